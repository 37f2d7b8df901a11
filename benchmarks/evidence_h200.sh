#!/usr/bin/env bash
# Device calls on the H200 for the serving and fusion evidence: each call runs the STEPS it is given.
#
#   COMMIT=<sha> STEPS="search_main dispatch search_fused chain" bash benchmarks/evidence_h200.sh
#   COMMIT=<sha> STEPS="search_hf check_serving" PREV=<an earlier call's results dir> bash benchmarks/evidence_h200.sh
#
# Run from the repository root there, $OUT set. Each step has its own time limit; after each one the
# results so far are packed into $OUT/evidence.tgz (a step cut by the device's limit leaves the
# earlier ones). Steps:
#  search_main    GEMV + elementwise table, Qwen3.5-27B, M=1,2,4,8, Triton + HIP: resumes the trials
#                 of benchmarks/results/h200-m1248-all-d75e409 and re-measures every final here
#                 (the kernel sources changed since, so no earlier table serves this commit);
#  dispatch       per-call overhead (benchmarks/dispatch_overhead.py), the torch op and the patched
#                 module, eager, with that table;
#  search_fused   the fused families at M=1 (norm -> GEMV, SiLU-and-mul -> down_proj, the residual
#                 epilogue gemv_add, the folded norm rms_gemv, SiLU-and-mul in gate_up's epilogue), Triton,
#                 seeded with the GEMV winners of the main table (--seed-from);
#  chain          tunekit chain, 64 layers, M=1: vendor / tuned_gemv / tuned / tuned_fused (gemv_add
#                 where it and the plain norm it leaves beat the GEMV and the fused add + norm);
#  search_hf      the Hugging Face model's own shapes (separate q/k/v, gate/up; its norms in the
#                 layout HF calls them), benchmarks/serving_check.py --print-shapes, seeded likewise;
#  check_serving  tunekit check-serving, patched HF Qwen3.5 (27B sizes, 4 layers), eager and
#                 graphed, with the main table and the HF tables, siblings not merged;
#  search_hf_fold rms_gemv for every linear a folded HF decoder norm feeds (--print-shapes --only
#                 rms_gemv), M=1, seeded with the HF GEMV table;
#  check_serving_fold  check_serving with that table too and --fold-norms;
#  search_hf_norms the norms part of search_hf only (what --merge-siblings needs beyond the main table);
#  check_serving_merge check_serving with --merge-siblings: HF's q/k/v, gate/up, qkv/z and b/a run as
#                 vLLM's merged GEMVs, served by the main table (and the HF norms' table);
#  check_serving_main  the same tables without --merge-siblings (what the merge adds, in the same call).
# PREV: an earlier call's results (its main/, fused/, hf-gemv/, hf-norms/ tables stand in for the
# searches not run; runs/ is emptied first, as a machine still warm from an earlier call keeps it). FUSED_M: the fused families' M (default 1);
# FUSED_OPS: the --ops of search_fused (default fused_gemv, every family); FUSED_TRIALS its trials (20).
# MAIN_M: the Ms of search_main (default 1,2,4,8); MAIN_TRIALS its trials (3, on top of the resumed ones);
# MAIN_BACKEND: its one backend (default: all).
# MODEL: the model of search_main and of the check_serving steps (default qwen3.5-27b; the fused families,
# the chain and the HF shape searches are Qwen3.5-27B's). Only Qwen3.5-27B's search resumes earlier trials.
# SEED_FUSED / SEED_HF_GEMV / SEED_HF_NORMS: extra --seed-from files (an earlier call's trials.csv).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=results
# A machine still warm from an earlier call keeps its working tree's ignored files: start from nothing
# (a resumed search refuses a trials.csv that another storage wrote; a table left there would serve).
rm -rf "$R" runs/main runs/fused runs/hf-gemv runs/hf-norms runs/hf-fold
mkdir -p "$R" runs/main runs/fused runs/hf-gemv runs/hf-norms runs/hf-fold
echo "${COMMIT:-unknown}" > "$R/commit.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$R/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$R/gpu.txt"
wanted() { case " ${STEPS:-} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
for d in main fused hf-gemv hf-norms hf-fold; do
  if [ "$d" = fused ] && wanted search_fused; then continue; fi  # searched afresh in this call
  if [ -n "${PREV:-}" ] && [ -f "$PREV/$d/table.json" ] && [ ! -f "runs/$d/table.json" ]; then
    cp "$PREV/$d/table.json" "runs/$d/table.json"
  fi
done
pack() {
  for d in main fused hf-gemv hf-norms hf-fold; do
    mkdir -p "$R/$d"
    for f in table.json final.csv run.json trials.csv; do
      [ -f "runs/$d/$f" ] && cp "runs/$d/$f" "$R/$d/"
    done
  done
  tar czf "$OUT/evidence.tgz" "$R"
}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "$name: rc $? in $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
  pack
}
# the Hugging Face shapes (the --shape arguments are meant to split)
seeds() { for f in "$@"; do [ -n "$f" ] && printf -- '--seed-from %s ' "$f"; done; }
search_hf_norms="python3 -m tunekit search \$(python3 benchmarks/serving_check.py --print-shapes --only norms) \
    --m \$(python3 benchmarks/serving_check.py --print-m) --backend triton --trials 6 $(seeds "${SEED_HF_NORMS:-}") \
    --out runs/hf-norms --no-progress"
