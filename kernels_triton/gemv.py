"""Triton GEMV family: y[M, N] = x[M, K] @ W[N, K]^T for decode (M = 1..16),
``gemv_add``: y = x @ W^T + r, the residual add in the epilogue, and
``rms_gemv``: y = (x / rms(x)) @ W^T, an RMSNorm whose weight is folded into W.

BF16 in and out, FP32 accumulation, each weight element read once per call.
The caller passes an explicit ``GemvConfig`` (no ``@triton.autotune``: tuning
is tunekit's job); ``DEFAULT`` is valid for every shape and M.

Design, for a memory-bound problem:
- one program owns BLOCK_N rows of W and streams them along K in BLOCK_K
  steps; the product is accumulated element-wise in a [.., BLOCK_N, BLOCK_K]
  fp32 register tile and reduced over K once after the loop, so the loop body
  is loads + FMAs with no cross-lane traffic;
- rows past N are *clamped* (re-read row N-1) instead of masked, so W loads
  stay unmasked and vectorised; only the store is masked;
- SPLIT_K > 1 gives small-N problems (N=96) enough programs to fill the GPU:
  each split writes fp32 partials to a workspace and the splits are summed in
  a fixed order (deterministic: no atomics on outputs), either by a second
  kernel or, SPLIT_REDUCE="fused", by the last split program of each row
  block (a ticket counter decides which; saves a launch at ~3 us sizes);
- M > 1, three ways to share each W tile among the M rows of x (W is read
  once in all of them), chosen by M_MODE:
  "tile": one [BLOCK_M, BLOCK_N, BLOCK_K] fp32 tile, BLOCK_M = next_pow2(M);
  on the H200 it lost to cuBLAS by 1.1-2.8x at M = 2..8;
  "rows": one [BLOCK_N, BLOCK_K] accumulator per row of x (up to 16: the
  M <= 16 of speculative decoding's verify steps), each exactly the
  M=1 kernel's 2D tile and layout (the M=1 path reaches 92-101% of the read
  limit), so no 3D broadcast or layout conversion;
  "dot": tl.dot on tensor cores with M padded to 16 (x is the MMA's M side;
  on sm_90 Triton lowers it to mma.sync m16n8k16 fed by ldmatrix);
  "dot_w": the same product with the operands swapped, acc^T = W x^T, so W's
  rows are the MMA's M side (BLOCK_N >= 64 lowers to Hopper wgmma m64n16k16
  reading W from shared memory) - the usual layout of small-M GEMMs;
- ``residual`` (op ``gemv_add``): the fp32 result plus r[M, N], rounded once,
  wherever the output is stored (the split-K sums included). A decoder's
  o_proj / out_proj / down_proj output is only ever added to the residual
  stream (vLLM's fused_add_rms_norm does it next, in its own launch); done
  here, the next norm is a plain one and that launch is gone. The epilogue
  reads M x N values against the N x K of W: nothing at decode sizes;
- ``rms_eps`` (op ``rms_gemv``, SPLIT_K = 1): the fp32 sum of squares of the x
  tiles the loop loads anyway, per row of x, and the result times
  rsqrt(mean + eps) once after the loop. rms is one scalar per row, so
  W (x diag(1/rms)) = (W x) / rms: with the norm's weight g folded into the
  consumer's W once (W' = W diag(g), or diag(1 + g) for Gemma's convention),
  norm -> GEMV becomes this GEMV, which reads nothing the plain one does not
  (the norm-prologue family, kernels_triton/rms_norm_gemv.py, also reads g
  per program, which costs the one-row-per-program configs the GEMV wins with);
- ``glu`` (ops ``gemv_silu_mul``, ``rms_gemv_silu_mul``; SPLIT_K = 1): W is
  gate_up's [gate; up] with its rows reordered once into (gate_i, up_i)
  pairs, so a program's BLOCK_N rows (even) hold BLOCK_N / 2 whole pairs; the
  epilogue splits the fp32 dots into gate and up and writes silu(g) * u
  (scaled by 1/rms first in the rms_ form): vLLM's SiLU-and-mul launch is
  gone and the output is half as wide. On the H200 (Qwen3.5-27B gate_up,
  34816 x 5120, same calls) the plain / rms_ forms take 81.8-81.9 / 82.8-82.9
  us against the GEMV's 80.6-81.0 and rms_gemv's 80.8-81.2, plus 1.3 us of
  SiLU-and-mul: the plain form pays by about 0.5 us, the rms_ form loses by
  about 0.5. Streaming each pair as one 2K-long run instead (one pair per
  program, as the one-row GEMV) was slower: 83.4 / 85.0 us with two loops,
  90.9 / 91.6 us with one loop that switches accumulators
  (benchmarks/results/h200-glu).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from kernels_triton import pdl
from kernels_triton.config import GEMV_MAX_M, next_pow2


@dataclass(frozen=True)
class GemvConfig:
    BLOCK_N: int = 4
    BLOCK_K: int = 256
    num_warps: int = 4
    num_stages: int = 2
    SPLIT_K: int = 1
    W_EVICT: str = ""  # "" (default policy) or "evict_first" / "evict_last"
    SPLIT_REDUCE: str = "kernel"  # SPLIT_K > 1: "kernel" (2nd launch) or "fused" (last split sums)
    M_MODE: str = "tile"  # how M > 1 rows share a W tile: "tile", "rows", "dot" or "dot_w" (module doc)

    @classmethod
    def from_params(cls, params: dict) -> GemvConfig:
        params = dict(params)
        # USE_DOT (0/1) was the first name of the tensor-core choice; configs
        # recorded with it (benchmarks/results) still load.
        if "USE_DOT" in params:
            params.setdefault("M_MODE", "dot" if params.pop("USE_DOT") else "tile")
        return cls(**{k: v for k, v in params.items() if k in cls.__dataclass_fields__})

    def as_params(self) -> dict:
        return asdict(self)


#: The name every kernel module gives its config (``gemv_add`` is built through it).
Config = GemvConfig

#: Valid for every shape and M = 1..MAX_M (the fallback / "tactic -1" config).
DEFAULT = GemvConfig()

#: Largest M the kernel serves: every mode keeps all M rows of x on one W tile (W read once), up to the
#: 16 of one MMA tile ("dot"/"dot_w"), 16 "rows" accumulators, a BLOCK_M = 16 "tile".
MAX_M = GEMV_MAX_M

#: Smallest tile dimension tl.dot takes (M is padded up to it).
_DOT_MIN = 16

#: Triton 3.6's CPU interpreter multiplies the raw bits of BF16 operands in
#: tl.dot; there the operands go through fp32 (exact for BF16 values, so the
#: products and the fp32 accumulation are the same math). GPUs use BF16 MMA.
_DOT_IN_FP32 = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Register budget of the accumulator tile per thread. Past ~128 fp32 values
#: Triton spills to local memory and the kernel falls far below bandwidth.
_MAX_ACC_PER_THREAD = 128


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def invalid_reason(config: GemvConfig, m: int, n: int, k: int) -> str | None:
    """None if ``config`` can run (m, n, k), else a short reason. Pure predicate."""
    for name in ("BLOCK_N", "BLOCK_K", "num_warps"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            return f"{name}={value} is not a power of two"
    if config.SPLIT_K < 1:
        return f"SPLIT_K={config.SPLIT_K} < 1"
    if not 1 <= m <= MAX_M:
        return f"M={m} outside 1..{MAX_M}"
    if config.W_EVICT not in ("", "evict_first", "evict_last"):
        return f"unknown W_EVICT {config.W_EVICT!r}"
    if config.SPLIT_REDUCE not in ("kernel", "fused"):
        return f"unknown SPLIT_REDUCE {config.SPLIT_REDUCE!r}"
    if config.SPLIT_K == 1 and config.SPLIT_REDUCE != "kernel":
        return "SPLIT_REDUCE only applies to SPLIT_K > 1"
    threads = 32 * config.num_warps
    if config.M_MODE not in ("tile", "rows", "dot", "dot_w"):
        return f"unknown M_MODE {config.M_MODE!r}"
    if config.M_MODE == "rows" and m == 1:
        return 'M_MODE="rows" is the "tile" kernel at M=1'
    if config.M_MODE in ("dot", "dot_w"):
        if config.BLOCK_N < _DOT_MIN or config.BLOCK_K < _DOT_MIN:
            return f"tl.dot needs BLOCK_N and BLOCK_K >= {_DOT_MIN}"
        # the W tile (bf16) and the [16, BLOCK_N] accumulator live in registers
        if config.BLOCK_N * config.BLOCK_K > 2 * _MAX_ACC_PER_THREAD * threads:
            return "W tile exceeds the register budget"
    elif next_pow2(m) * config.BLOCK_N * config.BLOCK_K > _MAX_ACC_PER_THREAD * threads:
        return "accumulator tile exceeds the register budget"
    if config.BLOCK_N * config.BLOCK_K < threads:
        return "fewer tile elements than threads"
    k_per_split = _cdiv(_cdiv(k, config.SPLIT_K), config.BLOCK_K) * config.BLOCK_K
    if k_per_split * (config.SPLIT_K - 1) >= k:
        return "the last K split would be empty"
    if config.BLOCK_K > max(2 * next_pow2(k), DEFAULT.BLOCK_K):
        # pure waste (masked lanes), pruned from the search; DEFAULT's stays valid at any K
        return "BLOCK_K far larger than K"
    return None


@triton.jit
def _row_fma(acc, wf, xk, r: tl.constexpr, stride_xm, km, r0, M):
    """The "rows" mode's step for row ``r`` of x: acc += W tile * x[r, k-step] (zeros past M or K)."""
    return acc + wf * tl.load(xk + r * stride_xm, mask=km & (r0 + r < M), other=0.0).to(tl.float32)


