"""A toy op added to tunekit through one record: every file an op needs, here in one module, and its record.

``toy_scale``: y[M, N] = x[M, N] * w[N] (BF16 in and out, fp32 math, rounded once). What a new op brings:

* its problem spec (:data:`SPEC`: inputs, fp64 reference, error bound, bytes moved);
* its Triton kernel with the backend's protocol (:class:`Config` with ``from_params``, :func:`invalid_reason`,
  :func:`launch`) and its search space (``tests/data/toy_scale.toml``);
* the eager composition the vendor baseline times (:func:`vendor`);
* its serving impl (on ``tunekit.ops.serve_elementwise``, as the built-in elementwise ops), fake impl and stock
  composition;
* and :data:`RECORD`, which names them all: ``tunekit.problems.oprecords.register(RECORD)`` then
  ``tunekit.ops.register()`` make it a ``torch.ops.tunekit.toy_scale`` served from a table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from tunekit.problems.oprecords import OpRecord
from tunekit.problems.opspec_base import TINY, UNIT_ROUNDOFF, OpSpec, scaled_randn

OP = "toy_scale"
OPS = (OP,)


# ----------------------------------------------------------------------------- the spec


def _inputs(problem, device, gen):
    x = scaled_randn((problem.m, problem.n), gen, device, torch.bfloat16)
    w = scaled_randn((problem.n,), gen, device, torch.bfloat16, shift=1.0)
    return x, w


def _output(problem, device):
    return torch.empty((problem.m, problem.n), dtype=torch.bfloat16, device=device)


def _reference(inputs):
    x, w = inputs
    return x.double() * w.double()


def _bound(problem, inputs, ref):
    return 2 * UNIT_ROUNDOFF[problem.dtype] * ref.abs() + TINY  # one rounding of an exact product


SPEC = OpSpec(name=OP, make_inputs=_inputs, make_output=_output, reference=_reference, error_bound=_bound,
              bytes_moved=lambda p: 2 * (2 * p.m * p.n + p.n), rotated_input=(0,), limit="copy", max_copies=4)


# ----------------------------------------------------------------------------- the Triton kernel


@dataclass(frozen=True)
class Config:
    BLOCK_N: int = 64
    num_warps: int = 4

    @classmethod
    def from_params(cls, params: dict) -> Config:
        return cls(**params)  # TypeError for a name the kernel does not have


def invalid_reason(config: Config, m: int, n: int, k: int) -> str | None:
    if k != n:
        return f"toy_scale is [M, N] -> [M, N]: K={k} must equal N={n}"
    if config.BLOCK_N & (config.BLOCK_N - 1):
        return f"BLOCK_N={config.BLOCK_N} is not a power of two"
    return None


@triton.jit
def _scale_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (x * w).to(y_ptr.dtype.element_ty), mask=mask)


def launch(op: str, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, config: Config, eps: float = 1e-6) -> None:
    x, w = inputs
    m, n = x.shape
    grid = (m, triton.cdiv(n, config.BLOCK_N))
    _scale_kernel[grid](x, w, out, n, x.stride(0), out.stride(0), BLOCK_N=config.BLOCK_N,
                        num_warps=config.num_warps)


# ----------------------------------------------------------------------------- baseline and serving


def vendor(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
    x, w = inputs
    torch.mul(x, w, out=out)


def stock(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * weight


def fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def toy_scale_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from tunekit import ops

    n = x.shape[-1] if x.dim() else 0
    m = x.numel() // n if n else 0
    return ops.serve_elementwise(
        OP, (x,), weight, (m, n, n), None,
        make_out=lambda m, n, x: x.new_empty((m, n)),
        kernel_inputs=lambda m, n: (x.view(m, n), weight),
        vendor=lambda: stock(x, weight),
        finish=lambda out: out.view(x.shape),
        vendor_args=(x, weight),
    )


# ----------------------------------------------------------------------------- the one record

RECORD = OpRecord(
    OP, "elementwise", "toy", spec="toy_op:SPEC", space=str(Path(__file__).parent / "data" / "toy_scale.toml"),
    kernels={"triton": "toy_op"}, vendor="toy_op:vendor", schema="toy_scale(Tensor x, Tensor weight) -> Tensor",
    impl="toy_op:toy_scale_impl", fake="toy_op:fake", stock="toy_op:stock",
)
