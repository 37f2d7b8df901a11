"""`tunekit compare`'s PNGs: no %-of-limit chart without a limit, the per-token title names its ops, a run of
40 problems facets by M and grows with its shapes with no two labels on top of each other."""

from __future__ import annotations

import io
import itertools
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from tunekit.evidence import compare, plots  # noqa: E402
from tunekit.evidence.comparison import load_comparison  # noqa: E402

READ_GBPS, COPY_GBPS = 4000.0, 3500.0
MS = (1, 2, 4, 8)
# ten shapes of four op families (op, n, k, count, names): with MS, 40 problems
SHAPES = [("gemv", 4096 + 512 * i, 4096, 2, f"layer_{i}.proj") for i in range(6)] + [
    ("rms_gemv", 6144, 4096, 32, "input_layernorm+qkv_proj"),
    ("rms_norm", 4096, 4096, 65, "input_layernorm;post_attention_layernorm;norm"),
    ("silu_and_mul", 14336, 28672, 32, "mlp.act_fn"),
    ("rms_gemv", 28672, 4096, 32, "post_attention_layernorm+mlp.gate_up_proj"),
]


def _write_run(path: Path, shapes: list[tuple], ms: tuple[int, ...] = MS, kind: str = "gpu") -> Path:
    """A run folder as `tunekit search` writes it: vendor, two Triton and one HIP candidate per problem."""
    from tunekit.problems import opspec
    from tunekit.problems.shapes import Problem

    path.mkdir(parents=True, exist_ok=True)
    rows, problems = [], []
    for j, (m, (op, n, k, count, names)) in enumerate(itertools.product(ms, shapes)):
        problems.append({"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "count": count,
                         "names": names.split(";")})
        nbytes = opspec.get(op).bytes_moved(Problem(op, "bf16", m, n, k))
        limit = READ_GBPS if opspec.get(op).limit == "read" else COPY_GBPS
        base = 5.0 + nbytes / 3e6
        for i, (backend, t) in enumerate([("vendor", base), ("triton", base * (0.8 + 0.03 * (j % 7))),
                                          ("triton", base * 1.2), ("hip", base * (0.9 + 0.02 * (j % 5)))]):
            gbps = nbytes / (t * 1e-6) / 1e9
            rows.append({"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "count": count, "names": names,
                         "label": backend if backend == "vendor" else f"{backend}#{i}", "backend": backend,
                         "trial": None if backend == "vendor" else i, "params": "{}", "time_us": t,
                         "time_p25_us": t, "time_p75_us": t, "spread": 0.0, "baseline_us": base,
                         "speedup": base / t, "gbps": gbps, "pct_of_limit": 100 * gbps / limit,
                         "max_abs_err": None, "err_ratio": None, "timing_kind": kind, "numerics": "bounded"})
    meta = {"command": "tunekit search --shape ...", "model": None, "backends": ["triton", "hip"],
            "min_gain": 0.01, "problems": problems,
            "device": {"name": "Test GPU", "arch": "sm_00", "cu_count": 1, "runtime": "none"},
            "probe": {"read_gbps": READ_GBPS, "copy_gbps": COPY_GBPS, "kind": kind}, "environment": {}}
    (path / "run.json").write_text(json.dumps(meta))
    pd.DataFrame(rows).to_csv(path / "final.csv", index=False)
    return path


