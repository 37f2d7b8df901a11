"""One elementwise key's route: what serves (op, m, n, k, dtype, device, eps), resolved once.

Call protocol: ``tunekit.dispatch.elementwise._ew_serve`` makes a
:class:`_EwRoute` per key (and per epsilon) the first time it sees it and
keeps it while the decision cache holds its choice. The route holds the
choice, its marker rows' counters, the tuned kernel's call at the route's
epsilon (:func:`_at_eps`) and bound launcher, and the state of the
default-config kernel that serves the key's fallbacks
(``tunekit.dispatch.elementwise_fallback._launch_default``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from tunekit.dispatch import canary, launch
from tunekit.dispatch.decisions import resolve
from tunekit.dispatch.markers import counter, served_m
from tunekit.dispatch.state import DEFAULT_EPS, STATE


def _at_eps(kernel: Callable[..., None], takes_eps: bool, eps: float | None) -> Callable[..., None]:
    """``kernel`` as called at ``eps``: itself at its built epsilon (or when it takes none), else a
    partial that passes ``eps``, so a bound launcher records and replays that epsilon."""
    if not takes_eps or eps is None or eps == DEFAULT_EPS:
        return kernel
    return partial(kernel, eps=eps)


class _EwRoute:
    """What serves one (op, m, n, k, dtype, device, eps), resolved once: the choice, its marker
    rows' counters, its kernel's bound launcher and, for a fallback, the default-config kernel's
    (valid while the decision cache holds the choice)."""

    __slots__ = ("ckey", "choice", "shape", "ticks", "run", "launcher", "bind", "vticks",
                 "default", "drun", "dlauncher", "dseen")

    def __init__(self, op: str, dtype: str, m: int, n: int, k: int, device: torch.device, capturing: bool,
                 eps: float | None = None) -> None:
        self.ckey = (op, dtype, m, n, k, str(device))
        self.choice = STATE.choices.get(self.ckey) or resolve(op, dtype, m, n, k, device, capturing)
        self.shape = f"{n}x{k}"
        # ticks[capturing]: the tuned rows (fallbacks count through count(): their vendor varies per call)
        self.ticks = [counter(op, dtype, self.shape, m, False, self.choice.impl, c, None, served_m(self.choice)).tick
                      for c in (False, True)]
        self.run, self.launcher, self.bind = None, None, False
        #: (impl, served by, capturing) -> tick of a fallback's row
        self.vticks: dict[tuple, Callable[[], int]] = {}
        #: the default-config kernel serving this key's fallbacks: the DefaultKernel, its call at this eps,
        #: its bound launcher and how far binding got (0: no eager call yet, 1: one, 2: bound or tried)
        self.default, self.drun, self.dlauncher, self.dseen = None, None, None, 0
        kernel = self.choice.kernel
        if kernel is not None:
            self.run = run = _at_eps(kernel, self.choice.takes_eps, eps)
            # the canary's check wraps the call (TUNEKIT_CANARY; off: the call itself, bound as ever)
            self.run = canary.guard(op, dtype, m, n, k, device, run, eps)
            if self.run is run and self.choice.impl == "tuned:triton":
                tried, self.launcher = launch.bound(self.run)
                self.bind = not tried
