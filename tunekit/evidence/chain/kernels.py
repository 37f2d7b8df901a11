"""The implementations a chain binds to its steps: vendor, tuned (``torch.ops.tunekit``), fp32, and the
pieces a fused kernel replaces a pair of steps with.

Each is a callable of the step's inputs that returns its output(s) into buffers made once (graph-safe),
as ``Chain._forward`` calls it. Call protocol: ``vendor_impl(step, vendor_elementwise(device), chain)``,
``tuned_impl(step)``; the fused pieces wrap a built kernel ``kernel(inputs, out)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tunekit.evidence.chain.steps import Step
from tunekit.problems.opspec import EPS


class Buffers(Protocol):
    """What a step's implementation takes from its chain: the M, dtype and device of its output buffers."""

    m: int
    dtype: torch.dtype
    device: torch.device


def vendor_elementwise(device: torch.device) -> dict[str, Callable[..., None]]:
    """The vendor compositions, compiled by Inductor on a GPU (the searches' faster baseline), eager on the CPU."""
    from tunekit.backends.vendor import ELEMENTWISE

    if device.type != "cuda":
        return dict(ELEMENTWISE)
    # one compile per op and shape; a fresh Dynamo keeps every M under the recompile limit
    torch._dynamo.reset()
    return {op: torch.compile(fn, fullgraph=True, dynamic=False) for op, fn in ELEMENTWISE.items()}


def identity(x: torch.Tensor) -> torch.Tensor:
    """A step whose work a fused kernel does (act_fn after gate_up's SiLU-and-mul epilogue): x passes on."""
    return x


def fused_norm_step(kernel: Callable[..., None], weight: torch.Tensor, y: torch.Tensor,
                    residual_out: torch.Tensor | None) -> Callable[..., Any]:
    """The norm step of a fused norm -> GEMV pair: launches the fused kernel on its consumers'
    weight; returns what the norm step returns in ``Chain._forward`` with y standing for the
    normed x (only the consumers read it, and they return slices of y)."""
    if residual_out is None:
        def plain(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            kernel((x, g, weight), y)
            return y
        return plain

    def with_residual(x: torch.Tensor, residual: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kernel((x, residual, g, weight), (y, residual_out))
        return y, residual_out
    return with_residual


def unnormed(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A norm folded into its consumers: it passes x on (each consumer computes 1/rms itself)."""
    return x


def on_prepared_weight(kernel: Callable[..., None], weight: torch.Tensor, out: torch.Tensor) -> Callable[..., Any]:
    """A GEMV-family kernel on a weight prepared once (a folded norm's consumer: ``rms_gemv`` on the
    un-normalised x; gate_up with its rows paired: the ``GLU_OPS``); the step's own weight is unused."""
    def prepared(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        kernel((x, weight), out)
        return out
    return prepared


def gemv_add_step(kernel: Callable[..., None], out: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A layer output's GEMV with the residual add in its epilogue: returns x W^T + residual."""
    def layer_output(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        kernel((x, w, residual), out)
        return out
    return layer_output


def plain_after_add(norm: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The fused add + norm step after a ``gemv_add``: its input already is the sum, so the plain norm
    ``norm(s, g)`` runs, and the sum passes on as the residual (the fused add's two outputs)."""
    def after_add(s: torch.Tensor, residual: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return norm(s, g), s
    return after_add


def plain_norm_impl(step: Step, served: Callable[[Step], bool], fns: dict[str, Callable[..., None]],
                    chain: Buffers) -> Callable[..., torch.Tensor]:
    """The plain norm ``step`` as the tuned variant would run it: tunekit's op where a table serves it."""
    return tuned_impl(step) if served(step) else vendor_impl(step, fns, chain)


def output_slice(y: torch.Tensor, start: int, stop: int) -> Callable[..., torch.Tensor]:
    """A consumer GEMV of a fused norm: its columns of the fused kernel's output."""
    def consumer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return y[:, start:stop]
    return consumer


def launch_then_slice(launch: Callable[..., torch.Tensor], start: int, stop: int) -> Callable[..., torch.Tensor]:
    """The first consumer of a kernel several consumers share (a folded norm's siblings): it launches the
    kernel, ``launch(x, w)``, and returns its columns of the output (the others: ``output_slice``)."""
    def consumer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return launch(x, w)[:, start:stop]
    return consumer


def tuned_impl(step: Step) -> Callable[..., Any]:
    """``step`` through ``torch.ops.tunekit`` (the loaded tables' kernel, or the op's own fallback)."""
    op = getattr(torch.ops.tunekit, step.op)
    if step.op == "gemv":
        return lambda x, w: op(x, w, None)
    if step.op == "silu_and_mul":
        return op
    return lambda *args: op(*args, EPS)


def fp32_impl(step: Step, fns: dict[str, Callable[..., None]], chain: Buffers) -> Callable[..., Any]:
    """``step`` of the fp32 reference: fp32 activations, the weight upcast per call (eager)."""
    if step.op == "gemv":
        return lambda x, w: F.linear(x, w.float())
    return vendor_impl(step, fns, chain, torch.float32)


def vendor_impl(step: Step, fns: dict[str, Callable[..., None]], chain: Buffers,
                dtype: torch.dtype | None = None) -> Callable[..., Any]:
    """``step`` the vendor's way: ``F.linear`` for a GEMV, else ``fns[step.op]`` writing into buffers made
    here once (in ``dtype``, the chain's by default)."""
    if step.op == "gemv":
        return lambda x, w: F.linear(x, w)
    fn = fns[step.op]
    m, dtype, device = chain.m, dtype or chain.dtype, chain.device
    # outputs preallocated once per step (graph-safe, as the vendor compositions write into ``out``)
    if "fused_add" in step.op:
        outs = (torch.empty(m, step.n, dtype=dtype, device=device), torch.empty(m, step.n, dtype=dtype, device=device))

        def fused(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            fn((x, residual, w), outs)
            return outs
        return fused
    out = torch.empty(m, step.n, dtype=dtype, device=device)

    def call(*inputs: torch.Tensor) -> torch.Tensor:
        fn(inputs, out)
        return out
    return call
