"""GPU evidence: per-call CPU overhead of the routed ops, eager, at Qwen3.5-27B's M=1 decode shapes.

    python benchmarks/probes/dispatch_overhead.py --table runs/qwen/table.json --out dispatch.json [--calls 2000]

The seven M=1 GEMV shapes of ``load_model('qwen3.5-27b')`` and its 5120 norm. Arms per shape:
``direct`` (F.linear; the norm's PyTorch composition), ``op_vendor`` (torch.ops.tunekit.* with no
table: the vendor path), ``op_tuned`` (the op with --table), and the table's kernel called raw:
``kernel`` (kernel[grid], Triton's launch path) and ``bound`` (tunekit.dispatch.launch's launcher).
Without --table the search spaces' default Triton configs are tabulated for this device.
Wall = perf_counter over --calls back-to-back calls, synchronized only at the ends (small kernels:
the CPU launch path dominates); gpu = CUDA events over 200 calls queued behind a sleep kernel (the
device time per call, launch gaps excluded). Medians of --repeats
interleaved rounds. Overhead = arm wall minus its baseline's wall (op_vendor - direct,
op_tuned - bound). ``module`` / ``patched_vendor`` / ``patched_tuned``: what a ``tunekit.patch``-ed
model runs eager, an ``nn.Linear`` unpatched, patched with no table, patched with --table (the
norm: the patched forward's call); ``eag_vend`` = patched_vendor - module, ``eag_tuned`` =
patched_tuned - bound - (module - direct). ``floor`` is a no-op-Python custom op around the
direct call (torch's own dispatch cost, the part of op_vendor - direct that tunekit cannot
remove). Outputs are checked before anything is timed (bound, op_tuned and patched_tuned
bit-identical to kernel, op_vendor and patched_vendor to direct, tuned within the op's BF16
bound); exits 1 on a failed check.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _arms(op, problem, inputs, kernel, launcher, out):
    import tunekit.ops as ops  # noqa: F401 (registers torch.ops.tunekit.*)
    from tunekit.dispatch.elementwise import _vendor_rms_norm
    from tunekit.dispatch.state import DEFAULT_EPS

    fn, x, w = getattr(torch.ops.tunekit, op), *inputs
    gemma = op.startswith("gemma")
    if op == "gemv":
        direct, routed = (lambda: F.linear(x, w)), (lambda: fn(x, w, None))
        floor = lambda: torch.ops.tunekit_bench.linear(x, w, None)  # noqa: E731
    else:
        direct = lambda: _vendor_rms_norm(x, w, DEFAULT_EPS, gemma)  # noqa: E731
        routed = lambda: fn(x, w, DEFAULT_EPS)  # noqa: E731
        floor = lambda: torch.ops.tunekit_bench.norm(x, w, DEFAULT_EPS, gemma)  # noqa: E731
    arms = {"direct": direct, "floor": floor, "op": routed, "kernel": lambda: kernel(inputs, out)}
    # What a tunekit.patch-ed model runs eager: the module's own forward, unpatched and patched
    # (the patched forward calls the op's impl without torch's dispatcher).
    if op == "gemv":
        import tunekit

        module, patched = (torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
                           for _ in range(2))
        for mod in (module, patched):
            mod.weight = torch.nn.Parameter(w, requires_grad=False)
        tunekit.patch(patched, only_covered=False)
        arms["module"], arms["patched"] = (lambda: module(x)), (lambda: patched(x))
    else:
        from tunekit.integrations.torch_patch import _ELEMENTWISE_FORWARDS

        norm = torch.nn.Module()
        norm.weight, norm.variance_epsilon = torch.nn.Parameter(w, requires_grad=False), DEFAULT_EPS
        patched = _ELEMENTWISE_FORWARDS[op](norm)  # the forward tunekit.patch gives an HF norm module
        arms["module"], arms["patched"] = direct, (lambda: patched(x))
    if launcher is not None:
        arms["bound"] = lambda: launcher(inputs, out) or sys.exit("bound launcher refused its own layout")
    return arms


def _floor_ops():
    """torch's own cost of a Python custom op: ops in a bench namespace whose impl is the direct call."""
    from tunekit.dispatch.elementwise import _vendor_rms_norm

    lib = torch.library.Library("tunekit_bench", "DEF")
    lib.define("linear(Tensor x, Tensor w, Tensor? b=None) -> Tensor")
    lib.define("norm(Tensor x, Tensor w, float eps, bool gemma) -> Tensor")
    lib.impl("linear", lambda x, w, b=None: F.linear(x, w, b), "CUDA")
    lib.impl("norm", _vendor_rms_norm, "CUDA")
    return lib


