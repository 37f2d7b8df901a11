"""What the serve-bench tests share (``tests/test_serve_bench*.py`` import it; tests/ is on sys.path): the data
folder, the stub engine's runner, the settings of a small run, and a recorded folder's report rebuilt from its raw
files."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tunekit.evidence.serve_bench import bench
from tunekit.evidence.serve_bench.settings import Settings, build_settings

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "serve_bench"
TABLE = DATA / "table-h200.json"
FAKE_RUNNER = DATA / "fake_runner.py"
RESULTS = REPO / "benchmarks" / "results"


def use_fake_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every runner process of this test is the stub engine (tests/data/serve_bench/fake_runner.py), with none
    of its failure switches set; returns the file it records each process in (arm, index, ..., the arm it saw)."""
    record = tmp_path / "record.txt"
    monkeypatch.setenv(bench.RUNNER_ENV, f"{sys.executable} {FAKE_RUNNER}")
    monkeypatch.setenv("FAKE_RECORD", str(record))
    for name in ("VLLM_PLUGINS", "FAKE_PROBE", "FAKE_TUNED_MISMATCH", "FAKE_FAIL_ARM", "FAKE_ENGINE_SLEEP"):
        monkeypatch.delenv(name, raising=False)
    return record


def small_settings(**kw) -> Settings:
    """A 4-layer Qwen3.5-27B run at B = 1, 2 with the H200 table: short enough for the stub engine."""
    opts = {"tokens": 16, "prompt_len": 8, "repeats": 2, "processes": 2, "layers": 4, "runner_timeout_s": 120.0}
    opts.update(kw)
    return build_settings("qwen3.5-27b", None, [TABLE], [1, 2], **opts)


def rebuild(src: Path, out: Path, tables: list[str]) -> dict:
    """A recorded serve-bench folder's raw files (runs, dispatch logs, settings) copied to ``out``, the
    tables it served pointed at their copies in the repository, and the report rebuilt from them alone."""
    shutil.copytree(src / "runs", out / "runs")
    if (src / "dispatch").is_dir():
        shutil.copytree(src / "dispatch", out / "dispatch")
    key = json.loads((src / "serve-settings.json").read_text())
    key["tables"] = tables
    (out / "serve-settings.json").write_text(json.dumps(key))
    return bench.report_dir(out, log=lambda s: None)
