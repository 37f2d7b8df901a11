"""The fusion phase: each layer group's fusion decided by timing what serving would run, fused and unfused.

After the final re-measure the table's entries are known (``table.build_table`` of the final rows). For
each group of :func:`tunekit.table_fusions.model_groups` whose fused op the run searched (``gemv_add``
groups first: a folded norm's residual add is free only where its writers' epilogue takes it), at every M
of the run's GEMV problems, the worker times two sequences interleaved in one session
(:mod:`~tunekit.search.sequences`), each step as the table serves it: its entry (the lookup rule of
``table.lookup``, the entry's config accepted at that M), else the stock path (``vendor`` for a GEMV; for
a norm the fastest stock baseline its final re-measure timed, else Inductor where it runs, else vendor).

* ``rms_gemv`` / ``sibling_rms_gemv``: ``rms_gemv`` on each consumer (the joined rows of siblings), plus the
  residual add where it stays standalone, against the norm in the form the model runs it plus each
  consumer's ``gemv``;
* ``gemv_add``: ``gemv_add`` against ``gemv`` then the add.

An M where the fused op has no entry is not timed and counts against the group
(``table_fusions.decide``). The seeds of ``--seed-from`` only choose what the studies measure first: the
entries and this decision are this run's measurements, on this device, whatever the seed table says.

Each measurement is kept in ``RUN/fusions.json`` under the steps it timed (with the groups and the device
stamp), so a rerun that serves the same entries reads it instead of timing it again, and ``tunekit
export`` decides again for the entries of its table (a group whose steps changed with another
``--min-gain`` has no figure there: not fused, saying so).

Call protocol::

    section = fusion_phase(run, ctx)                              # engine, after the finals
    section = redecide(run_dir, table, rows, device, problems)    # export: for another table of the same run
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tunekit import backends as backend_registry
from tunekit import table as table_mod
from tunekit.problems.shapes import Problem
from tunekit.search.stops import STOPS
from tunekit.table_fusions import NORM_FORMS, FusionGroup, Measured, describe, record

FUSIONS_FILE = "fusions.json"
FORMAT = "tunekit.fusions/1"
#: interleaved rounds of the two sequences (the final re-measure's figure)
FUSION_REPEATS = 30
#: the GEMV-family ops whose Ms a fusion must pay at: a fold serves them all
GEMV_OPS = ("gemv", "rms_gemv", "gemv_add")

Step = dict[str, Any]


def searched_groups(groups: Sequence[FusionGroup], problems: Sequence[Problem]) -> list[FusionGroup]:
    """The groups whose fused op the run searched at some M (the others: no decision here), ``gemv_add``
    first."""
    have = {(p.op, p.dtype, p.n, p.k) for p in problems}
    found = [g for g in groups if any((g.fused_op, g.dtype, n, k) in have for n, k in g.fused_shapes)]
    return sorted(found, key=lambda g: g.family != "gemv_add")


def group_ms(problems: Sequence[Problem]) -> list[int]:
    """Every M the table covers: the Ms of the run's GEMV-family problems."""
    return sorted({p.m for p in problems if p.op in GEMV_OPS})


def _step(op: str, dtype: str, m: int, n: int, k: int, backend: str, params: dict[str, Any] | None = None) -> Step:
    return {"op": op, "dtype": dtype, "m": m, "n": n, "k": k, "backend": backend, "params": dict(params or {})}


def label(step: Step) -> str:
    """``op NxK@backend`` (a norm or the add: its width)."""
    shape = f"{step['n']}x{step['k']}" if step["op"] in GEMV_OPS else str(step["n"])
    return f"{step['op']} {shape}@{step['backend']}" if step["op"] != "add" else f"add {shape}"


