"""Streaming kernels of the bandwidth probe: the device's practical limits.

Read: a GEMV at M=1 is a streaming read of W; the best ``stream_read`` reaches
over a small grid of configs is the ceiling every GEMV result is compared with
("% of limit"). Each program sums its slice and writes one fp32 partial so the
loads cannot be optimised away.

Copy: an elementwise op reads about as many bytes as it writes; the best
``stream_copy`` (the same grid) or ``torch`` copy reaches is the ceiling of
those ops. torch's own ``copy_`` alone is not enough: on the H200 it moved
2770 GB/s where tuned elementwise kernels reached 4118 GB/s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Grid searched by the probe (GPU); the first entry alone on the CPU.
PROBE_CONFIGS: list[dict] = [
    {"BLOCK": block, "ITERS": iters, "num_warps": warps}
    for block in (2048, 4096, 8192)
    for iters in (4, 16)
    for warps in (4, 8)
]


@triton.jit
def _stream_read_kernel(src_ptr, partial_ptr, numel, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    base = pid * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def make_partials(numel: int, config: dict, device: torch.device) -> torch.Tensor:
    programs = triton.cdiv(numel, config["BLOCK"] * config["ITERS"])
    return torch.empty(programs, dtype=torch.float32, device=device)


def stream_read(src: torch.Tensor, partials: torch.Tensor, config: dict) -> torch.Tensor:
    """Read all of ``src`` once; ``partials`` from ``make_partials``."""
    numel = src.numel()
    grid = (partials.numel(),)
    _stream_read_kernel[grid](
        src, partials, numel, BLOCK=config["BLOCK"], ITERS=config["ITERS"], num_warps=config["num_warps"]
    )
    return partials


@triton.jit
def _stream_copy_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        v = tl.load(src_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        tl.store(dst_ptr + offs, v, mask=mask)


def stream_copy(src: torch.Tensor, dst: torch.Tensor, config: dict) -> torch.Tensor:
    """dst[:] = src (both contiguous, same numel): each byte read once and written once."""
    numel = src.numel()
    grid = (triton.cdiv(numel, config["BLOCK"] * config["ITERS"]),)
    _stream_copy_kernel[grid](src, dst, numel, BLOCK=config["BLOCK"], ITERS=config["ITERS"],
                              num_warps=config["num_warps"])
    return dst
