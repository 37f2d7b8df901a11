"""FlashInfer's BF16 mm as vLLM runs it behind ``--linear-backend``: a GEMV baseline (peer).

vLLM 0.33 wires one FlashInfer backend for unquantized BF16 linears:
``--linear-backend flashinfer_cutedsl`` (``vllm.model_executor.layers.utils``:
``_FLASHINFER_BF16_BACKENDS``), which calls ``flashinfer.mm_bf16(x, W.t(),
pdl=<sm_90+>, out_dtype=bf16, backend="cute-dsl")`` where its gate admits the
call (BF16, contiguous, K a multiple of 128, 32-byte aligned) and F.linear
elsewhere; vLLM autotunes FlashInfer's kernels at warm-up unless told not to.
This baseline times that call, autotuned the same way at its first call.
On the H200 (sm_90) FlashInfer's ``cute-dsl`` mm is not built: vLLM's
default there is F.linear, the ``vendor`` baseline.

Call protocol (as every backend; ``kind == "baseline"``: never searched)::

    backend = tunekit.backends.get("flashinfer")
    backend.unavailable_reason(device)   # one line: no GPU, architecture, package missing
    backend.invalid_reason(problem, {})  # shape unsupported: dtype, K % 128
    kernel = backend.build(problem, {}, device)
    kernel((x, w), out)   # the first call autotunes (outside a capture); graph-capturable after it
"""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.backends.vllm_skinny import EXTRA, capability, device_reason, has_module
from tunekit.measure.device import DeviceInfo
from tunekit.problems.shapes import Problem

#: FlashInfer's mm_bf16 backend behind vLLM's --linear-backend flashinfer_cutedsl.
FLASHINFER_BACKEND = "cute-dsl"
#: vLLM's gate (_can_use_flashinfer_cutedsl_bf16): K a multiple of 128, else F.linear.
K_MULTIPLE = 128
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
        what = "FlashInfer's BF16 mm"
        why = device_reason(device, what)
        if why:
            return why
        if not has_module("flashinfer"):
            return f"flashinfer-python is not installed ({EXTRA})"
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
            return (f"architecture {device.arch} unsupported ({what} behind vLLM's --linear-backend "
                    f"flashinfer_cutedsl, mm_bf16 backend {FLASHINFER_BACKEND!r}, runs on {archs})")
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
            return f"shape unsupported: FlashInfer's mm_bf16 takes BF16 only (got {problem.dtype})"
        if problem.k % K_MULTIPLE:
            return (f"shape unsupported: K={problem.k} is not a multiple of {K_MULTIPLE} "
                    "(vLLM runs F.linear there under --linear-backend flashinfer_cutedsl)")
        return None

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        why = self.unavailable_reason(device) or self.invalid_reason(problem, params)
        if why:
            raise BuildError(why)
        flashinfer = importlib.import_module("flashinfer")
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

    def source_hash(self) -> str:
        try:
            version = importlib.metadata.version("flashinfer-python")
        except importlib.metadata.PackageNotFoundError:
            version = "missing"
        return f"flashinfer-{version}-{FLASHINFER_BACKEND}"

    def kernel_name(self, problem: Problem) -> str:
        return f"flashinfer.mm_bf16(backend={FLASHINFER_BACKEND!r}) (vLLM --linear-backend flashinfer_cutedsl)"


BACKEND = FlashInferBackend()
