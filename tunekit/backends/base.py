"""The Backend protocol: one family of implementations of tunekit's ops.

A backend turns a parameter set (sampled by the search from
``search_spaces/<op>.toml``) into a callable kernel for one problem.

Call protocol (what the search worker does, in this order)::

    backend = tunekit.backends.get("triton")
    why = backend.unavailable_reason(device)      # None -> usable here
    space = backend.space(problem)                # SearchSpace: domains + default
    reason = backend.invalid_reason(problem, params)  # None -> buildable
    kernel = backend.build(problem, params, device)   # compile; BuildError on failure
    kernel(inputs, out)                           # writes the op's result into `out`

``build`` must do all compilation, so that the first ``kernel(...)`` call after
it is cheap and graph-capturable (launch on torch's current stream, allocate
only through torch). ``inputs`` is the tuple an ``OpSpec.make_inputs`` returns
(for GEMV: ``(x[M,K], w[N,K])``); ``out`` is what ``OpSpec.make_output``
returns: a preallocated output tensor, or a tuple of them for a multi-output
op (``fused_add_rms_norm``: ``(y, residual_out)``), that the kernel must fill
completely (verification poisons every output first).

Optionally, ``backend.pinned_params(device) -> dict`` names tunables that do
not change the kernel on that device (HIP's REDUCE_DPP on NVIDIA); the search
pins them to the given value so one kernel is not measured under two names.

Backends never import optuna: search code adapts ``SearchSpace`` to samplers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from search_spaces import SearchSpace  # noqa: F401  (defined with the TOMLs it is read from)
from tunekit.errors import BuildError  # noqa: F401  (defined below the backends, for tunekit.rtc)
from tunekit.measure.device import DeviceInfo
from tunekit.problems.shapes import Problem

Params = dict[str, Any]
Kernel = Callable[[tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, ...]], None]


class Backend(Protocol):
    """A family of implementations (Triton kernels, HIP kernels, the vendor BLAS through eager torch)."""

    name: str
    #: "tuned" for searchable families, "baseline" for what is measured beside them and never searched.
    kind: str
    #: ops this backend implements (keys of tunekit.problems.opspec.OPS).
    ops: tuple[str, ...]

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        """None if the backend can run on ``device``, else a one-line reason."""

    def space(self, problem: Problem) -> SearchSpace:
        """The parameter domains for ``problem.op`` (may be empty for vendor)."""

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        """None if ``params`` can be built for ``problem``, else why not.

        A pure predicate: no compilation, no device work.
        """

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        """Compile (and cache) the candidate; raise BuildError on failure."""

    def source_hash(self) -> str:
        """Hash of the kernel sources this backend builds from (table stamp)."""

    def kernel_name(self, problem: Problem) -> str:
        """Name of the kernel function that serves ``problem`` (for reports)."""


def build_m(backend: Backend, op: str, served_m: int, entry_m: int) -> int:
    """The M to build for when an entry tuned at ``entry_m`` serves ``served_m``.

    A kernel compiled for every M up to a define (HIP's GEMV: MAX_M, the backend's optional
    ``builds_up_to_m(op)``) is built once at the entry's M and serves each smaller M; every other is
    built, and its config checked, at the M it serves."""
    up_to = getattr(backend, "builds_up_to_m", None)
    return entry_m if up_to is not None and up_to(op) else served_m
