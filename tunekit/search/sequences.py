"""In the worker: sequences of kernels timed interleaved, the fusion phase's measurement (task kind ``sequences``).

A task names arms (``fused``, ``unfused``), each a list of steps, each step one kernel as the table
serves it: ``{"op", "dtype", "m", "n", "k", "backend", "params"}`` built through its backend
(``tunekit.backends``; a tuned entry's config, or a baseline: ``vendor``, ``inductor``), or
``{"op": "add", ...}``: the residual add left standalone (``torch.add`` of two [M, N] rows, eager, as the
fold's fallback runs it). Each step gets the inputs of its own problem, rotated as a lone kernel's are
(``tunekit.measure.bench.Rotation``; ``gemv`` and ``rms_gemv`` of one shape share them), and an arm runs
its steps one after the other for each launch; the arms are timed by ``bench.time_interleaved`` (graphs,
warm-up, rounds in rotated order) exactly as the final re-measure times candidates. The reply's figure of
an arm is its median time per launch of the whole sequence.

Call protocol (in the worker, ``_ChildState.handle``)::

    reply = measure(state, {"kind": "sequences", "arms": {"fused": [...], "unfused": [...]}, "repeats": 30})
    # {"status": "ok", "timings": {"fused": {"time_us", "spread", ...}, ...}} or {"status": "fail", "error"}
"""

from __future__ import annotations

from typing import Any


class _AddRotation:
    """Inputs and outputs of the standalone residual add: x, residual and out of [M, N], two copies."""

    copies = 2

    def __init__(self, m: int, n: int, dtype: Any, device: Any, launches: int) -> None:
        import torch

        gen = torch.Generator(device=device).manual_seed(7)
        self.inputs = [tuple(torch.randn((m, n), generator=gen, device=device, dtype=torch.float32).to(dtype)
                             for _ in range(2)) for _ in range(self.copies)]
        self.outputs = [torch.empty((m, n), device=device, dtype=dtype) for _ in range(self.copies)]
        self.launches = launches


def _add_kernel(inputs: tuple, out: Any) -> None:
    import torch

    torch.add(inputs[0], inputs[1], out=out)


class _Sequences:
    """The rotation ``bench.time_interleaved`` drives: each launch runs a whole arm (every step on its own
    rotated inputs), as many launches as the longest rotation of its steps."""

    def __init__(self, device: Any, rotations: list[Any]) -> None:
        self.device = device
        self.copies = max(r.copies for r in rotations)
        self.launches = max(r.launches for r in rotations)

    def run(self, arm: Any) -> None:
        for i in range(self.launches):
            arm(i)


def _arm(steps: list[tuple[Any, Any]]) -> Any:
    def run(i: int) -> None:
        for kernel, rotation in steps:
            j = i % rotation.copies
            kernel(rotation.inputs[j], rotation.outputs[j])

    return run


def measure(state: Any, task: dict[str, Any]) -> dict[str, Any]:
    """Build every step of every arm, run each once (compiles, first calls), time the arms interleaved."""
    import torch

    from tunekit import backends
    from tunekit.measure.bench import MIN_LAUNCHES_PER_GRAPH, Rotation, time_interleaved
    from tunekit.problems import opspec
    from tunekit.problems.opspec_base import TORCH_DTYPES
    from tunekit.problems.shapes import Problem

    device = state.device
    state.forget_problem()  # one problem's buffers at a time: these are several problems' at once
    tdev = torch.device(device.torch_device)
    rotations: dict[tuple, Any] = {}
    arms: dict[str, Any] = {}
    for label, steps in task["arms"].items():
        parts = []
        for step in steps:
            m, n, k, dtype = int(step["m"]), int(step["n"]), int(step["k"]), step["dtype"]
            if step["op"] == "add":
                key = ("add", dtype, m, n)
                if key not in rotations:
                    launches = max(2, MIN_LAUNCHES_PER_GRAPH) if device.is_gpu else 2
                    rotations[key] = _AddRotation(m, n, TORCH_DTYPES[dtype], tdev, launches)
                parts.append((_add_kernel, rotations[key]))
                continue
            problem = Problem(step["op"], dtype, m, n, k)
            shared = "rms_gemv" if step["op"] in ("gemv", "rms_gemv") else step["op"]  # one input layout
            key = (shared, dtype, m, n, k)
            if key not in rotations:
                rotations[key] = Rotation(opspec.get(shared), Problem(shared, dtype, m, n, k), device)
            try:
                kernel = backends.get(step["backend"]).build(problem, dict(step["params"]), device)
            except Exception as exc:  # noqa: BLE001 - the step's error is the reply's
                return {"status": "fail", "error": f"{step['op']} {n}x{k} {step['backend']}: build failed: "
                                                   f"{type(exc).__name__}: {str(exc)[:300]}"}
            parts.append((kernel, rotations[key]))
        arms[label] = _arm(parts)
    for run in arms.values():  # first calls: Triton compiles at its first launch, Inductor at its first call
        run(0)
    if device.is_gpu:
        torch.cuda.synchronize()
    timings = time_interleaved(arms, _Sequences(device, list(rotations.values())), repeats=task.get("repeats"))
    return {"status": "ok", "timings": {label: {"time_us": t.median_us, "time_p25_us": t.p25_us,
                                                "time_p75_us": t.p75_us, "spread": t.spread, "timing_kind": t.kind}
                                        for label, t in timings.items()}}
