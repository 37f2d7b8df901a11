"""Search spaces as data: one TOML file per op, one table per backend.

``load(op, backend)`` returns a ``tunekit.backends.base.SearchSpace``. The
TOML holds domains, the default (fallback) config and the exact-numerics
reference config; validity predicates live in Python next to each kernel.
The Gemma-weight norms share the file of their plain-weight op (``FILES``):
one kernel serves both conventions, the op name tells it which.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import tomllib

#: op -> TOML file stem, where they differ (same kernels, same tunables).
FILES: dict[str, str] = {
    "gemma_rms_norm": "rms_norm",
    "gemma_fused_add_rms_norm": "fused_add_rms_norm",
    # norm -> GEMV: one kernel for both weight conventions, with or without a residual
    "gemma_rms_norm_gemv": "rms_norm_gemv",
    "fused_add_rms_norm_gemv": "rms_norm_gemv",
    "gemma_fused_add_rms_norm_gemv": "rms_norm_gemv",
    # the residual add in the GEMV epilogue: the GEMV's kernel and tunables
    "gemv_add": "gemv",
    # SiLU-and-mul in gate_up's epilogue, with or without the folded norm's scale: one space
    "rms_gemv_silu_mul": "gemv_silu_mul",
}


class SpaceError(ValueError):
    """A search-space file is missing or malformed."""


@cache
def _read(op: str) -> dict[str, Any]:
    path = resources.files(__name__).joinpath(f"{op}.toml")
    if not path.is_file():
        raise SpaceError(f"no search space for op {op!r} (expected search_spaces/{op}.toml)")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpaceError(f"search_spaces/{op}.toml: {exc}") from exc


def load(op: str, backend: str):
    """The ``SearchSpace`` of ``backend`` for ``op``; checks default/reference lie in the domains."""
    from tunekit.backends.base import SearchSpace

    stem = FILES.get(op, op)
    data = _read(stem)
    if backend not in data:
        raise SpaceError(f"search_spaces/{stem}.toml has no [{backend}] table")
    table = data[backend]
    domains = {name: list(values) for name, values in table.get("domains", {}).items()}
    default = dict(table.get("default", {}))
    reference = dict(table.get("reference", default))
    for label, params in (("default", default), ("reference", reference)):
        missing = set(domains) - set(params)
        if missing:
            raise SpaceError(f"[{backend}.{label}] of {stem}.toml lacks {sorted(missing)}")
        for name, value in params.items():
            if name in domains and value not in domains[name]:
                raise SpaceError(f"[{backend}.{label}] {name}={value!r} is outside its domain {domains[name]}")
    fixed = dict(table.get("fixed", {}))
    return SearchSpace(op=op, backend=backend, domains=domains, default=default, reference=reference, fixed=fixed)
