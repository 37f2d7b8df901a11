"""Triton fused add + RMSNorm: s = x + residual; y = s / rms(s) * w (or * (1 + w)); returns (y, s).

Ops ``fused_add_rms_norm`` (plain weight) and ``gemma_fused_add_rms_norm``
(Qwen3.5: * (1 + w)). BF16 in and out, FP32 math. The updated residual s is
an output (``residual_out``); vLLM's in-place form ``fused_add_rms_norm(x,
residual)`` is ``out=(x, residual)``, which is alias-safe in the one-pass
path (BLOCK_N >= N: every element is loaded before any is stored); the
chunked path re-reads x and residual in its second pass, so it needs
separate outputs.

Design as ``kernels_triton.rms_norm`` (tile [ROWS, BLOCK_N], one pass when the
row fits, else two chunked passes; no row split over programs), with two
fp32 tiles (x and residual) live in the one-pass path.

Numerics (where rounding to BF16 happens), ``VLLM_ROUNDING``:
- 1 (default, fixed in search_spaces/fused_add_rms_norm.toml): as vLLM. The
  sum is rounded to BF16 *before* the variance (csrc fused_add_rms_norm_kernel
  adds in scalar_t: ``z += residual``; GemmaRMSNorm.forward_static adds two
  BF16 tensors), so y is the norm of exactly the residual that is stored and
  that the next layer reads. Plain weight: also t = bf16(s * rstd) before
  * w, as the CUDA kernel; Gemma: y = bf16(s * rstd * (1 + w)).
- 0: the variance of the fp32 sum, y rounded once; residual_out is still the
  rounded sum (it is BF16). This is what vLLM's forward_native computes in
  fp32 and what Inductor produced for the Gemma composition on the CPU
  (torch 2.13: it does not round the BF16 intermediate ``x + residual``).
``rounded_reference`` is the same math in torch with the same roundings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton import pdl
from kernels_triton.config import StrictConfig
from kernels_triton.rms_norm import _apply_weight, effective_block, tile_reason
from kernels_triton.rounding import RNE_BY_BITS, round_bf16

OPS = ("fused_add_rms_norm", "gemma_fused_add_rms_norm")


@dataclass(frozen=True)
class FusedAddRmsNormConfig(StrictConfig):
    BLOCK_N: int = 1024  # columns per step; >= N: one pass, row in registers (and alias-safe)
    ROWS: int = 1  # rows per program
    num_warps: int = 4
    VLLM_ROUNDING: int = 1  # 1: sum rounded before the variance, as vLLM (module docstring); 0: fp32 sum


Config = FusedAddRmsNormConfig
#: Valid for every N and M.
DEFAULT = FusedAddRmsNormConfig()


def invalid_reason(config: FusedAddRmsNormConfig, m: int, n: int, k: int) -> str | None:
    """None if ``config`` can run an (m, n) fused add + RMSNorm, else a short reason. Pure predicate."""
    if m < 1 or n < 1:
        return f"empty problem (M={m}, N={n})"
    if k != n:
        return f"fused_add_rms_norm normalises whole rows: K={k} must equal N={n}"
    if config.VLLM_ROUNDING not in (0, 1):
        return f"VLLM_ROUNDING={config.VLLM_ROUNDING} is not 0 or 1"
    if config.BLOCK_N < 1 or config.BLOCK_N & (config.BLOCK_N - 1):
        return f"BLOCK_N={config.BLOCK_N} is not a power of two"
    block = effective_block(config.BLOCK_N, n)
    # one pass holds x and residual tiles at once; the chunked path one tile + the accumulator
    return tile_reason(block, config.ROWS, config.num_warps, tiles=2)


@triton.jit
def _sum(x_rows, r_rows, c, mask, ROUND_SUM: tl.constexpr, BY_BITS: tl.constexpr):
    s = tl.load(x_rows + c, mask=mask, other=0.0).to(tl.float32) + tl.load(
        r_rows + c, mask=mask, other=0.0).to(tl.float32)
    if ROUND_SUM:
        s = round_bf16(s, BY_BITS)
    return s


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, o_ptr,
    M, N, stride_xm, stride_rm, stride_ym, stride_om, eps,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ONE_PASS: tl.constexpr,
    GEMMA: tl.constexpr, ROUND_SUM: tl.constexpr, ROUND_NORMED: tl.constexpr, BY_BITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:
        pdl.release_then_wait()
    pid = tl.program_id(0)
    offs_m = pid * ROWS + tl.arange(0, ROWS)
    m_mask = offs_m < M
    rows64 = offs_m.to(tl.int64)[:, None]
    x_rows = x_ptr + rows64 * stride_xm
    r_rows = r_ptr + rows64 * stride_rm
    y_rows = y_ptr + rows64 * stride_ym
    o_rows = o_ptr + rows64 * stride_om
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        mask = m_mask[:, None] & (cols[None, :] < N)
        s = _sum(x_rows, r_rows, cols[None, :], mask, ROUND_SUM, BY_BITS)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)  # before the reduction (rms_norm.py)
        tl.store(o_rows + cols[None, :], round_bf16(s, BY_BITS).to(o_ptr.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(s * s, axis=1) / N + eps)
        y = _apply_weight(s * rstd[:, None], w[None, :], GEMMA, ROUND_NORMED, BY_BITS)
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + cols
            mask = m_mask[:, None] & (c[None, :] < N)
            s = _sum(x_rows, r_rows, c[None, :], mask, ROUND_SUM, BY_BITS)
            tl.store(o_rows + c[None, :], round_bf16(s, BY_BITS).to(o_ptr.dtype.element_ty), mask=mask)
            acc += s * s
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + cols
            mask = m_mask[:, None] & (c[None, :] < N)
            # x + residual again from the inputs (mostly L2 hits): the fp32 sum
            # of VLLM_ROUNDING=0 is not what residual_out holds.
            s = _sum(x_rows, r_rows, c[None, :], mask, ROUND_SUM, BY_BITS)
            w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
            y = _apply_weight(s * rstd[:, None], w[None, :], GEMMA, ROUND_NORMED, BY_BITS)
            tl.store(y_rows + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    config: FusedAddRmsNormConfig = DEFAULT,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
    gemma: bool = False,
    use_pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, x + residual) with an explicit config; x, residual [M, N], w [N]; ``out`` = (y, residual_out).
    ``use_pdl``: as ``kernels_triton.gemv.gemv``'s."""
    m, n = x.shape
    if residual.shape != (m, n) or w.shape != (n,):
        raise ValueError(f"x is [{m}, {n}], residual {list(residual.shape)}, w {list(w.shape)}")
    if out is None:
        out = (torch.empty_like(x), torch.empty_like(x))
    y, res_out = out
    block = effective_block(config.BLOCK_N, n)
    if block < n and (y.data_ptr() in (x.data_ptr(), residual.data_ptr())
                      or res_out.data_ptr() in (x.data_ptr(), residual.data_ptr())):
        raise ValueError("in-place fused_add_rms_norm needs a one-pass config (BLOCK_N >= N)")
    if n > 1 and any(t.stride(1) != 1 for t in (x, residual, y, res_out)):
        raise ValueError("fused_add_rms_norm needs unit stride along N")
    on = pdl.enabled(x.device, use_pdl)
    _fused_add_rms_norm_kernel[(triton.cdiv(m, config.ROWS),)](
        x, residual, w, y, res_out, m, n,
        x.stride(0), residual.stride(0), y.stride(0), res_out.stride(0), eps,
        BLOCK_N=block, ROWS=config.ROWS, ONE_PASS=block >= n, GEMMA=gemma,
        ROUND_SUM=bool(config.VLLM_ROUNDING), ROUND_NORMED=bool(config.VLLM_ROUNDING) and not gemma,
        BY_BITS=RNE_BY_BITS, PDL=on, num_warps=config.num_warps, **pdl.launch_options(on),
    )
    return y, res_out


def launch(op: str, inputs: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, torch.Tensor],
           config: FusedAddRmsNormConfig, eps: float = 1e-6) -> None:
    """The backend's entry: ``inputs = (x, residual, w)``, ``out = (y, residual_out)``."""
    x, residual, w = inputs
    fused_add_rms_norm(x, residual, w, config, out=out, eps=eps, gemma=op == "gemma_fused_add_rms_norm")


def reference(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float = 1e-6,
              gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 reference (y, s) on the same (BF16) values; s unrounded."""
    s = x.double() + residual.double()
    w64 = w.double() + 1.0 if gemma else w.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w64, s


def rounded_reference(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float = 1e-6,
                      gemma: bool = False, vllm_rounding: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in torch fp32, rounding to BF16 exactly where the kernel does."""
    s = x.float() + residual.float()
    if vllm_rounding:
        s = s.to(torch.bfloat16).float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        y = normed * (1.0 + w.float())
    else:
        if vllm_rounding:
            normed = normed.to(torch.bfloat16).float()
        y = normed * w.float()
    return y.to(torch.bfloat16), s.to(torch.bfloat16)
