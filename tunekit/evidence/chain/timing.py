"""The chain's variants captured as CUDA graphs and timed interleaved (A B C A B C ...); optionally each
graph's replays read by torch's profiler as serve-bench reads a served step.

Call protocol: ``measure(chain, variants, iters, repeats, profile_replays)`` on a bound chain on a GPU;
one :class:`~tunekit.evidence.chain.results.VariantResult` per variant, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from tunekit.errors import UserError
from tunekit.evidence.chain.results import VariantResult, variant_result
from tunekit.evidence.chain.variants import Chain


def measure(chain: Chain, variants: Sequence[str], iters: int = 20, repeats: int = 15,
            profile_replays: int = 0) -> list[VariantResult]:
    """Capture each bound variant as one CUDA graph and time the replays interleaved (A B C A B C ...).

    Needs a GPU. Each variant is run eagerly twice first (compiles, builds and
    caches every kernel outside the capture), and its logits are compared with
    the vendor variant's. With ``profile_replays``, after the timing each graph's
    replays are also read by torch's profiler with serve-bench's key (the same
    GEMV problem is then the same row here and in a served step's ``by_launch``).
    Returns one result per variant, in order.
    """
    if chain.device.type != "cuda":
        raise UserError("timing a chain needs a GPU (CUDA / ROCm); on the CPU use compare_eager")
    logits = {}
    for v in variants:
        for _ in range(2):
            logits[v] = chain.forward(v).float().clone()
    torch.cuda.synchronize(chain.device)
    graphs = {}
    for v in variants:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain.forward(v)
        graphs[v] = graph
    for v in variants:  # warm replays
        graphs[v].replay()
    torch.cuda.synchronize(chain.device)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                graphs[v].replay()
            end.record()
            end.synchronize()
            times[v].append(start.elapsed_time(end) * 1000.0 / iters)
    launches = {v: _profiled_launches(graphs[v], profile_replays) for v in variants} if profile_replays else {}
    base = logits.get("vendor")
    ref = chain.forward_fp32()
    return [replace(variant_result(v, times[v], chain.kinds[v], logits[v], base, ref, len(chain.fused.get(v, ()))),
                    by_launch=launches.get(v)) for v in variants]


def _profiled_launches(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, dict[str, float]]:
    """``replays`` replays of ``graph`` under torch's profiler, per launch shape and predecessor, per replay
    (largest time first)."""
    from tunekit.evidence.serve_bench.profile import launch_totals, traced

    trace = traced(lambda: [graph.replay() for _ in range(replays)], "CUDA")
    rows = {key: {f: v / replays for f, v in row.items()} for key, row in launch_totals(trace).items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["us"]))
