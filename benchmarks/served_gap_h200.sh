#!/usr/bin/env bash
# Where a served decode step's GEMV time goes beyond the tables' standalone figures, on the lent H200.
# Served in vLLM 0.26.0 the folded arm's tunekit GEMVs took about 235 us per step more than their table
# entries add up to, while `tunekit chain` on the same tables measured what they predict. Both are read
# here with the same profiler and the same key (launch shape and the kernel before it, `by_launch`),
# on the tables of h200-serve-merge-df17426 (main M=1 of 8031457 + fused M=1 of df17426), with the
# GPU's clocks, temperatures and power sampled every 0.5 s.
#
#   bash benchmarks/served_gap_h200.sh chain          # tunekit chain --profile-replays 5 at M=1 -> $OUT/chain
#                                                     # (a carried bundle part is kept, as `carry` does)
#   bash benchmarks/served_gap_h200.sh serve SECONDS  # serve-bench vanilla,folded at batch 1, one process
#                                                     # per arm with --profile-steps 8; rerun until it
#                                                     # exits 0 (resumes /var/tmp/serve-gap)
#   bash benchmarks/served_gap_h200.sh evict-ab hint|nohint SECONDS
#                                                     # serve-bench vanilla,folded on the fused table with or
#                                                     # without the W eviction hint (64 layers; resumes
#                                                     # /var/tmp/evict-ab/VARIANT)
#   bash benchmarks/served_gap_h200.sh fixed SECONDS  # the fused table searched with W_EVICT fixed to no hint
#                                                     # (seeded with df17426's and tab-noevict's trials), then
#                                                     # serve-bench vanilla,folded at batch 1, one process
#                                                     # per arm (resumes /var/tmp/fixed)
#   bash benchmarks/served_gap_h200.sh confirm SECONDS
#                                                     # serve-bench vanilla,folded at batch 1 on the tables of
#                                                     # h200-serve-noevict-a986fd9, two processes per arm
#                                                     # (rerun until it exits 0; resumes /var/tmp/confirm)
#   bash benchmarks/served_gap_h200.sh pressure       # memory_pressure_probe.py: the tables' M=1 GEMVs on an
#                                                     # empty GPU against one filled to 12 GiB free
# Carry the vLLM bundle first (benchmarks/serve_h200.sh carry, one part per call); the last part travels
# with SHA256SUMS and .whl on the first serve call.
set -euo pipefail
res=benchmarks/results
main=$res/h200-serve-fold-8031457/table/main/table.json
fused=$res/h200-serve-merge-df17426/table/table.json
query=timestamp,clocks.sm,clocks.mem,temperature.gpu,temperature.memory,power.draw,utilization.gpu

