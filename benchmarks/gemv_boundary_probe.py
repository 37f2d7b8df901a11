"""Probe: two ways to take cost out of the boundaries of a batch-1 decode layer's GEMVs.

1. ``pdl``: since the norm fold, a layer's GEMVs follow each other directly (out_proj -> gate_up,
   down -> the next layer's in_proj). With programmatic dependent launch a GEMV's programs can start
   while the previous GEMV drains and load their first W tile (independent of x) before waiting on it.
   A graph of L blocks [out_proj gemv_add 5120x6144 -> gate_up rms_gemv 34816x5120 -> down gemv_add
   5120x17408 -> in_proj rms_gemv 16480x5120], distinct cold weights, is timed with:
   ``product`` (kernels_triton.gemv at the tuned configs), ``plain`` (this probe's M=1 kernel, no PDL),
   ``pdl_wait`` (wait at the start, release after the K loop), ``pdl_pre`` (first W tile loaded
   before the wait, release after the loop), ``pdl_pre_early`` (the same, release at the start).
2. ``gated``: Gated DeltaNet's gated RMSNorm (groups of 128, y = x / rms(x) * g * silu(z)) computed in
   out_proj's K loop (gemv_add 5120x6144, scale per group after the group's dot) against the tuned
   gated_rms_norm kernel followed by the tuned gemv_add, L layers in one graph.

Every variant's output is checked against fp32 torch before it is timed.
Usage (GPU): python benchmarks/gemv_boundary_probe.py --out DIR. Writes DIR/gemv_boundary.json.
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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.l2_prefetch_probe import time_graph  # noqa: E402  (median of graph replays, us)
from kernels_triton.gated_rms_norm import GatedRmsNormConfig, gated_rms_norm  # noqa: E402
from kernels_triton.gemv import GemvConfig, gemv  # noqa: E402

EPS = 1e-6
#: tuned M=1 configs of h200-serve-merge-df17426 (fused table) and 8031457 (main)
LONG_K = dict(BLOCK_N=4, BLOCK_K=512, num_warps=2, num_stages=1)  # 5120x6144, 5120x17408 gemv_add
WIDE = dict(BLOCK_N=1, BLOCK_K=256, num_warps=1, num_stages=4)  # 34816x5120, 16480x5120 rms_gemv
BLOCK = [  # (name, n, k, kind, config)
    ("out_proj", 5120, 6144, "add", LONG_K),
    ("gate_up", 34816, 5120, "rms", WIDE),
    ("down", 5120, 17408, "add", LONG_K),
    ("in_proj", 16480, 5120, "rms", WIDE),
]


@triton.jit
def _probe_gemv_kernel(x_ptr, w_ptr, y_ptr, r_ptr, N, K, eps,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr, RMS: tl.constexpr,
                       PDL: tl.constexpr, PRE: tl.constexpr, EARLY: tl.constexpr):
    # M = 1, K a multiple of BLOCK_K; W streamed with evict_first as the tuned kernels
    pid = tl.program_id(0)
    rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    if PRE:
        w0 = tl.load(w_ptrs, eviction_policy="evict_first")  # W does not depend on the previous grid
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    if PRE:
        x0 = tl.load(x_ptr + offs_k).to(tl.float32)
        acc += w0.to(tl.float32) * x0[None, :]
        if RMS:
            ss += x0 * x0
        start = BLOCK_K
    else:
        start = 0
    for k0 in range(start, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        if RMS:
            ss += x * x
    if PDL and not EARLY:
        gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if RMS:
        y = y * tl.rsqrt(tl.sum(ss) / K + eps)
    if HAS_RES:
        y += tl.load(r_ptr + rows).to(tl.float32)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _gated_gemv_add_kernel(x_ptr, z_ptr, g_ptr, w_ptr, y_ptr, r_ptr, N, K, eps,
                           BLOCK_N: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr):
    # y = (x / rms_group(x) * g * silu(z)) W^T + residual; a K step is HEADS whole groups, so each
    # group's rms comes from the tile already loaded (no prologue pass); the activation is rounded to
    # BF16 where vLLM's gated norm writes it
    pid = tl.program_id(0)
    rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    offs_h = tl.arange(0, HEADS)
    offs_g = tl.arange(0, GROUP)
    offs_k = offs_h[:, None] * GROUP + offs_g[None, :]  # [HEADS, GROUP]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None, None] * K + offs_k[None, :, :]
    g = tl.load(g_ptr + offs_g).to(tl.float32)
    acc = tl.zeros([BLOCK_N, HEADS, GROUP], dtype=tl.float32)
    for k0 in range(0, K, HEADS * GROUP):
        x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
        z = tl.load(z_ptr + k0 + offs_k).to(tl.float32)
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / GROUP + eps)
        a = (x * rstd[:, None] * g[None, :] * (z / (1.0 + tl.exp(-z)))).to(tl.bfloat16).to(tl.float32)
        acc += w.to(tl.float32) * a[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.load(r_ptr + rows).to(tl.float32)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def probe_gemv(x, w, out, residual, kind, config, pdl=False, pre=False, early=False):
    n, k = w.shape
    _probe_gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
        x, w, out, residual if residual is not None else out, n, k, EPS,
        BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], HAS_RES=kind == "add", RMS=kind == "rms",
        PDL=pdl, PRE=pre, EARLY=early, num_warps=config["num_warps"], num_stages=config["num_stages"],
        **({"launch_pdl": True} if pdl else {}))


def product_gemv(x, w, out, residual, kind, config):
    cfg = GemvConfig(W_EVICT="evict_first", **config)
    gemv(x, w, cfg, out=out, residual=residual, rms_eps=EPS if kind == "rms" else None)


def reference(x, w, residual, kind):
    xf = x.float()
    if kind == "rms":
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    y = xf @ w.float().T
    return y + residual.float() if kind == "add" else y


def capture(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def pdl_probe(layers: int) -> list[dict]:
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    blocks = []
    for _ in range(layers):
        layer = []
        for name, n, k, kind, config in BLOCK:
            w = (torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16)
            layer.append((name, w, kind, config))
        blocks.append(layer)
    hidden = torch.randn(1, 5120, device=dev, generator=gen).to(torch.bfloat16)
    # activations: each GEMV reads the previous one's output (sliced to its K), as in the layer
    bufs = {}

    def run(variant: str) -> torch.Tensor:
        h = hidden
        x = torch.randn(1, 6144, device=dev, generator=gen).to(torch.bfloat16) if "x0" not in bufs else bufs["x0"]
        bufs["x0"] = x
        for li, layer in enumerate(blocks):
            for name, w, kind, config in layer:
                key = (variant, li, name)
                if key not in bufs:
                    bufs[key] = torch.empty(1, w.shape[0], device=dev, dtype=torch.bfloat16)
                out = bufs[key]
                inp = x[:, : w.shape[1]] if name in ("out_proj", "down") else h
                inp = inp.contiguous() if not inp.is_contiguous() else inp
                residual = h if kind == "add" else None
                if variant == "product":
                    product_gemv(inp, w, out, residual, kind, config)
                else:
                    probe_gemv(inp, w, out, residual, kind, config, pdl=variant != "plain",
                               pre=variant.startswith("pdl_pre"), early=variant == "pdl_pre_early")
                if kind == "add":
                    h = out
                else:
                    x = out
        return h

    rows = []
    variants = ["product", "plain", "pdl_wait", "pdl_pre", "pdl_pre_early"]
    # correctness: the first layer of every variant against fp32 torch, one GEMV at a time
    for variant in variants:
        for name, w, kind, config in blocks[0]:
            x = torch.randn(1, w.shape[1], device=dev, generator=gen).to(torch.bfloat16)
            r = torch.randn(1, w.shape[0], device=dev, generator=gen).to(torch.bfloat16)
            out = torch.full((1, w.shape[0]), float("nan"), device=dev, dtype=torch.bfloat16)
            if variant == "product":
                product_gemv(x, w, out, r if kind == "add" else None, kind, config)
            else:
                probe_gemv(x, w, out, r if kind == "add" else None, kind, config, pdl=variant != "plain",
                           pre=variant.startswith("pdl_pre"), early=variant == "pdl_pre_early")
            ref = reference(x, w, r, kind)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"{variant} {name}: rel err {err}"
    graphs = {v: capture(lambda v=v: run(v)) for v in variants}
    for rep in range(3):
        for v in variants:
            us = time_graph(graphs[v], replays=15) / layers
            rows.append(dict(probe="pdl", variant=v, repeat=rep, layer_us=us))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def gated_probe(layers: int) -> list[dict]:
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(2)
    n, k, group = 5120, 6144, 128
    ws = [(torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16) for _ in range(layers)]
    xs = [torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    zs = [(2 * torch.randn(1, k, device=dev, generator=gen)).to(torch.bfloat16) for _ in range(layers)]
    g = (1 + 0.1 * torch.randn(group, device=dev, generator=gen)).to(torch.bfloat16)
    res = [torch.randn(1, n, device=dev, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    normed = [torch.empty(1, k, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    norm_cfg = GatedRmsNormConfig(ROWS=4, num_warps=4)
    gemv_cfg = GemvConfig(W_EVICT="evict_first", **LONG_K)

    def fused(i, block_n, heads, warps, stages):
        _gated_gemv_add_kernel[(triton.cdiv(n, block_n),)](
            xs[i], zs[i], g, ws[i], outs[i], res[i], n, k, EPS, BLOCK_N=block_n, HEADS=heads, GROUP=group,
            num_warps=warps, num_stages=stages)

    def unfused(i):
        gated_rms_norm(xs[i].view(1, k), zs[i].view(1, k), g, norm_cfg, out=normed[i], eps=EPS)
        gemv(normed[i], ws[i], gemv_cfg, out=outs[i], residual=res[i])

    def ref(i):
        xg = xs[i].float().view(k // group, group)
        a = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + EPS) * g.float()).view(1, k)
        a = (a * torch.nn.functional.silu(zs[i].float())).to(torch.bfloat16).float()
        return a @ ws[i].float().T + res[i].float()

    shapes = [(4, 4, 2, 1), (4, 4, 4, 1), (4, 4, 4, 2), (2, 4, 2, 1), (8, 2, 4, 1), (4, 2, 2, 1), (2, 8, 4, 1)]
    rows = []
    expect = ref(0)
    unfused(0)
    err = ((outs[0].float() - expect).abs().max() / expect.abs().max()).item()
    assert err < 2e-2, f"unfused rel err {err}"
    graphs = {"unfused": capture(lambda: [unfused(i) for i in range(layers)])}
    for shape in shapes:
        outs[0].fill_(float("nan"))
        fused(0, *shape)
        err = ((outs[0].float() - expect).abs().max() / expect.abs().max()).item()
        assert err < 2e-2, f"fused {shape} rel err {err}"
        graphs[f"fused{shape}"] = capture(lambda s=shape: [fused(i, *s) for i in range(layers)])
    graphs["gemv_add_only"] = capture(lambda: [gemv(normed[i], ws[i], gemv_cfg, out=outs[i], residual=res[i])
                                               for i in range(layers)])
    for rep in range(3):
        for name, graph in graphs.items():
            rows.append(dict(probe="gated", variant=name, repeat=rep, layer_us=time_graph(graph, replays=15) / layers))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = gated_probe(40) + pdl_probe(args.layers)
    (args.out / "gemv_boundary.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                                            indent=1))
    print("\nprobe variant median_us_per_layer (3 repeats)")
    for probe, variant in dict.fromkeys((r["probe"], r["variant"]) for r in rows):
        us = [r["layer_us"] for r in rows if r["probe"] == probe and r["variant"] == variant]
        print(f"{probe:6} {variant:24} {statistics.median(us):9.2f}  {[round(u, 2) for u in us]}")


if __name__ == "__main__":
    main()
