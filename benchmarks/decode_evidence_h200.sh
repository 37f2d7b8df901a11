#!/usr/bin/env bash
# One device call on the H200: a fresh table at this commit, then the decode evidence that needs it.
#
#   COMMIT=<sha> bash benchmarks/decode_evidence_h200.sh     (run from the repository root, $OUT set)
#
# Steps, most needed first, each under its own time limit; after each one the results so far are
# packed into $OUT/evidence.tgz (a step cut by the device's limit still leaves the earlier ones):
#  1. GEMV + elementwise table, Qwen3.5-27B, M=1,2,4,8, Triton + HIP: resumes the trials of
#     benchmarks/results/h200-m1248-all-d75e409 (the GEMV and elementwise kernel sources are unchanged
#     since; only new kernel files were added) and re-measures every final at this commit;
#  2. per-call dispatch overhead (benchmarks/dispatch_overhead.py) with that table;
#  3. tunekit check-serving: patched HF Qwen3.5 (27B sizes, 4 layers), eager and graphed;
#  4. the fused families (norm -> GEMV, SiLU-and-mul -> down_proj) at M=1, Triton;
#  5. tunekit chain, 64 layers, M=1: vendor / tuned / tuned_fused.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=results
mkdir -p "$R" runs/main runs/fused
echo "${COMMIT:-unknown}" > "$R/commit.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$R/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$R/gpu.txt"
pack() {
  for d in main fused; do
    mkdir -p "$R/$d"
    for f in table.json final.csv run.json trials.csv; do
      [ -f "runs/$d/$f" ] && cp "runs/$d/$f" "$R/$d/"
    done
  done
  tar czf "$OUT/evidence.tgz" "$R"
}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "$name: rc $? in $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
  pack
}

cp benchmarks/results/h200-m1248-all-d75e409/optuna.db runs/main/
step search_main 200 python3 -m tunekit search --model qwen3.5-27b --trials 3 --out runs/main --no-progress
step dispatch 60 python3 benchmarks/dispatch_overhead.py --table runs/main/table.json --out "$R/dispatch.json"
step check_serving 150 python3 -m tunekit check-serving --model qwen3.5-27b --table runs/main/table.json \
  --layers 4 --steps 16 --iters 10 --rounds 5 --skip-ops --out "$R/check"
step search_fused 150 python3 -m tunekit search --model qwen3.5-27b --ops fused_gemv --m 1 --backend triton \
  --trials 5 --out runs/fused --no-progress
step chain 120 python3 -m tunekit chain --model qwen3.5-27b --table runs/main/table.json \
  --table runs/fused/table.json --m 1 --out "$R/chain"
tail -n 3 "$R"/*.log
cat "$R/steps.txt"
