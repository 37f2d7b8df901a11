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
is consistent with the driver clearing freed memory in the background at about 400 GB/s. Every
condition therefore starts ``--settle-s`` after the previous condition's memory was released; with
``--settle-s 0`` the probe measures that window too (its first run did: ``empty`` 11-12% slow).

The vendor path (``tunekit.backends.vendor``: cuBLAS, and the unfused sequence of a fused op) is timed
beside each entry, interleaved on the same operands, so each condition also gives the entry's speedup.
Every kernel is verified before it is timed (``tunekit.verify``); times come from ``tunekit.bench``.
Usage (GPU): python benchmarks/memory_pressure_probe.py --table T [--table T2] [--leave-gib 12]
[--rounds 3] [--settle-s 1] --out DIR. Writes DIR/memory_pressure.json and prints one line per problem.
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
from tunekit import opspec, table, verify  # noqa: E402
from tunekit.backends import get  # noqa: E402
from tunekit.bench import Rotation, time_interleaved  # noqa: E402
from tunekit.device import detect  # noqa: E402
from tunekit.shapes import Problem  # noqa: E402

CONDITIONS = ("empty", "fill_after", "fill_before")


def _fill(leave_bytes: int) -> torch.Tensor | None:
    free, _total = torch.cuda.mem_get_info()
    size = free - leave_bytes
    return torch.empty(size, dtype=torch.uint8, device="cuda") if size > 0 else None


def _time_under(condition: str, kernels: dict, spec, problem: Problem, device, leave_bytes: int,
                settle_s: float) -> dict[str, float]:
    time.sleep(settle_s)  # the previous condition's freed memory is cleared before this one is timed
    fill = _fill(leave_bytes) if condition == "fill_before" else None
    rotation = Rotation(spec, problem, device)
    if condition == "fill_after":
        fill = _fill(leave_bytes)
    try:
        return {name: t.median_us for name, t in time_interleaved(kernels, rotation).items()}
    finally:
        del rotation, fill
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="append", required=True)
    parser.add_argument("--leave-gib", type=float, default=12.0, help="free memory left by a fill")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=1.0, help="wait after each release of memory")
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
                got = _time_under(condition, kernels, spec, problem, device, leave, args.settle_s)
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
    args.out.mkdir(parents=True, exist_ok=True)
    free, total = torch.cuda.mem_get_info()
    doc = {"device": device.as_dict(), "torch": torch.__version__, "leave_gib": args.leave_gib,
           "settle_s": args.settle_s, "rounds": args.rounds, "tables": args.table, "memory_total": total, "rows": rows}
    (args.out / "memory_pressure.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
