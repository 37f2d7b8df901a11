"""Triton SiLU-and-mul: y[M, N] = silu(x[:, :N]) * x[:, N:] for x [M, 2N] (the SwiGLU MLP activation).

BF16 in and out, FP32 math, silu(a) = a / (1 + exp(-a)) as vLLM's kernel.
No reduction: a program owns a [ROWS, BLOCK_N] tile of the output, and the
1D grid covers rows x column blocks (column blocks fastest), so at M = 1 one
row is split over cdiv(N, BLOCK_N) programs (17408 / 1024 = 17 for Qwen3.5-27B).

Numerics, ``VLLM_ROUNDING``:
- 1 (default, fixed in search_spaces/silu_and_mul.toml): t = bf16(silu(a)),
  y = bf16(t * b), as vLLM's csrc act_and_mul_kernel (``ACT_FN(x) * y`` with
  ACT_FN returning scalar_t) and eager ``F.silu(a) * b`` (two BF16 ops);
- 0: y = bf16(silu(a) * b), one rounding (what Inductor fuses it into).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton import pdl
from kernels_triton.config import StrictConfig
from kernels_triton.rms_norm import tile_reason
from kernels_triton.rounding import RNE_BY_BITS, round_bf16
from kernels_triton.tiles import pointwise_grid, tile_offsets

OPS = ("silu_and_mul",)


@dataclass(frozen=True)
class SiluAndMulConfig(StrictConfig):
    BLOCK_N: int = 1024  # output columns per program
    ROWS: int = 1  # rows per program
    num_warps: int = 4
    VLLM_ROUNDING: int = 1  # 1: silu rounded to BF16 before the multiply (vLLM); 0: one rounding


Config = SiluAndMulConfig
#: Valid for every N and M.
DEFAULT = SiluAndMulConfig()


def invalid_reason(config: SiluAndMulConfig, m: int, n: int, k: int) -> str | None:
    """None if ``config`` can run x [m, k] -> y [m, n] (k = 2n), else a short reason. Pure predicate."""
    if m < 1 or n < 1:
        return f"empty problem (M={m}, N={n})"
    if k != 2 * n:
        return f"silu_and_mul reads [M, 2N]: K={k} must be 2 * N={2 * n}"
    if config.VLLM_ROUNDING not in (0, 1):
        return f"VLLM_ROUNDING={config.VLLM_ROUNDING} is not 0 or 1"
    # a and b tiles are live together
    return tile_reason(config.BLOCK_N, config.ROWS, config.num_warps, tiles=2)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, y_ptr, M, N, stride_xm, stride_ym,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ROUND_ACT: tl.constexpr, BY_BITS: tl.constexpr,
    GRID_2D: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        pdl.release_then_wait()
    offs_m, cols = tile_offsets(N, BLOCK_N, ROWS, GRID_2D)  # column blocks fastest (tiles.py)
    mask = (offs_m < M)[:, None] & (cols < N)[None, :]
    rows64 = offs_m.to(tl.int64)[:, None]
    a_ptrs = x_ptr + rows64 * stride_xm + cols[None, :]
    a = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(a_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    act = a / (1.0 + tl.exp(-a))
    if ROUND_ACT:
        act = round_bf16(act, BY_BITS)
    y = round_bf16(act * b, BY_BITS)
    tl.store(y_ptr + rows64 * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, config: SiluAndMulConfig = DEFAULT, out: torch.Tensor | None = None,
                 use_pdl: bool | None = None) -> torch.Tensor:
    """y = silu(x[:, :N]) * x[:, N:] with an explicit config; x [M, 2N], unit stride on the last dim.
    ``use_pdl``: as ``kernels_triton.gemv.gemv``'s."""
    m, k = x.shape
    if k % 2:
        raise ValueError(f"x is [{m}, {k}]: the last dim must be even")
    n = k // 2
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if x.stride(1) != 1 or (n > 1 and out.stride(1) != 1):
        raise ValueError("silu_and_mul needs unit stride along the last dim")
    grid, grid_2d = pointwise_grid(m, n, config.ROWS, config.BLOCK_N)
    on = pdl.enabled(x.device, use_pdl)
    _silu_and_mul_kernel[grid](
        x, out, m, n, x.stride(0), out.stride(0),
        BLOCK_N=config.BLOCK_N, ROWS=config.ROWS, ROUND_ACT=bool(config.VLLM_ROUNDING), BY_BITS=RNE_BY_BITS,
        GRID_2D=grid_2d, PDL=on, num_warps=config.num_warps, **pdl.launch_options(on),
    )
    return out


def launch(op: str, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, config: SiluAndMulConfig,
           eps: float = 1e-6) -> None:
    """The backend's entry: ``inputs = (x,)`` (``eps`` unused; one signature for all elementwise ops)."""
    (x,) = inputs
    silu_and_mul(x, config, out=out)


def reference(x: torch.Tensor) -> torch.Tensor:
    """fp64 reference on the same (BF16) values."""
    n = x.shape[1] // 2
    a, b = x[:, :n].double(), x[:, n:].double()
    return a * torch.sigmoid(a) * b


def rounded_reference(x: torch.Tensor, vllm_rounding: int = 1) -> torch.Tensor:
    """The kernel's arithmetic in torch fp32, rounding to BF16 exactly where the kernel does."""
    n = x.shape[1] // 2
    a, b = x[:, :n].float(), x[:, n:].float()
    act = a / (1.0 + torch.exp(-a))
    if vllm_rounding:
        act = act.to(torch.bfloat16).float()
    return (act * b).to(torch.bfloat16)