# serve-bench vanilla against folded at batch 1 on the main table and FUSED_TABLE, 8 decode steps profiled
serve_ab() {  # LIMIT FUSED_TABLE PROCESSES OUT
  bash benchmarks/serve_h200.sh serve "$1" --model qwen3.5-27b --table "$main" --table "$2" \
    --arms vanilla,folded --batch 1 --tokens 128 --prompt-len 64 --repeats 3 --processes "$3" \
    --profile-steps 8 --out "$4"
}
case ${1:-} in
  chain)
    bash benchmarks/serve_h200.sh carry
    mkdir -p "$OUT/chain"
    nvidia-smi --query-gpu=$query --format=csv -lms 500 >"$OUT/chain/smi.csv" 2>/dev/null &
    smi=$!
    rc=0
    python3 -m tunekit chain --model qwen3.5-27b --table "$main" --table "$fused" --m 1 --profile-replays 5 \
      --out "$OUT/chain" >"$OUT/chain/chain.log" 2>&1 || rc=$?
    kill "$smi" || true
    tail -n 12 "$OUT/chain/chain.log"
    exit "$rc"
    ;;
  serve)
    limit=$2
    out=/var/tmp/serve-gap
    mkdir -p "$out"
    n=$(find "$out" -maxdepth 1 -name 'smi-*.csv' | wc -l)
    nvidia-smi --query-gpu=$query --format=csv -lms 500 >"$out/smi-$n.csv" 2>/dev/null &
    smi=$!
    rc=0
    serve_ab "$limit" "$fused" 1 "$out" || rc=$?
    kill "$smi" || true
    git rev-parse HEAD >"$out/commit.txt" 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >"$out/gpu.txt" || true
    tar czf "$OUT/serve-gap.tgz" -C /var/tmp serve-gap
    exit "$rc"
    ;;
  insitu)
    # the same A/B with every tuned kernel of the folded process also timed standalone inside that process
    # (TUNEKIT_PROFILE_KERNELS=1: profile.in_process_kernel_times), then the chain profiled again on the
    # warm GPU; rerun until it exits 0 (resumes /var/tmp/serve-kern)
    limit=$2
    out=/var/tmp/serve-kern
    mkdir -p "$out"
    rc=0
    TUNEKIT_PROFILE_KERNELS=1 serve_ab "$limit" "$fused" 1 "$out" || rc=$?
    if [ "$rc" = 0 ] && [ ! -f "$out/chain-after/chain.json" ]; then
      python3 -m tunekit chain --model qwen3.5-27b --table "$main" --table "$fused" --m 1 --profile-replays 5 \
        --out "$out/chain-after" >"$out/chain-after.log" 2>&1 || rc=$?
      tail -n 4 "$out/chain-after.log"
    fi
    git rev-parse HEAD >"$out/commit.txt" 2>/dev/null || true
    tar czf "$OUT/serve-kern.tgz" -C /var/tmp serve-kern
    exit "$rc"
    ;;
  noevict-search)
    # the fused table searched again with no L2 eviction hint on W (W_EVICT=""), seeded with df17426's
    # trials; the served step's L2 holds the token mixers' state, the chain's does not
    bash benchmarks/serve_h200.sh carry >/dev/null
    bash benchmarks/serve_h200.sh search /var/tmp/tab-noevict --model qwen3.5-27b --ops rms_gemv,gemv_add --m 1 \
      --backend triton --trials 8 --timeout 60 --restrict W_EVICT= \
      --seed-from "$res/h200-serve-merge-df17426/table/trials.csv" >/var/tmp/tab-noevict.log 2>&1 || rc=$?
    mkdir -p "$OUT/tab-noevict"
    cp /var/tmp/tab-noevict.log /var/tmp/tab-noevict/table.json /var/tmp/tab-noevict/final.csv "$OUT/tab-noevict/" || true
    tail -n 5 /var/tmp/tab-noevict.log
    exit "${rc:-0}"
    ;;
  evict-ab)
    # the folded arm with the W eviction hint (df17426's fused table) or without it (tab-noevict, searched by
    # noevict-search in call3-abf0b0d), each against its own vanilla, all 64 layers, in one lease;
    # rerun until it exits 0 (resumes /var/tmp/evict-ab/VARIANT)
    variant=$2 limit=$3
    case $variant in
      hint) fused_table=$fused ;;
      nohint) fused_table=$res/h200-served-gap-ad3a8ee/call3-abf0b0d/tab-noevict/table.json ;;
      *) echo "evict-ab takes hint or nohint" >&2; exit 2 ;;
    esac
    out=/var/tmp/evict-ab/$variant
    mkdir -p "$out"
    rc=0
    serve_ab "$limit" "$fused_table" 1 "$out" || rc=$?
    git rev-parse HEAD >"$out/commit.txt" 2>/dev/null || true
    tar czf "$OUT/evict-ab-$variant.tgz" -C /var/tmp/evict-ab "$variant"
    exit "$rc"
    ;;
  fixed)
    # the spaces of 5d667ff no longer search W_EVICT: the seeds recorded with the hint keep their tiles
    limit=$2
    out=/var/tmp/fixed
    mkdir -p "$out"
    rc=0
    if [ ! -f "$out/tab/table.json" ]; then
      bash benchmarks/serve_h200.sh search "$out/tab" --model qwen3.5-27b --ops rms_gemv,gemv_add --m 1 \
        --backend triton --trials 12 --timeout 150 --seed-from "$res/h200-serve-merge-df17426/table/trials.csv" \
        --seed-from "$res/h200-served-gap-ad3a8ee/call3-abf0b0d/tab-noevict/table.json" >"$out/search.log" 2>&1 || rc=$?
      tail -n 20 "$out/search.log"
    fi
    left=$((limit - SECONDS))  # the search's time comes out of this call's limit
    if [ "$rc" = 0 ] && [ "$left" -lt 60 ]; then
      echo "fixed: ${left} s left after the search; rerun to serve" >&2
      rc=3
    fi
    if [ "$rc" = 0 ]; then
      serve_ab "$left" "$out/tab/table.json" 1 "$out/serve" || rc=$?
    fi
    git rev-parse HEAD >"$out/commit.txt" 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >"$out/gpu.txt" || true
    tar czf "$OUT/fixed.tgz" -C /var/tmp fixed
    exit "$rc"
    ;;
  confirm)
    # the 1.1497x of h200-serve-noevict-a986fd9 came from one process per arm, whose spread is ~0.4%:
    # the same two tables served again with more processes, arms alternated
    limit=$2
    out=/var/tmp/confirm
    mkdir -p "$out"
    rc=0
    serve_ab "$limit" "$res/h200-serve-noevict-a986fd9/tab/table.json" 2 "$out" || rc=$?
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >"$out/gpu.txt" || true
    tar czf "$OUT/confirm.tgz" -C /var/tmp confirm
    exit "$rc"
    ;;
  pressure)
    # benchmarks/memory_pressure_probe.py on the served tables' M=1 GEMVs (a carried bundle part is kept)
    bash benchmarks/serve_h200.sh carry >/dev/null
    python3 benchmarks/memory_pressure_probe.py --table "$main" --table "$fused" --out "$OUT/pressure" \
      2>&1 | tee "$OUT/pressure.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *) echo "usage: $0 chain | serve SECONDS | insitu SECONDS | noevict-search | evict-ab hint|nohint SECONDS | fixed SECONDS | confirm SECONDS | pressure" >&2; exit 2 ;;
esac
