"""How the tuned Triton kernels are launched, as opposed to what they compute: programmatic dependent launch.

With PDL (NVIDIA sm_90+) a kernel is launched with the programmatic stream
serialisation attribute, so it may start before the previous kernel in the
stream has finished. Each kernel built for it (``PDL`` constexpr) waits on the
previous grid (``griddepcontrol.wait``: completed, writes visible) before it
reads anything that grid may have written, and releases the next grid
(``griddepcontrol.launch_dependents``) as early as that is useful: the
elementwise kernels at their start, the GEMV after its K loop. Before its wait
the GEMV prefetches the first K chunk of its weight rows into L2 (weights are
never written by a previous kernel), so the weight stream starts while the
previous kernel still runs. The arithmetic is unchanged: same bits.

It is a launch policy, not a searched tunable: a standalone timing (one
kernel launched back to back with itself in a graph) shows an overlap that a
model's real neighbours may not give. ``tunekit chain`` measures it in the
model's own sequence (variant ``tuned_pdl``); serving turns it on with
``TUNEKIT_PDL=1`` (``tunekit.ops``). The interpreter and ROCm ignore it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_state = {"pdl": False}


def set_pdl(enabled: bool) -> None:
    """Launch the tuned Triton kernels with programmatic dependent launch from now on (or not)."""
    _state["pdl"] = bool(enabled)


def usable(requested: bool) -> bool:
    """``requested``, unless PDL cannot apply here: the interpreter or a ROCm build of torch."""
    return bool(requested) and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def pdl() -> bool:
    """True when the next launch should use PDL: the policy asks for it and it can apply here."""
    return usable(_state["pdl"])


@contextmanager
def programmatic_dependent_launch(enabled: bool = True) -> Iterator[None]:
    """``set_pdl(enabled)`` for the duration of a ``with`` block (the previous policy is restored)."""
    before = _state["pdl"]
    set_pdl(enabled)
    try:
        yield
    finally:
        set_pdl(before)


def launch_options(enabled: bool) -> dict:
    """The launch keywords for ``kernel[grid](...)``: ``launch_pdl`` is an NVIDIA Triton option only."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of an elementwise kernel: with PDL, let the next grid launch now (its
    programs can start and prefetch their weights while this one runs; they wait for this grid
    to complete before reading its output), then wait for the previous grid to complete."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
