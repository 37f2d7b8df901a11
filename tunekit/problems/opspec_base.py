"""What an op *is*, independent of any implementation: the ``OpSpec`` protocol and the arithmetic the ops share.

An ``OpSpec`` says how to make fresh random inputs for a problem, how to
compute its fp64 reference, the per-element error bound an implementation in
the problem's dtype must meet, and how many bytes one call must move (the
roofline numerator). ``verify.py`` and ``bench.py`` are written against this
interface only, so a new op plugs in as one more spec of a family module.

Call protocol of a kernel of an op: ``kernel(inputs, out)`` with ``inputs`` the
tuple ``make_inputs`` returns and ``out`` what ``make_output`` returns: one
tensor, or a tuple of tensors for an op with several outputs
(``fused_add_rms_norm``: ``(y, residual_out)``). The reference and the bound
then are tuples in the same order; verification poisons, checks and compares
every output (``output_names`` label them in messages).

The ops themselves live by family, each importing this module:

* ``tunekit.problems.opspec_gemv``: the GEMV and the fused GEMV families
  (a norm or SiLU-and-mul in its prologue; a residual, an RMS scale or
  SiLU-and-mul in its epilogue);
* ``tunekit.problems.opspec_elementwise``: the norms and the pointwise ops.

:func:`tunekit.problems.opspec.get` (and ``OPS``, op name -> spec) is the
registry over both, on top of them; callers import the protocol from there.

``EPS`` is the norms' epsilon in verification (kernels take eps at run time;
it changes neither the code nor the cost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tunekit.problems.shapes import Problem

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: Unit roundoff u of each storage dtype (2^-precision bits). The output of a
#: kernel is rounded to this dtype once, so |y - ref| <= 2u|ref| covers the
#: final rounding even for a truncating conversion (the Triton CPU interpreter
#: truncates BF16; GPUs round to nearest, i.e. u|ref|).
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}
#: Unit roundoff of fp32, the kernels' accumulation type.
FP32_U = 2.0**-24
#: Smallest normal fp32 (= bf16) magnitude: results below it may be flushed to
#: zero by GPU fp32 arithmetic, so the elementwise bounds never go below it.
TINY = 2.0**-126

#: Norm epsilon used in verification (vLLM's default and that of every built-in
#: model but Llama-3.1's 1e-5; with unit-variance inputs it is invisible anyway).
EPS = 1e-6

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class OpSpec:
    name: str
    make_inputs: Callable[[Problem, torch.device, torch.Generator], tuple[torch.Tensor, ...]]
    #: one tensor, or a tuple of tensors for a multi-output op
    make_output: Callable[[Problem, torch.device], Outputs]
    reference: Callable[[tuple[torch.Tensor, ...]], Outputs]
    error_bound: Callable[[Problem, tuple[torch.Tensor, ...], Outputs], Outputs]
    bytes_moved: Callable[[Problem], int]
    #: index (or indices) of the inputs rotated over several copies while timing:
    #: the large operands that must come from DRAM (the GEMV weight; the
    #: activations of an elementwise op, large at M = 4096).
    rotated_input: int | tuple[int, ...]
    #: which measured bandwidth is this op's limit: "read" (a GEMV streams its
    #: weight, its writes are negligible) or "copy" (elementwise ops write about
    #: as much as they read, like a device copy).
    limit: str = "read"
    #: cap on the rotated copies (None: as many as 4x L2 needs). Tiny elementwise
    #: operands would need thousands of copies; see
    #: ``tunekit.problems.opspec_elementwise.ELEMENTWISE_MAX_COPIES``.
    max_copies: int | None = None
    #: labels of the outputs, in the order of make_output / reference
    output_names: tuple[str, ...] = ("out",)

    @property
    def rotated_inputs(self) -> tuple[int, ...]:
        rotated = self.rotated_input
        return (rotated,) if isinstance(rotated, int) else tuple(rotated)


def scaled_randn(shape: tuple[int, ...], gen: torch.Generator, device: torch.device, dtype: torch.dtype,
                 scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """N(shift, scale^2) values drawn in fp32 from ``gen``, then stored in ``dtype``."""
    out = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return out.mul_(scale).add_(shift).to(dtype)


def rms_scaled(s: torch.Tensor, group: int) -> torch.Tensor:
    """fp64 s / rms(s) over groups of ``group`` elements of each row (``EPS`` inside the root)."""
    m, n = s.shape
    g = s.reshape(m, n // group, group)
    return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + EPS)).reshape(m, n)
