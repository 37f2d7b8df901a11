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


def linear_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """F.linear(x, w) written into ``out``: what Inductor compiles for the max-autotune peer. The store into
    ``out`` is the epilogue of Inductor's mm template (or a copy after its extern cuBLAS choice)."""
    out.copy_(torch.nn.functional.linear(x, w))


class InductorMaxAutotuneBackend:
    """``inductor_max_autotune``: ``torch.compile(mode="max-autotune")`` of the linear, what a PyTorch user
    reaches for. Inductor benchmarks its mm templates (Triton tiles, and cuBLAS as an extern choice) per
    shape at the first call and keeps the fastest. ``-no-cudagraphs``: the timing harness captures its own
    graph; Inductor's cudagraph trees inside that capture would not run."""

    name = "inductor_max_autotune"
    kind = "baseline"
    ops = ("gemv",)
    MODE = "max-autotune-no-cudagraphs"

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        if not device.is_gpu:
            return "torch.compile max-autotune is measured on GPUs only (its autotuning times on the device)"
        return None

    def space(self, problem: Problem) -> SearchSpace:
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        return None if problem.op in self.ops else f"no torch.compile max-autotune baseline for op {problem.op!r}"

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        why = self.unavailable_reason(device) or self.invalid_reason(problem, params)
        if why:
            raise BuildError(why)
        torch._dynamo.reset()  # one shape per compile: see InductorBackend.build
        compiled = torch.compile(linear_into, mode=self.MODE, fullgraph=True, dynamic=False)

        def kernel(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x, w = inputs
            compiled(x, w, out)

        return kernel

    def source_hash(self) -> str:
        return f"torch-{torch.__version__}-inductor-{self.MODE}"

    def kernel_name(self, problem: Problem) -> str:
        return f"torch.compile(F.linear, mode={self.MODE!r})"


MAX_AUTOTUNE = InductorMaxAutotuneBackend()
