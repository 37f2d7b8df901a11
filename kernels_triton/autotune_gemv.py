"""A plain ``@triton.autotune`` GEMV: what a Triton user writes in an afternoon (a peer, never searched).

y[M, N] = x[M, K] @ w[N, K]^T, BF16 in and out, FP32 accumulation. One program
owns BLOCK_N output columns for every row (M <= 16 fits one BLOCK_M = 16 tile,
so W is read once whatever M), walks K in BLOCK_K steps and multiplies with
``tl.dot``, as the matmul tutorial does. Triton's autotuner picks one of
:data:`CONFIGS` per (M, N, K) at the first call, by timing each on that call's
own tensors; the choice is cached in the process.

This is deliberately not tunekit's GEMV (``kernels_triton.gemv``): no split-K,
no row-per-warp layout, no search. It is the bar a user who reaches for Triton
without tunekit would set. ``launch(x, w, out)`` is graph-capturable after its
first call for a shape (the autotuner times outside any capture then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: The usual list: the tile sizes and warp counts a GEMV tutorial or a first attempt would try.
CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn in (16, 32, 64, 128)
    for bk in (64, 128, 256)
    for w, s in ((4, 3), (8, 4))
]
#: M up to this fits one row tile (tl.dot needs at least 16 rows).
BLOCK_M = 16


@triton.autotune(configs=CONFIGS, key=["M", "N", "K"])
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def invalid_reason(m: int, n: int, k: int) -> str | None:
    """None if the kernel runs x [m, k] @ w [n, k]^T, else why not. Pure predicate."""
    if not 1 <= m <= BLOCK_M:
        return f"the afternoon GEMV holds M in one tile of {BLOCK_M} rows (M={m})"
    if n < 1 or k < 1:
        return f"empty problem (N={n}, K={k})"
    return None


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out[M, N] = x[M, K] @ w[N, K]^T (x, w and out with unit stride along their last dimension)."""
    m, k = x.shape
    n = w.shape[0]
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731 - the autotuner's grid form
    _gemv_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=BLOCK_M)


def launch_config(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: triton.Config) -> None:
    """One config of :data:`CONFIGS` launched directly, as the autotuner launches each candidate: where no
    device times them (the interpreter, the GPU-target compile checks)."""
    m, k = x.shape
    n = w.shape[0]
    _gemv_kernel.fn[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=BLOCK_M,
        num_warps=config.num_warps, num_stages=config.num_stages, **config.kwargs)
