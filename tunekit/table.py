"""Dispatch table: schema, export, load, validate, lookup (and ``serving_lookup``: the M rule serving applies,
for the predictions to use the same).

A table maps (op, dtype, n, k, m) to the fastest *verified* candidate that beat the baseline by at least
``min_gain`` in the same run. It carries an environment stamp (device, arch, versions, kernel source hash) so that a
table tuned elsewhere is refused rather than silently used.

This module must stay importable without optuna (the serving path loads it).

The baseline a candidate must beat (``build_table``): the *fastest* baseline row of its problem in the same
interleaved re-measure. For GEMV that is the vendor path (cuBLAS / rocBLAS). For the elementwise ops it is the
faster of the PyTorch eager composition ("vendor") and its Inductor compilation ("inductor", when measured): vLLM
runs these ops either eagerly or, by default, inside torch.compile'd graphs where Inductor fuses them, so a kernel
that only beats eager would replace nothing in a compiled deployment. Peers (vLLM's skinny GEMM, FlashInfer:
``backends.PEERS``) are timed in the same re-measure and reported, but are no bar: where a shape has no entry the
plugin serves the stock path, not the peer. Entries record that time as ``baseline_us`` and the speedup over it;
``speedup`` is recomputed here from the rows, so a table re-exported from final.csv gates the same way.

Format (``format`` = ``tunekit.dispatch/1``)::

    {"format": "tunekit.dispatch/1", "created": ISO-8601,
     "environment": {"gpu": ..., "arch": ..., "cu_count": ..., "wave_size": ...,
                     "runtime": ..., "torch": ..., "triton": ..., "tunekit": ...,
                     "kernel_hash": {backend: hash}},
     "read_limit_gbps": float or null,
     "tp": int or null,
     "entries": [{"op", "dtype", "m", "n", "k", "backend", "kernel", "params",
                  "time_us", "baseline_us", "speedup", "gbps", "pct_of_limit",
                  "max_abs_err", "err_ratio", "count", "timing_kind"}],
     "fusions": {group key: {"fuse", "margin", "why", "per_m", ...}}}

``fusions`` (``tunekit.table_fusions``): per layer group, whether serving fuses it (a folded norm, the residual
add in the GEMV epilogue), measured by the search against the unfused sequence at every M; empty for a search
of no layer group (``--shape``); absent in tables written before it (serving then keeps its older rule).

``read_limit_gbps``: the probe's streaming-read bandwidth, the limit ``pct_of_limit`` refers to; null where
none was measured: a CPU (interpreter) run, whose figures are not bandwidth evidence (its entries'
``pct_of_limit`` null too, as the search's summary and ``tunekit compare`` show them); a table written before
that records the CPU probe's figure, and still loads.

``tp``: the tensor-parallel size the problems were sharded for (``tunekit search --model M --tp N``: one
rank's shards); null or absent (tables written before it was recorded, and ``--shape`` searches, whose
shapes are given as they run): unknown, served at any TP size.

In memory (``load``, ``build_table``) a table is its JSON object with each entry a frozen :class:`Entry`, read
by attribute; ``entries(table)`` is how code outside this module reaches them, from a loaded table or one
written as a plain dict (whose JSON objects it checks and converts); ``save`` and ``as_json`` give the JSON back.

Validation (``validate``; ``load`` runs it): the structure and every field's type and range always (finite positive
times, ``pct_of_limit`` a number or null, the stamp's fields, known op and dtype, params a flat dict). With
``strict=True`` (``tunekit show``) also what each entry means: a tuned backend that serves its op, params non-empty,
named and typed as the backend's search space has them, and accepted by the kernel's own predicate
(``Backend.invalid_reason``) for the entry's problem. Serving loads tables without ``strict``: an entry that does
not build there takes the vendor path on its own (``tunekit.ops``), and a backend that cannot be imported on the
serving machine does not make the rest of the table unusable.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tunekit.errors import UserError
from tunekit.problems import oprecords
from tunekit.problems.shapes import DTYPE_BYTES, Problem

FORMAT = "tunekit.dispatch/1"

_ENTRY_FIELDS: dict[str, tuple[type, ...]] = {
    "op": (str,), "dtype": (str,), "m": (int,), "n": (int,), "k": (int,), "backend": (str,), "kernel": (str,),
    "params": (dict,), "time_us": (int, float), "baseline_us": (int, float), "speedup": (int, float),
    "gbps": (int, float),
}
_ENV_FIELDS = ("gpu", "arch", "cu_count", "wave_size", "runtime", "torch", "triton", "tunekit", "kernel_hash")
_ENV_TYPES: dict[str, tuple[type, ...]] = {
    "gpu": (str,), "arch": (str,), "cu_count": (int,), "wave_size": (int,), "runtime": (str,), "torch": (str,),
    "triton": (str, type(None)), "tunekit": (str,), "kernel_hash": (dict,),
}
#: Entry fields that hold a number >= 0 or null (a figure some devices cannot give).
_OPTIONAL_NUMBERS = ("pct_of_limit", "max_abs_err", "err_ratio")
_PARAM_VALUE_TYPES = (int, float, str, bool)


class TableError(UserError):
    """An invalid or corrupt dispatch table."""


#: An entry's keys in the order :func:`build_table` writes them (and ``Entry.to_json`` gives them back).
ENTRY_KEYS = ("op", "dtype", "m", "n", "k", "backend", "kernel", "params", "time_us", "baseline_us", "speedup",
              "gbps", "pct_of_limit", "max_abs_err", "err_ratio", "count", "timing_kind")
#: The keys an entry may leave out (tables written before them were recorded), and what a reader gets then.
_OPTIONAL = {"pct_of_limit": None, "max_abs_err": None, "err_ratio": None, "count": 1, "timing_kind": None}
_KNOWN = frozenset(ENTRY_KEYS)


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a dispatch table: the config that serves (op, dtype, M, N, K) and the figures it won by.

    Made and checked once, where a table is read or built (:func:`load`, :func:`build_table`, :func:`entries`),
    so no reader meets a missing key or a wrong type later. Frozen, ``params`` a read-only view: a loaded
    table's entries are shared by every reader (the serving index, the load check, the predictions), and one
    writing into an entry would change what the others serve; ``dict(entry.params)`` is a copy of one's own.
    ``to_json`` gives back the JSON object the entry was read from: a table loaded and saved is the same file."""

    op: str
    dtype: str
    m: int
    n: int
    k: int
    backend: str
    kernel: str
    params: Mapping[str, Any]
    time_us: float
    baseline_us: float
    speedup: float
    gbps: float
    pct_of_limit: float | None = None
    max_abs_err: float | None = None
    err_ratio: float | None = None
    count: int = 1
    timing_kind: str | None = None
    #: the optional keys (:data:`_OPTIONAL`) the JSON object left out: ``to_json`` leaves them out again
    omitted: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    #: keys beyond the schema (the format never refused them), kept so that a load and a save lose nothing
    extra: tuple[tuple[str, Any], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        # a copy behind the view (the caller's dict may change after); a view given is this module's, kept
        if type(self.params) is not MappingProxyType:
            object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def __hash__(self) -> int:  # params (a view) has no hash; a table holds one entry per key anyway
        return hash((self.op, self.dtype, self.m, self.n, self.k, self.backend))

    @property
    def key(self) -> tuple[str, str, int, int, int]:  # (op, dtype, M, N, K): one entry per key in a table
        return (self.op, self.dtype, self.m, self.n, self.k)

    @property
    def shape_key(self) -> tuple[str, str, int, int]:  # (op, dtype, N, K): what its Ms share (TableIndex's key)
        return (self.op, self.dtype, self.n, self.k)

    @property
    def problem(self) -> Problem:
        return Problem(self.op, self.dtype, self.m, self.n, self.k)

    @classmethod
    def from_json(cls, data: Any, index: int = 0, source: str = "table") -> Entry:
        """The entry of JSON object ``data`` (the ``index``-th of table ``source``), or :func:`validate`'s
        TableError for it."""
        if not isinstance(data, dict):
            raise TableError(f"{source}: entry {index} is not an object")
        why = _entry_problem(data)
        if why is not None:
            raise TableError(f"{source}: {_entry_label(index, data)}: {why}")
        return cls._from_checked(data, owned=False)

    @classmethod
    def _from_checked(cls, data: dict[str, Any], owned: bool) -> Entry:
        """The entry of a JSON object :func:`_entry_problem` passed; ``owned``: dropped after (a load's), no copy."""
        entry = object.__new__(cls)
        # each slot through its own descriptor: made through the frozen __init__ (object.__setattr__ per field)
        # a 100,000-entry table loaded in 2.09 s of CPU against 1.33 s before entries were typed (one series)
        for name, setter in _SLOT_SETTERS:
            setter(entry, data.get(name, _OPTIONAL.get(name)))
        _SET_PARAMS(entry, MappingProxyType(data["params"] if owned else dict(data["params"])))
        _SET_OMITTED(entry, _NONE_OMITTED if _KNOWN <= data.keys() else
                     frozenset(name for name in _OPTIONAL if name not in data))
        _SET_EXTRA(entry, tuple((name, value) for name, value in data.items() if name not in _KNOWN))
        return entry

    def to_json(self) -> dict[str, Any]:
        """The entry as its table's JSON holds it (:data:`ENTRY_KEYS`' order, then the extra keys); own params."""
        out = {name: getattr(self, name) for name in ENTRY_KEYS if name not in self.omitted}
        out["params"] = dict(self.params)
        return out | dict(self.extra)


_SLOT_SETTERS = tuple((name, getattr(Entry, name).__set__) for name in ENTRY_KEYS if name != "params")
_SET_PARAMS, _SET_OMITTED, _SET_EXTRA = (getattr(Entry, name).__set__ for name in ("params", "omitted", "extra"))
_NONE_OMITTED: frozenset[str] = frozenset()


def entries(table: Mapping[str, Any], source: str = "table") -> list[Entry]:
    """The entries of ``table`` as :class:`Entry`: the one door to them outside this module. A table from
    :func:`load` or :func:`build_table` holds them already (no second check); a table written as a plain dict
    (the tests', an integration's) holds JSON objects, each checked as :func:`load` checks it (TableError
    naming the first bad one). The table's other sections are :func:`validate`'s to check."""
    return [e if type(e) is Entry else Entry.from_json(e, i, source) for i, e in enumerate(table["entries"])]


def as_json(table: Mapping[str, Any]) -> dict[str, Any]:
    """``table`` as its JSON file holds it: every :class:`Entry` given back as its JSON object (``json.dumps``
    takes no Entry). What :func:`save` writes; also for a caller that hashes or copies a table as JSON."""
    return dict(table, entries=[e.to_json() if type(e) is Entry else e for e in table["entries"]])


def tunekit_version() -> str:
    from tunekit import __version__

    return __version__


def environment_stamp(device: dict[str, Any], backends: list[str]) -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from tunekit import backends as registry

    hashes = {}
    for name in backends:
        try:
            hashes[name] = registry.get(name).source_hash()
        except Exception as exc:  # a broken backend must not prevent stamping the others
            hashes[name] = f"unavailable: {exc}"
    return {"gpu": device["name"], "arch": device["arch"], "cu_count": device["cu_count"],
            "wave_size": device["wave_size"], "runtime": device["runtime"], "torch": torch.__version__,
            "triton": triton_version, "tunekit": tunekit_version(), "kernel_hash": hashes}


def build_table(
    final_rows: list[dict[str, Any]],
    device: dict[str, Any],
    probe: dict[str, Any],
    min_gain: float,
    backends: list[str],
    tp: int | None = None,
    fusions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Pick per problem the fastest re-measured candidate at least ``min_gain`` ahead of the
    fastest stock baseline (vendor; for elementwise ops also Inductor: see the module docstring).
    ``tp``: the tensor-parallel size the problems were sharded for (None: unknown). A CPU ``probe``
    (kind "cpu") gives no read limit: ``read_limit_gbps`` and every ``pct_of_limit`` are null. ``fusions``:
    the section of ``tunekit.table_fusions`` (None: the table has none)."""
    from tunekit import backends as registry

    # on the CPU interpreter no read-bandwidth limit is measured (the search and the report say "none")
    cpu = probe.get("kind") == "cpu"

    def problem_key(row: dict[str, Any]) -> tuple:
        return (row["op"], row["dtype"], int(row["m"]), int(row["n"]), int(row["k"]))

    baseline: dict[tuple, float] = {}
    for row in final_rows:
        if row["backend"] in registry.STOCK:  # peers are reported, not a bar (backends.STOCK says why)
            key = problem_key(row)
            baseline[key] = min(baseline.get(key, math.inf), float(row["time_us"]))
    best: dict[tuple, dict[str, Any]] = {}
    for row in final_rows:
        if row["backend"] in registry.BASELINES:
            continue
        key = problem_key(row)
        # rows without a baseline row of their problem keep the engine's figures
        base_us = baseline.get(key, float(row["baseline_us"]))
        row = dict(row, baseline_us=base_us, speedup=base_us / float(row["time_us"]))
        if row["speedup"] < 1.0 + min_gain:
            continue
        if key not in best or row["time_us"] < best[key]["time_us"]:
            best[key] = row
    made = []
    for (op, dtype, m, n, k), row in sorted(best.items()):
        params = row["params"]
        if isinstance(params, str):
            params = json.loads(params)
        made.append(Entry(
            op, dtype, m, n, k, row["backend"], registry.get(row["backend"]).kernel_name(Problem(op, dtype, m, n, k)),
            params, float(row["time_us"]), float(row["baseline_us"]), float(row["speedup"]), float(row["gbps"]),
            pct_of_limit=None if cpu else _num(row.get("pct_of_limit")), max_abs_err=_num(row.get("max_abs_err")),
            err_ratio=_num(row.get("err_ratio")), count=int(row.get("count") or 1),
            timing_kind=row.get("timing_kind", "gpu")))
    table = {
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment_stamp(device, backends),
        "read_limit_gbps": None if cpu else probe.get("read_gbps"),
        "min_gain": min_gain,
        "tp": tp,
        "entries": made,
    }
    if fusions is not None:
        table["fusions"] = fusions
    return table


def _num(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def save(table: Mapping[str, Any], path: Path) -> Path:
    """Write ``table`` (its entries :class:`Entry` or JSON objects) to ``path`` once :func:`validate` passes it;
    a table :func:`load` read is written back byte for byte."""
    validate(table, source=str(path))
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(as_json(table), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load(path: str | Path, strict: bool = False) -> dict[str, Any]:
    """Read and validate a table; TableError (one line) if unreadable or invalid. The table's JSON object, its
    ``entries`` a list of :class:`Entry` (:func:`as_json` gives the JSON back).

    ``strict``: also check every entry against its backend (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"{path}: no such table file")
    try:
        table = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TableError(f"{path}: corrupt table (not JSON: {exc})") from None
    table["entries"] = _checked(table, str(path), strict)
    return table


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _entry_label(i: int, entry: dict[str, Any]) -> str:
    """``entry 3 (gemv bf16 m1 96x5120 triton)``: which entry a message is about."""
    parts = [str(entry.get(f, "?")) for f in ("op", "dtype")] + [f"m{entry.get('m', '?')}",
                                                                 f"{entry.get('n', '?')}x{entry.get('k', '?')}",
                                                                 str(entry.get("backend", "?"))]
    return f"entry {i} ({' '.join(parts)})"


#: Each field's types as JSON gives them, tried first (one set lookup per field: a 100,000-entry table is
#: checked in about half the time isinstance takes); any other value takes the isinstance checks.
_ENTRY_EXACT = {name: frozenset(types) for name, types in _ENTRY_FIELDS.items()}
_FINITE_POSITIVE = ("time_us", "baseline_us", "speedup", "gbps")
_NUMBER_TYPES = frozenset((int, float))
_PARAM_EXACT = frozenset(_PARAM_VALUE_TYPES)


def _entry_problem(entry: dict[str, Any]) -> str | None:
    """Why an entry's fields are malformed (types, ranges, names), else None."""
    get = entry.get
    for name, exact in _ENTRY_EXACT.items():
        value = get(name)
        if type(value) not in exact:
            types = _ENTRY_FIELDS[name]
            if not isinstance(value, types) or isinstance(value, bool):
                return f"field {name!r} missing or not {types[0].__name__} (got {value!r})"
    for name in ("m", "n", "k"):
        if entry[name] < 1:
            return f"{name}={entry[name]} (must be > 0)"
    for name in _FINITE_POSITIVE:
        if not 0 < entry[name] < math.inf:  # NaN and infinities fail too
            return f"{name}={entry[name]} (must be finite and > 0)"
    for name in _OPTIONAL_NUMBERS:
        value = get(name)
        if value is not None and not ((type(value) in _NUMBER_TYPES or _is_number(value)) and 0 <= value < math.inf):
            return f"{name}={value!r} (must be a number >= 0 or null)"
    count = get("count", 1)
    if type(count) is not int and (not isinstance(count, int) or isinstance(count, bool)) or count < 1:
        return f"count={count!r} (must be an integer > 0)"
    if not isinstance(get("timing_kind", ""), str):
        return f"timing_kind={entry['timing_kind']!r} (must be a string)"
    record = oprecords.RECORDS.get(entry["op"])
    if record is None or not record.tabulated:  # every op with a spec: the fused families chain-used too
        return f"unknown op {entry['op']!r} (known: {', '.join(oprecords.names(tabulated=True))})"
    if entry["dtype"] not in DTYPE_BYTES:
        return f"unknown dtype {entry['dtype']!r} (known: {', '.join(DTYPE_BYTES)})"
    for key, value in entry["params"].items():
        if type(value) not in _PARAM_EXACT and not isinstance(value, _PARAM_VALUE_TYPES):
            return f"params {key}={value!r}: not a number or a string"
    return None


def _entry_meaning(entry: dict[str, Any]) -> str | None:
    """Why a well-formed entry cannot serve its problem (strict validation), else None."""
    from tunekit import backends as registry

    name, params = entry["backend"], entry["params"]
    if name in registry.BASELINES:
        return f"backend {name!r} is a baseline: the vendor path needs no entry"
    if name not in registry.BUILTIN and ":" not in name:
        return f"unknown backend {name!r} (known: {', '.join(registry.TUNED)}, or module:ATTR)"
    if not params:
        return "params is empty (a tuned entry names its config)"
    try:
        backend = registry.get(name)
    except ImportError as exc:
        if name in registry.BUILTIN:
            return None  # not installed here (no triton, say): the structure is all that can be checked
        return f"backend {name!r} cannot be imported ({exc})"
    except (KeyError, AttributeError) as exc:
        return f"backend {name!r} cannot be loaded ({exc})"
    if entry["op"] not in getattr(backend, "ops", ()):
        return f"backend {name!r} has no kernel for op {entry['op']!r}"
    problem = Problem(entry["op"], entry["dtype"], entry["m"], entry["n"], entry["k"])
    return params_problem(backend, name, problem, params)


def params_problem(backend: Any, name: str, problem: Any, params: dict[str, Any],
                   need_space: bool = True) -> str | None:
    """Why ``params`` cannot serve ``problem`` on ``backend`` (named ``name``): a name or type its search
    space does not have, or the kernel's own predicate (``Backend.invalid_reason``) refusing them; else None.
    A backend without a space or a predicate is checked for what it has. Never raises: a predicate that
    chokes on the params is a refusal; a kernel module that cannot be imported here is None (unknown).
    ``need_space=False``: a space that cannot be had (a plug-in backend's, named without a search-space
    file) leaves the names and types unchecked, and the predicate decides.

    Also what serving checks before it builds an entry's kernel (``tunekit.dispatch.decisions``)."""
    try:
        try:
            space = backend.space(problem) if hasattr(backend, "space") else None
        except ImportError:
            raise
        except Exception:
            if need_space:
                raise
            space = None
        if space is not None:
            known = {**space.domains, **{k: [v] for k, v in {**space.default, **space.reference,
                                                              **space.fixed}.items()}}
            for key, value in params.items():
                if key not in known:
                    return f"params {key}={value!r}: {name} {problem.op} has no tunable {key!r}"
                types = {type(v) for v in known[key]}
                if type(value) not in types and not (type(value) is int and float in types):
                    wanted = " or ".join(sorted(t.__name__ for t in types))
                    return f"params {key}={value!r} is {type(value).__name__}, expected {wanted}"
        predicate = getattr(backend, "invalid_reason", None)
        reason = None if predicate is None else predicate(problem, params)
    except ImportError:
        return None  # the kernel module needs what is not installed here (see above)
    except Exception as exc:  # noqa: BLE001 - a predicate that chokes on the params: that is the verdict
        reason = f"{type(exc).__name__}: {exc}"
    return None if reason is None else f"params rejected by the {name} kernel: {reason}"


def validate(table: Any, source: str = "table", strict: bool = False) -> None:
    """TableError (one line naming the entry and why) unless ``table`` is a valid table (its entries JSON
    objects or :class:`Entry`, each checked: an Entry made directly, not read, was never checked);
    ``strict`` also checks each entry against its backend (see the module docstring)."""
    _checked(table, source, strict, build=False)


def _checked(table: Any, source: str, strict: bool, build: bool = True) -> list[Entry]:
    """:func:`validate`'s check, and (``build``) the entries it passed as :class:`Entry`: one pass, so that a load
    checks each entry and makes it once."""
    if not isinstance(table, dict):
        raise TableError(f"{source}: a table must be a JSON object")
    if table.get("format") != FORMAT:
        raise TableError(f"{source}: unknown format {table.get('format')!r} (expected {FORMAT!r})")
    env = table.get("environment")
    if not isinstance(env, dict):
        raise TableError(f"{source}: missing environment stamp")
    missing = [f for f in _ENV_FIELDS if f not in env]
    if missing:
        raise TableError(f"{source}: environment stamp lacks {missing}")
    for name, types in _ENV_TYPES.items():
        value = env[name]
        if not isinstance(value, types) or isinstance(value, bool):
            raise TableError(f"{source}: environment {name}={value!r} is not {types[0].__name__}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env["kernel_hash"].items()):
        raise TableError(f"{source}: environment kernel_hash must map backend names to hash strings")
    for name in ("read_limit_gbps", "min_gain"):
        value = table.get(name)
        if value is not None and not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise TableError(f"{source}: {name}={value!r} (must be a number >= 0 or null)")
    tp = table.get("tp")
    if tp is not None and not (type(tp) is int and tp >= 1):
        raise TableError(f"{source}: tp={tp!r} (the tensor-parallel size: a whole number >= 1, or null)")
    if "fusions" in table:
        from tunekit.table_fusions import section_problem

        why = section_problem(table["fusions"])
        if why is not None:
            raise TableError(f"{source}: {why}")
    entries = table.get("entries")
    if not isinstance(entries, list):
        raise TableError(f"{source}: 'entries' must be a list")
    seen = set()
    problems: list[str] = []
    out: list[Entry] = []
    for i, entry in enumerate(entries):
        if type(entry) is Entry:
            entry = entry.to_json()
        elif not isinstance(entry, dict):
            problems.append(f"entry {i} is not an object")
            continue
        why = _entry_problem(entry)
        if why is None:
            key = (entry["op"], entry["dtype"], entry["m"], entry["n"], entry["k"])
            why = f"duplicate entry for {key}" if key in seen else (_entry_meaning(entry) if strict else None)
            seen.add(key)
        if why is not None:
            problems.append(f"{_entry_label(i, entry)}: {why}")
        elif build and not problems:
            out.append(Entry._from_checked(entry, owned=True))
    if problems:
        more = f" (and {len(problems) - 1} more invalid entries)" if len(problems) > 1 else ""
        raise TableError(f"{source}: {problems[0]}{more}")
    return out


def table_tp(table: dict[str, Any]) -> int | None:
    """The tensor-parallel size ``table`` was tuned for, or None (not recorded: unknown)."""
    return table.get("tp")


def environment_mismatch(table: Mapping[str, Any], device: dict[str, Any]) -> list[str]:
    """Fields of the stamp that differ from the running device/software."""
    env = table["environment"]
    # the kernel sources of every backend the entries use: a tuned config was
    # verified and timed on those sources, not on whatever the files hold now
    used = sorted({e.backend for e in (entries(table) if "entries" in table else ())
                   if e.backend in env["kernel_hash"]})
    current = environment_stamp(device, used)
    diffs = []
    for name in ("gpu", "arch", "wave_size", "runtime", "torch", "triton"):
        if env.get(name) != current.get(name):
            diffs.append(f"{name}: table {env.get(name)!r}, here {current.get(name)!r}")
    for backend in used:
        tabled, here = env["kernel_hash"][backend], current["kernel_hash"].get(backend)
        if tabled != here:
            diffs.append(f"{backend} kernel sources: table {tabled!r}, here {here!r}")
    return diffs


def saving_us(entry: Entry) -> float:
    """What one call served by ``entry`` saves by its standalone figures: baseline minus tuned time (us)."""
    return float(entry.baseline_us) - float(entry.time_us)


def lookup(table: Mapping[str, Any], op: str, dtype: str, m: int, n: int, k: int) -> Entry | None:
    """Entry for the exact M, else the smallest tabulated M >= m, else None (vendor path). Whether that
    entry's config runs at ``m`` is not asked: :func:`serving_lookup` is what the ops serve."""
    shape = (op, dtype, n, k)
    candidates = [e for e in entries(table) if e.shape_key == shape and e.m >= m]
    if not candidates:
        return None
    return min(candidates, key=lambda e: e.m)


def invalid_at_m(entry: Entry, m: int) -> str | None:
    """Why ``entry`` (tabulated at ``entry.m`` >= ``m``) cannot serve a call at M = ``m``, None where it can:
    its kernel's own predicate at that M (a Triton config of per-row accumulators, ``M_MODE="rows"``, does not
    run M = 1). An entry always runs its own M, and a HIP GEMV is built for its tabulated M, which serves every
    smaller M. The one test serving applies (``tunekit.dispatch.decisions``) and the predictions with it
    (:func:`serving_lookup`); it imports the entry's backend (torch) only where the Ms differ."""
    if entry.m == m or (entry.backend == "hip" and entry.op == "gemv"):
        return None
    from tunekit import backends as registry

    backend = registry.get(entry.backend)
    if not hasattr(backend, "invalid_reason"):
        return None
    return backend.invalid_reason(Problem(entry.op, entry.dtype, m, entry.n, entry.k), dict(entry.params))


def serving_lookup(table: Mapping[str, Any], op: str, dtype: str, m: int, n: int, k: int) -> Entry | None:
    """The entry the ops serve a call at M = ``m`` from: of the entries at M or above, smallest M first
    (:func:`lookup`'s order), the first whose config runs at ``m`` (:func:`invalid_at_m`); None where none
    does or none is tabulated (the stock path). An M between two tabulated ones, M = 3 with entries at 2 and
    4, is served by the one at 4 where its config runs at 3, else by the next above. An entry whose backend
    cannot be loaded here ends the walk with None, as its build error does in serving."""
    shape = (op, dtype, n, k)
    candidates = sorted((e for e in entries(table) if e.shape_key == shape and e.m >= m), key=lambda e: e.m)
    for entry in candidates:
        try:
            if invalid_at_m(entry, m) is None:
                return entry
        except Exception:  # the backend or its predicate fails to load: serving takes the stock path
            return None
    return None
