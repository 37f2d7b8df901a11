"""The dispatch tables being served: loading, the per-device environment check, the merged table.

Call protocol: :func:`load_tables` replaces the served tables (``None``
reads ``TUNEKIT_TABLE``; the first use of any table loads it lazily), and
forgets every cached decision. :func:`tables_for` gives, per device, the
merged table of the loaded tables whose environment stamp matches that
device (first path wins a duplicate key), or the fallback reason when none
does; it is cached per device key in ``STATE.device_tables``.
:func:`covers` and :func:`served_entry` answer integrations that decide
per layer or per call site before entering a tunekit op. Nothing here
raises for a broken table: it is logged once and served as absent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from tunekit import table as table_mod
from tunekit.dispatch.markers import maybe_register_atexit
from tunekit.dispatch.state import STATE, TABLE_ENV, LoadedTable, log_once


def load_tables(paths: str | os.PathLike | Sequence[str | os.PathLike] | None) -> list[dict[str, Any]]:
    """Serve ``paths`` (a list, or one ``:``-separated string); ``None`` reads ``TUNEKIT_TABLE`` again.

    Replaces the tables loaded before and forgets every cached decision (the
    dispatch markers are kept). A table that cannot be loaded is logged once
    and served as absent (``fallback:table_error``); this function itself
    never raises. Returns :func:`loaded_tables`.
    """
    if paths is None:
        paths = os.environ.get(TABLE_ENV, "")
    if isinstance(paths, (str, os.PathLike)):
        parts = [p for p in str(paths).split(os.pathsep) if p.strip()]
    else:
        parts = [str(p) for p in paths]
    loaded = []
    for path in parts:
        try:
            loaded.append(LoadedTable(path, table_mod.load(path)))
        except Exception as exc:  # serving never raises: a broken table is a vendor path + one log line
            loaded.append(LoadedTable(path, None, str(exc)))
            log_once(f"table-error:{path}", logging.ERROR, "tunekit: table %s not used: %s", path, exc)
    with STATE.lock:
        STATE.tables = loaded
        _forget_decisions()
        STATE.built.clear()  # other tables: other kernels
    maybe_register_atexit()  # TUNEKIT_DISPATCH_LOG may have been set since import tunekit.ops
    return loaded_tables()


def set_tensor_parallel(size: int | None) -> None:
    """Serve as one rank of a ``size``-way tensor-parallel model (None: unknown). A table that records
    another TP size (``tunekit search --tp``) then serves none of its shapes in this process: its keys take
    the vendor path as ``fallback:tp_mismatch``, warned once per table. Forgets the cached decisions when
    the size changes; never raises."""
    with STATE.lock:
        if STATE.tp == size:
            return
        STATE.tp = size
        _forget_decisions()  # the built kernels stay valid: the same tables, fewer of them served


def _forget_decisions() -> None:
    """Drop every cached decision derived from the served tables (the caller holds ``STATE.lock``)."""
    STATE.device_tables.clear()
    STATE.choices.clear()
    STATE.epoch += 1
    STATE.gated_layouts.clear()
    STATE.largest.clear()
    STATE.defaults.clear()


def loaded_tables() -> list[dict[str, Any]]:
    """The tables being served: path, entries, load error and, per device seen so far, the stamp verdict."""
    tables = all_tables()
    out = []
    for lt in tables:
        row: dict[str, Any] = {"path": lt.path, "entries": len(lt.table["entries"]) if lt.table else 0,
                               "tp": table_mod.table_tp(lt.table) if lt.table else None}
        if lt.error:
            row["error"] = lt.error
        out.append(row)
    with STATE.lock:
        verdicts = {dev: verdict for dev, (_, verdict) in STATE.device_tables.items()}
    if verdicts:
        for row in out:
            row["devices"] = verdicts
    return out


def all_tables() -> list[LoadedTable]:
    with STATE.lock:
        if STATE.tables is not None:
            return STATE.tables
    load_tables(None)
    with STATE.lock:
        return STATE.tables or []


def device_info(device: torch.device) -> Any:
    """DeviceInfo for a tensor's device, or a fallback reason (str) when tuned kernels cannot run on it."""
    from tunekit.measure.device import detect, interpret_mode

    if device.type == "cpu":
        # detect() describes the CPU exactly when the interpreter is on (or no GPU exists).
        return detect() if interpret_mode() else "interpreter_off"
    if device.type == "cuda":
        if interpret_mode():
            return "interpreter_on"
        return detect(device.index if device.index is not None else torch.cuda.current_device())
    return "device"


