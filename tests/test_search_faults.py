"""The search under faults, each caused for real: a PostgreSQL server stopped mid-search, a full file system
(a small tmpfs filled up; a file size limit set on the running search), a run folder made unwritable
mid-run, SIGTERM and SIGHUP, ``kill -9`` of the search, and a run folder reused for another problem set.

Every fault is one line on stderr (``error:`` or ``interrupted:``) with its documented exit status, never a
traceback; no temporary file and no process is left behind; the trials stored before the fault are kept
and rerunning the same command resumes. The searches use tests/fixed_time_backend.py (2 s builds, known
costs) with the vendor baseline slowed by tests/slow_vendor, as tests/test_distributed.py does.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pandas as pd
import postgres_server
import pytest

from tunekit.errors import UserError
from tunekit.problems.shapes import Problem
from tunekit.search import results

REPO = Path(__file__).resolve().parents[1]
#: a grid of 4 fixed-cost configs: about 2 s a trial, so a fault lands while the search is running
FIXED = ["--backend", "fixed_time_backend:FIXED", "--sampler", "grid", "--trials", "4", "--warm-start", "0",
         "--no-progress"]
RESUME = "rerun the same command to resume"


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "tests" / "slow_vendor")])
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, TUNEKIT_TEST_VENDOR_MS="120")


def _start(*args: str) -> subprocess.Popen:
    # a session of its own: the check for processes left behind looks for its session id
    return subprocess.Popen([sys.executable, "-m", "tunekit", *args], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=900)


def _one_line(rc: int, stderr: str, want_rc: int, prefix: str, *fragments: str) -> str:
    assert rc == want_rc, stderr
    assert "Traceback" not in stderr and "exceeding max length" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _wait(condition: Callable[[], bool], proc: subprocess.Popen, what: str, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _sqlite_measured(db: Path) -> int:
    """Measured trials in a run's SQLite database, read beside the search writing it."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return con.execute("select count(*) from trial_user_attributes where key='measured'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _trials(url: str) -> dict[tuple[str, int], optuna.trial.FrozenTrial]:
    storage = optuna.storages.RDBStorage(results_url(url))
    out = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        for trial in optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False):
            out[(summary.study_name, trial.number)] = trial
    return out


def results_url(url: str) -> str:
    from tunekit.search.storage import postgres_driver

    return postgres_driver(url)


def _finished(trials: dict) -> dict:
    """The finished trials as (state, params, status, time) per (study, number): what a rerun must keep."""
    return {key: (t.state.name, json.dumps(t.params, sort_keys=True), t.user_attrs.get("status"),
                  t.user_attrs.get("time_us")) for key, t in trials.items() if t.state.is_finished()}


def _measured_configs(trials: dict) -> list[str]:
    return [json.dumps(t.params, sort_keys=True) for (study, _), t in trials.items()
            if t.user_attrs.get("measured") and not study.startswith("final|")]


def _check_resumed(rc: int, stderr: str, url: str, before: dict, wanted: int = 4) -> None:
    """The rerun finished, kept every trial finished before the fault as it was, and measured each config once."""
    assert rc == 0, stderr
    after = _trials(url)
    assert {k: v for k, v in _finished(after).items() if k in before} == before
    measured = _measured_configs(after)
    assert len(measured) == wanted and len(set(measured)) == wanted, measured
    assert not [k for k, t in after.items() if t.state.name == "RUNNING"]


def _no_temp_files(out: Path) -> None:
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")], sorted(p.name for p in out.iterdir())


