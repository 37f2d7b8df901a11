"""Many workers on one storage: a real PostgreSQL server, concurrent searches, a killed worker, --gpus.

The PostgreSQL tests start a throwaway server (tests/postgres_server.py). Without one they skip,
except under TUNEKIT_REQUIRE_POSTGRES=1 (.ci/run), where a missing server is a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

# The slow tier (`python -m pytest -q -m slow`, run by .ci/run):
# searches of several processes on a throwaway PostgreSQL.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
#: fixed costs and a vendor slower than every candidate: the table is decided by the trials alone
FIXED = ["--shape", "24x64", "--backend", "fixed_time_backend:FIXED", "--sampler", "grid", "--trials", "8",
         "--warm-start", "0", "--no-progress"]


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "tests" / "slow_vendor")])
    # builds of 0.3 s, not the fixed backend's 2 s: nothing here needs a long one (the killed worker's build of
    # COST=3 never ends; --gpus' two workers start on two studies at once)
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "TUNEKIT_TEST_VENDOR_MS": "120",
            "TUNEKIT_TEST_BUILD_S": "0.3", **extra}


def _start(*args: str, **env: str) -> subprocess.Popen:
    # its own process group: kill -9 of the group takes the search and its worker process
    return subprocess.Popen([sys.executable, "-m", "tunekit", *args], cwd=REPO, env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 900) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _studies(url: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    from tunekit.search.engine import open_storage

    storage = open_storage(url)
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=storage).get_trials(deepcopy=False)
            for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}


def _entries(table_path: Path) -> list[tuple]:
    table = json.loads(table_path.read_text())
    return sorted((e["op"], e["m"], e["n"], e["k"], e["backend"], json.dumps(e["params"], sort_keys=True))
                  for e in table["entries"])


def _check_no_duplicate_and_no_lost_trial(studies: dict[str, list], wanted: int) -> None:
    for name, trials in studies.items():
        assert not [t.number for t in trials if t.state.name == "RUNNING"], f"{name}: a trial left RUNNING"
        if name.startswith("final|"):
            done = [t for t in trials if t.state.name == "COMPLETE"]
            assert len(done) == 1 and done[0].user_attrs["status"] == "ok", f"{name}: re-measured {len(done)} times"
            continue
        measured = [json.dumps(t.params, sort_keys=True) for t in trials if t.user_attrs.get("measured")]
        assert len(measured) == len(set(measured)), f"{name}: a config measured twice"
        assert len(measured) == wanted, f"{name}: {len(measured)} measured, {wanted} wanted"


def test_three_concurrent_searches_on_postgres_measure_every_config_once(postgres, tmp_path) -> None:
    url = postgres.create_database("concurrent")
    # two studies of the real Triton kernel; N=8 (N enters no validity rule): 1 to 8 interpreter programs a
    # launch, where 96x256 and 32x512 made a BLOCK_N=1 trial or re-measure tens of seconds
    args = ["search", "--shape", "8x256", "--shape", "8x512", "--backend", "triton", "--sampler", "random",
            "--trials", "3", "--warm-start", "0", "--no-progress", "--storage", url]
    # no table is read: the vendor path keeps its own speed (not 120 ms a call through each re-measure's rounds)
    procs = [_start(*args, "--out", str(tmp_path / f"run{i}"), TUNEKIT_TEST_VENDOR_MS="") for i in range(3)]
    results = [_finish(p) for p in procs]
    for rc, _, err in results:
        assert rc == 0, err
    studies = _studies(url)
    assert len([n for n in studies if not n.startswith("final|")]) == 2
    assert len([n for n in studies if n.startswith("final|")]) == 2  # one final re-measure per problem
    _check_no_duplicate_and_no_lost_trial(studies, wanted=3)
    finals = [(tmp_path / f"run{i}" / "final.csv").read_text() for i in range(3)]
    assert finals[0] == finals[1] == finals[2]  # every search reports the one stored re-measure
    part = json.loads((tmp_path / "run0" / "run.json").read_text())["participants"]
    owners = {t.user_attrs["worker"] for trials in studies.values() for t in trials if t.user_attrs.get("measured")}
    assert part["workers"] == len(owners) and part["hosts"] == 1
    assert "password" not in json.dumps(part)


def _wait_for(predicate, proc: subprocess.Popen, what: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert proc.poll() is None, (what, proc.communicate())
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.2)


def test_a_killed_worker_trial_fails_by_heartbeat_and_the_others_finish_its_work(postgres, tmp_path,
                                                                                request) -> None:
    # the reference: one process, SQLite (its own storage and folder: it runs while the rest happens)
    reference = _start("search", *FIXED, "--out", str(tmp_path / "single"))
    request.addfinalizer(lambda: reference.poll() is None and os.killpg(reference.pid, signal.SIGKILL))

    url = postgres.create_database("killed")
    # each process names a host of its own: the dead one is known by its silent heartbeat alone
    fast = {"TUNEKIT_HEARTBEAT_S": "1", "TUNEKIT_GRACE_S": "4"}
    # its build of COST=3 never ends: killed there, mid-trial
    victim = _start("search", *FIXED, "--storage", url, "--out", str(tmp_path / "victim"), TUNEKIT_HOST="host-a",
                    TUNEKIT_TEST_HANG_COST="3", **fast)

    def victim_in_flight() -> bool:
        try:
            trials = [t for ts in _studies(url).values() for t in ts]
        except Exception:  # noqa: BLE001 - tables not created yet
            return False
        return any(t.state.name == "RUNNING" and t.params == {"COST": 3} and t.user_attrs.get("owner")
                   for t in trials)

    _wait_for(victim_in_flight, victim, "the first worker measuring COST=3")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    killed = [t for ts in _studies(url).values() for t in ts if t.state.name == "RUNNING"]
    assert len(killed) == 1 and killed[0].user_attrs["owner"].startswith("host-a:")

    others = [_start("search", *FIXED, "--storage", url, "--out", str(tmp_path / f"w{i}"), TUNEKIT_HOST=f"host-{i}",
                     **fast) for i in "bc"]
    for proc in others:
        rc, _, err = _finish(proc)
        assert rc == 0, err
    rc, _, err = _finish(reference)
    assert rc == 0, err
    single = _entries(tmp_path / "single" / "table.json")
    assert single and json.loads(single[0][5]) == {"COST": 1}  # the fixed costs decide: the cheapest wins
    studies = _studies(url)
    (trial,) = [t for ts in studies.values() for t in ts if t.number == killed[0].number
                and t.user_attrs.get("owner") == killed[0].user_attrs["owner"] and t.datetime_start
                == killed[0].datetime_start]
    assert trial.state.name == "FAIL" and not trial.user_attrs.get("measured")
    # failed by Optuna's stale-heartbeat check (fail_stale_trials sets no status); the pid check
    # of a worker on the owner's own host would have recorded status "interrupted"
    assert "status" not in trial.user_attrs
    _check_no_duplicate_and_no_lost_trial(studies, wanted=8)
    retried = [t for ts in studies.values() for t in ts if t.system_attrs.get("failed_trial") == killed[0].number]
    assert retried and retried[0].user_attrs.get("measured")  # its config was measured by another worker
    assert retried[0].user_attrs["worker"].split(":")[0] in ("host-b", "host-c")
    for name in ("wb", "wc"):
        assert _entries(tmp_path / name / "table.json") == single
    exported = tmp_path / "exported.json"
    rc, out, err = _finish(_start("export", "--storage", url, "--output", str(exported)))
    assert rc == 0, err
    assert _entries(exported) == single


def test_gpus_runs_one_worker_per_device_sharing_the_studies(tmp_path) -> None:
    # without a GPU, under the interpreter, --gpus 0,1 gives two CPU workers: the same queue and claims
    rc, out, err = _finish(_start("search", *FIXED, "--shape", "16x64", "--gpus", "0,1",
                                  "--out", str(tmp_path / "two")))
    assert rc == 0, err
    assert "2 workers (cpu0, cpu1)" in out
    meta = json.loads((tmp_path / "two" / "run.json").read_text())
    assert meta["participants"]["here"]["workers"] == ["cpu0", "cpu1"]
    studies = _studies(f"sqlite:///{tmp_path / 'two' / 'optuna.db'}")
    _check_no_duplicate_and_no_lost_trial(studies, wanted=8)
    workers = {t.user_attrs["worker"].rsplit(":", 1)[1] for ts in studies.values() for t in ts
               if t.user_attrs.get("measured")}
    assert workers == {"cpu0", "cpu1"}  # both took work from the queue
    assert meta["participants"]["workers"] == 2
    assert len(_entries(tmp_path / "two" / "table.json")) == 2


def test_bad_gpus_values_are_one_line_errors(tmp_path) -> None:
    for value, fragment in (("x", "expected 'all' or device indices"), ("0,0", "given twice"),
                            ("all", "no GPU is visible")):
        proc = subprocess.run([sys.executable, "-m", "tunekit", "search", *FIXED, "--gpus", value,
                               "--out", str(tmp_path / "bad")], cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=300)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], proc.stderr


def test_a_study_measured_on_another_device_is_refused(tmp_path) -> None:
    run = tmp_path / "run"
    rc, _, err = _finish(_start("search", *FIXED, "--trials", "1", "--out", str(run)))
    assert rc == 0, err
    storage = optuna.storages.RDBStorage(f"sqlite:///{run / 'optuna.db'}")
    (name,) = [s.study_name for s in optuna.get_all_study_summaries(storage) if not s.study_name.startswith("final|")]
    study = optuna.load_study(study_name=name, storage=storage)
    study.set_user_attr("stamp", "0123456789")
    study.set_user_attr("stamp_text", "Other GPU (sm_80, 108 CUs)")
    rc, _, err = _finish(_start("search", *FIXED, "--trials", "2", "--out", str(run)))
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "never merged" in lines[0] and "Other GPU" in lines[0], err


def test_export_from_a_storage_with_two_device_models_asks_for_one(tmp_path) -> None:
    from tunekit.search import fleet

    url = f"sqlite:///{tmp_path / 'mixed.db'}"
    storage = optuna.storages.RDBStorage(url)
    device = {"name": "GPU", "arch": "sm_90", "cu_count": 132, "wave_size": 32, "l2_bytes": 50 << 20,
              "runtime": "cuda 13.0", "vendor": "nvidia", "is_gpu": True, "torch_device": "cuda:0"}
    row = {"op": "gemv", "dtype": "bf16", "m": 1, "n": 64, "k": 64, "count": 1, "names": "x", "label": "triton#0",
           "backend": "triton", "trial": 0, "params": "{}", "time_us": 1.0, "time_p25_us": 1.0, "time_p75_us": 1.0,
           "spread": 0.0, "baseline_us": 2.0, "baseline": "vendor", "speedup": 2.0, "gbps": 1.0, "pct_of_limit": None,
           "max_abs_err": 0.0, "err_ratio": 0.0, "timing_kind": "gpu", "numerics": "bounded"}
    for stamp in ("aaaaaaaaaa", "bbbbbbbbbb"):
        study = optuna.create_study(study_name=f"{fleet.FINAL_PREFIX}sm_90|gemv-{stamp}|bounded|x", storage=storage)
        study.add_trial(optuna.create_trial(value=1.0, user_attrs={
            "rows": json.dumps([row, dict(row, label="vendor", backend="vendor", time_us=2.0, speedup=1.0)]),
            "device": json.dumps(device), "probe": json.dumps({"kind": "gpu", "read_gbps": 4000.0}),
            "backends": json.dumps(["triton"]), "stamp": stamp, "stamp_text": f"GPU {stamp[0]}", "status": "ok"}))
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "tunekit", "export", "--storage", url, "-o", str(out)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "never merged" in proc.stderr and "GPU a" in proc.stderr and not out.exists()
    proc = subprocess.run([sys.executable, "-m", "tunekit", "export", "--storage", url, "--stamp", "bbbbbbbbbb",
                           "-o", str(out)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(out.read_text())["entries"]) == 1
