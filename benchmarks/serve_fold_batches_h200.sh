#!/usr/bin/env bash
# The fold at batch sizes its fused table does not hold, on the lent H200: vanilla vs tuned vs folded
# vLLM 0.26.0, Qwen3.5-27B, batch 1, 2 and 8. The tables are those of a user who searched the main ops
# at M=1,2,4,8 and the fused ops at M=1 only, all stamped with the current kernel sources (checked at
# load):
#   main M=1      benchmarks/results/h200-serve-fold-8031457/table/main
#   main M=2,4,8  benchmarks/results/h200-chain-m248-b8efa4a/main
#   fused M=1     benchmarks/results/h200-serve-merge-df17426/table (gemv_add, rms_gemv)
# The plugin's compile ranges then end at 2 (the fused ops' largest M) and 8. Batch 8 runs in [3, 8],
# where the pass hands rms_gemv back as the norm around the tuned tunekit::gemv; batch 2 runs in
# [1, 2], above the fused entries, on their fallbacks (one norm launch and the tuned GEMV).
# Carry the vLLM bundle first, one part per call (benchmarks/serve_h200.sh carry), then rerun this
# until it exits 0 (serve-bench resumes in /var/tmp/serve-fb; $OUT/serve-fb.tgz after every call):
#
#   bash benchmarks/serve_fold_batches_h200.sh SECONDS   # SECONDS: serve-bench's --stop-after
set -euo pipefail
limit=${1:-300}
res=benchmarks/results
rc=0
bash benchmarks/serve_h200.sh serve "$limit" --model qwen3.5-27b \
  --table "$res/h200-serve-fold-8031457/table/main/table.json" \
  --table "$res/h200-chain-m248-b8efa4a/main/table.json" \
  --table "$res/h200-serve-merge-df17426/table/table.json" \
  --arms vanilla,tuned,folded --batch 1,2,8 --tokens 128 --prompt-len 64 \
  --repeats 3 --processes 2 --out /var/tmp/serve-fb || rc=$?
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > /var/tmp/serve-fb/gpu.txt || true
tar czf "$OUT/serve-fb.tgz" -C /var/tmp serve-fb
exit "$rc"
