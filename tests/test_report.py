"""`tunekit compare`: per-problem figures, per-token prediction, Amdahl, report.md + plots, CLI."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from tunekit.errors import UserError
from tunekit.evidence import compare as report
from tunekit.evidence import comparison, plots
from tunekit.evidence import search_summary as summary

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "benchmarks" / "results" / "h200-m1-triton-9251ae9"
READ_GBPS = 1000.0
# (n, k, count, names) of the two synthetic shapes
SHAPE_A = (1000, 500, 2, "a_proj")
SHAPE_B = (250, 1000, 3, "b_proj;c_proj")
# m -> shape -> [(backend, time_us), ...]: every winner kind occurs once or more
TIMES = {
    1: {SHAPE_A: [("vendor", 10.0), ("triton", 8.0), ("triton", 8.5), ("hip", 9.0)],
        SHAPE_B: [("vendor", 4.0), ("triton", 5.0), ("hip", 6.0)]},
    2: {SHAPE_A: [("vendor", 12.0), ("triton", 11.0), ("hip", 10.0), ("hip", 10.5)],
        SHAPE_B: [("vendor", 5.0), ("triton", 4.0), ("hip", 4.5)]},
}


def _bytes(m: int, n: int, k: int) -> int:
    """bf16 GEMV bytes per call: weight + x + y (opspec's roofline numerator)."""
    return 2 * (n * k + m * (n + k))


def _write_run(path: Path, backends: tuple[str, ...] = ("triton", "hip"), kind: str = "gpu") -> Path:
    """A run folder as `tunekit search` writes it, with rows computed like the engine's final re-measure."""
    path.mkdir(parents=True, exist_ok=True)
    rows, problems = [], []
    for m, shapes in TIMES.items():
        for (n, k, count, names), cands in shapes.items():
            problems.append({"op": "gemv", "dtype": "bf16", "m": m, "n": n, "k": k, "count": count,
                             "names": names.split(";")})
            base = cands[0][1]
            for i, (backend, t) in enumerate(c for c in cands if c[0] in ("vendor", *backends)):
                gbps = _bytes(m, n, k) / (t * 1e-6) / 1e9
                rows.append({"op": "gemv", "dtype": "bf16", "m": m, "n": n, "k": k, "count": count, "names": names,
                             "label": backend if backend == "vendor" else f"{backend}#{i}", "backend": backend,
                             "trial": None if backend == "vendor" else i, "params": "{}", "time_us": t,
                             "time_p25_us": t, "time_p75_us": t, "spread": 0.0, "baseline_us": base,
                             "speedup": base / t, "gbps": gbps, "pct_of_limit": 100 * gbps / READ_GBPS,
                             "max_abs_err": None, "err_ratio": None, "timing_kind": kind, "numerics": "bounded"})
    meta = {"command": "tunekit search --shape 1000x500 --m 1,2", "model": None, "backends": list(backends),
            "min_gain": 0.01, "problems": problems,
            "device": {"name": "Test GPU", "arch": "sm_00", "cu_count": 1, "runtime": "none"},
            "probe": {"read_gbps": READ_GBPS, "copy_gbps": 800.0, "kind": kind}, "environment": {}}
    (path / "run.json").write_text(json.dumps(meta))
    pd.DataFrame(rows).to_csv(path / "final.csv", index=False)
    return path


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _problem(comp: comparison.Comparison, m: int, n: int) -> comparison.ProblemResult:
    return next(p for p in comp.problems if p.m == m and p.n == n)


def test_per_problem_best_winner_and_pct(tmp_path) -> None:
    comp = comparison.load_comparison(_write_run(tmp_path / "run"))
    assert comp.present == ["triton", "hip"] and comp.timing_kind == "gpu" and not comp.is_interpreter
    a1 = _problem(comp, 1, 1000)
    assert a1.vendor.time_us == 10.0 and a1.best["triton"].time_us == 8.0 and a1.best["hip"].time_us == 9.0
    assert a1.best["triton"].speedup == pytest.approx(10 / 8) and a1.best["hip"].speedup == pytest.approx(10 / 9)
    assert a1.weight_bytes == 1_000_000 and a1.bytes_moved == 1_003_000
    assert a1.best["triton"].pct_of_limit == pytest.approx(100 * 1_003_000 / 8e3 / READ_GBPS)  # 12.5375 %
    assert a1.best["triton"].gbps == pytest.approx(125.375)
    winners = {(p.m, p.n): p.winner.backend for p in comp.problems}
    assert winners == {(1, 1000): "triton", (1, 250): "vendor", (2, 1000): "hip", (2, 250): "triton"}
    assert _problem(comp, 2, 1000).winner.time_us == 10.0


def test_per_token_prediction_amdahl_and_floor(tmp_path) -> None:
    comp = comparison.load_comparison(_write_run(tmp_path / "run"))
    t1, t2 = comp.tokens
    assert (t1.m, t1.calls, t2.m) == (1, 5, 2)
    # M=1: vendor 2*10 + 3*4; tuned 2*min(8, 9, 10) + 3*min(5, 6, 4)
    assert (t1.vendor_us, t1.tuned_us) == (32.0, 28.0)
    assert t1.only_us == {"triton": 28.0, "hip": 2 * 9.0 + 3 * 4.0}
    assert t1.speedup == pytest.approx(32 / 28)
    # M=2: vendor 2*12 + 3*5; tuned 2*10 (hip) + 3*4 (triton)
    assert (t2.vendor_us, t2.tuned_us) == (39.0, 32.0)
    assert t2.only_us == {"triton": 2 * 11.0 + 3 * 4.0, "hip": 2 * 10.0 + 3 * 4.5}
    assert report.amdahl(0.5, t1.speedup) == pytest.approx(16 / 15)  # 1 / (0.5 + 0.5 * 7/8)
    assert report.amdahl(0.9, 2.0) == pytest.approx(1 / 0.55) and report.amdahl(0.0, 3.0) == 1.0
    assert t1.floor_us == pytest.approx((2 * 1_003_000 + 3 * 502_500) / (READ_GBPS * 1e3))  # 3.5135 us
    assert t2.floor_us == pytest.approx((2 * 1_006_000 + 3 * 505_000) / (READ_GBPS * 1e3))
    _, rows = report.amdahl_table(comp)
    assert rows[0][:3] == ["1", "tuned (all backends)", "1.1429"] and rows[0][3] == "1.0667x"
    assert [r[1] for r in rows] == ["tuned (all backends)", "triton only", "hip only"] * 2


def test_report_md_and_plots(tmp_path) -> None:
    run = _write_run(tmp_path / "run")
    out = Console(file=io.StringIO(), width=250)
    report.compare_run(run, out)
    md = (run / "report.md").read_text()
    assert "Test GPU (sm_00)" in md and "1000 GB/s" in md and "tunekit search --shape 1000x500" in md
    assert "standalone microbenchmark" in md and "| 1 | 5 | 0.032 | 0.028 | 1.1429 |" in md
    assert "CPU TIMINGS" not in md
    assert "## Best configs" not in md  # the synthetic rows carry no params
    for name in plots.PLOT_FILES.values():
        assert (run / name).stat().st_size > 1000 and f"]({name})" in md
    text = out.file.getvalue()
    assert "per token" in text and "hip#2" in text  # the M=2 winner of shape A


def test_triton_only_run_and_cpu_warning(tmp_path) -> None:
    run = _write_run(tmp_path / "run", backends=("triton",), kind="cpu")
    comp = report.compare_run(run, _quiet())
    assert comp.present == ["triton"] and comp.is_interpreter
    head, rows = report.problem_table(comp)
    hip = head.index("hip µs")
    assert all(row[hip:hip + 3] == ["-", "-", "-"] for row in rows)
    assert comp.tokens[0].tuned_us == 28.0 and comp.tokens[0].only_us == {"triton": 28.0}
    assert comp.tokens[1].tuned_us == 2 * 11.0 + 3 * 4.0
    md = (run / "report.md").read_text()
    assert "CPU TIMINGS" in md and "NOT performance evidence" in md
    # the rows carry a % of the CPU probe's "limit": shown nowhere, and no read-limit floor either
    assert all(x.pct_of_limit is None and p.limit_gbps is None
               for p in comp.problems for x in (p.vendor, *p.best.values()))
    assert all(t.floor_us is None for t in comp.tokens)


def test_rows_of_an_earlier_search_are_left_out(tmp_path) -> None:
    run = _write_run(tmp_path / "run")
    meta = json.loads((run / "run.json").read_text())
    meta["problems"] = [p for p in meta["problems"] if p["m"] == 1]
    (run / "run.json").write_text(json.dumps(meta))
    comp = comparison.load_comparison(run)
    assert [t.m for t in comp.tokens] == [1] and len(comp.problems) == 2
    assert comp.notes and "earlier search" in comp.notes[0]


def test_user_errors_and_empty_final(tmp_path) -> None:
    with pytest.raises(UserError, match="not a tunekit run folder"):
        comparison.load_comparison(tmp_path)
    run = _write_run(tmp_path / "run")
    (run / "final.csv").unlink()
    with pytest.raises(UserError, match="no final.csv"):
        comparison.load_comparison(run)
    pd.DataFrame([]).to_csv(run / "final.csv", index=False)  # what write_final leaves when nothing re-measured
    with pytest.raises(UserError, match="no rows"):
        comparison.load_comparison(run)
    out = _quiet()
    assert summary.report_after_search(out, run) is None
    assert "no comparison" in out.file.getvalue() and not (run / "report.md").exists()


def test_cli_compare(tmp_path) -> None:
    run = _write_run(tmp_path / "run")
    res = _cli("compare", str(run))
    assert res.returncode == 0, res.stderr
    assert "per problem" in res.stdout and (run / "report.md").is_file()
    res = _cli("compare", str(tmp_path / "nothing"))
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "not a tunekit run folder" in lines[0]


def test_recorded_h200_run(tmp_path) -> None:
    run = tmp_path / "h200"
    shutil.copytree(RECORDED, run)
    comp = report.compare_run(run, _quiet())
    frame = pd.read_csv(RECORDED / "final.csv")
    keys = ["m", "n", "k"]
    vendor = frame[frame.backend == "vendor"].set_index(keys)
    best = frame[frame.backend == "triton"].groupby(keys).time_us.min()
    served = pd.concat([best, vendor.time_us], axis=1).min(axis=1)
    vendor_us = (vendor["count"] * vendor.time_us).sum()
    tuned_us = (vendor["count"] * served).sum()
    (t,) = comp.tokens
    assert (t.m, t.calls) == (1, 305)
    assert t.vendor_us == pytest.approx(vendor_us) and t.tuned_us == pytest.approx(tuned_us)
    assert t.vendor_us / 1e3 == pytest.approx(13.5525, abs=1e-3)
    assert t.tuned_us / 1e3 == pytest.approx(12.4422, abs=1e-3)
    assert t.speedup == pytest.approx(1.0892, abs=1e-4)
    assert t.floor_us / 1e3 == pytest.approx(11.256, abs=1e-3)
    assert comp.present == ["triton"] and all(p.winner.backend == "triton" for p in comp.problems)
    ba = next(p for p in comp.problems if p.n == 96)
    assert ba.best["triton"].speedup == pytest.approx(2.867, abs=1e-3)
    assert ba.vendor.pct_of_limit == pytest.approx(3.0004, abs=1e-3)
    md = (run / "report.md").read_text()
    assert "NVIDIA H200 (sm_90)" in md and "4554 GB/s" in md and "| 1 | 305 | 13.553 | 12.442 |" in md
    # the best configs section names each winner's tunables, as final.csv recorded them
    winner = frame[(frame.n == 96) & (frame.backend == "triton")].sort_values("time_us").iloc[0]
    params = ", ".join(f"{k}={v}" for k, v in json.loads(winner.params).items())
    assert "## Best configs" in md and f"| gemv m1 96x5120 | {winner.label} | 2.867x | `{params}` |" in md
    assert all((run / name).stat().st_size > 1000 for name in plots.PLOT_FILES.values())
    assert not (RECORDED / "report.md").exists()


def test_the_search_summary_loads_neither_optuna_nor_torch() -> None:
    """The end-of-search summary and the report's figures are read without the search's or the kernels'
    libraries: only the report's own (rich; pandas and torch when final.csv is read)."""
    code = ("import sys, tunekit.evidence.search_summary, tunekit.evidence.console; "
            "print(sorted(m for m in ('optuna', 'torch', 'matplotlib', 'pandas') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
