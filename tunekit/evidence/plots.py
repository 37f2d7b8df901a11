"""The PNGs of ``tunekit compare``: % of the limit and speedup per problem, per-token time per M.

Call protocol: ``write_plots(comp)`` draws a :class:`~tunekit.evidence.comparison.Comparison` on
Matplotlib's Agg canvas (no pyplot state) into the run folder and returns the paths of the files it
drew (a subset of ``PLOT_FILES``); a chart with nothing to show is not drawn, its stale file from an
earlier compare is removed, and ``plot_notes(comp)`` (no matplotlib needed) gives report.md one line
per chart left out. ``pct_figure``, ``speedup_figure`` and ``token_figure`` return the figures
themselves (``None`` where left out). Everything but ``plot_notes`` raises ImportError where
matplotlib is not installed.

Layout: the per-problem charts are horizontal bars, one row per shape (op, N x K) and one panel per
M, panels wrapped four to a row; the figure grows with the number of shapes and of M values, so a
run of 40+ problems keeps its labels apart at its natural size.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunekit.evidence.comparison import Comparison, Measure, ProblemResult, format_gbps

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PLOT_FILES = {"pct": "compare_pct_of_limit.png", "speedup": "compare_speedup.png",
              "token": "compare_per_token.png"}

_COLORS = {"vendor": "#7f7f7f", "inductor": "#9467bd", "triton": "#1f77b4", "hip": "#d62728"}
#: M panels per row of a per-problem chart before it wraps
PANELS_PER_ROW = 4
#: height of one bar of a per-problem chart and the gap between shapes (inches)
_BAR_IN, _GAP_IN = 0.17, 0.16
_DPI = 120
_TITLE_CHARS = 110  # a title line wraps past this many characters


def _color(backend: str, index: int) -> Any:
    """Fixed colors for the built-in backends, tab10 for plugins."""
    from matplotlib import colormaps

    return _COLORS.get(backend) or colormaps["tab10"](index % 10)


def _stack_color(index: int) -> Any:
    """Color ``index`` of tab20, tab20b, tab20c in turn (60 distinct colors for the stacked problems)."""
    from matplotlib import colormaps

    name = ("tab20", "tab20b", "tab20c")[(index // 20) % 3]
    return colormaps[name](index % 20)


# ---- what the charts show (pure: no matplotlib) ---------------------------------------------------

def _measures(p: ProblemResult) -> list[Measure]:
    return [p.vendor, *p.baselines.values(), *p.best.values()]


def has_limit(comp: Comparison) -> bool:
    """Whether any figure carries a % of a measured limit (never on the CPU interpreter)."""
    return any(x.pct_of_limit is not None for p in comp.problems for x in _measures(p))


def stacked_ops(comp: Comparison) -> list[str]:
    """The ops the per-token chart stacks (those with calls counted per token), in the run's order."""
    return list(dict.fromkeys(p.op for p in comp.problems if comp.calls(p)))


def _ops(comp: Comparison) -> list[str]:
    """Every op of the run, in its order (the per-problem charts' rows)."""
    return list(dict.fromkeys(p.op for p in comp.problems))


def plot_notes(comp: Comparison) -> list[str]:
    """One line per chart ``write_plots`` leaves out, and why (report.md prints them with the plots)."""
    notes = []
    if not has_limit(comp):
        why = ("CPU interpreter timing is not bandwidth evidence" if comp.is_interpreter
               else "the run's probe recorded none")
        notes.append(f"No %-of-limit chart: this run has no measured bandwidth limit ({why}).")
    if not comp.present:
        notes.append("No speedup chart: no tuned backend has a re-measured candidate in this run.")
    return notes


def _shape_label(p: ProblemResult, dtypes: int) -> str:
    """The problem without its M, op always named (``gemv 5120x17408``); the dtype where a run mixes them."""
    shape = p.label.removeprefix(f"m{p.m} ")
    return f"{p.op} {shape}" + (f" {p.dtype}" if dtypes > 1 else "")


