"""NVIDIA side of tunekit.rtc: NVRTC compile to cubin, load and launch via cuda.core.

Call protocol (``tunekit.rtc`` drives it; nothing here touches the cache)::

    version = compiler_version()                  # "nvrtc 13.5"; no GPU needed
    cubin, log = compile_source(source, defines, "sm_90", name="gemv.hip")
    kernel = load_kernel(cubin, "tunekit_gemv", device_index=0)   # needs the GPU
    kernel((gx, gy, 1), (bx, 1, 1), [ptr, ptr, n, ...], stream_handle)

Compilation needs only the NVRTC library (the ``nvidia-cuda-nvrtc`` wheel),
no driver: ``cuda.core.Program`` compiles to cubin without a device when the
arch is given. If that path fails for a reason other than a compile error
(an older cuda.core that probes the driver), ``cuda.bindings.nvrtc`` compiles
instead. Loading and launching use ``cuda.core`` on torch's current stream, so
CUDA graphs capture the launches. Kernel arguments must all be 8 bytes wide:
cuda.core passes a Python int as an ``intptr_t``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from tunekit.errors import BuildError

#: NVRTC options besides the arch and the defines (part of the cache key).
OPTIONS: tuple[str, ...] = ("-std=c++17",)


def available() -> str | None:
    """None if cuda.core can be imported, else a one-line reason."""
    try:
        import cuda.core  # noqa: F401
    except ImportError as exc:
        return f"cuda.core is not installed ({exc.name}): pip install 'cuda-core[cu12]' (or [cu13])"
    return None


@lru_cache(maxsize=1)
def compiler_version() -> str:
    """``"nvrtc MAJOR.MINOR"`` of the NVRTC library that will compile."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(err, "nvrtcVersion")
    return f"nvrtc {major}.{minor}"


def compile_source(source: str, defines: Mapping[str, int | str], arch: str, name: str) -> tuple[bytes, str]:
    """Compile ``source`` to a cubin for ``arch`` (``sm_90``); returns (cubin, log).

    Raises BuildError with the compiler's diagnostics on a compile error.
    """
    try:
        return _compile_core(source, defines, arch, name)
    except BuildError:
        raise
    except Exception:  # noqa: BLE001 - any non-compile failure: try the plain bindings
        return _compile_bindings(source, defines, arch, name)


def _compile_core(source: str, defines: Mapping[str, int | str], arch: str, name: str) -> tuple[bytes, str]:
    from cuda.core import Program, ProgramOptions

    options = ProgramOptions(
        name=name,
        arch=arch,
        std="c++17",
        define_macro=[(str(k), str(v)) for k, v in sorted(defines.items())],
    )
    log = _Log()
    try:
        program = Program(source, "c++", options=options)
        obj = program.compile("cubin", logs=log)
    except Exception as exc:  # NVRTCError lives in a private module: match on its text
        text = str(exc)
        if "NVRTC_ERROR_COMPILATION" in text or "compilation log" in text:
            raise BuildError(f"NVRTC failed to compile {name} for {arch}", log=text) from None
        raise
    return bytes(obj.code), log.text()


def _compile_bindings(
    source: str, defines: Mapping[str, int | str], arch: str, name: str
) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        opts = [f"-arch={arch}", *OPTIONS, *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check_nvrtc(err, "nvrtcGetProgramLogSize")
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\0").decode(errors="replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise BuildError(f"NVRTC failed to compile {name} for {arch}", log=log)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check_nvrtc(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class NvKernel:
    """One loaded kernel function; call it to launch on a raw CUDA stream handle."""

    def __init__(self, kernel: Any, device_index: int, module: Any) -> None:
        self._kernel = kernel
        self._device_index = device_index
        self._module = module  # keeps the CUmodule alive as long as the kernel
        self._streams: dict[int, Any] = {}

    def __call__(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[int],
        stream: int,
        shmem: int = 0,
    ) -> None:
        from cuda.core import LaunchConfig, launch

        wrapped = self._streams.get(stream)
        if wrapped is None:
            wrapped = self._wrap_stream(stream)
        launch(wrapped, LaunchConfig(grid=grid, block=block, shmem_size=shmem), self._kernel, *args)

    def _wrap_stream(self, handle: int) -> Any:
        # A non-owning cuda.core view of torch's stream, made once per handle:
        # the first call of a kernel happens before graph capture (warm-up).
        from cuda.core import Device

        wrapped = Device(self._device_index).create_stream(_StreamRef(handle))
        self._streams[handle] = wrapped
        return wrapped


class _StreamRef:
    """Anything with ``__cuda_stream__`` is a stream to cuda.core."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def load_kernel(cubin: bytes, name: str, device_index: int) -> NvKernel:
    """Load ``cubin`` into device ``device_index``'s primary context (torch's) and get ``name``."""
    from cuda.core import Device, ObjectCode

    Device(device_index).set_current()
    try:
        module = ObjectCode.from_cubin(cubin)
        kernel = module.get_kernel(name)
    except Exception as exc:  # e.g. a cubin newer than the driver
        raise BuildError(f"cannot load kernel {name!r}: {exc}", log=str(exc)) from exc
    return NvKernel(kernel, device_index, module)


class _Log:
    """File-like sink for cuda.core's compile log."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def write(self, text: str) -> None:
        self._parts.append(str(text))

    def text(self) -> str:
        return "".join(self._parts)


def _check_nvrtc(err: Any, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
