"""AMD side of tunekit.rtc: hipRTC compile, hipModuleLoadData, hipModuleLaunchKernel.

Call protocol (``tunekit.rtc`` drives it; nothing here touches the cache)::

    version = compiler_version()                       # "hiprtc 6.3"
    code, log = compile_source(source, defines, "gfx90a", name="gemv.hip")
    kernel = load_kernel(code, "tunekit_gemv", device_index=0)
    kernel((gx, gy, 1), (bx, 1, 1), [ptr, ptr, n, ...], stream_handle)

Everything goes through hip-python (``from hip import hip, hiprtc``), imported
lazily so that this module imports on machines without ROCm. hip-python's
major version must match the installed ROCm (``hip-python~=6.3`` for ROCm
6.3). Launches pass their arguments as one packed buffer (``extra``): every
kernel argument is 8 bytes wide (pointer or int64), so the packing has no
alignment gaps. Launching on torch's current stream (its ``cuda_stream`` int
is the hipStream_t) lets HIP graphs capture the kernels.

hipRTC sees no include path: ``tunekit.rtc`` hands it the source with
``tunekit_hip.h`` already inlined.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from tunekit.errors import BuildError

#: hipRTC options besides the arch and the defines (part of the cache key).
OPTIONS: tuple[str, ...] = ("-O3",)


def available() -> str | None:
    """None if hip-python can be imported, else a one-line reason."""
    try:
        from hip import hip, hiprtc  # noqa: F401
    except ImportError as exc:
        return f"hip-python is not installed ({exc.name}): pip install 'hip-python~=<your ROCm version>'"
    return None


@lru_cache(maxsize=1)
def compiler_version() -> str:
    from hip import hiprtc

    err, major, minor = hiprtc.hiprtcVersion()
    _check(err, "hiprtcVersion")
    return f"hiprtc {major}.{minor}"


def compile_source(source: str, defines: Mapping[str, int | str], arch: str, name: str) -> tuple[bytes, str]:
    """Compile ``source`` for ``arch`` (``gfx90a``, ``gfx936`` ...); returns (code object, log).

    Raises BuildError with the compiler's diagnostics on a compile error.
    """
    from hip import hiprtc

    err, prog = hiprtc.hiprtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err, "hiprtcCreateProgram")
    try:
        opts = [f"--offload-arch={arch}", *OPTIONS, *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
        encoded = [o.encode() for o in opts]
        (result,) = hiprtc.hiprtcCompileProgram(prog, len(encoded), encoded)
        log = _program_log(prog)
        if result != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
            raise BuildError(f"hipRTC failed to compile {name} for {arch}: {result}", log=log)
        err, size = hiprtc.hiprtcGetCodeSize(prog)
        _check(err, "hiprtcGetCodeSize")
        code = bytearray(size)
        (err,) = hiprtc.hiprtcGetCode(prog, code)
        _check(err, "hiprtcGetCode")
        return bytes(code), log
    finally:
        hiprtc.hiprtcDestroyProgram(prog.createRef())


def _program_log(prog: Any) -> str:
    from hip import hiprtc

    err, size = hiprtc.hiprtcGetProgramLogSize(prog)
    if err != hiprtc.hiprtcResult.HIPRTC_SUCCESS or size <= 1:
        return ""
    buf = bytearray(size)
    hiprtc.hiprtcGetProgramLog(prog, buf)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


class HipKernel:
    """One loaded kernel function; call it to launch on a raw hipStream_t handle."""

    def __init__(self, function: Any, module: Any) -> None:
        self._function = function
        self._module = module  # keeps the hipModule_t referenced with the function

    def __call__(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[int],
        stream: int,
        shmem: int = 0,
    ) -> None:
        from hip import hip

        # All arguments are 8 bytes (pointers, int64): c_int64 packs them
        # without padding into the buffer hip-python hands to `extra`.
        packed = tuple(ctypes.c_int64(int(a)) for a in args)
        (err,) = hip.hipModuleLaunchKernel(
            self._function,
            grid[0],
            grid[1],
            grid[2],
            block[0],
            block[1],
            block[2],
            shmem,
            stream or None,
            None,
            packed,
        )
        _check(err, "hipModuleLaunchKernel")


def load_kernel(code: bytes, name: str, device_index: int) -> HipKernel:
    """Load ``code`` on device ``device_index`` (torch's primary context) and get ``name``."""
    from hip import hip

    (err,) = hip.hipSetDevice(device_index)
    _check(err, "hipSetDevice")
    err, module = hip.hipModuleLoadData(code)
    if err != hip.hipError_t.hipSuccess:
        raise BuildError(f"cannot load code object: {err}", log=str(err))
    err, function = hip.hipModuleGetFunction(module, name.encode())
    if err != hip.hipError_t.hipSuccess:
        raise BuildError(f"no kernel {name!r} in code object: {err}", log=str(err))
    return HipKernel(function, module)


def _check(err: Any, what: str) -> None:
    from hip import hip, hiprtc

    ok = (hip.hipError_t.hipSuccess, hiprtc.hiprtcResult.HIPRTC_SUCCESS)
    if err not in ok:
        raise RuntimeError(f"{what} failed: {err}")
