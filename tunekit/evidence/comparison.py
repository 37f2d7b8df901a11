"""The figures of one run's final re-measure: per problem the baselines, the peers and each tuned backend's
best, per M the per-token prediction.

Baselines are the backends of kind "baseline" (``tunekit.backends.BASELINES``). ``vendor`` is the stock path;
every other baseline is a **peer** (Inductor, and any other kernel a user could pick instead of tunekit's:
vLLM's skinny GEMM, FlashInfer), timed in the same interleaved session. Where no table entry serves, the
serving stack runs its own path, the fastest of :data:`STOCK_BASELINES` measured; the dispatch table admits
a tuned kernel where it beats that stock path (``tunekit.table``; a peer is reported, not a bar: the plugin
never falls back to a peer), so "tuned" here is the best tuned candidate where it beats the stock path and
the stock path elsewhere; "tuned over the best peer" says where a peer would still have been faster. Per
token the problems are summed over the path the plugin serves, each layer once
(``tunekit.evidence.served_path``).

Call protocol: ``load_comparison(run_dir)`` reads RUN/run.json and RUN/final.csv into a :class:`Comparison`;
``tunekit.evidence.compare`` prints it and writes report.md, ``tunekit.evidence.plots`` draws it. Imports
neither rich nor matplotlib; torch (through ``tunekit.problems.opspec``) only inside ``load_comparison``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunekit.errors import UserError
from tunekit.evidence import served_path

#: Tuned families always given a column (``-`` when absent); plugin backends are appended.
REPORT_BACKENDS = ("triton", "hip")
#: Baselines the serving stack itself runs where no table entry serves: the vendor path, and Inductor's
#: kernels for the elementwise ops (vLLM's compiled graphs run them). "tuned" falls back to the fastest of
#: these; every other peer is a kernel to compare with, never what tunekit's fallback runs.
STOCK_BASELINES = ("vendor", "inductor")  # = tunekit.backends.STOCK, not imported here: that imports torch
#: final.csv's column of a problem's peer record (JSON: peer -> "ok" or why it was not timed).
PEERS_COLUMN = "peers"


def baseline_names() -> tuple[str, ...]:
    """The baselines' backend names (vendor and the peers): measured with every problem, never tabulated."""
    from tunekit.backends import BASELINES

    return BASELINES


