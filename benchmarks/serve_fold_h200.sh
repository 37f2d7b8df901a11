#!/usr/bin/env bash
# The folded norms served, on the lent H200: vanilla vs tuned vs folded vLLM 0.26.0, Qwen3.5-27B, batch 1.
# First carry the vLLM bundle, one part per call (benchmarks/serve_h200.sh carry; the parts of
# `PART_SIZE=20m shared/device/vllm/build-carry.sh`, each within a call's 64 MiB with the working tree),
# the last part with SHA256SUMS and .whl. Then rerun this until it exits 0 (serve-bench resumes):
#
#   COMMIT=<sha> bash benchmarks/serve_fold_h200.sh SECONDS   # SECONDS: serve-bench's --stop-after
#
# 1. The tables, once per machine (/var/tmp/fold-tab, kept while it stays warm): evidence_h200.sh's
#    search_main (GEMV + elementwise, M=1, resumed on the storage of h200-m1248-all-d75e409) and
#    search_fused with FUSED_OPS=gemv_add,rms_gemv (the folded consumers and the residual add's GEMVs).
# 2. tunekit serve-bench --arms vanilla,tuned,folded (folded = tuned + TUNEKIT_FOLD_NORMS=1) with both
#    tables, in /var/tmp/serve-fold; $OUT/serve-fold.tgz holds it and the tables after every call.
set -euo pipefail
limit=${1:-300}
tab=/var/tmp/fold-tab
if [ ! -f "$tab/fused/table.json" ]; then
  STEPS="search_main search_fused" MAIN_M=1 FUSED_OPS=gemv_add,rms_gemv bash benchmarks/evidence_h200.sh
  mkdir -p "$tab"
  cp -r runs/main runs/fused "$tab/"
  cp -r results "$tab/search-results"
fi
rc=0
bash benchmarks/serve_h200.sh serve "$limit" --model qwen3.5-27b --table "$tab/main/table.json" \
  --table "$tab/fused/table.json" --arms vanilla,tuned,folded --batch 1 --tokens 128 --prompt-len 64 \
  --repeats 3 --processes 2 --out /var/tmp/serve-fold || rc=$?
tar czf "$OUT/serve-fold.tgz" -C /var/tmp serve-fold fold-tab
exit "$rc"
