"""Probe: does prefetching a GEMV's weight into L2 during the latency-bound kernels before it pay?

At batch 1 a decode layer runs a weight-streaming GEMV, then a few microseconds of kernels that
barely touch HBM (conv1d, the recurrence, attention, norms), then the next GEMV. This probe puts a
CUDA graph of L layers together, each ``window -> gemv_add(W_i)`` with distinct cold weights, the
window a spin kernel of a given length, and times it against the same graph with the first P bytes
of W_i prefetched into L2 at the window's start:

- ``bulk``: one tiny kernel of ``cp.async.bulk.prefetch.L2`` instructions on the same stream (the
  prefetches are fire-and-forget: the kernel exits while L2 fills);
- ``bulk_side``: the same kernel on a side stream forked before the window and joined before the GEMV;
- ``load_side``: a Triton kernel that really loads the bytes (``evict_last``) on a side stream.

Usage (GPU): python benchmarks/l2_prefetch_probe.py --out DIR. Writes DIR/l2_prefetch.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels_triton.gemv import GemvConfig, gemv  # noqa: E402

#: the tuned gemv_add of 5120x6144 (o_proj / linear_attn.out_proj) in h200-serve-merge-df17426
OUT_PROJ = GemvConfig(BLOCK_K=512, BLOCK_N=4, M_MODE="tile", SPLIT_K=1, W_EVICT="evict_first", num_stages=1,
                      num_warps=2)
DOWN_PROJ = OUT_PROJ  # the same config won 5120x17408 there


@triton.jit
def _bulk_prefetch_kernel(w_ptr, sink_ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # one element per thread (BLOCK = 32 * num_warps): each thread asks L2 for CHUNK bytes
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = idx.to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    ptr = w_ptr + start // 2  # bf16 elements
    done = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + idx, done, mask=done != 0)  # never true: keeps the asm alive


@triton.jit
def _load_prefetch_kernel(w_ptr, sink_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # the caller's byte count is a multiple of BLOCK * STEPS elements: no mask, vector loads
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(STEPS):
        offs = base + s * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, eviction_policy="evict_last").to(tl.float32)
    total = tl.sum(acc)
    tl.store(sink_ptr + tl.program_id(0), total, mask=total == 12345.678)  # never true


def bulk_prefetch(w: torch.Tensor, nbytes: int, sink: torch.Tensor, chunk: int = 65536, warps: int = 1) -> None:
    block = 32 * warps
    chunks = triton.cdiv(nbytes, chunk)
    _bulk_prefetch_kernel[(triton.cdiv(chunks, block),)](w, sink, nbytes, CHUNK=chunk, BLOCK=block, num_warps=warps)


def load_prefetch(w: torch.Tensor, nbytes: int, sink: torch.Tensor) -> None:
    n = nbytes // 2
    block, steps = 2048, 8
    assert n % (block * steps) == 0
    _load_prefetch_kernel[(n // (block * steps),)](w, sink, BLOCK=block, STEPS=steps, num_warps=8)


def spin_cycles(us: float) -> int:
    """Cycles of torch.cuda._sleep for ``us`` microseconds, calibrated once."""
    c = 200000
    torch.cuda._sleep(c)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(c)
    e1.record()
    torch.cuda.synchronize()
    per_us = c / (e0.elapsed_time(e1) * 1000)
    return max(1, int(us * per_us))


def build(variant: str, weights, x, residuals, outs, cycles: int, nbytes: int, chunk: int,
          sink) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    main = None
    with torch.cuda.graph(g):
        main = torch.cuda.current_stream()
        for w, r, o in zip(weights, residuals, outs, strict=True):
            if variant == "bulk":
                bulk_prefetch(w, nbytes, sink, chunk)
            if variant in ("bulk_side", "load_side"):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    if variant == "bulk_side":
                        bulk_prefetch(w, nbytes, sink, chunk)
                    else:
                        load_prefetch(w, nbytes, sink)
            if cycles:
                torch.cuda._sleep(cycles)
            if variant in ("bulk_side", "load_side"):
                main.wait_stream(side)
            if variant != "window_only":
                gemv(x, w, OUT_PROJ if w.shape[1] == 6144 else DOWN_PROJ, out=o, residual=r)
    return g


def time_graph(g: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=40)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev = "cuda"
    results = []
    sink = torch.zeros(1 << 16, device=dev, dtype=torch.float32)
    for n, k, windows, sizes_mb in ((5120, 6144, (0, 4, 8, 15), (0, 8, 16, 24, 32, 40, 48, 62)),
                                    (5120, 17408, (0, 1.2, 3), (0, 4, 8, 16))):
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        residuals = [torch.randn(1, n, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
        outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
        # correctness gate: the GEMV after a prefetch equals the GEMV (prefetch reads only)
        ref = x.float() @ weights[0].float().T + residuals[0].float()
        got = gemv(x, weights[0], OUT_PROJ, residual=residuals[0])
        assert (got.float() - ref).abs().max().item() < 0.1, "gemv_add wrong"
        for window in windows:
            cycles = spin_cycles(window) if window else 0
            win = 0.0
            if window:
                win = time_graph(build("window_only", weights, x, residuals, outs, cycles, 0, 65536, sink))
            for mb in sizes_mb:
                nbytes = min(mb << 20, n * k * 2) // 65536 * 65536
                variants = ["none"] if mb == 0 else ["bulk", "bulk_side", "load_side"]
                for variant in variants:
                    chunks = (65536,) if variant != "bulk_side" else (16384, 65536)
                    for chunk in chunks:
                        g = build(variant, weights, x, residuals, outs, cycles, nbytes, chunk, sink)
                        us = [time_graph(g) / args.layers for _ in range(2)]
                        row = dict(n=n, k=k, window_us=window, prefetch_mb=mb, variant=variant, chunk=chunk,
                                   layer_us=min(us), repeat_us=us, window_only_us=win / args.layers)
                        results.append(row)
                        print(json.dumps(row), flush=True)
                        del g
        del weights
        torch.cuda.empty_cache()
    (args.out / "l2_prefetch.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=results),
                                                          indent=1))
    # short table: per (shape, window) the best prefetch against none
    print("\nshape window  none_us  best_us  best")
    for (n, k) in {(r["n"], r["k"]) for r in results}:
        for window in sorted({r["window_us"] for r in results if r["n"] == n and r["k"] == k}):
            rows = [r for r in results if (r["n"], r["k"], r["window_us"]) == (n, k, window)]
            none = next(r for r in rows if r["variant"] == "none")["layer_us"]
            best = min(rows, key=lambda r: r["layer_us"])
            print(f"{n}x{k} {window:5} {none:8.2f} {best['layer_us']:8.2f}  {best['variant']} {best['prefetch_mb']}MB "
                  f"chunk {best['chunk']}")


if __name__ == "__main__":
    main()
