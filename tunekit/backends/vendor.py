"""Vendor baseline: what the stock path runs (torch -> cuBLAS / rocBLAS / hipBLASLt).

Timed in the same process and the same way as every candidate, so speedups
are same-run ratios.

For the elementwise ops the baseline is the PyTorch eager composition, written
as vLLM writes it when its custom ops are off (``forward_native`` /
``forward_static`` of RMSNorm, GemmaRMSNorm, RMSNormGated, SiluAndMul; eager
``F.gelu(x + b)`` for bias + GELU): several kernels per call. Outputs are
written with ``out=`` where an op has that form, so no copy kernel is added
that vLLM would not run. ``tunekit.backends.inductor`` compiles the same
functions (``ELEMENTWISE``) with torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.measure.device import DeviceInfo
from tunekit.problems import oprecords
from tunekit.problems.opspec import EPS
from tunekit.problems.shapes import Problem

Tensors = tuple[torch.Tensor, ...]


def mm(inputs: Tensors, out: torch.Tensor) -> None:
    """The GEMV as vLLM's unquantized linear runs it: F.linear(x, w) lowers to mm(x, w.T); mm with out=
    runs the same BLAS call without the copy kernel that copying F.linear's result into ``out`` would add
    (~2 us, a large share of a 7 us small-N baseline)."""
    x, w = inputs
    torch.mm(x, w.t(), out=out)


mm.kernel_name = "torch.nn.functional.linear"  # what a report names: the call vLLM makes


def rms_norm(inputs: Tensors, out: torch.Tensor) -> None:
    """vLLM RMSNorm.forward_native: fp32 variance, normalised rows rounded to BF16, then * w in BF16."""
    x, w = inputs
    xf = x.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    torch.mul((xf * torch.rsqrt(variance + EPS)).to(x.dtype), w, out=out)


def gemma_rms_norm(inputs: Tensors, out: torch.Tensor) -> None:
    """vLLM GemmaRMSNorm.forward_static: (x / rms * (1 + w)) in fp32, rounded once."""
    x, w = inputs
    xf = x.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    out.copy_(xf * torch.rsqrt(variance + EPS) * (1.0 + w.float()))


def fused_add_rms_norm(inputs: Tensors, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """vLLM RMSNorm.forward_native with a residual: the fp32 sum (not rounded before the variance)."""
    x, residual, w = inputs
    y, residual_out = out
    s = x.float() + residual
    residual_out.copy_(s)
    variance = s.pow(2).mean(dim=-1, keepdim=True)
    torch.mul((s * torch.rsqrt(variance + EPS)).to(x.dtype), w, out=y)


def gemma_fused_add_rms_norm(inputs: Tensors, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """vLLM GemmaRMSNorm.forward_static with a residual: a BF16 add (rounded), then the norm in fp32."""
    x, residual, w = inputs
    y, residual_out = out
    torch.add(x, residual, out=residual_out)
    s = residual_out.float()
    variance = s.pow(2).mean(dim=-1, keepdim=True)
    y.copy_(s * torch.rsqrt(variance + EPS) * (1.0 + w.float()))


def gated_rms_norm(inputs: Tensors, out: torch.Tensor) -> None:
    """vLLM RMSNormGated.forward_native (norm_before_gate): per-group norm * w * silu(z) in fp32."""
    x, z, w = inputs
    m, n = x.shape
    k = w.shape[0]
    xf = x.float().view(m, n // k, k)
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + EPS) * w.float()).view(m, n)
    out.copy_(normed * F.silu(z.float()))


def silu_and_mul(inputs: Tensors, out: torch.Tensor) -> None:
    """vLLM SiluAndMul.forward_native: F.silu(a) * b, two BF16 ops."""
    (x,) = inputs
    d = x.shape[-1] // 2
    torch.mul(F.silu(x[:, :d]), x[:, d:], out=out)


def bias_gelu(inputs: Tensors, out: torch.Tensor) -> None:
    """Eager F.gelu(x + b, approximate="tanh"): a BF16 add, then GELU into ``out``."""
    x, b = inputs
    torch.ops.aten.gelu.out(x + b, approximate="tanh", out=out)


def _norm_then_mm(norm_op: str) -> Callable[..., None]:
    """The unfused sequence a norm -> GEMV op replaces: the eager norm writes BF16, then mm."""
    norm = globals()[norm_op]
    with_residual = norm_op.startswith(("fused_add", "gemma_fused_add"))

    def kernel(inputs: Tensors, out) -> None:
        *norm_inputs, w = inputs
        y = out[0] if with_residual else out
        normed = torch.empty_like(inputs[0])
        norm(tuple(norm_inputs), (normed, out[1]) if with_residual else normed)
        torch.mm(normed, w.t(), out=y)

    kernel.__name__ = f"{norm_op}_then_mm"
    return kernel


# norm -> GEMV ops (kernels_triton/rms_norm_gemv.py): their unfused eager sequences (the op records name them)
rms_norm_gemv_unfused = _norm_then_mm("rms_norm")
gemma_rms_norm_gemv_unfused = _norm_then_mm("gemma_rms_norm")
fused_add_rms_norm_gemv_unfused = _norm_then_mm("fused_add_rms_norm")
gemma_fused_add_rms_norm_gemv_unfused = _norm_then_mm("gemma_fused_add_rms_norm")


def silu_and_mul_then_mm(inputs: Tensors, out: torch.Tensor) -> None:
    """The unfused sequence silu_mul_gemv replaces: eager SiLU-and-mul writes BF16, then mm (down_proj)."""
    gate_up, w = inputs
    act = torch.empty((gate_up.shape[0], w.shape[1]), dtype=gate_up.dtype, device=gate_up.device)
    silu_and_mul((gate_up,), act)
    torch.mm(act, w.t(), out=out)



def addmm(inputs: Tensors, out: torch.Tensor) -> None:
    """What gemv_add (the residual add in the GEMV epilogue) is measured against: the BLAS call with
    its own epilogue, residual + x @ W^T in one launch (cuBLAS / hipBLASLt beta = 1), stronger than
    vLLM's mm followed by the add inside its next norm."""
    x, w, residual = inputs
    torch.addmm(residual, x, w.t(), out=out)


