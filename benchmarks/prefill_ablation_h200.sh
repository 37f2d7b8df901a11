#!/usr/bin/env bash
# Where the tuned arm's slower first token comes from: offline serve-bench A/Bs of the same model with
# tables cut down to one family each, on the lent H200 (run from the repository root there, after the
# vLLM bundle was carried: benchmarks/serve_h200.sh). One folder per table under OUT_ROOT:
#   full        the table as searched
#   gemv        its GEMV entries only
#   ew          its elementwise entries only
#   no-lmhead   everything but the lm_head's GEMV entries (vLLM computes logits outside its graph)
# Each A/B is vanilla against tuned, one process per arm, with --profile-steps (kernel, host-op and
# cProfile tables of a 1-token generate per arm). A rerun resumes every folder (serve-bench resumes);
# the whole run stops by itself at DEADLINE_S seconds.
#
#   benchmarks/prefill_ablation_h200.sh TABLE OUT_ROOT DEADLINE_S [serve-bench options, e.g. --layers 16]
#   MODEL: the built-in model (default qwen3.5-27b); CUTS: which tables, in order (default
#   "full gemv ew no-lmhead"): each A/B costs two engine starts, 165-190 s each for Qwen3.5-27B
set -euo pipefail
table=$1 root=$2 deadline=$3
shift 3
start=$SECONDS
mkdir -p "$root/tables"
python3 - "$table" "$root/tables" <<'PY'
import json, sys
from pathlib import Path
src, dest = json.load(open(sys.argv[1])), Path(sys.argv[2])
keep = {
    "full": lambda e: True,
    "gemv": lambda e: e["op"] == "gemv",
    "ew": lambda e: e["op"] != "gemv",
    "no-lmhead": lambda e: not (e["op"] == "gemv" and e["n"] >= 100000),
}
for name, pred in keep.items():
    doc = dict(src, entries=[e for e in src["entries"] if pred(e)])
    (dest / f"{name}.json").write_text(json.dumps(doc, indent=1))
    print(f"prefill-ablation: table {name}: {len(doc['entries'])} entries")
PY
for name in ${CUTS:-full gemv ew no-lmhead}; do
  [ -f "$root/tables/$name.json" ] || { echo "prefill-ablation: no cut named $name" >&2; exit 2; }
  left=$((deadline - (SECONDS - start) - 20))
  if [ "$left" -lt 60 ]; then
    echo "prefill-ablation: $name not started (${left} s left); rerun to resume"
    continue
  fi
  echo "prefill-ablation: $name (${left} s left)"
  bash benchmarks/serve_h200.sh serve "$left" --model "${MODEL:-qwen3.5-27b}" --table "$root/tables/$name.json" \
    --arms vanilla,tuned --out "$root/$name" "$@" || echo "prefill-ablation: $name stopped (rc $?)"
done
