"""Triton backend: the kernels of ``kernels_triton`` with explicit configs.

Each op's kernel module is its record's (``tunekit.problems.oprecords``,
``kernels["triton"]``). ``gemv`` is served through
``kernels_triton.gemv`` (GemvConfig, gemv(x, w, config, out)); every
elementwise module offers one protocol: ``Config.from_params``,
``invalid_reason(config, m, n, k)`` and ``launch(op, inputs, out, config,
eps)`` taking ``tunekit.problems.opspec``'s inputs and outputs (the op name picks the
weight convention of a norm).
"""

from __future__ import annotations

import hashlib
import importlib
from functools import cache
from pathlib import Path

import torch

import search_spaces
from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.measure.device import DeviceInfo, interpret_mode
from tunekit.problems import oprecords
from tunekit.problems.shapes import Problem

#: The op records' key of this backend's kernels (subclasses under other names run the same kernels).
_KERNELS = "triton"
#: Modules the elementwise kernels import (part of the source hash).
_HELPER_MODULES = ("kernels_triton.rounding", "kernels_triton.tiles")


class TritonBackend:
    name = "triton"
    kind = "tuned"

    @property
    def ops(self) -> tuple[str, ...]:
        """The ops whose record names a Triton kernel."""
        return oprecords.names(backend=_KERNELS)

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if not device.is_gpu and not interpret_mode():
            return "no GPU (set TRITON_INTERPRET=1 to run Triton kernels on the CPU interpreter)"
        return None

    def _module(self, op: str):
        module = oprecords.kernel(op, _KERNELS)
        if module is None:
            raise BuildError(f"triton backend has no kernel for op {op!r}")
        return importlib.import_module(module)

    def space(self, problem: Problem) -> SearchSpace:
        return search_spaces.load(problem.op, self.name)

    def serving_space(self, problem: Problem) -> SearchSpace:
        """What serving checks an entry's params against and builds a fallback's default config from: the
        kernel module's ``DEFAULT`` config (its names, their types, its values: Python next to the kernel; for
        the elementwise ops, whose fallbacks it serves, equal to the search space's default and fixed values,
        ``tests/test_table_index.py``), so serving reads no search-time TOML; a kernel module without one (a
        plug-in op's) its search space."""
        default = getattr(self._module(problem.op), "DEFAULT", None)
        if default is None or not hasattr(default, "as_params"):
            return self.space(problem)
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default=default.as_params(), reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        module = self._module(problem.op)
        try:
            config = module.Config.from_params(params)
        except TypeError as exc:
            return f"bad params: {exc}"
        return module.invalid_reason(config, problem.m, problem.n, problem.k)

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        module = self._module(problem.op)
        try:
            config = module.Config.from_params(params)
        except TypeError as exc:
            raise BuildError(f"bad params: {exc}") from None
        reason = module.invalid_reason(config, problem.m, problem.n, problem.k)
        if reason:
            raise BuildError(f"invalid config: {reason}")
        if problem.op != "gemv":
            from tunekit.problems.opspec import EPS

            op = problem.op

            # eps is a run-time argument of the kernels (not a constexpr), so one build serves every
            # model's epsilon (Llama-3.1: 1e-5, Qwen3.5: 1e-6); the search times them at opspec's EPS.
            def elementwise(inputs: tuple[torch.Tensor, ...], out, eps: float = EPS) -> None:
                module.launch(op, inputs, out, config, eps)

            return elementwise

        def kernel(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x, w = inputs
            module.gemv(x, w, config, out=out)

        return kernel

    def source_hash(self) -> str:
        modules = {oprecords.kernel(op, _KERNELS) for op in oprecords.names(backend=_KERNELS)}
        return _sources_hash(tuple(sorted(modules | set(_HELPER_MODULES))))

    def kernel_name(self, problem: Problem) -> str:
        return oprecords.kernel(problem.op, _KERNELS) or "?"


@cache
def _sources_hash(modules: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec and spec.origin:
            digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


BACKEND = TritonBackend()
