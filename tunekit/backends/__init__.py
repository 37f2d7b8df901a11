"""Backend registry: name -> module path, imported lazily.

Built-in names are ``triton``, ``hip`` and ``vendor``. Any other name of the
form ``package.module:ATTR`` is imported as a third-party backend (used by
tests to inject failing candidates, and by plugins).
"""

from __future__ import annotations

import importlib

from tunekit.backends.base import Backend, BuildError, SearchSpace

__all__ = ["Backend", "BuildError", "SearchSpace", "get", "BUILTIN", "TUNED"]

BUILTIN: dict[str, str] = {
    "triton": "tunekit.backends.triton:BACKEND",
    "hip": "tunekit.backends.hip:BACKEND",
    "vendor": "tunekit.backends.vendor:BACKEND",
}
#: Searchable families, in report order.
TUNED = ("triton", "hip")


def get(name: str) -> Backend:
    """The backend called ``name`` (built-in) or at ``module:ATTR``."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise KeyError(f"unknown backend {name!r} (known: {', '.join(BUILTIN)})")
    module_name, attr = target.split(":", 1)
    module = importlib.import_module(module_name)
    return getattr(module, attr)
