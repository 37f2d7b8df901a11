"""Run-time compilation of ``kernels_hip`` (NVRTC on NVIDIA, hipRTC on AMD), disk-cached.

Call protocol::

    from tunekit import rtc

    module = rtc.compile_kernel("gemv", {"VEC": 8, "WAVE": 64, ...}, device)
    module.compile_s, module.cache_hit       # seconds spent here; True if served from disk
    fn = module.kernel("tunekit_gemv", device_index=0)    # loads on the GPU (once per device)
    fn((gx, gy, 1), (bx, 1, 1), [x.data_ptr(), ..., n, k], torch.cuda.current_stream().cuda_stream)

``compile_kernel`` needs no GPU: it only uses ``device.vendor`` and
``device.arch`` (``sm_90``, ``gfx90a``, ``gfx936`` ...), so CI compiles every
variant on a CPU machine. A compile error raises
``tunekit.errors.BuildError`` whose ``.log`` is the compiler output.

The source handed to the compiler is ``kernels_hip/<op>.hip`` with
``tunekit_hip.h`` inlined in place of its ``#include`` (hipRTC and NVRTC see no
include path); ``#line`` directives keep diagnostics pointing at the real
files. The cache key covers that text, the sorted defines, the arch, the
compiler version and its options (see ``tunekit.rtc.cache``).

Kernel launches take a flat list of 8-byte arguments (device pointers as ints
and int64 scalars) and a raw stream handle; they are asynchronous and
capturable by CUDA/HIP graphs.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kernels_hip import HEADER, SOURCE_DIR, source_path
from tunekit.errors import BuildError
from tunekit.measure.device import DeviceInfo
from tunekit.rtc import cache

__all__ = [
    "CompiledModule",
    "LaunchFn",
    "compile_kernel",
    "compiler_for",
    "source_text",
    "sources_hash",
    "unavailable_reason",
]

_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"' + re.escape(HEADER) + r'"[ \t]*$', re.MULTILINE)


class LaunchFn(Protocol):
    """A loaded kernel: ``fn(grid, block, args, stream, shmem=0)`` launches asynchronously."""

    def __call__(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[int],
        stream: int,
        shmem: int = 0,
    ) -> None: ...


@dataclass
class CompiledModule:
    """One compiled variant of an op's source: the code object plus how it was made."""

    op: str
    vendor: str  # "nvidia" or "amd"
    arch: str
    defines: dict[str, int | str]
    binary: bytes  # cubin (NVIDIA) or AMD code object
    key: str  # cache key (sha256 hex)
    compiler: str  # "nvrtc 13.5" / "hiprtc 6.3"
    compile_s: float  # wall seconds spent in compile_kernel (cache lookup included)
    cache_hit: bool
    log: str = ""
    _loaded: dict[tuple[str, int], LaunchFn] = field(default_factory=dict, repr=False)

    def kernel(self, name: str, device_index: int = 0) -> LaunchFn:
        """The launcher of ``name`` on GPU ``device_index`` (loads the module on first use)."""
        loaded = self._loaded.get((name, device_index))
        if loaded is None:
            loaded = _driver(self.vendor).load_kernel(self.binary, name, device_index)
            self._loaded[(name, device_index)] = loaded
        return loaded


def source_text(op: str) -> str:
    """``kernels_hip/<op>.hip`` with ``tunekit_hip.h`` inlined (what the compiler sees)."""
    path = source_path(op)
    try:
        text = path.read_text()
    except OSError as exc:
        raise BuildError(f"no HIP source for op {op!r}: {path}") from exc
    header = (SOURCE_DIR / HEADER).read_text()
    match = _INCLUDE_RE.search(text)
    if not match:
        return text
    line_after = text.count("\n", 0, match.end()) + 2
    inlined = f'#line 1 "{HEADER}"\n{header}\n#line {line_after} "{path.name}"'
    return text[: match.start()] + inlined + text[match.end() :]


def sources_hash() -> str:
    """sha256 over every .hip file and the header of kernels_hip (dispatch-table stamp)."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*.hip")) + [SOURCE_DIR / HEADER]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def compiler_for(vendor: str) -> str:
    """Version string of the compiler serving ``vendor`` (part of the cache key)."""
    return _driver(vendor).compiler_version()


def unavailable_reason(vendor: str) -> str | None:
    """None if the run-time compiler/loader for ``vendor`` imports, else why not."""
    if vendor not in ("nvidia", "amd"):
        return f"no run-time compiler for {vendor!r} devices (HIP kernels need an NVIDIA or AMD GPU)"
    return _driver(vendor).available()


def compile_kernel(
    op: str,
    defines: Mapping[str, int | str],
    device: DeviceInfo,
    *,
    use_cache: bool = True,
) -> CompiledModule:
    """Compile ``kernels_hip/<op>.hip`` with ``defines`` for ``device.arch`` (disk-cached).

    Raises BuildError on a compile error (``.log`` = compiler output) or when
    the device's vendor has no run-time compiler here.
    """
    t0 = time.perf_counter()
    why = unavailable_reason(device.vendor)
    if why:
        raise BuildError(why)
    driver = _driver(device.vendor)
    source = source_text(op)
    defs = {str(k): v for k, v in defines.items()}
    compiler = driver.compiler_version()
    target = "cubin" if device.vendor == "nvidia" else "hsaco"
    key = cache.cache_key(
        source, defs, arch=device.arch, compiler=compiler, target=target, options=driver.OPTIONS
    )
    log = ""

    def build() -> bytes:
        nonlocal log
        blob, log = driver.compile_source(source, defs, device.arch, name=source_path(op).name)
        return blob

    if use_cache:
        blob, built = cache.get_or_build(key, build)
        hit = not built
    else:
        blob, hit = build(), False
    return CompiledModule(
        op=op,
        vendor=device.vendor,
        arch=device.arch,
        defines=defs,
        binary=blob,
        key=key,
        compiler=compiler,
        compile_s=time.perf_counter() - t0,
        cache_hit=hit,
        log=log,
    )


def _driver(vendor: str) -> Any:
    # Lazy: importing tunekit.rtc must not need cuda-python or hip-python.
    if vendor == "nvidia":
        from tunekit.rtc import nvrtc

        return nvrtc
    if vendor == "amd":
        from tunekit.rtc import hiprtc

        return hiprtc
    raise BuildError(f"no run-time compiler for {vendor!r} devices")
