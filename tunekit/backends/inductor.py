"""Inductor baseline: ``torch.compile`` of the vendor backend's eager compositions (elementwise ops).

A second baseline, timed in the same interleaved final re-measure as the eager
one: Inductor fuses each composition into one or two generated kernels, which
is what vLLM's compiled graphs run for these ops when its custom ops are off.
The dispatch table admits a tuned kernel only if it beats the faster of the
two (see ``tunekit.table``).

Call protocol (as every backend; ``kind == "baseline"``: never searched)::

    backend = tunekit.backends.get("inductor")
    backend.unavailable_reason(device)   # None on a GPU
    kernel = backend.build(problem, {}, device)   # compiles lazily, at the first call
    kernel(inputs, out)                  # graph-capturable after that first call

Numerics differ from eager: Inductor keeps BF16 intermediates in fp32 (on the
CPU, torch 2.13, the Gemma fused add + norm took the variance of the unrounded
sum while eager rounds it), so its bits follow neither eager nor vLLM's CUDA
kernels exactly; it stays within the ops' bounds.
"""

from __future__ import annotations

import torch

from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.backends.vendor import ELEMENTWISE
from tunekit.measure.device import DeviceInfo
from tunekit.problems.shapes import Problem


class InductorBackend:
    name = "inductor"
    kind = "baseline"

    @property
    def ops(self) -> tuple[str, ...]:
        """The elementwise ops whose record names an eager composition (``vendor.ELEMENTWISE``)."""
        return tuple(ELEMENTWISE)

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        if not device.is_gpu:
            # On the CPU Inductor generates C++ (10-30 s per problem to compile) and
            # the interpreter tier's timings are no evidence anyway.
            return "the Inductor baseline is measured on GPUs only"
        return None

    def space(self, problem: Problem) -> SearchSpace:
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        return None if problem.op in self.ops else f"no Inductor baseline for op {problem.op!r}"

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        if problem.op not in self.ops:
            raise BuildError(f"no Inductor baseline for op {problem.op!r}")
        # Dynamo caches compiled code per code object, and the worker compiles the
        # same composition for every M of a search: a fresh start keeps it under
        # the recompile limit (past it Dynamo silently runs eager). Only
        # baselines are compiled in the worker, one problem at a time.
        torch._dynamo.reset()
        return torch.compile(ELEMENTWISE[problem.op], fullgraph=True, dynamic=False)

    def source_hash(self) -> str:
        return f"torch-{torch.__version__}-inductor"

    def kernel_name(self, problem: Problem) -> str:
        return f"torch.compile(tunekit.backends.vendor:{ELEMENTWISE[problem.op].__name__})"


BACKEND = InductorBackend()
