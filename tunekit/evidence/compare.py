"""``tunekit compare``: vendor vs the peers vs Triton vs HIP per problem and per token, Amdahl's prediction.

Call protocol: ``compare_run(run_dir, console)`` loads the run's final re-measure
(``tunekit.evidence.comparison``), prints the three tables on ``console``, draws the plots
(``tunekit.evidence.plots``) and writes RUN/report.md and the tables as RUN/compare_problems.csv and
RUN/compare_tokens.csv (the cells of report.md's tables); the ``*_table`` functions give the tables as
(header, rows) for other callers. Every peer (each baseline but vendor) gets a column where it was
measured and one line saying where it was not, and why.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tunekit.evidence.comparison import (
    Comparison,
    Measure,
    format_gbps,
    format_value,
    load_comparison,
    winning_peer_lines,
)
from tunekit.evidence.plots import plot_notes, write_plots
from tunekit.evidence.time_split import read_time, split_table

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


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or not den else f"{num / den:.3f}x"


def problem_table(comp: Comparison, compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-problem comparison.

    The markdown (and CSV) form has one column per figure; ``compact`` (the console) puts each backend's
    time, speedup, GB/s and % of limit in one two-line cell. Columns: vendor, each peer measured in the run,
    each tuned backend (speedup over the stock path), then tuned (what the table serves), tuned over vendor,
    the best peer and tuned over it; "counted/token" where the per-token sums count fewer calls than listed.
    """
    peers = comp.peers
    partial = any(comp.calls(p) != p.count for p in comp.problems)
    if compact:
        head = ["problem", "count", "weight MB", "vendor", *peers, *comp.backends, "tuned", "winner"]
    else:
        head = ["op", "M", "N", "K", "count/token", *(["counted/token"] if partial else []), "weight MB",
                "vendor µs", "vendor GB/s (% limit)"]
        for b in peers:
            head += [f"{b} µs", f"{b} GB/s (% limit)"]
        for b in comp.backends:
            head += [f"{b} µs", f"{b} GB/s (% limit)", f"{b} speedup"]
        head += ["tuned µs", "tuned / vendor", "best peer", "tuned / best peer", "winner"]
    rows = []
    for p in comp.problems:
        v, served, peer = p.vendor, p.served_us(), p.best_peer
        peer_us = None if peer is None else peer.time_us
        if compact:
            count = str(p.count) if comp.calls(p) == p.count else f"{p.count}\n({comp.calls(p):g} counted)"
            row = [f"{p.op} {p.label}", count, f"{p.weight_bytes / 1e6:.2f}", f"{v.time_us:.2f} µs\n{_rate(v)}"]
            for b in peers:
                x = p.baselines.get(b)
                row.append("-" if x is None else f"{x.time_us:.2f} µs\n{_rate(x)}")
            for b in comp.backends:
                x = p.best.get(b)
                row.append("-" if x is None else f"{x.time_us:.2f} µs {x.speedup:.3f}x\n{_rate(x)}")
            row.append(f"{served:.2f} µs\n{_ratio(p.stock.time_us, served)} vendor, {_ratio(peer_us, served)} "
                       f"{'peer' if peer is None else peer.label}")
        else:
            row = [p.op, str(p.m), str(p.n), str(p.k), str(p.count),
                   *([f"{comp.calls(p):g}"] if partial else []), f"{p.weight_bytes / 1e6:.2f}",
                   f"{v.time_us:.2f}", _bw(v)]
            for b in peers:
                x = p.baselines.get(b)
                row += ["-", "-"] if x is None else [f"{x.time_us:.2f}", _bw(x)]
            for b in comp.backends:
                x = p.best.get(b)
                row += ["-", "-", "-"] if x is None else [f"{x.time_us:.2f}", _bw(x), f"{x.speedup:.3f}x"]
            row += [f"{served:.2f}", _ratio(p.stock.time_us, served),
                    "-" if peer is None else f"{peer.label} {peer.time_us:.2f}", _ratio(peer_us, served)]
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
    """Header and rows of the per-token prediction, one row per M (times in ms).

    vendor: the stock path; tuned: what the table serves; "<backend> only": tuned with that backend alone;
    "<peer> ms": that peer on every problem it was measured on, the stock path elsewhere, with its speedup
    over vendor and the calls it served; best peer: per problem the fastest peer (stock where none)."""
    calls = "GEMV calls" if all(p.op == "gemv" for p in comp.problems) else "calls"
    head = ["M", calls, "vendor ms", "tuned ms", "s (tuned)",
            *(f"{b} only ms (s)" for b in comp.backends), *(f"{b} ms (s; calls served)" for b in comp.peers),
            "best peer ms", "tuned / best peer", "floor ms", "% of limit vendor / tuned"]
    rows = []
    for t in comp.tokens:
        row = [f"{t.calls:g}", f"{t.vendor_us / 1e3:.3f}", f"{t.tuned_us / 1e3:.3f}", f"{t.speedup:.4f}"]
        row.insert(0, str(t.m))
        for b in comp.backends:
            us = t.only_us.get(b)
            row.append("-" if us is None else f"{us / 1e3:.3f} ({t.vendor_us / us:.4f})")
        for b in comp.peers:
            us = t.peer_us.get(b)
            row.append("-" if us is None else
                       f"{us / 1e3:.3f} ({t.vendor_us / us:.4f}; {t.peer_calls[b]:g} of {t.calls:g})")
        if t.best_peer_us is None:
            row += ["-", "-"]
        else:
            row += [f"{t.best_peer_us / 1e3:.3f}", f"{t.over_best_peer:.4f}"]
        if t.floor_us is None:
            row += ["-", "-"]
        else:
            row += [f"{t.floor_us / 1e3:.3f}",
                    f"{100 * t.floor_us / t.vendor_us:.1f}% / {100 * t.floor_us / t.tuned_us:.1f}%"]
        rows.append(row)
    return head, rows


