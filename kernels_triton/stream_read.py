"""Streaming-read kernel: the device's practical read-bandwidth limit.

A GEMV at M=1 is a streaming read of W; the best this kernel reaches over a
small grid of configs is the ceiling every GEMV result is compared with
("% of limit"). Each program sums its slice and writes one fp32 partial so the
loads cannot be optimised away.
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