search_hf="python3 -m tunekit search \$(python3 benchmarks/serving_check.py --print-shapes --only gemv) --m 1 \
    --backend triton --trials 8 $(seeds runs/main/table.json "${SEED_HF_GEMV:-}") --out runs/hf-gemv --no-progress &&
  $search_hf_norms"

MODEL=${MODEL:-qwen3.5-27b}
if wanted search_main && [ "$MODEL" = qwen3.5-27b ]; then
  cp benchmarks/results/h200-m1248-all-d75e409/optuna.db runs/main/
fi
step search_main 200 python3 -m tunekit search --model "$MODEL" --m "${MAIN_M:-1,2,4,8}" --trials "${MAIN_TRIALS:-3}" \
  ${MAIN_BACKEND:+--backend "$MAIN_BACKEND"} --out runs/main --no-progress
step dispatch 100 python3 benchmarks/dispatch_overhead.py --table runs/main/table.json --calls 500 --repeats 5 \
  --out "$R/dispatch.json"
step search_fused 380 python3 -m tunekit search --model qwen3.5-27b --ops "${FUSED_OPS:-fused_gemv}" --m "${FUSED_M:-1}" --backend triton \
  --trials "${FUSED_TRIALS:-20}" $(seeds runs/main/table.json "${SEED_FUSED:-}") --out runs/fused --no-progress
step chain 200 python3 -m tunekit chain --model qwen3.5-27b --table runs/main/table.json \
  --table runs/fused/table.json --m "${FUSED_M:-1}" --out "$R/chain"
step search_hf 300 bash -c "$search_hf"
step check_serving 200 python3 -m tunekit check-serving --model qwen3.5-27b --table runs/main/table.json \
  --table runs/hf-gemv/table.json --table runs/hf-norms/table.json --no-merge-siblings \
  --layers 4 --steps 16 --iters 20 --rounds 9 --skip-ops --out "$R/check"
step search_hf_fold 200 bash -c "python3 -m tunekit search \$(python3 benchmarks/serving_check.py --print-shapes \
  --only rms_gemv) --m 1 --backend triton --trials 8 --seed-from runs/hf-gemv/table.json --out runs/hf-fold --no-progress"
step check_serving_fold 200 python3 -m tunekit check-serving --model qwen3.5-27b --table runs/main/table.json \
  --table runs/hf-gemv/table.json --table runs/hf-norms/table.json --table runs/hf-fold/table.json --fold-norms \
  --no-merge-siblings \
  --layers 4 --steps 16 --iters 20 --rounds 9 --skip-ops --out "$R/check-fold"
step search_hf_norms 150 bash -c "$search_hf_norms"
hf_norms=$([ -f runs/hf-norms/table.json ] && echo "--table runs/hf-norms/table.json")  # Llama's norm: in main
step check_serving_merge 200 python3 -m tunekit check-serving --model "$MODEL" --table runs/main/table.json \
  $hf_norms --merge-siblings \
  --layers 4 --steps 16 --iters 20 --rounds 9 --skip-ops --out "$R/check-merge"
step check_serving_main 200 python3 -m tunekit check-serving --model "$MODEL" --table runs/main/table.json \
  $hf_norms --no-merge-siblings --layers 4 --steps 16 --iters 20 --rounds 9 --skip-ops --out "$R/check-main"
tail -n 3 "$R"/*.log
cat "$R/steps.txt"
