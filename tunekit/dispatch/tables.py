"""The dispatch tables being served: loading, and per device one index of what serves it.

Call protocol: :func:`load_tables` replaces the served tables (``None``
reads ``TUNEKIT_TABLE``, through ``index.table_paths``, its one reader; the
first use of any table loads it lazily), and forgets every cached decision.
:func:`tables_for` gives, per device, the :class:`~tunekit.dispatch.index.TableIndex`
of the loaded tables whose environment stamp and TP size match (first path
wins a duplicate key), or the fallback reason when none does; it is built
once per device key and TP size (cached in ``STATE.device_tables``, cleared
on a load or a TP change). :func:`covers`, :func:`largest_m`,
:func:`served_entry` ... answer integrations that decide per layer or per
call site before entering a tunekit op, from that same index; :func:`host_index`
is the index a caller that must not touch the GPU reads (the vLLM plugin's
compile ranges), and :func:`check_shipped` the load that checks the shipped
tables where a caller chooses (the plugin's worker). Nothing here raises
for a broken table: it is logged once and served as absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from tunekit import shipped
from tunekit import table as table_mod
from tunekit.dispatch import index as index_mod
from tunekit.dispatch.index import TableIndex, table_paths
from tunekit.dispatch.markers import maybe_register_atexit
from tunekit.dispatch.state import STATE, LoadedTable, log_once


def load_tables(paths: str | os.PathLike | Sequence[str | os.PathLike] | None,
                strict: bool = False) -> list[dict[str, Any]]:
    """Serve ``paths`` (a list, or one ``:``-separated string); ``None`` reads ``TUNEKIT_TABLE`` again.

    Replaces the tables loaded before and forgets every cached decision (the
    dispatch markers are kept). A table that cannot be loaded is logged once
    and served as absent (``fallback:table_error``); this function itself
    never raises, unless ``strict``: then the first table that cannot be read
    raises its ``tunekit.table.TableError``, nothing logged and the tables
    served before kept (a caller that hands the error to its user, once:
    ``tunekit.patch``). Returns :func:`loaded_tables`.
    """
    _serve(_read(paths, strict=strict))
    return loaded_tables()


def _serve(loaded: list[LoadedTable]) -> None:
    with STATE.lock:
        STATE.tables = loaded
        _forget_decisions()
        STATE.built.clear()  # other tables: other kernels
    maybe_register_atexit()  # TUNEKIT_DISPATCH_LOG may have been set since import tunekit.ops


def check_shipped(paths: str | os.PathLike | Sequence[str | os.PathLike] | None = None
                  ) -> tuple[int, str, str] | None:
    """Serve ``paths`` (None: ``TUNEKIT_TABLE``'s) as :func:`load_tables` does, the shipped tables among them
    (``auto``) checked on this device now (``dispatch.auto``); the check's one line is returned, not logged.

    For an integration that names the tables where no GPU work may happen (the vLLM plugin's register, in
    every process) and serves them where the device is set (its worker, after the weights load, before the
    first forward): it logs the line in its own log. None where ``paths`` name no shipped table (nothing is
    loaded then); else (the line's level: INFO where every entry was kept, else WARNING; the line; a digest
    of what the check kept: the served shipped tables' paths and entries, for a compile-cache key). Never
    raises."""
    if not any(shipped.is_shipped(p) for p in _parts(paths)):
        return None
    heard: list[tuple[int, str]] = []
    loaded = _read(paths, log=lambda level, line: heard.append((level, line)))
    _serve(loaded)
    kept = [[lt.path, [e.to_json() for e in table_mod.entries(lt.table)]] for lt in loaded
            if lt.table is not None and shipped.is_shipped(lt.path)]
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()
    level, line = heard[-1] if heard else (logging.ERROR, "tunekit: auto tables: not checked, nothing served from them")
    return level, line, digest


def _parts(paths: str | os.PathLike | Sequence[str | os.PathLike] | None) -> list[str]:
    if paths is None or isinstance(paths, (str, os.PathLike)):
        return table_paths(None if paths is None else str(paths))
    return [q for p in paths for q in (table_paths(str(p)) if str(p).strip() == shipped.AUTO else [str(p)])]


def _read(paths: str | os.PathLike | Sequence[str | os.PathLike] | None,
          check_shipped: bool = True, log: Any = None, strict: bool = False) -> list[LoadedTable]:
    """Every table of ``paths`` read and validated (``tunekit.table.load``), or the error why not (logged once):
    the one place serving reads table files. The shipped tables among them (``auto``) are checked on this
    device (``dispatch.auto``: a foreign GPU's refused, each entry verified; its line logged, or handed to
    ``log(level, line)``) unless ``check_shipped`` is off (a caller that must not touch the GPU: they are then
    read as stamped)."""
    loaded = []
    for path in _parts(paths):
        try:
            with index_mod.no_collection():
                loaded.append(LoadedTable(path, table_mod.load(path)))
        except Exception as exc:  # serving never raises: a broken table is a vendor path + one log line
            if strict:
                raise exc if isinstance(exc, table_mod.TableError) else table_mod.TableError(f"{path}: {exc}") from exc
            loaded.append(LoadedTable(path, None, str(exc)))
            log_once(f"table-error:{path}", logging.ERROR, "tunekit: table %s not used: %s", path, exc)
    mine = {id(lt) for lt in loaded if lt.table is not None and shipped.is_shipped(lt.path)}
    if check_shipped and mine:
        from tunekit.dispatch import auto

        try:
            served = dict(auto.check([(lt.path, lt.table) for lt in loaded if id(lt) in mine], log))
        except Exception as exc:  # noqa: BLE001 - serving never raises: the shipped tables are then not served
            served = {}
            log_once(f"auto-error:{exc}", logging.ERROR, "tunekit: the shipped tables not used: %s", exc)
            if log is not None:
                log(logging.ERROR, f"tunekit: auto tables: the check failed ({exc}): nothing served from them")
        loaded = [LoadedTable(lt.path, served[lt.path]) if id(lt) in mine else lt for lt in loaded
                  if id(lt) not in mine or lt.path in served]
    return loaded


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
    STATE.defaults.clear()


def loaded_tables() -> list[dict[str, Any]]:
    """The tables being served: path, entries, load error and, per device seen so far, the stamp verdict."""
    tables = all_tables()
    out = []
    for lt in tables:
        row: dict[str, Any] = {"path": lt.path, "entries": len(table_mod.entries(lt.table)) if lt.table else 0,
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


def _warn(dev_key: str) -> Any:
    def warn(kind: str, path: str, detail: Any) -> None:
        if kind == "env":
            log_once(f"mismatch:{path}:{dev_key}", logging.WARNING,
                     "tunekit: table %s was tuned for another environment, vendor path for its shapes on %s: %s",
                     path, dev_key, detail)
        else:
            log_once(f"tp:{path}:{STATE.tp}", logging.WARNING,
                     "tunekit: table %s was tuned for tp=%d, this process serves tp=%d: vendor path for its shapes "
                     "(tune with tunekit search --tp %d)", path, detail, STATE.tp, STATE.tp)
    return warn


def tables_for(device: torch.device, dev_key: str) -> tuple[TableIndex | None, str | None]:
    """(the index of the loaded tables that serve ``device`` at this process's TP size, reason if none)."""
    cached = STATE.device_tables.get(dev_key)  # lock-free read (atomic under the GIL)
    if cached is not None:
        return cached
    all_tables()  # the lazy first load of TUNEKIT_TABLE, if none happened yet
    with STATE.lock:  # one snapshot: a load or a TP change after it leaves this index uncached
        epoch, tables = STATE.epoch, STATE.tables or []
    usable = [(lt.path, lt.table) for lt in tables if lt.table is not None]
    result: tuple[TableIndex | None, str | None]
    if not tables:
        result = (None, "no_table")
    elif not usable:
        result = (None, "table_error")
    else:
        info = device_info(device)
        if isinstance(info, str):
            result = (None, info)
        elif device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # the load check runs kernels and reads their outputs back: never inside a capture (vLLM's
            # warm-up, dispatch.warmup, builds this index before capturing). Under a capture the index is
            # read for routing only (no kernel is built inside one: decisions, elementwise_fallback), so it
            # is served unchecked and not cached: the next eager call checks the tables and caches the index
            return index_mod.build(usable, info, STATE.tp, _warn(dev_key))
        else:
            result = index_mod.build(_load_checked(usable, info), info, STATE.tp, _warn(dev_key))
    with STATE.lock:
        if STATE.epoch == epoch:
            STATE.device_tables[dev_key] = result
    return result


def _load_checked(usable: list[tuple[str, Any]], info: Any) -> list[tuple[str, Any]]:
    """``usable`` with the entries that fail the load check on this device dropped (``dispatch.load_check``):
    every table stamped for this device but the shipped ones, which ``dispatch.auto`` checked when they were
    read. The check's one line is logged once per load and device (WARNING where an entry was dropped)."""
    from tunekit.dispatch import load_check

    mine = [i for i, (path, table) in enumerate(usable)
            if not shipped.is_shipped(path) and not index_mod.mismatch(table, info)]
    if not mine or not load_check.enabled(info):
        return usable
    checked, dropped = load_check.check([usable[i] for i in mine], info)
    out = list(usable)
    for i, pair in zip(mine, checked, strict=True):
        out[i] = pair
    log_once(f"load-check:{STATE.epoch}:{info.torch_device}", logging.WARNING if dropped else logging.INFO, "%s",
             load_check.LAST[0])
    return out


def host_index(tp: int | None = None, paths: Sequence[str] | None = None) -> TableIndex | None:
    """The index of the tables ``paths`` names (None: the served ones, ``TUNEKIT_TABLE``'s unless
    :func:`load_tables` named others; the served ones are reused where they are these) at TP size ``tp``
    for this host, built without touching a GPU: the stamps are checked against the device where torch
    knows it already (the interpreter, a CPU-only host, CUDA already initialised), else against the software
    only (torch, Triton, the kernel sources: the GPU's own fields are the ops' to check at their first call).
    The shipped tables (``auto``) not yet checked by a load count unchecked, every entry whatever its stamp
    (``index.stamped_here``): their check builds every entry on the device, work a caller here must not do,
    and it only drops entries, so this index holds at least what they will serve. None where no table
    serves. Never raises. For callers that run before any GPU work (the vLLM plugin's compile ranges, at
    vLLM's config time)."""
    try:
        from tunekit.measure.device import detect, interpret_mode

        info = None
        if interpret_mode() or not torch.cuda.is_available():
            info = detect()
        elif torch.cuda.is_initialized():
            info = detect(torch.cuda.current_device())
        with STATE.lock:
            served = STATE.tables
        fresh = False
        if served is not None and (paths is None or [lt.path for lt in served] == [str(p) for p in paths]):
            tables = served  # loaded by the ops: the shipped ones among them were checked then
        else:
            tables, fresh = _read(None if paths is None else list(paths), check_shipped=False), True
        usable = [(lt.path, index_mod.stamped_here(lt.table, info) if fresh and shipped.is_shipped(lt.path)
                   else lt.table) for lt in tables if lt.table is not None]
        index, _ = index_mod.build(usable, info, tp) if usable else (None, None)
        return index
    except Exception:  # noqa: BLE001 - the ops log a broken table once, at their first call
        return None


def serving_table(device: str) -> TableIndex | None:
    """The index that serves ``device`` ("cuda:0", "cpu"), or None (no usable table, or any error: never
    raises). Integrations ask per layer call: a device seen before costs one dict access."""
    cached = STATE.device_tables.get(device)  # lock-free read (atomic under the GIL)
    if cached is not None:
        return cached[0]
    try:
        index, _ = tables_for(torch.device(device), str(torch.device(device)))
    except Exception:
        return None
    return index


def other_tp(op: str, dtype: str, n: int, k: int, device: str) -> int | None:
    """The TP size of a loaded table that holds (op, dtype, N, K) for ``device`` but does not serve it here,
    being tuned for another TP size than :func:`set_tensor_parallel`'s; None if there is none. Never raises.

    For integrations that count why a layer keeps its own code (an eager vLLM layer the tables do not cover
    asks on every call: two dict accesses)."""
    index = serving_table(device)
    return None if index is None else index.other_tp.get((op, dtype, n, k))


def covers(op: str, dtype: str, n: int | None, k: int, device: str) -> bool:
    """True if a table serving ``device`` has an entry for (op, dtype, N, K) at some M (``n=None``:
    at any N, for an op served from either row layout, as the gated norm). Never raises.

    For integrations that decide per layer (static: no M) whether to enter a
    tunekit op at all, where the op's vendor path would differ from theirs.
    """
    return largest_m(op, dtype, n, k, device) is not None


def largest_m(op: str, dtype: str, n: int | None, k: int, device: str) -> int | None:
    """The largest M a table serving ``device`` holds for (op, dtype, N, K) (``n=None``: at any N, as in
    :func:`covers`), or None. Every M up to it is served by a tuned entry (the lookup takes the
    smallest tabulated M at or above the call's); above it, the op's fallback. Never raises.

    For integrations that compile per token-count range (a range starting above it gains nothing
    from the op: ``tunekit.integrations.vllm.graph_routes``) or that know M per eager call; :func:`covers`
    is its "any M". Two dict accesses: eager integrations ask on every call.
    """
    index = serving_table(device)
    return None if index is None else index.largest_m(op, dtype, n, k)


def largest_rows(op: str, dtype: str, k: int, device: str) -> int | None:
    """The most K-wide rows one call of (op, dtype, any N, K) is served in by a tuned entry: the largest
    M x N / K of the entries, or None. Never raises.

    For an op whose calls come in either row layout, so that a call's M cannot be read from it: the
    gated norm, which vLLM 0.26's Qwen3.5 calls as [tokens * heads, head_dim] where the table holds
    [tokens, heads * head_dim] (``tunekit.dispatch.elementwise._gated_layout`` serves the same groups
    in the table's rows). A call of more rows is above every entry.
    """
    index = serving_table(device)
    return None if index is None else index.largest_rows(op, dtype, k)


def holds(op: str, device: str) -> bool:
    """Whether a table serving ``device`` holds any entry of ``op``. Never raises."""
    index = serving_table(device)
    return index is not None and index.holds(op)


def tabulated_ms(op: str, dtype: str, n: int, k: int, device: str) -> list[int]:
    """The Ms the tables serving ``device`` hold entries of (op, dtype, N, K) at, ascending. Never raises."""
    index = serving_table(device)
    return [] if index is None else list(index.ms(op, dtype, n, k))


def served_entry(op: str, dtype: str, m: int, n: int, k: int, device: str) -> table_mod.Entry | None:
    """The table entry that serves (op, dtype, M, N, K) on ``device`` (the lookup rule of the ops:
    exact M, else the smallest tabulated larger M), or None for the vendor path. Never raises.

    For callers that choose per call site between a tunekit op and their own
    (faster than the op's fallback) path, such as ``tunekit.evidence.chain``.
    """
    index = serving_table(device)
    return None if index is None else index.lookup(op, dtype, m, n, k)
