#!/usr/bin/env bash
# Set up tunekit on a fresh Debian machine, with or without a GPU:
#  - Debian's hipcc + HIP headers + ROCm device libs, so the HIP kernels can be
#    compiled for AMD targets (gfx906/gfx90a/gfx940) even without an AMD GPU;
#  - PyTorch, if none is installed (2.13.0; on the CPU machines of this project
#    pip takes its CPU build from the local wheel cache);
#  - tunekit itself (editable) with the test and NVRTC extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && ! command -v hipcc >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc libamdhip64-dev rocm-device-libs >/dev/null
fi

if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[test,nvrtc]"
