#!/usr/bin/env bash
# The served A/B on the lent H200 (no network; vLLM 0.26.0 carried as a bundle built by
# shared/device/vllm/build-carry.sh in parts small enough to travel one per call with the working tree
# within a call's 64 MiB: PART_SIZE=20m (nine parts) for the 42 MiB tree of 8031457, 30m (six) when it
# was 32 MiB, 16m (eleven) for the 44 MiB tree of df17426, where 20m parts were refused; parts re-split
# from the whole .tgz with `split -b 16m -a 1 vllm026-site.tgz vllm026-site.tgz.part-0` keep the
# part-0? names this script reads. The last part travels with SHA256SUMS, .whl and the real command.
# A carry call takes seconds on a warm machine; the next must start within 30 s of it).
# Run from the repository root there; /var/tmp persists between calls while the machine stays warm,
# and has outlived a session: give every run a fresh --out / OUT (serve-bench resumes a folder).
#
#   benchmarks/serve_h200.sh carry                 copy the bundle parts this call carried to /var/tmp/vl
#   benchmarks/serve_h200.sh search OUT ARGS       tunekit search ARGS --out OUT (optuna from .whl); also
#                                                  copies the carried parts, so a part can travel with it
#   benchmarks/serve_h200.sh table  RESULT_DIR     re-measure a carried search (RESULT_DIR/optuna.db:
#                                                  its studies are complete, so only the final
#                                                  interleaved re-measure runs) -> /var/tmp/tab/table.json
#   benchmarks/serve_h200.sh serve  SECONDS ARGS   tunekit serve-bench ARGS --stop-after SECONDS
#                                                  (rerun until it exits 0; it resumes)
#   benchmarks/serve_h200.sh endpoint MODEL TABLE OUT [vllm serve options]
#                                                  benchmarks/endpoint_ab.sh: `vllm serve` vanilla and
#                                                  tuned side by side, serve-bench --endpoint against both
#                                                  (MODEL: a built-in name, its config written to OUT/model)
# `vllm serve` needs seven small wheels the bundle lacks (benchmarks/serve_wheels.txt); fetch them here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --require-hashes -r benchmarks/serve_wheels.txt -d .vllm-carry/serve-wheels
# and carry .vllm-carry/serve-wheels with the call.
# The serve mode first unpacks the bundle once (every part checked against SHA256SUMS, which travels
# with the last part) and makes the tunekit entry point visible to vLLM from this checkout.
set -euo pipefail
vl=/var/tmp/vl
mkdir -p "$vl"
cp .vllm-carry/*.part-0? .vllm-carry/SHA256SUMS "$vl/" 2>/dev/null || true

optuna_site() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /var/tmp/optuna-site .whl/*.whl
  fi
}

unpack_vllm() {
  if [ ! -d "$vl/site/vllm" ]; then
    mkdir -p "$vl/site"
    (cd "$vl" && sha256sum -c --ignore-missing SHA256SUMS >/dev/null &&
      test "$(cat ./*.part-0? | sha256sum | cut -c1-64)" = "$(grep ' vllm026-site.tgz$' SHA256SUMS | cut -c1-64)")
    cat "$vl"/*.part-0? | tar -xzf - -C "$vl/site"
  fi
  # tunekit runs from this checkout; vLLM finds its plugin through a two-file dist-info
  local d=$vl/site/tunekit-0.1.0.dist-info
  mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: tunekit\nVersion: 0.1.0\n' >"$d/METADATA"
  printf '[vllm.general_plugins]\ntunekit = tunekit.integrations.vllm.plugin:register\n' >"$d/entry_points.txt"
}

export PYTHONPATH=/var/tmp/optuna-site:$PWD PYTHONUNBUFFERED=1
mode=${1:-}; shift || true
case "$mode" in
  carry)
    ls -l "$vl"
    ;;
  search)
    out=$1; shift
    optuna_site
    mkdir -p "$out"
    python3 -m tunekit search "$@" --out "$out" --no-progress
    ;;
  table)
    src=$1
    optuna_site
    mkdir -p /var/tmp/tab
    [ -f /var/tmp/tab/optuna.db ] || cp "$src/optuna.db" /var/tmp/tab/
    # the command of the carried search (src/search.log's run), resumed on its storage
    python3 -m tunekit search --model qwen3.5-27b --m 1,2,4,8 \
      --ops gemv,rms_norm,fused_add_rms_norm,gated_rms_norm,silu_and_mul --backend triton,hip --trials 3 \
      --timeout 170 --out /var/tmp/tab --no-progress
    python3 -m tunekit show /var/tmp/tab/table.json --check | head -3
    ;;
  serve)
    limit=$1; shift
    optuna_site
    unpack_vllm
    export PYTHONPATH=/var/tmp/optuna-site:$vl/site:$PWD HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
    export VLLM_CACHE_ROOT=/var/tmp/vllm-cache # the compile cache outlives a call while the machine stays warm
    python3 -m tunekit serve-bench "$@" --stop-after "$limit"
    ;;
  endpoint)
    model=$1 table=$2 out=$3
    shift 3
    optuna_site
    unpack_vllm
    # the wheels travel with a call; a later call on the same machine reuses what the first installed
    if compgen -G ".vllm-carry/serve-wheels/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$vl/serve-site" \
        .vllm-carry/serve-wheels/*.whl
    elif [ ! -d "$vl/serve-site" ]; then
      echo "carry .vllm-carry/serve-wheels with this call: vllm serve needs them (see the header)" >&2
      exit 2
    fi
    export PYTHONPATH=/var/tmp/optuna-site:$vl/serve-site:$vl/site:$PWD HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
    export VLLM_CACHE_ROOT=/var/tmp/vllm-cache
    model_dir=$(python3 -c "import sys
from tunekit.evidence.serve_bench.bench import build_settings, write_model_dir
print(write_model_dir(sys.argv[2], build_settings(sys.argv[1], None, [], arms=['vanilla']).model_config))" "$model" "$out")
    SERVE_BENCH_ARGS="--model $model ${SERVE_BENCH_ARGS:---concurrency 1,8 --tokens 128 --repeats 5}" \
      bash benchmarks/endpoint_ab.sh python3 "$model_dir" "$table" "$out" "$@"
    ;;
  *) echo "usage: $0 carry | search OUT ARGS... | table RESULT_DIR | serve SECONDS ARGS... | endpoint MODEL TABLE OUT" >&2
     exit 2 ;;
esac
