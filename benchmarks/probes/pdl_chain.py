"""Programmatic dependent launch on a decode token's GEMV chain: the same kernels with and without PDL.

Per M, every GEMV of one decode token of the model in vLLM's layer order (full-attention layers every
``--full-every``-th layer, as Qwen3.5; lm_head last), each on its own weights (the model's real bytes,
51 GB for Qwen3.5-27B: cold in L2 as in serving), captured as one CUDA graph three times:

* ``vendor``: ``F.linear`` (cuBLAS);
* ``triton``: ``kernels_triton.gemv`` at each shape's config, launched without PDL;
* ``triton_pdl``: the same kernels and configs with PDL (``kernels_triton.pdl``).

The three graphs are replayed interleaved (vendor, triton, triton_pdl, vendor, ...) and each figure is the
median of the replays; the floor is the chain's weight bytes at the measured read limit. Configs: the
table's Triton entry at this (M, N, K), else its Triton entry of the shape at the nearest M whose config
runs at M, else a fixed one (``SOURCE`` in the output says which).

Before any timing, two correctness gates:
* a dependent chain (each GEMV reads the previous one's output, 64 steps of 5120 x 5120, plain and
  split-K configs) with PDL must give the bits of the same chain without PDL, and stay within the
  fp32 reference's bound; a PDL kernel that read its input before the wait would differ here;
* every chain output of ``triton_pdl`` equals ``triton``'s bits after one replay of each graph.

The MLP blocks: per M, the model's layers as [fused add + RMSNorm -> gate_up GEMV -> SiLU-and-mul -> down
GEMV] (the elementwise kernels at their family defaults), all Triton, with and without PDL: where a GEMV
follows a short elementwise kernel it can prefetch its weight while that kernel runs.

A diagnostic row: 256 back-to-back N=96 GEMVs (latency-bound, 2-4 us each), where a launch overlap, if
the graph keeps the programmatic edges, must show.

    python benchmarks/probes/pdl_chain.py --out OUT [--model qwen3.5-27b] [--table T.json] [--m 1,2,4,8,16]

Writes OUT/pdl_chain.json (every replay's time) and prints a table. Needs a CUDA GPU of sm_90 or later.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kernels_triton import gemv as g  # noqa: E402
from kernels_triton import pdl  # noqa: E402
from tunekit.problems.models.load import load_model  # noqa: E402


def chain_shapes(model: str, full_every: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of one token's GEMVs in layer order."""
    spec = load_model(model)
    lin = {name: (n, k) for name, n, k, _ in spec.linears()}
    layers = spec.num_layers
    out: list[tuple[str, int, int]] = []
    for layer in range(layers):
        full = "qkv_proj" in lin and ("linear_attn.in_proj_qkvz" not in lin or layer % full_every == full_every - 1)
        names = ("qkv_proj", "o_proj") if full else tuple(
            n for n in ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj") if n in lin)
        names += tuple(n for n in ("mlp.gate_up_proj", "mlp.down_proj") if n in lin)
        out += [(n, *lin[n]) for n in names]
    if "lm_head" in lin:
        out.append(("lm_head", *lin["lm_head"]))
    return out


def pick_config(entries: list[dict], m: int, n: int, k: int) -> tuple[g.GemvConfig, str]:
    mine = [e for e in entries if e["op"] == "gemv" and e["n"] == n and e["k"] == k and e["backend"] == "triton"]
    for e in sorted(mine, key=lambda e: (e["m"] != m, abs(e["m"] - m), e["m"] < m)):
        config = g.GemvConfig.from_params(e["params"])
        if g.invalid_reason(config, m, n, k) is None:
            return config, "table" if e["m"] == m else f"table@M={e['m']}"
    split = 8 if n < 1024 else 1
    config = g.GemvConfig(BLOCK_N=4, BLOCK_K=256 if m > 1 else 512, num_warps=4, num_stages=2, SPLIT_K=split,
                          M_MODE="rows" if m > 1 else "tile")
    if g.invalid_reason(config, m, n, k) is not None:
        config = g.DEFAULT
    return config, "fixed"


def capture(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_interleaved(graphs: dict[str, torch.cuda.CUDAGraph], replays: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for graph in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    for _ in range(replays):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)  # us
    return times


def dependent_gate(device: torch.device) -> list[dict]:
    """The dependent chain, PDL against no PDL: bit-equal, and near the fp32 reference."""
    torch.manual_seed(0)
    k, steps = 5120, 64
    ws = [(torch.randn(k, k, device=device) / k ** 0.5).to(torch.bfloat16) for _ in range(steps)]
    x0 = torch.randn(4, k, device=device).to(torch.bfloat16)
    rows = []
    for m in (1, 4):
        for config in (g.GemvConfig(BLOCK_N=4, BLOCK_K=512, num_stages=2, M_MODE="rows" if m > 1 else "tile"),
                       g.GemvConfig(BLOCK_N=4, BLOCK_K=256, SPLIT_K=4, SPLIT_REDUCE="fused",
                                    M_MODE="rows" if m > 1 else "tile"),
                       g.GemvConfig(BLOCK_N=4, BLOCK_K=256, SPLIT_K=4, SPLIT_REDUCE="kernel",
                                    M_MODE="rows" if m > 1 else "tile")):
            outs = {}
            for on in (False, True):
                bufs = [x0[:m].clone()] + [torch.full((m, k), float("nan"), device=device, dtype=torch.bfloat16)
                                           for _ in range(steps)]

                def run(bufs=bufs, on=on, config=config):
                    for i, w in enumerate(ws):
                        g.gemv(bufs[i], w, config, out=bufs[i + 1], use_pdl=on)

                graph = capture(run)
                for b in bufs[1:]:
                    b.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                outs[on] = bufs[-1].clone()
            ref = x0[:m].float()
            for w in ws:
                ref = (ref @ w.float().T).to(torch.bfloat16).float()
            rows.append({"m": m, "config": config.as_params(), "bit_equal": bool(torch.equal(outs[False], outs[True])),
                         "finite": bool(torch.isfinite(outs[True]).all()),
                         "max_rel_vs_fp32": float((outs[True].float() - ref).abs().max() / ref.abs().max())})
    return rows


def mlp_blocks(args, device: torch.device, entries: list[dict], report: dict) -> dict:
    """The MLP blocks of every layer, norm and activation between the GEMVs, with and without PDL."""
    from kernels_triton import fused_add_rms_norm as fan
    from kernels_triton import silu_and_mul as sam

    spec = load_model(args.model)
    lin = {name: (n, k) for name, n, k, _ in spec.linears()}
    (ng, h), (nd, kd) = lin["mlp.gate_up_proj"], lin["mlp.down_proj"]
    layers = spec.num_layers
    wg = [torch.empty(ng, h, device=device, dtype=torch.bfloat16).normal_(0, h ** -0.5) for _ in range(layers)]
    wd = [torch.empty(nd, kd, device=device, dtype=torch.bfloat16).normal_(0, kd ** -0.5) for _ in range(layers)]
    gain = torch.randn(h, device=device).to(torch.bfloat16) * 0.1
    out: dict = {}
    print("| M | MLP blocks, no PDL us | with PDL us | PDL saves |")
    print("| --- | --- | --- | --- |")
    for m in [int(v) for v in args.m.split(",")]:
        cg, cd = pick_config(entries, m, ng, h)[0], pick_config(entries, m, nd, kd)[0]
        x0 = torch.randn(m, h, device=device).to(torch.bfloat16)
        r0 = torch.randn(m, h, device=device).to(torch.bfloat16)
        bufs = {on: dict(x=x0.clone(), r=[r0.clone(), torch.empty_like(r0)], y=torch.empty_like(x0),
                         g=torch.empty(m, ng, device=device, dtype=torch.bfloat16),
                         a=torch.empty(m, ng // 2, device=device, dtype=torch.bfloat16)) for on in (False, True)}

        def blocks(on: bool, cg=cg, cd=cd, bufs=bufs):
            b = bufs[on]
            for i in range(layers):  # the residual ping-pongs between two buffers
                fan.fused_add_rms_norm(b["x"], b["r"][i % 2], gain, out=(b["y"], b["r"][(i + 1) % 2]), gemma=True,
                                       use_pdl=on)
                g.gemv(b["y"], wg[i], cg, out=b["g"], use_pdl=on)
                sam.silu_and_mul(b["g"], out=b["a"], use_pdl=on)
                g.gemv(b["a"], wd[i], cd, out=b["x"], use_pdl=on)

        graphs = {on: capture(lambda on=on: blocks(on)) for on in (False, True)}
        # correctness: one replay of each from the same inputs gives the same bits
        for on in (False, True):
            bufs[on]["x"].copy_(x0)
            bufs[on]["r"][0].copy_(r0)
            graphs[on].replay()
        torch.cuda.synchronize()
        last = layers % 2
        same = (torch.equal(bufs[False]["x"], bufs[True]["x"])
                and torch.equal(bufs[False]["r"][last], bufs[True]["r"][last]))
        finite = bool(torch.isfinite(bufs[True]["x"]).all())
        times = time_interleaved({"triton": graphs[False], "triton_pdl": graphs[True]}, args.replays)
        med = {v: statistics.median(t) for v, t in times.items()}
        out[m] = {"times_us": times, "median_us": med, "bit_equal_pdl": same, "finite": finite}
        print(f"| {m} | {med['triton']:.0f} | {med['triton_pdl']:.0f} | {med['triton'] - med['triton_pdl']:.0f} us "
              f"({(med['triton'] / med['triton_pdl'] - 1) * 100:.2f}%) | bits {'equal' if same else 'DIFFER'}, "
              f"finite {finite}")
        report["mlp_blocks"] = out
        del graphs
    wg.clear()
    wd.clear()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3.5-27b")
    ap.add_argument("--table", default=None, help="a table whose Triton GEMV configs to use (default: fixed)")
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--full-every", type=int, default=4)
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    why = pdl.unsupported_reason(device)
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": __import__("triton").__version__, "pdl_unsupported": why, "model": args.model}
    print(f"{report['gpu']}: torch {report['torch']}, triton {report['triton']}; PDL: {why or 'supported'}")
    if why:
        (out / "pdl_chain.json").write_text(json.dumps(report, indent=1))
        return 1
    gate = dependent_gate(device)
    report["dependent_gate"] = gate
    for row in gate:
        print(f"gate M={row['m']} split={row['config']['SPLIT_K']}/{row['config']['SPLIT_REDUCE']}: "
              f"bit_equal={row['bit_equal']} finite={row['finite']} rel={row['max_rel_vs_fp32']:.2e}")
    if not all(r["bit_equal"] and r["finite"] and r["max_rel_vs_fp32"] < 0.05 for r in gate):
        (out / "pdl_chain.json").write_text(json.dumps(report, indent=1))
        print("FAIL: PDL changed the dependent chain's result; nothing timed")
        return 1

    from tunekit.measure.bench import probe_bandwidth
    from tunekit.measure.device import detect
    limit = probe_bandwidth(detect()).read_gbps
    report["read_limit_gbps"] = limit
    entries = json.loads(Path(args.table).read_text())["entries"] if args.table else []
    report["mlp_blocks"] = mlp_blocks(args, device, entries, report)
    (out / "pdl_chain.json").write_text(json.dumps(report, indent=1))
    shapes = chain_shapes(args.model, args.full_every)
    weights = {}
    for i, (_, n, k) in enumerate(shapes):
        weights[i] = torch.empty(n, k, device=device, dtype=torch.bfloat16).normal_(0, k ** -0.5)
    wbytes = sum(w.numel() * 2 for w in weights.values())
    report["weight_bytes"] = wbytes
    print(f"{len(shapes)} GEMVs per token, {wbytes / 1e9:.2f} GB of weights; read limit {limit:.0f} GB/s "
          f"-> floor {wbytes / limit / 1e3:.1f} us")

    # diagnostic: latency-bound back-to-back GEMVs
    small_w = [torch.randn(96, 5120, device=device).to(torch.bfloat16) for _ in range(256)]
    xs = torch.randn(1, 5120, device=device).to(torch.bfloat16)
    ys = torch.empty(1, 96, device=device, dtype=torch.bfloat16)
    small_cfg = g.GemvConfig(BLOCK_N=4, BLOCK_K=128, num_warps=8, num_stages=1, SPLIT_K=8)
    small = {on: capture(lambda on=on: [g.gemv(xs, w, small_cfg, out=ys, use_pdl=on) for w in small_w])
             for on in (False, True)}
    st = time_interleaved({"triton": small[False], "triton_pdl": small[True]}, args.replays)
    report["small_n96_x256"] = st
    print(f"diagnostic 256 x (96x5120, split-K 8): no PDL {statistics.median(st['triton']):.1f} us, "
          f"PDL {statistics.median(st['triton_pdl']):.1f} us")

    report["per_m"] = {}
    print("| M | vendor us | triton us | triton+PDL us | PDL saves | triton/vendor | PDL/vendor | % of floor (PDL) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in [int(v) for v in args.m.split(",")]:
        x = torch.randn(m, max(k for _, _, k in shapes), device=device).to(torch.bfloat16)
        cfgs = [pick_config(entries, m, n, k) for _, n, k in shapes]
        outs = {v: [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _, n, _ in shapes]
                for v in ("vendor", "triton", "triton_pdl")}

        def vendor(m=m, x=x, outs=outs):
            for i, (_, _, k) in enumerate(shapes):
                torch.matmul(x[:, :k], weights[i].T, out=outs["vendor"][i])

        def tuned(on: bool, m=m, x=x, cfgs=cfgs, outs=outs):
            name = "triton_pdl" if on else "triton"
            for i, (_, _, k) in enumerate(shapes):
                g.gemv(x[:, :k], weights[i], cfgs[i][0], out=outs[name][i], use_pdl=on)

        t0 = time.time()
        graphs = {"vendor": capture(vendor), "triton": capture(lambda: tuned(False)),
                  "triton_pdl": capture(lambda: tuned(True))}
        same = all(torch.equal(a, b) for a, b in zip(outs["triton"], outs["triton_pdl"], strict=True))
        close = max(float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6))
                    for a, b in zip(outs["triton_pdl"], outs["vendor"], strict=True))
        times = time_interleaved(graphs, args.replays)
        med = {v: statistics.median(t) for v, t in times.items()}
        floor = wbytes / limit / 1e3 * 1.0  # us at the read limit (x is negligible)
        report["per_m"][m] = {"times_us": times, "median_us": med, "bit_equal_pdl": same,
                              "max_rel_vs_vendor": close, "configs": [(c.as_params(), s) for c, s in cfgs],
                              "floor_us": floor, "build_s": time.time() - t0}
        print(f"| {m} | {med['vendor']:.0f} | {med['triton']:.0f} | {med['triton_pdl']:.0f} | "
              f"{med['triton'] - med['triton_pdl']:.0f} us ({(med['triton'] / med['triton_pdl'] - 1) * 100:.2f}%) | "
              f"{med['vendor'] / med['triton']:.4f}x | {med['vendor'] / med['triton_pdl']:.4f}x | "
              f"{floor / med['triton_pdl'] * 100:.1f}% | bits {'equal' if same else 'DIFFER'}, "
              f"rel {close:.1e}; sources {sorted(set(s for _, s in cfgs))}")
        (out / "pdl_chain.json").write_text(json.dumps(report, indent=1))
        del graphs
        torch.cuda.empty_cache()
    (out / "pdl_chain.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
