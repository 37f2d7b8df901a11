"""The end of ``tunekit search``: per problem its trials and the interleaved re-measure, why a table came out
empty, then the comparison of ``tunekit compare``.

Call protocol: ``print_summary(console, outcome)`` with the ``SearchOutcome`` of
``tunekit.search.engine.run_search``, then ``report_after_search(console, outcome.run_dir)``.
Imports neither optuna nor torch: the outcome carries everything printed.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from tunekit import table as table_mod
from tunekit.evidence.compare import compare_run
from tunekit.evidence.comparison import Comparison, baseline_names, read_final_rows

#: Under the trials table: what each column counts (every count is this search's, except "stored before").
TRIALS_CAPTION = (
    "measured = ok + failed: trials this search built, verified and timed (failed: did not build, verify "
    "or finish in time; trials.csv says why); invalid: refused by the kernel's own predicate, not run; dup: a "
    "config already measured, not run again; stored before: measured trials the storage held for the study "
    "before this search (earlier runs, other searches), so its total is stored before + measured; best: the "
    "fastest verified trial in the storage (search timing; the re-measure below is the one that counts); stopped "
    "early: why the study ended before --trials (near the measured limit, or a plateau; stored on the study)")

#: Under the re-measure table.
FINAL_CAPTION = (
    "the top candidates of every backend re-measured interleaved with the baselines: count: calls per token; "
    "best: the fastest tuned candidate (vendor where none was verified); us, GB/s, % limit: its time, bandwidth "
    "and share of the measured read limit; speedup: the faster baseline's time / best's time (vendor, and "
    "Inductor for elementwise ops)")


def print_summary(console: Console, outcome) -> None:
    """Per problem: trials, vendor and best tuned time (interleaved re-measure), speedup, % of limit."""
    stats = Table("problem", "backend", "measured", "ok", "failed", "invalid", "dup", "stored before",
                  "best us (search)", "stopped early", title="trials of this search, per study", caption=TRIALS_CAPTION,
                  caption_justify="left")
    for s in outcome.stats:
        p = s.problem
        stats.add_row(_problem_label(p.op, p.m, p.n, p.k), s.backend, str(s.measured_now), str(s.ok),
                      str(s.failed), str(s.invalid), str(s.duplicates), str(s.measured_before),
                      "-" if s.best_us is None else f"{s.best_us:.2f}", s.stopped or "-")
    console.print(stats)
    limit = outcome.probe.get("read_gbps")
    if outcome.probe.get("kind") == "cpu":
        title = "interleaved re-measure (CPU interpreter timing: not bandwidth evidence)"
    elif limit:
        title = f"interleaved re-measure ({outcome.probe.get('kind')} timing, read limit {limit:.0f} GB/s)"
    else:
        title = "interleaved re-measure"
    final = Table("problem", "count", "vendor µs", "best", "us", "speedup", "GB/s", "% limit", title=title,
                  caption=FINAL_CAPTION, caption_justify="left")
    by_problem: dict[tuple, list[dict]] = {}
    for row in outcome.final_rows:
        by_problem.setdefault((row["op"], row["m"], row["n"], row["k"]), []).append(row)
    for (op, m, n, k), rows in by_problem.items():
        tuned = [r for r in rows if r["backend"] not in baseline_names()]
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
        table = table_mod.load(outcome.table_path)
    except table_mod.TableError:
        return None
    if table_mod.entries(table):
        return None
    problems = {(s.problem.op, s.problem.m, s.problem.n, s.problem.k) for s in outcome.stats}
    verified = {(r["op"], r["m"], r["n"], r["k"]) for r in outcome.final_rows
                if r["backend"] not in baseline_names()}
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



def _problem_label(op: str, m: int, n: int, k: int) -> str:
    """``m1 96x5120`` for a GEMV; ``<op> m1 <shape>`` for an elementwise op."""
    from tunekit.problems.shapes import Problem

    if op == "gemv":
        return f"m{m} {n}x{k}"
    return f"{op} m{m} {Problem(op, 'bf16', m, n, k).shape_text}"


def report_after_search(console: Console, run_dir: Path) -> Comparison | None:
    """The end of `tunekit search`: the comparison, or one line when final.csv has no rows."""
    if not read_final_rows(run_dir):
        console.print(f"no comparison: {run_dir}/final.csv has no rows (the final re-measure produced none)")
        return None
    return compare_run(run_dir, console)
