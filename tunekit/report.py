"""Reports of a search: the end-of-run summary (and, later, Triton vs HIP vs vendor)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_summary(console: Console, outcome) -> None:
    """Per problem: trials, vendor and best tuned time (interleaved re-measure), speedup, % of limit."""
    stats = Table("problem", "backend", "measured", "ok", "failed", "invalid", "dup", "best us (search)")
    for s in outcome.stats:
        p = s.problem
        stats.add_row(f"m{p.m} {p.n}x{p.k}", s.backend, f"{s.measured_before + s.measured_now}"
                      f" (+{s.measured_now})", str(s.ok), str(s.failed), str(s.invalid), str(s.duplicates),
                      "-" if s.best_us is None else f"{s.best_us:.2f}")
    console.print(stats)
    limit = outcome.probe.get("read_gbps")
    final = Table("problem", "count", "vendor us", "best", "us", "speedup", "GB/s", "% limit",
                  title=f"interleaved re-measure ({outcome.probe.get('kind')} timing, "
                        f"read limit {limit:.0f} GB/s)" if limit else "interleaved re-measure")
    by_problem: dict[tuple, list[dict]] = {}
    for row in outcome.final_rows:
        by_problem.setdefault((row["m"], row["n"], row["k"]), []).append(row)
    for (m, n, k), rows in by_problem.items():
        tuned = [r for r in rows if r["backend"] != "vendor"]
        vendor = next(r for r in rows if r["backend"] == "vendor")
        best = min(tuned, key=lambda r: r["time_us"]) if tuned else vendor
        pct = best.get("pct_of_limit")
        final.add_row(f"m{m} {n}x{k}", str(vendor["count"]), f"{vendor['time_us']:.2f}", best["label"],
                      f"{best['time_us']:.2f}", f"{best['speedup']:.3f}", f"{best['gbps']:.0f}",
                      "-" if pct is None else f"{pct:.1f}")
    console.print(final)
    if outcome.table_path:
        console.print(f"dispatch table: {outcome.table_path}; trials: {outcome.trials_path}")
