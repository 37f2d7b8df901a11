"""Triton SiLU-and-mul in the GEMV prologue: y[M, N] = (silu(gate) * up)[M, K] . W[N, K]^T.

One op, ``silu_mul_gemv``: one kernel in place of a SwiGLU MLP's ``act_fn ->
down_proj``. The input is laid out as vLLM's merged ``gate_up_proj`` output,
gate_up [M, 2K]: columns [0, K) are the gate, [K, 2K) the up projection; W is
down_proj's weight [N, K] (N = hidden size, K = intermediate size / TP). So
(m, n, k) of the problem are the GEMV's; the activation input is 2k wide.
BF16 in and out, FP32 math; the caller passes an explicit
``SiluMulGemvConfig`` (no ``@triton.autotune``); ``DEFAULT`` is valid for
every shape and M = 1..16.

Design (the GEMV of ``kernels_triton.gemv``: its tile and tensor-core modes and split-K, no fused reduce):
- one program owns BLOCK_N rows of W and streams them along K in BLOCK_K
  steps; in the same step it loads the matching gate and up chunks of the M
  rows (L1/L2 hits after the first program: the whole activation input is
  M * 2K * 2 bytes, 70 KB per row at K = 17408), computes the activation and
  accumulates W * a in an fp32 register tile reduced once after the loop;
- every program recomputes the activation of its K range (there is no
  reduction in SiLU-and-mul, so no prologue pass is needed, unlike the norm
  family): M * K exp per program, so BLOCK_N also trades exp work against
  program count (4 rows: 1280 programs on 5120 x 17408);
- rows past N are clamped onto row N-1 (unmasked W loads), only the store is
  masked; K steps are unmasked when BLOCK_K divides K (EVEN_K), as the GEMV;
- SPLIT_K > 1 splits K over programs, fp32 partials summed in a fixed order
  by the GEMV's reduce kernel (deterministic): the tensor-core tiles take
  64-128 rows per program, 40-80 programs on a 5120-row down_proj;
- M > 1, ``M_MODE`` as the GEMV's: "tile" (one [BLOCK_M, BLOCK_N, BLOCK_K]
  fp32 tile, register-bound as M grows), "dot"
  (tl.dot on tensor cores, M padded to 16, the activation the MMA's M side)
  or "dot_w" (W x a^T, W rows the MMA's M side). The activation is rounded
  to BF16 anyway, so the MMA's BF16 operands lose nothing: its products are
  exact in fp32, only the fp32 sum order differs. Measured figures (H200):
  ``benchmarks/results/h200-decode-944f424`` (M=1, against the eager
  sequence and against tunekit's tuned SiLU-and-mul + GEMV pair).

Numerics, fixed (as the unfused sequence vLLM runs): vLLM's silu_and_mul
kernel (csrc act_and_mul_kernel, and eager ``F.silu(a) * b``) rounds silu(a)
to BF16, multiplies by b and writes the BF16 product that the down_proj GEMV
reads. This kernel rounds at the same two points, a = bf16(bf16(silu(gate))
* up), and multiplies the BF16 a by W in fp32 with one rounding of y: the
activations the dot sees are bit-identical to those of vLLM's unfused path
(``_silu_and_mul_kernel`` with VLLM_ROUNDING=1), so the fused and unfused y
differ only by the order of the fp32 sum. silu(a) = a / (1 + exp(-a)), as
vLLM's kernel and ``kernels_triton.silu_and_mul``. Inductor's compiled
``F.silu(a) * b`` (the chain's vendor path) may round once instead (fp32
intermediates unless it emulates the casts); both are inside the op's
bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton.config import StrictConfig, gemv_head_reason, next_pow2
from kernels_triton.gemv import _split_k_reduce_kernel
from kernels_triton.rounding import RNE_BY_BITS, round_bf16

OPS = ("silu_mul_gemv",)


@dataclass(frozen=True)
class SiluMulGemvConfig(StrictConfig):
    BLOCK_N: int = 4  # rows of W per program
    BLOCK_K: int = 256  # K per loop step
    num_warps: int = 4
    num_stages: int = 2
    M_MODE: str = "tile"  # how M > 1 rows share a W tile: "tile", "dot" or "dot_w" (module doc)
    SPLIT_K: int = 1  # K split over programs; partials reduced by a second kernel in a fixed order
    W_EVICT: str = ""  # L2 eviction hint on the streamed W, as the GEMV's: "" or "evict_first"


Config = SiluMulGemvConfig
#: Valid for every shape and M = 1..16 (the fallback config).
DEFAULT = SiluMulGemvConfig()

#: fp32 accumulator values per thread before Triton spills (as the GEMV's budget).
_MAX_ACC_PER_THREAD = 128
#: Smallest tile dimension tl.dot takes (M is padded up to it).
_DOT_MIN = 16
#: Triton 3.6's CPU interpreter multiplies the raw bits of BF16 operands in tl.dot (as
#: kernels_triton.gemv): there the operands go through fp32, exact for BF16 values.
_DOT_IN_FP32 = RNE_BY_BITS


def invalid_reason(config: SiluMulGemvConfig, m: int, n: int, k: int) -> str | None:
    """None if ``config`` can run (m, n, k) (the GEMV's dims; the input is [m, 2k]), else a short reason. Pure."""
    head = gemv_head_reason(config, m, n, k)
    if head is not None:
        return head
    threads = 32 * config.num_warps
    if config.M_MODE not in ("tile", "dot", "dot_w"):
        return f"unknown M_MODE {config.M_MODE!r}"
    if config.M_MODE != "tile":
        if config.BLOCK_N < _DOT_MIN or config.BLOCK_K < _DOT_MIN:
            return f"tl.dot needs BLOCK_N and BLOCK_K >= {_DOT_MIN}"
        # the W tile (bf16) and the [16, BLOCK_K] gate / up / activation tiles live in registers
        if config.BLOCK_N * config.BLOCK_K > 2 * _MAX_ACC_PER_THREAD * threads \
                or max(_DOT_MIN, next_pow2(m)) * config.BLOCK_K > _MAX_ACC_PER_THREAD * threads:
            return "W or activation tile exceeds the register budget"
    elif next_pow2(m) * config.BLOCK_N * config.BLOCK_K > _MAX_ACC_PER_THREAD * threads:
        return "accumulator tile exceeds the register budget"
    if config.BLOCK_N * config.BLOCK_K < threads:
        return "fewer tile elements than threads"
    if config.BLOCK_K > max(2 * next_pow2(k), DEFAULT.BLOCK_K):
        return "BLOCK_K far larger than K"
    if config.SPLIT_K < 1:
        return f"SPLIT_K={config.SPLIT_K} < 1"
    if _k_per_split(k, config) * (config.SPLIT_K - 1) >= k:
        return "the last K split would be empty"
    return None


def _k_per_split(k: int, config: SiluMulGemvConfig) -> int:
    """K of each split, a whole number of BLOCK_K steps."""
    per_split = -(-k // config.SPLIT_K)  # ceil(k / SPLIT_K)
    return -(-per_split // config.BLOCK_K) * config.BLOCK_K  # rounded up to whole BLOCK_K steps


@triton.jit
def _silu_mul_gemv_kernel(
    x_ptr, w_ptr, y_ptr, p_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_ym, stride_ps, stride_pm,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, BY_BITS: tl.constexpr, W_EVICT: tl.constexpr,
    USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # clamped: unmasked W loads (module docstring)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)  # this split's first step
    m_mask = offs_m[:, None] < M
    gate_rows = x_ptr + offs_m[:, None] * stride_xm  # columns [0, K): gate; [K, 2K): up
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if USE_DOT and SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        c = (k0 + offs_k)[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy=W_EVICT)
        else:
            w = tl.load(w_ptrs, mask=c < K, other=0.0, eviction_policy=W_EVICT)
        mask = m_mask & (c < K)
        gate = tl.load(gate_rows + c, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_rows + K + c, mask=mask, other=0.0).to(tl.float32)
        # the BF16 activation vLLM's silu_and_mul kernel would write (0 where masked: silu(0) = 0)
        act = round_bf16(gate / (1.0 + tl.exp(-gate)), BY_BITS)
        a = round_bf16(act * up, BY_BITS)
        if USE_DOT:
            if DOT_IN_FP32:
                wd = w.to(tl.float32)
                ad = a
            else:
                wd = w
                ad = a.to(w.dtype)  # exact: a is a BF16 value already
            if SWAP_AB:  # [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M(>=16)]: W is the MMA's M side
                if DOT_IN_FP32:
                    acc = tl.dot(wd, tl.trans(ad), acc, input_precision="ieee")
                else:
                    acc = tl.dot(wd, tl.trans(ad), acc)
            else:  # padded rows of a are zeros (masked gate and up): MMA work only
                if DOT_IN_FP32:
                    acc = tl.dot(ad, tl.trans(wd), acc, input_precision="ieee")
                else:
                    acc = tl.dot(ad, tl.trans(wd), acc)
        elif BLOCK_M == 1:
            acc += w.to(tl.float32) * a
        else:
            acc += w.to(tl.float32)[None, :, :] * a[:, None, :]
        w_ptrs += BLOCK_K
    if USE_DOT and SWAP_AB:
        out = tl.trans(acc)
    elif USE_DOT:
        out = acc
    elif BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    y_mask = m_mask & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.store(p_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :], out, mask=y_mask)


def silu_mul_gemv(
    gate_up: torch.Tensor,
    w: torch.Tensor,
    config: SiluMulGemvConfig = DEFAULT,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (silu(gate_up[:, :K]) * gate_up[:, K:]) @ w.T; gate_up [M, 2K], w [N, K]; unit stride on K."""
    m, two_k = gate_up.shape
    n, k = w.shape
    if two_k != 2 * k:
        raise ValueError(f"gate_up is [{m}, {two_k}] but w is {list(w.shape)}: expected [{m}, {2 * k}]")
    if gate_up.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("silu_mul_gemv needs unit stride along K")
    if out is None:
        out = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    use_dot = config.M_MODE in ("dot", "dot_w")
    split = config.SPLIT_K
    k_per_split = _k_per_split(k, config)
    # fp32 partials [SPLIT_K, M, N] (torch's allocator: graph-capturable); unused without a split
    partials = torch.empty((split, m, n), dtype=torch.float32, device=gate_up.device) if split > 1 else out
    _silu_mul_gemv_kernel[(triton.cdiv(n, config.BLOCK_N), split)](
        gate_up, w, out, partials,
        m, n, k, k_per_split,
        gate_up.stride(0), w.stride(0), out.stride(0),
        partials.stride(0) if split > 1 else 0, partials.stride(1) if split > 1 else 0,
        SPLIT_K=split, BLOCK_M=max(_DOT_MIN, next_pow2(m)) if use_dot else next_pow2(m),
        BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        EVEN_K=k % config.BLOCK_K == 0 and k_per_split * split == k, BY_BITS=RNE_BY_BITS, W_EVICT=config.W_EVICT,
        USE_DOT=use_dot, SWAP_AB=config.M_MODE == "dot_w", DOT_IN_FP32=_DOT_IN_FP32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        block = 256
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            partials, out, out, m, n, partials.stride(0), partials.stride(1), out.stride(0), 0,
            SPLIT_K=split, BLOCK=block, HAS_RESIDUAL=False, num_warps=4,
        )
    return out


def launch(op: str, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, config: SiluMulGemvConfig,
           eps: float = 1e-6) -> None:
    """The backend's entry, ``tunekit.problems.opspec``'s protocol: inputs ``(gate_up, W)`` -> ``y``
    (``eps`` unused)."""
    gate_up, w = inputs
    silu_mul_gemv(gate_up, w, config, out=out)


def reference(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp64 reference of the unfused sequence (SiLU-and-mul, then GEMV) on the same BF16 values, no rounding."""
    k = w.shape[1]
    gate, up = gate_up[:, :k].double(), gate_up[:, k:].double()
    return (gate * torch.sigmoid(gate) * up) @ w.double().T
