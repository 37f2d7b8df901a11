"""Issue 48: a fusion is decided by one same-run measurement of what will be served, and serving follows it.

The search's fusion phase (``tunekit.search.fusion_phase``) times each layer group's fused sequence against the
unfused one at every M, each step as the table serves it; the table's ``fusions`` section records the decision
(``tunekit.table_fusions``); the torch patch's and the vLLM plugin's folds follow it (``tunekit.ops.fold_decision``)
and a table without the section keeps the older rule, saying so once. Timings are injected with
``tests/fusion_cost_backend.py`` (fixed sleeps per op and M, wide apart: a loaded CPU stretches every sleep).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from test_ops import make_table, timed_entry

from tunekit import ops
from tunekit import table as table_mod
from tunekit.measure.device import detect
from tunekit.problems.shapes import Problem
from tunekit.search import fusion_phase
from tunekit.table_fusions import FusionGroup, Measured, decide, describe, group_key, model_groups, record

REPO = Path(__file__).resolve().parents[1]
COSTED = "fusion_cost_backend:COSTED"
N, K = 16, 32
GROUP = FusionGroup("rms_gemv", "bf16", ((N, K),), "rms_norm", "rms_norm", (), ("input_layernorm+q_proj",), 1)


# ----------------------------------------------------------------------------- the decision rule and the section
def test_a_group_is_fused_at_the_ms_where_its_fused_sequence_wins_and_no_m_vetoes_another() -> None:
    wins = {1: Measured(5.0, 10.0), 2: Measured(9.0, 10.0)}
    fuse, margin, why, fused_m = decide(wins)
    assert fuse and fused_m == [1, 2] and margin == pytest.approx(0.1)
    assert "faster at every M" in why and "M=2" in why
    # one M lost: fused at the others, unfused there (issue 55: one losing M vetoed the group before)
    fuse, margin, why, fused_m = decide({**wins, 4: Measured(12.0, 10.0)})
    assert fuse and fused_m == [1, 2] and margin == pytest.approx(0.1)
    assert why.startswith("faster at M=1,2: by 10.0% at M=2") and "slower at M=4: 12.00 us fused" in why
    # an M without a fused entry: unfused there, fused where it was measured faster
    fuse, margin, why, fused_m = decide({**wins, 8: Measured(note="no rms_gemv entry serves 16x32 at M=8")})
    assert fuse and fused_m == [1, 2] and why.endswith("M=8: no rms_gemv entry serves 16x32 at M=8")
    # no M wins: not fused, the margin the best M's
    fuse, margin, why, fused_m = decide({1: Measured(11.0, 10.0), 2: Measured(13.0, 10.0)})
    assert not fuse and fused_m == [] and margin == pytest.approx(-0.1) and why.startswith("slower at M=1")
    fuse, margin, why, fused_m = decide({8: Measured(note="no entry")})
    assert not fuse and margin is None and fused_m == [] and why == "M=8: no entry"


def test_the_section_validates_and_says_one_line_per_group(tmp_path: Path) -> None:
    rec = record(GROUP, {1: Measured(5.0, 10.0, ["rms_gemv 16x32@triton"], ["rms_norm 32@vendor", "gemv 16x32@x"])})
    path = make_table(tmp_path / "t.json", [timed_entry("gemv", N, K)])
    table = json.loads(path.read_text())
    table["fusions"] = {GROUP.key: rec}
    table_mod.save(table, path)
    assert table_mod.load(path)["fusions"][GROUP.key]["fuse"] is True
    assert describe(GROUP.key, rec) == ("fused: rms_gemv input_layernorm+q_proj (rms_norm|bf16|16x32): faster at M=1: "
                                        "5.00 us fused against 10.00 us unfused (+50.0%)")
    for broken, words in (({"x": rec}, "does not name"), ({GROUP.key: dict(rec, fuse="yes")}, "fuse must be"),
                          ({GROUP.key: dict(rec, per_m={"1": {"fused_us": -1}})}, "fused_us=-1"),
                          ({GROUP.key: dict(rec, fused_m=[])}, "empty exactly where fuse is false"),
                          ({GROUP.key: dict(rec, fused_m=["1"])}, "fused_m")):
        with pytest.raises(table_mod.TableError, match=words):
            table_mod.validate(dict(table, fusions=broken))


def test_the_model_groups_are_the_folds_and_epilogues_vllm_serves() -> None:
    from tunekit.problems.models import load_model

    keys = {g.key: g for g in model_groups(load_model("qwen3.5-27b"))}
    assert set(keys) == {"rms_gemv|gemma_rms_norm|bf16|14336x5120", "rms_gemv|gemma_rms_norm|bf16|34816x5120",
                         "sibling_rms_gemv|gemma_rms_norm|bf16|96x5120+16384x5120", "gemv_add|-|bf16|5120x6144",
                         "gemv_add|-|bf16|5120x17408"}
    siblings = keys["sibling_rms_gemv|gemma_rms_norm|bf16|96x5120+16384x5120"]
    assert siblings.fused_shapes == ((16480, 5120),) and siblings.norm_op == "gemma_fused_add_rms_norm"
    assert siblings.writers == ((5120, 17408),)  # the previous layer's down_proj writes the residual it adds
    assert not [g for g in model_groups(load_model("qwen3.5-27b"), tp=2) if g.family == "gemv_add"]


# ----------------------------------------------------------------------------- the measurement, in process
class _Child:
    """The worker's state as ``search.sequences.measure`` needs it, in this process."""

    device = detect()

    def forget_problem(self) -> None:
        pass


