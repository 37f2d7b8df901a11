"""Every user mistake is one ``error:`` line on stderr and exit status 2, never a traceback:
usage errors (whichever copy of click typer carries), bad files, unwritable places, invalid
table entries; and what `search --model` tunes by default."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tunekit import table as table_mod

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "benchmarks" / "results" / "h200-m1-triton-9251ae9"


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _assert_one_error(res: subprocess.CompletedProcess, fragment: str) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["search", "--trials", "abc"], "--trials"),
        (["search", "--shape", "96x256", "--no-such-option"], "--no-such-option"),
        (["show"], "TABLE"),
        (["shapes", "--tp", "two"], "--tp"),
        (["no-such-command"], "no-such-command"),
        (["search", "--shape", "96x256", "--min-gain", "-0.5"], "--min-gain"),
        (["search", "--shape", "96x256", "--min-gain", "nan"], "--min-gain"),
        (["export", "/nonexistent/run", "--min-gain", "-1"], "--min-gain"),
        (["search", "--shape", "96x256", "--backend", "triton", "--seed-from", "/nonexistent/trials.csv"],
         "no such file"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, fragment) -> None:
    line = _assert_one_error(_run(*args), fragment)
    if args[0] in ("search", "show", "shapes") and "min-gain" not in fragment and "no such file" not in fragment:
        assert "--help" in line  # click's own usage errors say where the help is


def test_bare_tunekit_prints_the_help_and_one_error_line() -> None:
    res = _run()
    _assert_one_error(res, "missing command")
    assert "search" in res.stdout and "show" in res.stdout  # the commands, on stdout
    assert _run("--help").returncode == 0


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_bad_files_are_one_line(tmp_path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    (run / "final.csv").write_text("")
    _assert_one_error(_run("export", str(run)), "final.csv has no rows")
    _assert_one_error(_run("compare", str(run)), "final.csv has no rows")
    (run / "final.csv").write_bytes(b'\x00\x01garbage"\n"a')
    _assert_one_error(_run("export", str(run)), "not a readable re-measure table")
    _assert_one_error(_run("compare", str(run)), "not a readable re-measure table")
    (run / "run.json").write_text("{")
    _assert_one_error(_run("export", str(run)), "corrupt run file")

    search = ["search", "--shape", "96x256", "--backend", "triton", "--out", str(tmp_path / "never")]
    bad = tmp_path / "trials.csv"
    for content, fragment in [(b"", "the file is empty"), (b'\x00garbage"\n"a', "not a readable trials table"),
                              (b"op,dtype\ngemv,bf16\n", "not a trials table")]:
        bad.write_bytes(content)
        _assert_one_error(_run(*search, "--seed-from", str(bad)), fragment)
    _assert_one_error(_run(*search, "--seed-from", str(tmp_path)), "no such file")
    assert not (tmp_path / "never").exists()  # refused before anything was written

    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": "other/1"}))
    _assert_one_error(_run("chain", "--model", "qwen3-8b", "--table", str(table)), "unknown format")


def test_an_unreadable_final_csv_is_kept_beside_the_new_one(tmp_path) -> None:
    from tunekit.search import results

    (tmp_path / "final.csv").write_bytes(b'\x00garbage"\n"a')
    row = {"op": "gemv", "dtype": "bf16", "m": 1, "n": 96, "k": 256, "backend": "vendor", "time_us": 1.0}
    results.write_final(tmp_path, [row])
    assert len(results.read_final(tmp_path)) == 1
    (aside,) = tmp_path.glob("final-unreadable-*.csv")
    assert aside.read_bytes() == b'\x00garbage"\n"a'


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_out_at_a_file_under_a_file_and_in_a_read_only_folder(tmp_path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    common = ["search", "--shape", "96x256", "--backend", "triton", "--trials", "1"]
    _assert_one_error(_run(*common, "--out", str(afile)), "not a folder")
    _assert_one_error(_run(*common, "--out", str(afile / "run")), "cannot create the run folder")
    with _read_only(tmp_path / "ro") as ro:
        _assert_one_error(_run(*common, "--out", str(ro / "run")), "cannot create the run folder")
    assert afile.read_text() == "not a folder\n"


class _read_only:  # noqa: N801 - used as a context manager
    """A folder nothing can be created in, even as root (immutable attribute); skips where unavailable."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._immutable = False

    def __enter__(self) -> Path:
        self.path.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(self.path)],
                                                                capture_output=True).returncode != 0:
                pytest.skip("root, and no immutable attribute on this filesystem: nothing is read-only")
            self._immutable = True
        else:
            self.path.chmod(0o555)
        try:
            (self.path / "probe").write_text("")
        except OSError:
            return self.path
        self.__exit__()
        pytest.skip("the folder stayed writable")

    def __exit__(self, *exc: object) -> None:
        if self._immutable:
            subprocess.run(["chattr", "-i", str(self.path)], check=True)
        else:
            self.path.chmod(0o755)