def amdahl_table(comp: Comparison) -> tuple[list[str], list[list[str]]]:
    """Predicted service speedup 1 / ((1 - f) + f / s) per M, variant and share f (peers: s = vendor / peer)."""
    head = ["M", "variant", "s (linear part)"] + [f"f = {f:.0%}" for f in AMDAHL_SHARES]
    rows = []
    for t in comp.tokens:
        variants = [("tuned (all backends)", t.speedup)]
        variants += [(f"{b} only", t.vendor_us / us) for b, us in t.only_us.items()]
        variants += [(f"{b} (peer)", t.vendor_us / us) for b, us in t.peer_us.items()]
        if t.best_peer_us is not None:
            variants.append(("best peer", t.vendor_us / t.best_peer_us))
        for name, s in variants:
            rows.append([str(t.m), name, f"{s:.4f}"] + [f"{amdahl(f, s):.4f}x" for f in AMDAHL_SHARES])
    return head, rows


def _limit_source(probe: dict, kind: str) -> str:
    """Where a limit came from: the probe's streaming kernel, or the faster verified kernel that raised it."""
    by = probe.get(f"{kind}_raised_by")
    if not by:
        return "probe"
    return f"the best measured: {by}, above the probe's {format_gbps(probe.get(f'{kind}_probe_gbps'))} GB/s"


def _header_lines(comp: Comparison) -> list[str]:
    meta, probe = comp.meta, comp.meta.get("probe", {})
    device = meta.get("device", {})
    return [
        f"GPU: {comp.gpu}, {device.get('cu_count', '?')} CUs, {device.get('runtime', '?')}",
        "read limit: none (CPU interpreter timing is not bandwidth evidence)" if comp.is_interpreter else
        f"read limit: {format_gbps(comp.read_gbps)} GB/s ({_limit_source(probe, 'read')}, {probe.get('kind', '?')} "
        f"timing; copy {format_gbps(probe.get('copy_gbps'))} GB/s, {_limit_source(probe, 'copy')})",
        f"model: {meta.get('model') or '-'}; tuned backends in this run: {', '.join(comp.present) or 'none'}",
        f"command: {meta.get('command', '?')}",
        f"timing kind: {comp.timing_kind}; source: {comp.run_dir}/final.csv (interleaved final re-measure)",
    ]


_CPU_WARNING = ("CPU TIMINGS: these are Triton/PyTorch interpreter timings on the CPU, "
                "NOT performance evidence; they only show the pipeline works.")


