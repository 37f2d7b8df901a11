"""What a user sees around a search: probe without a driver, --gpus, configs that do not divide, the
postgres:// alias, the progress lines without a terminal, the size estimate and the summary's columns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tunekit.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])
    return dict(os.environ, PYTHONPATH=path, **extra)


def _tunekit(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=REPO, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# ------------------------------------------------------------------ probe without a driver
def test_probe_without_gpu_or_interpreter_says_how_to_run_on_the_cpu() -> None:
    env = _env(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    line = _one_error(_tunekit("probe", env=env))
    assert "no GPU driver is visible" in line and "TRITON_INTERPRET=1" in line, line
    assert "active drivers" not in line


def test_no_driver_reason_is_none_under_the_interpreter(monkeypatch) -> None:
    from tunekit.measure import device

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert device.no_driver_reason() is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: False)
    assert device.no_driver_reason() == device.NO_DRIVER


# ------------------------------------------------------------------ --gpus
@pytest.mark.parametrize("text", ["all", "5", "1", "0,2"])
def test_gpus_asking_for_gpus_that_are_not_there_is_refused_with_the_count(text) -> None:
    from tunekit.search.fleet import parse_gpus

    for interpreter in (True, False):
        with pytest.raises(UserError, match=r"no GPU is visible here \(0 GPUs") as err:
            parse_gpus(text, 0, interpreter)
        assert ("CPU workers" in str(err.value)) == interpreter


def test_gpus_under_the_interpreter_names_cpu_workers_from_zero() -> None:
    from tunekit.search.fleet import parse_gpus

    assert [s.label for s in parse_gpus("0,1", 0, True)] == ["cpu0", "cpu1"]
    assert [s.label for s in parse_gpus("1,0", 0, True)] == ["cpu0", "cpu1"]
    with pytest.raises(UserError, match="0 GPUs"):
        parse_gpus("0,1", 0, False)
    with pytest.raises(UserError, match=r"2 GPU\(s\) visible here \(indices 0..1\)"):
        parse_gpus("5", 2, False)
    assert [s.label for s in parse_gpus("1", 2, False)] == ["gpu1"]


def test_search_gpus_5_on_the_cpu_is_one_line(tmp_path) -> None:
    proc = _tunekit("search", "--shape", "16x64", "--backend", "triton", "--trials", "1", "--gpus", "5",
                    "--no-progress", "--out", str(tmp_path / "run"), env=_env(TRITON_INTERPRET="1"))
    line = _one_error(proc)
    assert "--gpus 5: no GPU is visible here (0 GPUs)" in line, line
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ configs that do not divide
def _llama(**fields) -> dict:
    return {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256} | fields


def test_heads_not_divisible_by_kv_heads_are_refused(tmp_path) -> None:
    from tunekit.problems.models.load import load_config_file

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama(num_key_value_heads=5)))
    with pytest.raises(UserError, match="num_attention_heads=32 is not divisible by num_key_value_heads=5"):
        load_config_file(path)
    path.write_text(json.dumps(_llama()))
    assert load_config_file(path).num_key_value_heads == 8


def test_cli_refuses_a_non_divisible_config_and_tp_in_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_llama(num_attention_heads=30, num_key_value_heads=4, hidden_size=3840)))
    line = _one_error(_tunekit("shapes", "--config", str(bad)))
    assert "num_attention_heads=30" in line and "num_key_value_heads=4" in line and str(bad) in line, line
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_llama()))
    line = _one_error(_tunekit("shapes", "--config", str(good), "--tp", "3"))
    assert "tp=3" in line and "num_attention_heads=32" in line and f"(config {good})" in line, line


def test_a_tp_the_config_cannot_shard_names_the_model_and_its_config_file(tmp_path) -> None:
    from tunekit.problems.models.load import load_config_file, load_model

    folder = tmp_path / "Llama-X"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_llama()))
    with pytest.raises(UserError) as err:
        load_config_file(folder).check_tp(3)
    assert str(err.value).startswith(f"Llama-X (config {folder / 'config.json'}): tp=3 is not supported: "
                                     "num_attention_heads=32 not divisible by tp=3"), err.value
    with pytest.raises(UserError, match=r"^llama-3\.1-8b-instruct \(config tunekit/problems/models/configs/"
                                        r"[^)]+\.json\): tp=3 is not supported"):
        load_model("llama-3.1-8b-instruct").check_tp(3)


def test_linear_value_heads_not_divisible_by_key_heads_are_refused() -> None:
    from tunekit.problems.models.load import load_model

    spec = load_model("qwen3.5-0.8b")
    config = dict(spec.config)
    config["linear_num_value_heads"] = config["linear_num_key_heads"] + 1
    from tunekit.problems.models.spec import ModelSpec

    with pytest.raises(UserError, match="linear_num_value_heads=.* is not divisible by .*linear_num_key_heads"):
        ModelSpec.from_config(config, name="x", hf_id=None, origin="x.json")


# ------------------------------------------------------------------ postgres:// and its driver
class _Recorder:
    urls: list[str] = []

    def __init__(self, url: str, **_: object) -> None:
        _Recorder.urls.append(url)


@pytest.mark.parametrize("given, opened", [
    ("postgres://u:pw@db:5432/tk", "postgresql+psycopg://u:pw@db:5432/tk"),
    ("postgresql://u:pw@db/tk", "postgresql+psycopg://u:pw@db/tk"),
    ("postgres+psycopg://u@db/tk", "postgresql+psycopg://u@db/tk"),
])
def test_postgres_alias_reaches_optuna_as_postgresql(monkeypatch, given, opened) -> None:
    import optuna

    from tunekit.search import storage

    _Recorder.urls = []
    monkeypatch.setattr(optuna.storages, "RDBStorage", _Recorder)
    # the postgres extra's driver installed (its lookup only: nothing connects, so the test extra alone runs this)
    monkeypatch.setattr(storage, "_has_module", lambda name: name == "psycopg")
    storage.open_storage(given)
    assert _Recorder.urls == [opened]


def test_a_missing_postgres_driver_is_one_line_saying_what_to_install(monkeypatch) -> None:
    from tunekit.search import storage

    monkeypatch.setattr(storage, "_has_module", lambda name: False)
    with pytest.raises(UserError) as err:
        storage.open_storage("postgres://u:secret@db/tk")
    text = str(err.value)
    assert "no PostgreSQL driver is installed" in text and "pip install 'psycopg[binary]'" in text, text
    assert "secret" not in text and "\n" not in text
    monkeypatch.setattr(storage, "_has_module", lambda name: name == "psycopg2")
    assert storage.postgres_driver("postgres://u@db/tk") == "postgresql+psycopg2://u@db/tk"


# ------------------------------------------------------------------ progress lines and the estimate
class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines_progress(clock: _Clock, **options):
    from tunekit.search.progress import Progress

    lines: list[str] = []
    bar = Progress("lines", lines.append, clock=clock, **options)
    return bar, lines


def test_progress_lines_per_finished_study_and_at_most_one_per_interval() -> None:
    clock = _Clock()
    bar, lines = _lines_progress(clock, studies=3, trials=4, workers=1, cpu=False)
    bar.plan(problems=3, backends=1)
    assert lines == ["plan: 3 problem(s) x 1 backend(s) = 3 studies x 4 trials = 12 trials at most "
                     "(a resumed study measures only what it lacks)"]
    a = bar.add("gemv m1 16x64 triton", total=4, done=0)
    for completed in (1, 2, 3):
        clock.now += 3  # 9 s: no line before the interval
        bar.update(a, completed)
    assert len(lines) == 1
    clock.now += 3
    bar.update(a, 4)  # the study's last trial: its line, whatever the interval
    assert lines[1] == "progress: study done: gemv m1 16x64 triton; 1/3 studies, 4/12 trials, 12 s elapsed, ETA 24 s"
    b = bar.add("gemv m1 24x64 triton", total=4, done=1)  # resumed: one trial stored
    clock.now += 5
    bar.update(b, 2)
    assert len(lines) == 2  # 5 s since the last line
    clock.now += 6
    bar.update(b, 3)  # 11 s since the last line
    assert lines[2].startswith("progress: 1/3 studies, 7/12 trials, 23 s elapsed, ETA ")
    bar.finish(b)  # stopped short (exhausted): the plan shrinks by what it will not measure
    assert lines[3].startswith("progress: study done: gemv m1 24x64 triton; 2/3 studies, 7/11 trials")
    bar.finish(b)
    assert len(lines) == 4  # a study is reported done once


def test_progress_resumed_complete_study_counts_done_without_a_line() -> None:
    clock = _Clock()
    bar, lines = _lines_progress(clock, studies=2, trials=4)
    bar.add("done already", total=4, done=4)
    task = bar.add("new", total=4, done=0)
    clock.now += 2
    bar.update(task, 1)
    assert lines == []
    bar.finish(task)
    assert lines == ["progress: study done: new; 2/2 studies, 5/5 trials, 2 s elapsed, ETA 0 s"]


def test_no_progress_prints_no_lines_and_bars_mode_is_rich() -> None:
    clock = _Clock()
    from tunekit.search.progress import Progress

    lines: list[str] = []
    bar = Progress(False, lines.append, studies=1, trials=1, clock=clock)
    bar.update(bar.add("s", 1, 0), 1)
    bar.finish("s")
    assert lines == []
    bar.log("message")
    assert lines == ["message"]
    with pytest.raises(ValueError):
        Progress("dots", lines.append)


def test_cpu_estimate_from_the_first_trial_warns_before_hours() -> None:
    # the default search of a 27B model on the CPU: 44 problems x 40 trials, a trial of 2 minutes
    clock = _Clock()
    bar, lines = _lines_progress(clock, studies=44, trials=40, cpu=True)
    bar.plan(problems=44, backends=1)
    assert "1760 trials at most" in lines[0] and "the first trial gives an estimate" in lines[0]
    task = bar.add("gemv m1 5120x17408 triton", total=40, done=0)
    clock.now += 120
    bar.update(task, 1)
    assert lines[1] == ("estimate: the first trial took 2 min on the CPU interpreter; the 1759 trials left would "
                        "take about 58.6 h (from 1 trial; refined after 5)")
    assert lines[2].startswith("warning: this CPU search would take about 58.6 h: make it smaller with "
                               "--budget quick, --ops")
    assert "--m 1" in lines[2] and "--trials N" in lines[2]
    clock.now += 120
    bar.update(task, 2)
    assert sum(line.startswith(("estimate:", "warning:")) for line in lines) == 2  # once per search


def test_cpu_estimate_is_refined_from_the_median_of_the_first_trials() -> None:
    # the first trial also pays the worker's warm-up: 10 min, then 30 s a trial
    clock = _Clock()
    bar, lines = _lines_progress(clock, studies=1, trials=100, cpu=True)
    task = bar.add("s", total=100, done=0)
    for completed, took in enumerate((600, 30, 30, 40, 30, 30), start=1):
        clock.now += took
        bar.update(task, completed)
    estimates = [line for line in lines if line.startswith("estimate:")]
    assert estimates == [
        "estimate: the first trial took 10 min on the CPU interpreter; the 99 trials left would take about 16.5 h "
        "(from 1 trial; refined after 5)",
        "estimate: a trial takes 30 s on the CPU interpreter (the median of the first 5); the 95 trials left "
        "would take about 48 min"]
    assert len([line for line in lines if line.startswith("warning:")]) == 1  # with the first estimate only


def test_cpu_estimate_counts_each_worker_threads_own_trials() -> None:
    import threading

    clock = _Clock()
    bar, lines = _lines_progress(clock, studies=1, trials=20, cpu=True, workers=2)
    task = bar.add("s", total=20, done=0)

    clock.now += 8
    bar.update(task, 1)  # this thread's first: 8 s since the start
    clock.now += 2
    go = threading.Event()  # the other threads' first trials, all ending at 10 s (all alive: distinct threads)
    threads = [threading.Thread(target=lambda c=c: (go.wait(), bar.update(task, c))) for c in (2, 3, 4, 5)]
    for thread in threads:
        thread.start()
    go.set()
    for thread in threads:
        thread.join()
    assert lines[-1] == ("estimate: a trial takes 10 s on the CPU interpreter (the median of the first 5); the 15 "
                         "trials left would take about 75 s over 2 workers")


def test_cpu_estimate_of_a_short_search_has_no_warning_and_counts_workers() -> None:
    clock = _Clock()
    bar, lines = _lines_progress(clock, studies=2, trials=4, cpu=True, workers=2)
    task = bar.add("s", total=4, done=0)
    clock.now += 6
    bar.update(task, 1)
    assert lines == ["estimate: the first trial took 6 s on the CPU interpreter; the 7 trials left would take "
                     "about 21 s over 2 workers (from 1 trial; refined after 5)"]
    gpu_clock = _Clock()
    bar, lines = _lines_progress(gpu_clock, studies=2, trials=4, cpu=False)
    gpu_clock.now += 6000
    bar.update(bar.add("s", total=4, done=0), 1)
    assert not [line for line in lines if line.startswith(("estimate:", "warning:"))]


def test_search_picks_lines_when_stdout_is_not_a_terminal(monkeypatch) -> None:
    from tunekit.cli import tune

    class _Out:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.setattr(tune.sys, "stdout", _Out(False))
    assert tune._progress_mode(True) == "lines"
    assert tune._progress_mode(False) is False
    monkeypatch.setattr(tune.sys, "stdout", _Out(True))
    assert tune._progress_mode(True) == "bars"


TINY = ["--backend", "triton", "--warm-start", "0", "--sampler", "random"]


@pytest.mark.faults  # done for real: in the README's test command however long it takes
def test_a_piped_search_prints_plan_estimate_and_progress_lines(tmp_path) -> None:
    proc = _tunekit("search", "--shape", "16x64", "--shape", "24x64", "--trials", "2", *TINY,
                    "--out", str(tmp_path / "run"), env=_env(TRITON_INTERPRET="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert ("plan: 2 problem(s) x 1 backend(s) = 2 studies x 2 trials = 4 trials at most (a resumed study "
            "measures only what it lacks); on the CPU interpreter the first trial gives an estimate of the whole"
            ) in lines
    assert [line for line in lines if line.startswith("estimate: the first trial took ")]
    done = [line for line in lines if line.startswith("progress: study done: ")]
    assert len(done) == 2, proc.stdout
    assert " 1/2 studies, 2/4 trials, " in done[0] and " ETA " in done[0]
    assert " 2/2 studies, 4/4 trials, " in done[1] and done[1].endswith("ETA 0 s")
    assert not [line for line in lines if line.startswith("warning:")]
    text = " ".join(proc.stdout.split())
    assert "measured = ok + failed: trials this search built, verified and timed" in text
    assert "stored before: measured trials the storage held for the study before this search" in text
    rerun = _tunekit("search", "--shape", "16x64", "--shape", "24x64", "--trials", "2", *TINY, "--no-progress",
                     "--out", str(tmp_path / "run"), env=_env(TRITON_INTERPRET="1"), timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert not [line for line in rerun.stdout.splitlines() if line.startswith(("progress:", "estimate:"))]


@pytest.mark.faults  # done for real: in the README's test command however long it takes
def test_a_cpu_search_of_hours_warns_after_its_first_trial(tmp_path) -> None:
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "tunekit", "search", "--shape", "16x64", "--trials", "5000",
                             *TINY, "--out", str(tmp_path / "run")], cwd=REPO, env=_env(TRITON_INTERPRET="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line.rstrip("\n"))
            if line.startswith("warning: this CPU search"):
                break
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    warning = seen[-1]
    assert warning.startswith("warning: this CPU search would take about ") and " h: make it smaller" in warning
    assert "--budget quick" in warning and "--trials N" in warning
    assert seen[-2].startswith("estimate: the first trial took ") and "4999 trials left" in seen[-2]
    assert proc.returncode == 130, err


# ------------------------------------------------------------------ the summary's columns
def test_summary_columns_count_this_search_and_say_so(tmp_path) -> None:
    from rich.console import Console

    from tunekit.evidence.search_summary import print_summary
    from tunekit.problems.shapes import Problem
    from tunekit.search.common import SearchOutcome, StudyStats

    stats = StudyStats(Problem("gemv", "bf16", 1, 96, 5120), "triton", measured_before=4, measured_now=5, ok=3,
                       failed=2, invalid=7, duplicates=1, best_us=2.5,
                       stopped="plateau: no gain over 1% in the last 10 trials")
    outcome = SearchOutcome(run_dir=tmp_path, stats=[stats], probe={"kind": "cpu"})
    console = Console(record=True, width=400)
    print_summary(console, outcome)
    text = console.export_text()
    header = next(line for line in text.splitlines() if "problem" in line and "backend" in line)
    columns = [cell.strip() for cell in header.strip("┃│ ").replace("┃", "│").split("│")]
    assert columns == ["problem", "backend", "measured", "ok", "failed", "invalid", "dup", "stored before",
                       "best us (search)", "stopped early"]
    row = next(line for line in text.splitlines() if "m1 96x5120" in line)
    cells = [cell.strip() for cell in row.strip("┃│ ").split("│")]
    # measured = ok + failed (this search); the storage's earlier trials in their own column
    assert cells[2:8] == ["5", "3", "2", "7", "1", "4"]
    assert cells[9] == "plateau: no gain over 1% in the last 10 trials"  # why the study ended before --trials
    assert "(+" not in text
    flat = " ".join(text.split())
    assert "trials of this search, per study" in flat
    assert "measured = ok + failed: trials this search built, verified and timed" in flat
    assert "so its total is stored before + measured" in flat


@pytest.mark.needs("postgres")  # psycopg's own connection attempt, refused
def test_a_refused_connection_is_one_line_saying_how_to_start_the_server() -> None:
    import socket

    from tunekit.search import storage

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError) as err:
        storage.open_storage(f"postgres://tunekit:secret@127.0.0.1:{port}/tunekit")
    text = str(err.value)
    assert "\n" not in text and "Background on this error" not in text and "secret" not in text, text
    assert "Connection refused" in text and "service postgresql start" in text, text


def test_a_missing_password_is_one_line_saying_where_to_give_it(monkeypatch) -> None:
    import optuna
    import sqlalchemy.exc

    from tunekit.search import storage

    def refuse(url: str, **_: object) -> None:
        orig = Exception('connection failed: connection to server at "127.0.0.1", port 5432 failed: '
                         "fe_sendauth: no password supplied\n")
        raise sqlalchemy.exc.OperationalError("connect", {}, orig)

    monkeypatch.setattr(optuna.storages, "RDBStorage", refuse)
    monkeypatch.setattr(storage.time, "sleep", lambda s: None)
    monkeypatch.setattr(storage, "_has_module", lambda name: name == "psycopg")  # the driver's lookup only
    with pytest.raises(UserError) as err:
        storage.open_storage("postgres://tunekit@db/tunekit")
    text = str(err.value)
    assert "\n" not in text and "no password supplied" in text, text
    assert "postgresql://USER:PASSWORD@HOST/DB" in text and "PGPASSWORD" in text, text


@pytest.mark.faults  # done for real: in the README's test command however long it takes
def test_postgres_alias_and_a_sql_ascii_database_on_a_real_server(postgres) -> None:
    import psycopg

    from tunekit.search import storage

    url = postgres.create_database("alias")
    opened = storage.open_storage("postgres://" + url.split("://", 1)[1])
    assert storage.stored_trials(opened) == 0  # the tables were made through the alias
    with psycopg.connect(host="127.0.0.1", port=postgres.port, user=postgres_server_user(), dbname="postgres",
                         autocommit=True) as con:
        con.execute("CREATE DATABASE ascii ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    with pytest.raises(UserError) as err:
        storage.open_storage(f"postgres://{postgres_server_user()}@127.0.0.1:{postgres.port}/ascii")
    text = str(err.value)
    assert "SQL_ASCII" in text and "createdb -E UTF8 -T template0" in text and "\n" not in text, text


def postgres_server_user() -> str:
    import postgres_server

    return postgres_server.USER


def test_optunas_query_fallback_warning_is_dropped_and_its_other_warnings_kept(tmp_path) -> None:
    """A database server stopped mid-search made Optuna's trials query warn "Caught an error from sqlalchemy
    ... Falling back" with its SQL, six lines before the search's own one line (test_search_faults.py)."""
    import logging

    import optuna

    from tunekit.search import storage

    storage.open_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = optuna.logging.get_logger("optuna")
    logger.addHandler(handler)
    try:
        rdb = logging.getLogger("optuna.storages._rdb.storage")
        rdb.warning("Caught an error from sqlalchemy: (psycopg.errors.AdminShutdown) terminating connection\n"
                    "[SQL: SELECT ...]. Falling back to a slower alternative.")
        rdb.warning("another warning")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another warning"]