class _Worker:
    def __init__(self) -> None:
        self.tasks: list[dict] = []

    def call(self, task: dict, timeout: float = 0) -> dict:
        from tunekit.search.sequences import measure

        self.tasks.append(task)
        return measure(_Child(), task)


def _row(op: str, m: int, n: int, k: int, backend: str = COSTED, time_us: float = 1000.0) -> dict:
    params = {} if backend == "vendor" else {"COST": 1}
    return {"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "backend": backend, "label": backend,
            "params": json.dumps(params), "time_us": time_us, "baseline_us": 9e4, "baseline": "vendor", "gbps": 1.0,
            "count": 1}


class _Run:
    """What ``fusion_phase`` reads of a search: its config, final rows, device, stamp and log."""

    def __init__(self, out: Path, problems: list[Problem], rows: list[dict]) -> None:
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(problems=problems, fusion_groups=[GROUP], min_gain=0.0, tp=None, out_dir=out,
                                   trial_timeout_s=60)
        self.finals = {p.key: [r for r in rows if (r["op"], r["m"], r["n"], r["k"]) == (p.op, p.m, p.n, p.k)]
                       for p in problems}
        self.device, self.probe, self.usable, self.stamp = detect().as_dict(), {"kind": "cpu"}, [COSTED], "here"
        self.bar = SimpleNamespace(log=print)


def _phase(tmp_path: Path, monkeypatch, costs: dict[str, float], ms=(1, 2)) -> tuple[dict, _Worker, _Run]:
    monkeypatch.setenv("TUNEKIT_TEST_FUSION_MS", json.dumps(costs))
    monkeypatch.setattr(fusion_phase, "FUSION_REPEATS", 3)
    problems = [Problem(op, "bf16", m, n, K) for m in ms for op, n in (("gemv", N), ("rms_gemv", N), ("rms_norm", K))]
    rows = [r for p in problems for r in (_row(p.op, p.m, p.n, p.k), _row(p.op, p.m, p.n, p.k, "vendor", 9e4))]
    tmp_path.mkdir(parents=True, exist_ok=True)
    run, worker = _Run(tmp_path, problems, rows), _Worker()
    from types import SimpleNamespace

    return fusion_phase.fusion_phase(run, SimpleNamespace(worker=worker)), worker, run


