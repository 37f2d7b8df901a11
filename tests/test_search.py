"""Search engine: CPU pipeline end to end, worker isolation, resume after a kill."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest

from tunekit import table as table_mod
from tunekit.problems.shapes import Problem
from tunekit.search.engine import SearchConfig, run_search

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")
    return env


def _tunekit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_cli_search_leaves_trials_and_a_table_that_show_accepts(tmp_path) -> None:
    out = tmp_path / "run"
    res = _tunekit("search", "--shape", "96x256", "--backend", "triton", "--trials", "4", "--out", str(out),
                   cwd=tmp_path)
    assert res.returncode == 0, res.stderr + res.stdout
    trials = pd.read_csv(out / "trials.csv")
    measured = trials[trials["measured"] == True]  # noqa: E712
    assert len(measured) == 4
    ok = measured[measured["status"] == "ok"]
    assert len(ok) >= 1
    assert (ok["err_ratio"] <= 1).all() and (ok["time_us"] > 0).all()
    assert set(ok["timing_kind"]) == {"cpu"}
    # the interpreter measures no limit: no % of one, and no study stops "near" it
    assert "pct_of_limit" not in trials or trials["pct_of_limit"].isna().all()
    assert "near the limit" not in res.stdout + res.stderr
    assert (out / "table.json").is_file() and (out / "final.csv").is_file()
    shown = _tunekit("show", str(out / "table.json"), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "tunekit.dispatch/1" in shown.stdout
    table = table_mod.load(out / "table.json")
    final = pd.read_csv(out / "final.csv")
    assert set(final["backend"]) >= {"vendor", "triton"}
    # an entry exists exactly when a tuned candidate beat vendor by >= 1% in the re-measure
    beat = (final[final["backend"] == "triton"]["speedup"] >= 1.01).any()
    assert bool(table["entries"]) == bool(beat)
    # where the time went: every measured trial split into compile, verify and time inside its worker call,
    # and the parts of the split add up to the phases the search recorded
    from tunekit.evidence.time_split import read_time, split_table

    ok_parts = ok[["compile_s", "verify_s", "time_s"]].sum(axis=1)
    assert (ok[["compile_s", "verify_s", "time_s"]] > 0).all().all() and (ok_parts <= ok["wall_s"]).all()
    phases = read_time(out)
    head, rows = split_table(out)
    by_part = {r[0]: r for r in rows}
    assert by_part["triton: worker"][1] == "4"
    totals = sum(float(r[head.index("total s")]) for r in rows)
    budget = phases["setup_s"] + phases["fusion_s"] + sum(w["trials"] + w["finals"] for w in phases["workers"])
    assert abs(totals - budget) < 0.5 and budget <= phases["wall_s"]
    assert abs(sum(float(r[-1].rstrip("%")) for r in rows) - 100.0) < 0.5
    # the final re-measure split by part: each candidate's backend built, the inputs, the graphs and timing
    final_split = phases["workers"][0]["final_split"]
    assert final_split["problems"] == 1 and final_split["time_s"] > 0 and final_split["rotation_s"] > 0
    assert set(final_split["build_s"]) >= {"vendor", "triton"}
    final_parts = [r for r in rows if r[0].startswith("final re-measure: ")]
    assert {"final re-measure: triton (build, first call, check)", "final re-measure: graphs and timing",
            "final re-measure: inputs and memory release"} <= {r[0] for r in final_parts}
    counted = final_split["rotation_s"] + final_split["time_s"] + sum(final_split["build_s"].values()) + sum(
        final_split["verify_s"].values())
    assert counted <= phases["workers"][0]["finals"]
    final_total = sum(float(r[head.index("total s")]) for r in final_parts)  # each row rounded to 0.1 s
    assert abs(final_total - phases["workers"][0]["finals"]) <= 0.05 * len(final_parts) + 1e-9
    assert "## Where the search's time went" in (out / "report.md").read_text()


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_worker_isolation_records_every_fault_and_completes(tmp_path) -> None:
    cfg = SearchConfig(
        problems=[Problem("gemv", "bf16", 1, 24, 64)], backends=["fault_backend:BACKEND"], out_dir=tmp_path,
        trials=5, sampler="grid", trial_timeout_s=20, warm_start=0,
    )
    outcome = run_search(cfg, progress=False, log=lambda s: None)
    trials = pd.read_csv(outcome.trials_path)
    by_block = {int(r.p_BLOCK_N): r for r in trials.itertuples() if r.measured is True}
    assert set(by_block) == {2, 4, 8, 16, 32}
    assert by_block[2].status == "crash" and "exit code 3" in by_block[2].error
    assert by_block[8].status == "timeout"
    assert by_block[16].status == "fail" and "build failed" in by_block[16].error
    assert by_block[32].status == "fail" and "exceeds the bound" in by_block[32].error
    assert by_block[4].status == "ok" and by_block[4].state == "COMPLETE"
    assert (outcome.stats[0].ok, outcome.stats[0].failed) == (1, 4)
    # the crash and the hang each cost one worker; the study still re-measured its winner
    assert any(r["backend"] == "fault_backend:BACKEND" for r in outcome.final_rows)


def _measured(db: Path) -> list[tuple[int, str]]:
    storage = f"sqlite:///{db}"
    out = []
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        for t in study.get_trials(deepcopy=False):
            if t.user_attrs.get("measured"):
                out.append((t.number, json.dumps(t.params, sort_keys=True)))
    return out


def _count_measured(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(db, timeout=1)
        rows = con.execute("select count(*) from trial_user_attributes where key='measured'").fetchone()
        con.close()
        return rows[0]
    except sqlite3.Error:
        return 0


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_resume_after_kill_never_remeasures_a_finished_trial(tmp_path) -> None:
    # N=8: the random sampler proposes the same configs at any N (N enters no GEMV validity rule), each
    # launch is 1 to 8 interpreter programs where 64 made BLOCK_N=1 a 64-program, 20 s trial
    out = tmp_path / "run"
    args = [sys.executable, "-m", "tunekit", "search", "--shape", "8x128", "--backend", "triton",
            "--trials", "6", "--sampler", "random", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    db = out / "optuna.db"
    deadline = time.monotonic() + 600
    while _count_measured(db) < 2:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "search made no progress"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the search and its worker, mid-study
    proc.wait()
    before = _measured(db)
    assert 2 <= len(before) < 6

    res = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    after = _measured(db)
    assert len(after) == 6
    assert set(before) <= set(after)  # finished trials kept as they were
    params = [p for _, p in after]
    assert len(params) == len(set(params))  # no parameter set measured twice
    trials = pd.read_csv(out / "trials.csv")
    if (trials["status"] == "interrupted").any():  # the trial in flight at the kill
        assert (trials[trials["status"] == "interrupted"]["state"] == "FAIL").all()


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_exact_numerics_refuses_a_one_ulp_difference_that_bounded_accepts(tmp_path) -> None:
    def run(numerics: str) -> dict[int, str]:
        cfg = SearchConfig(
            problems=[Problem("gemv", "bf16", 1, 24, 64)], backends=["fault_backend:EXACT"],
            out_dir=tmp_path / numerics, trials=2, sampler="grid", numerics=numerics, warm_start=0,
        )
        outcome = run_search(cfg, progress=False, log=lambda s: None)
        trials = pd.read_csv(outcome.trials_path)
        return {int(r.p_BLOCK_N): (r.status, str(r.error)) for r in trials.itertuples() if r.measured is True}

    bounded = run("bounded")
    assert bounded[4][0] == "ok" and bounded[64][0] == "ok"
    exact = run("exact")
    assert exact[4][0] == "ok"
    assert exact[64][0] == "fail" and "bit-identical" in exact[64][1]


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_parameters_a_backend_pins_for_the_device_are_not_searched(tmp_path) -> None:
    cfg = SearchConfig(
        problems=[Problem("gemv", "bf16", 1, 24, 64)], backends=["fault_backend:PINNED"], out_dir=tmp_path,
        trials=2, sampler="random", warm_start=0,
    )
    outcome = run_search(cfg, progress=False, log=lambda s: None)
    trials = pd.read_csv(outcome.trials_path)
    measured = trials[trials["measured"] == True]  # noqa: E712
    assert set(measured["p_BLOCK_N"]) == {4}  # 32 (wrong results) never reached the worker


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_restrict_narrows_every_measured_trial_and_an_empty_restriction_measures_nothing(tmp_path) -> None:
    problem = Problem("gemv", "bf16", 1, 24, 64)
    cfg = SearchConfig(problems=[problem], backends=["fault_backend:BACKEND"], out_dir=tmp_path,
                       trials=2, sampler="random", warm_start=0, restrict={"BLOCK_N": ("4", "32")})
    outcome = run_search(cfg, progress=False, log=lambda s: None)
    trials = pd.read_csv(outcome.trials_path)
    measured = trials[trials["measured"] == True]  # noqa: E712
    assert len(measured) == 2 and set(measured["p_BLOCK_N"]) == {4, 32}  # never the crash, hang or compile error
    # no value left: the study is kept (the re-measure reads it) but nothing is asked
    logs: list[str] = []
    again = dataclasses.replace(cfg, out_dir=tmp_path / "empty", restrict={"BLOCK_N": ("128",)})
    outcome = run_search(again, progress=False, log=logs.append)
    assert outcome.stats[0].measured_now == 0
    assert any("--restrict BLOCK_N=128 leaves no valid value" in line for line in logs), logs


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_domain_pruning_keeps_exactly_the_values_some_valid_config_uses() -> None:
    # The sampled fast path must give the same domains as enumerating the whole product.
    import itertools

    from tunekit import backends
    from tunekit.search.studies import _prune_domains

    for name, (m, n, k) in [("triton", (1, 96, 256)), ("triton", (8, 96, 5120)), ("triton", (1, 5120, 6144)),
                            ("hip", (2, 24, 64)), ("hip", (1, 34816, 5120))]:
        backend = backends.get(name)
        problem = Problem("gemv", "bf16", m, n, k)
        space = backend.space(problem)
        names = list(space.domains)
        used: dict[str, set] = {p: set() for p in names}
        for values in itertools.product(*(space.domains[p] for p in names)):
            params = dict(space.fixed) | dict(zip(names, values, strict=True))
            if backend.invalid_reason(problem, params) is None:
                for p, v in zip(names, values, strict=True):
                    used[p].add(repr(v))
        exact = {p: [v for v in space.domains[p] if repr(v) in used[p]] for p in names}
        assert _prune_domains(backend, problem, space.domains, space.fixed) == exact, (name, m, n, k)


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_a_default_config_invalid_for_the_shape_is_not_enqueued(tmp_path, monkeypatch) -> None:
    # Enqueuing it would give Optuna a value outside the pruned domain (a crash, before).
    from tunekit import backends

    triton_backend = backends.get("triton")
    real_space = triton_backend.space

    def space_with_a_bad_default(problem):
        space = real_space(problem)
        return dataclasses.replace(space, default=dict(space.default, BLOCK_K=8192))

    monkeypatch.setattr(triton_backend, "space", space_with_a_bad_default)
    cfg = SearchConfig(problems=[Problem("gemv", "bf16", 1, 8, 64)], backends=["triton"], out_dir=tmp_path,
                       trials=1, warm_start=0)
    outcome = run_search(cfg)
    (stats,) = outcome.stats
    assert stats.measured_now == 1
