"""The figures of one run's final re-measure: per problem the baselines and each tuned backend's best, per M
the per-token prediction.

Call protocol: ``load_comparison(run_dir)`` reads RUN/run.json and RUN/final.csv into a :class:`Comparison`;
``tunekit.evidence.compare`` prints it and writes report.md, ``tunekit.evidence.plots`` draws it. Imports
neither rich nor matplotlib; torch (through ``tunekit.problems.opspec``) only inside ``load_comparison``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunekit.errors import UserError

#: Tuned families always given a column (``-`` when absent); plugin backends are appended.
REPORT_BACKENDS = ("triton", "hip")


def baseline_names() -> tuple[str, ...]:
    """The baselines' backend names (vendor, inductor): measured with every problem, never tabulated."""
    from tunekit.backends import BASELINES

    return BASELINES


@dataclass(frozen=True)
class Measure:
    """One candidate of one problem as re-measured in final.csv."""

    label: str
    backend: str
    time_us: float
    gbps: float
    pct_of_limit: float | None
    speedup: float  # baseline time / this time, same interleaved session (baseline: ProblemResult.baseline)
    params: str = ""  # the candidate's config (JSON, as final.csv holds it; empty for baselines)


@dataclass(frozen=True)
class ProblemResult:
    """A problem's baselines and the best candidate of each tuned backend.

    ``vendor`` is the vendor path (cuBLAS; the eager composition for elementwise
    ops); ``baselines`` the other baselines measured (Inductor); ``baseline``
    the fastest of them all, against which speedups are taken and which the
    dispatch table must beat (as tunekit.table does). For GEMV runs there is
    only vendor, so ``baseline`` is ``vendor``.
    """

    op: str
    dtype: str
    m: int
    n: int
    k: int
    count: int
    names: str
    weight_bytes: int  # weight bytes streamed per call
    bytes_moved: int  # bytes one call must move (the GB/s numerator)
    vendor: Measure
    best: dict[str, Measure]  # tuned backend -> its fastest candidate
    baselines: dict[str, Measure] = field(default_factory=dict)  # other baselines (Inductor) -> time
    limit_gbps: float | None = None  # the measured limit of this op (read for GEMV, copy for elementwise)

    @property
    def label(self) -> str:
        if self.op == "gemv":
            return f"m{self.m} {self.n}x{self.k}"
        from tunekit.problems.shapes import Problem

        return f"m{self.m} {Problem(self.op, self.dtype, self.m, self.n, self.k).shape_text}"

    @property
    def plot_label(self) -> str:
        """``label`` with the op named where it is not a GEMV (plots mix ops on one axis)."""
        return self.label if self.op == "gemv" else f"{self.op} {self.label}"

    @property
    def baseline(self) -> Measure:
        """The fastest baseline (vendor wins ties)."""
        return min([self.vendor, *self.baselines.values()], key=lambda x: x.time_us)

    @property
    def winner(self) -> Measure:
        """Fastest of all candidates, baselines included (vendor wins ties)."""
        return min([self.vendor, *self.baselines.values(), *self.best.values()], key=lambda x: x.time_us)

    def served_us(self, backend: str | None = None) -> float:
        """What a dispatch table serves: min(best tuned, fastest baseline), over all backends or one."""
        tuned = [m.time_us for b, m in self.best.items() if backend is None or b == backend]
        return min([self.baseline.time_us, *tuned])


@dataclass(frozen=True)
class TokenPrediction:
    """Per-token time of the problems of one M (sum of count x time), in microseconds."""

    m: int
    calls: int
    vendor_us: float
    tuned_us: float
    only_us: dict[str, float]  # backend -> tuned with that backend alone
    floor_us: float | None  # every call at the read limit

    @property
    def speedup(self) -> float:
        """Local speedup s of the linear part: vendor / tuned."""
        return self.vendor_us / self.tuned_us


@dataclass
class Comparison:
    """Everything ``tunekit compare`` prints and writes for one run folder."""

    run_dir: Path
    meta: dict[str, Any]
    timing_kind: str
    backends: list[str]  # report columns: REPORT_BACKENDS + plugin backends found
    problems: list[ProblemResult]
    tokens: list[TokenPrediction]
    notes: list[str] = field(default_factory=list)

    @property
    def read_gbps(self) -> float | None:
        return self.meta.get("probe", {}).get("read_gbps") or None

    @property
    def present(self) -> list[str]:
        """Tuned backends with at least one re-measured candidate."""
        return [b for b in self.backends if any(b in p.best for p in self.problems)]

    @property
    def gpu(self) -> str:
        device = self.meta.get("device", {})
        return f"{device.get('name', '?')} ({device.get('arch', '?')})"

    @property
    def is_interpreter(self) -> bool:
        return "cpu" in (self.timing_kind, self.meta.get("probe", {}).get("kind"))


def _measure(row: dict[str, Any], limit_gbps: float | None, base_us: float, cpu: bool = False) -> Measure:
    # CPU interpreter rows carry a % of a CPU "limit": no bandwidth meaning, not shown
    pct = None if cpu else row.get("pct_of_limit")
    if pct is None and limit_gbps:
        pct = 100.0 * float(row["gbps"]) / limit_gbps
    time_us = float(row["time_us"])
    params = row.get("params")
    return Measure(str(row["label"]), str(row["backend"]), time_us, float(row["gbps"]),
                   None if pct is None else float(pct), base_us / time_us,
                   params if isinstance(params, str) and params not in ("", "{}") else "")


