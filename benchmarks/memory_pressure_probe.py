"""Probe: is a tuned GEMV slower when the GPU's memory is nearly full?

Timed standalone inside a served vLLM engine's process (``TUNEKIT_PROFILE_KERNELS=1``), the tuned
GEMVs of a Qwen3.5-27B table ran 0.8-2.4% slower than their table entries (h200-served-gap-ad3a8ee).
That process differs from a search's in one obvious way: its KV cache holds about 90% of the GPU's
memory, and the rotated operands are allocated into what is left. This probe times each M=1 GEMV
entry of the given tables in one fresh process under three conditions, rounds interleaved:

- ``empty``: the operands allocated and timed on an otherwise empty GPU (a search's condition);
- ``fill_after``: the operands allocated first, then the GPU filled to ``--leave-gib`` free
  (the served weights' condition: loaded before vLLM sizes its KV cache);
- ``fill_before``: the GPU filled first, the operands allocated into what is left (the in-process
  timing's condition).

After a large free the GPU is slower for a while: a 120 GB buffer freed (``torch.cuda.empty_cache``)
left the 34816x5120 GEMV 13% slower for 0.3 s, 60 GB for 0.15 s (h200-memory-state-bd038d3), which
is consistent with the driver clearing freed memory in the background at about 400 GB/s. Each
condition's memory is therefore released with ``tunekit.measure.bench.release_memory``, which waits while the
driver clears it; ``--no-wait`` frees without waiting, as the probe's first run did (``empty`` then
11-12% slow: it ran in the window the condition before had left).

The vendor path (``tunekit.backends.vendor``: cuBLAS, and the unfused sequence of a fused op) is timed
beside each entry, interleaved on the same operands, so each condition also gives the entry's speedup.
``--free-window OP:NxK`` measures that window itself for the table's M=1 entry of that problem: the
kernel timed over and over (3 repeats a time) for 3 s after a buffer of each of ``--free-gib`` GB was
allocated and freed without waiting, and after nothing was freed.

Every kernel is verified before it is timed (``tunekit.measure.verify``); times come from ``tunekit.measure.bench``.
Usage (GPU): python benchmarks/memory_pressure_probe.py --table T [--table T2] [--leave-gib 12]
[--rounds 3] [--no-wait] [--free-window rms_gemv:34816x5120 [--free-gib 120,60]] --out DIR.
Writes DIR/memory_pressure.json and prints one line per problem.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tunekit import table
from tunekit.backends import get  # noqa: E402
from tunekit.measure import verify  # noqa: E402
from tunekit.measure.bench import Rotation, release_memory, time_interleaved, time_kernel  # noqa: E402
from tunekit.measure.device import detect  # noqa: E402
from tunekit.problems import opspec
from tunekit.problems.shapes import Problem  # noqa: E402

CONDITIONS = ("empty", "fill_after", "fill_before")


def _fill(leave_bytes: int) -> torch.Tensor | None:
    free, _total = torch.cuda.mem_get_info()
    size = free - leave_bytes
    return torch.empty(size, dtype=torch.uint8, device="cuda") if size > 0 else None


def _time_under(condition: str, kernels: dict, spec, problem: Problem, device, leave_bytes: int,
                wait: bool) -> dict[str, float]:
    fill = _fill(leave_bytes) if condition == "fill_before" else None
    rotation = Rotation(spec, problem, device)
    if condition == "fill_after":
        fill = _fill(leave_bytes)
    try:
        return {name: t.median_us for name, t in time_interleaved(kernels, rotation).items()}
    finally:
        del rotation, fill
        if wait:
            release_memory()
        else:
            torch.cuda.empty_cache()


def _free_window(kernel, spec, problem: Problem, device, sizes_gib: list[float], seconds: float = 3.0) -> dict:
    """{"free_<G>gib" / "none": [(seconds since the free, median us), ...]}: the kernel timed back to back
    after a buffer of G GiB was freed without waiting, and after nothing was freed."""
    rotation = Rotation(spec, problem, device)
    series: dict[str, list[tuple[float, float]]] = {}
    for gib in [*sizes_gib, 0.0]:
        for _ in range(3):
            time_kernel(kernel, rotation, repeats=3)  # warm, and past any earlier window
        release_memory()
        if gib:
            buffer = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            del buffer
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        start, points = time.perf_counter(), []
        while time.perf_counter() - start < seconds:
            us = time_kernel(kernel, rotation, repeats=3).median_us
            points.append((round(time.perf_counter() - start, 4), us))
        series[f"free_{gib:g}gib" if gib else "none"] = points
    del rotation
    release_memory()
    return series


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="append", required=True)
    parser.add_argument("--leave-gib", type=float, default=12.0, help="free memory left by a fill")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-wait", action="store_true", help="free memory without waiting while it is cleared")
    parser.add_argument("--free-window", metavar="OP:NxK", help="also time this entry after large frees")
    parser.add_argument("--free-gib", default="120,60", help="the buffers freed for --free-window, GiB")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = detect()
    if not device.is_gpu:
        print("memory_pressure_probe: needs a GPU", file=sys.stderr)
        return 2
    leave = int(args.leave_gib * (1 << 30))
    entries = [e for path in args.table for e in table.load(path)["entries"]
               if e["m"] == 1 and "gemv" in e["op"] and e["op"] in opspec.OPS]
    rows = []
    for entry in entries:
        problem = Problem(entry["op"], entry["dtype"], 1, entry["n"], entry["k"])
        spec = opspec.get(problem.op)
        kernels = {"tuned": get(entry["backend"]).build(problem, entry["params"], device)}
        if get("vendor").invalid_reason(problem, {}) is None:
            kernels["vendor"] = get("vendor").build(problem, {}, device)
        failed = [name for name, kernel in kernels.items()
                  if not verify.verify(kernel, spec, problem, torch.device(device.torch_device), seed=0).ok]
        if failed:
            rows.append({"problem": str(problem), "error": f"verification failed: {', '.join(failed)}"})
            continue
        times: dict[str, dict[str, list[float]]] = {name: {c: [] for c in CONDITIONS} for name in kernels}
        for r in range(args.rounds):
            order = CONDITIONS if r % 2 == 0 else tuple(reversed(CONDITIONS))
            for condition in order:
                got = _time_under(condition, kernels, spec, problem, device, leave, not args.no_wait)
                for name, us in got.items():
                    times[name][condition].append(us)
        median = {name: {c: statistics.median(v) for c, v in per.items()} for name, per in times.items()}
        tuned = median["tuned"]
        row = {"problem": f"{problem.op} {problem.m}x{problem.n}x{problem.k}", "table_us": entry["time_us"],
               "table_baseline_us": entry.get("baseline_us"), "count": entry.get("count"), "us": median,
               "rounds": times, "fill_before_vs_empty": tuned["fill_before"] / tuned["empty"],
               "fill_after_vs_empty": tuned["fill_after"] / tuned["empty"]}
        if "vendor" in median:
            row["speedup"] = {c: median["vendor"][c] / tuned[c] for c in CONDITIONS}
        rows.append(row)
        print(f"{row['problem']:<28} table {entry['time_us']:8.2f}  " + "  ".join(
            f"{c} {tuned[c]:8.2f}" + (f" (x{row['speedup'][c]:.3f})" if "speedup" in row else "")
            for c in CONDITIONS)
            + f"  before/empty {row['fill_before_vs_empty']:.4f}  after/empty {row['fill_after_vs_empty']:.4f}",
            flush=True)
    window = None
    if args.free_window:
        op, shape = args.free_window.split(":")
        n, k = (int(v) for v in shape.split("x"))
        entry = next(e for e in entries if (e["op"], e["n"], e["k"]) == (op, n, k))
        problem = Problem(op, entry["dtype"], 1, n, k)
        kernel = get(entry["backend"]).build(problem, entry["params"], device)
        window = _free_window(kernel, opspec.get(op), problem, device, [float(g) for g in args.free_gib.split(",")])
        quiet = statistics.median(us for _, us in window["none"])
        for name, points in window.items():
            slow = [t for t, us in points if us > 1.05 * quiet]
            print(f"free window {args.free_window} {name}: first {points[0][1]:.2f} us, last {points[-1][1]:.2f} us,"
                  f" >5% over the no-free median until {max(slow) if slow else 0:.3f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    free, total = torch.cuda.mem_get_info()
    doc = {"device": device.as_dict(), "torch": torch.__version__, "leave_gib": args.leave_gib,
           "wait_after_free": not args.no_wait, "rounds": args.rounds, "tables": args.table, "memory_total": total,
           "rows": rows, "free_window": window}
    (args.out / "memory_pressure.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
