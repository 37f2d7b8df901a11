"""Triton bias + GELU (tanh approximation): y[M, N] = gelu_tanh(x[M, N] + b[N]).

BF16 in and out, FP32 math. gelu_tanh(v) = 0.5 v (1 + tanh(c (v + a v^3)))
is computed as v * sigmoid(2c (v + a v^3)) = v / (1 + exp(-2c (v + a v^3))):
the same function, without the cancellation of 1 + tanh for negative v and
without a tanh intrinsic (not portable across Triton's targets).

No built-in model runs bias + GELU (vLLM's Llama/Qwen families use SiLU MLPs
without bias); the op is tuned through ad-hoc problems, ``tunekit search
--shape bias_gelu:4096``. Grid and tunables as ``kernels_triton.silu_and_mul``.

Numerics, ``VLLM_ROUNDING`` (vLLM has no bias+GELU kernel; the reference
composition is eager PyTorch):
- 1 (default, fixed in search_spaces/bias_gelu.toml): v = bf16(x + b) before
  the GELU, as eager ``F.gelu(x + b, approximate="tanh")`` (a BF16 add);
- 0: v in fp32, y rounded once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton.config import StrictConfig
from kernels_triton.rms_norm import tile_reason
from kernels_triton.rounding import RNE_BY_BITS, round_bf16
from kernels_triton.tiles import pointwise_grid, tile_offsets

OPS = ("bias_gelu",)
#: 2 * sqrt(2 / pi) and GELU's cubic coefficient.
_TWO_C = 2.0 * math.sqrt(2.0 / math.pi)
_A = 0.044715
#: The same two constants for the jitted kernel: Triton's compiler only reads
#: module globals that are ``tl.constexpr`` (its interpreter reads any).
#: Written with the tensor as the left operand in the kernel: Triton >= 3.9's
#: interpreter returns a constexpr-wrapped tensor for ``constexpr * tensor``,
#: which ``tl.exp`` then rejects (the products are the same bits either way).
_NEG_TWO_C_K = tl.constexpr(-_TWO_C)
_A_K = tl.constexpr(_A)


@dataclass(frozen=True)
class BiasGeluConfig(StrictConfig):
    BLOCK_N: int = 1024  # columns per program
    ROWS: int = 1  # rows per program
    num_warps: int = 4
    VLLM_ROUNDING: int = 1  # 1: x + b rounded to BF16 before the GELU (eager PyTorch); 0: fp32


Config = BiasGeluConfig
#: Valid for every N and M.
DEFAULT = BiasGeluConfig()


def invalid_reason(config: BiasGeluConfig, m: int, n: int, k: int) -> str | None:
    """None if ``config`` can run an (m, n) bias + GELU, else a short reason. Pure predicate."""
    if m < 1 or n < 1:
        return f"empty problem (M={m}, N={n})"
    if k != n:
        return f"bias_gelu is [M, N] -> [M, N]: K={k} must equal N={n}"
    if config.VLLM_ROUNDING not in (0, 1):
        return f"VLLM_ROUNDING={config.VLLM_ROUNDING} is not 0 or 1"
    return tile_reason(config.BLOCK_N, config.ROWS, config.num_warps)


@triton.jit
def _bias_gelu_kernel(
    x_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_ym,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ROUND_SUM: tl.constexpr, BY_BITS: tl.constexpr,
    GRID_2D: tl.constexpr,
):
    offs_m, cols = tile_offsets(N, BLOCK_N, ROWS, GRID_2D)  # column blocks fastest (tiles.py)
    mask = (offs_m < M)[:, None] & (cols < N)[None, :]
    rows64 = offs_m.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    v = x + b[None, :]
    if ROUND_SUM:
        v = round_bf16(v, BY_BITS)
    y = round_bf16(v / (1.0 + tl.exp((v + v * _A_K * v * v) * _NEG_TWO_C_K)), BY_BITS)
    tl.store(y_ptr + rows64 * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def bias_gelu(x: torch.Tensor, b: torch.Tensor, config: BiasGeluConfig = DEFAULT,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """y = gelu_tanh(x + b) with an explicit config; x [M, N], b [N], unit stride on N."""
    m, n = x.shape
    if b.shape != (n,):
        raise ValueError(f"x is [{m}, {n}] but b is {list(b.shape)}")
    if out is None:
        out = torch.empty_like(x)
    if n > 1 and (x.stride(1) != 1 or out.stride(1) != 1):
        raise ValueError("bias_gelu needs unit stride along N")
    grid, grid_2d = pointwise_grid(m, n, config.ROWS, config.BLOCK_N)
    _bias_gelu_kernel[grid](
        x, b, out, m, n, x.stride(0), out.stride(0),
        BLOCK_N=config.BLOCK_N, ROWS=config.ROWS, ROUND_SUM=bool(config.VLLM_ROUNDING), BY_BITS=RNE_BY_BITS,
        GRID_2D=grid_2d, num_warps=config.num_warps,
    )
    return out


def launch(op: str, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, config: BiasGeluConfig,
           eps: float = 1e-6) -> None:
    """The backend's entry: ``inputs = (x, b)`` (``eps`` unused)."""
    x, b = inputs
    bias_gelu(x, b, config, out=out)


def reference(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp64 reference on the same (BF16) values."""
    v = x.double() + b.double()
    return v * torch.sigmoid(_TWO_C * (v + _A * v.pow(3)))


def rounded_reference(x: torch.Tensor, b: torch.Tensor, vllm_rounding: int = 1) -> torch.Tensor:
    """The kernel's arithmetic in torch fp32, rounding to BF16 exactly where the kernel does."""
    v = x.float() + b.float()
    if vllm_rounding:
        v = v.to(torch.bfloat16).float()
    return (v / (1.0 + torch.exp(-_TWO_C * (v + _A * v * v * v)))).to(torch.bfloat16)
