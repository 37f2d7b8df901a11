"""GPU evidence: the host cost of a routed op's calls at M the table lacks (an eager prefill's calls).

    python benchmarks/probes/fallback_overhead.py --table T --model llama-3.1-8b --m 1,64,512 --out f.json

In vLLM a prefill above the captured sizes runs eager: every routed layer calls its tunekit op from
Python, and a call the table does not serve falls back inside the op (``F.linear`` for a GEMV, the
default-config Triton kernel or vLLM's kernel for a norm). What that costs on the host, per call,
against what an unrouted layer costs there:

- gemv: ``F.linear``; ``mm`` (``torch.mm(x, w.t())``, what Inductor's graph calls); ``op``
  (``torch.ops.tunekit.gemv`` with the table loaded); ``impl`` (the op's Python body without torch's
  dispatcher).
- norms: ``composition`` (the PyTorch composition, eager); ``inductor`` (the composition under
  ``torch.compile``: one Inductor kernel, plus the compiled function's guard); ``op``; ``impl``.

Host us per call = wall time to issue ``--calls`` calls while the GPU is held busy by a sleep kernel
(so no call waits for the device): the CPU's cost alone. Medians of ``--repeats`` interleaved rounds.
``profile``: cProfile of the op's calls at the largest M, the functions with the most own time.
Outputs are checked first: every arm within the op's BF16 bound of the fp64 reference; exits 1 if not.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _host_us(fn, calls: int) -> float:
    """CPU time to issue ``calls`` calls while a sleep kernel keeps the GPU busy (us per call)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9 * 2e-3 * calls / 10))  # ~ calls x 200 us at ~2 GHz: nothing waits on the GPU
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def _arms(p, inputs, eps):
    import tunekit.ops  # noqa: F401 (registers torch.ops.tunekit.*)
    from tunekit.dispatch import elementwise as ew
    from tunekit.dispatch.gemv import gemv_impl

    if p.op == "gemv":
        x, w = inputs
        return {"F.linear": lambda: F.linear(x, w), "mm": lambda: torch.mm(x, w.t()),
                "op": lambda: torch.ops.tunekit.gemv(x, w, None), "impl": lambda: gemv_impl(x, w, None)}
    if p.op == "fused_add_rms_norm":
        x, r, w = inputs
        comp = lambda: ew._vendor_fused_add(x, r, w, eps, False)  # noqa: E731
        compiled = torch.compile(lambda a, b, c: ew._vendor_fused_add(a, b, c, eps, False), dynamic=False)
        return {"composition": comp, "inductor": lambda: compiled(x, r, w),
                "op": lambda: torch.ops.tunekit.fused_add_rms_norm(x, r, w, eps),
                "impl": lambda: ew._fused_add_impl(x, r, w, eps)}
    x, w = inputs
    compiled = torch.compile(lambda a, c: ew._vendor_rms_norm(a, c, eps, False), dynamic=False)
    return {"composition": lambda: ew._vendor_rms_norm(x, w, eps, False), "inductor": lambda: compiled(x, w),
            "op": lambda: torch.ops.tunekit.rms_norm(x, w, eps), "impl": lambda: ew._rms_norm_impl(x, w, eps)}


def main(argv: list[str] | None = None) -> int:
    import tunekit.ops as ops
    from tunekit.measure.device import detect
    from tunekit.problems import opspec
    from tunekit.problems.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--m", default="1,64,512")
    ap.add_argument("--eps", type=float, default=1e-5, help="the norms' epsilon (Llama-3.1: 1e-5)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="fallback_overhead.json")
    args = ap.parse_args(argv)
    info, dev = detect(), torch.device("cuda")
    ms = [int(v) for v in args.m.split(",")]
    ops.load_tables([args.table])
    model = load_model(args.model)
    problems = model.problems(1, ms, "bf16", ("gemv", "rms_norm", "fused_add_rms_norm"))
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, failed, profiles = [], [], {}
    for p in problems:
        spec = opspec.get(p.op)
        inputs = spec.make_inputs(p, dev, gen)
        arms = _arms(p, inputs, args.eps)
        # the reference at opspec's eps: another model's eps (1e-5) moves the result ~1e-6 relative,
        # far inside the BF16 bound
        ref = spec.reference(inputs)
        bound = spec.error_bound(p, inputs, ref)
        refs, bounds = (ref, bound) if isinstance(ref, tuple) else ((ref,), (bound,))
        checks = {}
        with torch.no_grad():
            for name, fn in arms.items():
                got = fn()
                gots = got if isinstance(got, (tuple, list)) else (got,)
                checks[name] = all(bool(((g.reshape(r.shape).double() - r).abs() <= b).all())
                                   for g, r, b in zip(gots, refs, bounds, strict=True))
        failed += [f"{p.op} M={p.m} {p.n}x{p.k}: {a}" for a, ok in checks.items() if not ok]
        ops.reset_stats()
        with torch.no_grad():
            for fn in arms.values():
                fn()  # warm: routes resolved, kernels compiled, launchers bound
            samples = {name: [] for name in arms}
            for _ in range(args.repeats):
                for name, fn in arms.items():
                    samples[name].append(_host_us(fn, args.calls))
        impls = sorted({f"{r['impl']} [{r['vendor']}]" if r["vendor"] else r["impl"] for r in ops.dispatch_stats()})
        row = {"op": p.op, "m": p.m, "n": p.n, "k": p.k, "checks": checks, "impls": impls,
               **{f"{name}_host_us": statistics.median(v) for name, v in samples.items()}}
        rows.append(row)
        if p.m == max(ms):
            prof = cProfile.Profile()
            with torch.no_grad():
                torch.cuda._sleep(int(2e9 * 2e-3 * args.calls / 10))
                prof.enable()
                for _ in range(args.calls):
                    arms["op"]()
                prof.disable()
                torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
            profiles[f"{p.op} M={p.m} {p.n}x{p.k}"] = buf.getvalue()
    doc = {"device": info.as_dict(), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "table": args.table, "model": args.model, "eps": args.eps, "calls": args.calls,
           "repeats": args.repeats, "rows": rows, "profiles": profiles, "failed": failed}
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    for r in rows:
        arms = [k[:-8] for k in r if k.endswith("_host_us")]
        print(f"{r['op']:<20} M={r['m']:<4} {r['n']}x{r['k']:<7} "
              + "  ".join(f"{a} {r[a + '_host_us']:.1f}" for a in arms) + "  us host/call  " + "; ".join(r["impls"]))
    for name, text in profiles.items():
        print(f"--- cProfile, {args.calls} op calls: {name}\n" + "\n".join(text.splitlines()[:30]))
    print("FAILED: " + "; ".join(failed) if failed else "all checks passed", f"-> {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