def test_the_decision_follows_the_same_run_measurement_both_ways(tmp_path: Path, monkeypatch) -> None:
    # rms_gemv 2 ms against the norm's 40 + the GEMV's 40 at M=1 and M=2: fused
    section, worker, _ = _phase(tmp_path / "a", monkeypatch, {"rms_gemv": 2, "gemv": 40, "rms_norm": 40})
    rec = section[GROUP.key]
    assert rec["fuse"] and rec["margin"] > 0.3 and set(rec["per_m"]) == {"1", "2"}, rec
    assert rec["per_m"]["1"]["fused"] == [f"rms_gemv 16x32@{COSTED}"]
    assert rec["per_m"]["1"]["unfused"] == [f"rms_norm 32@{COSTED}", f"gemv 16x32@{COSTED}"]
    assert [sorted(t["arms"]) for t in worker.tasks] == [["fused", "unfused"]] * 2  # one session per M
    # the same entries, but rms_gemv 120 ms at M=2: it loses there, so the group is fused at M=1 only
    costs = {"rms_gemv": 5, "rms_gemv@2": 120, "gemv": 10, "rms_norm": 10}
    section, _, run = _phase(tmp_path / "b", monkeypatch, costs)
    rec = section[GROUP.key]
    assert rec["fuse"] and rec["fused_m"] == [1] and rec["margin"] > 0 and "slower at M=2" in rec["why"]
    assert rec["per_m"]["1"]["fused_us"] < rec["per_m"]["1"]["unfused_us"]
    # the measurements are kept by the steps they timed: a rerun reads them, export decides again from them
    stored = json.loads((tmp_path / "b" / "fusions.json").read_text())
    assert len(stored["measured"]) == 2 and stored["groups"] == [GROUP.as_dict()]
    from tunekit.search.finals import final_rows

    rows, device = final_rows(run), run.device
    table = table_mod.build_table(rows, device, run.probe, 0.0, run.usable)
    assert fusion_phase.redecide(tmp_path / "b", table, rows, device, run.cfg.problems) == section
    # another table's steps (here: a norm on the stock path) were never timed: not fused, saying so
    other = dict(table, entries=[e for e in table_mod.entries(table) if e.op != "rms_norm"])
    again = fusion_phase.redecide(tmp_path / "b", other, rows, device, run.cfg.problems)[GROUP.key]
    assert not again["fuse"] and again["why"].startswith("M=1: not measured with this table's entries")


def test_an_m_without_a_fused_entry_is_unfused_untimed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TUNEKIT_TEST_FUSION_MS", "{}")
    problems = [Problem(op, "bf16", m, n, K) for m in (1, 2) for op, n in (("gemv", N), ("rms_gemv", N))]
    rows = [_row(p.op, p.m, p.n, p.k) for p in problems if (p.op, p.m) != ("rms_gemv", 2)]
    table = table_mod.build_table(rows, detect().as_dict(), {"kind": "cpu"}, 0.0, [COSTED])
    planner = fusion_phase.Planner(table, rows, detect().as_dict())
    fused, unfused = planner.steps(GROUP, 1)
    assert [s["backend"] for s in unfused] == ["vendor", COSTED]  # no norm entry, no Inductor on a CPU: vendor
    # rms_gemv at M=2 is served by no entry (the lookup rule finds none at or above it)
    assert planner.steps(GROUP, 2) == ("no rms_gemv entry serves 16x32 at M=2 (the fusion would run its unfused "
                                       "fallback there)")
    # a fused-add norm's residual add rides free only where its writer's gemv_add group fuses
    added = FusionGroup("rms_gemv", "bf16", ((N, K),), "rms_norm", "fused_add_rms_norm", ((K, 64),))
    assert [s["op"] for s in planner.steps(added, 1)[0]] == ["rms_gemv", "add"]
    planner.fused_adds[("bf16", K, 64)] = frozenset({2})  # the epilogue serves M=2 only: M=1 still adds
    assert [s["op"] for s in planner.steps(added, 1)[0]] == ["rms_gemv", "add"]
    planner.fused_adds[("bf16", K, 64)] = frozenset({1, 2})
    assert [s["op"] for s in planner.steps(added, 1)[0]] == ["rms_gemv"]


