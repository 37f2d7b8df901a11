"""serve-bench with speculative decoding (``--speculative``): the option and its errors, the engine arguments per
k, vLLM's acceptance counters parsed from a recorded metrics list, the verify steps' M and the dispatch coverage at
those M from recorded markers, and the whole parent on the stub engine (one folder per k, the index). Nothing here
needs vLLM or a GPU; tests/vllm/test_vllm_serve_bench.py checks the same pieces against vLLM 0.33."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from serve_bench_helpers import REPO, TABLE, small_settings, use_fake_runner

from tunekit.errors import UserError
from tunekit.evidence.serve_bench import bench, runner, spec_decode


def test_the_option_takes_repeats_and_comma_lists_in_order() -> None:
    assert spec_decode.parse_speculative(["ngram:5,ngram:3", " ngram:1 "]) == ("ngram:5", "ngram:3", "ngram:1")
    assert spec_decode.parse_speculative([]) == ()
    assert spec_decode.folder("ngram:15") == "ngram-15"


@pytest.mark.parametrize(("value", "fragment"), [
    ("eagle:3", "unknown method 'eagle'"), ("ngram:0", "1..15"), ("ngram:16", "1..15"), ("ngram", "1..15"),
    ("ngram:x", "1..15"), ("ngram:3,ngram:3", "twice")])
def test_bad_values_are_one_line_errors(value: str, fragment: str) -> None:
    with pytest.raises(UserError, match=fragment) as err:
        spec_decode.parse_speculative([value])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("k", [3, 5])
def test_the_engine_arguments_for_each_k(k: int) -> None:
    settings = small_settings(speculative=f"ngram:{k}")
    engine = settings.engine(Path("/m"))
    assert engine["speculative_config"] == {"method": "ngram", "num_speculative_tokens": k,
                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert engine["disable_log_stats"] is False  # LLM.get_metrics() asserts stats logging
    assert settings.prompts == "repeat"
    # the k drafts of the last step fit inside the model length
    assert settings.max_model_len >= settings.prompt_len + settings.tokens + k
    assert settings.key()["speculative"] == f"ngram:{k}" and settings.key()["prompts"] == "repeat"
    # a vLLM without speculative_config must fail, not run without speculating: the runner keeps it
    kept, dropped = runner.engine_kwargs(engine, {"model", "disable_log_stats"})
    assert "speculative_config" in kept and "gdn_prefill_backend" in dropped


def test_without_the_option_nothing_changes() -> None:
    settings = small_settings()
    engine = settings.engine(Path("/m"))
    assert "speculative_config" not in engine and "disable_log_stats" not in engine
    assert "speculative" not in settings.key() and "prompts" not in settings.key()  # earlier runs still resume
    assert small_settings(prompts="repeat").key()["prompts"] == "repeat"
    with pytest.raises(UserError, match="--prompts takes distinct or repeat"):
        small_settings(prompts="random")
    with pytest.raises(UserError, match="unknown method"):
        small_settings(speculative="medusa:2")


def test_repeat_prompts_repeat_their_own_pattern() -> None:
    prompts = runner.make_prompts(4, 20, 32000, "repeat")
    period = runner.REPEAT_PERIOD
    for p in prompts:
        assert len(p) == 20 and len(set(p[:period])) == period
        assert p[period:] == p[:20 - period]  # the proposer's n-gram of the tail is found one period back
        assert all(100 <= t < 32000 for t in p)
    assert len({tuple(p[:period]) for p in prompts}) == 4  # each request its own pattern
    assert runner.make_prompts(2, 20, 32000) == runner.make_prompts(2, 20, 32000, "distinct")


def _metric(name: str, value: int | None = None, values: list[int] | None = None, engine: str = "0"):
    labels = {"model_name": "m", "engine": engine}
    return SimpleNamespace(name=name, labels=labels, value=value) if values is None else \
        SimpleNamespace(name=name, labels=labels, values=values)


def test_vllms_counters_parse_sum_over_engines_and_give_the_acceptance() -> None:
    # LLM.get_metrics() of vLLM 0.33 (v1/metrics/reader.py): Counter(name, labels, value), the per-position
    # counters as one Vector(values); gauges and other counters are ignored; a `_total` name is read alike
    recorded = [_metric("vllm:num_requests_running", 2), _metric("vllm:spec_decode_num_drafts", 10),
                _metric("vllm:spec_decode_num_draft_tokens", 30), _metric("vllm:spec_decode_num_accepted_tokens", 12),
                _metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[7, 4, 1]),
                _metric("vllm:spec_decode_num_drafts_total", 2, engine="1"),
                _metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[1, 1], engine="1")]
    after = spec_decode.counters(recorded)
    assert after == {"drafts": 12, "draft_tokens": 30, "accepted_tokens": 12, "accepted_per_pos": [8, 5, 1]}
    before = {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 3, "accepted_per_pos": [2, 1, 0]}
    d = spec_decode.delta(before, after)
    assert d == {"drafts": 10, "draft_tokens": 24, "accepted_tokens": 9, "accepted_per_pos": [6, 4, 1]}
    acc = spec_decode.acceptance(d)
    assert acc["acceptance_rate"] == pytest.approx(9 / 24)
    assert acc["mean_accepted_length"] == pytest.approx(1 + 9 / 10)
    assert acc["per_position"] == pytest.approx([0.6, 0.4, 0.1])
    # a vLLM that reports none of them: every figure None, nothing invented
    none = spec_decode.counters([_metric("vllm:num_requests_running", 1)])
    assert set(none.values()) == {None}
    assert spec_decode.acceptance(spec_decode.delta(none, none)) == {
        "acceptance_rate": None, "mean_accepted_length": None, "per_position": None}


def test_the_step_hook_records_each_steps_m_and_restores_the_scheduler() -> None:
    class Scheduler:
        def schedule(self, tokens: int, new: bool = False, spec: int = 0):
            return SimpleNamespace(total_num_scheduled_tokens=tokens, scheduled_new_reqs=["r"] if new else [],
                                   scheduled_spec_decode_tokens={"a": [1] * spec} if spec else {})

    sched = Scheduler()
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
        engine_core=SimpleNamespace(scheduler=sched))))
    with spec_decode.StepShapes(llm) as shapes:
        sched.schedule(128, new=True)
        for tokens, spec in ((8, 6), (8, 6), (5, 3), (2, 0)):
            sched.schedule(tokens, spec=spec)
    assert "schedule" not in vars(sched)
    assert shapes.record() == {"decode_m": {"2": 1, "5": 1, "8": 2}, "prefill_steps": 1, "spec_tokens": 15}
    # a vLLM without an in-process scheduler: nothing recorded, nothing raised
    with spec_decode.StepShapes(SimpleNamespace()) as none:
        pass
    assert none.record() is None


def test_an_arms_figures_and_the_coverage_at_the_verify_steps_m() -> None:
    rows = [{"counters": {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 15, "accepted_per_pos": [8, 5, 2]},
             "steps": {"decode_m": {"4": 9, "1": 1}}},
            {"counters": {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 9, "accepted_per_pos": [5, 3, 1]},
             "steps": {"decode_m": {"4": 10}}}, None]
    fig = spec_decode.arm_figures(rows)
    assert fig["counters"] == {"drafts": 20, "draft_tokens": 60, "accepted_tokens": 24, "accepted_per_pos": [13, 8, 3]}
    assert fig["acceptance_rate"] == pytest.approx(0.4) and fig["per_process_acceptance"] == [0.5, 0.3]
    assert fig["decode_m"] == {"1": 1, "4": 19} and fig["mean_m"] == pytest.approx((1 + 76) / 20)
    assert spec_decode.arm_figures([None]) is None
    # recorded markers (analysis.merge_dispatch rows): B = 1, 2 at k = 3 verify up to M = 8; prefill above
    assert spec_decode.verify_bound([1, 2], "ngram:3") == 8
    marker_rows = [
        {"op": "gemv", "m": 4, "impl": "tuned:triton", "calls": 96},
        {"op": "gemv", "m": 8, "impl": "tuned:triton", "calls": 90},
        {"op": "gemv", "m": 8, "impl": "fallback:no_entry", "calls": 6},
        {"op": "rms_norm", "m": 4, "impl": "fallback:no_entry", "calls": 2},
        {"op": "gemv", "m": 128, "impl": "fallback:m_above_table", "calls": 96}]
    cov = spec_decode.verify_coverage({"rows": marker_rows}, 8)
    assert cov["tuned_calls"] == 186 and cov["fallback_calls"] == 8
    assert cov["by_m"]["4"] == {"tuned": 96, "fallback": 2, "ops": {"gemv": {"tuned:triton": 96},
                                                                   "rms_norm": {"fallback:no_entry": 2}}}
    assert list(cov["by_m"]) == ["4", "8"]
    assert spec_decode.verify_coverage(None, 8) is None
    # an arm that verified other numbers of tokens than vanilla: named, since its TPOT compares other work
    note = spec_decode.acceptance_note(2, {"vanilla": {"acceptance_rate": 0.50}, "tuned": {"acceptance_rate": 0.40},
                                           "passthrough": {"acceptance_rate": 0.51}})
    assert note is not None and "tuned 0.400" in note and "passthrough" not in note
    assert spec_decode.acceptance_note(2, {"vanilla": {"acceptance_rate": 0.5}, "tuned": {"acceptance_rate": 0.5}}) \
        is None


def test_every_k_runs_every_arm_on_the_stub_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_runner(tmp_path, monkeypatch)
    out = tmp_path / "serve"
    lines: list[str] = []
    settings = [small_settings(speculative=v, processes=1) for v in ("ngram:3", "ngram:5")]
    doc = bench.run_speculative(settings, out, lines.append)
    assert [v["speculative"] for v in doc["variants"]] == ["ngram:3", "ngram:5"]
    for k in (3, 5):
        serve = json.loads((out / f"ngram-{k}" / "serve.json").read_text())
        spec = json.loads((out / f"ngram-{k}" / "runs" / "tuned-0.spec.json").read_text())
        assert spec["engine"]["speculative_config"]["num_speculative_tokens"] == k and spec["prompts"] == "repeat"
        assert serve["speculative"]["verify_max_m"] == 2 * (1 + k)
        for row in serve["batches"]:
            b = row["batch"]
            for arm in ("vanilla", "passthrough", "tuned"):  # the stub accepts k // 2 of k drafts per step
                fig = row["spec_decode"][arm]
                assert fig["acceptance_rate"] == pytest.approx((k // 2) / k)
                assert fig["mean_accepted_length"] == pytest.approx(1 + k // 2)
                assert fig["decode_m"] == {str(b * (1 + k)): 45}  # (1 warm-up + 2 repeats) x 15 steps
        # coverage at the verify steps' M: the stub's table serves up to M = 8 (k = 3 at B = 2), above it falls back
        by_m = serve["speculative"]["coverage"]["tuned"]["by_m"]
        assert by_m[str(1 + k)]["tuned"] == 48
        assert by_m[str(2 * (1 + k))] == ({"tuned": 48, "fallback": 0, "ops": {"gemv": {"tuned:triton": 48}}}
                                          if k == 3 else
                                          {"tuned": 0, "fallback": 48, "ops": {"gemv": {"fallback:m_above_table": 48}}})
        assert serve["speculative"]["coverage"]["passthrough"]["tuned_calls"] == 0
        md = (out / f"ngram-{k}" / "serve.md").read_text()
        assert f"vLLM's ngram:{k} in every arm" in md and "Dispatch coverage at the verify steps' M" in md
    index = (out / "serve.md").read_text()
    assert "[ngram:3](ngram-3/serve.md) | 1 |" in index and "[ngram:5](ngram-5/serve.md) | 2 |" in index
    # --report-only on the top folder rebuilds every setting's report and the index
    again = bench.report_dir(out, log=lines.append)
    assert again["variants"] == json.loads((out / "serve.json").read_text())["variants"]


def test_cli_speculative_errors_are_one_line(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "tunekit", "serve-bench", "--model", "qwen3.5-27b", "--table",
                          str(TABLE), "--speculative", "ngram:3,ngram:20", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode != 0
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "ngram:20" in err[0] and "1..15" in err[0]
