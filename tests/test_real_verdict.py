"""The agreement verdict on real trained checkpoints (SmolLM2-135M-Instruct, Gemma 3 270M: tests/real_checkpoints.py),
through ``tunekit.patch`` on the Hugging Face model, on the CPU: the correct tables pass, and the defects fail.

Every arm decodes the unpatched model's greedy tokens teacher-forced (``check_serving.forced_hf``): 2 prompts x 6
positions, the decode steps at M = 1, where the tables serve. The verdict is ``tunekit.evidence.verdict.judge``
with the caps of the model's dtype, the same function serve-bench judges with; vanilla's spread is measured in
the same run (the same positions through one forward over the whole sequence).

In BF16 a correct table (another summation order, tunekit's norm rounding, the fold's W diag(g) rounded to BF16)
moves these positions by up to 0.4 nats (docs/evidence.md): a dropped K block or a dropped residual is past the
caps, while one norm gain 1% off in one layer, one layer accumulating in BF16 or one misfolded channel is inside
BF16's own noise on these models. In fp32 (the same checkpoints upcast, tables of fp32 entries) a correct table
moves them by 2e-5 nats, and each of the four defects fails, by 20x or more.
"""

from __future__ import annotations

from pathlib import Path

import fault_backend
import pytest
import real_checkpoints as rc
import torch

import tunekit
from tunekit import ops
from tunekit.evidence.check_serving import forced_hf
from tunekit.evidence.verdict import caps_for

pytestmark = [pytest.mark.usefixtures("clean_ops", "one_thread"), pytest.mark.needs("hf")]

STEPS, TOPK = 6, 20