# ----------------------------------------------------------------------------- a whole search, seeded from another GPU
def _foreign_table(tmp_path: Path) -> Path:
    """A table stamped for another GPU whose rms_gemv entry and fusions section say: fuse."""
    device = dict(detect().as_dict(), name="NVIDIA H200", arch="sm_90", is_gpu=True)
    path = make_table(tmp_path / "h200.json", [dict(timed_entry(op, n, K, 0.5), backend=COSTED, params={"COST": 1})
                                               for op, n in (("gemv", N), ("rms_gemv", N), ("rms_norm", K))], device)
    table = json.loads(path.read_text())
    table["fusions"] = {GROUP.key: record(GROUP, {1: Measured(1.0, 9.0)})}
    return table_mod.save(table, path)


def test_a_search_seeded_from_another_gpus_table_measures_its_own_decision(tmp_path: Path, monkeypatch) -> None:
    from tunekit.search import finals
    from tunekit.search.engine import SearchConfig, run_search

    seed = _foreign_table(tmp_path)
    assert json.loads(seed.read_text())["fusions"][GROUP.key]["fuse"] is True
    # here rms_gemv costs 60 ms against the norm's 4 + the GEMV's 4: the fold loses on this device
    monkeypatch.setenv("TUNEKIT_TEST_FUSION_MS", json.dumps({"rms_gemv": 60, "gemv": 4, "rms_norm": 4}))
    monkeypatch.setenv("TUNEKIT_TEST_VENDOR_MS", "150")  # the vendor path slower than every candidate
    paths = [REPO, REPO / "tests", REPO / "tests" / "slow_vendor"]  # the worker's: the backend, the slow vendor
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(finals, "FINAL_REPEATS", 3)
    monkeypatch.setattr(fusion_phase, "FUSION_REPEATS", 3)
    problems = [Problem(op, "bf16", 1, n, K) for op, n in (("gemv", N), ("rms_gemv", N), ("rms_norm", K))]
    out = tmp_path / "run"
    run_search(SearchConfig(problems=problems, backends=[COSTED], out_dir=out, trials=1, warm_start=0,
                            seed_from=(seed,), fusion_groups=[GROUP]), progress=False, log=lambda s: None)
    table = table_mod.load(out / "table.json")
    assert table["environment"]["gpu"] == detect().as_dict()["name"]  # this device's table, not the seed's
    assert {e.op for e in table_mod.entries(table)} == {"gemv", "rms_gemv", "rms_norm"}
    assert all(e.time_us > 1000 for e in table_mod.entries(table))  # measured here (ms sleeps), not the seed's 0.5 us
    rec = table["fusions"][GROUP.key]
    assert rec["fuse"] is False and rec["why"].startswith("slower at M=1")  # measured here, against the seed's word
    assert rec["per_m"]["1"]["fused_us"] > rec["per_m"]["1"]["unfused_us"]


# ----------------------------------------------------------------------------- serving follows the table
def _decided(path: Path, decisions: dict[str, bool]) -> Path:
    """``path``'s table with a fusions section deciding each group key as given (figures to match)."""
    table = json.loads(path.read_text())
    table["fusions"] = {}
    for key, fuse in decisions.items():
        family, norm, dtype, shapes = key.split("|")
        consumers = tuple(tuple(int(v) for v in s.split("x")) for s in shapes.split("+"))
        group = FusionGroup(family, dtype, consumers, None if norm == "-" else norm)
        table["fusions"][key] = record(group, {1: Measured(1.0, 2.0) if fuse else Measured(2.0, 1.0)})
    return table_mod.save(table, path.with_name(f"decided-{path.name}"))