def _rows(comp: Comparison) -> tuple[list[tuple], dict[tuple, str]]:
    """The per-problem charts' rows: one per (op, dtype, N, K), grouped by op in the run's order."""
    ops = _ops(comp)
    dtypes = len({p.dtype for p in comp.problems})
    labels = {}
    for p in comp.problems:
        labels.setdefault((p.op, p.dtype, p.n, p.k), _shape_label(p, dtypes))
    keys = sorted(labels, key=lambda key: ops.index(key[0]))  # stable: shapes keep their order within an op
    return keys, labels


def _title(head: str, comp: Comparison, width_in: float | None = None) -> str:
    """``head`` wrapped to the figure's width (about 10.5 characters an inch at "medium"), then the device line."""
    tail = f"{comp.gpu}, {comp.timing_kind} timing" + (" (CPU: NOT performance evidence)"
                                                       if comp.is_interpreter else "")
    chars = _TITLE_CHARS if width_in is None else max(40, int(10.5 * width_in))
    return "\n".join([*textwrap.wrap(head, chars), tail])


# ---- per-problem charts: one panel per M, one row per shape ---------------------------------------

Series = tuple[str, Callable[[ProblemResult], "float | None"]]


def _per_problem(comp: Comparison, series: list[Series], *, title: str, xlabel: str, ref: float,
                 ref_label: str, fmt: Callable[[float], str]) -> Figure:
    """Horizontal grouped bars: a panel per M (wrapped ``PANELS_PER_ROW`` to a row), a row per shape."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    keys, labels = _rows(comp)
    ms = sorted({p.m for p in comp.problems})
    by_key = {(p.op, p.dtype, p.n, p.k, p.m): p for p in comp.problems}
    ncols = min(PANELS_PER_ROW, len(ms))
    nrows = math.ceil(len(ms) / ncols)
    # per shape, the series it has a figure for (a GEMV has no Inductor bar): its bars close up around the row
    present = {key: [i for i, (_, fn) in enumerate(series)
                     if any(fn(p) is not None for p in comp.problems if (p.op, p.dtype, p.n, p.k) == key)]
               for key in keys}
    width = max([1, *(len(v) for v in present.values())])
    panel_h = (_BAR_IN * width + _GAP_IN) * len(keys) + 0.6  # the rows, the panel's title and its x ticks
    label_in = 0.4 + 0.065 * max(len(s) for s in labels.values())  # y tick labels at "small"
    width_in = label_in + 3.4 * ncols + 1.6
    fig = Figure(figsize=(width_in, nrows * panel_h + 1.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False)
    top = max([ref] + [v for _, fn in series for p in comp.problems if (v := fn(p)) is not None])
    bar_h = 1.0 / (width + 0.9)
    ys = list(range(len(keys)))
    ops = [key[0] for key in keys]
    for j, m in enumerate(ms):
        ax: Axes = axes[j // ncols][j % ncols]
        for i, (name, fn) in enumerate(series):
            pts = []
            for y, key in enumerate(keys):
                p = by_key.get(key + (m,))
                v = None if p is None else fn(p)
                if v is not None:
                    pos = present[key].index(i) - (len(present[key]) - 1) / 2
                    pts.append((y + pos * bar_h, v))
            if pts:
                bars = ax.barh([y for y, _ in pts], [v for _, v in pts], bar_h, color=_color(name, i))
                # on a white box: a value just short of the reference line stays readable across it
                ax.bar_label(bars, labels=[fmt(v) for _, v in pts], fontsize=6.5, padding=2,
                             bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.85})
        for y, key in enumerate(keys):
            if key + (m,) not in by_key:  # this shape was not a problem at this M: say so, not a blank row
                ax.text(0.01 * top, y, "not in this run at this M", va="center", fontsize=6.5, color="0.5")
        for y in range(1, len(keys)):
            if ops[y] != ops[y - 1]:  # a rule between op families
                ax.axhline(y - 0.5, color="0.75", linewidth=0.8)
        ax.axvline(ref, color="black", linestyle="--", linewidth=1)
        ax.set_xlim(0, top * 1.2)
        ax.set_title(f"M = {m}", fontsize="medium")
        ax.tick_params(axis="x", labelsize="small")
        ax.grid(axis="x", color="0.9", linewidth=0.6)
        ax.set_axisbelow(True)
    for j in range(len(ms), nrows * ncols):
        fig.delaxes(axes[j // ncols][j % ncols])
    first = axes[0][0]
    first.set_yticks(ys, [labels[key] for key in keys], fontsize="small")
    first.set_ylim(len(keys) - 0.5, -0.5)  # the run's first shape on top
    for r in range(nrows):
        axes[r][0].tick_params(axis="y", labelleft=True)
    handles = [Patch(color=_color(name, i), label=name) for i, (name, _) in enumerate(series)]
    handles.append(Line2D([], [], color="black", linestyle="--", linewidth=1, label=ref_label))
    fig.supxlabel(xlabel, fontsize="small")
    # on the top-right panel, outside it: the layout makes room for it (a figure legend meets the title)
    axes[0][ncols - 1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small",
                              frameon=False)
    fig.suptitle(_title(title, comp, width_in), fontsize="medium")
    return fig


def _series_names(comp: Comparison) -> list[str]:
    """vendor, the other baselines measured (Inductor), then the tuned backends present."""
    return ["vendor", *sorted({b for p in comp.problems for b in p.baselines}), *comp.present]


def _measure_of(p: ProblemResult, backend: str) -> Measure | None:
    return p.vendor if backend == "vendor" else p.baselines.get(backend) or p.best.get(backend)


def pct_figure(comp: Comparison) -> Figure | None:
    """% of the op's measured limit per problem and backend; None where the run has no limit (CPU)."""
    if not has_limit(comp):
        return None
    from tunekit.problems import opspec  # which limit each op is held to (torch is loaded with the comparison)

    limits = {opspec.get(op).limit for op in _ops(comp)}
    gbps = {"read": comp.read_gbps, "copy": comp.meta.get("probe", {}).get("copy_gbps")}

    def pct(backend: str) -> Callable[[ProblemResult], float | None]:
        return lambda p: getattr(_measure_of(p, backend), "pct_of_limit", None)

    series = [(b, pct(b)) for b in _series_names(comp)]
    if len(limits) == 1:
        (limit,) = limits
        xlabel = f"% of the measured {limit} limit ({format_gbps(gbps[limit])} GB/s)"
    else:
        xlabel = (f"% of the op's measured limit (GEMV families: read {format_gbps(gbps['read'])} GB/s, "
                  f"elementwise: copy {format_gbps(gbps['copy'])} GB/s)")
    ref_label = f"{limits.pop()} limit (100%)" if len(limits) == 1 else "the op's limit (100%)"
    return _per_problem(comp, series, title="Bandwidth efficiency per problem", xlabel=xlabel,
                        ref=100.0, ref_label=ref_label,
                        fmt=lambda v: f"{v:.1f}" if v < 10 else f"{v:.0f}")  # latency-bound ops sit below 1%