@triton.jit
def _row_out(out, rows_m, acc, r: tl.constexpr):
    """Row ``r`` of the [BLOCK_M, BLOCK_N] result: its accumulator reduced over K."""
    return tl.where(rows_m == r, tl.sum(acc, axis=1)[None, :], out)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, p_ptr, count_ptr, r_ptr,
    M, N, K, K_PER_SPLIT, eps,
    stride_xm, stride_wn, stride_ym, stride_ps, stride_pm, stride_rm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, FUSED_REDUCE: tl.constexpr,
    EVEN_K: tl.constexpr, W_EVICT: tl.constexpr, USE_DOT: tl.constexpr, ROWS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, SWAP_AB: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RMS_SCALE: tl.constexpr,
    GLU: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Clamp rows past N onto row N-1: unmasked (vectorised) W loads; the
    # duplicate rows are dropped by the masked store.
    rows = tl.minimum(offs_n, N - 1)
    offs_m = tl.arange(0, BLOCK_M)
    k_start = pid_k * K_PER_SPLIT
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    m_mask = offs_m[:, None] < M
    if PDL:
        # Launched with PDL this program may run while the previous kernel drains: start this program's
        # first W tile towards L2 (one pointer per 128-byte line; W is never written by a step kernel),
        # then wait for the previous kernel before x, the residual or any output is touched.
        lines = tl.minimum(k_start + tl.arange(0, PF_LINES) * 64, K - 1)
        pdl.prefetch_l2(w_ptr + rows[:, None] * stride_wn + lines[None, :])
        pdl.wait()
    # per-row accumulators of the "rows" mode, one per row of x up to BLOCK_M (Triton has no list of
    # tensors; the unused ones are dead code, removed)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    acc8, acc9, acc10, acc11, acc12, acc13, acc14, acc15 = acc0, acc0, acc0, acc0, acc0, acc0, acc0, acc0
    if USE_DOT and SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1 or ROWS:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)  # RMS_SCALE: x's sum of squares (else dead)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy=W_EVICT)
            x = tl.load(x_ptrs, mask=m_mask, other=0.0)
        else:
            k_mask = (offs_k + k0) < K
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy=W_EVICT)
            x = tl.load(x_ptrs, mask=m_mask & k_mask[None, :], other=0.0)
        if RMS_SCALE:
            xf = x.to(tl.float32)
            sq += xf * xf
        if ROWS:
            # each row of x is a [1, BLOCK_K] load in W's own layout
            wf = w.to(tl.float32)
            xk = x_ptr + (offs_k + k0)[None, :]
            km = (offs_k + k0)[None, :] < K
            # Row r's mask is ``km & (r0 + r < M)`` with r0 a [1, BLOCK_K] int32 zero
            # tensor: a bare ``r < M`` can be a Python bool (the interpreter passes M
            # as an int), which Triton >= 3.9 turns into an int32 mask and rejects.
            r0 = tl.zeros([1, BLOCK_K], dtype=tl.int32)
            acc0 += wf * tl.load(xk, mask=km, other=0.0).to(tl.float32)
            acc1 = _row_fma(acc1, wf, xk, 1, stride_xm, km, r0, M)
            if BLOCK_M > 2:
                acc2 = _row_fma(acc2, wf, xk, 2, stride_xm, km, r0, M)
                acc3 = _row_fma(acc3, wf, xk, 3, stride_xm, km, r0, M)
            if BLOCK_M > 4:
                acc4 = _row_fma(acc4, wf, xk, 4, stride_xm, km, r0, M)
                acc5 = _row_fma(acc5, wf, xk, 5, stride_xm, km, r0, M)
                acc6 = _row_fma(acc6, wf, xk, 6, stride_xm, km, r0, M)
                acc7 = _row_fma(acc7, wf, xk, 7, stride_xm, km, r0, M)
            if BLOCK_M > 8:
                acc8 = _row_fma(acc8, wf, xk, 8, stride_xm, km, r0, M)
                acc9 = _row_fma(acc9, wf, xk, 9, stride_xm, km, r0, M)
                acc10 = _row_fma(acc10, wf, xk, 10, stride_xm, km, r0, M)
                acc11 = _row_fma(acc11, wf, xk, 11, stride_xm, km, r0, M)
                acc12 = _row_fma(acc12, wf, xk, 12, stride_xm, km, r0, M)
                acc13 = _row_fma(acc13, wf, xk, 13, stride_xm, km, r0, M)
                acc14 = _row_fma(acc14, wf, xk, 14, stride_xm, km, r0, M)
                acc15 = _row_fma(acc15, wf, xk, 15, stride_xm, km, r0, M)
        elif USE_DOT and SWAP_AB:
            # [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M(>=16)]: W is the MMA's M side
            if DOT_IN_FP32:
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        elif USE_DOT:
            # [BLOCK_M(>=16), BLOCK_K] x [BLOCK_K, BLOCK_N] on tensor cores; the
            # padded rows of x are zeros (masked), so they cost MMA work only.
            if DOT_IN_FP32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        elif BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:
        # the weight stream is done: let the next kernel's programs start (they wait for this grid)
        pdl.launch_dependents()
    if ROWS:
        rows_m = offs_m[:, None]
        out = tl.where(rows_m == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
        out = tl.where(rows_m == 1, tl.sum(acc1, axis=1)[None, :], out)
        if BLOCK_M > 2:
            out = _row_out(out, rows_m, acc2, 2)
            out = _row_out(out, rows_m, acc3, 3)
        if BLOCK_M > 4:
            out = _row_out(out, rows_m, acc4, 4)
            out = _row_out(out, rows_m, acc5, 5)
            out = _row_out(out, rows_m, acc6, 6)
            out = _row_out(out, rows_m, acc7, 7)
        if BLOCK_M > 8:
            out = _row_out(out, rows_m, acc8, 8)
            out = _row_out(out, rows_m, acc9, 9)
            out = _row_out(out, rows_m, acc10, 10)
            out = _row_out(out, rows_m, acc11, 11)
            out = _row_out(out, rows_m, acc12, 12)
            out = _row_out(out, rows_m, acc13, 13)
            out = _row_out(out, rows_m, acc14, 14)
            out = _row_out(out, rows_m, acc15, 15)
    elif USE_DOT and SWAP_AB:
        out = tl.trans(acc)
    elif USE_DOT:
        out = acc
    elif BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    if RMS_SCALE:
        # SPLIT_K == 1 (the wrapper's check): this program's loop saw all of K
        out = out * tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    if GLU:
        # W's rows are (gate, up) pairs: the program's BLOCK_N rows give BLOCK_N / 2 outputs
        # silu(gate) * up, from the fp32 dots (SPLIT_K == 1, the wrapper's check)
        gate, up = tl.split(tl.reshape(out, [BLOCK_M, BLOCK_N // 2, 2]))
        out = gate / (1.0 + tl.exp(-gate)) * up
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        N = N // 2
    y_mask = m_mask & (offs_n[None, :] < N)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    r_ptrs = r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_RESIDUAL:
            out += tl.load(r_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        p_tile = p_ptr + offs_m[:, None] * stride_pm + offs_n[None, :]
        tl.store(p_tile + pid_k * stride_ps, out, mask=y_mask)
        if FUSED_REDUCE:
            # The last split to finish sums all partials of this row block in
            # split order (same bits as the separate reduce kernel), then
            # re-arms the counter: one launch instead of two. acq_rel makes
            # the other splits' partial stores visible to the last one.
            ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(p_tile + s * stride_ps, mask=y_mask, other=0.0, cache_modifier=".cg")
                if HAS_RESIDUAL:
                    total += tl.load(r_ptrs, mask=y_mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
                tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _split_k_reduce_kernel(
    p_ptr, y_ptr, r_ptr, M, N, stride_ps, stride_pm, stride_ym, stride_rm,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
):
    # Sums the SPLIT_K fp32 partials in a fixed order: bitwise reproducible.
    if PDL:
        pdl.wait()  # the partials are the previous kernel's
        pdl.launch_dependents()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + s * stride_ps + m * stride_pm + n, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + m * stride_rm + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


#: Zeroed split-K tickets per (device, row blocks); each fused-reduce call
#: leaves them zero again, so one allocation serves every call and graph.
_TICKETS: dict[tuple[str, int], torch.Tensor] = {}


def _tickets(device: torch.device, blocks: int) -> torch.Tensor:
    key = (str(device), blocks)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(blocks, dtype=torch.int32, device=device)
    return _TICKETS[key]


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    config: GemvConfig = DEFAULT,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    rms_eps: float | None = None,
    glu: bool = False,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    """y = x @ w.T (+ residual) with an explicit config. x [M, K], w [N, K] (unit stride on K);
    residual [M, N] (unit stride on N; ``out`` may be the residual itself: updated in place).
    With ``rms_eps``: y = (x / sqrt(mean(x^2) + rms_eps)) @ w.T, per row of x (SPLIT_K = 1).
    With ``glu``: w's rows are (gate, up) pairs (``tunekit.problems.opspec_gemv.interleave_gate_up``) and y[M, N / 2] =
    silu(gate) * up of the fp32 dots (SPLIT_K = 1, even BLOCK_N, no residual).
    ``use_pdl``: launch with programmatic dependent launch (``kernels_triton.pdl``); None (the default)
    follows ``TUNEKIT_PDL``, False never, True asks for it (ignored where unsupported)."""
    m, k = x.shape
    n = w.shape[0]
    if glu and (config.SPLIT_K != 1 or config.BLOCK_N < 2 or n % 2 or residual is not None):
        raise ValueError("glu needs SPLIT_K = 1, BLOCK_N >= 2, an even N and no residual")
    if w.shape[1] != k:
        raise ValueError(f"x is [{m}, {k}] but w is {list(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv needs unit stride along K for x and w")
    if residual is not None and (tuple(residual.shape) != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{m}, {n}] with unit stride along N, got {list(residual.shape)}")
    if rms_eps is not None and config.SPLIT_K != 1:
        raise ValueError("the rms scale needs all of K in one program (SPLIT_K = 1)")
    if out is None:
        out = torch.empty((m, n // 2 if glu else n), dtype=x.dtype, device=x.device)
    r = out if residual is None else residual  # unused by the kernels without a residual
    use_dot = config.M_MODE in ("dot", "dot_w")
    rows = config.M_MODE == "rows" and m > 1
    block_m = max(_DOT_MIN, next_pow2(m)) if use_dot else next_pow2(m)
    split = config.SPLIT_K
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.BLOCK_K) * config.BLOCK_K
    even_k = k % config.BLOCK_K == 0 and k_per_split * split == k
    blocks_n = triton.cdiv(n, config.BLOCK_N)
    fused = split > 1 and config.SPLIT_REDUCE == "fused"
    if split == 1:
        partials, tickets = out, out  # unused by the kernel
    else:
        # fp32 partials [SPLIT_K, M, N]; torch's allocator makes this
        # graph-capturable (a private pool while capturing).
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        tickets = _tickets(x.device, blocks_n) if fused else partials
    on = pdl.enabled(x.device, use_pdl)
    launch_options = pdl.launch_options(on)
    _gemv_kernel[(blocks_n, split)](
        x, w, out, partials, tickets, r,
        m, n, k, k_per_split, 0.0 if rms_eps is None else rms_eps,
        x.stride(0), w.stride(0), out.stride(0), partials.stride(0) if split > 1 else 0,
        partials.stride(1) if split > 1 else 0, r.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        SPLIT_K=split, FUSED_REDUCE=fused, EVEN_K=even_k, W_EVICT=config.W_EVICT, USE_DOT=use_dot, ROWS=rows,
        DOT_IN_FP32=_DOT_IN_FP32, SWAP_AB=config.M_MODE == "dot_w", HAS_RESIDUAL=residual is not None,
        RMS_SCALE=rms_eps is not None, GLU=glu, PDL=on, PF_LINES=max(1, config.BLOCK_K // 64),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options,
    )
    if split > 1 and not fused:
        block = 256
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            partials, out, r, m, n, partials.stride(0), partials.stride(1), out.stride(0), r.stride(0),
            SPLIT_K=split, BLOCK=block, HAS_RESIDUAL=residual is not None, PDL=on, num_warps=4, **launch_options,
        )
    return out


#: the fused GEMV ops :func:`launch` serves
FUSED_OPS = ("gemv_add", "rms_gemv", "gemv_silu_mul", "rms_gemv_silu_mul")


def launch(op: str, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, config: GemvConfig,
           eps: float = 1e-6) -> None:
    """The backend's entry for ``FUSED_OPS`` (``tunekit.problems.opspec``'s protocol): inputs ``(x, W,
    residual)`` -> ``y = x @ W^T + residual`` (``eps`` unused); ``(x, W)`` -> ``y = (x / rms(x)) @
    W^T``; ``(x, W)`` with W's rows (gate, up) pairs -> ``y = silu(x W_gate^T) * (x W_up^T)``
    (``rms_`` form: of x / rms(x)). The plain GEMV is built on :func:`gemv` directly."""
    if op == "gemv_add":
        x, w, residual = inputs
        gemv(x, w, config, out=out, residual=residual)
    elif op in FUSED_OPS:
        x, w = inputs
        gemv(x, w, config, out=out, rms_eps=eps if op.startswith("rms_") else None, glu=op.endswith("silu_mul"))
    else:
        raise ValueError(f"kernels_triton.gemv.launch serves {', '.join(FUSED_OPS)}, not {op!r}")


def reference(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 reference on the same (BF16) values."""
    y = x.double() @ w.double().T
    return y if residual is None else y + residual.double()
