"""The agreement verdict at every M a table serves (``check_serving.forced_hf.every_m`` / ``per_m``), on the real
checkpoints in fp32 through ``tunekit.patch``: the same teacher-forced positions decoded as batches of 2 and 4
requests (M = 2, 4: the tables' M = 8 entries serve them) and fed 4 forced tokens per forward (M = 4, a speculative
verify step of 3 draft tokens). A defect confined to M = 2-4 passes the M = 1 verdict and fails here, named; one
at M = 4 alone fails at the verify width; the correct table passes at every M."""

from __future__ import annotations

import fault_backend
import pytest
import real_checkpoints as rc
import torch

import tunekit
from tunekit import ops
from tunekit.evidence.check_serving import forced_hf

pytestmark = [pytest.mark.usefixtures("clean_ops", "one_thread"), pytest.mark.needs("hf"), pytest.mark.slow]

STEPS, TOPK, BATCHES, WIDTHS = 6, 20, (2, 4), (4,)


@pytest.fixture(scope="module", params=rc.NAMES)
def subject(request, tmp_path_factory) -> dict:
    torch.set_num_threads(1)
    model = rc.load(request.param, torch.float32)
    prompts = forced_hf.same_length(rc.prompts(request.param, rc.PROMPTS_EVERY_M), 4)
    ref = forced_hf.decode_record(model, prompts, STEPS, TOPK)
    forced = forced_hf.forced_of(ref)
    return {"model": model, "prompts": prompts, "ref": ref, "forced": forced,
            "vanilla": forced_hf.every_m(model, prompts, forced, TOPK, BATCHES, WIDTHS),
            "spread": forced_hf.prefill_record(model, prompts, forced, TOPK),
            "table": rc.table_for(model, tmp_path_factory.mktemp("t") / "table.json")}


def _judge(s: dict, fault_ms: set[int]) -> tuple[dict, dict]:
    """(the M = 1 verdict, the per-M one) of the correct table with the calls at ``fault_ms`` zeroed."""
    ops.load_tables([])
    rc.clear_faults()
    with rc.torch_norm_vendors():
        tunekit.patch(s["model"], table=str(s["table"]), fold_norms=False)
        try:
            fault_backend.FAULT_MS.update(fault_ms)
            m1 = forced_hf.decode_record(s["model"], s["prompts"], STEPS, TOPK, forced=s["forced"])
            arms = forced_hf.every_m(s["model"], s["prompts"], s["forced"], TOPK, BATCHES, WIDTHS)
        finally:
            tunekit.unpatch(s["model"])
            rc.clear_faults()
    served = {r["m"] for r in ops.dispatch_stats() if r["impl"] == "tuned:fault_backend:REORDERED"}
    assert {1, 2, 4} <= served, served  # every M judged ran tuned kernels
    doc = forced_hf.per_m(s["ref"], arms, {k: v for k, v in s["vanilla"].items() if k in arms}, [s["spread"]],
                          dtype="fp32")
    return forced_hf.agreement(s["ref"], m1, [s["spread"]], dtype="fp32"), doc


def test_batched_and_verify_records_decode_the_same_positions(subject) -> None:
    """Unpatched, each M gives the reference's positions within fp32 rounding: the records line up."""
    for label, record in subject["vanilla"].items():
        assert record["requests"][0]["forced"] == subject["forced"][0], label
        assert len(record["requests"]) == 4 and all(len(r["top"]) == STEPS for r in record["requests"]), label
        doc = forced_hf.agreement(subject["ref"], record, dtype="fp32")
        assert doc["verdict"] == "pass" and doc["max_abs_logprob_diff"] < 1e-3, (label, doc["max_abs_logprob_diff"])


def test_a_correct_table_passes_at_every_m(subject) -> None:
    m1, doc = _judge(subject, set())
    assert m1["verdict"] == "pass" and doc["verdict"] == "pass", doc
    assert set(doc) - {"verdict", "failed_at"} == {"M=2 (batch 2)", "M=4 (batch 4)", "M=4 (verify 1+3)"}


def test_a_defect_at_m_2_to_4_passes_at_m1_and_fails_at_every_m_it_hits(subject) -> None:
    m1, doc = _judge(subject, {2, 3, 4})
    assert m1["verdict"] == "pass"  # what the M = 1 verdict alone concluded
    assert doc["verdict"] == "fail" and doc["failed_at"] == ["M=2 (batch 2)", "M=4 (batch 4)", "M=4 (verify 1+3)"]


def test_a_defect_at_a_verify_width_alone_fails_there(subject) -> None:
    m1, doc = _judge(subject, {4})
    assert m1["verdict"] == "pass" and doc["M=2 (batch 2)"]["verdict"] == "pass"
    assert doc["failed_at"] == ["M=4 (batch 4)", "M=4 (verify 1+3)"], doc["failed_at"]


def test_prompts_of_one_length_are_needed_for_a_batch() -> None:
    assert forced_hf.same_length([[1, 2, 3], [4, 5]], 3) == [[1, 2], [4, 5], [1, 2]]
    with pytest.raises(ValueError, match="one length"):
        forced_hf.decode_record(torch.nn.Identity(), [[1, 2, 3], [4, 5]], 2, 5, batch=2)
