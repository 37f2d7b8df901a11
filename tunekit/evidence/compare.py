"""Reports of a search: the end-of-run summary and `tunekit compare` (vendor vs Triton vs HIP, per token)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tunekit.errors import UserError

#: Columns of a report that is not printed on a terminal. Rich assumes 80 there and
#: cuts table cells to fit ("(1.00…"); a file or a pipe has no width to respect.
PIPE_WIDTH = 200


def make_console() -> Console:
    """The console reports print on: a terminal's own width; piped or redirected, PIPE_WIDTH
    columns (or $COLUMNS) and long lines left unwrapped, so no table cell is truncated."""
    if sys.stdout.isatty():
        return Console()
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() else PIPE_WIDTH, soft_wrap=True)


def print_summary(console: Console, outcome) -> None:
    """Per problem: trials, vendor and best tuned time (interleaved re-measure), speedup, % of limit."""
    stats = Table("problem", "backend", "measured", "ok", "failed", "invalid", "dup", "best us (search)")
    for s in outcome.stats:
        p = s.problem
        stats.add_row(_problem_label(p.op, p.m, p.n, p.k), s.backend, f"{s.measured_before + s.measured_now}"
                      f" (+{s.measured_now})", str(s.ok), str(s.failed), str(s.invalid), str(s.duplicates),
                      "-" if s.best_us is None else f"{s.best_us:.2f}")
    console.print(stats)
    limit = outcome.probe.get("read_gbps")
    if outcome.probe.get("kind") == "cpu":
        title = "interleaved re-measure (CPU interpreter timing: not bandwidth evidence)"
    elif limit:
        title = f"interleaved re-measure ({outcome.probe.get('kind')} timing, read limit {limit:.0f} GB/s)"
    else:
        title = "interleaved re-measure"
    final = Table("problem", "count", "vendor µs", "best", "us", "speedup", "GB/s", "% limit", title=title)
    by_problem: dict[tuple, list[dict]] = {}
    for row in outcome.final_rows:
        by_problem.setdefault((row["op"], row["m"], row["n"], row["k"]), []).append(row)
    for (op, m, n, k), rows in by_problem.items():
        tuned = [r for r in rows if r["backend"] not in _baseline_names()]
        vendor = next(r for r in rows if r["backend"] == "vendor")
        best = min(tuned, key=lambda r: r["time_us"]) if tuned else vendor
        pct = None if outcome.probe.get("kind") == "cpu" else best.get("pct_of_limit")
        # speedup: over the faster baseline (vendor, or Inductor for elementwise ops)
        final.add_row(_problem_label(op, m, n, k), str(vendor["count"]), f"{vendor['time_us']:.2f}", best["label"],
                      f"{best['time_us']:.2f}", f"{best['speedup']:.3f}", f"{best['gbps']:.0f}",
                      "-" if pct is None else f"{pct:.1f}")
    console.print(final)
    if outcome.table_path:
        console.print(f"dispatch table: {outcome.table_path}; trials: {outcome.trials_path}")
        advice = empty_table_advice(outcome)
        if advice:
            from rich.markup import escape

            console.print(f"[yellow]{escape(advice)}[/]")


def empty_table_advice(outcome) -> str | None:
    """Why a search's dispatch table came out empty, with counts, and what to try next; None if it has entries."""
    try:
        table = json.loads(Path(outcome.table_path).read_text())
    except (OSError, ValueError):
        return None
    if table.get("entries"):
        return None
    problems = {(s.problem.op, s.problem.m, s.problem.n, s.problem.k) for s in outcome.stats}
    verified = {(r["op"], r["m"], r["n"], r["k"]) for r in outcome.final_rows
                if r["backend"] not in _baseline_names()}
    beaten = len(problems & verified)  # a verified candidate existed; a baseline stayed ahead
    none_ok = len(problems - verified)  # no candidate passed verification (or none was re-measured)
    failed = sum(s.failed for s in outcome.stats)
    gain = table.get("min_gain")
    parts = []
    if beaten:
        parts.append(f"the baseline (vendor) stayed fastest on {beaten} of {len(problems)} problems "
                     f"(no candidate {'' if gain is None else f'{gain:.0%} '}ahead)")
    if none_ok:
        parts.append(f"{none_ok} of {len(problems)} had no verified candidate ({failed} failed trials in this run)")
    cpu = " CPU interpreter timings rank kernels arbitrarily: a GPU run is what counts." \
        if outcome.probe.get("kind") == "cpu" else ""
    return (f"the dispatch table is empty: {'; '.join(parts) or 'no problem was searched'}. Next: more --trials, "
            f"a lower --min-gain, and the status / error columns of {outcome.trials_path} for the failures; "
            f"meanwhile the vendor path serves every problem.{cpu}")