def peer_names() -> tuple[str, ...]:
    """Every baseline other than vendor, in ``BASELINES`` order."""
    return tuple(b for b in baseline_names() if b != "vendor")


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
    ops); ``baselines`` the peers measured (every other baseline: Inductor,
    vLLM's skinny GEMM ...); ``baseline`` the fastest of them all; ``stock`` the
    fastest of ``STOCK_BASELINES``, what serves where the table holds no entry,
    what the dispatch table must beat (as tunekit.table does) and what
    speedups are taken against. Without peers ``stock`` is ``baseline``.
    ``peer_status``: the run's record per peer ("ok" or why it was not timed);
    empty where final.csv predates the record.
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
    peer_status: dict[str, str] = field(default_factory=dict)

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
    def stock(self) -> Measure:
        """The fastest of the stock baselines (vendor; Inductor where measured): what serves without an entry."""
        return min([self.vendor, *(x for b, x in self.baselines.items() if b in STOCK_BASELINES)],
                   key=lambda x: x.time_us)

    @property
    def best_peer(self) -> Measure | None:
        """The fastest peer measured on this problem; None where none was."""
        return min(self.baselines.values(), key=lambda x: x.time_us) if self.baselines else None

    @property
    def winner(self) -> Measure:
        """Fastest of all candidates, baselines included (vendor wins ties)."""
        return min([self.vendor, *self.baselines.values(), *self.best.values()], key=lambda x: x.time_us)

    def served_us(self, backend: str | None = None) -> float:
        """What a dispatch table serves, over all tuned backends or one: the best tuned candidate where it
        beats the stock path (the table's gate; peers are no bar), else the stock path."""
        tuned = [m.time_us for b, m in self.best.items() if backend is None or b == backend]
        if tuned and min(tuned) < self.stock.time_us:
            return min(tuned)
        return self.stock.time_us


@dataclass(frozen=True)
class TokenPrediction:
    """Per-token time of the problems of one M (sum of counted calls x time), in microseconds.

    ``vendor_us`` is the stock path (each problem's ``stock``); ``peer_us[peer]`` the time if that peer served
    every problem it was measured on and the stock path the others (``peer_calls[peer]``: the calls it
    served); ``best_peer_us`` per problem the fastest peer measured, the stock path where none was (None
    where no peer was measured at this M).
    """

    m: int
    calls: float
    vendor_us: float
    tuned_us: float
    only_us: dict[str, float]  # backend -> tuned with that backend alone
    floor_us: float | None  # every call at the read limit
    peer_us: dict[str, float] = field(default_factory=dict)
    peer_calls: dict[str, float] = field(default_factory=dict)
    best_peer_us: float | None = None

    @property
    def speedup(self) -> float:
        """Local speedup s of the linear part: vendor / tuned."""
        return self.vendor_us / self.tuned_us

    @property
    def over_best_peer(self) -> float | None:
        """Tuned over the best peer: best peer / tuned (None without a peer)."""
        return None if self.best_peer_us is None else self.best_peer_us / self.tuned_us


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
    #: calls per token counted per problem ((op, dtype, m, n, k) -> calls): the served path, each layer once
    counted: dict[tuple, float] = field(default_factory=dict)
    #: what the per-token sums counted in place of what, one line per group of M (served_path)
    path_lines: list[str] = field(default_factory=list)
    #: one line per peer: where it was measured, and why not elsewhere
    peer_lines: list[str] = field(default_factory=list)

    @property
    def read_gbps(self) -> float | None:
        return self.meta.get("probe", {}).get("read_gbps") or None

    @property
    def present(self) -> list[str]:
        """Tuned backends with at least one re-measured candidate."""
        return [b for b in self.backends if any(b in p.best for p in self.problems)]

    @property
    def peers(self) -> list[str]:
        """Peers measured on at least one problem (the report's peer columns), in ``BASELINES`` order."""
        found = {b for p in self.problems for b in p.baselines}
        return [b for b in peer_names() if b in found] + sorted(found - set(peer_names()))

    def calls(self, p: ProblemResult) -> float:
        """Calls per token of ``p`` counted in the sums (its count where the served path keeps it whole)."""
        return self.counted.get(served_path.id_of(p), float(p.count))

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
        # speedups against the stock path (vendor; Inductor where measured): over "vendor" as the report says;
        # the fastest peer has its own column
        stock = [float(r["time_us"]) for r in group if r["backend"] in STOCK_BASELINES]
        base_us = min(stock or [float(vendor_row["time_us"])])
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
                                      nbytes, _measure(vendor_row, limit_gbps, base_us, cpu), best, others, limit_gbps,
                                      _peer_status(group)))
    found = {b for p in problems for b in p.best}
    backends = list(REPORT_BACKENDS) + sorted(found - set(REPORT_BACKENDS))
    kinds = sorted({str(r.get("timing_kind") or "?") for g in groups.values() for r in g})
    comp = Comparison(run_dir, meta, "+".join(kinds), backends, problems, [], notes)
    comp.counted, comp.path_lines = served_path.served_counts(problems)
    comp.tokens = [_token(comp, m) for m in sorted({p.m for p in problems})]
    comp.peer_lines = peer_lines(comp)
    return comp


def _peer_status(group: list[dict[str, Any]]) -> dict[str, str]:
    """The problem's peer record (final.csv's ``peers`` column, on every row of the problem); {} if absent."""
    for row in group:
        text = row.get(PEERS_COLUMN)
        if isinstance(text, str) and text.strip():
            try:
                record = json.loads(text)
            except ValueError:
                continue
            if isinstance(record, dict):
                return {str(k): str(v) for k, v in record.items()}
    return {}


def _token(comp: Comparison, m: int) -> TokenPrediction:
    problems = [p for p in comp.problems if p.m == m]
    calls = {served_path.id_of(p): comp.calls(p) for p in problems}

    def total(time_of) -> float:
        return sum(calls[served_path.id_of(p)] * time_of(p) for p in problems)

    only = {b: total(lambda p, b=b: p.served_us(b)) for b in comp.present}
    peers = [b for b in comp.peers if any(b in p.baselines for p in problems)]
    peer_us = {b: total(lambda p, b=b: p.baselines[b].time_us if b in p.baselines else p.stock.time_us)
               for b in peers}
    peer_calls = {b: sum(calls[served_path.id_of(p)] for p in problems if b in p.baselines) for b in peers}
    best_peer = (total(lambda p: p.best_peer.time_us if p.best_peer else p.stock.time_us) if peers else None)
    # each problem at its own limit (read for GEMV, copy for elementwise ops)
    counted = [p for p in problems if calls[served_path.id_of(p)]]
    floor = (sum(calls[served_path.id_of(p)] * p.bytes_moved / (p.limit_gbps * 1e3) for p in counted)
             if counted and all(p.limit_gbps for p in counted) else None)
    n_calls = sum(calls.values())
    return TokenPrediction(m, int(n_calls) if float(n_calls).is_integer() else n_calls,
                           total(lambda p: p.stock.time_us), total(lambda p: p.served_us()), only, floor,
                           peer_us, peer_calls, best_peer)


