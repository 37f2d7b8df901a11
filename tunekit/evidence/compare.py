"""``tunekit compare``: vendor vs Triton vs HIP per problem and per token, Amdahl's prediction, report.md.

Call protocol: ``compare_run(run_dir, console)`` loads the run's final re-measure
(``tunekit.evidence.comparison``), prints the three tables on ``console``, draws the plots
(``tunekit.evidence.plots``) and writes RUN/report.md; the ``*_table`` functions give the
tables as (header, rows) for other callers.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tunekit.evidence.comparison import Comparison, Measure, format_gbps, format_value, load_comparison
from tunekit.evidence.plots import write_plots

#: Shares of decode time spent in these GEMVs for the Amdahl service prediction.
AMDAHL_SHARES = (0.5, 0.7, 0.9)
EVIDENCE = ("prediction from standalone microbenchmarks (the 'standalone microbenchmark' layer of evidence: "
            "each kernel timed alone, interleaved with its baselines), not an end-to-end measurement")


def amdahl(f: float, s: float) -> float:
    """Whole-service speedup when a share ``f`` of the time gets ``s`` times faster."""
    return 1.0 / ((1.0 - f) + f / s)


def _rate(x: Measure) -> str:
    """GB/s and % of limit in one cell of the console's table."""
    return f"{format_gbps(x.gbps)} GB/s {format_value(x.pct_of_limit, '.1f', '%')}"


def _bw(x: Measure) -> str:
    return f"{format_gbps(x.gbps)} ({format_value(x.pct_of_limit, '.1f', '%')})"


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
                   f"{v.time_us:.2f} µs\n{_rate(v)}"]
            for b in extra:
                x = p.baselines.get(b)
                row.append("-" if x is None else f"{x.time_us:.2f} µs\n{_rate(x)}")
            for b in comp.backends:
                x = p.best.get(b)
                row.append("-" if x is None else f"{x.time_us:.2f} µs {x.speedup:.3f}x\n{_rate(x)}")
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
        f"read limit: {format_gbps(comp.read_gbps)} GB/s (probe, {probe.get('kind', '?')} timing; "
        f"copy {format_gbps(probe.get('copy_gbps'))} GB/s)",
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
            f"min_gain = {format_value(comp.meta.get('min_gain'), '.1%')}); floor = every call at the read limit. "
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
