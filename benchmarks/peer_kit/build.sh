#!/usr/bin/env bash
# Builds the peer kit for the lent GPU (README.md beside this file): the pinned wheels of wheels.txt for
# CPython 3.12 manylinux x86_64, vLLM 0.33.0's two skinny-GEMM files out of its wheel with the shim that
# stands in for the rest of vLLM, packed into parts of at most PART_MIB (default 42) MiB with SHA256SUMS.
#   benchmarks/peer_kit/build.sh [OUT]      (OUT defaults to .peer-kit, git-ignored)
# VLLM_WHEEL=path reuses a downloaded vllm-0.33.0 wheel (336 MB).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-.peer-kit}
PART_MIB=${PART_MIB:-42}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PLATFORM=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WORK/tree/wheels" -r "$HERE/wheels.txt"
if [[ -z "${VLLM_WHEEL:-}" ]]; then
  "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WORK/vllm" vllm==0.33.0
  VLLM_WHEEL=$(ls "$WORK"/vllm/vllm-0.33.0-*.whl)
fi
cp -r "$HERE/vllm_shim/." "$WORK/tree/site/"
"$PY" - "$VLLM_WHEEL" "$WORK/tree/site" <<'PYEOF'
import sys, zipfile
from pathlib import Path
wheel, site = sys.argv[1], Path(sys.argv[2])
files = ["vllm/model_executor/kernels/linear/cute_dsl/skinny_gemm.py",
         "vllm/model_executor/kernels/linear/cute_dsl/_skinny_gemm.py"]
with zipfile.ZipFile(wheel) as z:
    for name in files:
        (site / name).write_bytes(z.read(name))
    license_ = next(n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE"))
    info = site / "vllm-0.33.0+kernelonly.dist-info"
    info.mkdir()
    (info / "LICENSE").write_bytes(z.read(license_))
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0+kernelonly\n"
                               "Summary: vLLM 0.33.0's CuTe-DSL skinny GEMM files alone, with tunekit's shim\n")
PYEOF
"$PY" "$HERE/kit.py" pack "$WORK/tree" "$OUT" --part-mib "$PART_MIB"