def _session_left(sid: int) -> list[str]:
    """Live processes (zombies aside) of session ``sid``: what a search that started it left running."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            left.append(f"{entry.name} {stat[:stat.rindex(')') + 1]} state {fields[0]}")
    return left


def _wait_session_gone(sid: int, limit_s: float = 15) -> list[str]:
    deadline = time.monotonic() + limit_s
    while (left := _session_left(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# ------------------------------------------------------------------ a storage that goes away
def _pg_ctl(server, *args: str) -> None:
    run = subprocess.run([*server.as_user, postgres_server.find_bin("pg_ctl"), *args, "-D",
                          str(server.folder / "data"), "-w"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr


@pytest.mark.faults  # a fault done for real: in the README's test command however long it takes
def test_postgres_stopped_mid_search_is_one_line_and_a_rerun_resumes(postgres, tmp_path) -> None:
    import psycopg

    url = postgres.create_database("stopped")
    args = ["search", "--shape", "24x64", *FIXED, "--storage", url, "--out", str(tmp_path / "run")]
    proc = _start(*args)

    def measured() -> int:
        try:
            with psycopg.connect(host="127.0.0.1", port=postgres.port, user=postgres_server.USER,
                                 dbname="stopped") as con:
                return con.execute("select count(*) from trial_user_attributes where key='measured'").fetchone()[0]
        except psycopg.Error:
            return 0

    _wait(lambda: measured() >= 2, proc, "two measured trials")
    _pg_ctl(postgres, "stop", "-m", "fast")  # the server goes away mid-search
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        _pg_ctl(postgres, "start", "-l", str(postgres.folder / "server.log"), "-o",
                f"-h 127.0.0.1 -p {postgres.port} -k {postgres.folder} -c fsync=off -c max_connections=200")
    _one_line(proc.returncode, stderr, 2, "error: ", "stopped answering", "start the database server", RESUME,
              "trials stored so far are kept")
    assert not _session_left(proc.pid)
    before = _finished(_trials(url))
    assert [v for v in before.values() if v[2] == "ok"]  # the fault came after trials were stored

    res = _run(*args)
    _check_resumed(res.returncode, res.stderr, url, before)


# ------------------------------------------------------------------ a full disk
def _fill(folder: Path) -> Path:
    """Write a file in ``folder`` until its file system is full. Unbuffered: a buffered file's close would
    flush what the full disk refused again, and raise there."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


@pytest.mark.faults  # a fault done for real: in the README's test command however long it takes
def test_a_full_tmpfs_mid_search_is_one_line_leaves_no_temp_file_and_a_rerun_resumes(tmp_path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:  # the file size limit below fills a file without privileges
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}); "
                    "test_a_file_size_limit_mid_search... covers the full file")
    try:
        out = mount / "run"
        args = ["search", "--shape", "24x64", *FIXED, "--out", str(out)]
        proc = _start(*args)
        _wait(lambda: _sqlite_measured(out / "optuna.db") >= 2, proc, "two measured trials")
        filler = _fill(mount)
        _, stderr = proc.communicate(timeout=300)
        _one_line(proc.returncode, stderr, 2, "error: ", "the disk is full", "free space", RESUME,
                  "trials stored so far are kept")
        _no_temp_files(out)
        url = f"sqlite:///{out / 'optuna.db'}"
        before = _finished(_trials(url))
        assert [v for v in before.values() if v[2] == "ok"]  # the fault came after trials were stored

        filler.unlink()  # the user frees space, then reruns
        res = _run(*args)
        _check_resumed(res.returncode, res.stderr, url, before)
        assert (out / "table.json").is_file()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.faults  # a fault done for real: in the README's test command however long it takes