def _baseline_names() -> tuple[str, ...]:
    from tunekit.backends import BASELINES

    return BASELINES


def _problem_label(op: str, m: int, n: int, k: int) -> str:
    """``m1 96x5120`` for a GEMV; ``<op> m1 <shape>`` for an elementwise op."""
    from tunekit.problems.shapes import Problem

    if op == "gemv":
        return f"m{m} {n}x{k}"
    return f"{op} m{m} {Problem(op, 'bf16', m, n, k).shape_text}"


# --------------------------------------------------------------------------------------------------
# tunekit compare: vendor vs Triton vs HIP from one run's interleaved final re-measure (final.csv)
# --------------------------------------------------------------------------------------------------

#: Shares of decode time spent in these GEMVs for the Amdahl service prediction.
AMDAHL_SHARES = (0.5, 0.7, 0.9)
#: Tuned families always given a column (``-`` when absent); plugin backends are appended.
REPORT_BACKENDS = ("triton", "hip")
PLOT_FILES = {"pct": "compare_pct_of_limit.png", "speedup": "compare_speedup.png",
              "token": "compare_per_token.png"}
EVIDENCE = ("prediction from standalone microbenchmarks (the 'standalone microbenchmark' layer of evidence: "
            "each kernel timed alone, interleaved with its baselines), not an end-to-end measurement")


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


def amdahl(f: float, s: float) -> float:
    """Whole-service speedup when a share ``f`` of the time gets ``s`` times faster."""
    return 1.0 / ((1.0 - f) + f / s)


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


def _read_rows(run_dir: Path) -> list[dict[str, Any]]:
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
    rows = _read_rows(run_dir)
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
    baseline_names = _baseline_names()
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
        base_us = min(float(r["time_us"]) for r in group if r["backend"] in baseline_names)
        best: dict[str, Measure] = {}
        others: dict[str, Measure] = {}
        for row in group:
            if row["backend"] == "vendor":
                continue
            cand = _measure(row, limit_gbps, base_us, cpu)
            pool = others if cand.backend in baseline_names else best
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


# ---- formatting -----------------------------------------------------------------------------------

