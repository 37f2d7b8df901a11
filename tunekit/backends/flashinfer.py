"""FlashInfer's BF16 small-M GEMM as a user would pick it: a GEMV baseline (peer).

Per architecture, the kernel FlashInfer offers for a BF16 linear at small M:

* **SM90 (H100, H200): ``flashinfer.tinygemm_bf16``**, the TensorRT-LLM tinygemm2
  kernel (warp-specialised, TMA loads, ``mma.sync`` with the batch as the MMA's
  N = 8 tile), JIT-compiled with ``nvcc`` at its first use. It needs K a multiple
  of 64 and N a multiple of 16. It runs here without PDL: its docs warn that PDL
  hangs unless every preceding kernel on the stream uses PDL too, and tunekit's
  own kernels are timed without it.
* **SM100 and newer: ``flashinfer.mm_bf16(backend="cute-dsl")``**, which is what
  vLLM 0.33 runs behind ``--linear-backend flashinfer_cutedsl``
  (``vllm.model_executor.layers.utils``: ``pdl=<sm_90+>``, ``out_dtype=bf16``),
  where vLLM's gate admits the call (K a multiple of 128), autotuned at its first
  call as vLLM's warm-up does.

Call protocol (as every backend; ``kind == "baseline"``: never searched)::

    backend = tunekit.backends.get("flashinfer")
    backend.unavailable_reason(device)   # one line: no GPU, architecture, package missing
    backend.invalid_reason(problem, {})  # shape unsupported: dtype, K or N multiple
    kernel = backend.build(problem, {}, device)   # tinygemm: compiles (nvcc) here
    kernel((x, w), out)   # mm_bf16: the first call autotunes (outside a capture); graph-capturable after it
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil

import torch

from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.backends.vllm_skinny import EXTRA, capability, device_reason, has_module
from tunekit.measure.device import DeviceInfo
from tunekit.problems.shapes import Problem

#: FlashInfer's mm_bf16 backend behind vLLM's --linear-backend flashinfer_cutedsl (SM100 and newer).
FLASHINFER_BACKEND = "cute-dsl"
#: vLLM's gate (_can_use_flashinfer_cutedsl_bf16): K a multiple of 128, else F.linear.
K_MULTIPLE = 128
#: tinygemm2 (SM90): K in 64-element TMA tiles, W rows in MMA tiles of 16.
TINYGEMM_K_MULTIPLE, TINYGEMM_N_MULTIPLE = 64, 16
#: The architecture family tinygemm serves here (sm_90: H100, H200); mm_bf16's cute-dsl serves SM100+.
TINYGEMM_MAJOR = 9


def uses_tinygemm(arch: str) -> bool:
    """Whether the peer on ``arch`` is tinygemm_bf16 (SM90) rather than mm_bf16's cute-dsl backend."""
    cc = capability(arch)
    return cc is not None and cc[0] == TINYGEMM_MAJOR
#: FlashInfer's is_sm100a_supported: CUDA 12.8 or newer.
MIN_CUDA = (12, 8)


def _mm_bf16():
    return importlib.import_module("flashinfer").mm_bf16


def supported_capabilities() -> list[int]:
    """The compute capabilities (major * 10 + minor) FlashInfer builds its ``cute-dsl`` mm_bf16 for."""
    mm = _mm_bf16()
    return [cc for cc in range(70, 130) if mm.is_backend_supported(FLASHINFER_BACKEND, cc)]


def _cuda_version(runtime: str) -> tuple[int, ...] | None:
    """(12, 8) from a DeviceInfo runtime "cuda 12.8"; None if it names no CUDA version."""
    name, _, version = runtime.partition(" ")
    parts = version.split(".")[:2]
    if name != "cuda" or not all(p.isdigit() for p in parts) or not parts:
        return None
    return tuple(int(p) for p in parts)