def _time(fn, calls: int) -> tuple[float, float]:
    """(wall us per call of ``calls`` back-to-back calls, GPU us per call). The GPU time is taken
    with CUDA events over 200 calls queued behind a sleep kernel, so the GPU runs them back to
    back whatever the CPU launch cost: the device time of the call, launch gaps excluded."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls * 1e6
    start, end, queued = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), 200
    torch.cuda._sleep(int(queued * wall * 3000))  # ~1.5x the time the CPU takes to queue the calls (~2 GHz)
    start.record()
    for _ in range(queued):
        fn()
    end.record()
    torch.cuda.synchronize()
    return wall, start.elapsed_time(end) / queued * 1e3


def main(argv: list[str] | None = None) -> int:
    import tunekit.ops as ops
    from tunekit import backends
    from tunekit import table as table_mod
    from tunekit.dispatch import launch
    from tunekit.measure.device import detect
    from tunekit.problems import opspec
    from tunekit.problems.models import load_model
    from tunekit.problems.shapes import Problem

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", help="dispatch table (default: the default Triton configs, tabulated here)")
    ap.add_argument("--out", default="dispatch_overhead.json")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    info, dev, triton = detect(), torch.device("cuda"), backends.get("triton")
    model = load_model("qwen3.5-27b")
    norms = [p for p in model.problems(1, [1], "bf16", ("rms_norm", "gemma_rms_norm")) if p.n == 5120][:1]
    problems = model.problems(1, [1], "bf16", ("gemv",)) + (norms or [Problem("rms_norm", "bf16", 1, 5120, 5120)])
    table_path = args.table
    if table_path is None:
        rows = []
        for p in problems:
            space = triton.space(p)
            params = dict(space.fixed) | dict(space.default)
            rows.append({"op": p.op, "dtype": p.dtype, "m": p.m, "n": p.n, "k": p.k, "backend": "triton",
                         "params": json.dumps(params), "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0,
                         "gbps": 1.0})
        table = table_mod.build_table(rows, info.as_dict(), {}, 0.0, ["triton"])
        table_path = str(table_mod.save(table, Path(tempfile.mkdtemp()) / "default_table.json"))
    merged, lib = table_mod.load(table_path), _floor_ops()  # noqa: F841 (lib keeps the ops defined)
    gen = torch.Generator(device=dev).manual_seed(0)
    results, failed = [], []
    for p in problems:
        spec, entry = opspec.get(p.op), table_mod.lookup(merged, p.op, p.dtype, p.m, p.n, p.k)
        if entry is None:
            print(f"{p.op} {p.n}x{p.k}: not in the table, skipped")
            continue
        inputs = spec.make_inputs(p, dev, gen)
        # the entry's own backend (a HIP winner built as Triton would time another kernel)
        kernel = backends.get(entry["backend"]).build(p, entry["params"], info)
        out, ref_out = spec.make_output(p, dev), spec.make_output(p, dev)
        kernel(inputs, ref_out)
        launcher = launch.bind(kernel, inputs, out)
        arms = _arms(p.op, p, inputs, kernel, launcher, out)
        ops.load_tables([])
        vendor = arms["op"]()
        ops.load_tables([table_path])
        tuned = arms["op"]()
        ops.reset_stats()
        checks = {"bound_bitwise": launcher is None or torch.equal(out, ref_out),
                  "op_tuned_bitwise": torch.equal(tuned.reshape(ref_out.shape), ref_out),
                  "op_vendor_bitwise": torch.equal(vendor, arms["direct"]()),
                  "tuned_within_bound": bool(((tuned.reshape(ref_out.shape).double() - spec.reference(inputs))
                                              .abs() <= spec.error_bound(p, inputs, spec.reference(inputs))).all())}
        bad = [k for k, ok in checks.items() if not ok]
        failed += [f"{p.op} {p.n}x{p.k}: {k}" for k in bad]
        samples: dict[str, list] = {a: [] for a in ("direct", "floor", "op_vendor", "op_tuned", "kernel", "bound",
                                                    "module", "patched_vendor", "patched_tuned")}
        with torch.no_grad():
            ops.load_tables([])
            patched_vendor = arms["patched"]()
            ops.load_tables([table_path])
            patched_tuned = arms["patched"]()
        checks["patched_vendor_bitwise"] = torch.equal(patched_vendor, vendor)
        checks["patched_tuned_bitwise"] = torch.equal(patched_tuned, tuned)
        for _ in range(args.repeats):
            for arm in samples:
                base = arm.split("_")[0]
                if base in ("op", "patched"):
                    ops.load_tables([] if arm.endswith("_vendor") else [table_path])
                    arms[base]()  # resolve outside the timed loop
                fn = arms.get(base if base in ("op", "patched") else arm)
                if fn is not None:
                    with torch.no_grad():
                        samples[arm].append(_time(fn, args.calls))
        stats = ops.dispatch_stats(reset=True)
        row = {"op": p.op, "n": p.n, "k": p.k, "backend": entry["backend"], "params": entry["params"], "checks": checks,
               "bound": launcher is not None, "unbound_reason": launch.unsupported_reason(),
               "impls": sorted({r["impl"] for r in stats})}
        for arm, vals in samples.items():
            if vals:
                row[f"{arm}_wall_us"] = statistics.median(v[0] for v in vals)
                row[f"{arm}_gpu_us"] = statistics.median(v[1] for v in vals)
        row["overhead_vendor_us"] = row["op_vendor_wall_us"] - row["direct_wall_us"]
        row["torch_op_floor_us"] = row["floor_wall_us"] - row["direct_wall_us"]
        row["overhead_tuned_us"] = row["op_tuned_wall_us"] - row.get("bound_wall_us", row["kernel_wall_us"])
        # eager patched model: against the unpatched module; the tuned path also pays the module's own
        # call (module - direct), which an unpatched model pays too
        row["patched_overhead_vendor_us"] = row["patched_vendor_wall_us"] - row["module_wall_us"]
        launched = row.get("bound_wall_us", row["kernel_wall_us"])
        row["patched_overhead_tuned_us"] = (row["patched_tuned_wall_us"] - launched
                                            - (row["module_wall_us"] - row["direct_wall_us"]))
        results.append(row)
    doc = {"device": info.as_dict(), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "table": args.table, "calls": args.calls, "repeats": args.repeats, "rows": results, "failed": failed}
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    cols = ("direct", "floor", "op_vendor", "op_tuned", "kernel", "bound", "module", "patched_vendor",
            "patched_tuned")
    for unit in ("wall", "gpu"):
        print(f"{'shape':<26}" + "".join(f"{c[:10]:>11}" for c in cols)
              + (f"{'ovh_vend':>10}{'ovh_tuned':>10}{'eag_vend':>10}{'eag_tuned':>10}  (wall us/call)"
                 if unit == "wall" else "  (GPU us/call)"))
        for r in results:
            print(f"{r['op'] + ' ' + str(r['n']) + 'x' + str(r['k']):<26}"
                  + "".join(f"{r.get(f'{c}_{unit}_us', float('nan')):>11.2f}" for c in cols)
                  + (f"{r['overhead_vendor_us']:>10.2f}{r['overhead_tuned_us']:>10.2f}"
                     f"{r['patched_overhead_vendor_us']:>10.2f}{r['patched_overhead_tuned_us']:>10.2f}"
                     if unit == "wall" else ""))
    print("FAILED: " + "; ".join(failed) if failed else "all checks passed", f"-> {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
