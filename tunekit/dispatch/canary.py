"""The canary (``TUNEKIT_CANARY=N``): one served call in N of each tuned key checked, the key demoted on a miss.

Opt-in, for a table whose kernels passed the search's correctness gate on
random inputs and now serve real ones. With ``TUNEKIT_CANARY=N`` (a whole
number >= 1), the N-th, 2N-th, ... eager call of each tuned key (op, dtype,
M, N, K, device) is checked after its launch the way the search checks a
candidate (``tunekit.measure.verify``): every output finite and within the
op's error bound (``OpSpec.error_bound``) of its fp64 reference
(``OpSpec.reference``), on the call's own inputs. A miss raises
:class:`CanaryMismatch` inside the op's launch; the op then treats it as a
kernel that raised (``tunekit.dispatch.decisions.mark_broken``): that call
and every later one of the key take the vendor path, counted as
``fallback:canary_mismatch``, and one warning says why.

Call protocol: a route that holds a tuned kernel passes it through
:func:`guard` when it is resolved. Off (the variable unset, empty or ``0``),
:func:`guard` returns the kernel itself: the hot path is the same code as
without the canary. On, it returns a checking wrapper, and the route does
not bind the kernel (``tunekit.dispatch.launch``: a bound launcher replays
the kernel's launches and would skip the check).

Not checked: calls under CUDA-graph capture (the check reads the output back
and must not enter the graph; graph replays run no Python at all), and calls
at a norm epsilon other than the one the search verifies at
(``tunekit.problems.opspec.EPS``: the fp64 references are written for it).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from tunekit.dispatch.state import STATE, log_once

CANARY_ENV = "TUNEKIT_CANARY"

#: (op, dtype, m, n, k, device key) -> the key's call counter (kept across route rebuilds, so "one in N"
#: holds however often a route is made again)
_COUNTS: dict[tuple, Callable[[], int]] = {}


class CanaryMismatch(RuntimeError):
    """A checked call's output was outside the op's bound of its fp64 reference (the message says by how much)."""


def every() -> int:
    """N of ``TUNEKIT_CANARY`` (0: off). A value that is not a whole number >= 0 is off, with one warning."""
    text = os.environ.get(CANARY_ENV, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        log_once(f"canary-env:{text}", logging.WARNING,
                 "tunekit: %s=%r is not a whole number >= 0; the canary is off", CANARY_ENV, text)
        return 0
    return value


def guard(op: str, dtype: str, m: int, n: int, k: int, device: torch.device, kernel: Callable[..., None],
          eps: float | None = None) -> Callable[..., None]:
    """``kernel`` itself when the canary is off (or the call's ``eps`` is not the verified one), else a wrapper
    with the same call protocol that checks one call in N after the launch (raising :class:`CanaryMismatch`)."""
    n_every = every()
    if n_every <= 0:
        return kernel
    from tunekit.problems import opspec
    from tunekit.problems.shapes import Problem

    if eps is not None and eps != opspec.EPS:
        return kernel  # the fp64 references are written for the search's epsilon
    try:
        spec = opspec.get(op)
    except (KeyError, ValueError):
        return kernel  # an op without a reference: nothing to check against
    problem = Problem(op, dtype, m, n, k)
    key = (op, dtype, m, n, k, str(device))
    with STATE.lock:
        tick = _COUNTS.setdefault(key, itertools.count(1).__next__)

    def checked(inputs: tuple[torch.Tensor, ...], out: Any, *args: Any, **kwargs: Any) -> None:
        kernel(inputs, out, *args, **kwargs)
        if tick() % n_every:
            return
        first = out[0] if isinstance(out, tuple) else out
        if first.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # a read-back inside a capture would break it; the graph replays unchecked
        why = mismatch(spec, problem, inputs, out)
        if why is not None:
            raise CanaryMismatch(why)

    return checked


def mismatch(spec: Any, problem: Any, inputs: tuple[torch.Tensor, ...], out: Any) -> str | None:
    """Why ``out`` fails the search's bound against the fp64 reference of ``inputs`` (worst output), else None."""
    from tunekit.measure.verify import against_reference

    outs = out if isinstance(out, tuple) else (out,)
    if not all(bool(torch.isfinite(o).all()) for o in outs):
        return "non-finite output"
    worst = against_reference(spec, problem, inputs, outs)
    if worst.ratio > 1.0:
        return f"max |error| {worst.worst_err:.3g} against the fp64 reference, {worst.ratio:.3g}x the op's bound"
    return None
