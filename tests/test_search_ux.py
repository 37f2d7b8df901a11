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
    assert "tp=3" in line and "num_attention_heads=32" in line, line


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
