"""No run destroys data: the run folder's lock, searches sharing one storage, Ctrl-C, an empty or
corrupt database and a trials.csv longer than the storage. Every case checks the exit status, the
one line on stderr (no traceback) and that the trials stored before are all still there."""

from __future__ import annotations

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

REPO = Path(__file__).resolve().parents[1]
SEARCH = ["search", "--shape", "96x256", "--backend", "triton", "--no-progress", "--sampler", "random"]


def _env() -> dict[str, str]:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")


def _tunekit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=900)


def _start(*args: str) -> subprocess.Popen:
    # its own process group: a signal to the group reaches the search and its worker, as Ctrl-C does
    return subprocess.Popen([sys.executable, "-m", "tunekit", *args], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _one_error(res_rc: int, stderr: str, fragment: str, rc: int = 2, prefix: str = "error: ") -> str:
    assert res_rc == rc, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix) and fragment in lines[0], stderr
    return lines[0]


def _measured(db: Path) -> int:
    """Measured trials in a run's database, read without disturbing the search writing it."""
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(db, timeout=1)
        try:
            return con.execute("select count(*) from trial_user_attributes where key='measured'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _wait_measured(db: Path, count: int, proc: subprocess.Popen, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while _measured(db) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the search measured nothing"
        time.sleep(0.2)


def _trials(db: Path) -> dict[tuple[str, int], optuna.trial.FrozenTrial]:
    storage = f"sqlite:///{db}"
    out = {}
    for summary in optuna.get_all_study_summaries(storage):
        for trial in optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False):
            out[(summary.study_name, trial.number)] = trial
    return out


def _done(trials: dict) -> dict:
    """The finished trials, as (state, params, status, time) per (study, number)."""
    return {key: (t.state.name, json.dumps(t.params, sort_keys=True), t.user_attrs.get("status"),
                  t.user_attrs.get("time_us"))
            for key, t in trials.items() if t.state.is_finished()}


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_a_second_search_on_a_locked_run_folder_is_refused_and_touches_nothing(tmp_path) -> None:
    out = tmp_path / "run"
    first = _start(*SEARCH, "--trials", "3", "--out", str(out))
    _wait_measured(out / "optuna.db", 1, first)
    second = _tunekit(*SEARCH, "--trials", "3", "--out", str(out))
    line = _one_error(second.returncode, second.stderr, "is in use by another search")
    assert f"pid {first.pid} on " in line and "started " in line and "--trials 3" in line
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    trials = pd.read_csv(out / "trials.csv")
    measured = trials[trials["measured"] == True]  # noqa: E712
    assert len(measured) == 3 and (measured["status"] != "interrupted").all()
    assert not (trials["state"] == "FAIL").any()


