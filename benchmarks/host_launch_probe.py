"""Does loading tunekit's HIP-family kernels (NVRTC + cuda.core) change the host cost of everything else?

A served Qwen3.5-27B table holds HIP entries, a Llama-3.1-8B one only Triton
entries; with its table, Qwen's offline first token stayed slower than
vanilla's although no tunekit op ran in its prefill. This probe times, in one
process and one GPU, the host side of three things a prefill does many times:

* ``torch``: a small eager op (one kernel launch), µs per call;
* ``triton``: a Triton kernel through its normal launch path (tunekit's GEMV at
  its default config), µs per call;
* ``sync``: a small op then ``torch.cuda.synchronize()``, µs per round trip;

in three phases: before anything of cuda.core is touched, after
``cuda.core.Device(0).set_current()`` (what ``tunekit.rtc.nvrtc.load_kernel``
does first), and after a HIP-family GEMV is built, loaded and launched
through ``tunekit.backends.hip``. Medians of ``--rounds`` rounds; same-process
ratios against the first phase.

    python benchmarks/host_launch_probe.py [--calls 3000] [--rounds 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _per_call_us(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()  # the GPU work is tiny: the loop's time is the host's
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def _build(backend_name: str, n: int, k: int):
    from tunekit import backends
    from tunekit.measure.device import detect
    from tunekit.problems.shapes import Problem

    backend = backends.get(backend_name)
    problem = Problem("gemv", "bf16", 1, n, k)
    space = backend.space(problem)
    return backend.build(problem, dict(space.fixed) | dict(space.default), detect())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    dev = torch.device("cuda:0")
    small = torch.zeros(256, device=dev)
    x = torch.randn(1, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(96, 512, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, 96, device=dev, dtype=torch.bfloat16)
    triton_gemv = _build("triton", 96, 512)
    triton_gemv((x, w), out)  # compile outside the timing

    def torch_op() -> None:
        small.add_(1.0)

    def triton_op() -> None:
        triton_gemv((x, w), out)

    def sync_op() -> None:
        small.add_(1.0)
        torch.cuda.synchronize()

    probes = {"torch": torch_op, "triton": triton_op, "sync": sync_op}

    def measure() -> dict[str, float]:
        return {name: _per_call_us(fn, args.calls if name != "sync" else args.calls // 10, args.rounds)
                for name, fn in probes.items()}

    phases: dict[str, dict[str, float]] = {"baseline": measure()}
    from cuda.core import Device

    Device(0).set_current()
    phases["after_set_current"] = measure()
    hip_gemv = _build("hip", 96, 512)
    hip_out = torch.empty_like(out)
    hip_gemv((x, w), hip_out)
    torch.cuda.synchronize()
    ref = (x.float() @ w.float().T)
    err = max((hip_out.float() - ref).abs().max().item(), (out.float() - ref).abs().max().item())
    phases["after_hip_kernel"] = measure()
    base = phases["baseline"]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "calls": args.calls,
              "rounds": args.rounds, "max_abs_err_vs_fp32": err, "us_per_call": phases,
              "ratio_to_baseline": {p: {k: v / base[k] for k, v in m.items()} for p, m in phases.items()}}
    for phase, m in phases.items():
        print(f"{phase:18s} " + "  ".join(f"{k} {v:7.2f} us ({v / base[k]:.3f}x)" for k, v in m.items()))
    print(f"GEMV outputs within {err:.4f} of fp32 (not zeros: {bool(out.abs().sum() > 0)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
