"""The tables serving one device at one tensor-parallel size, as one immutable index; and ``TUNEKIT_TABLE``.

:func:`table_paths` is the one place ``TUNEKIT_TABLE`` is read. :func:`build`
makes a :class:`TableIndex` of loaded tables for a device (its
``DeviceInfo``; None: the host's software only, for callers that may not
touch the GPU) and a TP size: the tables whose environment stamp and TP size
match, merged (the first table given wins a key, and a fusions group), keyed
by (op, dtype, N, K) with the Ms sorted. What serving keeps is what the index
holds: the decisions of the ops (``dispatch.decisions``), the integrations'
coverage questions (``covers``, ``largest_m``) and the vLLM plugin's compile
ranges all read an index, so none of them sees an entry serving drops.

Cost: building is one pass over the entries and one sort of each key's Ms;
a lookup is a dict access and a bisection of the key's Ms (at most a few);
the coverage questions (largest M, largest rows, whether an op is held) are
dict accesses. ``dispatch.tables`` builds one index per device key and TP
size, once per load of the tables.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from tunekit import shipped, table_fusions
from tunekit import table as table_mod
from tunekit.table import Entry

#: The tables to serve (os.pathsep-separated paths), read by :func:`table_paths` alone.
TABLE_ENV = "TUNEKIT_TABLE"

#: A table key (op, dtype, N, K) and what the index keeps per key: the Ms ascending, and the entries in that order.
Key = tuple[str, str, int, int]

#: Stamp fields only a device can tell (compared where :func:`build` has its ``DeviceInfo``).
_DEVICE_FIELDS = ("gpu:", "arch:", "wave_size:", "runtime:")
_NO_DEVICE = {"name": None, "arch": None, "cu_count": 0, "wave_size": 0, "runtime": None}


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """The cyclic garbage collector paused: reading a large table makes hundreds of thousands of objects, all
    kept, and each collection they trigger walks them all again (with it running, a 100,000-entry table took
    a third longer to parse and index)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def table_paths(text: str | None = None) -> list[str]:
    """The table paths ``TUNEKIT_TABLE`` names (or ``text``, the same form), blanks dropped, ``auto`` replaced by
    the shipped tables' paths: the one reader of the variable (serving's lazy load, the vLLM plugin's switch and
    compile-cache digest)."""
    if text is None:
        text = os.environ.get(TABLE_ENV, "")
    out: list[str] = []
    for part in (p for p in text.split(os.pathsep) if p.strip()):
        # "auto": every shipped table (tunekit.shipped), in its place in the precedence order; each is checked
        # on the device when it is read (dispatch.auto)
        if part.strip() == shipped.AUTO:
            out.extend(str(p) for p in shipped.paths())
        else:
            out.append(part)
    return out


