"""Triton backend: the kernels of ``kernels_triton`` with explicit configs."""

from __future__ import annotations

import hashlib
import importlib
from functools import cache
from pathlib import Path

import torch

import search_spaces
from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.device import DeviceInfo, interpret_mode
from tunekit.shapes import Problem

#: op -> module in kernels_triton holding its kernel, config and predicate.
_OP_MODULES = {"gemv": "kernels_triton.gemv"}


class TritonBackend:
    name = "triton"
    kind = "tuned"
    ops = tuple(_OP_MODULES)

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if not device.is_gpu and not interpret_mode():
            return "no GPU (set TRITON_INTERPRET=1 to run Triton kernels on the CPU interpreter)"
        return None

    def _module(self, op: str):
        try:
            return importlib.import_module(_OP_MODULES[op])
        except KeyError:
            raise BuildError(f"triton backend has no kernel for op {op!r}") from None

    def space(self, problem: Problem) -> SearchSpace:
        return search_spaces.load(problem.op, self.name)

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        module = self._module(problem.op)
        try:
            config = module.GemvConfig.from_params(params)
        except TypeError as exc:
            return f"bad params: {exc}"
        return module.invalid_reason(config, problem.m, problem.n, problem.k)

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        module = self._module(problem.op)
        config = module.GemvConfig.from_params(params)
        reason = module.invalid_reason(config, problem.m, problem.n, problem.k)
        if reason:
            raise BuildError(f"invalid config: {reason}")

        def kernel(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x, w = inputs
            module.gemv(x, w, config, out=out)

        return kernel

    def source_hash(self) -> str:
        return _sources_hash(tuple(sorted(_OP_MODULES.values())))

    def kernel_name(self, problem: Problem) -> str:
        return _OP_MODULES.get(problem.op, "?")


@cache
def _sources_hash(modules: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec and spec.origin:
            digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


BACKEND = TritonBackend()
