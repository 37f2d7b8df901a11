"""What GPU (or CPU interpreter) we run on: vendor, arch, CUs, wave size, L2.

The read-bandwidth limit is *measured* (see ``tunekit.measure.bench.probe_bandwidth``),
not taken from a datasheet: every result reports its share of that number.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass

import torch

#: L2 size assumed on the CPU interpreter path, where no device reports one.
_CPU_L2_BYTES = 32 * 2**20


def interpret_mode() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: Why Triton has nothing to run on, in one line (``no_driver_reason``).
NO_DRIVER = ("no GPU driver is visible here (torch sees no CUDA or ROCm device); TRITON_INTERPRET=1 runs the "
             "Triton kernels on the CPU (for development: its timings are not evidence)")


def no_driver_reason() -> str | None:
    """:data:`NO_DRIVER` when Triton would find no active driver (no GPU, no interpreter), else None.

    Without it Triton's own message is "0 active drivers ([]). There should only be one."
    """
    if interpret_mode() or torch.cuda.is_available():
        return None
    return NO_DRIVER


@dataclass(frozen=True)
class DeviceInfo:
    vendor: str  # "nvidia", "amd" or "cpu"
    name: str
    arch: str  # "sm_90", "gfx90a", "gfx936" ... or "cpu"
    cu_count: int  # SMs on NVIDIA, CUs on AMD, cores on CPU
    wave_size: int  # 32 on NVIDIA, 64 on AMD/DCU gfx9
    l2_bytes: int
    memory_bytes: int
    runtime: str  # "cuda 13.0", "hip 6.3", "cpu"
    torch_device: str  # what torch.device() takes: "cuda:0" or "cpu"

    @property
    def is_gpu(self) -> bool:
        return self.vendor in ("nvidia", "amd")

    @property
    def timing_kind(self) -> str:
        """"gpu" timings are real; "cpu" ones come from the interpreter (tests only)."""
        return "gpu" if self.is_gpu else "cpu"

    def as_dict(self) -> dict:
        return asdict(self)


def detect(index: int = 0) -> DeviceInfo:
    """Describe GPU ``index``, or the CPU when none is usable.

    Under ``TRITON_INTERPRET=1`` the CPU is used even if a GPU exists, because
    interpreted kernels take CPU tensors.
    """
    if torch.cuda.is_available() and not interpret_mode():
        props = torch.cuda.get_device_properties(index)
        if torch.version.hip:
            vendor = "amd"
            arch = getattr(props, "gcnArchName", "gfx").split(":")[0]
            runtime = f"hip {torch.version.hip}"
        else:
            vendor = "nvidia"
            arch = f"sm_{props.major}{props.minor}"
            runtime = f"cuda {torch.version.cuda}"
        wave = int(getattr(props, "warp_size", 64 if vendor == "amd" else 32))
        l2 = int(getattr(props, "L2_cache_size", 0)) or 64 * 2**20
        return DeviceInfo(
            vendor=vendor,
            name=props.name,
            arch=arch,
            cu_count=props.multi_processor_count,
            wave_size=wave,
            l2_bytes=l2,
            memory_bytes=props.total_memory,
            runtime=runtime,
            torch_device=f"cuda:{index}",
        )
    return DeviceInfo(
        vendor="cpu",
        name=platform.processor() or platform.machine(),
        arch="cpu",
        cu_count=os.cpu_count() or 1,
        wave_size=1,
        l2_bytes=_CPU_L2_BYTES,
        memory_bytes=0,
        runtime="cpu (triton interpreter)" if interpret_mode() else "cpu",
        torch_device="cpu",
    )
