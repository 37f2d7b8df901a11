"""HIP kernel sources (one op per ``.hip`` file) and their portability header.

The files are data for ``tunekit.rtc``, which compiles them at run time
(NVRTC on NVIDIA, hipRTC on AMD); nothing here imports a GPU library.
"""

from __future__ import annotations

from pathlib import Path

#: Directory holding ``<op>.hip`` and ``tunekit_hip.h``.
SOURCE_DIR = Path(__file__).parent
#: The portability header every .hip file includes.
HEADER = "tunekit_hip.h"


def source_path(op: str) -> Path:
    """Path of the HIP source of ``op`` (``gemv`` -> ``kernels_hip/gemv.hip``)."""
    return SOURCE_DIR / f"{op}.hip"