addmm.kernel_name = "torch.addmm (residual + x @ W^T, the BLAS epilogue)"



def rms_norm_then_mm(inputs: Tensors, out: torch.Tensor) -> None:
    """The unfused sequence rms_gemv replaces, with the norm's weight already folded into W: the
    unweighted norm (``F.rms_norm``, one launch) writes BF16, then mm."""
    x, w = inputs
    normed = F.rms_norm(x, (x.shape[-1],), eps=EPS)
    torch.mm(normed, w.t(), out=out)



def _mm_then_silu_and_mul(rms: bool) -> Callable[..., None]:
    """The unfused sequence a gemv_silu_mul op replaces (rms_: with the folded norm before it): (the
    unweighted norm, then) mm writes BF16 gate_up, then vLLM's SiLU-and-mul (forward_native). W's rows
    are (gate, up) pairs, so gate and up are the even and odd columns; the mm costs what it costs on
    the [gate; up] layout."""
    def kernel(inputs: Tensors, out: torch.Tensor) -> None:
        x, w = inputs
        if rms:
            x = F.rms_norm(x, (x.shape[-1],), eps=EPS)
        gate_up = torch.mm(x, w.t())
        torch.mul(F.silu(gate_up[:, 0::2]), gate_up[:, 1::2], out=out)

    kernel.__name__ = f"{'rms_norm_then_' if rms else ''}mm_then_silu_and_mul"
    return kernel


mm_then_silu_and_mul = _mm_then_silu_and_mul(rms=False)
rms_norm_then_mm_then_silu_and_mul = _mm_then_silu_and_mul(rms=True)


def composition(op: str) -> Callable[..., None] | None:
    """The eager composition of ``op`` its record names (``tunekit.problems.oprecords``), or None."""
    record = oprecords.RECORDS.get(op)
    return None if record is None or record.vendor is None else oprecords.resolve(record.vendor)


class _ByKind(Mapping):
    """op -> eager composition, for the ops of some kinds whose record names one (read when looked up)."""

    def __init__(self, *kinds: str) -> None:
        self.kinds = kinds

    def _ops(self) -> tuple[str, ...]:
        return tuple(op for kind in self.kinds for op in oprecords.names(kind=kind) if oprecords.get(op).vendor)

    def __getitem__(self, op: str) -> Callable[..., None]:
        if op not in self._ops():
            raise KeyError(op)
        return composition(op)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ops())

    def __len__(self) -> int:
        return len(self._ops())


#: elementwise op -> eager composition ``fn(inputs, out)`` (tunekit.problems.opspec's inputs and outputs): what
#: the Inductor baseline compiles.
ELEMENTWISE: Mapping[str, Callable[..., None]] = _ByKind("elementwise")
#: fused GEMV op -> its unfused eager sequence (kept out of ``ELEMENTWISE``, which Inductor compiles).
NORM_GEMV: Mapping[str, Callable[..., None]] = _ByKind("fused_gemv")


class VendorBackend:
    name = "vendor"
    kind = "baseline"

    @property
    def ops(self) -> tuple[str, ...]:
        """Every op whose record names an eager composition."""
        return tuple(op for op, r in oprecords.RECORDS.items() if r.vendor is not None)

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        return None

    def space(self, problem: Problem) -> SearchSpace:
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        return None if problem.op in self.ops else f"no vendor path for op {problem.op!r}"

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        kernel = composition(problem.op)
        if kernel is None:
            raise BuildError(f"no vendor path for op {problem.op!r}")
        return kernel

    def source_hash(self) -> str:
        return f"torch-{torch.__version__}"

    def kernel_name(self, problem: Problem) -> str:
        kernel = composition(problem.op)
        if hasattr(kernel, "kernel_name"):
            return kernel.kernel_name
        kind = "PyTorch eager + mm" if oprecords.get(problem.op).kind == "fused_gemv" else "PyTorch eager"
        return f"{kernel.__module__}:{kernel.__name__} ({kind})"


BACKEND = VendorBackend()
