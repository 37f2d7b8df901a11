"""The three PNGs of ``tunekit compare``: % of the limit and speedup per problem, per-token time per M.

Call protocol: ``write_plots(comp)`` draws a :class:`~tunekit.evidence.comparison.Comparison` on
Matplotlib's Agg canvas (no pyplot state) into the run folder and returns the paths
(``PLOT_FILES``); it raises ImportError where matplotlib is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunekit.evidence.comparison import Comparison, ProblemResult, format_gbps

PLOT_FILES = {"pct": "compare_pct_of_limit.png", "speedup": "compare_speedup.png",
              "token": "compare_per_token.png"}

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
        ax.set_ylabel(f"% of the op's measured limit\n(GEMV: read {format_gbps(comp.read_gbps)} GB/s, "
                      f"elementwise: copy {format_gbps(copy_gbps)} GB/s)", fontsize="small")
    else:
        ax.set_ylabel(f"% of measured read limit ({format_gbps(comp.read_gbps)} GB/s)")
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