def peer_lines(comp: Comparison) -> list[str]:
    """One line per peer (every baseline but vendor, and any other found): the problems it was timed on and,
    for the others, why not: the run's record (package missing, architecture, op or shape unsupported, a
    failed build), or that the run predates the record."""
    lines = []
    total = len(comp.problems)
    for peer in dict.fromkeys([*peer_names(), *comp.peers]):
        timed = [p for p in comp.problems if peer in p.baselines]
        why: dict[str, list[ProblemResult]] = {}
        for p in comp.problems:
            if peer in p.baselines:
                continue
            status = p.peer_status.get(peer)
            if status is None:
                status = ("not recorded (this run's final.csv predates the peer record)" if not p.peer_status
                          else "not in this run's peer record")
            why.setdefault(status, []).append(p)
        if not timed and not any(p.peer_status for p in comp.problems):
            lines.append(f"{peer}: not measured in this run (its final.csv records no peer arms: the run predates "
                         "them)")
            continue
        head = f"{peer}: measured on {len(timed)} of {total} problems" if timed else f"{peer}: not measured"
        parts = [f"{_problems_text(ps)}: {status}" for status, ps in why.items()]
        lines.append(head + ("; not on " + "; ".join(parts) if parts and timed else
                             ": " + "; ".join(parts) if parts else ""))
    return lines


#: Why the table does not serve a peer that beats the tuned kernel, per peer (tunekit compare's "Peers that win").
#: The table holds tunekit's searched families only and falls back to the stock path, never to a peer.
PEER_NOT_SERVED = {
    "vllm_skinny_heuristic": "the same kernel is the searched family vllm_skinny: the table serves it where the "
                             "run searched it (--backend ...,vllm_skinny) and it won; serving it needs vLLM >= 0.33",
    "flashinfer": "FlashInfer is not a tunekit family: the table serves tunekit's families and the stock path only",
    "inductor_max_autotune": "Inductor's pick inside a compiled graph, not a kernel the table can name; vLLM runs "
                             "it where the whole model is compiled with max-autotune",
    "triton_autotune": "a plain Triton tile loop inside the Triton family's space (M_MODE=dot): the search did not "
                       "reach it; more trials, or its configs as seeds",
}


def winning_peer_lines(comp: Comparison) -> list[str]:
    """One line per problem where a peer beats what the table serves: the peer, both times, and why the table
    does not serve it (:data:`PEER_NOT_SERVED`), or that the table serves it."""
    lines = []
    for p in comp.problems:
        peer, served = p.best_peer, p.served_us()
        if peer is None or peer.time_us >= served:
            continue
        why = PEER_NOT_SERVED.get(peer.label, "not a tunekit family: the table cannot serve it")
        if peer.label == "vllm_skinny_heuristic" and "vllm_skinny" in p.best:
            why = "vllm_skinny was searched in this run and its best is slower than vLLM's heuristic here"
        lines.append(f"{p.op} {p.label}: {peer.label} {peer.time_us:.2f} µs vs served {served:.2f} µs "
                     f"({served / peer.time_us:.3f}x slower): {why}")
    return lines


def _problems_text(problems: list[ProblemResult]) -> str:
    """``3 problems (gemv m1, m2; rms_gemv m1)``: how many, and their ops with their Ms."""
    by_op: dict[str, list[int]] = {}
    for p in problems:
        by_op.setdefault(p.op, []).append(p.m)
    ops = "; ".join(f"{op} m{', m'.join(map(str, sorted(set(ms))))}" for op, ms in by_op.items())
    return f"{len(problems)} problem{'s' if len(problems) != 1 else ''} ({ops})"


# ---- formatting, shared by the report's tables and its plots -------------------------------------

def format_value(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` in ``spec`` with ``suffix``; ``-`` for None."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_gbps(value: float | None) -> str:
    """GB/s: whole numbers on a GPU, three digits for the tiny CPU-interpreter figures."""
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.3g}"
