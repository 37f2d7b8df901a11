"""Triton gated RMSNorm: y = x / rms_group(x) * w * silu(z), per group of K elements.

As vLLM's RMSNormGated with norm_before_gate=True (Gated DeltaNet's output
norm): x, z, y are [M, N], N = G * K; each of the G groups of K elements of a
row (one linear-attention value head) is normalised on its own and w[K] is
shared by all groups (Qwen3.5-27B: G = 48 heads of K = 128 at TP=1).

Design: the M * G groups are the rows of the problem; a program owns ROWS of
them as a [ROWS, BLOCK_K] tile, BLOCK_K = next_pow2(K) (a group, 64-256
elements, always fits registers: one pass, x and z read once). At M = 1 the
row is thereby split over G / ROWS programs.

Numerics: fp32 throughout, the output rounded once to BF16 (nearest even) -
exactly where vLLM's Triton kernel (layernorm_gated.py) rounds, so there is
no vLLM-matching variant to offer. silu(z) = z * sigmoid(z) = z / (1 + exp(-z)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton import pdl
from kernels_triton.config import StrictConfig, next_pow2
from kernels_triton.rms_norm import tile_reason
from kernels_triton.rounding import RNE_BY_BITS, round_bf16

OPS = ("gated_rms_norm",)
#: Largest group held in registers (the default config's [4, 2048] x and z tiles
#: fill the register budget; real groups are head dims, 64-256).
MAX_GROUP = 2048


@dataclass(frozen=True)
class GatedRmsNormConfig(StrictConfig):
    ROWS: int = 4  # groups per program
    num_warps: int = 4


Config = GatedRmsNormConfig
#: Valid for every group size up to MAX_GROUP and every M.
DEFAULT = GatedRmsNormConfig()


def invalid_reason(config: GatedRmsNormConfig, m: int, n: int, k: int) -> str | None:
    """None if ``config`` can run groups of ``k`` over rows of ``n`` (M = ``m``), else why not. Pure."""
    if m < 1 or n < 1 or k < 1:
        return f"empty problem (M={m}, N={n}, K={k})"
    if n % k:
        return f"N={n} is not a whole number of groups of K={k}"
    if k > MAX_GROUP:
        return f"group of {k} > {MAX_GROUP} elements (kept in registers)"
    return tile_reason(next_pow2(k), config.ROWS, config.num_warps, tiles=2)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr,
    Q, G, K, stride_xm, stride_zm, stride_ym, eps,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr, BY_BITS: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        pdl.release_then_wait()
    pid = tl.program_id(0)
    q = pid * ROWS + tl.arange(0, ROWS)  # group index over all rows: q = m * G + g
    q_mask = q < Q
    q64 = q.to(tl.int64)
    row = q64 // G
    start = (q64 - row * G) * K
    cols = tl.arange(0, BLOCK_K)
    mask = q_mask[:, None] & (cols[None, :] < K)
    offs = start[:, None] + cols[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row[:, None] * stride_zm + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)
    gate = z / (1.0 + tl.exp(-z))
    y = round_bf16(x * rstd[:, None] * w[None, :] * gate, BY_BITS)
    tl.store(y_ptr + row[:, None] * stride_ym + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    w: torch.Tensor,
    config: GatedRmsNormConfig = DEFAULT,
    out: torch.Tensor | None = None,
    eps: float = 1e-6,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    """y = norm_groups(x) * w * silu(z); x, z [M, N], w [K] (N = G * K), unit stride on N.
    ``use_pdl``: as ``kernels_triton.gemv.gemv``'s."""
    m, n = x.shape
    k = w.shape[0]
    if z.shape != (m, n) or w.dim() != 1 or n % k:
        raise ValueError(f"x {list(x.shape)}, z {list(z.shape)}, w {list(w.shape)}: N must be G * K")
    if out is None:
        out = torch.empty_like(x)
    if n > 1 and any(t.stride(1) != 1 for t in (x, z, out)):
        raise ValueError("gated_rms_norm needs unit stride along N")
    groups = n // k
    total = m * groups
    on = pdl.enabled(x.device, use_pdl)
    _gated_rms_norm_kernel[(triton.cdiv(total, config.ROWS),)](
        x, z, w, out, total, groups, k, x.stride(0), z.stride(0), out.stride(0), eps,
        BLOCK_K=next_pow2(k), ROWS=config.ROWS, BY_BITS=RNE_BY_BITS, PDL=on, num_warps=config.num_warps,
        **pdl.launch_options(on),
    )
    return out


def launch(op: str, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, config: GatedRmsNormConfig,
           eps: float = 1e-6) -> None:
    """The backend's entry: ``inputs = (x, z, w)``."""
    x, z, w = inputs
    gated_rms_norm(x, z, w, config, out=out, eps=eps)


def reference(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp64 reference on the same (BF16) values."""
    m, n = x.shape
    k = w.shape[0]
    g = x.double().reshape(m, n // k, k)
    normed = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    z64 = z.double()
    return normed.reshape(m, n) * z64 * torch.sigmoid(z64)


def rounded_reference(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The kernel's arithmetic in torch fp32 (one rounding, at the output)."""
    m, n = x.shape
    k = w.shape[0]
    g = x.float().reshape(m, n // k, k)
    normed = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps) * w.float()).reshape(m, n)
    zf = z.float()
    return (normed * (zf / (1.0 + torch.exp(-zf)))).to(torch.bfloat16)
