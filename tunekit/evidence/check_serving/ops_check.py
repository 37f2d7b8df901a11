"""Every table entry's op eagerly, under ``torch.compile(fullgraph=True)`` and under CUDA-graph capture + replay.

For each entry of the loaded tables (the first table wins a duplicate key, as in serving): inputs of the
entry's problem from ``tunekit.problems.opspec``; ``torch.ops.tunekit.<op>`` eagerly, compiled and captured (output
poisoned with NaN before the replay). Compiled and replayed outputs must equal eager bitwise (same kernel);
eager must be within the op's BF16 bound of the fp64 reference (``opspec.error_bound``; the vendor path's own
ratio and the max |tuned - vendor| are reported). ``tunekit.dispatch_stats()`` is reset and read around each
mode and must show the tuned kernel; under capture the counts are made once, at capture, and replays count
nothing (checked). Without CUDA, graph capture is a SKIP line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tunekit.evidence.check_serving.checks import (
    Outputs,
    Report,
    as_tuple,
    bitwise_equal,
    error_text,
    fmt_counts,
    impl_counts,
    sync,
)
from tunekit.problems import opspec
from tunekit.problems.shapes import Problem
from tunekit.table import Entry

#: Ops whose schema has no eps argument.
NO_EPS_OPS = ("gemv", "silu_and_mul", "bias_gelu")


def table_entries(paths: Sequence[str]) -> list[tuple[str, Entry]]:
    """(table path, entry) of the tables that load, first path winning a duplicate key (as tunekit.ops merges
    them).

    A table that does not load is skipped here (run_check reports it as a FAIL).
    """
    from tunekit import table as table_mod

    seen: set[tuple] = set()
    out = []
    for path in paths:
        try:
            entries = table_mod.entries(table_mod.load(path))
        except Exception:
            continue
        for entry in entries:
            if entry.key not in seen:
                seen.add(entry.key)
                out.append((str(path), entry))
    return out


def _call_args(op: str, inputs: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    return inputs if op in NO_EPS_OPS else (*inputs, opspec.EPS)


def _reference(problem: Problem, inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(fp64 references, per-element bounds) of ``tunekit.problems.opspec``, one tuple entry per output."""
    spec = opspec.get(problem.op)
    ref = spec.reference(inputs)
    return as_tuple(ref), as_tuple(spec.error_bound(problem, inputs, ref))


def _err_ratio(y: Outputs, refs: tuple[torch.Tensor, ...], bounds: tuple[torch.Tensor, ...]) -> float:
    """max |y - ref| / bound over every element of every output (inf if any is not finite)."""
    worst = 0.0
    for out, ref, bound in zip(as_tuple(y), refs, bounds, strict=True):
        err = (out.double().reshape(ref.shape) - ref).abs() / bound
        value = float(err.max())
        if not math.isfinite(value):
            return math.inf
        worst = max(worst, value)
    return worst


def _vendor_output(problem: Problem, inputs: tuple[torch.Tensor, ...], device: torch.device) -> Outputs:
    """The vendor path of tunekit.backends.vendor (cuBLAS GEMV; vLLM's eager composition of the norms)."""
    from tunekit import backends
    from tunekit.measure.device import detect

    spec = opspec.get(problem.op)
    out = spec.make_output(problem, device)
    kernel = backends.get("vendor").build(problem, {}, detect())
    kernel(inputs, out)
    return out


def _max_abs_diff(a: Outputs, b: Outputs) -> float:
    pairs = zip(as_tuple(a), as_tuple(b), strict=True)
    return max(float((x.double() - y.double().reshape(x.shape)).abs().max()) for x, y in pairs)


