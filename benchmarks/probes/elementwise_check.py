"""GPU check of the elementwise families (Triton and HIP): correctness at the
model's sizes and odd sizes for every M asked, and launches per call at M=1.

    python benchmarks/probes/elementwise_check.py [--m 1,2,8,256,4096] [--configs 2]

Correctness goes through tunekit.measure.verify (fp64 reference, NaN-poisoned outputs,
BF16 bound, determinism) with each family's default config and a few sampled
ones. Launches are counted with torch.profiler: the CUDA kernels one call of
the default config runs (the eager and Inductor baselines are counted the same
way). Prints one line per check and a summary; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tunekit import backends
from tunekit.measure import verify  # noqa: E402
from tunekit.measure.device import detect  # noqa: E402
from tunekit.problems import opspec
from tunekit.problems.shapes import adhoc_problems  # noqa: E402

#: Qwen3.5-27B's sizes (hidden 5120, 48 gated-norm groups of 128, intermediate
#: 17408; bias_gelu is not in the model and takes the hidden size), both weight
#: conventions of the norms, and odd sizes for every op.
MODEL_SHAPES = [
    "rms_norm:5120", "gemma_rms_norm:5120", "fused_add_rms_norm:5120", "gemma_fused_add_rms_norm:5120",
    "gated_rms_norm:48x128", "silu_and_mul:17408", "bias_gelu:5120",
]
ODD_SHAPES = [
    "rms_norm:4099", "gemma_rms_norm:1027", "fused_add_rms_norm:333", "gemma_fused_add_rms_norm:5121",
    "gated_rms_norm:5x100", "silu_and_mul:1001", "bias_gelu:4097",
]


def _sample_configs(backend, problem, count: int, rng: random.Random) -> list[dict]:
    space = backend.space(problem)
    out, tries = [], 0
    while len(out) < count and tries < 2000:
        tries += 1
        params = dict(space.fixed) | {k: rng.choice(v) for k, v in space.domains.items()}
        if backend.invalid_reason(problem, params) is None and params not in out:
            out.append(params)
    return out


def _kernel_launches(kernel, problem, device: torch.device) -> tuple[int, list[str]]:
    """CUDA kernels one call runs (after a warm-up call that compiles)."""
    spec = opspec.get(problem.op)
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = spec.make_inputs(problem, device, gen)
    out = spec.make_output(problem, device)
    kernel(inputs, out)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernel(inputs, out)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(names), names


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="1,2,8,256,4096")
    parser.add_argument("--configs", type=int, default=2, help="sampled configs per problem and family")
    args = parser.parse_args()
    device = detect()
    if not device.is_gpu:
        print("this check needs a GPU")
        return 1
    tdev = torch.device(device.torch_device)
    failures = 0
    ms = [int(v) for v in args.m.split(",")]
    families = [name for name in ("triton", "hip") if backends.get(name).unavailable_reason(device) is None]
    print(f"device {device.name} {device.arch}; families {families}; M {ms}")
    problems = adhoc_problems(MODEL_SHAPES + ODD_SHAPES, ms)
    for problem in problems:
        for family in families:
            backend = backends.get(family)
            # the same sampled configs at every M of a shape: each compiles once
            rng = random.Random(f"{family}|{problem.op}|{problem.n}|{problem.k}")
            space = backend.space(problem)
            configs = [space.default] + _sample_configs(backend, problem, args.configs, rng)
            for params in configs:
                try:
                    # fixed (never searched) values join every candidate, as in the search
                    kernel = backend.build(problem, dict(space.fixed) | params, device)
                    result = verify.verify(kernel, opspec.get(problem.op), problem, tdev, seed=problem.m + problem.n)
                    ok, why = result.ok, result.reason or f"err_ratio {result.err_ratio:.3f}"
                except Exception as exc:  # report and go on: this is a check script
                    ok, why = False, f"{type(exc).__name__}: {exc}"
                failures += not ok
                if not ok or params is configs[0]:
                    print(f"{'PASS' if ok else 'FAIL'} {family} {problem.key} {params}: {why}", flush=True)
    print("launches per call at M=1 (default configs; baselines for comparison):")
    for problem in adhoc_problems(MODEL_SHAPES, [1]):
        for name in [*families, "vendor", "inductor"]:
            backend = backends.get(name)
            try:
                space = backend.space(problem)
                params = dict(space.fixed) | space.default
                count, names = _kernel_launches(backend.build(problem, params, device), problem, tdev)
            except Exception as exc:
                print(f"FAIL launches {name} {problem.key}: {type(exc).__name__}: {exc}")
                failures += 1
                continue
            tuned = name in families
            if tuned and count != 1:
                failures += 1
            print(f"{'PASS' if count == 1 or not tuned else 'FAIL'} launches {name} {problem.key}: {count} {names}")
    print(f"checks failed: {failures}")
    if failures == 0:
        print("ELEMENTWISE_OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
