"""The default search: `tunekit search --model` tunes what serving uses (the fused GEMV families the vLLM
plugin serves included), --ops narrows it, --budget quick trims it and says so. No trial is run: the
search's problem list and trials are read from the SearchConfig the command hands to run_search."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from tunekit.errors import UserError
from tunekit.problems import budget, shapes
from tunekit.problems.models import load_model

SERVED = {"rms_gemv", "gemv_add"}
CHAIN_ONLY = set(shapes.FUSED_GEMV_OPS) - SERVED


def _model_default(name: str, tp: int = 1) -> list[shapes.Problem]:
    m, ops = shapes.search_selection(True, None, None)
    selected = shapes.parse_ops(ops)
    return load_model(name).problems(tp=tp, m_list=shapes.parse_m_list(m, selected), ops=selected)


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "llama-3.1-8b-instruct"])
def test_the_model_default_includes_the_served_fused_families_at_every_m(name) -> None:
    spec = load_model(name)
    problems = _model_default(name)
    by_m = {m: {(p.op, p.n, p.k, p.count) for p in problems if p.m == m} for m in shapes.MODEL_M}
    assert sorted({p.m for p in problems}) == list(shapes.MODEL_M) == [1, 2, 4, 8, 16]
    assert all(shapes_at_m == by_m[1] for shapes_at_m in by_m.values())
    # every GEMV that reads a decoder norm as rms_gemv (the sibling consumers as one), every GEMV that
    # writes the residual as gemv_add: exactly the spec's lists, merged by shape
    fused = Counter()
    for _, op, n, k, count in spec.rms_gemvs(1) + spec.residual_gemvs(1):
        fused[(op, n, k)] += count
    assert {(op, n, k, c) for op, n, k, c in by_m[1] if op in SERVED} == {(*key, c) for key, c in fused.items()}
    ops = {p.op for p in problems}
    assert SERVED <= ops and "gemv" in ops and not ops & CHAIN_ONLY
    assert ops >= {op for _, op, *_ in spec.elementwise(1)}  # the elementwise ops, as before


def test_gemv_add_is_left_out_above_tp_1_and_ops_narrows_exactly() -> None:
    at_tp2 = {p.op for p in _model_default("qwen3.5-0.8b", tp=2)}
    assert "rms_gemv" in at_tp2 and "gemv_add" not in at_tp2  # the add follows the all-reduce there
    spec = load_model("qwen3.5-0.8b")
    assert {p.op for p in spec.problems(m_list=[1], ops=shapes.parse_ops("gemv"))} == {"gemv"}
    # only --shape: gemv at M=1, as before
    assert shapes.search_selection(False, None, None) == ("1", "gemv")
    assert shapes.search_selection(True, "2", "gemv") == ("2", "gemv")


@pytest.fixture
def searched(monkeypatch, tmp_path):
    """Run `tunekit search ARGS` in process up to run_search; returns (exit code, output, SearchConfig)."""
    from tunekit import cli
    from tunekit.evidence import search_summary as summary
    from tunekit.search import engine

    seen = {}

    def fake_run_search(cfg, progress, log):
        seen["cfg"] = cfg
        return SimpleNamespace(run_dir=cfg.out_dir)

    monkeypatch.setattr(engine, "run_search", fake_run_search)
    monkeypatch.setattr(summary, "print_summary", lambda console, outcome: None)
    monkeypatch.setattr(summary, "report_after_search", lambda console, run_dir: None)

    def run(*args: str):
        seen.clear()
        result = CliRunner().invoke(cli.app, ["search", *args, "--backend", "triton", "--out", str(tmp_path / "run")])
        return result.exit_code, result.output, seen.get("cfg")

    return run


def test_cli_search_model_tunes_the_served_fused_families_by_default(searched) -> None:
    code, output, cfg = searched("--model", "qwen3.5-0.8b")
    assert code == 0, output
    assert [p.key for p in cfg.problems] == [p.key for p in _model_default("qwen3.5-0.8b")]
    assert SERVED <= {p.op for p in cfg.problems} and cfg.trials == budget.FULL_TRIALS
    assert "--budget" not in output  # a full budget trims nothing and says nothing
    code, output, cfg = searched("--model", "qwen3.5-0.8b", "--ops", "gemv")
    assert code == 0, output
    assert {p.op for p in cfg.problems} == {"gemv"} and {p.m for p in cfg.problems} == {1, 2, 4, 8, 16}
    code, output, cfg = searched("--model", "qwen3.5-0.8b", "--ops", "rms_gemv", "--m", "1")
    assert code == 0, output
    assert {(p.op, p.m) for p in cfg.problems} == {("rms_gemv", 1)}


def test_cli_search_budget_quick_trims_and_says_what_it_left_out(searched) -> None:
    full = _model_default("qwen3.5-0.8b")
    code, output, cfg = searched("--model", "qwen3.5-0.8b", "--budget", "quick")
    assert code == 0, output
    assert {p.m for p in cfg.problems} == {1} and cfg.trials == budget.QUICK_TRIALS
    at_m1 = [p for p in full if p.m == 1]
    assert 0 < len(cfg.problems) < len(at_m1)
    # the kept ones are the largest estimates, and they make the share asked
    cost = {p.key: budget.estimated_cost(p) for p in at_m1}
    kept = {p.key for p in cfg.problems}
    assert min(cost[k] for k in kept) >= max(c for key, c in cost.items() if key not in kept)
    assert sum(cost[k] for k in kept) >= budget.QUICK_SHARE * sum(cost.values())
    lines = [line for line in output.splitlines() if "--budget quick" in line]
    assert len(lines) == 1, output
    assert f"{len(cfg.problems)} of {len(full)} problems" in lines[0] and "M=1 only" in lines[0]
    assert "left out" in lines[0] and f"{budget.QUICK_TRIALS} trials per study instead of 40" in lines[0]
    # what the user gives stays theirs
    code, output, cfg = searched("--model", "qwen3.5-0.8b", "--budget", "quick", "--m", "1,2", "--trials", "3")
    assert code == 0, output
    assert {p.m for p in cfg.problems} == {1, 2} and cfg.trials == 3
    assert "M=1 only" not in output and "trials per study" not in output
    # only --shape: defaults as before, the budget keeps the one problem
    code, output, cfg = searched("--shape", "96x256", "--budget", "quick", "--trials", "1")
    assert code == 0, output
    assert [p.key for p in cfg.problems] == ["gemv|bf16|m1|n96|k256"] and cfg.trials == 1


def test_an_unknown_budget_is_a_user_error() -> None:
    with pytest.raises(UserError, match="--budget"):
        budget.apply_budget("slow", [], None, m_given=False)
    assert budget.apply_budget("full", [], 7, m_given=False).trials == 7


def test_the_help_and_docs_name_the_budget() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs"
    text = (docs / "commands.md").read_text()
    assert "`--budget`" in text and "rms_gemv and gemv_add" in text
    # docs/search.md's example line is what the budget says for Qwen3.5-27B
    note = budget.apply_budget("quick", _model_default("qwen3.5-27b"), None, m_given=False).note
    assert f"    {note}\n" in (docs / "search.md").read_text()
