#!/usr/bin/env bash
# Folded norms with joined siblings served, on the lent H200: vanilla vs folded vLLM 0.26.0, Qwen3.5-27B,
# batch 1 (folded = the tables + TUNEKIT_FOLD_NORMS=1; the sibling merge is on by default, so each
# Gated DeltaNet's in_proj_qkvz + in_proj_ba run as one rms_gemv of 16480 rows where the fused table
# holds it). Carry the vLLM bundle first, one part per call (benchmarks/serve_h200.sh carry), then
# rerun this until it exits 0 (serve-bench resumes):
#
#   COMMIT=<sha> bash benchmarks/serve_merge_h200.sh SECONDS   # SECONDS: serve-bench's --stop-after
#
# 1. Once per machine (/var/tmp/merge-tab, kept while it stays warm): the main table is the one
#    h200-serve-fold-8031457 searched (same kernel sources: its stamp is checked at load); the fused
#    table (gemv_add, rms_gemv at M=1, 20 trials) is searched here, seeded from that run's fused trials;
#    then tunekit chain M=1 on both tables.
# 2. tunekit serve-bench --arms vanilla,folded, three processes per arm, in /var/tmp/serve-merge;
#    $OUT/serve-merge.tgz holds it, the tables and the chain after every call.
set -euo pipefail
limit=${1:-300}
tab=/var/tmp/merge-tab
prev=benchmarks/results/h200-serve-fold-8031457/table
if [ ! -f "$tab/fused/table.json" ]; then
  mkdir -p "$tab/main"
  cp "$prev/main/table.json" "$tab/main/"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$tab/gpu.txt" || true
  echo "${COMMIT:-unknown}" > "$tab/commit.txt"
  bash benchmarks/serve_h200.sh search "$tab/fused" --model qwen3.5-27b --ops gemv_add,rms_gemv --m 1 \
    --backend triton --trials 20 --timeout 150 --seed-from "$prev/fused/trials.csv" 2>&1 | tee "$tab/search_fused.log"
  python3 -m tunekit chain --model qwen3.5-27b --table "$tab/main/table.json" --table "$tab/fused/table.json" \
    --m 1 --out "$tab/chain" 2>&1 | tee "$tab/chain.log" || true
fi
rc=0
bash benchmarks/serve_h200.sh serve "$limit" --model qwen3.5-27b --table "$tab/main/table.json" \
  --table "$tab/fused/table.json" --arms vanilla,folded --batch 1 --tokens 128 --prompt-len 64 \
  --repeats 3 --processes 3 --out /var/tmp/serve-merge || rc=$?
tar czf "$OUT/serve-merge.tgz" -C /var/tmp serve-merge merge-tab
exit "$rc"
