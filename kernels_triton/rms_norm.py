"""Triton RMSNorm family: y[M, N] = x / rms(x) * w (``rms_norm``) or * (1 + w) (``gemma_rms_norm``).

BF16 in and out, FP32 math: rms(x) = sqrt(mean(x^2) + eps) per row. The
caller passes an explicit ``RmsNormConfig`` (no autotuning here); ``DEFAULT``
is valid for every N and M.

Design, for a memory-bound op:
- one program owns ROWS rows as a [ROWS, BLOCK_N] tile; BLOCK_N >= N keeps a
  row in registers (one pass: x read once); BLOCK_N < N walks the row in
  BLOCK_N chunks twice (sum of squares, then normalise; the second read of x
  mostly hits L2). BLOCK_N above next_pow2(N) acts as next_pow2(N);
- in Triton the vector width and loads per thread follow from the tile:
  BLOCK_N / (32 * num_warps) elements per thread, split into 16-byte vectors
  by the compiler (tunekit_hip's rms_norm.hip exposes VEC explicitly);
- a row is never split over programs: a hidden-size row is 2-16 KB, which one
  program reads in one or two loads per thread, and a cross-program reduction
  would cost a second launch or a grid-wide wait (more than the ~1 us a row
  takes at M = 1).

Numerics (where rounding to BF16 happens), ``VLLM_ROUNDING``:
- 1 (default, fixed in search_spaces/rms_norm.toml): as vLLM's own kernels.
  Plain weight: t = bf16(x * rstd), y = bf16(t * w), as csrc rms_norm_kernel
  (``((scalar_t)(x * s_variance)) * weight``). Gemma weight: y = bf16(x * rstd
  * (1 + w)) with 1 + w in fp32, as vLLM's GemmaRMSNorm.forward_static (there
  is no CUDA kernel for it).
- 0: fp32 throughout, the output rounded once (y = bf16(x * rstd * w)).
``rounded_reference`` is the same math in torch with the same roundings; the
tests compare bits with it. Every rounding is to nearest even, on GPUs and on
the CPU interpreter alike (see ``kernels_triton.rounding``). The sum of
squares is fp32 in tl.sum's order, so bits depend on BLOCK_N and ROWS' layout
only through that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton import pdl
from kernels_triton.config import StrictConfig, is_pow2, next_pow2
from kernels_triton.rounding import RNE_BY_BITS, round_bf16

#: The ops this module serves (the weight convention is in the op name).
OPS = ("rms_norm", "gemma_rms_norm")


@dataclass(frozen=True)
class RmsNormConfig(StrictConfig):
    BLOCK_N: int = 1024  # columns per step; >= N: the row stays in registers (one pass)
    ROWS: int = 1  # rows per program
    num_warps: int = 4
    VLLM_ROUNDING: int = 1  # 1: round where vLLM's kernels do (module docstring); 0: fp32 throughout


Config = RmsNormConfig
#: Valid for every N and M (the fallback / "tactic -1" config).
DEFAULT = RmsNormConfig()

#: fp32 tile elements per thread before Triton spills (as the GEMV's budget).
MAX_TILE_PER_THREAD = 128


def tile_reason(block: int, rows: int, num_warps: int, tiles: int = 1) -> str | None:
    """Shared register-budget rule of the norm kernels: ``tiles`` live [rows, block] fp32 tiles."""
    for name, value in (("BLOCK", block), ("ROWS", rows), ("num_warps", num_warps)):
        if not is_pow2(value):
            return f"{name}={value} is not a power of two"
    if num_warps > 32:
        return f"num_warps={num_warps} > 32"
    threads = 32 * num_warps
    if tiles * rows * block > MAX_TILE_PER_THREAD * threads:
        return f"{tiles} x [{rows}, {block}] fp32 tile(s) exceed {MAX_TILE_PER_THREAD} values per thread"
    # A tile smaller than the threads is legal (Triton replicates it): tiny rows
    # must stay valid with the default config.
    return None


def effective_block(config_block: int, n: int) -> int:
    """BLOCK_N used for a row of ``n``: never above next_pow2(n) (a larger tile only masks more)."""
    return min(config_block, next_pow2(n))


def invalid_reason(config: RmsNormConfig, m: int, n: int, k: int) -> str | None:
    """None if ``config`` can run an (m, n) RMSNorm, else a short reason. Pure predicate."""
    if m < 1 or n < 1:
        return f"empty problem (M={m}, N={n})"
    if k != n:
        return f"rms_norm normalises whole rows: K={k} must equal N={n}"
    if config.VLLM_ROUNDING not in (0, 1):
        return f"VLLM_ROUNDING={config.VLLM_ROUNDING} is not 0 or 1"
    if not is_pow2(config.BLOCK_N):
        return f"BLOCK_N={config.BLOCK_N} is not a power of two"
    return tile_reason(effective_block(config.BLOCK_N, n), config.ROWS, config.num_warps)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr,
    M, N, stride_xm, stride_ym, eps,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ONE_PASS: tl.constexpr,
    GEMMA: tl.constexpr, ROUND_NORMED: tl.constexpr, BY_BITS: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        pdl.release_then_wait()
    pid = tl.program_id(0)
    offs_m = pid * ROWS + tl.arange(0, ROWS)
    m_mask = offs_m < M
    # int64 row offsets: M * stride passes 2^31 at prefill sizes (4096 x 17408 x 2).
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    y_rows = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        mask = m_mask[:, None] & (cols[None, :] < N)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # w is loaded before the reduction so its latency overlaps x's instead
        # of following the cross-warp sum on every row's critical path
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        y = _apply_weight(x * rstd[:, None], w[None, :], GEMMA, ROUND_NORMED, BY_BITS)
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Sum of squares element-wise in a register tile, reduced once after the loop.
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + cols
            mask = m_mask[:, None] & (c[None, :] < N)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + cols
            mask = m_mask[:, None] & (c[None, :] < N)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
            y = _apply_weight(x * rstd[:, None], w[None, :], GEMMA, ROUND_NORMED, BY_BITS)
            tl.store(y_rows + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _apply_weight(normed, w, GEMMA: tl.constexpr, ROUND_NORMED: tl.constexpr, BY_BITS: tl.constexpr):
    """normed * w (or * (1 + w)), rounded to BF16 (returned as fp32, exact in BF16)."""
    if GEMMA:
        y = normed * (1.0 + w)
    else:
        if ROUND_NORMED:
            normed = round_bf16(normed, BY_BITS)
        y = normed * w
    return round_bf16(y, BY_BITS)


def rms_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    config: RmsNormConfig = DEFAULT,
    out: torch.Tensor | None = None,
    eps: float = 1e-6,
    gemma: bool = False,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    """y = x / rms(x) * w (``gemma``: * (1 + w)) with an explicit config; x [M, N], w [N], unit stride on N.
    ``use_pdl``: as ``kernels_triton.gemv.gemv``'s."""
    m, n = x.shape
    if w.shape != (n,):
        raise ValueError(f"x is [{m}, {n}] but w is {list(w.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if (n > 1 and (x.stride(1) != 1 or out.stride(1) != 1)) or w.stride(0) != 1:
        raise ValueError("rms_norm needs unit stride along N")
    block = effective_block(config.BLOCK_N, n)
    on = pdl.enabled(x.device, use_pdl)
    _rms_norm_kernel[(triton.cdiv(m, config.ROWS),)](
        x, w, out, m, n, x.stride(0), out.stride(0), eps,
        BLOCK_N=block, ROWS=config.ROWS, ONE_PASS=block >= n,
        GEMMA=gemma, ROUND_NORMED=bool(config.VLLM_ROUNDING) and not gemma, BY_BITS=RNE_BY_BITS,
        PDL=on, num_warps=config.num_warps, **pdl.launch_options(on),
    )
    return out


def launch(op: str, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, config: RmsNormConfig,
           eps: float = 1e-6) -> None:
    """The backend's entry: ``inputs = (x, w)`` as tunekit.problems.opspec makes them."""
    x, w = inputs
    rms_norm(x, w, config, out=out, eps=eps, gemma=op == "gemma_rms_norm")


def reference(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, gemma: bool = False) -> torch.Tensor:
    """fp64 reference on the same (BF16) values."""
    x64 = x.double()
    w64 = w.double() + 1.0 if gemma else w.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64


def rounded_reference(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, gemma: bool = False,
                      vllm_rounding: int = 1) -> torch.Tensor:
    """The kernel's arithmetic in torch fp32, rounding to BF16 exactly where the kernel does."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + w.float())).to(torch.bfloat16)
    if vllm_rounding:
        normed = normed.to(torch.bfloat16).float()
    return (normed * w.float()).to(torch.bfloat16)