def tables_for(device: torch.device, dev_key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(merged table of the loaded tables whose stamp matches ``device``, reason if none)."""
    with STATE.lock:
        cached = STATE.device_tables.get(dev_key)
    if cached is not None:
        return cached
    tables = all_tables()
    usable = [lt for lt in tables if lt.table is not None]
    result: tuple[dict[str, Any] | None, str | None]
    if not tables:
        result = (None, "no_table")
    elif not usable:
        result = (None, "table_error")
    else:
        info = device_info(device)
        if isinstance(info, str):
            result = (None, info)
        else:
            entries: list[dict[str, Any]] = []
            seen: set[tuple] = set()
            matched = 0
            #: the fusions sections (the first table wins a group) and the tables without one
            fusions: dict[str, Any] = {}
            unmeasured: list[str] = []
            #: (op, dtype, n, k) -> TP size of the first table that holds it but was tuned for another TP
            other_tp: dict[tuple, int] = {}
            for lt in usable:
                diffs = table_mod.environment_mismatch(lt.table, info.as_dict())
                if diffs:
                    log_once(
                        f"mismatch:{lt.path}:{dev_key}", logging.WARNING,
                        "tunekit: table %s was tuned for another environment, vendor path for its shapes on %s: %s",
                        lt.path, dev_key, "; ".join(diffs),
                    )
                    continue
                tp = table_mod.table_tp(lt.table)
                if tp is not None and STATE.tp is not None and tp != STATE.tp:
                    log_once(f"tp:{lt.path}:{STATE.tp}", logging.WARNING,
                             "tunekit: table %s was tuned for tp=%d, this process serves tp=%d: vendor path for "
                             "its shapes (tune with tunekit search --tp %d)", lt.path, tp, STATE.tp, STATE.tp)
                    for entry in lt.table["entries"]:
                        other_tp.setdefault((entry["op"], entry["dtype"], entry["n"], entry["k"]), tp)
                    continue
                matched += 1
                if "fusions" in lt.table:
                    for group, decision in lt.table["fusions"].items():
                        fusions.setdefault(group, decision)
                else:
                    unmeasured.append(lt.path)
                for entry in lt.table["entries"]:
                    key = (entry["op"], entry["dtype"], entry["m"], entry["n"], entry["k"])
                    if key not in seen:  # the first path given wins a duplicate key
                        seen.add(key)
                        entries.append(entry)
            merged = {"entries": entries, "device": info, "other_tp": other_tp, "fusions": fusions,
                      "unmeasured": unmeasured}
            result = (merged, None) if matched or other_tp else (None, "env_mismatch")
    with STATE.lock:
        STATE.device_tables[dev_key] = result
    return result

def serving_table(device: str) -> dict[str, Any] | None:
    """The merged table that serves ``device``, or None (no usable table, or any error: never raises)."""
    try:
        merged, _ = tables_for(torch.device(device), str(torch.device(device)))
    except Exception:
        return None
    return merged


def other_tp(op: str, dtype: str, n: int, k: int, device: str) -> int | None:
    """The TP size of a loaded table that holds (op, dtype, N, K) for ``device`` but does not serve it here,
    being tuned for another TP size than :func:`set_tensor_parallel`'s; None if there is none. Never raises.

    For integrations that count why a layer keeps its own code: an eager vLLM layer the tables do not cover
    asks on every call, so the answer is cached per key until the tables or the TP size change."""
    key = (op, dtype, n, k, device, "other_tp")
    hit = STATE.largest.get(key)  # lock-free read (atomic under the GIL)
    if hit is None:
        epoch = STATE.epoch  # read first: a load_tables or set_tensor_parallel meanwhile leaves nothing cached
        merged = serving_table(device)
        hit = 0 if merged is None else merged.get("other_tp", {}).get((op, dtype, n, k), 0)
        with STATE.lock:
            if STATE.epoch == epoch:
                STATE.largest[key] = hit
    return hit or None


def covers(op: str, dtype: str, n: int | None, k: int, device: str) -> bool:
    """True if a table serving ``device`` has an entry for (op, dtype, N, K) at some M (``n=None``:
    at any N, for an op served from either row layout, as the gated norm). Never raises.

    For integrations that decide per layer (static: no M) whether to enter a
    tunekit op at all, where the op's vendor path would differ from theirs.
    An eager integration asks on every call: :func:`largest_m` caches the scan.
    """
    return largest_m(op, dtype, n, k, device) is not None


def largest_m(op: str, dtype: str, n: int | None, k: int, device: str) -> int | None:
    """The largest M a table serving ``device`` holds for (op, dtype, N, K) (``n=None``: at any N, as in
    :func:`covers`), or None. Every M up to it is served by a tuned entry (the lookup takes the
    smallest tabulated M at or above the call's); above it, the op's fallback. Never raises.

    For integrations that compile per token-count range (a range starting above it gains nothing
    from the op: ``tunekit.integrations.vllm.graph_routes``) or that know M per eager call; :func:`covers`
    is its "any M". Cached per key until the tables change: eager integrations ask on every call,
    and the scan is over every entry.
    """
    return _largest(op, dtype, n, k, device, "m")


def largest_rows(op: str, dtype: str, k: int, device: str) -> int | None:
    """The most K-wide rows one call of (op, dtype, any N, K) is served in by a tuned entry: the largest
    M x N / K of the entries, or None. Never raises.

    For an op whose calls come in either row layout, so that a call's M cannot be read from it: the
    gated norm, which vLLM 0.26's Qwen3.5 calls as [tokens * heads, head_dim] where the table holds
    [tokens, heads * head_dim] (``tunekit.dispatch.elementwise._gated_layout`` serves the same groups
    in the table's rows). A call of more rows is above every entry. Cached as :func:`largest_m`.
    """
    return _largest(op, dtype, None, k, device, "rows")


def _largest(op: str, dtype: str, n: int | None, k: int, device: str, unit: str) -> int | None:
    key = (op, dtype, n, k, device, unit)
    hit = STATE.largest.get(key)  # lock-free read (atomic under the GIL)
    if hit is None:
        with STATE.lock:
            tables = STATE.tables
        merged = serving_table(device)
        sizes = [] if merged is None else [
            e["m"] if unit == "m" else e["m"] * e["n"] // k for e in merged["entries"]
            if e["op"] == op and e["dtype"] == dtype and n in (None, e["n"]) and e["k"] == k]
        hit = max(sizes, default=0)
        with STATE.lock:
            if tables is not None and STATE.tables is tables:  # not cached across a load_tables in between
                STATE.largest[key] = hit
    return hit or None


def holds(op: str, device: str) -> bool:
    """Whether a table serving ``device`` holds any entry of ``op``. Never raises."""
    merged = serving_table(device)
    return any(e["op"] == op for e in (merged or {}).get("entries", ()))


def tabulated_ms(op: str, dtype: str, n: int, k: int, device: str) -> list[int]:
    """The Ms the tables serving ``device`` hold entries of (op, dtype, N, K) at, ascending. Never raises."""
    merged = serving_table(device)
    return sorted({int(e["m"]) for e in (merged or {}).get("entries", ())
                   if e["op"] == op and e["dtype"] == dtype and e["n"] == n and e["k"] == k})


def served_entry(op: str, dtype: str, m: int, n: int, k: int, device: str) -> dict[str, Any] | None:
    """The table entry that serves (op, dtype, M, N, K) on ``device`` (the lookup rule of the ops:
    exact M, else the smallest tabulated larger M), or None for the vendor path. Never raises.

    For callers that choose per call site between a tunekit op and their own
    (faster than the op's fallback) path, such as ``tunekit.evidence.chain``.
    """
    merged = serving_table(device)
    return None if merged is None else table_mod.lookup(merged, op, dtype, m, n, k)

