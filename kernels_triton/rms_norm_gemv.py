"""Triton RMSNorm-in-the-GEMV-prologue family: y[M, N] = W[N, K] . norm(x)[M, K].

Ops (``OPS``; the weight convention and the residual are in the name):

- ``rms_norm_gemv``: a = x / rms(x) * g, y = a @ W^T;
- ``gemma_rms_norm_gemv``: the same with * (1 + g) (Gemma / Qwen3.5 norms);
- ``fused_add_rms_norm_gemv`` / ``gemma_...``: s = x + residual, a = norm(s),
  y = a @ W^T; s is also an output (the updated residual).

This is one kernel in place of a decoder layer's ``input_layernorm ->
qkv_proj`` (or ``in_proj_qkvz``) and ``post_attention_layernorm ->
gate_up_proj``: the normalised activations never go through memory. BF16 in
and out, FP32 math; the caller passes an explicit ``RmsNormGemvConfig`` (no
``@triton.autotune``); ``DEFAULT`` is valid for every shape and M = 1..16.

Design (the GEMV of ``kernels_triton.gemv``, M_MODE="tile", SPLIT_K=1):
- every program computes rstd of the M rows itself in a prologue pass over
  x (+ residual): a row is 10-35 KB, every program reads it in its K loop
  anyway, and a separate norm kernel or a grid-wide reduction would cost a
  launch or a grid sync, more than re-reading x from L2;
- the K loop then streams its BLOCK_N rows of W, normalises the matching x
  chunk on the fly (x, residual and g are L1/L2 hits) and accumulates in an
  fp32 register tile reduced over K once after the loop, as the GEMV;
- rows past N are clamped onto row N-1 (unmasked W loads), only the store is
  masked, as the GEMV.

ONE_PASS=1 drops the prologue pass: the K loop accumulates the sum of
squares next to the products, and since rstd is one scalar per row,
y = rstd * sum_k (s_k g_k) W_nk is applied once after the loop. The program
reads x and W once each, as the plain GEMV, at the price of the activation's
BF16 roundings (a never exists as a tensor): y is closer to the fp64
reference than the unfused sequence, and differs from it by at most the
rounding of a (inside the op's bound, ``tunekit.problems.opspec_gemv._norm_gemv_bound``).

The residual s (fused-add ops) is written exactly once, spread over the
grid: BLOCK_K chunk j of s is stored by program ``j % num_programs`` during
its prologue pass, when the chunk is in its registers anyway. One writer per
element keeps the bytes at M*K; round-robin keeps the store off one
program's critical path (a single writer would add up to M*K*2 = 280 KB of
stores at M = 8, K = 17408 to one program, the grid's tail). Every program
reads x and residual until its prologue ends, so residual_out must not
alias them (the wrapper refuses; vLLM's in-place form needs separate
buffers here).

Numerics (where BF16 rounding happens) are those of vLLM's unfused sequence,
fixed: the rms_norm / fused_add_rms_norm kernels with VLLM_ROUNDING=1 write a
BF16 tensor that the GEMV reads. So: s = bf16(x + residual) before the
variance; plain weight: a = bf16(bf16(s * rstd) * g); Gemma: a = bf16(s *
rstd * (1 + g)); the GEMV multiplies the BF16 a by W in fp32 and rounds y
once. ``_apply_weight`` is the norm kernels' own function. rstd is the fp32
sum of squares in this kernel's chunk order, so it can differ from the
standalone norm's in the last bit (the tests compare within the op's bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton.config import StrictConfig, gemv_head_reason, next_pow2
from kernels_triton.rms_norm import _apply_weight
from kernels_triton.rounding import RNE_BY_BITS, round_bf16

OPS = ("rms_norm_gemv", "gemma_rms_norm_gemv", "fused_add_rms_norm_gemv", "gemma_fused_add_rms_norm_gemv")
#: The ops with a residual input and output.
FUSED_ADD_OPS = ("fused_add_rms_norm_gemv", "gemma_fused_add_rms_norm_gemv")


@dataclass(frozen=True)
class RmsNormGemvConfig(StrictConfig):
    BLOCK_N: int = 4  # rows of W per program
    BLOCK_K: int = 256  # K per loop step (prologue and GEMV loop)
    num_warps: int = 4
    num_stages: int = 2
    #: 1: one pass over K; rstd is a per-row scalar, so it is applied to the fp32 dot product after
    #: the loop (numerics below); 0: the prologue pass, then vLLM's roundings of the activation
    ONE_PASS: int = 1
    W_EVICT: str = ""  # L2 eviction hint on the streamed W, as the GEMV's: "" or "evict_first"


Config = RmsNormGemvConfig
#: Valid for every shape and M = 1..16 (the fallback config).
DEFAULT = RmsNormGemvConfig()

#: fp32 accumulator values per thread before Triton spills (as the GEMV's budget).
_MAX_ACC_PER_THREAD = 128


def invalid_reason(config: RmsNormGemvConfig, m: int, n: int, k: int) -> str | None:
    """None if ``config`` can run (m, n, k) (the GEMV's dims; norm width = k), else a short reason. Pure."""
    head = gemv_head_reason(config, m, n, k)
    if head is not None:
        return head
    if config.ONE_PASS not in (0, 1):
        return f"ONE_PASS={config.ONE_PASS} is not 0 or 1"
    threads = 32 * config.num_warps
    if next_pow2(m) * config.BLOCK_N * config.BLOCK_K > _MAX_ACC_PER_THREAD * threads:
        return "accumulator tile exceeds the register budget"
    if config.BLOCK_N * config.BLOCK_K < threads:
        return "fewer tile elements than threads"
    if config.BLOCK_K > max(2 * next_pow2(k), DEFAULT.BLOCK_K):
        return "BLOCK_K far larger than K"
    return None


@triton.jit
def _rms_norm_gemv_kernel(
    x_ptr, r_ptr, g_ptr, w_ptr, y_ptr, o_ptr,
    M, N, K, eps,
    stride_xm, stride_rm, stride_wn, stride_ym, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BY_BITS: tl.constexpr, ONE_PASS: tl.constexpr,
    W_EVICT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # clamped: unmasked W loads (module docstring)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    r_rows = r_ptr + offs_m[:, None] * stride_rm
    o_rows = o_ptr + offs_m[:, None] * stride_om

    if ONE_PASS:
        out = _one_pass(x_rows, r_rows, o_rows, g_ptr, w_ptr + rows[:, None] * stride_wn, m_mask, pid, nprog, K, eps,
                        BLOCK_M, BLOCK_N, BLOCK_K, HAS_RESIDUAL, GEMMA, BY_BITS, W_EVICT)
    else:
        # Prologue: rstd of each row of s = x (+ residual), sum of squares in a
        # register tile reduced once; the fused-add ops store their chunks of s.
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = (k0 + offs_k)[None, :]
            s = _row_sum(x_rows, r_rows, o_rows, c, m_mask & (c < K), k0, pid, nprog, BLOCK_K, HAS_RESIDUAL,
                         BY_BITS, True)
            sq += s * s
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]

        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
        acc = _acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            w, s, g = _k_step(w_ptrs, x_rows, r_rows, o_rows, g_ptr, m_mask, k0, offs_k, pid, nprog, K, BLOCK_K,
                              HAS_RESIDUAL, BY_BITS, False, W_EVICT)
            # the BF16 activation vLLM's norm kernel would write (0 past K: s is 0 there)
            acc = _accumulate(acc, w, _apply_weight(s * rstd, g[None, :], GEMMA, True, BY_BITS), BLOCK_M)
            w_ptrs += BLOCK_K
        out = _acc_total(acc, BLOCK_M)
    y_mask = m_mask & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _row_sum(x_rows, r_rows, o_rows, c, mask, k0, pid, nprog, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
             BY_BITS: tl.constexpr, STORE: tl.constexpr):
    """s = x (+ residual) at columns ``c`` of the M rows, fp32. The residual sum is rounded to BF16
    before the variance, as vLLM's fused_add_rms_norm; with STORE, chunk j = k0 // BLOCK_K of it is
    written by program j % num_programs only (a tensor compare, so the mask stays a tensor under
    the interpreter)."""
    s = tl.load(x_rows + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = round_bf16(s + tl.load(r_rows + c, mask=mask, other=0.0).to(tl.float32), BY_BITS)
        if STORE:
            chunk = tl.zeros([1, BLOCK_K], dtype=tl.int32) + k0 // BLOCK_K
            tl.store(o_rows + c, s.to(o_rows.dtype.element_ty), mask=mask & ((chunk % nprog) == pid))
    return s


@triton.jit
def _k_step(w_ptrs, x_rows, r_rows, o_rows, g_ptr, m_mask, k0, offs_k, pid, nprog, K, BLOCK_K: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr, BY_BITS: tl.constexpr, STORE: tl.constexpr, W_EVICT: tl.constexpr):
    """One K step's operands, fp32: W's [BLOCK_N, BLOCK_K] chunk (``w_ptrs``), s = x (+ residual) of the
    M rows at those columns (:func:`_row_sum`, storing its chunk with STORE) and the norm weight g."""
    kk = k0 + offs_k
    k_mask = kk < K
    w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy=W_EVICT).to(tl.float32)
    c = kk[None, :]
    s = _row_sum(x_rows, r_rows, o_rows, c, m_mask & (c < K), k0, pid, nprog, BLOCK_K, HAS_RESIDUAL, BY_BITS, STORE)
    g = tl.load(g_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    return w, s, g


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 accumulator: [BLOCK_N, BLOCK_K] at M=1, else [BLOCK_M, BLOCK_N, BLOCK_K]."""
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit
def _acc_total(acc, BLOCK_M: tl.constexpr):
    """The accumulator reduced over K: [BLOCK_M, BLOCK_N]."""
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    return out


@triton.jit
def _accumulate(acc, w, a, BLOCK_M: tl.constexpr):
    """acc + W * a: [BLOCK_N, BLOCK_K] at M=1, else [BLOCK_M, BLOCK_N, BLOCK_K] (a: [BLOCK_M, BLOCK_K])."""
    if BLOCK_M == 1:
        acc += w * a
    else:
        acc += w[None, :, :] * a[:, None, :]
    return acc


@triton.jit
def _one_pass(x_rows, r_rows, o_rows, g_ptr, w_rows, m_mask, pid, nprog, K, eps,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BY_BITS: tl.constexpr, W_EVICT: tl.constexpr):
    """ONE_PASS=1's body: y[BLOCK_M, BLOCK_N] (fp32) = rstd * ((s * g') . W), one pass over K."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_rows + offs_k[None, :]
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    acc = _acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        w, s, g = _k_step(w_ptrs, x_rows, r_rows, o_rows, g_ptr, m_mask, k0, offs_k, pid, nprog, K, BLOCK_K,
                          HAS_RESIDUAL, BY_BITS, True, W_EVICT)
        sq += s * s
        if GEMMA:
            g = g + 1.0
        acc = _accumulate(acc, w, s * g[None, :], BLOCK_M)  # unnormalised, fp32: rstd comes after the loop
        w_ptrs += BLOCK_K
    rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    return _acc_total(acc, BLOCK_M) * rstd