def test_compare_and_export_on_a_read_only_run_folder_fail_before_printing(tmp_path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    before = sorted(p.name for p in run.iterdir())
    with _read_only(run):
        res = _run("compare", str(run))
        _assert_one_error(res, "cannot write in")
        assert res.stdout == ""  # refused before the report, not after it
        res = _run("export", str(run))
        _assert_one_error(res, "cannot write in")
        assert res.stdout == ""
    assert sorted(p.name for p in run.iterdir()) == before
    _assert_one_error(_run("export", str(run), "--output", str(tmp_path)), "is a folder")


def test_compare_output_is_not_cut_when_piped(tmp_path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([sys.executable, "-m", "tunekit", "compare", str(run)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=dict(env, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout  # rich's truncation mark: at 80 columns "(1.00…" cut the per-token table


# ------------------------------------------------------------------------------------------------ tables


def _valid_table() -> dict:
    from tunekit import backends
    from tunekit.problems.shapes import Problem

    problem = Problem("gemv", "bf16", 1, 96, 256)
    space = backends.get("triton").space(problem)
    params = dict(space.fixed) | dict(space.default)
    assert backends.get("triton").invalid_reason(problem, params) is None
    entry = {"op": "gemv", "dtype": "bf16", "m": 1, "n": 96, "k": 256, "backend": "triton",
             "kernel": "kernels_triton.gemv", "params": params, "time_us": 2.0, "baseline_us": 3.0,
             "speedup": 1.5, "gbps": 25.0, "pct_of_limit": 1.0, "max_abs_err": 0.0, "err_ratio": 0.1,
             "count": 1, "timing_kind": "gpu"}
    env = {"gpu": "Test GPU", "arch": "sm_90", "cu_count": 132, "wave_size": 32, "runtime": "cuda 12.8",
           "torch": "2.9.0", "triton": "3.5.0", "tunekit": "0.1.0", "kernel_hash": {"triton": "0123456789abcdef"}}
    return {"format": table_mod.FORMAT, "created": "2026-01-01T00:00:00+00:00", "environment": env,
            "read_limit_gbps": 4000.0, "min_gain": 0.01, "entries": [entry]}


def _with(table: dict, **changes) -> dict:
    table["entries"][0].update(changes)
    return table


def _params(table: dict, **changes) -> dict:
    table["entries"][0]["params"].update(changes)
    return table


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda t: _params(t, num_warps="eight"), "num_warps='eight' is str, expected int"),
        (lambda t: _params(t, BLOCK_N=3), "params rejected by the triton kernel"),
        (lambda t: _params(t, NOT_A_TUNABLE=1), "no tunable 'NOT_A_TUNABLE'"),
        (lambda t: _with(t, params={}), "params is empty"),
        (lambda t: _with(t, params={"BLOCK_N": [1, 2]}), "not a number or a string"),
        (lambda t: _with(t, backend="cudnn"), "unknown backend 'cudnn'"),
        (lambda t: _with(t, backend="vendor"), "baseline"),
        (lambda t: _with(t, backend="no_such_module:BACKEND"), "cannot be imported"),
        (lambda t: _with(t, op="conv2d"), "unknown op 'conv2d'"),
        (lambda t: _with(t, dtype="int3"), "unknown dtype 'int3'"),
        (lambda t: _with(t, m=0), "m=0"),
        (lambda t: _with(t, n=96.0), "'n'"),
        (lambda t: _with(t, time_us=math.inf), "time_us=inf"),
        (lambda t: _with(t, speedup=-1.5), "speedup=-1.5"),
        (lambda t: _with(t, gbps="fast"), "'gbps'"),
        (lambda t: _with(t, baseline_us=0), "baseline_us=0"),
        (lambda t: _with(t, pct_of_limit="high"), "pct_of_limit='high'"),
        (lambda t: _with(t, count=0), "count=0"),
        (lambda t: t["environment"].update(kernel_hash=["triton"]), "kernel_hash"),
        (lambda t: t["environment"].update(cu_count="132"), "cu_count"),
        (lambda t: t["environment"].update(kernel_hash={"triton": 7}), "kernel_hash"),
        (lambda t: t.update(read_limit_gbps="4 TB/s"), "read_limit_gbps"),
    ],
)
def test_show_validates_every_entry(tmp_path, mutate, fragment) -> None:
    table = _valid_table()
    mutate(table)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    with pytest.raises(table_mod.TableError) as err:
        table_mod.load(path, strict=True)
    message = str(err.value)
    assert fragment in message and "\n" not in message, message
    if "environment" not in message and "read_limit" not in message:
        assert "entry 0 (" in message  # names the entry


def test_a_valid_table_passes_strict_and_pct_of_limit_may_be_null(tmp_path) -> None:
    path = tmp_path / "table.json"
    table = _valid_table()
    table["entries"][0]["pct_of_limit"] = None
    path.write_text(json.dumps(table))
    assert table_mod.entries(table_mod.load(path, strict=True))[0].pct_of_limit is None


def test_show_of_an_empty_table_says_it_has_no_entries_instead_of_an_empty_grid(tmp_path, monkeypatch) -> None:
    import io

    from rich.console import Console

    from tunekit.cli import tune

    def shown(table: dict) -> str:
        path = tmp_path / "table.json"
        path.write_text(json.dumps(table))
        out = io.StringIO()
        monkeypatch.setattr(tune, "console", Console(file=out, width=200))
        tune.show(path, check=False)
        return out.getvalue()

    text = shown(dict(_valid_table(), entries=[]))
    assert ", 0 entries, tuned on Test GPU" in text
    assert ("no entries: every shape served with this table takes the stock path (no tuned candidate beat it by "
            "the min gain 1.0%)") in text
    assert "speedup" not in text and "┃" not in text  # no grid
    assert "min gain" not in shown({k: v for k, v in _valid_table().items() if k != "min_gain"} | {"entries": []})
    assert "no entries" not in shown(_valid_table()) and "speedup" in shown(_valid_table())


def test_show_names_the_bad_entry_in_one_line_and_counts_the_others(tmp_path) -> None:
    table = _valid_table()
    second = dict(table["entries"][0], n=128, params=dict(table["entries"][0]["params"], num_warps="eight"))
    third = dict(table["entries"][0], n=256, time_us=float("nan"))
    table["entries"] += [second, third]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    line = _assert_one_error(_run("show", str(path)), "entry 1 (gemv bf16 m1 128x256 triton)")
    assert "num_warps" in line and "1 more invalid entries" in line
    res = _run("show", str(path), "--check")
    _assert_one_error(res, "entry 1")


def test_serving_still_loads_what_only_strict_validation_refuses(tmp_path) -> None:
    # an entry the kernel no longer accepts takes the vendor path on its own when served (tunekit.ops)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_params(_valid_table(), BLOCK_N=3)))
    assert table_mod.entries(table_mod.load(path))[0].params["BLOCK_N"] == 3
    with pytest.raises(table_mod.TableError):
        table_mod.load(path, strict=True)


# ----------------------------------------------------------------------------- search --model defaults


def _searched(monkeypatch, **options) -> list:
    """The problems `tunekit search` would tune with these options (the search itself is stubbed)."""
    from tunekit import cli
    from tunekit.search import engine

    seen: list = []

    class Stop(Exception):
        pass

    def fake_run_search(cfg, **_: object):
        seen.extend(cfg.problems)
        raise Stop

    monkeypatch.setattr(engine, "run_search", fake_run_search)
    with pytest.raises(Stop):
        cli.search(backend="triton", progress=False, **options)
    return seen


def test_search_model_tunes_every_op_it_runs_at_m_1_2_4_8(monkeypatch) -> None:
    from tunekit.problems.models import load_model

    spec = load_model("qwen3.5-27b")
    problems = _searched(monkeypatch, model="qwen3.5-27b")
    # and the fused GEMV families the vLLM plugin serves (tests/test_default_search.py: their problems)
    ops = {op for _, op, _, _, _ in spec.elementwise(1)} | {"gemv", "rms_gemv", "gemv_add"}
    assert {p.op for p in problems} == ops and len(ops) >= 6
    assert {p.m for p in problems} == {1, 2, 4, 8, 16}
    assert len({(p.op, p.n, p.k) for p in problems if p.op == "gemv"}) == len({(n, k) for _, n, k, _ in
                                                                               spec.linears(1)})
    # --ops / --m narrow it
    assert {(p.op, p.m) for p in _searched(monkeypatch, model="qwen3.5-27b", ops="gemv")} == {
        ("gemv", m) for m in (1, 2, 4, 8, 16)}
    assert {p.m for p in _searched(monkeypatch, model="qwen3.5-27b", m="1")} == {1}
    assert {p.op for p in _searched(monkeypatch, model="qwen3.5-27b", m="1")} == ops
    # only --shape: one GEMV at M=1, as before
    assert [(p.op, p.m, p.n, p.k) for p in _searched(monkeypatch, shape=["96x256"])] == [("gemv", 1, 96, 256)]