@pytest.mark.needs("hf")
@pytest.mark.usefixtures("clean_ops")
def test_the_torch_patch_folds_as_the_table_decided_not_as_its_entries_price_it(tmp_path: Path, caplog) -> None:
    from test_torch_patch import _fold_table
    from transformers import LlamaConfig, LlamaForCausalLM

    import tunekit
    from tunekit.integrations import torch_patch

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    qkv, gate_up = [(64, 64), (32, 64), (32, 64)], [(96, 64), (96, 64)]
    q_key, mlp_key = group_key("rms_gemv", "rms_norm", "bf16", qkv), group_key("rms_gemv", "rms_norm", "bf16", gate_up)
    caplog.set_level(logging.INFO, logger="tunekit")
    # the entries say every fold pays (0.9 us a folded GEMV); the table measured the attention's fold slower
    paying = _decided(_fold_table(tmp_path, model, 0.9, "rms_norm"), {q_key: False, mlp_key: True})
    with torch.no_grad():
        counts = tunekit.patch(model, table=paying, fold_norms=True)
    assert counts["rms_norm folded"] == 1 and counts["rms_norm (not fused per the table)"] == 1
    assert counts["rms_gemv"] == 2  # gate and up only
    assert "not fused: rms_gemv (rms_norm|bf16|32x64+32x64+64x64): slower at M=1" in caplog.text
    tunekit.unpatch(model)
    # the entries say no fold pays (1.5 us a folded GEMV); the table measured both faster: both fold
    losing = _decided(_fold_table(tmp_path, model, 1.5, "rms_norm"), {q_key: True, mlp_key: True})
    with torch.no_grad():
        counts = tunekit.patch(model, table=losing, fold_norms=True)
    assert counts["rms_norm folded"] == 2 and counts["rms_gemv"] == 5
    tunekit.unpatch(model)
    # a table without the section: the older rule (its entries), said once
    caplog.clear()
    with torch.no_grad():
        counts = tunekit.patch(model, table=_fold_table(tmp_path, model, 1.5, "rms_norm"), fold_norms=True)
    assert counts["rms_norm (fold not in the tables or not paying)"] == 2
    assert caplog.text.count("no fusions section (written before tunekit measured fusions)") == 1
    tunekit.unpatch(model)
    assert torch_patch is not None


@pytest.mark.usefixtures("clean_ops")
def test_the_vllm_fold_and_gemv_add_follow_the_tables_decision(tmp_path: Path) -> None:
    from test_vllm_fold import N_BA, N_GU, N_QKVZ, H, _everything, _layer, _tables
    from torch import nn

    from tunekit.integrations.vllm import fold as vllm_fold
    from tunekit.integrations.vllm import verify_fold
    from tunekit.integrations.vllm.marks import REFUSED

    _tables(tmp_path, rms_gemv_us=0.65)  # by the M=1 entries both norms' folds pay
    (path,) = [Path(t["path"]) for t in ops.loaded_tables()]
    qkvz = group_key("rms_gemv", "gemma_rms_norm", "bf16", [(N_QKVZ, H), (N_BA, H)])
    mlp = group_key("rms_gemv", "gemma_rms_norm", "bf16", [(N_GU, H)])
    ops.load_tables(str(_decided(path, {qkvz: False, mlp: True})))
    layer = _layer()
    report = vllm_fold.FoldReport()
    counts = vllm_fold.fold_model(nn.ModuleList([layer]), _everything, report=report)
    assert counts == {"gemma_rms_norm (not fused per the table)": 1, "gemma_rms_norm folded": 1}
    assert [p.name for p in report.folded] == ["0.post_attention_layernorm"]
    assert any(line.startswith("not fused: rms_gemv") and "slower at M=1" in line for line in report.decisions)
    # gemv_add: a shape the table decided against stays an add, unchecked
    REFUSED.clear()
    rows = [timed_entry("gemv_add", H, N_GU, 0.5)]
    declined = {group_key("gemv_add", None, "bf16", [(H, N_GU)]): False}
    add_path = _decided(make_table(tmp_path / "add.json", rows), declined)
    ops.load_tables(str(add_path))
    down = nn.Module()
    down.weight = nn.Parameter(torch.randn(H, N_GU).bfloat16(), requires_grad=False)
    down.quant_method = type("UnquantizedLinearMethod", (), {})()
    adds = verify_fold.check_residual_adds(nn.ModuleList([down]), _everything)
    assert adds.checked == 0 and adds.declined == [("gemv_add", "bf16", H, N_GU, "cpu")]
    assert ("gemv_add", "bf16", H, N_GU, "cpu") in REFUSED
    REFUSED.clear()
