"""What each op *is*, independent of any implementation.

An ``OpSpec`` says how to make fresh random inputs for a problem, how to
compute its fp64 reference, the per-element error bound an implementation in
the problem's dtype must meet, and how many bytes one call must move (the
roofline numerator). ``verify.py`` and ``bench.py`` are written against this
interface only, so a new op (elementwise, ...) plugs in here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tunekit.shapes import DTYPE_BYTES, Problem

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Unit roundoff u of each storage dtype (2^-precision bits). The output of a
# kernel is rounded to this dtype once, so |y - ref| <= 2u|ref| covers the
# final rounding even for a truncating conversion (the Triton CPU interpreter
# truncates BF16; GPUs round to nearest, i.e. u|ref|).
_UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}
_FP32_U = 2.0**-24


@dataclass(frozen=True)
class OpSpec:
    name: str
    make_inputs: Callable[[Problem, torch.device, torch.Generator], tuple[torch.Tensor, ...]]
    make_output: Callable[[Problem, torch.device], torch.Tensor]
    reference: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]
    error_bound: Callable[[Problem, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]
    bytes_moved: Callable[[Problem], int]
    #: index of the input that is rotated over several copies while timing
    #: (the large operand that must come from DRAM, e.g. the GEMV weight).
    rotated_input: int


def _gemv_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dtype = TORCH_DTYPES[problem.dtype]
    # Scaled so that |y| ~ 1: keeps the BF16 output in its normal range while
    # every weight element still carries a random, nonzero value.
    x = torch.randn((problem.m, problem.k), generator=gen, device=device, dtype=torch.float32)
    w = torch.randn((problem.n, problem.k), generator=gen, device=device, dtype=torch.float32)
    w.mul_(problem.k**-0.5)
    return x.to(dtype), w.to(dtype)


def _gemv_output(problem: Problem, device: torch.device) -> torch.Tensor:
    return torch.empty((problem.m, problem.n), dtype=TORCH_DTYPES[problem.dtype], device=device)


def _gemv_reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, w = inputs
    return x.double() @ w.double().T


def _gemv_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
    """Per-element bound: output rounding + worst-case fp32 accumulation.

    |y - ref| <= 2u_out |ref| + K * u_fp32 * (|x| @ |W|^T) + tiny absolute floor.
    The second term is the classic gamma_K bound for recursive summation in
    fp32, valid for any reduction order (tree, split-K, sequential). A kernel
    that drops or repeats a K chunk errs by O(|x_i w_i| sqrt(chunk)), orders of
    magnitude above this bound at the sizes we test.
    """
    x, w = inputs
    abs_dot = x.double().abs() @ w.double().abs().T
    u_out = _UNIT_ROUNDOFF[problem.dtype]
    return 2 * u_out * ref.abs() + problem.k * _FP32_U * abs_dot + 1e-30


def _gemv_bytes(problem: Problem) -> int:
    size = DTYPE_BYTES[problem.dtype]
    return problem.n * problem.k * size + problem.m * (problem.k + problem.n) * size


GEMV = OpSpec(
    name="gemv",
    make_inputs=_gemv_inputs,
    make_output=_gemv_output,
    reference=_gemv_reference,
    error_bound=_gemv_bound,
    bytes_moved=_gemv_bytes,
    rotated_input=1,
)

OPS: dict[str, OpSpec] = {"gemv": GEMV}


def get(op: str) -> OpSpec:
    try:
        return OPS[op]
    except KeyError:
        raise KeyError(f"unknown op {op!r} (known: {', '.join(sorted(OPS))})") from None