def check_entry(report: Report, entry: Entry, table: str, device: torch.device, seed: int,
                compile_backend: str) -> dict[str, Any]:
    """Eager / torch.compile / CUDA graph of one table entry's op (of the table at path ``table``); returns the
    numbers."""
    from tunekit import ops

    problem = entry.problem
    name = f"{problem.key} [{entry.backend}]"
    row: dict[str, Any] = {"key": problem.key, "backend": entry.backend, "table": table,
                           "table_speedup": entry.speedup}
    expected = f"tuned:{entry.backend}"
    try:
        spec = opspec.get(problem.op)
        gen = torch.Generator(device=device).manual_seed(seed)
        inputs = spec.make_inputs(problem, device, gen)
        args = _call_args(problem.op, inputs)
        fn = getattr(torch.ops.tunekit, problem.op)
    except Exception as exc:
        report.add("FAIL", f"ops setup {name}", error_text(exc))
        row["error"] = error_text(exc)
        return row

    # eager
    eager: Outputs | None = None
    try:
        ops.reset_stats()
        eager = fn(*args)
        sync(device)
        counts = impl_counts(ops.dispatch_stats(reset=True))
        row["eager_impls"] = counts
        hit = counts.get(expected, 0) > 0
        report.add("PASS" if hit else "FAIL", f"ops eager {name}",
                   f"markers {fmt_counts(counts)}" + ("" if hit else f" (expected {expected})"))
    except Exception as exc:
        report.add("FAIL", f"ops eager {name}", error_text(exc))
        row["eager_error"] = error_text(exc)
        return row

    # accuracy: fp64 reference within the op's bound; the vendor path for comparison
    try:
        refs, bounds = _reference(problem, inputs)
        ratio = _err_ratio(eager, refs, bounds)
        vendor = _vendor_output(problem, inputs, device)
        vendor_ratio = _err_ratio(vendor, refs, bounds)
        del refs, bounds
        diff = _max_abs_diff(eager, vendor)
        row.update(err_ratio=ratio, vendor_err_ratio=vendor_ratio, max_abs_diff_vs_vendor=diff)
        ok = ratio <= 1.0
        report.add("PASS" if ok else "FAIL", f"ops bound {name}",
                   f"err/bound {ratio:.3g} (vendor {vendor_ratio:.3g}); max|tuned - vendor| {diff:.3g}")
    except Exception as exc:
        report.add("FAIL", f"ops bound {name}", error_text(exc))
        row["bound_error"] = error_text(exc)

    # torch.compile(fullgraph=True): one opaque node, the same kernel inside
    try:
        torch._dynamo.reset()

        def call(*a: Any) -> Any:
            return fn(*a)

        compiled = torch.compile(call, fullgraph=True, backend=compile_backend)
        compiled(*args)  # compile (and a first run)
        sync(device)
        ops.reset_stats()
        out_c = compiled(*args)
        sync(device)
        counts = impl_counts(ops.dispatch_stats(reset=True))
        same = bitwise_equal(out_c, eager)
        hit = counts.get(expected, 0) > 0
        row.update(compile_impls=counts, compile_bitwise_equal=same)
        report.add("PASS" if same and hit else "FAIL", f"ops compile {name}",
                   f"bitwise equal to eager: {same}; markers {fmt_counts(counts)}")
    except Exception as exc:
        report.add("FAIL", f"ops compile {name}", error_text(exc))
        row["compile_error"] = error_text(exc)
    finally:
        torch._dynamo.reset()

    # CUDA graph capture + replay
    if device.type != "cuda":
        report.add("SKIP", f"ops graph {name}", "SKIP (no CUDA)")
        row["graph"] = "skipped: no CUDA"
        return row
    try:
        sync(device)
        graph = torch.cuda.CUDAGraph()
        ops.reset_stats()
        with torch.cuda.graph(graph):
            out_g = fn(*args)
        capture_rows = ops.dispatch_stats(reset=True)
        for t in as_tuple(out_g):
            t.fill_(float("nan"))  # the replay must write every element
        graph.replay()
        graph.replay()
        sync(device)
        replay_rows = ops.dispatch_stats(reset=True)
        same = bitwise_equal(out_g, eager)
        captured = impl_counts(capture_rows)
        at_capture = all(r["counted_at"] == "capture" for r in capture_rows) and bool(capture_rows)
        hit = captured.get(f"{expected} (at capture)", 0) > 0
        ok = same and hit and at_capture and not replay_rows
        row.update(graph_capture_impls=captured, graph_replay_rows=replay_rows, graph_bitwise_equal=same)
        report.add("PASS" if ok else "FAIL", f"ops graph {name}",
                   f"replay bitwise equal to eager: {same}; markers at capture {fmt_counts(captured)}; "
                   f"2 replays counted {len(replay_rows)} rows (replays run no Python, counts are captures)")
        del graph
    except Exception as exc:
        report.add("FAIL", f"ops graph {name}", error_text(exc))
        row["graph_error"] = error_text(exc)
    return row


def check_ops(report: Report, paths: Sequence[str], device: torch.device, seed: int,
              compile_backend: str) -> list[dict[str, Any]]:
    try:
        entries = table_entries(paths)
    except Exception as exc:
        report.add("FAIL", "ops tables", error_text(exc))
        return []
    if not entries:
        report.add("SKIP", "ops", "no table entries to check (no --table, or the tables are empty)")
        return []
    report.info(f"ops: {len(entries)} table entries, compile backend {compile_backend}")
    rows = []
    for i, (table, entry) in enumerate(entries):
        try:
            rows.append(check_entry(report, entry, table, device, seed + i, compile_backend))
        except Exception as exc:  # check_entry guards itself; this is the last net
            report.add("FAIL", f"ops {entry.op} m{entry.m} n{entry.n} k{entry.k}", error_text(exc))
    return rows