def rms_norm_gemv(
    x: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    config: RmsNormGemvConfig = DEFAULT,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    eps: float = 1e-6,
    gemma: bool = False,
) -> torch.Tensor:
    """y = norm(x (+ residual)) @ w.T; x [M, K], g [K] (norm weight), w [N, K]; unit stride on K.

    With ``residual`` the sum x + residual (BF16) is written to ``residual_out``
    (required, not aliasing x or residual: see the module docstring).
    """
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or g.shape != (k,):
        raise ValueError(f"x is [{m}, {k}] but w is {list(w.shape)} and g {list(g.shape)}")
    if (residual is None) != (residual_out is None):
        raise ValueError("residual and residual_out go together")
    if residual is not None:
        if residual.shape != (m, k) or residual_out.shape != (m, k):
            raise ValueError(f"residual {list(residual.shape)} / residual_out {list(residual_out.shape)} "
                             f"must be [{m}, {k}]")
        if residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr()):
            raise ValueError("residual_out must not alias x or residual (other programs still read them)")
    tensors = (x, w) + ((residual, residual_out) if residual is not None else ())
    if any(t.stride(1) != 1 for t in tensors) or g.stride(0) != 1:
        raise ValueError("rms_norm_gemv needs unit stride along K")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    has_res = residual is not None
    r = residual if has_res else x  # unused by the kernel without a residual
    o = residual_out if has_res else x
    _rms_norm_gemv_kernel[(triton.cdiv(n, config.BLOCK_N),)](
        x, r, g, w, out, o,
        m, n, k, eps,
        x.stride(0), r.stride(0), w.stride(0), out.stride(0), o.stride(0),
        BLOCK_M=next_pow2(m), BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        HAS_RESIDUAL=has_res, GEMMA=gemma, BY_BITS=RNE_BY_BITS, ONE_PASS=config.ONE_PASS, W_EVICT=config.W_EVICT,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def launch(op: str, inputs: tuple[torch.Tensor, ...], out, config: RmsNormGemvConfig, eps: float = 1e-6) -> None:
    """The backend's entry, ``tunekit.problems.opspec``'s protocol: inputs ``(x, g, W)`` -> ``y``, or
    ``(x, residual, g, W)`` -> ``(y, residual_out)`` for the fused-add ops."""
    gemma = op.startswith("gemma_")
    if op in FUSED_ADD_OPS:
        x, residual, g, w = inputs
        y, residual_out = out
        rms_norm_gemv(x, g, w, config, out=y, residual=residual, residual_out=residual_out, eps=eps, gemma=gemma)
    else:
        x, g, w = inputs
        rms_norm_gemv(x, g, w, config, out=out, eps=eps, gemma=gemma)


def reference(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
              eps: float = 1e-6, gemma: bool = False) -> torch.Tensor:
    """fp64 reference of the unfused sequence (norm, then GEMV) on the same BF16 values, no rounding."""
    s = x.double() if residual is None else x.double() + residual.double()
    g64 = g.double() + 1.0 if gemma else g.double()
    a = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * g64
    return a @ w.double().T
