"""GPU check of the HIP GEMV family: correctness on the model's shapes and odd
tails at M = 1, 2, 4, 8 (the default, two sampled CUDA-core configs and,
where the device has it, two sampled MMA=1 configs), and run-time compile
times (cold and cached).

    python benchmarks/probes/hip_check.py [--model qwen3.5-27b] [--configs 12]

Prints one line per check and a summary; exits 1 if any check fails. Every
check goes through tunekit.measure.verify (fp64 reference, poisoned output, bound,
determinism), with the default config and a few sampled ones.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tunekit import backends
from tunekit.measure import verify  # noqa: E402
from tunekit.measure.device import detect  # noqa: E402
from tunekit.problems import opspec_gemv
from tunekit.problems.models import load_model  # noqa: E402
from tunekit.problems.shapes import Problem  # noqa: E402

ODD_TAILS = [(77, 300), (1000, 1030), (5, 4099), (96, 5121), (33, 262)]


def _sample_configs(backend, problem: Problem, count: int, rng: random.Random, **fixed) -> list[dict]:
    space = backend.space(problem)
    out, tries = [], 0
    while len(out) < count and tries < 5000:
        tries += 1
        params = {k: rng.choice(v) for k, v in space.domains.items()} | fixed
        if backend.invalid_reason(problem, params) is None and params not in out:
            out.append(params)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3.5-27b")
    parser.add_argument("--configs", type=int, default=12, help="sampled configs for the compile-time check")
    args = parser.parse_args()
    os.environ["TUNEKIT_CACHE"] = tempfile.mkdtemp(prefix="tunekit-rtc-")  # cold cache
    device = detect()
    hip = backends.get("hip")
    reason = hip.unavailable_reason(device)
    if reason:
        print(f"HIP backend unavailable: {reason}")
        return 1
    tdev = torch.device(device.torch_device)
    rng = random.Random(0)
    failures = 0
    spec = load_model(args.model)
    mma = hip.pinned_params(device).get("MMA", 1) == 1
    shapes = sorted({(n, k) for _, n, k, _ in spec.linears(1)}) + ODD_TAILS
    print(f"device {device.name} {device.arch}; checking {len(shapes)} shapes x M 1,2,4,8")
    for m in (1, 2, 4, 8):
        for n, k in shapes:
            problem = Problem("gemv", "bf16", m, n, k)
            configs = [hip.space(problem).default] + _sample_configs(hip, problem, 2, rng, MMA=0)
            if mma:  # the tensor-core path: two sampled configs more
                configs += _sample_configs(hip, problem, 2, rng, MMA=1)
            for params in configs:
                try:
                    kernel = hip.build(problem, params, device)
                    result = verify.verify(kernel, opspec_gemv.GEMV, problem, tdev, seed=m * 1000 + n)
                    ok, why = result.ok, result.reason or f"err_ratio {result.err_ratio:.3f}"
                except Exception as exc:  # report and go on: this is a check script
                    ok, why = False, f"{type(exc).__name__}: {exc}"
                failures += not ok
                if not ok or params is configs[0] or params.get("MMA"):
                    print(f"{'PASS' if ok else 'FAIL'} m{m} {n}x{k} {params}: {why}")
    # compile times: cold (fresh cache dir), then the same configs again (cached)
    problem = Problem("gemv", "bf16", 1, 5120, 6144)
    configs = _sample_configs(hip, problem, args.configs, rng)
    cold, warm = [], []
    for params in configs:
        t0 = time.perf_counter()
        kernel = hip.build(problem, params, device)
        cold.append((time.perf_counter() - t0, kernel.compile_s, kernel.cache_hit))
    for params in configs:
        t0 = time.perf_counter()
        kernel = hip.build(problem, params, device)
        warm.append((time.perf_counter() - t0, kernel.compile_s, kernel.cache_hit))
    print(f"compile cold: median build {statistics.median(c[0] for c in cold):.3f} s, "
          f"compiler {statistics.median(c[1] for c in cold):.3f} s, hits {sum(c[2] for c in cold)}/{len(cold)}")
    print(f"compile cached: median build {statistics.median(c[0] for c in warm):.4f} s, "
          f"hits {sum(c[2] for c in warm)}/{len(warm)}")
    print(f"checks failed: {failures}")
    if failures == 0:
        print("HIP_OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
