"""The elementwise ops' specs (``tunekit.problems.opspec_base``'s protocol): the norms and the pointwise ops.

Inputs / outputs (n, k as in ``tunekit.problems.shapes.Problem``):

====================== =========================== ===================
op                     inputs                      outputs
====================== =========================== ===================
rms_norm, gemma_...    x[m,n], w[n]                y[m,n]
fused_add_rms_norm, .. x[m,n], residual[m,n], w[n] y[m,n], residual_out
gated_rms_norm         x[m,n], z[m,n], w[k]        y[m,n]
silu_and_mul           x[m,2n]                     y[m,n]
bias_gelu              x[m,n], b[n]                y[m,n]
====================== =========================== ===================

All are limited by copy bandwidth (they write about as much as they read) and
rotate their activations over at most :data:`ELEMENTWISE_MAX_COPIES` copies.
:data:`SPECS` lists them for the registry (``tunekit.problems.opspec.get``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tunekit.problems.opspec_base import (
    FP32_U,
    TINY,
    TORCH_DTYPES,
    UNIT_ROUNDOFF,
    OpSpec,
    rms_scaled,
    scaled_randn,
)
from tunekit.problems.shapes import DTYPE_BYTES, Problem

#: Rotated copies of elementwise activations are capped here: below
#: 4 x L2 / 64 of activations (~3.75 MB on an H200) the timing runs with the
#: activations in L2, as in decode, where the previous kernel just wrote them;
#: an M = 1 row would otherwise need ~20000 copies (a graph of as many launches).
ELEMENTWISE_MAX_COPIES = 64

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


# Unit-variance rows and an N(0, 1) weight: a (1 + w) / w mix-up, a wrong
# group or a missing residual changes outputs by O(1), far above the bound.
def _norm_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dtype = TORCH_DTYPES[problem.dtype]
    x = scaled_randn((problem.m, problem.n), gen, device, dtype)
    return x, scaled_randn((problem.n,), gen, device, dtype)


def _fused_add_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dtype = TORCH_DTYPES[problem.dtype]
    m, n = problem.m, problem.n
    x, residual = scaled_randn((m, n), gen, device, dtype), scaled_randn((m, n), gen, device, dtype)
    return x, residual, scaled_randn((n,), gen, device, dtype)


def _gated_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dtype = TORCH_DTYPES[problem.dtype]
    m, n = problem.m, problem.n
    x, z = scaled_randn((m, n), gen, device, dtype), scaled_randn((m, n), gen, device, dtype, scale=2.0)
    return x, z, scaled_randn((problem.k,), gen, device, dtype)


def _rows_output(problem: Problem, device: torch.device) -> torch.Tensor:
    return torch.empty((problem.m, problem.n), dtype=TORCH_DTYPES[problem.dtype], device=device)


def _two_rows_outputs(problem: Problem, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows_output(problem, device), _rows_output(problem, device)


def _norm_reference(gemma: bool) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    def reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, w = inputs
        w64 = w.double() + 1.0 if gemma else w.double()
        return rms_scaled(x.double(), x.shape[1]) * w64

    return reference


def _fused_add_reference(gemma: bool) -> Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, torch.Tensor]]:
    def reference(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual, w = inputs
        s = x.double() + residual.double()
        w64 = w.double() + 1.0 if gemma else w.double()
        return rms_scaled(s, s.shape[1]) * w64, s

    return reference


def _gated_reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, z, w = inputs
    m, n = x.shape
    group = w.shape[0]
    z64 = z.double()
    gate = z64 * torch.sigmoid(z64)
    return (rms_scaled(x.double(), group).reshape(m, n // group, group) * w.double()).reshape(m, n) * gate


def _norm_bound(roundings: int) -> Callable[[Problem, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]:
    """Per-element bound of a norm: ``roundings`` BF16 roundings + fp32 reduction.

    y_i = s_i * rstd * w_i is a product, so every error is relative to |y_i|:
    one BF16 rounding of a factor or of the result costs r = 2u (u = 2^-8;
    2u covers truncation, as the GEMV bound). Allowed roundings, as vLLM's own
    kernels do (tunekit's VLLM_ROUNDING=1):
      rms_norm (x*w): x*rstd before the weight multiply, the output   -> 2
      gemma_rms_norm (x*(1+w)): the output (one more allowed)          -> 2
      gated_rms_norm: the output (one more allowed, e.g. before gating) -> 2
    The fp32 sum of the group's squares errs by at most group*u32 relative
    (gamma_n, any order) and rstd by half of it; the few fp32 products and
    the gate's exp/sigmoid add under 16 u32. The floor 2^-126 admits
    flush-to-zero of results below the normal range.
    Mistakes this catches: a (1 + w) / w mix-up, a wrong group, a missing
    gate or an eps of the wrong order all change y by O(1); a kernel that
    drops a fraction f of a row from the sum of squares errs by ~f/2, caught
    when f > 4r; smaller slips are what the bit-exact tests of the Triton and
    HIP kernels (tests/test_elementwise_*.py) and numerics="exact" are for.
    """

    def bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
        r = 2 * UNIT_ROUNDOFF[problem.dtype]
        return (roundings * r + (problem.k + 16) * FP32_U) * ref.abs() + TINY

    return bound


def _fused_add_bound(problem: Problem, inputs: tuple[torch.Tensor, ...],
                     ref: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds of (y, residual_out) of a fused add + RMSNorm.

    y: four BF16 roundings r = 2u relative to |y_i| (see ``_norm_bound``): the
    residual sum rounded to BF16 before the variance (vLLM's CUDA kernel, and
    eager PyTorch adding two BF16 tensors) perturbs s_i by r and, through the
    mean of squares, rstd by at most r; x*rstd rounded before the weight
    multiply (plain weight, vLLM's CUDA kernel); the output. Whether the sum
    is rounded before the variance is the one numerics choice here that
    matters; the bound admits both, the rounding-location tests tell them apart.
    residual_out: the sum of two BF16 values is exact in fp32 (or one fp32
    rounding), then rounded once to BF16: r relative.
    """
    y, s = ref
    r = 2 * UNIT_ROUNDOFF[problem.dtype]
    y_bound = (4 * r + (problem.n + 16) * FP32_U) * y.abs() + TINY
    return y_bound, (r + FP32_U) * s.abs() + TINY


def _norm_bytes(problem: Problem) -> int:
    return (2 * problem.m * problem.n + problem.n) * DTYPE_BYTES[problem.dtype]  # x in, y out, w


def _fused_add_bytes(problem: Problem) -> int:
    # x, residual in; y, residual out; w
    return (4 * problem.m * problem.n + problem.n) * DTYPE_BYTES[problem.dtype]


def _gated_bytes(problem: Problem) -> int:
    return (3 * problem.m * problem.n + problem.k) * DTYPE_BYTES[problem.dtype]  # x, z in; y out; w[k]


def _silu_and_mul_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    # std 2: both SiLU regimes (~linear, ~zero) and its curved middle are hit.
    return (scaled_randn((problem.m, problem.k), gen, device, TORCH_DTYPES[problem.dtype], scale=2.0),)


def _silu_and_mul_reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    (x,) = inputs
    d = x.shape[1] // 2
    a, b = x[:, :d].double(), x[:, d:].double()
    return a * torch.sigmoid(a) * b


def _silu_and_mul_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
    """Two BF16 roundings, r = 2u each, relative to |y|: silu(a) rounded before the
    multiply (vLLM's CUDA act_and_mul kernel and eager PyTorch both do) and the
    output. fp32 exp / divide / multiply: under 64 u32 (the exponent a is exact,
    exp's relative error passes to sigmoid damped by 1 - sigmoid)."""
    r = 2 * UNIT_ROUNDOFF[problem.dtype]
    return (2 * r + 64 * FP32_U) * ref.abs() + TINY


def _silu_and_mul_bytes(problem: Problem) -> int:
    return (problem.m * problem.k + problem.m * problem.n) * DTYPE_BYTES[problem.dtype]


def _bias_gelu_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dtype = TORCH_DTYPES[problem.dtype]
    x = scaled_randn((problem.m, problem.n), gen, device, dtype, scale=2.0)
    return x, scaled_randn((problem.n,), gen, device, dtype)


def _gelu_tanh64(v: torch.Tensor) -> torch.Tensor:
    # 0.5 v (1 + tanh(t/2)) == v * sigmoid(t), t = 2c(v + a v^3): no cancellation.
    return v * torch.sigmoid(2.0 * _GELU_C * (v + _GELU_A * v.pow(3)))


def _bias_gelu_reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, b = inputs
    return _gelu_tanh64(x.double() + b.double())


def _bias_gelu_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
    """Output rounding r|g| plus the effect of rounding v = x + b to BF16 first
    (eager PyTorch ``F.gelu(x + b)``; tunekit's VLLM_ROUNDING=1): |v g'(v)| r,
    which for negative v exceeds |g| many times (GELU's relative condition
    number reaches ~35 at v = -5). fp32 exp/divide: 32 u32 on both terms.
    Plus 8 u32 |v| absolute: PyTorch's own tanh form, 0.5 v (1 + tanh(.)) in
    fp32, cancels where tanh ~ -1 (v < -3: it returns -0.0 for a true
    -9e-8 at v = -5.1); that form is the reference composition, so it must
    pass. The slack is far below the output rounding wherever |g| > 2^-8 |v|."""
    x, b = inputs
    v = x.double() + b.double()
    t = 2.0 * _GELU_C * (v + _GELU_A * v.pow(3))
    sig = torch.sigmoid(t)
    slope = sig + v * sig * (1.0 - sig) * 2.0 * _GELU_C * (1.0 + 3.0 * _GELU_A * v.pow(2))
    r = 2 * UNIT_ROUNDOFF[problem.dtype]
    sensitivity = (v * slope).abs()
    return (r + 32 * FP32_U) * ref.abs() + (r + 32 * FP32_U) * sensitivity + 8 * FP32_U * v.abs() + TINY


def _bias_gelu_bytes(problem: Problem) -> int:
    return (2 * problem.m * problem.n + problem.n) * DTYPE_BYTES[problem.dtype]


def _elementwise(name: str, **fields) -> OpSpec:
    return OpSpec(name=name, limit="copy", max_copies=ELEMENTWISE_MAX_COPIES, **fields)


RMS_NORM = _elementwise(
    "rms_norm", make_inputs=_norm_inputs, make_output=_rows_output, reference=_norm_reference(gemma=False),
    error_bound=_norm_bound(2), bytes_moved=_norm_bytes, rotated_input=(0,),
)
GEMMA_RMS_NORM = _elementwise(
    "gemma_rms_norm", make_inputs=_norm_inputs, make_output=_rows_output, reference=_norm_reference(gemma=True),
    error_bound=_norm_bound(2), bytes_moved=_norm_bytes, rotated_input=(0,),
)
FUSED_ADD_RMS_NORM = _elementwise(
    "fused_add_rms_norm", make_inputs=_fused_add_inputs, make_output=_two_rows_outputs,
    reference=_fused_add_reference(gemma=False), error_bound=_fused_add_bound, bytes_moved=_fused_add_bytes,
    rotated_input=(0, 1), output_names=("out", "residual_out"),
)
GEMMA_FUSED_ADD_RMS_NORM = _elementwise(
    "gemma_fused_add_rms_norm", make_inputs=_fused_add_inputs, make_output=_two_rows_outputs,
    reference=_fused_add_reference(gemma=True), error_bound=_fused_add_bound, bytes_moved=_fused_add_bytes,
    rotated_input=(0, 1), output_names=("out", "residual_out"),
)
GATED_RMS_NORM = _elementwise(
    "gated_rms_norm", make_inputs=_gated_inputs, make_output=_rows_output, reference=_gated_reference,
    error_bound=_norm_bound(2), bytes_moved=_gated_bytes, rotated_input=(0, 1),
)
SILU_AND_MUL = _elementwise(
    "silu_and_mul", make_inputs=_silu_and_mul_inputs, make_output=_rows_output,
    reference=_silu_and_mul_reference, error_bound=_silu_and_mul_bound, bytes_moved=_silu_and_mul_bytes,
    rotated_input=(0,),
)
BIAS_GELU = _elementwise(
    "bias_gelu", make_inputs=_bias_gelu_inputs, make_output=_rows_output, reference=_bias_gelu_reference,
    error_bound=_bias_gelu_bound, bytes_moved=_bias_gelu_bytes, rotated_input=(0,),
)

#: every elementwise op, in the registry's order
SPECS: tuple[OpSpec, ...] = (RMS_NORM, GEMMA_RMS_NORM, FUSED_ADD_RMS_NORM, GEMMA_FUSED_ADD_RMS_NORM, GATED_RMS_NORM,
                             SILU_AND_MUL, BIAS_GELU)
