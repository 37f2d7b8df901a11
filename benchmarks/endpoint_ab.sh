#!/usr/bin/env bash
# The served A/B against real `vllm serve` processes: a vanilla server (tunekit's plugin left out of
# VLLM_PLUGINS) and a tuned one (plugin + TUNEKIT_TABLE) side by side on one GPU, then
# `tunekit serve-bench --endpoint` against both; the servers are stopped at the end (SIGINT: each
# process writes its TUNEKIT_DISPATCH_LOG at exit, the forked engine core on multiprocessing's exit
# path; --shutdown-timeout, where vLLM has it, lets it drain first) and `serve-bench --report-only`
# adds the tuned server's dispatch coverage.
#
#   benchmarks/endpoint_ab.sh PYTHON MODEL_DIR TABLE OUT_DIR [vllm serve options...]
#
# PYTHON: the interpreter with vLLM (and tunekit importable); MODEL_DIR: a folder with config.json
# (dummy weights, no tokenizer: `tunekit serve-bench --model NAME` writes one under OUT/model);
# SERVE_BENCH_ARGS: extra serve-bench options (default: --concurrency 1,8 --tokens 128 --repeats 5);
# SHUTDOWN_TIMEOUT: seconds a stopping server drains (default 30, where vLLM has --shutdown-timeout);
# GPU_SHARE: each server's --gpu-memory-utilization (default 0.4: an 8B model; Qwen3.5-27B holds 50 GiB
# of weights, so two of its servers need about 0.47 each on a 140 GB GPU, not yet tried); START_TIMEOUT: seconds to wait
# for both servers (default 900); PORT: the vanilla server's port (tuned: PORT + 1; default 8100).
set -euo pipefail
python=$1 model_dir=$2 table=$3 out=$4
shift 4
port=${PORT:-8100}
mkdir -p "$out/logs" "$out/dispatch"
out=$(cd "$out" && pwd)
# vLLM's allow-list of general plugins: every installed one but tunekit (vanilla), or all (tuned)
others=$("$python" -c "from importlib.metadata import entry_points
print(','.join(sorted({e.name for e in entry_points(group='vllm.general_plugins')} - {'tunekit'})))")
serve() {  # serve ARM PORT [ENV=VALUE...]
  local arm=$1 p=$2
  shift 2
  env "$@" setsid "$python" -m vllm.entrypoints.cli.main serve "$model_dir" --port "$p" --host 127.0.0.1 \
    --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 1024 --max-num-seqs 8 \
    --gpu-memory-utilization "${GPU_SHARE:-0.4}" --no-enable-prefix-caching "${serve_args[@]}" \
    >"$out/logs/$arm.log" 2>&1 &
  echo $!
}
serve_args=("$@")
# vLLM's drain mode (0.26's --shutdown-timeout): the engine core finishes its requests and leaves its
# busy loop before the server exits (a core killed instead writes no dispatch log)
if "$python" -c "import dataclasses, sys
from vllm.engine.arg_utils import EngineArgs
sys.exit(0 if 'shutdown_timeout' in {f.name for f in dataclasses.fields(EngineArgs)} else 1)" 2>/dev/null; then
  serve_args=(--shutdown-timeout "${SHUTDOWN_TIMEOUT:-30}" "${serve_args[@]}")
fi
pids=()
stop() {
  for pid in "${pids[@]}"; do kill -INT -- "-$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
}
trap stop EXIT
t0=$SECONDS
wait_up() {  # wait_up PORT ARM: until the server answers; fails if it exits or START_TIMEOUT passes
  local p=$1 arm=$2
  until "$python" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$p/v1/models', timeout=5)" 2>/dev/null; do
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "a server exited before it answered; its log:" >&2; tail -n 30 "$out/logs/$arm.log" >&2; exit 1; }
    done
    if ((SECONDS - t0 > ${START_TIMEOUT:-900})); then echo "servers not up after ${START_TIMEOUT:-900} s" >&2; exit 1; fi
    sleep 5
  done
  echo "$arm server on port $p up after $((SECONDS - t0)) s"
}
# One after the other: vLLM sizes its KV cache from the memory it sees used while it profiles, so two
# servers starting together on one GPU can count each other's allocations ("No available memory for
# the cache blocks", seen on the H200).
pids+=("$(serve vanilla "$port" VLLM_PLUGINS="$others")")
wait_up "$port" vanilla
pids+=("$(serve tuned $((port + 1)) VLLM_PLUGINS="${others:+$others,}tunekit" TUNEKIT_TABLE="$table" \
  TUNEKIT_DISPATCH_LOG="$out/dispatch/tuned-{pid}.json")")
wait_up $((port + 1)) tuned
# shellcheck disable=SC2086  # SERVE_BENCH_ARGS is a list of options
"$python" -m tunekit serve-bench --endpoint "vanilla=http://127.0.0.1:$port" \
  --endpoint "tuned=http://127.0.0.1:$((port + 1))" --table "$table" --out "$out" \
  ${SERVE_BENCH_ARGS:---concurrency 1,8 --tokens 128 --repeats 5}
# the servers write their dispatch logs as they stop; then the report gains the tuned server's coverage
stop
trap - EXIT
"$python" -m tunekit serve-bench --report-only --out "$out"