def _f(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _gbps(value: float | None) -> str:
    """GB/s: whole numbers on a GPU, three digits for the tiny CPU-interpreter figures."""
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _bw(x: Measure) -> str:
    return f"{_gbps(x.gbps)} ({_f(x.pct_of_limit, '.1f', '%')})"


def problem_table(comp: Comparison, compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-problem comparison.

    The markdown form has one column per figure; ``compact`` (the console) puts
    each backend's time, speedup, GB/s and % of limit in one two-line cell.
    """
    # baselines besides vendor (Inductor, elementwise ops) get columns only when measured
    extra = sorted({b for p in comp.problems for b in p.baselines})
    if compact:
        head = ["problem", "count", "weight MB", "vendor", *extra, *comp.backends, "winner"]
    else:
        head = ["op", "M", "N", "K", "count/token", "weight MB", "vendor µs", "vendor GB/s (% limit)"]
        for b in extra:
            head += [f"{b} µs", f"{b} GB/s (% limit)"]
        for b in comp.backends:
            head += [f"{b} µs", f"{b} GB/s (% limit)", f"{b} speedup"]
        head.append("winner")
    rows = []
    for p in comp.problems:
        v = p.vendor
        if compact:
            row = [f"{p.op} {p.label}", str(p.count), f"{p.weight_bytes / 1e6:.2f}",
                   f"{v.time_us:.2f} µs\n{_gbps(v.gbps)} GB/s {_f(v.pct_of_limit, '.1f', '%')}"]
            for b in extra:
                x = p.baselines.get(b)
                row.append("-" if x is None else f"{x.time_us:.2f} µs\n{_gbps(x.gbps)} GB/s "
                                                 f"{_f(x.pct_of_limit, '.1f', '%')}")
            for b in comp.backends:
                x = p.best.get(b)
                row.append("-" if x is None else f"{x.time_us:.2f} µs {x.speedup:.3f}x\n"
                                                 f"{_gbps(x.gbps)} GB/s {_f(x.pct_of_limit, '.1f', '%')}")
        else:
            row = [p.op, str(p.m), str(p.n), str(p.k), str(p.count), f"{p.weight_bytes / 1e6:.2f}",
                   f"{v.time_us:.2f}", _bw(v)]
            for b in extra:
                x = p.baselines.get(b)
                row += ["-", "-"] if x is None else [f"{x.time_us:.2f}", _bw(x)]
            for b in comp.backends:
                x = p.best.get(b)
                row += ["-", "-", "-"] if x is None else [f"{x.time_us:.2f}", _bw(x), f"{x.speedup:.3f}x"]
        row.append(p.winner.label)
        rows.append(row)
    return head, rows


def config_table(comp: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per problem and tuned backend, its best candidate's label and config."""
    rows = []
    for p in comp.problems:
        for backend in comp.backends:
            x = p.best.get(backend)
            if x is not None and x.params:
                params = ", ".join(f"{k}={v}" for k, v in json.loads(x.params).items())
                rows.append([f"{p.op} {p.label}", x.label, f"{x.speedup:.3f}x", f"`{params}`"])
    return ["problem", "candidate", "speedup", "config"], rows


def token_table(comp: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-token prediction, one row per M (times in ms)."""
    calls = "GEMV calls" if all(p.op == "gemv" for p in comp.problems) else "calls"
    head = ["M", calls, "vendor ms", "tuned ms", "s (tuned)",
            *(f"{b} only ms (s)" for b in comp.backends), "floor ms", "% of limit vendor / tuned"]
    rows = []
    for t in comp.tokens:
        row = [str(t.m), str(t.calls), f"{t.vendor_us / 1e3:.3f}", f"{t.tuned_us / 1e3:.3f}", f"{t.speedup:.4f}"]
        for b in comp.backends:
            us = t.only_us.get(b)
            row.append("-" if us is None else f"{us / 1e3:.3f} ({t.vendor_us / us:.4f})")
        if t.floor_us is None:
            row += ["-", "-"]
        else:
            row += [f"{t.floor_us / 1e3:.3f}",
                    f"{100 * t.floor_us / t.vendor_us:.1f}% / {100 * t.floor_us / t.tuned_us:.1f}%"]
        rows.append(row)
    return head, rows


def amdahl_table(comp: Comparison) -> tuple[list[str], list[list[str]]]:
    """Predicted service speedup 1 / ((1 - f) + f / s) per M, variant and share f."""
    head = ["M", "variant", "s (linear part)"] + [f"f = {f:.0%}" for f in AMDAHL_SHARES]
    rows = []
    for t in comp.tokens:
        variants = [("tuned (all backends)", t.speedup)]
        variants += [(f"{b} only", t.vendor_us / us) for b, us in t.only_us.items()]
        for name, s in variants:
            rows.append([str(t.m), name, f"{s:.4f}"] + [f"{amdahl(f, s):.4f}x" for f in AMDAHL_SHARES])
    return head, rows


def _header_lines(comp: Comparison) -> list[str]:
    meta, probe = comp.meta, comp.meta.get("probe", {})
    device = meta.get("device", {})
    return [
        f"GPU: {comp.gpu}, {device.get('cu_count', '?')} CUs, {device.get('runtime', '?')}",
        "read limit: none (CPU interpreter timing is not bandwidth evidence)" if comp.is_interpreter else
        f"read limit: {_gbps(comp.read_gbps)} GB/s (probe, {probe.get('kind', '?')} timing; "
        f"copy {_gbps(probe.get('copy_gbps'))} GB/s)",
        f"model: {meta.get('model') or '-'}; tuned backends in this run: {', '.join(comp.present) or 'none'}",
        f"command: {meta.get('command', '?')}",
        f"timing kind: {comp.timing_kind}; source: {comp.run_dir}/final.csv (interleaved final re-measure)",
    ]


_CPU_WARNING = ("CPU TIMINGS: these are Triton/PyTorch interpreter timings on the CPU, "
                "NOT performance evidence; they only show the pipeline works.")


def print_comparison(console: Console, comp: Comparison) -> None:
    """Print the per-problem table, the per-token prediction and the Amdahl table with rich."""
    from rich.markup import escape

    for line in _header_lines(comp):
        console.print(escape(line))
    if comp.is_interpreter:
        console.print(f"[bold red]{_CPU_WARNING}[/]")
    for note in comp.notes:
        console.print(f"[yellow]note: {escape(note)}[/]")
    tables = (("per problem: best of each backend, speedup over vendor, GB/s and % of read limit",
               problem_table(comp, compact=True), None),
              ("per token: sum of count x time; tuned = min(best tuned, vendor) per problem; s = vendor / tuned",
               token_table(comp), None),
              ("predicted service speedup 1 / ((1 - f) + f / s), f = share of decode time in these GEMVs",
               amdahl_table(comp), EVIDENCE))
    for title, (head, rows), caption in tables:
        table = Table(*head, title=escape(title), caption=caption and escape(caption))
        for row in rows:
            table.add_row(*(escape(cell) for cell in row))
        console.print(table)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(comp: Comparison, plots: list[Path], path: Path | None = None) -> Path:
    """Write RUN/report.md: header, the three tables, the plot links."""
    path = path or comp.run_dir / "report.md"
    out = [f"# tunekit compare: {comp.meta.get('model') or comp.run_dir.name} on {comp.gpu}", ""]
    out += [f"- {line}" for line in _header_lines(comp)[:3]]
    out += [f"- command: `{comp.meta.get('command', '?')}`",
            f"- timing kind: **{comp.timing_kind}**; source: `final.csv` (vendor and the top candidates of "
            "every backend re-measured interleaved in one session per problem; no figure from another run)", ""]
    if comp.is_interpreter:
        out += [f"> **WARNING — {_CPU_WARNING}**", ""]
    out += [f"> note: {note}" for note in comp.notes] + ([""] if comp.notes else [])
    elementwise = any(p.op != "gemv" for p in comp.problems)
    baseline_note = (" Elementwise ops: % of the measured copy bandwidth, and speedups over the faster baseline "
                     "(PyTorch eager = vendor, or Inductor where measured), as the dispatch table gates them."
                     if elementwise else "")
    out += ["## Per problem", "", "Best candidate of each backend; GB/s over the bytes one call must move, "
            "% of the measured read limit; speedup over vendor in the same session; winner = fastest incl. "
            "vendor." + baseline_note, "", _md_table(*problem_table(comp)), ""]
    out += ["## Per token", "", f"Sum over problems of count x time per decoded token. tuned = per problem "
            f"min(best tuned, vendor), what the dispatch table serves (the table also requires a gain of at least "
            f"min_gain = {_f(comp.meta.get('min_gain'), '.1%')}); floor = every call at the read limit. "
            f"This is a {EVIDENCE}.", "", _md_table(*token_table(comp)), ""]
    out += ["### Predicted service speedup (Amdahl)", "", "If a share f of decode time is spent in these GEMVs "
            "and the rest is unchanged: 1 / ((1 - f) + f / s). A prediction from standalone microbenchmarks, "
            "to be checked end to end.", "", _md_table(*amdahl_table(comp)), ""]
    configs = config_table(comp)
    if configs[1]:
        out += ["## Best configs", "", "The config of each backend's best candidate (the kernel's own tunable "
                "names), to read which variant won: for GEMV, Triton's `M_MODE`, HIP's `MMA`.", "",
                _md_table(*configs), ""]
    if plots:
        out += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    path.write_text("\n".join(out))
    return path


# ---- plots ----------------------------------------------------------------------------------------

_COLORS = {"vendor": "#7f7f7f", "triton": "#1f77b4", "hip": "#d62728"}


def _color(backend: str, index: int) -> Any:
    """Fixed colors for the built-in backends, tab10 for plugins."""
    from matplotlib import colormaps

    return _COLORS.get(backend) or colormaps["tab10"](index % 10)


def _stack_color(index: int) -> Any:
    """Color ``index`` of tab20 (distinct colors for the stacked problems)."""
    from matplotlib import colormaps

    return colormaps["tab20"](index % 20)


def write_plots(comp: Comparison) -> list[Path]:
    """Write the three PNGs (Agg canvas, no pyplot state) into the run folder."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    title = f"{comp.gpu}, {comp.timing_kind} timing" + (" (CPU: NOT performance evidence)"
                                                        if comp.is_interpreter else "")
    labels = [p.plot_label for p in comp.problems]
    xs = list(range(len(labels)))
    elementwise = any(p.op != "gemv" for p in comp.problems)
    copy_gbps = comp.meta.get("probe", {}).get("copy_gbps")
    width_in = max(7.0, 0.9 * len(labels) + 3)
    paths = []

    def save(fig: Figure, key: str) -> None:
        FigureCanvasAgg(fig)
        fig.tight_layout()
        path = comp.run_dir / PLOT_FILES[key]
        fig.savefig(path, dpi=120)
        paths.append(path)

    # (a) % of the read limit per problem
    fig = Figure(figsize=(width_in, 4.8))
    ax = fig.add_subplot()
    series = ["vendor", *comp.present]
    bar_w = 0.8 / len(series)
    for i, b in enumerate(series):
        vals = [(p.vendor if b == "vendor" else p.best.get(b)) for p in comp.problems]
        pct = [0.0 if v is None or v.pct_of_limit is None else v.pct_of_limit for v in vals]
        bars = ax.bar([x + (i - (len(series) - 1) / 2) * bar_w for x in xs], pct, bar_w, label=b,
                      color=_color(b, i))
        ax.bar_label(bars, labels=["" if v is None or v.pct_of_limit is None else f"{v.pct_of_limit:.0f}"
                                   for v in vals], fontsize="x-small", padding=1)
    ax.axhline(100.0, color="black", linestyle="--", linewidth=1, label="limit" if elementwise else "read limit")
    top = max([100.0] + [v.pct_of_limit or 0.0 for p in comp.problems for v in [p.vendor, *p.best.values()]])
    ax.set_ylim(0, top * 1.18)
    if elementwise:
        ax.set_ylabel(f"% of the op's measured limit\n(GEMV: read {_gbps(comp.read_gbps)} GB/s, "
                      f"elementwise: copy {_gbps(copy_gbps)} GB/s)", fontsize="small")
    else:
        ax.set_ylabel(f"% of measured read limit ({_gbps(comp.read_gbps)} GB/s)")
    ax.set_xlabel("problem (M, N x K)")
    ax.set_xticks(xs, labels, rotation=30, ha="right")
    ax.set_title(f"Bandwidth efficiency per problem\n{title}", fontsize="medium")
    ax.legend(loc="upper left", ncol=len(series) + 1, fontsize="small")
    save(fig, "pct")

    # (b) speedup over vendor
    fig = Figure(figsize=(width_in, 4.8))
    ax = fig.add_subplot()
    tuned = comp.present or ["(none)"]
    bar_w = 0.8 / len(tuned)
    for i, b in enumerate(tuned):
        vals = [p.best[b].speedup if b in p.best else 0.0 for p in comp.problems]
        bars = ax.bar([x + (i - (len(tuned) - 1) / 2) * bar_w for x in xs], vals, bar_w, label=b,
                      color=_color(b, i + 1))
        ax.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in vals], fontsize="x-small", padding=1)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1,
               label="baseline (1.0)" if elementwise else "vendor (1.0)")
    ax.set_ylabel("speedup over the fastest baseline\n(vendor or Inductor; x, same session)" if elementwise
                  else "speedup over vendor (x, same session)")
    ax.set_xlabel("problem (M, N x K)")
    ax.set_xticks(xs, labels, rotation=30, ha="right")
    over = "the fastest baseline" if elementwise else "vendor"
    ax.set_title(f"Speedup of each backend's best candidate over {over}\n{title}", fontsize="medium")
    top = max([1.0] + [x.speedup for p in comp.problems for x in p.best.values()])
    ax.set_ylim(0, top * 1.2)
    ax.legend(loc="upper left", ncol=len(tuned) + 1, fontsize="small")
    save(fig, "speedup")

    # (c) per-token time, stacked by problem, vendor vs tuned per M
    fig = Figure(figsize=(max(7.0, 2.4 * len(comp.tokens) + 5), 5.2))
    ax = fig.add_subplot()
    shapes = list(dict.fromkeys((p.op, p.n, p.k) for p in comp.problems))
    names = {(p.op, p.n, p.k): p.names.replace(";", ", ") for p in comp.problems}
    ticks, tick_labels = [], []
    for j, t in enumerate(comp.tokens):
        group = {(p.op, p.n, p.k): p for p in comp.problems if p.m == t.m}
        for i, (kind, get) in enumerate((("vendor", lambda p: p.vendor.time_us), ("tuned", ProblemResult.served_us))):
            x = 3 * j + i
            bottom = 0.0
            for s, shape in enumerate(shapes):
                p = group.get(shape)
                ms = 0.0 if p is None else p.count * get(p) / 1e3
                ax.bar(x, ms, 0.8, bottom=bottom, color=_stack_color(s),
                       label=f"{shape[1]}x{shape[2]} {names[shape]}" if j == 0 and i == 0 else None)
                bottom += ms
            ax.text(x, bottom, f"{bottom:.3f} ms", ha="center", va="bottom", fontsize="small")
            ticks.append(x)
            tick_labels.append(f"M={t.m}\n{kind}")
        if t.floor_us is not None:
            ax.hlines(t.floor_us / 1e3, 3 * j - 0.45, 3 * j + 1.45, colors="black", linestyles="--",
                      label="read-limit floor" if j == 0 else None)
    ax.set_xticks(ticks, tick_labels)
    ax.set_ylabel("GEMV time per decoded token (ms)")
    fig.suptitle(f"Per-token GEMV time, sum of count x standalone microbenchmark time\n{title}",
                 fontsize="medium")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", title="problem (N x K, layers)")
    ax.margins(y=0.1)
    save(fig, "token")
    return paths


def compare_run(run_dir: Path, console: Console) -> Comparison:
    """`tunekit compare RUN`: load, print, write RUN/report.md and the PNG plots."""
    comp = load_comparison(run_dir)
    from tunekit.search.results import check_writable_dir

    # before the report is printed: a folder it cannot be written to is one line, not a report and a failure
    check_writable_dir(Path(run_dir), "compare writes report.md and the plots into the run folder")
    print_comparison(console, comp)
    try:
        plots = write_plots(comp)
    except ImportError:
        plots = []
        console.print("[yellow]matplotlib is not installed: no plots (pip install matplotlib)[/]")
    md = write_markdown(comp, plots)
    console.print(f"wrote {md}" + "".join(f", {p.name}" for p in plots))
    return comp


def report_after_search(console: Console, run_dir: Path) -> Comparison | None:
    """The end of `tunekit search`: the comparison, or one line when final.csv has no rows."""
    if not _read_rows(run_dir):
        console.print(f"no comparison: {run_dir}/final.csv has no rows (the final re-measure produced none)")
        return None
    return compare_run(run_dir, console)
