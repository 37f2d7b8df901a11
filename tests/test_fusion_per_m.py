"""Issue 55: a fusion chosen per M, inside the op, on the same folded weights.

A layer group whose fused sequence wins at M=1 and loses at M=2 is folded once (``tunekit.table_fusions.decide``:
fused where one M pays) and the op picks its path per M from the table's ``fused_m``
(``tunekit.dispatch.decisions``): at M=1 the fused kernel, at M=2 (served by the M=8 entries) the unit-gain
norm and the GEMV on the folded weight. Checked on a real checkpoint (SmolLM2-135M, ``tests/real_checkpoints.py``)
through ``tunekit.patch``: the dispatch log shows each path at its M, and the teacher-forced verdict passes at
M=1 and at M=2 (the two prompts' copies decoded as one batch of two). A table whose fusions section predates
the per-M choice is served as before (fused at every M), and says so once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import real_checkpoints as rc
import torch

import tunekit
from tunekit import ops
from tunekit import table as table_mod
from tunekit.evidence.check_serving import forced_hf
from tunekit.table_fusions import FusionGroup, Measured, group_key, record

pytestmark = [pytest.mark.usefixtures("clean_ops", "one_thread"), pytest.mark.needs("hf")]

STEPS, TOPK = 4, 20
BACKEND = "tuned:fault_backend:REORDERED"


def _with_fusions(path: Path, model, per_m: dict[int, Measured], legacy: bool = False) -> Path:
    """``path``'s table with a fusions section: every norm group of ``model`` measured as ``per_m`` says
    (``legacy``: the record as written before the per-M choice, without ``fused_m``)."""
    from tunekit.integrations.torch_fold import _fold_plan

    table = json.loads(path.read_text())
    table["fusions"] = {}
    dtype = ops.dtype_name(next(model.parameters()).dtype)
    for _, op, consumers in _fold_plan(model):
        shapes = tuple(tuple(c.weight.shape) for c in consumers)
        rec = record(FusionGroup("rms_gemv", dtype, shapes, op), per_m)
        if legacy:
            rec.pop("fused_m")
        table["fusions"][group_key("rms_gemv", op, dtype, shapes)] = rec
    return table_mod.save(table, path.with_name(f"fusions-{path.name}"))


def _ms(rows: list[dict], op: str, impl: str) -> set[int]:
    return {r["m"] for r in rows if r["op"] == op and r["impl"] == impl and r["calls"] > 0}


def test_a_group_that_wins_at_m1_and_loses_at_m2_serves_each_path_on_the_folded_weights(tmp_path: Path,
                                                                                       caplog) -> None:
    torch.set_num_threads(1)
    model = rc.load("smollm2", torch.bfloat16)
    # a 3-token prompt: every prefill runs the unfused path (the M = 8 entry serves it), a Triton norm the CPU
    # interpreter takes ~0.2 s a row for; the decode steps are what this test is about
    prompt = rc.prompts("smollm2")[0][:3]
    ref = forced_hf.decode_record(model, [prompt], STEPS, TOPK)
    forced = forced_hf.forced_of(ref)
    spread = forced_hf.prefill_record(model, [prompt], forced, TOPK)
    # the fused sequence faster at M=1, slower at M=8 (which serves M=2)
    per_m = {1: Measured(1.0, 2.0), 8: Measured(3.0, 2.0)}
    table = _with_fusions(rc.table_for(model, tmp_path / "t.json"), model, per_m)
    caplog.set_level(logging.INFO, logger="tunekit")
    with rc.torch_norm_vendors():
        counts = tunekit.patch(model, table=str(table), fold_norms=True)
        try:
            assert counts["rms_gemv"] > 0 and counts.get("rms_norm folded", 0) > 0, counts
            ops.reset_stats()
            at1 = forced_hf.decode_record(model, [prompt], STEPS, TOPK, forced=forced)
            rows1 = ops.dispatch_stats()
            ops.reset_stats()
            # two copies decoded as one batch: every decode step at M = 2
            at2 = forced_hf.decode_record(model, [prompt] * 2, STEPS, TOPK, forced=forced * 2, batch=2)
            rows2 = ops.dispatch_stats()
        finally:
            tunekit.unpatch(model)
    # M=1 decode steps: the fused kernel; M=2: the unfused path on the folded weights (its GEMV tuned)
    assert 1 in _ms(rows1, "rms_gemv", BACKEND), rows1
    assert 1 not in _ms(rows1, "rms_gemv", "fallback:unfused_at_m")  # (the prompt's prefill, M=3, is unfused)
    assert 2 in _ms(rows2, "rms_gemv", "fallback:unfused_at_m"), rows2
    assert 2 not in _ms(rows2, "rms_gemv", BACKEND)
    folded_n = {tuple(map(int, r["shape"].split("x"))) for r in rows2
                if r["op"] == "rms_gemv" and r["impl"] == "fallback:unfused_at_m"}
    gemv_n = {tuple(map(int, r["shape"].split("x"))) for r in rows2 if r["op"] == "gemv" and r["impl"] == BACKEND
              and r["m"] == 2}
    assert folded_n and folded_n <= gemv_n  # the unfused path's GEMV on the same (folded) weight shape, tuned
    assert any("faster at M=1" in line and "slower at M=8" in line for line in caplog.messages), caplog.messages
    for arm in (at1, at2):
        doc = forced_hf.agreement(ref, {**arm, "requests": arm["requests"][:1]}, [spread], dtype="bf16")
        assert doc["verdict"] == "pass", (doc["why"], doc["max_abs_logprob_diff"], doc["kl_max"])
    second = forced_hf.agreement(ref, {**at2, "requests": at2["requests"][1:]}, [spread], dtype="bf16")
    assert second["verdict"] == "pass", second["why"]


def _small_table(tmp_path: Path, legacy: bool) -> Path:
    """rms_gemv and gemv entries (Triton, interpreted) of one 16 x 32 group at M = 1 and 8, and its fusions
    record: faster fused at M=1, slower at M=8 (``legacy``: without ``fused_m``, as tables written before)."""
    from test_ops import make_table, timed_entry

    rows = [timed_entry(op, 16, 32, m=m) for m in (1, 8) for op in ("rms_gemv", "gemv")]
    path = make_table(tmp_path / "small.json", rows)
    table = json.loads(path.read_text())
    group = FusionGroup("rms_gemv", "bf16", ((16, 32),), "rms_norm")
    rec = record(group, {1: Measured(1.0, 2.0), 8: Measured(3.0, 2.0)})
    if legacy:
        rec = dict(rec, fuse=True, why="faster at every M (an older table)")
        rec.pop("fused_m")
    table["fusions"] = {group.key: rec}
    return table_mod.save(table, path)


@pytest.mark.parametrize("legacy", [False, True], ids=["per_m", "older_table"])
def test_the_op_takes_the_path_of_the_m_its_entry_serves(tmp_path: Path, legacy: bool) -> None:
    """The per-M route without a model: at M=1 the fused kernel, at M = 2..8 (the M=8 entry's) the norm and the
    GEMV, equal to the fp64 unfused reference within the op's bound; an older table fuses at every M and says
    once that it has no per-M choice."""
    ops.load_tables(str(_small_table(tmp_path, legacy)))
    weight = torch.ones(32, dtype=torch.bfloat16)
    said = [ops.fold_decision("rms_norm", weight, [(16, 32)]) for _ in range(2)]
    assert all(d.fuse and d.source == "table" for d in said)
    assert [bool(d.notice) for d in said] == ([True, False] if legacy else [False, False])
    torch.manual_seed(0)
    w = torch.randn(16, 32).bfloat16()
    for m in (1, 2, 8):
        x = torch.randn(m, 32).bfloat16()
        ops.reset_stats()
        y = torch.ops.tunekit.rms_gemv(x, w, 1e-6)
        xf = x.double()
        ref = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w.double().T
        assert torch.allclose(y.double(), ref, rtol=0.03, atol=0.03), (m, (y.double() - ref).abs().max())
        impls = {r["impl"] for r in ops.dispatch_stats() if r["op"] == "rms_gemv" and r["calls"]}
        fused = legacy or m == 1
        assert impls == ({"tuned:triton"} if fused else {"fallback:unfused_at_m"}), (m, impls)
        if not fused:  # the unfused path's GEMV: the table's gemv entry, on the same weight
            assert {r["impl"] for r in ops.dispatch_stats() if r["op"] == "gemv" and r["calls"]} == {"tuned:triton"}

