"""Per-launch kernel times of ``tunekit chain``'s CUDA graphs, read as serve-bench reads a served step.

Served in vLLM, a decode step's tunekit GEMVs take more kernel time than the tables' standalone figures
add up to (about 235 us per step for Qwen3.5-27B folded, ``h200-serve-merge-df17426``), while
``tunekit chain`` measures what the tables predict. To tell where the excess is, both must be read the
same way: this runs ``tunekit.chain.run`` and, after its timing at each M, captures every variant's
graph again and profiles a few replays with torch's profiler, keyed by launch shape and predecessor
(``tunekit.serve.profile.launch_totals``, the table ``serve-bench --profile-steps`` writes as
``by_launch``). Each variant's row also holds the replay's wall time, so kernel time and launch gaps
add up against it.

Usage (GPU): python benchmarks/chain_launch_profile.py --model qwen3.5-27b --table T [--table T2]
             [--m 1] --out DIR          -> DIR/chain_launches.json (and the chain's own report)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tunekit import chain as chain_mod  # noqa: E402
from tunekit.models.spec import load_model  # noqa: E402
from tunekit.serve import profile  # noqa: E402

#: replays profiled per variant (each a whole decode step's chain)
REPLAYS = 5


def profile_variants(chain: chain_mod.Chain, variants: list[str]) -> dict[str, dict]:
    """Each variant captured as one graph (as ``chain.measure`` does) and REPLAYS replays profiled."""
    out = {}
    for variant in variants:
        for _ in range(2):
            chain.forward(variant)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain.forward(variant)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def replays(start=start, end=end, graph=graph) -> None:
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()

        trace = profile._traced(replays, "CUDA")
        launches = {key: {f: v / REPLAYS for f, v in row.items()} for key, row in
                    profile.launch_totals(trace).items()}
        out[variant] = {"wall_us": start.elapsed_time(end) * 1000.0 / REPLAYS,
                        "busy_us": sum(r["us"] for r in launches.values()),
                        "gap_us": sum(r["gap_us"] for r in launches.values()),
                        "kernels": sum(r["kernels"] for r in launches.values()),
                        "by_launch": dict(sorted(launches.items(), key=lambda kv: -kv[1]["us"]))}
        del graph
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--table", action="append", required=True)
    ap.add_argument("--m", default="1")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profiling the chain's graphs needs a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    measured = chain_mod.measure
    profiles: list[dict] = []

    def measure_then_profile(chain, variants, iters=20, repeats=15):
        results = measured(chain, variants, iters, repeats)
        if "vendor" in variants:  # the timing of record, not the fusion check's short ones
            profiles.append({"m": chain.m, "timed_us": {r.variant: r.step_us for r in results},
                             "variants": profile_variants(chain, list(variants))})
        return results

    chain_mod.measure = measure_then_profile
    report = chain_mod.run(load_model(args.model), args.table, [int(m) for m in args.m.split(",")])
    (args.out / "chain.json").write_text(json.dumps(report, indent=1))
    (args.out / "chain_launches.json").write_text(json.dumps(profiles, indent=1))
    for row in profiles:
        for variant, p in row["variants"].items():
            print(f"M={row['m']} {variant}: timed {row['timed_us'][variant]:.1f} us, profiled wall "
                  f"{p['wall_us']:.1f}, kernels {p['busy_us']:.1f} us ({p['kernels']:.0f}), gaps {p['gap_us']:.1f}")


if __name__ == "__main__":
    main()