class FlashInferBackend:
    name = "flashinfer"
    kind = "baseline"
    ops = ("gemv",)

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        what = "FlashInfer's BF16 small-M GEMM"
        why = device_reason(device, what)
        if why:
            return why
        if not has_module("flashinfer"):
            return f"flashinfer-python is not installed ({EXTRA})"
        if uses_tinygemm(device.arch):
            return None if shutil.which("nvcc") or os.environ.get("CUDA_HOME") else (
                f"nvcc not found: FlashInfer JIT-compiles tinygemm_bf16 on {device.arch} (set CUDA_HOME)")
        if not has_module("cutlass"):
            return (f"the CuTe DSL is not installed (nvidia-cutlass-dsl, which FlashInfer's {FLASHINFER_BACKEND!r} "
                    f"mm needs; {EXTRA})")
        try:
            supported = supported_capabilities()
        except Exception as exc:  # noqa: BLE001 - FlashInfer's import can fail many ways: one line
            return f"flashinfer cannot be imported ({type(exc).__name__}: {exc})"
        cc = capability(device.arch)
        if cc is None or cc[0] * 10 + cc[1] not in supported:
            archs = ", ".join(f"sm_{c}" for c in supported) or "no architecture"
            return (f"architecture {device.arch} unsupported ({what}: tinygemm_bf16 on sm_90, mm_bf16 backend "
                    f"{FLASHINFER_BACKEND!r} (vLLM's --linear-backend flashinfer_cutedsl) on {archs})")
        cuda = _cuda_version(device.runtime)
        if cuda is not None and cuda < MIN_CUDA:
            return f"{device.runtime}: {what} ({FLASHINFER_BACKEND!r}) needs CUDA 12.8 or newer"
        return None

    def space(self, problem: Problem) -> SearchSpace:
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        if problem.op not in self.ops:
            return f"no FlashInfer baseline for op {problem.op!r}"
        if problem.dtype != "bf16":
            return f"shape unsupported: FlashInfer's BF16 GEMMs take BF16 only (got {problem.dtype})"
        # Both kernels' shape rules: the one that runs is known only with the device (build checks it again).
        return None

    def shape_reason(self, problem: Problem, arch: str) -> str | None:
        """Why the kernel that runs on ``arch`` refuses ``problem``'s shape, else None."""
        if uses_tinygemm(arch):
            if problem.k % TINYGEMM_K_MULTIPLE or problem.n % TINYGEMM_N_MULTIPLE:
                return (f"shape unsupported: tinygemm_bf16 needs K % {TINYGEMM_K_MULTIPLE} == 0 and "
                        f"N % {TINYGEMM_N_MULTIPLE} == 0 (N={problem.n}, K={problem.k})")
            return None
        if problem.k % K_MULTIPLE:
            return (f"shape unsupported: K={problem.k} is not a multiple of {K_MULTIPLE} "
                    "(vLLM runs F.linear there under --linear-backend flashinfer_cutedsl)")
        return None

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        why = (self.unavailable_reason(device) or self.invalid_reason(problem, params)
               or self.shape_reason(problem, device.arch))
        if why:
            raise BuildError(why)
        flashinfer = importlib.import_module("flashinfer")
        if uses_tinygemm(device.arch):
            return self._build_tinygemm(flashinfer)
        mm_bf16, autotune = flashinfer.mm_bf16, flashinfer.autotune
        cc = capability(device.arch) or (0, 0)
        pdl = cc[0] >= 9  # vLLM: pdl=current_platform.is_arch_support_pdl()
        tuned = [False]

        def kernel(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x, w = inputs
            if not tuned[0]:
                # vLLM's warm-up autotunes FlashInfer (enable_flashinfer_autotune, on by default): profile
                # this shape's tactics once, then every call runs the chosen one
                with autotune(tune_mode=True):
                    mm_bf16(x, w.t(), pdl=pdl, out=out, out_dtype=torch.bfloat16, backend=FLASHINFER_BACKEND)
                tuned[0] = True
            mm_bf16(x, w.t(), pdl=pdl, out=out, out_dtype=torch.bfloat16, backend=FLASHINFER_BACKEND)

        return kernel

    @staticmethod
    def _build_tinygemm(flashinfer) -> Kernel:
        try:
            # the JIT build (nvcc, ninja; cached under FlashInfer's workspace): here, not at the first call
            importlib.import_module("flashinfer.gemm.routergemm").get_tinygemm2_module()
        except Exception as exc:  # noqa: BLE001 - nvcc's and ninja's failures: a failed baseline, one line
            raise BuildError(f"FlashInfer's tinygemm_bf16 JIT build failed: {type(exc).__name__}: {exc}") from None
        tinygemm = importlib.import_module("flashinfer.gemm").tinygemm_bf16  # not re-exported at the top

        def kernel(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x, w = inputs
            tinygemm(x, w, out, use_pdl=False)

        return kernel

    def source_hash(self) -> str:
        try:
            version = importlib.metadata.version("flashinfer-python")
        except importlib.metadata.PackageNotFoundError:
            version = "missing"
        return f"flashinfer-{version}-tinygemm-{FLASHINFER_BACKEND}"

    def kernel_name(self, problem: Problem) -> str:
        return ("flashinfer.tinygemm_bf16 on sm_90; flashinfer.mm_bf16(backend="
                f"{FLASHINFER_BACKEND!r}) (vLLM --linear-backend flashinfer_cutedsl) on SM100+")


BACKEND = FlashInferBackend()
