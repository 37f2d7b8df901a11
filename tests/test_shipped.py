"""The shipped tables: TUNEKIT_TABLE=auto checks each at load on this device, `tunekit tables` lists them,
`search --seed-from auto` seeds from the ones of this GPU."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from test_ops import make_table, timed_entry

import tunekit.ops as ops
from tunekit import shipped
from tunekit import table as table_mod
from tunekit.measure.device import detect

pytestmark = pytest.mark.usefixtures("clean_ops")  # conftest.py: no table, markers or vendor GEMM leak

REPO = Path(__file__).resolve().parents[1]
H200 = json.loads((REPO / "benchmarks/results/h200-serve-qwen35-27b-a831b66/table/run.json").read_text())["device"]
N, K, HIDDEN = 8, 64, 64


def _ship(root: Path, gpu: str, model: str, rows: list[dict], device: dict | None = None) -> Path:
    path = make_table(root / gpu / f"{model}.json", rows, device)
    table = json.loads(path.read_text())
    table["shipped"] = {"gpu": table["environment"]["gpu"], "model": model, "ms": [1], "search": "tunekit search ...",
                        "created": table["created"], "speedup_per_token": {"1": 1.25}, "source": "benchmarks/x"}
    path.write_text(json.dumps(table))
    return path


@pytest.fixture
def shipped_dir(tmp_path: Path, monkeypatch) -> Path:
    """A shipped set of two tables: one stamped for this device (the CPU under the interpreter: a right GEMV
    and a wrong fused GEMV, fault_backend:WRONG), one for an H200."""
    root = tmp_path / "tables"
    (root / "cpu").mkdir(parents=True)
    (root / "nvidia-h200").mkdir(parents=True)
    _ship(root, "cpu", "tiny", [timed_entry("gemv", N, K),
                               dict(timed_entry("rms_gemv", N, HIDDEN), backend="fault_backend:WRONG")])
    _ship(root, "nvidia-h200", "tiny", [timed_entry("gemv", 16, K)], device=H200)
    monkeypatch.setattr(shipped, "TABLES_DIR", root)
    return root


def _auto_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if "auto tables" in r.getMessage()]
    assert len(lines) == 1, lines  # one line says what was used and what was dropped
    return lines[0]


def test_auto_serves_this_devices_table_refuses_a_foreign_gpu_and_drops_a_wrong_entry(shipped_dir, monkeypatch,
                                                                                      caplog) -> None:
    monkeypatch.setenv("TUNEKIT_TABLE", "auto")
    with caplog.at_level(logging.INFO, logger="tunekit"):
        loaded = ops.load_tables(None)
    assert [Path(row["path"]).parent.name for row in loaded] == ["cpu"] and loaded[0]["entries"] == 1
    line = _auto_line(caplog)
    assert f"used {detect().name}/tiny: 1 of 2 entries passed their check" in line
    assert "dropped 1: rms_gemv m1 8x64 fault_backend:WRONG:" in line and "bound" in line
    assert "refused NVIDIA H200/tiny: measured on another GPU (gpu: table 'NVIDIA H200'" in line
    # the kept entry serves; the dropped one's calls take the stock path
    x = torch.randn(1, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.ops.tunekit.gemv(x, w, None), torch.nn.functional.linear(x, w))
    assert [r["impl"] for r in ops.dispatch_stats() if r["op"] == "gemv"] == ["tuned:triton"]
    assert ops.served_entry("rms_gemv", "bf16", 1, N, HIDDEN, "cpu") is None


def test_only_a_foreign_gpus_table_is_one_line_and_nothing_served(shipped_dir, caplog) -> None:
    (shipped_dir / "cpu" / "tiny.json").unlink()
    with caplog.at_level(logging.INFO, logger="tunekit"):
        assert ops.load_tables("auto") == []
    line = _auto_line(caplog)
    assert "refused NVIDIA H200/tiny: measured on another GPU" in line and "nothing served from them" in line
    assert ops.served_entry("gemv", "bf16", 1, 16, K, "cpu") is None


def test_a_table_of_this_gpu_timed_with_other_software_serves_its_checked_entries_and_says_so(shipped_dir,
                                                                                              caplog) -> None:
    path = shipped_dir / "cpu" / "tiny.json"
    table = json.loads(path.read_text())
    table["environment"]["kernel_hash"]["triton"] = "0000000000000000"  # the kernels changed since
    table["entries"] = table["entries"][:1]
    path.write_text(json.dumps(table))
    assert table_mod.environment_mismatch(table, detect().as_dict())  # as stamped, serving would refuse it
    with caplog.at_level(logging.INFO, logger="tunekit"):
        assert [row["entries"] for row in ops.load_tables(["auto"])] == [1]
    assert "timed with other software: triton kernel sources: table '0000000000000000'" in _auto_line(caplog)
    assert ops.served_entry("gemv", "bf16", 1, N, K, "cpu") is not None


def test_the_tables_command_lists_the_shipped_set(shipped_dir) -> None:
    from typer.testing import CliRunner

    from tunekit.cli import app

    result = CliRunner().invoke(app, ["tables", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["gpu"], r["model"], r["ms"], r["speedup_per_token"]) for r in rows] == [
        (detect().name, "tiny", [1], {"1": 1.25}), ("NVIDIA H200", "tiny", [1], {"1": 1.25})]
    assert all(r["source"] == "benchmarks/x" and r["created"] for r in rows)


def test_the_real_shipped_set_is_valid_and_every_figure_comes_from_its_results_folder() -> None:
    rows = [shipped.describe(s) for s in shipped.load_all()]
    assert {(r["gpu"], r["model"]) for r in rows} >= {("NVIDIA H200", "qwen3.5-27b"),
                                                      ("NVIDIA H100 80GB HBM3", "qwen3.5-27b")}
    for s in shipped.load_all():
        source = REPO / s.meta["source"]
        recorded = table_mod.load(source / "table.json")
        assert {k: v for k, v in s.table.items() if k != "shipped"} == recorded  # copied as written
        report = (source / "report.md").read_text()
        for m, speedup in s.meta["speedup_per_token"].items():
            assert f"| {m} |" in report and f"| {speedup:.4f} |" in report


def test_seed_from_auto_names_the_tables_of_the_searchs_gpu(shipped_dir) -> None:
    from tunekit.search.studies import seed_paths

    cpu = shipped_dir / "cpu" / "tiny.json"
    assert seed_paths([Path("auto")], detect().as_dict()) == [cpu]
    assert seed_paths([Path("auto"), cpu], H200) == [shipped_dir / "nvidia-h200" / "tiny.json", cpu]


def test_check_shipped_loads_with_the_check_and_hands_its_line_to_the_caller(shipped_dir, tmp_path, monkeypatch,
                                                                            caplog) -> None:
    """The load an integration runs where the device is set (the vLLM plugin's worker): the line is returned
    for the caller's own log, not logged on tunekit's; the digest names what was kept."""
    monkeypatch.setenv("TUNEKIT_TABLE", str(make_table(tmp_path / "own.json", [timed_entry("gemv", N, K)])))
    assert ops.check_shipped() is None  # no shipped table named: nothing loaded, nothing checked
    monkeypatch.setenv("TUNEKIT_TABLE", "auto")
    with caplog.at_level(logging.INFO, logger="tunekit"):
        level, line, digest = ops.check_shipped()
    assert not [r for r in caplog.records if "auto tables" in r.getMessage()]
    assert level == logging.WARNING and "1 of 2 entries passed" in line and "refused NVIDIA H200/tiny" in line
    assert [Path(row["path"]).parent.name for row in ops.loaded_tables()] == ["cpu"]
    assert ops.served_entry("gemv", "bf16", 1, N, K, "cpu") is not None
    assert ops.served_entry("rms_gemv", "bf16", 1, N, HIDDEN, "cpu") is None
    # the same tables give the same digest; a table whose check keeps other entries another
    assert ops.check_shipped()[2] == digest
    (shipped_dir / "cpu" / "tiny.json").unlink()
    assert ops.check_shipped()[2] != digest


def test_host_index_counts_the_shipped_tables_unchecked(shipped_dir, monkeypatch) -> None:
    """Before any GPU work (the vLLM plugin's compile ranges, at config time) the shipped tables are not
    checked; every entry counts, another GPU's too: the check only drops, so this bounds what will serve."""
    from tunekit.dispatch import load_check

    monkeypatch.setattr(load_check, "entry_failure", lambda *a: pytest.fail("host_index checked an entry"))
    index = ops.host_index(None, ops.table_paths("auto"))
    assert index.tops() == {"gemv": 1, "rms_gemv": 1}
    assert index.largest_m("gemv", "bf16", 16, K) == 1  # the H200 table's entry, unchecked
    assert ops.loaded_tables() == []  # nothing served by it (clean_ops: no table loaded)


def test_search_takes_the_shipped_tables_as_seeds_unless_told_none() -> None:
    from tunekit.cli.search_options import seed_sources
    from tunekit.errors import UserError

    assert seed_sources(None) == (Path("auto"),)  # the default: the shipped tables of the search's GPU
    assert seed_sources([Path("run/table.json")]) == (Path("run/table.json"),)
    assert seed_sources([Path("none")]) == ()
    with pytest.raises(UserError, match="none means no seeds"):
        seed_sources([Path("none"), Path("run/table.json")])


@pytest.mark.slow  # a search on the interpreter: the slow tier
def test_a_default_search_measures_this_gpus_shipped_winner_right_after_the_default(tmp_path, monkeypatch) -> None:
    """`search` with no --seed-from on a GPU that has a shipped table measures its winner first, then refines."""
    import optuna
    from test_ops import _entry
    from typer.testing import CliRunner

    from tunekit import cli
    from tunekit.search import finals

    winner = {"BLOCK_N": 2, "BLOCK_K": 128, "num_warps": 2}  # not the default config (trial 0)
    root = tmp_path / "tables"
    (root / "cpu").mkdir(parents=True)
    _ship(root, "cpu", "tiny", [_entry("gemv", 1, 8, 256, params=winner)])
    monkeypatch.setattr(shipped, "TABLES_DIR", root)
    monkeypatch.setattr(finals, "FINAL_REPEATS", 1)  # no assertion reads the final re-measure
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli.app, ["search", "--shape", "8x256", "--m", "1", "--backend", "triton",
                                       "--trials", "2", "--warm-start", "0", "--out", "run"])
    assert res.exit_code == 0, f"{res.output}\n{res.exception!r}"
    assert f"seeds: the shipped tables measured on {detect().name}: {root / 'cpu' / 'tiny.json'}" in res.output
    storage = f"sqlite:///{tmp_path / 'run' / 'optuna.db'}"
    (summary,) = [s for s in optuna.get_all_study_summaries(storage) if s.study_name.endswith("triton|bounded")]
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False)
    assert {k: trials[1].params[k] for k in winner} == winner