def speedup_figure(comp: Comparison) -> Figure | None:
    """Each tuned backend's best over the stock path, per problem; None where none was tuned."""
    if not comp.present:
        return None
    # speedups are over the stock path: vendor, or Inductor where the run measured it faster (elementwise ops)
    inductor = any(p.stock is not p.vendor for p in comp.problems)

    def speedup(backend: str) -> Callable[[ProblemResult], float | None]:
        return lambda p: p.best[backend].speedup if backend in p.best else None

    over = "the stock path (vendor or Inductor)" if inductor else "vendor"
    return _per_problem(comp, [(b, speedup(b)) for b in comp.present],
                        title=f"Speedup of each backend's best candidate over {over}",
                        xlabel=f"speedup over {'the stock path' if inductor else 'vendor'} "
                               "(x, same session)",
                        ref=1.0, ref_label="stock path (1.0)" if inductor else "vendor (1.0)",
                        fmt=lambda v: f"{v:.2f}")


# ---- per-token chart: the problems of each M stacked, baseline vs tuned ---------------------------

def token_title(comp: Comparison, width_in: float | None = None) -> str:
    """The per-token chart's title: every op it stacks named."""
    ops = stacked_ops(comp)
    return _title(f"Per-token time of {', '.join(ops)}: sum of count x standalone microbenchmark time",
                  comp, width_in)