def _drawn(fig: Figure):
    """Lay the figure out and draw it as the PNG is drawn; return its renderer."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _overlapping(texts, renderer) -> list[tuple[str, str]]:
    """The pairs of visible, non-empty texts whose drawn boxes overlap."""
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_visible() and t.get_text()]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def _labels_apart(fig: Figure) -> None:
    """No two tick labels of an axis overlap, nor two texts inside one panel (the bars' values), and every
    text of the figure lies inside it."""
    renderer = _drawn(fig)
    whole = Bbox.from_bounds(0, 0, *fig.canvas.get_width_height())
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            assert not _overlapping(labels, renderer), (ax.get_title(), _overlapping(labels, renderer))
        assert not _overlapping(ax.texts, renderer), (ax.get_title(), _overlapping(ax.texts, renderer)[:3])
        texts = [*ax.texts, *ax.get_yticklabels(), *ax.get_xticklabels(), ax.title]
        legend = ax.get_legend()
        if legend is not None:
            texts += legend.get_texts()
        for t in texts:
            if t.get_visible() and t.get_text():
                box = t.get_window_extent(renderer)
                assert whole.contains(box.x0, box.y0) and whole.contains(box.x1, box.y1), t.get_text()


def test_no_pct_chart_without_a_limit(tmp_path) -> None:
    shapes = SHAPES[:2]
    gpu = compare.compare_run(_write_run(tmp_path / "gpu", shapes), Console(file=io.StringIO()))
    assert (gpu.run_dir / plots.PLOT_FILES["pct"]).is_file() and plots.plot_notes(gpu) == []
    # the CPU interpreter's run: no limit, so no chart, and the report says why in one line instead
    run = _write_run(tmp_path / "cpu", shapes, kind="cpu")
    (run / plots.PLOT_FILES["pct"]).write_bytes(b"an earlier compare's chart")
    comp = compare.compare_run(run, Console(file=io.StringIO()))
    assert comp.is_interpreter and plots.pct_figure(comp) is None
    assert not (run / plots.PLOT_FILES["pct"]).exists()
    assert (run / plots.PLOT_FILES["speedup"]).is_file() and (run / plots.PLOT_FILES["token"]).is_file()
    md = (run / "report.md").read_text()
    assert plots.PLOT_FILES["pct"] not in md
    notes = [line for line in md.splitlines() if "%-of-limit" in line]
    assert len(notes) == 1 and "no measured bandwidth limit" in notes[0]
    assert "%-of-limit" not in (gpu.run_dir / "report.md").read_text()


def test_per_token_title_names_every_stacked_op(tmp_path) -> None:
    comp = load_comparison(_write_run(tmp_path / "run", SHAPES, ms=(1,)))
    fig = plots.token_figure(comp)
    title = " ".join(t.get_text() for t in fig.texts)  # the suptitle
    assert plots.stacked_ops(comp) == ["gemv", "rms_gemv", "rms_norm", "silu_and_mul"]
    for op in ("gemv", "rms_gemv", "rms_norm", "silu_and_mul"):
        assert re.search(rf"(?<![\w]){op}(?![\w])", title), (op, title)
    assert "GEMV" not in title and "GEMV" not in fig.axes[0].get_ylabel()
    # the legend names each stacked problem's op too
    entries = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert sum(e.startswith("rms_gemv ") for e in entries) == 2 and any(e.startswith("rms_norm ") for e in entries)
    # a norm folded whole into its rms_gemv counts no call per token: not stacked, so not named
    norm = ("rms_norm", 4096, 4096, 64, "input_layernorm;post_attention_layernorm")
    folded = [s if s[0] != "rms_norm" else norm for s in SHAPES]
    comp = load_comparison(_write_run(tmp_path / "folded", folded, ms=(1,)))
    title = " ".join(t.get_text() for t in plots.token_figure(comp).texts)
    assert plots.stacked_ops(comp) == ["gemv", "rms_gemv", "silu_and_mul"] and "rms_norm" not in title
    # a GEMV-only run names only gemv
    only = load_comparison(_write_run(tmp_path / "gemv", SHAPES[:3], ms=(1,)))
    title = " ".join(t.get_text() for t in plots.token_figure(only).texts)
    assert re.search(r"time of gemv:", title) and "rms" not in title


def test_forty_problems_facet_by_m_and_stay_legible(tmp_path) -> None:
    comp = load_comparison(_write_run(tmp_path / "run", SHAPES))
    small = load_comparison(_write_run(tmp_path / "small", SHAPES[:2]))
    assert len(comp.problems) == 40 and len(small.problems) == 8
    for draw in (plots.pct_figure, plots.speedup_figure):
        fig, fig_small = draw(comp), draw(small)
        # one panel per M, titled, each with a row per shape
        assert [ax.get_title() for ax in fig.axes] == [f"M = {m}" for m in MS]
        assert [t.get_text() for t in fig.axes[0].get_yticklabels()][:2] == ["gemv 4096x4096", "gemv 4608x4096"]
        assert len(fig.axes[0].get_yticks()) == len(SHAPES)
        # the height grows with the shapes, the width stays at a natural size (not one column per problem)
        w, h = fig.get_size_inches()
        w_small, h_small = fig_small.get_size_inches()
        assert h >= h_small + 0.5 * (len(SHAPES) - 2) and w == pytest.approx(w_small, abs=1.0) and w <= 20
        _labels_apart(fig)
    _labels_apart(plots.token_figure(comp))


def test_one_m_and_forty_shapes_grows_one_panel(tmp_path) -> None:
    shapes = [("gemv", 1024 + 256 * i, 4096, 1, f"layer_{i}") for i in range(40)]
    comp = load_comparison(_write_run(tmp_path / "run", shapes, ms=(1,)))
    fig = plots.speedup_figure(comp)
    assert len(fig.axes) == 1 and len(fig.axes[0].get_yticks()) == 40
    w, h = fig.get_size_inches()
    assert h >= 40 * 0.4 and w <= 12
    _labels_apart(fig)
    token = plots.token_figure(comp)
    assert len(token.axes[0].get_legend().get_texts()) == 1 + 40  # the floor, then every problem
    _labels_apart(token)


def test_the_overlap_check_sees_a_cramped_chart(tmp_path, monkeypatch) -> None:
    """The legibility checks above can fail: rows squeezed to a few points put the labels on each other."""
    comp = load_comparison(_write_run(tmp_path / "run", SHAPES, ms=(1,)))
    monkeypatch.setattr(plots, "_BAR_IN", 0.02)
    monkeypatch.setattr(plots, "_GAP_IN", 0.0)
    with pytest.raises(AssertionError):
        _labels_apart(plots.pct_figure(comp))