def test_a_file_size_limit_mid_search_is_one_line_leaves_no_temp_file_and_a_rerun_resumes(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["search", "--shape", "24x64", *FIXED, "--out", str(out)]
    proc = _start(*args)
    _wait(lambda: _sqlite_measured(out / "optuna.db") >= 2, proc, "two measured trials")
    # the running search may now grow no file past 1 KiB: its database's next write fails (EFBIG)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1024, 1024))
    _, stderr = proc.communicate(timeout=300)
    _one_line(proc.returncode, stderr, 2, "error: ", "size limit", "ulimit -f", RESUME,
              "trials stored so far are kept")
    _no_temp_files(out)
    url = f"sqlite:///{out / 'optuna.db'}"
    before = _finished(_trials(url))
    assert [v for v in before.values() if v[2] == "ok"]  # the fault came after trials were stored

    res = _run(*args)
    _check_resumed(res.returncode, res.stderr, url, before)


# ------------------------------------------------------------------ a permission change mid-run
def _make_unwritable(folder: Path) -> Callable[[], None]:
    """Take away the right to create files in ``folder``; returns the undo. As root permission bits stop
    nothing, so root makes the folder immutable (``chattr +i``, where the file system has the attribute)."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        return lambda: folder.chmod(mode)
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: no way to make a folder unwritable to root here")
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i is not supported here ({made.stderr.strip()}): as root, permission bits "
                    "stop no write, so the permission change cannot be made for real")
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.faults  # a fault done for real: in the README's test command however long it takes
def test_a_run_folder_made_unwritable_mid_search_is_one_line_and_a_rerun_resumes(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["search", "--shape", "24x64", *FIXED, "--out", str(out)]
    proc = _start(*args)
    _wait(lambda: _sqlite_measured(out / "optuna.db") >= 1, proc, "a measured trial")
    undo = _make_unwritable(out)  # the database's files stay writable; no new file can be made beside them
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        undo()
    _one_line(proc.returncode, stderr, 2, "error: ", "can no longer be written", "give write access back",
              RESUME, "trials stored so far are kept")
    _no_temp_files(out)
    url = f"sqlite:///{out / 'optuna.db'}"
    before = _finished(_trials(url))

    res = _run(*args)
    _check_resumed(res.returncode, res.stderr, url, before)
    assert (out / "trials.csv").is_file() and (out / "table.json").is_file()


# ------------------------------------------------------------------ signals
@pytest.mark.faults  # a fault done for real: in the README's test command however long it takes
@pytest.mark.parametrize(("signum", "to_group"), [(signal.SIGTERM, False), (signal.SIGHUP, True)],
                         ids=["SIGTERM-to-the-search", "SIGHUP-to-its-group"])
def test_sigterm_and_sighup_stop_like_ctrl_c_and_write_trials_csv(tmp_path, signum, to_group) -> None:
    out = tmp_path / "run"
    args = ["search", "--shape", "24x64", *FIXED, "--out", str(out)]
    proc = _start(*args)
    db = out / "optuna.db"
    _wait(lambda: _sqlite_measured(db) >= 2, proc, "two measured trials")
    if to_group:  # a closed terminal, systemd's KillMode=control-group: the search and its worker
        os.killpg(proc.pid, signum)
    else:  # kill PID, a batch scheduler
        os.kill(proc.pid, signum)
    _, stderr = proc.communicate(timeout=120)
    name = signal.Signals(signum).name
    _one_line(proc.returncode, stderr, 128 + signum, "interrupted: ", name, RESUME)
    assert not _wait_session_gone(proc.pid)
    stored = _trials(f"sqlite:///{db}")
    assert not [k for k, t in stored.items() if t.state.name == "RUNNING"]  # the trial in flight: recorded
    listed = pd.read_csv(out / "trials.csv")  # complete: every trial of the storage, as stored
    assert len(listed) == len(stored)
    assert sorted(zip(listed["trial"], listed["state"], strict=True)) == sorted(
        (number, t.state.name) for (_, number), t in stored.items())
    assert 2 <= len(listed[listed["measured"] == True]) < 4  # noqa: E712
    _no_temp_files(out)

    res = _run(*args)
    _check_resumed(res.returncode, res.stderr, f"sqlite:///{db}", _finished(stored))


#: The moments of a short search (--trials 2) a stop signal is sent at: (what marks the start: a line of the
#: search's stdout, the run folder, two measured trials; then a random delay of up to so many seconds).
_MOMENTS = {
    "start": ("run folder", 1.5),  # the run folder's lock, the storage opening, the worker's start
    "device": ("device:", 2.0),  # the probe, run.json
    "trials": ("plan:", 6.0),  # ask, build, verify, time, tell
    "final": ("2 measured", 3.0),  # the final re-measure
    "export": ("workers:", 0.5),  # run.json, trials.csv, final.csv, table.json, the summary and report
}
_STRESS_SEARCHES = 6  # each moment once, then one at random
SHORT = ["--backend", "fixed_time_backend:FIXED", "--sampler", "grid", "--trials", "2", "--warm-start", "0",
         "--no-progress"]
_STRESS_LANES = 3  # searches at once: also a loaded machine, as CI's 2 cores often are


def _stopped_at(out: Path, moment: str, delay: float, signum: int, to_group: bool) -> str:
    """Start a short search, send ``signum`` ``delay`` s after ``moment`` began; check how it stopped."""
    args = ["search", "--shape", "24x64", *SHORT, "--out", str(out)]
    proc = _start(*args)
    lines: dict[str, list[str]] = {"out": [], "err": []}

    def read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    readers = [threading.Thread(target=read, args=(proc.stdout, lines["out"]), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, lines["err"]), daemon=True)]
    for reader in readers:
        reader.start()
    marker = _MOMENTS[moment][0]
    begun = {"run folder": lambda: out.is_dir(),
             "2 measured": lambda: _sqlite_measured(out / "optuna.db") >= 2}.get(
        marker, lambda: any(line.startswith(marker) for line in lines["out"]))
    name = signal.Signals(signum).name
    what = f"{name} to the {'group' if to_group else 'search'} {delay:.2f} s into {moment}"
    try:
        _wait(begun, proc, f"{moment} ({what})", limit_s=300)
        time.sleep(delay)
        if proc.poll() is not None:  # it ended before the signal: nothing was sent
            return f"{what}: finished first"
        (os.killpg if to_group else os.kill)(proc.pid, signum)
        sent = time.monotonic()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # a failed wait: nothing of it is left running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    took = time.monotonic() - sent
    for reader in readers:
        reader.join(timeout=10)
    stderr = "".join(lines["err"])
    assert not _wait_session_gone(proc.pid), what
    if proc.returncode == -signum and not stderr and any(x.startswith("wrote ") for x in lines["out"]):
        # after its end: the search's handlers were put back and the default action ended the process
        return f"{what}: ended by the signal after the search had finished, {took:.1f} s"
    assert "Exception ignored" not in stderr, f"{what}: {stderr}"
    line = _one_line(proc.returncode, stderr, 128 + signum, "interrupted: ", RESUME)
    assert (name in line) == (signum != signal.SIGINT), f"{what}: {line}"  # Ctrl-C: the CLI's own line
    db = out / "optuna.db"
    stored = _trials(f"sqlite:///{db}") if db.is_file() else {}
    assert not [k for k, t in stored.items() if t.state.name == "RUNNING"], what  # the trial in flight: recorded
    listed = results.read_csv(out / "trials.csv", "trials") if (out / "trials.csv").is_file() else pd.DataFrame()
    # written once the device is known (an empty file: no trial yet): every trial of the storage's tuning
    # studies (not the final re-measure's claim), as stored
    assert sorted(zip(listed.get("trial", []), listed.get("state", []), strict=True)) == sorted(
        (number, t.state.name) for (study, number), t in stored.items() if not study.startswith("final|")), what
    _no_temp_files(out)
    return f"{what}: exit {proc.returncode} {took:.1f} s after the signal"


@pytest.mark.faults  # a fault done for real: in the README's test command however long it takes
def test_a_stop_signal_at_a_random_moment_stops_the_search_in_one_line(tmp_path) -> None:
    """SIGTERM, SIGHUP or Ctrl-C, to the search or its process group, at a random moment of each phase of a
    short search: always its exit status and one ``interrupted:`` line, never a traceback or an "Exception
    ignored" (a signal's handler once raised in a finalizer, which swallowed the stop: issue 52), the trial
    in flight recorded, trials.csv as stored, no process left. Seeded: TUNEKIT_STRESS_SEED repeats a run."""
    seed = int(os.environ.get("TUNEKIT_STRESS_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"seed {seed} (TUNEKIT_STRESS_SEED={seed} repeats it)")
    rng = random.Random(seed)
    moments = list(_MOMENTS)
    plan = []
    for index in range(_STRESS_SEARCHES):
        moment = moments[index] if index < len(moments) else rng.choice(moments)
        plan.append((tmp_path / f"run{index}", moment, rng.uniform(0, _MOMENTS[moment][1]),
                     rng.choice((signal.SIGTERM, signal.SIGHUP, signal.SIGINT)), rng.random() < 0.5))
    with concurrent.futures.ThreadPoolExecutor(_STRESS_LANES) as pool:
        futures = [pool.submit(_stopped_at, *item) for item in plan]
        outcomes = []
        for index, future in enumerate(futures):
            try:
                outcomes.append(f"{index}: {future.result()}")
            except Exception as exc:
                raise AssertionError(f"seed {seed}, search {index}: {type(exc).__name__}: {exc}") from exc
    print("\n".join(outcomes))
    assert sum("finished first" not in o for o in outcomes) >= _STRESS_SEARCHES - 2, outcomes


@pytest.mark.faults  # a fault done for real: in the README's test command however long it takes
def test_kill_9_of_the_search_leaves_no_process_and_no_traceback(tmp_path) -> None:
    out = tmp_path / "run"
    proc = _start("search", "--shape", "24x64", *FIXED, "--out", str(out))
    _wait(lambda: _sqlite_measured(out / "optuna.db") >= 1, proc, "a measured trial")
    children = [line for line in _session_left(proc.pid) if not line.startswith(f"{proc.pid} ")]
    assert children, "the search runs its worker (and multiprocessing's resource tracker) in processes"
    os.kill(proc.pid, signal.SIGKILL)  # the search alone: nothing reaches its worker but its death
    proc.wait(timeout=30)
    left = _wait_session_gone(proc.pid, limit_s=10)
    assert not left, f"outlived the search: {left}"
    _, stderr = proc.communicate(timeout=30)  # every writer of the pipe is gone: no orphan printing
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


# ------------------------------------------------------------------ a run folder reused for other problems
def _problem(n: int) -> Problem:
    return Problem("gemv", "bf16", 1, n, 64)


def _record(out: Path, problems: list[Problem], command: str = "tunekit search --shape 24x64") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps({"command": command, "problems": [p.as_dict() for p in problems]}))


def test_a_run_folder_refuses_another_problem_set_in_one_line(tmp_path) -> None:
    _record(tmp_path, [_problem(24)])
    with pytest.raises(UserError) as info:
        results.folder_problems(tmp_path, [_problem(32)], add=False)
    message = str(info.value)
    assert "\n" not in message and "--add" in message and "another --out" in message
    assert "tunekit search --shape 24x64" in message and "1 of them not in the folder" in message
    # the same set resumes; a folder without a record (a new one, or a first run stopped early) takes any
    assert results.folder_problems(tmp_path, [_problem(24)], add=False) == [_problem(24)]
    assert results.folder_problems(tmp_path / "new", [_problem(32)], add=False) == [_problem(32)]


def test_add_searches_the_union_the_folder_first(tmp_path) -> None:
    _record(tmp_path, [_problem(24), _problem(48)])
    union = results.folder_problems(tmp_path, [_problem(32), _problem(24)], add=True)
    assert [p.n for p in union] == [24, 48, 32]
    # a subset of the folder's problems is another set too: without --add refused, with it the folder's own
    with pytest.raises(UserError, match="leaves out 1 of the folder's"):
        results.folder_problems(tmp_path, [_problem(24)], add=False)
    assert [p.n for p in results.folder_problems(tmp_path, [_problem(24)], add=True)] == [24, 48]


@pytest.mark.faults  # a fault done for real: in the README's test command however long it takes
def test_another_problem_set_on_an_existing_out_is_refused_unless_add(tmp_path) -> None:
    out = tmp_path / "run"
    first = ["search", "--shape", "24x64", *FIXED, "--trials", "2", "--out", str(out)]
    res = _run(*first)
    assert res.returncode == 0, res.stderr
    recorded = (out / "run.json").read_text()
    trials_csv = (out / "trials.csv").read_text()

    other = ["search", "--shape", "32x64", *FIXED, "--trials", "2", "--out", str(out)]
    res = _run(*other)
    _one_line(res.returncode, res.stderr, 2, "error: ", "--add", "another --out")
    assert (out / "run.json").read_text() == recorded and (out / "trials.csv").read_text() == trials_csv

    res = _run(*other, "--add")
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "run.json").read_text())
    assert sorted(p["n"] for p in data["problems"]) == [24, 32]
    final = pd.read_csv(out / "final.csv")
    assert sorted(set(final["n"])) == [24, 32]
    res = _run(*other, "--add")  # the same command again: resumes, nothing new to measure
    assert res.returncode == 0, res.stderr
    assert sorted(p["n"] for p in json.loads((out / "run.json").read_text())["problems"]) == [24, 32]
