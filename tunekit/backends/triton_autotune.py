"""A plain ``@triton.autotune`` GEMV (``kernels_triton.autotune_gemv``) as a baseline: the Triton user's peer.

What a user who writes a Triton GEMV without tunekit would run: the matmul
tutorial's tile loop over the usual config list, chosen by Triton's own
autotuner at the first call for each (M, N, K). Timed in the same interleaved
final re-measure as tunekit's winners; never searched, never tabulated.

Call protocol (as every backend; ``kind == "baseline"``)::

    backend = tunekit.backends.get("triton_autotune")
    backend.unavailable_reason(device)   # None on a GPU
    kernel = backend.build(problem, {}, device)
    kernel((x, w), out)   # the first call autotunes (outside a capture); graph-capturable after it
"""

from __future__ import annotations

import hashlib
import inspect

from kernels_triton import autotune_gemv
from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.measure.device import DeviceInfo
from tunekit.problems.shapes import Problem


class TritonAutotuneBackend:
    name = "triton_autotune"
    kind = "baseline"
    ops = ("gemv",)

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        if not device.is_gpu:
            # Triton's autotuner times every config with CUDA / HIP events; the interpreter has none
            return "the plain @triton.autotune GEMV is measured on GPUs only (its autotuner times on the device)"
        return None

    def space(self, problem: Problem) -> SearchSpace:
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        if problem.op not in self.ops:
            return f"no plain Triton baseline for op {problem.op!r}"
        why = autotune_gemv.invalid_reason(problem.m, problem.n, problem.k)
        return None if why is None else f"shape unsupported: {why}"

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        why = self.unavailable_reason(device) or self.invalid_reason(problem, params)
        if why:
            raise BuildError(why)

        def kernel(inputs, out) -> None:
            x, w = inputs
            autotune_gemv.launch(x, w, out)

        return kernel

    def source_hash(self) -> str:
        return hashlib.sha256(inspect.getsource(autotune_gemv).encode()).hexdigest()[:16]

    def kernel_name(self, problem: Problem) -> str:
        return f"kernels_triton.autotune_gemv:_gemv_kernel (@triton.autotune over {len(autotune_gemv.CONFIGS)} configs)"


BACKEND = TritonAutotuneBackend()