def read_final_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of RUN/final.csv; [] where the final re-measure wrote none."""
    from pandas.errors import EmptyDataError

    from tunekit.search import results

    try:
        return results.read_final(run_dir)
    except EmptyDataError:
        return []


def load_comparison(run_dir: Path) -> Comparison:
    """Read RUN/run.json and RUN/final.csv into per-problem results and per-token predictions.

    Only final.csv figures are used (one interleaved session per problem). Rows of
    problems not listed in run.json (left by an earlier search into the same
    folder) are left out so one report never mixes runs.
    """
    from tunekit.problems.shapes import Problem
    from tunekit.search import results

    run_dir = Path(run_dir)
    meta = results.read_run_json(run_dir)
    rows = read_final_rows(run_dir)
    if not rows:
        raise UserError(f"{run_dir}/final.csv has no rows: the final re-measure produced nothing to compare")
    from tunekit.problems import opspec  # bytes per call, the GB/s numerator (imports torch: after the user errors)
    wanted = {(p["op"], p["dtype"], int(p["m"]), int(p["n"]), int(p["k"])) for p in meta.get("problems", [])}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["op"], row["dtype"], int(row["m"]), int(row["n"]), int(row["k"]))
        groups.setdefault(key, []).append(row)
    notes = []
    if wanted:
        stale = [key for key in groups if key not in wanted]
        missing = [key for key in wanted if key not in groups]
        if stale:
            notes.append(f"left out {len(stale)} problem(s) of final.csv not in run.json (an earlier search)")
        if missing:
            notes.append(f"{len(missing)} problem(s) of run.json have no final re-measure: not in the sums")
        groups = {key: value for key, value in groups.items() if key in wanted}
    probe = meta.get("probe", {})
    cpu = probe.get("kind") == "cpu"  # interpreter timings: no % of limit, no floor
    baselines = baseline_names()
    problems = []
    for (op, dtype, m, n, k), group in groups.items():
        vendor_row = next((r for r in group if r["backend"] == "vendor"), None)
        if vendor_row is None:
            raise UserError(f"{run_dir}/final.csv: problem {op} m{m} {n}x{k} has no vendor row")
        try:
            spec = opspec.get(op)
        except KeyError as exc:
            raise UserError(f"{run_dir}/final.csv: {exc.args[0]}") from None
        # % of limit against the op's own limit: read bandwidth for GEMV, copy for elementwise
        limit_gbps = None if cpu else probe.get(f"{spec.limit}_gbps") or None
        # speedups against the fastest baseline, as the engine and the dispatch table take them
        base_us = min(float(r["time_us"]) for r in group if r["backend"] in baselines)
        best: dict[str, Measure] = {}
        others: dict[str, Measure] = {}
        for row in group:
            if row["backend"] == "vendor":
                continue
            cand = _measure(row, limit_gbps, base_us, cpu)
            pool = others if cand.backend in baselines else best
            if cand.backend not in pool or cand.time_us < pool[cand.backend].time_us:
                pool[cand.backend] = cand
        nbytes = spec.bytes_moved(Problem(op, dtype, m, n, k))
        problems.append(ProblemResult(op, dtype, m, n, k, int(vendor_row["count"] or 1),
                                      str(vendor_row.get("names") or ""), Problem(op, dtype, m, n, k).weight_bytes,
                                      nbytes, _measure(vendor_row, limit_gbps, base_us, cpu), best, others, limit_gbps))
    found = {b for p in problems for b in p.best}
    backends = list(REPORT_BACKENDS) + sorted(found - set(REPORT_BACKENDS))
    kinds = sorted({str(r.get("timing_kind") or "?") for g in groups.values() for r in g})
    comp = Comparison(run_dir, meta, "+".join(kinds), backends, problems, [], notes)
    comp.tokens = [_token(m, [p for p in problems if p.m == m], comp.present)
                   for m in sorted({p.m for p in problems})]
    return comp


def _token(m: int, problems: list[ProblemResult], backends: list[str]) -> TokenPrediction:
    only = {b: sum(p.count * p.served_us(b) for p in problems) for b in backends}
    # each problem at its own limit (read for GEMV, copy for elementwise ops)
    limits = [p.limit_gbps for p in problems]
    floor = (sum(p.count * p.bytes_moved / (p.limit_gbps * 1e3) for p in problems)
             if problems and all(limits) else None)
    return TokenPrediction(m, sum(p.count for p in problems), sum(p.count * p.baseline.time_us for p in problems),
                           sum(p.count * p.served_us() for p in problems), only, floor)


# ---- formatting, shared by the report's tables and its plots -------------------------------------

def format_value(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` in ``spec`` with ``suffix``; ``-`` for None."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_gbps(value: float | None) -> str:
    """GB/s: whole numbers on a GPU, three digits for the tiny CPU-interpreter figures."""
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.3g}"