class Subject:
    """A real checkpoint at one dtype: the model, its prompts, vanilla's record and spread, a correct table."""

    def __init__(self, name: str, dtype: torch.dtype, folder: Path) -> None:
        torch.set_num_threads(1)
        self.name, self.gemma = name, name.startswith("gemma")
        self.model = rc.load(name, dtype)
        self.dtype = forced_hf.model_dtype(self.model)
        self.prompts = rc.prompts(name)
        self.ref = forced_hf.decode_record(self.model, self.prompts, STEPS, TOPK)
        self.forced = forced_hf.forced_of(self.ref)
        self.spread = forced_hf.prefill_record(self.model, self.prompts, self.forced, TOPK)
        self.table = rc.table_for(self.model, folder / f"table-{name}-{self.dtype}.json")
        self.layer = self.model.model.layers[len(self.model.model.layers) // 2]

    def judge(self, fold: bool, defect=None) -> dict:
        """Patch with the correct table (``fold``: the norms folded), set the defect, decode teacher-forced, judge;
        the model is unpatched and the faults cleared afterwards."""
        ops.load_tables([])
        rc.clear_faults()
        with rc.torch_norm_vendors():
            counts = tunekit.patch(self.model, table=str(self.table), fold_norms=fold)
            handles = []
            try:
                assert counts.get("rms_gemv" if fold else "linear", 0) > 0, counts
                handles = (defect(self) if defect else None) or []
                record = forced_hf.decode_record(self.model, self.prompts, STEPS, TOPK, forced=self.forced)
            finally:
                for h in handles:
                    h.remove()
                tunekit.unpatch(self.model)
                rc.clear_faults()
        tuned = [r for r in ops.dispatch_stats() if r["impl"] == "tuned:fault_backend:REORDERED"]
        assert tuned, "the table served nothing"
        return forced_hf.agreement(self.ref, record, [self.spread], dtype=self.dtype)


def gain(s: Subject) -> None:  # (a) one norm gain 1% off, in one layer
    rc.arm_fault("gain", s.layer.input_layernorm.weight)


def drop_k_block(s: Subject) -> None:  # (b) one layer's down_proj leaves its first K block out of the sum
    rc.arm_fault("drop_k_block", s.layer.mlp.down_proj.weight)


def bf16_accumulation(s: Subject) -> None:  # (b) one layer's down_proj accumulates its K blocks in BF16
    rc.arm_fault("bf16_acc", s.layer.mlp.down_proj.weight)


def misfold(s: Subject) -> None:  # (c) a fold that scales the wrong channel (q_proj, the largest gain's channel)
    fault_backend.misfold(s.layer.self_attn.q_proj, s.layer.input_layernorm, s.gemma)


def drop_residual(s: Subject) -> list:  # (d) a gemv_add that drops the residual, in one layer
    return fault_backend.drop_residual(s.layer)


@pytest.mark.parametrize("name", rc.NAMES)
def test_in_bf16_a_correct_table_passes_and_a_gross_defect_fails(name: str, tmp_path: Path) -> None:
    s = Subject(name, torch.bfloat16, tmp_path)
    assert s.dtype == "bf16"
    caps = caps_for("bf16")
    spread = forced_hf.figures(s.ref, s.spread, caps)  # vanilla at M = the sequence length: within the caps
    assert spread["max_abs_logprob_diff"] <= caps.logprob and spread["kl_max"] <= caps.kl, spread
    for fold in (True, False):
        doc = s.judge(fold)
        assert doc["verdict"] == "pass", (fold, doc["why"], doc["max_abs_logprob_diff"], doc["kl_max"])
        assert doc["positions"] == len(s.prompts) * STEPS
    for defect in (drop_k_block, drop_residual):
        doc = s.judge(fold=False, defect=defect)
        assert doc["verdict"] == "fail" and not doc["checks"]["logprob"], (
            defect.__name__, doc["max_abs_logprob_diff"], doc["kl_max"])


@pytest.mark.parametrize("name", rc.NAMES)
def test_in_fp32_the_correct_table_passes_and_every_defect_fails(name: str, tmp_path: Path) -> None:
    s = Subject(name, torch.float32, tmp_path)
    assert s.dtype == "fp32"
    caps = caps_for("fp32")
    correct = s.judge(fold=True)
    assert correct["verdict"] == "pass", (correct["why"], correct["max_abs_logprob_diff"])
    assert correct["max_abs_logprob_diff"] < caps.logprob / 10
    figures = {}
    for defect, fold in ((gain, False), (drop_k_block, False), (bf16_accumulation, False), (misfold, True),
                         (drop_residual, False)):
        doc = s.judge(fold, defect)
        figures[defect.__name__] = (doc["verdict"], doc["max_abs_logprob_diff"], doc["kl_max"])
    assert all(v == "fail" for v, _, _ in figures.values()), figures
    assert all(lp > 5 * caps.logprob for _, lp, _ in figures.values()), figures


def test_the_checkpoint_goes_through_the_users_paths(tmp_path: Path) -> None:
    """A built checkpoint is a user's model folder: ``shapes --config DIR`` lists its problems and
    ``serve-bench --model-dir DIR`` takes it (its own weights, judged teacher-forced)."""
    import json
    import os
    import subprocess
    import sys

    from tunekit.evidence.serve_bench.settings import build_settings

    folder = rc.checkpoint("smollm2")
    stamp = json.loads((folder / "tunekit-real.json").read_text())
    assert stamp["architecture"] == "LlamaForCausalLM" and stamp["layers"] == 30 and stamp["dtype"] == "bfloat16"
    res = subprocess.run([sys.executable, "-m", "tunekit", "shapes", "--config", str(folder)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    for shape in ("960", "3072", "49152"):  # qkv_proj, gate_up_proj, lm_head (vLLM's merged shapes)
        assert shape in res.stdout
    table = rc.table_for(rc.load("smollm2"), tmp_path / "table.json")
    s = build_settings(None, None, [table], [1], model_dir=str(folder))
    assert s.weights == "checkpoint" and s.engine(tmp_path)["load_format"] == "auto"
