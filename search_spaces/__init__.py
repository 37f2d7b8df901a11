"""Search spaces as data: one TOML file per op, one table per backend.

``load(op, backend)`` returns a :class:`SearchSpace` (``tunekit.backends.base`` re-exports it). The
TOML holds domains, the default (fallback) config and the exact-numerics
reference config; validity predicates live in Python next to each kernel.
Which file an op reads is its record's (``tunekit.problems.oprecords``): the
Gemma-weight norms share the file of their plain-weight op (one kernel serves
both conventions, the op name tells it which); a plug-in op's record may name
a ``.toml`` path of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib


@dataclass(frozen=True)
class SearchSpace:
    """Domains of one backend's tunables for one op, as read from TOML.

    ``domains`` maps a parameter name (equal to the kernel's constexpr/define
    name) to the list of its allowed values; ``default`` is a parameter set
    valid for every problem of the op (the fallback config, enqueued first).
    ``reference`` is the designated config whose output bits define the
    ``exact`` numerics policy for this family.
    """

    op: str
    backend: str
    domains: dict[str, list[Any]]
    default: dict[str, Any]
    reference: dict[str, Any]
    fixed: dict[str, Any] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not self.domains


def _file(op: str) -> str:
    """The space file of ``op``: its record's (``tunekit.problems.oprecords``; ops of one kernel share a
    file, the Gemma-weight norms their plain-weight op's), else ``<op>.toml``'s stem."""
    from tunekit.problems import oprecords  # here: a space's TOML loads without the op records' torch

    record = oprecords.RECORDS.get(op)
    return op if record is None or record.space is None else record.space


class SpaceError(ValueError):
    """A search-space file is missing or malformed."""


@cache
def _read(op: str) -> dict[str, Any]:
    path = Path(op) if op.endswith(".toml") else resources.files(__name__).joinpath(f"{op}.toml")
    if not path.is_file():
        raise SpaceError(f"no search space for op {op!r} (expected search_spaces/{op}.toml)")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpaceError(f"search_spaces/{op}.toml: {exc}") from exc


#: The keys of a backend's table; the kernel a backend builds is its own (``tunekit.backends``), not the TOML's.
KEYS = frozenset({"domains", "default", "reference", "fixed"})


def load(op: str, backend: str):
    """The ``SearchSpace`` of ``backend`` for ``op``; checks default/reference lie in the domains."""
    stem = _file(op)
    data = _read(stem)
    if backend not in data:
        raise SpaceError(f"search_spaces/{stem}.toml has no [{backend}] table")
    table = data[backend]
    unknown = sorted(set(table) - KEYS)
    if unknown:  # a key nothing reads would look like a setting that works
        where = stem if stem.endswith(".toml") else f"search_spaces/{stem}.toml"
        raise SpaceError(f"[{backend}] of {where} has unknown keys {unknown} (known: {', '.join(sorted(KEYS))})")
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
