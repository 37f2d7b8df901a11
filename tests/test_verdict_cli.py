"""``tunekit verdict``: a table judged on a checkpoint at every M it serves (SmolLM2-135M, BF16 as saved, CPU).
Two prompts, batches of 2 (served by the table's M = 8 entries), verify width 4, norms unfolded (a folded norm
above the table would run an interpreted kernel here): the correct table passes at every M; with its calls at
M = 2 zeroed it fails there, named; a table that serves nothing is an error, never a pass."""

from __future__ import annotations

import json
from pathlib import Path

import fault_backend
import pytest
import real_checkpoints as rc
import torch
from typer.testing import CliRunner

from tunekit.cli import app

pytestmark = [pytest.mark.usefixtures("clean_ops", "one_thread"), pytest.mark.needs("hf"), pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[Path, Path]:
    torch.set_num_threads(1)
    folder = rc.checkpoint("smollm2")
    table = rc.table_for(rc.load("smollm2"), tmp_path_factory.mktemp("t") / "table.json")
    return folder, table


FAST = ("--prompts", "2", "--batches", "2", "--steps", "4", "--no-fold-norms")


def _verdict(folder: Path, table: Path, out: Path, *extra: str):
    with rc.torch_norm_vendors():  # a norm above the table runs PyTorch's math, not an interpreted kernel
        result = CliRunner().invoke(app, ["verdict", "--model-dir", str(folder), "--table", str(table),
                                          "--out", str(out), *FAST, *extra])
    return result, json.loads(out.read_text()) if out.is_file() else {}


def test_a_correct_table_passes_at_every_m_it_serves(smollm2, tmp_path) -> None:
    result, doc = _verdict(*smollm2, tmp_path / "v.json")
    assert result.exit_code == 0, result.output
    assert "verdict: pass" in result.output
    for label in ("M=1 (decode)", "M=2 (batch 2)", "M=4 (verify 1+3)"):
        assert doc[label]["verdict"] == "pass" and label in result.output, label
    assert any(impl.startswith("tuned:") for impl in doc["served"]["2"])  # the M = 8 entries served the batch


def test_a_defect_at_one_m_fails_there_and_says_where(smollm2, tmp_path) -> None:
    fault_backend.FAULT_MS.add(2)
    try:
        result, doc = _verdict(*smollm2, tmp_path / "v.json")
    finally:
        rc.clear_faults()
    assert result.exit_code == 1, result.output
    assert doc["failed_at"] == ["M=2 (batch 2)"] and "verdict: fail at M=2 (batch 2)" in result.output
    assert doc["M=1 (decode)"]["verdict"] == "pass"


def test_a_table_that_serves_nothing_is_an_error(smollm2, tmp_path) -> None:
    from tunekit.errors import UserError

    folder, table = smollm2  # a BF16 table: no entry serves the checkpoint loaded in fp32
    result, doc = _verdict(folder, table, tmp_path / "v.json", "--dtype", "fp32", "--widths", "")
    assert isinstance(result.exception, UserError) and not doc, result.output
    assert "served no call of this model in fp32" in str(result.exception)