class TableIndex:
    """The entries serving keeps for one device and TP size, keyed by (op, dtype, N, K) with the Ms sorted.

    Immutable: built once by :func:`build`; its mappings are read-only views, its sequences tuples and its
    entries the loaded tables' frozen ``tunekit.table.Entry`` objects, shared.
    """

    __slots__ = ("_keys", "_tops", "_widths", "_ops", "other_tp", "device", "tp", "fusions", "unmeasured", "size",
                 "per_m")

    def __init__(self, keys: dict[Key, tuple[tuple[int, ...], tuple[Entry, ...]]],
                 other_tp: dict[Key, int], device: Any, tp: int | None, fusions: dict[str, Any],
                 unmeasured: Sequence[str]) -> None:
        self._keys = MappingProxyType(keys)
        tops: dict[tuple, list[int]] = {}  # (op, dtype, K) -> [largest M, largest M x N / K rows]
        widths: dict[tuple, set[int]] = {}
        for (op, dtype, n, k), (ms, _) in keys.items():
            top = tops.setdefault((op, dtype, k), [0, 0])
            top[0] = max(top[0], ms[-1])
            top[1] = max(top[1], ms[-1] * n // k)
            widths.setdefault((op, dtype, k), set()).add(n)
        self._tops = MappingProxyType({key: tuple(v) for key, v in tops.items()})
        self._widths = MappingProxyType({key: tuple(sorted(v)) for key, v in widths.items()})
        self._ops = frozenset(op for op, _, _, _ in keys)
        #: (op, dtype, N, K) -> the TP size of the first table that holds it but was tuned for another TP
        self.other_tp = MappingProxyType(other_tp)
        #: the ``DeviceInfo`` the stamps were checked against (None: the host's software only)
        self.device = device
        #: the TP size this index serves (None: unknown, every table serves whatever TP it records)
        self.tp = tp
        #: the fusions sections (first table wins a group) and the paths of the tables without one
        self.fusions = MappingProxyType(fusions)
        self.unmeasured = tuple(unmeasured)
        #: (fused op, dtype, N, K) -> the Ms its fused kernel serves, from the records that choose per M
        self.per_m = MappingProxyType(table_fusions.per_m_choices(fusions))
        self.size = sum(len(ms) for ms, _ in keys.values())

    def __repr__(self) -> str:
        return f"TableIndex({self.size} entries, {len(self._keys)} keys, tp={self.tp})"

    def lookup(self, op: str, dtype: str, m: int, n: int, k: int) -> Entry | None:
        """The entry that serves a call: the exact M, else the smallest tabulated M above it, else None
        (``tunekit.table.lookup``'s rule)."""
        found = self._keys.get((op, dtype, n, k))
        if found is None:
            return None
        ms, entries = found
        i = bisect.bisect_left(ms, m)
        return entries[i] if i < len(ms) else None

    def fused_at(self, op: str, dtype: str, m: int, n: int, k: int) -> bool | None:
        """Whether fused op ``op`` runs its fused kernel at tabulated M ``m`` (the fusions' per-M choice,
        ``tunekit.table_fusions.decide``); None where no per-M record holds (op, dtype, N, K): the entry
        serves wherever it is, as for tables written before the per-M choice."""
        ms = self.per_m.get((op, dtype, n, k))
        return None if ms is None else m in ms

    def ms(self, op: str, dtype: str, n: int, k: int) -> tuple[int, ...]:
        """The Ms tabulated for (op, dtype, N, K), ascending (empty: none)."""
        found = self._keys.get((op, dtype, n, k))
        return () if found is None else found[0]

    def entries_of(self, op: str, dtype: str, n: int, k: int) -> tuple[Entry, ...]:
        """The entries of (op, dtype, N, K), by ascending M."""
        found = self._keys.get((op, dtype, n, k))
        return () if found is None else found[1]

    def largest_m(self, op: str, dtype: str, n: int | None, k: int) -> int | None:
        """The largest M held for (op, dtype, N, K) (``n=None``: at any N), or None."""
        if n is None:
            top = self._tops.get((op, dtype, k))
            return top[0] if top else None
        found = self._keys.get((op, dtype, n, k))
        return found[0][-1] if found else None

    def largest_rows(self, op: str, dtype: str, k: int) -> int | None:
        """The most K-wide rows one call of (op, dtype, any N, K) is served in: the largest M x N / K, or None."""
        top = self._tops.get((op, dtype, k))
        return top[1] if top else None

    def widths(self, op: str, dtype: str, k: int) -> tuple[int, ...]:
        """The Ns held for (op, dtype, any N, K), ascending."""
        return self._widths.get((op, dtype, k), ())

    def holds(self, op: str) -> bool:
        """Whether any entry of ``op`` is kept."""
        return op in self._ops

    def tops(self) -> dict[str, int]:
        """Per op, the largest M of its entries."""
        out: dict[str, int] = {}
        for (op, _, _), (top, _) in self._tops.items():
            out[op] = max(out.get(op, 0), top)
        return out

    def keys(self) -> Iterator[Key]:
        return iter(self._keys)

    def entries(self) -> Iterator[Entry]:
        """Every entry kept, key by key, by ascending M."""
        for _, found in self._keys.items():
            yield from found[1]


def mismatch(table: Mapping[str, Any], device: Any) -> list[str]:
    """The stamp's fields that differ from ``device`` (its ``DeviceInfo``) and this software; with ``device``
    None, the software's only (torch, Triton, the kernel sources): what a caller that must not touch the GPU
    can check."""
    if device is not None:
        return table_mod.environment_mismatch(table, device.as_dict())
    return [d for d in table_mod.environment_mismatch(table, _NO_DEVICE) if not d.startswith(_DEVICE_FIELDS)]


def stamped_here(table: Mapping[str, Any], device: Any) -> dict[str, Any]:
    """``table`` with its stamp replaced by this host's (``device``: its ``DeviceInfo``; None: the software
    only), so that :func:`build` keeps every entry of it: a shipped table counted before its check can run
    (``dispatch.tables.host_index``), never served so."""
    backends = sorted({e.backend for e in table_mod.entries(table)})
    here = table_mod.environment_stamp(device.as_dict() if device is not None else _NO_DEVICE, backends)
    return dict(table, environment=here)


def build(tables: Sequence[tuple[str, Mapping[str, Any]]], device: Any, tp: int | None,
          warn: Any = None) -> tuple[TableIndex | None, str | None]:
    """The index of loaded ``tables`` ((path, table), in precedence order) for ``device`` and TP size ``tp``,
    or (None, reason): "env_mismatch" where every table was stamped for another environment. ``warn(kind,
    path, detail)`` hears of each table left out ("env": the stamp's differences; "tp": its TP size)."""
    with no_collection():
        return _build(tables, device, tp, warn)


def _build(tables: Sequence[tuple[str, Mapping[str, Any]]], device: Any, tp: int | None,
           warn: Any) -> tuple[TableIndex | None, str | None]:
    keys: dict[Key, dict[int, Entry]] = {}
    other_tp: dict[Key, int] = {}
    fusions: dict[str, Any] = {}
    unmeasured: list[str] = []
    matched = 0
    for path, table in tables:
        diffs = mismatch(table, device)
        if diffs:
            if warn is not None:
                warn("env", path, "; ".join(diffs))
            continue
        table_tp = table_mod.table_tp(table)
        if table_tp is not None and tp is not None and table_tp != tp:
            if warn is not None:
                warn("tp", path, table_tp)
            for e in table_mod.entries(table, path):
                other_tp.setdefault(e.shape_key, table_tp)
            continue
        matched += 1
        if "fusions" in table:
            for group, decision in table["fusions"].items():
                fusions.setdefault(group, decision)
        else:
            unmeasured.append(path)
        for e in table_mod.entries(table, path):
            by_m = keys.setdefault(e.shape_key, {})
            by_m.setdefault(e.m, e)  # the first path given wins a duplicate key
    if not matched and not other_tp:
        return None, "env_mismatch"
    index = {key: (tuple(sorted(by_m)), tuple(by_m[m] for m in sorted(by_m))) for key, by_m in keys.items()}
    return TableIndex(index, other_tp, device, tp, fusions, unmeasured), None