def _running_owned(db: Path) -> int:
    """RUNNING trials that already recorded their owner (in flight in a live search)."""
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(db, timeout=1)
        try:
            return con.execute("select count(*) from trials t join trial_user_attributes a on a.trial_id = "
                               "t.trial_id where t.state = 'RUNNING' and a.key = 'owner'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _final_claims(db: Path) -> list[dict]:
    """The trials of the final re-measure claims (``final|`` studies) in a SQLite storage."""
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    claims = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if summary.study_name.startswith("final|"):
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            # the study and trial number travel with each claim: a failed assertion then says whether two
            # claims won one study or two final studies were opened for one problem
            claims += [{"state": t.state.name, "study": summary.study_name, "number": t.number, **t.user_attrs}
                       for t in study.get_trials(deepcopy=False)]
    return claims


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_two_searches_sharing_one_storage_both_finish_and_fail_none_of_the_others_trials(tmp_path) -> None:
    db = tmp_path / "shared.db"
    storage = f"sqlite:///{db}"
    # one problem, so both work on one study; each candidate takes 12 s to build, so the second
    # search opens the study (and looks for dead trials) while the first one's trial is in flight
    args = ["search", "--shape", "24x64", "--backend", "fault_backend:SLOW", "--no-progress", "--sampler", "grid",
            "--trials", "1", "--warm-start", "0", "--storage", storage]
    a = _start(*args, "--out", str(tmp_path / "a"))
    deadline = time.monotonic() + 300
    while _running_owned(db) < 1:
        assert a.poll() is None, a.communicate()
        assert time.monotonic() < deadline, "the first search never started a trial"
        time.sleep(0.1)
    b = _start(*args, "--out", str(tmp_path / "b"))
    out_a, err_a = a.communicate(timeout=600)
    out_b, err_b = b.communicate(timeout=600)
    assert a.returncode == 0, err_a
    assert b.returncode == 0, err_b
    trials = _trials(db)
    assert not [t for t in trials.values() if t.state.name == "FAIL" or t.user_attrs.get("status") == "interrupted"]
    assert not [t for t in trials.values() if t.state.name == "RUNNING"]
    measured = [t for t in trials.values() if t.user_attrs.get("measured")]
    # the second search found the study's one trial in flight in the first: it waited for it instead
    # of measuring a second one (and never failed it), then read the same final re-measure
    assert len(measured) == 1, [(t.number, t.user_attrs.get("owner")) for t in trials.values()]
    finals = _final_claims(db)
    # one final re-measure: exactly one claim "ok"; a search that asked at the same moment lost its claim
    # (the protocol's answer to that race, PRUNED with status claim_lost), in the same final study
    why = [(t["study"], t["number"], t["state"], t["status"], t.get("owner"), t.get("worker")) for t in finals]
    assert [t["status"] for t in finals].count("ok") == 1, why
    assert all(t["status"] == "claim_lost" and t["state"] == "PRUNED" for t in finals if t["status"] != "ok"), why
    assert len({t["study"] for t in finals}) == 1, why
    for run in ("a", "b"):
        assert (tmp_path / run / "trials.csv").is_file() and (tmp_path / run / "table.json").is_file()
    assert (tmp_path / "a" / "final.csv").read_text() == (tmp_path / "b" / "final.csv").read_text()


def test_a_tuning_trial_told_while_a_search_reads_the_final_candidates_opens_no_second_final(
        tmp_path, monkeypatch) -> None:
    # The interleaving of the two searches above, step by step: search A's trial stores ``measured``
    # before it is told, so B's trial phase is over while it is still RUNNING; B reads the final
    # candidates (no trial of A's yet) and A's tell lands before B looks for tuning trials in flight.
    # B must not claim a final keyed by the candidates it read: A claims the one with its trial in it.
    from types import SimpleNamespace

    from tunekit.problems.shapes import Problem
    from tunekit.search import finals
    from tunekit.search.common import study_name

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'shared.db'}")
    problem = Problem("gemv", "bf16", 1, 24, 64)
    tuning = optuna.create_study(study_name=study_name("cpu", problem, "triton", "bounded"),
                                 storage=storage, direction="minimize")
    in_flight = tuning.ask({"BLOCK_N": optuna.distributions.CategoricalDistribution([4, 8])})
    for key, value in (("owner", "elsewhere:1"), ("worker", "elsewhere:1:gpu0"), ("measured", True),
                       ("status", "ok")):
        in_flight.set_user_attr(key, value)

    def run_of(name: str) -> SimpleNamespace:
        return SimpleNamespace(cfg=SimpleNamespace(numerics="bounded", peers=()), storage=storage,
                               device={"arch": "cpu"}, usable=["triton"], probe={}, stamp_text="", name=name,
                               backends_for=lambda problem: ["triton"])

    def ctx_of(name: str) -> SimpleNamespace:
        live = SimpleNamespace(begin=lambda trial: trial.set_user_attr("owner", name), end=lambda: None)
        return SimpleNamespace(live=live, device={})

    read = finals._final_candidates
    calls = []

    def candidates_then_a_tells(run, problem):
        candidates = read(run, problem)
        calls.append(run.name)
        if len(calls) == 1:  # B's first read: A's tell lands right after it
            tuning.tell(in_flight.number, 1.0)
        return candidates

    monkeypatch.setattr(finals, "_final_candidates", candidates_then_a_tells)
    monkeypatch.setattr(finals, "_final_remeasure", lambda run, ctx, problem, candidates: [
        {"label": c["label"], "time_us": 1.0, "measured_by": run.name} for c in candidates])

    b_first = finals._final_step(run_of("B"), ctx_of("B"), problem)
    a_rows = finals._final_step(run_of("A"), ctx_of("A"), problem)
    b_rows = finals._final_step(run_of("B"), ctx_of("B"), problem)
    claims = _final_claims(tmp_path / "shared.db")
    assert [c["status"] for c in claims] == ["ok"], [
        (c["study"], c["number"], c["state"], c["status"], c.get("owner")) for c in claims]
    assert b_first is None and a_rows == b_rows
    assert [r["label"] for r in a_rows] == ["vendor", f"triton#{in_flight.number}"]


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_ctrl_c_exits_130_with_one_line_and_a_rerun_resumes(tmp_path) -> None:
    out = tmp_path / "run"
    # 8x256, not SEARCH's 96x256: the random sampler proposes the same configs (N enters no validity rule), each
    # launch is 1 to 8 interpreter programs where N=96 made the small-BLOCK_N trials and re-measure take minutes
    args = [*(("8x256" if arg == "96x256" else arg) for arg in SEARCH), "--trials", "6", "--out", str(out)]
    proc = _start(*args)
    db = out / "optuna.db"
    _wait_measured(db, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # the search and its worker, as Ctrl-C in a terminal
    stdout, stderr = proc.communicate(timeout=120)
    _one_error(proc.returncode, stderr, "rerun the same command to resume", rc=130, prefix="interrupted: ")
    assert "KeyboardInterrupt" not in stderr
    stored = _trials(db)
    before = _done(stored)
    assert 2 <= len([t for t in stored.values() if t.user_attrs.get("measured")]) < 6
    assert not [t for t in stored.values() if t.state.name == "RUNNING"]  # the trial in flight: recorded
    listed = pd.read_csv(out / "trials.csv")  # written on the way out
    assert len(listed) >= len(before)

    res = _tunekit(*args)
    assert res.returncode == 0, res.stderr
    after = _done(_trials(db))
    assert {k: v for k, v in after.items() if k in before} == before  # every finished trial kept as it was
    trials = pd.read_csv(out / "trials.csv")
    measured = trials[trials["measured"] == True]  # noqa: E712
    assert len(measured) == 6  # resumed: 6 in all, not 6 more
    assert len(set(measured["params"])) == 6
    interrupted = trials[trials["status"] == "interrupted"]
    assert (interrupted["state"] == "FAIL").all()


def _storage_with_trials(db: Path, count: int) -> None:
    study = optuna.create_study(study_name="cpu|gemv|bf16|m1|n96|k256|triton|bounded",
                                storage=f"sqlite:///{db}")
    for i in range(count):
        study.add_trial(optuna.trial.create_trial(value=float(i + 1), params={"BLOCK_N": i},
                                                  distributions={"BLOCK_N": optuna.distributions.IntDistribution(0, 9)},
                                                  user_attrs={"measured": True, "status": "ok"}))


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_an_empty_or_corrupt_database_is_refused_and_left_as_it_is(tmp_path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    db = out / "optuna.db"
    db.write_bytes(b"")
    res = _tunekit(*SEARCH, "--trials", "1", "--out", str(out))
    _one_error(res.returncode, res.stderr, "is empty (0 bytes)")
    assert db.stat().st_size == 0 and not (out / "trials.csv").exists()

    junk = b"this was optuna.db before something overwrote it\n" * 100
    db.write_bytes(junk)
    res = _tunekit(*SEARCH, "--trials", "1", "--out", str(out))
    _one_error(res.returncode, res.stderr, "not a readable SQLite database")
    assert db.read_bytes() == junk


def test_a_storage_with_fewer_trials_than_trials_csv_is_refused(tmp_path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    _storage_with_trials(tmp_path / "old.db", 5)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'old.db'}")
    from tunekit.search import results

    results.trials_frame(storage).to_csv(out / "trials.csv", index=False)  # trials.csv of a 5-trial run
    listed = (out / "trials.csv").read_text()
    _storage_with_trials(out / "optuna.db", 2)  # a database that lost three of them
    res = _tunekit(*SEARCH, "--trials", "1", "--out", str(out))
    _one_error(res.returncode, res.stderr, "lists 5 trials but the storage")
    assert (out / "trials.csv").read_text() == listed
    assert len(_trials(out / "optuna.db")) == 2


def test_writing_trials_csv_never_drops_rows(tmp_path) -> None:
    # the last guard: a storage that holds fewer trials for this device than trials.csv lists
    from tunekit.search import results

    _storage_with_trials(tmp_path / "five.db", 5)
    _storage_with_trials(tmp_path / "two.db", 2)
    device = {"arch": "cpu"}
    first = results.write_trials(tmp_path, optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'five.db'}"),
                                 None, device, {})
    assert first.name == "trials.csv"
    aside = results.write_trials(tmp_path, optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'two.db'}"),
                                 None, device, {})
    assert aside.name.startswith("trials-") and aside.parent == tmp_path
    assert len(pd.read_csv(tmp_path / "trials.csv")) == 5 and len(pd.read_csv(aside)) == 2
