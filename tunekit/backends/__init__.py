"""Backend registry: name -> module path, imported lazily.

Built-in names are ``triton``, ``hip`` (tuned families), ``vendor`` (cuBLAS /
rocBLAS for GEMV, the PyTorch eager composition for elementwise ops) and
``inductor`` (torch.compile of that composition). Any other name of the
form ``package.module:ATTR`` is imported as a third-party backend (used by
tests to inject failing candidates, and by plugins).
"""

from __future__ import annotations

import importlib

from tunekit.backends.base import Backend, BuildError, SearchSpace

__all__ = ["Backend", "BuildError", "SearchSpace", "get", "BUILTIN", "TUNED", "BASELINES"]

BUILTIN: dict[str, str] = {
    "triton": "tunekit.backends.triton:BACKEND",
    "hip": "tunekit.backends.hip:BACKEND",
    "vendor": "tunekit.backends.vendor:BACKEND",
    "inductor": "tunekit.backends.inductor:BACKEND",
}
#: Searchable families, in report order.
TUNED = ("triton", "hip")
#: Baselines (kind "vendor"), never searched: "vendor" is always measured; the
#: others join the final re-measure for the ops they implement where they can
#: run. A tuned kernel must beat the fastest of them (tunekit.table).
BASELINES = ("vendor", "inductor")


def get(name: str) -> Backend:
    """The backend called ``name`` (built-in) or at ``module:ATTR``."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise KeyError(f"unknown backend {name!r} (known: {', '.join(BUILTIN)})")
    module_name, attr = target.split(":", 1)
    module = importlib.import_module(module_name)
    return getattr(module, attr)