class Planner:
    """The steps serving would run for a group at one M, from the table's entries and the final rows."""

    def __init__(self, table: dict[str, Any], rows: Sequence[dict[str, Any]], device: dict[str, Any]) -> None:
        self.table = table
        self.stock = {(r["op"], r["dtype"], int(r["m"]), int(r["n"]), int(r["k"])): r.get("baseline")
                      for r in rows if r.get("baseline")}
        self.device = device
        #: gemv_add groups decided so far: (dtype, N, K) -> the Ms serving runs the epilogue at
        self.fused_adds: dict[tuple[str, int, int], frozenset[int]] = {}

    def served(self, op: str, dtype: str, m: int, n: int, k: int) -> Step | None:
        """The entry serving (op, M, N, K) as a step (its config accepted at M), else None."""
        entry = table_mod.lookup(self.table, op, dtype, m, n, k)
        if entry is None:
            return None
        name = entry.backend
        try:
            why = table_mod.params_problem(backend_registry.get(name), name, Problem(op, dtype, m, n, k),
                                           dict(entry.params), need_space=False)
        except Exception as exc:  # noqa: BLE001 - a backend that does not load here serves nothing
            why = str(exc)
        return None if why is not None else _step(op, dtype, m, n, k, name, entry.params)

    def _stock_norm(self, op: str, dtype: str, m: int, width: int) -> Step:
        name = self.stock.get((op, dtype, m, width, width))
        if name is None:
            from tunekit.measure.device import DeviceInfo

            try:
                inductor = backend_registry.get("inductor").unavailable_reason(DeviceInfo(**self.device)) is None
            except Exception:  # noqa: BLE001 - no Inductor here: the eager composition
                inductor = False
            name = "inductor" if inductor else "vendor"
        return _step(op, dtype, m, width, width, name)

    def steps(self, group: FusionGroup, m: int) -> tuple[list[Step], list[Step]] | str:
        """(fused steps, unfused steps) of ``group`` at ``m``, or why the fused sequence cannot be served."""
        dtype = group.dtype
        fused: list[Step] = []
        for n, k in group.fused_shapes:
            step = self.served(group.fused_op, dtype, m, n, k)
            if step is None:
                return (f"no {group.fused_op} entry serves {n}x{k} at M={m} (the fusion would run its unfused "
                        "fallback there)")
            fused.append(step)
        unfused = [self.served("gemv", dtype, m, n, k) or _step("gemv", dtype, m, n, k, "vendor")
                   for n, k in group.consumers]
        if group.family == "gemv_add":
            (n, k), = group.consumers
            return fused, unfused + [_step("add", dtype, m, n, n, "torch")]
        width = group.consumers[0][1]
        norm_op = group.norm_op or group.norm or "rms_norm"
        norm = self.served(norm_op, dtype, m, width, width) or self._stock_norm(norm_op, dtype, m, width)
        if norm_op in NORM_FORMS.values() and not (group.writers and all(
                m in self.fused_adds.get((dtype, n, k), ()) for n, k in group.writers)):
            fused.append(_step("add", dtype, m, width, width, "torch"))  # the add the fold leaves, on its own
        return fused, [norm] + unfused


def _cache_key(fused: list[Step], unfused: list[Step]) -> str:
    return json.dumps({"fused": fused, "unfused": unfused}, sort_keys=True)


def _read(run_dir: Path) -> dict[str, Any]:
    path = run_dir / FUSIONS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == FORMAT else {}