def print_comparison(console: Console, comp: Comparison) -> None:
    """Print the per-problem table, the per-token prediction and the Amdahl table with rich."""

    for line in _header_lines(comp):
        console.print(escape(line))
    if comp.is_interpreter:
        console.print(f"[bold red]{_CPU_WARNING}[/]")
    for note in comp.notes:
        console.print(f"[yellow]note: {escape(note)}[/]")
    for line in comp.peer_lines:
        console.print(f"peer {escape(line)}")
    for line in comp.path_lines:
        console.print(f"per-token path, {escape(line)}")
    tables = (("per problem: best of each backend, speedup over vendor, GB/s and % of read limit; tuned over "
               "vendor and over the best peer",
               problem_table(comp, compact=True), None),
              ("per token: sum of counted calls x time; tuned = best tuned where it beats the stock path, else "
               "vendor; s = vendor / tuned; a peer on the problems it was measured on, vendor elsewhere",
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


def _time_split_lines(run_dir: Path) -> list[str]:
    """report.md's section on where the search's time went, or nothing where the run has no time.json."""
    table = split_table(run_dir)
    if table is None:
        return []
    phases = read_time(run_dir) or {}
    workers = len(phases.get("workers", []))
    return ["## Where the search's time went", "",
            f"The last search's wall time, {phases.get('wall_s', 0.0):.0f} s with {workers} worker(s), by part: "
            "in each worker call, compile (build and first launch), verify (the fp64 check) and time (the "
            "measurement); other = the rest of the call (failed candidates, transfer). A worker times on the "
            "device only during `time s` and the final re-measure.", "", _md_table(*table), ""]


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
    out += ["## Peers", "", "Every baseline other than vendor is a peer: timed in the same interleaved session, "
            "with the same weight rotation and graphs, on each problem it can run. Where a peer was not timed, "
            "the run's record says why.", ""]
    out += [f"- {line}" for line in comp.peer_lines] + [""]
    winners = winning_peer_lines(comp)
    if winners:
        out += ["### Peers that win", "", "Where a peer is faster than what the table serves, and why the table does "
                "not serve it:", ""] + [f"- {line}" for line in winners] + [""]
    out += ["## Per problem", "", "Best candidate of each backend; GB/s over the bytes one call must move, "
            "% of the measured read limit; speedup over vendor in the same session; winner = fastest incl. "
            "vendor and the peers. tuned = the best tuned candidate where it beats the stock path (the dispatch "
            "table's gate; a peer is reported, not a bar), vendor elsewhere; tuned / vendor and tuned / best "
            "peer are time ratios (above 1: tuned is faster)." + baseline_note, "", _md_table(*problem_table(comp)), ""]
    counted = [f"- {line}" for line in comp.path_lines] or [
        "- every problem of the run counted as listed (no served fused family overlaps another problem)"]
    out += ["## Per token", "", f"Sum over problems of counted calls x time per decoded token. tuned = per "
            f"problem as above, what the dispatch table serves (the table also requires a gain of at least "
            f"min_gain = {format_value(comp.meta.get('min_gain'), '.1%')}); a peer's column: that peer on every "
            "problem it was measured on (calls served of all), vendor elsewhere; best peer: per problem the "
            "fastest peer, vendor where none; floor = every call at the read limit. "
            f"This is a {EVIDENCE}.", "", "Path counted (one served path per layer):", "", *counted, "",
            _md_table(*token_table(comp)), ""]
    out += ["### Predicted service speedup (Amdahl)", "", "If a share f of decode time is spent in these GEMVs "
            "and the rest is unchanged: 1 / ((1 - f) + f / s). A prediction from standalone microbenchmarks, "
            "to be checked end to end.", "", _md_table(*amdahl_table(comp)), ""]
    configs = config_table(comp)
    if configs[1]:
        out += ["## Best configs", "", "The config of each backend's best candidate (the kernel's own tunable "
                "names), to read which variant won: for GEMV, Triton's `M_MODE`, HIP's `MMA`.", "",
                _md_table(*configs), ""]
    out += _time_split_lines(comp.run_dir)
    notes = plot_notes(comp)  # one line per chart left out, in its place
    if plots or notes:
        out += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [f"- {n}" for n in notes] + [""]
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
    split = split_table(Path(run_dir))
    if split is not None:
        table = Table(*split[0], title="where the search's time went (report.md)")
        for row in split[1]:
            table.add_row(*(escape(cell) for cell in row))
        console.print(table)
    md = write_markdown(comp, plots)
    tables = write_csv(comp)
    console.print(f"wrote {md}" + "".join(f", {p.name}" for p in [*tables, *plots]))
    return comp


def write_csv(comp: Comparison) -> list[Path]:
    """RUN/compare_problems.csv and RUN/compare_tokens.csv: the cells of report.md's per-problem and
    per-token tables, one row each (the same strings, so the three outputs agree)."""
    paths = []
    for name, (head, rows) in (("compare_problems.csv", problem_table(comp)), ("compare_tokens.csv",
                                                                              token_table(comp))):
        path = comp.run_dir / name
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(head)
            writer.writerows(rows)
        paths.append(path)
    return paths
