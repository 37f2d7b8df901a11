#!/usr/bin/env bash
# Set up tunekit on a fresh Debian machine, with or without a GPU:
#  - Debian's hipcc + HIP headers + ROCm device libs, so the HIP kernels can be
#    compiled for AMD targets (gfx906/gfx90a/gfx940) even without an AMD GPU;
#  - PyTorch, if none is installed (2.13.0; on the CPU machines of this project
#    pip takes its CPU build from the local wheel cache);
#  - tunekit itself (editable) with the test, NVRTC and Hugging Face extras;
#  - vLLM 0.33.0 in its own virtualenv outside the clone (it pins torch 2.14,
#    ~9.4 GB, ~8 minutes from PyPI on a fresh machine), made once per machine
#    and reused, with tunekit installed into it: tests/test_vllm_plugin.py runs
#    the plugin's tests there. TUNEKIT_VLLM_VENV moves it; TUNEKIT_SKIP_VLLM=1
#    skips it (that test is then skipped).
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && ! command -v hipcc >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc libamdhip64-dev rocm-device-libs >/dev/null
fi

if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[test,nvrtc,hf]"

VLLM_VENV="${TUNEKIT_VLLM_VENV:-$HOME/.cache/tunekit/vllm-venv}"
if [ "${TUNEKIT_SKIP_VLLM:-0}" != 1 ]; then
  has_vllm() {
    "$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"' >/dev/null 2>&1
  }
  if ! has_vllm; then
    echo "setup: creating the vLLM 0.33.0 virtualenv at $VLLM_VENV (once per machine, ~8 min)"
    mkdir -p "$(dirname "$VLLM_VENV")"
    if ! { python -m venv "$VLLM_VENV" && "$VLLM_VENV/bin/python" -m pip install -q "vllm==0.33.0" pytest; }; then
      # Not fatal: without it only the vLLM tier is skipped (and says why).
      echo "setup: warning: the vLLM virtualenv could not be made; tests/test_vllm_plugin.py will be skipped" >&2
      rm -rf "$VLLM_VENV"
    fi
  fi
  if has_vllm; then
    # Editable, so its entry point (vllm.general_plugins) and code follow this clone.
    "$VLLM_VENV/bin/python" -m pip install -q pytest
    "$VLLM_VENV/bin/python" -m pip install -q --no-deps -e .
  fi
fi