def _write(run_dir: Path, stamp: str, groups: Sequence[FusionGroup], measured: dict[str, Any]) -> None:
    from tunekit.search.results import _atomic_write_text

    doc = {"format": FORMAT, "stamp": stamp, "groups": [g.as_dict() for g in groups], "measured": measured}
    _atomic_write_text(run_dir / FUSIONS_FILE, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def decide_all(groups: Sequence[FusionGroup], ms: Sequence[int], planner: Planner,
               measure: Callable[[list[Step], list[Step]], Measured]) -> dict[str, Any]:
    """The ``fusions`` section: each group's steps per M, measured by ``measure`` (or why not), decided."""
    section: dict[str, Any] = {}
    for group in groups:
        per_m: dict[int, Measured] = {}
        for m in ms:
            steps = planner.steps(group, m)
            if isinstance(steps, str):
                per_m[m] = Measured(note=steps)
                continue
            got = measure(*steps)
            got.fused, got.unfused = [label(s) for s in steps[0]], [label(s) for s in steps[1]]
            per_m[m] = got
        section[group.key] = rec = record(group, per_m)
        if group.family == "gemv_add":
            (n, k), = group.consumers
            planner.fused_adds[(group.dtype, n, k)] = frozenset(rec["fused_m"])
    return section


def fusion_phase(run: Any, ctx: Any) -> dict[str, Any]:
    """Measure and decide every group the run searched (none: an empty section, as for a ``--shape`` search,
    which knows no layer groups); the measurements go to ``RUN/fusions.json`` as they come."""
    from tunekit.search.finals import final_rows

    cfg = run.cfg
    groups = searched_groups(cfg.fusion_groups, cfg.problems)
    rows = final_rows(run)
    table = table_mod.build_table(rows, run.device, run.probe, cfg.min_gain, run.usable, tp=cfg.tp)
    stored = _read(cfg.out_dir)
    measured: dict[str, Any] = dict(stored.get("measured", {})) if stored.get("stamp") == run.stamp else {}
    known = [FusionGroup.from_dict(g) for g in stored.get("groups", [])] if stored.get("stamp") == run.stamp else []
    keep = list({g.key: g for g in [*known, *groups]}.values())

    def measure(fused: list[Step], unfused: list[Step]) -> Measured:
        key = _cache_key(fused, unfused)
        if key not in measured:
            STOPS.check()
            reply = ctx.worker.call({"kind": "sequences", "arms": {"fused": fused, "unfused": unfused},
                                     "repeats": FUSION_REPEATS}, timeout=max(cfg.trial_timeout_s, 300))
            if reply.get("status") != "ok":
                error = " ".join(str(reply.get("error")).split())[:300]
                run.bar.log(f"fusion measurement failed ({label(fused[0])}): {error}")
                return Measured(note=f"not measured: {error}")
            timings = reply["timings"]
            measured[key] = {arm: timings[arm]["time_us"] for arm in ("fused", "unfused")}
            _write(cfg.out_dir, run.stamp, keep, measured)
        return Measured(measured[key]["fused"], measured[key]["unfused"])

    ms = group_ms(cfg.problems)
    if groups:
        run.bar.log(f"fusions: {len(groups)} layer group(s) at M={','.join(map(str, ms))}, each fused sequence timed "
                    "against the unfused one serving would run")
    section = decide_all(groups, ms, Planner(table, rows, run.device), measure)
    _write(cfg.out_dir, run.stamp, keep, measured)
    for key, rec in section.items():
        run.bar.log(f"fusions: {describe(key, rec)}")
    return section


def redecide(run_dir: Path, table: dict[str, Any], rows: Sequence[dict[str, Any]], device: dict[str, Any],
             problems: Sequence[Problem]) -> dict[str, Any] | None:
    """The ``fusions`` section for ``table`` (``tunekit export``) from the run's stored measurements: a group
    whose steps at some M were never timed (other entries: another ``--min-gain``) is not fused there,
    saying so. None for a run folder without ``fusions.json`` (searched before fusions were measured)."""
    stored = _read(run_dir)
    if not stored:
        return None
    measured = stored.get("measured", {})
    groups = searched_groups([FusionGroup.from_dict(g) for g in stored.get("groups", [])], problems)

    def lookup(fused: list[Step], unfused: list[Step]) -> Measured:
        got = measured.get(_cache_key(fused, unfused))
        if got is None:
            return Measured(note="not measured with this table's entries (the search timed others): run the "
                                 "search again to measure it")
        return Measured(got["fused"], got["unfused"])

    return decide_all(groups, group_ms(problems), Planner(table, rows, device), lookup)