def _names(p: ProblemResult) -> str:
    """The layers a problem serves; nothing where they only repeat the shape (``--shape`` problems)."""
    names = p.names.replace(";", ", ")
    return "" if names.startswith("shape ") else names


def token_figure(comp: Comparison) -> Figure:
    """Per M the per-token time of the baseline and of what the table serves, stacked by problem."""
    from matplotlib.figure import Figure

    keys, labels = _rows(comp)
    names = {(p.op, p.dtype, p.n, p.k): _names(p) for p in comp.problems}
    gemv_only = all(p.op == "gemv" for p in comp.problems)
    # the bar the tuned one is set against: the stock path (vendor, or Inductor where it was faster)
    base = "stock" if any(p.stock is not p.vendor for p in comp.problems) else "vendor"
    ncol = 1 if len(keys) <= 24 else 2
    legend_h = 0.2 * math.ceil(len(keys) / ncol) + 1.0
    entry_chars = max(len(f"{labels[key]}  {names[key]}") for key in keys)
    width = max(7.5, 1.8 * len(comp.tokens) + 1.8 + ncol * (0.7 + 0.062 * entry_chars))
    fig = Figure(figsize=(width, max(5.4, legend_h + 1.2)), layout="constrained")
    ax = fig.add_subplot()
    # ms, or µs where a token's baseline sum stays under 0.1 ms (the norms alone)
    unit, scale = ("ms", 1e3) if max(t.vendor_us for t in comp.tokens) >= 100 else ("µs", 1.0)
    ticks, tick_labels = [], []
    handles: dict[str, Any] = {}
    for j, t in enumerate(comp.tokens):
        group = {(p.op, p.dtype, p.n, p.k): p for p in comp.problems if p.m == t.m}
        # the stock path (vendor, or Inductor where faster), as the per-token table's vendor sum: never a peer
        for i, (kind, get) in enumerate(((base, lambda p: p.stock.time_us),
                                         ("tuned", ProblemResult.served_us))):
            x = 3 * j + i
            bottom = 0.0
            for s, key in enumerate(keys):
                p = group.get(key)
                if p is None or not comp.calls(p):  # a folded norm: its calls are counted in its rms_gemv
                    continue
                height = comp.calls(p) * get(p) / scale  # the calls the per-token sums count (served path)
                bar = ax.bar(x, height, 0.8, bottom=bottom, color=_stack_color(s))
                handles.setdefault(key, bar)
                bottom += height
            ax.text(x, bottom, f"{bottom:{'.3f' if unit == 'ms' else '.2f'}} {unit}", ha="center", va="bottom",
                    fontsize="small")
            ticks.append(x)
            tick_labels.append(f"M={t.m}\n{kind}")
        if t.floor_us is not None:
            line = ax.hlines(t.floor_us / scale, 3 * j - 0.45, 3 * j + 1.45, colors="black", linestyles="--")
            handles.setdefault("floor", line)
    ax.set_xticks(ticks, tick_labels)
    ax.set_ylabel(f"time per decoded token ({unit})")
    ax.margins(y=0.1)
    entries = [(handles[key], f"{labels[key]}  {names[key]}".rstrip()) for key in keys if key in handles]
    if "floor" in handles:
        entries.insert(0, (handles["floor"], "read-limit floor" if gemv_only
                           else "floor: every call at its op's limit"))
    ax.legend([h for h, _ in entries], [text for _, text in entries], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize="small", ncol=ncol, title="problem (op shape, layers)", title_fontsize="small")
    fig.suptitle(token_title(comp, width), fontsize="medium")
    return fig


def write_plots(comp: Comparison) -> list[Path]:
    """Write the charts that have something to show into the run folder; return their paths.

    A chart left out (see ``plot_notes``) has its file from an earlier compare removed, so the folder
    never shows a chart the report does not.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figures = {"pct": pct_figure(comp), "speedup": speedup_figure(comp), "token": token_figure(comp)}
    paths = []
    for key, fig in figures.items():
        path = comp.run_dir / PLOT_FILES[key]
        if fig is None:
            path.unlink(missing_ok=True)
            continue
        FigureCanvasAgg(fig)
        fig.savefig(path, dpi=_DPI)
        paths.append(path)
    return paths
