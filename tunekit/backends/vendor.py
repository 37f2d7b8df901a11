"""Vendor baseline: what the stock path runs (torch -> cuBLAS / rocBLAS / hipBLASLt).

Timed in the same process and the same way as every candidate, so speedups
are same-run ratios.
"""

from __future__ import annotations

import torch

from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.device import DeviceInfo
from tunekit.shapes import Problem


class VendorBackend:
    name = "vendor"
    kind = "vendor"
    ops = ("gemv",)

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        return None

    def space(self, problem: Problem) -> SearchSpace:
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        return None if problem.op in self.ops else f"no vendor path for op {problem.op!r}"

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        if problem.op != "gemv":
            raise BuildError(f"no vendor path for op {problem.op!r}")

        def kernel(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x, w = inputs
            # F.linear(x, w) (vLLM's unquantized path) lowers to mm(x, w.T);
            # calling mm with out= runs the same BLAS call without the extra
            # copy kernel that copying F.linear's result into `out` would add
            # (~2 us, a large share of a 7 us small-N baseline).
            torch.mm(x, w.t(), out=out)

        return kernel

    def source_hash(self) -> str:
        return f"torch-{torch.__version__}"

    def kernel_name(self, problem: Problem) -> str:
        return "torch.nn.functional.linear"


BACKEND = VendorBackend()
