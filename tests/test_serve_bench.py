"""tunekit serve-bench: the parent's logic on a stub engine, the runner on stub vLLM objects, the endpoint
client against a local fake OpenAI-compatible server. Nothing here needs vLLM or a GPU."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from tunekit.errors import UserError
from tunekit.evidence.serve_bench import analysis, bench, endpoint, runner

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "serve_bench"
TABLE = DATA / "table-h200.json"
FAKE_RUNNER = DATA / "fake_runner.py"


# ---------------------------------------------------------------------------
# Settings, model folder, arms
# ---------------------------------------------------------------------------


def test_vllm_config_of_a_builtin_shrinks_layers_and_takes_the_form_that_ran() -> None:
    settings = bench.build_settings("qwen3.5-27b", None, [TABLE], [1, 2], layers=4)
    cfg = settings.model_config
    assert cfg["num_hidden_layers"] == 4
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    # the rotary fields as in the Qwen3.5 text config that served on the GPU machine
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}
    assert not {"rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"} & set(cfg)
    assert settings.tables == (str(TABLE.resolve()),)
    engine = settings.engine(Path("/x/model"))
    assert engine["max_num_seqs"] == 2 and engine["load_format"] == "dummy" and engine["skip_tokenizer_init"]
    assert engine["max_model_len"] >= 64 + 128 and engine["max_model_len"] % 64 == 0
    assert engine["gdn_prefill_backend"] == "triton" and engine["enable_prefix_caching"] is False


def test_vllm_config_keeps_a_dense_model_and_nested_text_config(tmp_path: Path) -> None:
    cfg = bench.vllm_model_config({"model_type": "llama", "num_hidden_layers": 32, "rope_theta": 5e5}, 2)
    assert cfg == {"model_type": "llama", "num_hidden_layers": 2, "rope_theta": 5e5,
                   "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    nested = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "rope_theta": 1e7,
                              "layer_types": ["linear_attention"] * 7 + ["full_attention"]}}
    out = bench.vllm_model_config(nested, 4)
    assert out["text_config"]["num_hidden_layers"] == 4 and len(out["text_config"]["layer_types"]) == 4
    assert out["text_config"]["rope_parameters"]["rope_theta"] == 1e7
    with pytest.raises(UserError, match="--layers must be 1..8"):
        bench.vllm_model_config(nested, 9)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"model": "qwen3.5-27b", "config": None, "tables": []}, "at least one --table"),
        ({"model": "qwen3.5-27b", "config": None, "tables": [DATA / "missing.json"]}, "no such table"),
        ({"model": None, "config": None, "tables": [TABLE]}, "one of --model or --config"),
        ({"model": "qwen3.5-27b", "config": None, "tables": [TABLE], "tokens": 1}, "--tokens"),
        ({"model": "qwen3.5-27b", "config": None, "tables": [TABLE], "arms": ["tuned"]}, "--arms"),
        ({"model": "qwen3.5-27b", "config": None, "tables": [TABLE], "layers": 65}, "--layers"),
    ],
)
def test_build_settings_errors(kwargs: dict, fragment: str) -> None:
    with pytest.raises(UserError, match=fragment):
        bench.build_settings(**kwargs)


def test_plugin_cost_alone_needs_no_table() -> None:
    """vanilla against passthrough measures the plugin's own cost: no tuned arm, so no --table needed."""
    s = bench.build_settings("qwen3.5-27b", None, [], arms=["passthrough", "vanilla"])
    assert s.arms == ("vanilla", "passthrough") and s.tables == ()


def test_corrupt_table_is_one_error(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="corrupt table"):
        bench.build_settings("qwen3.5-27b", None, [bad])


def test_schedule_alternates_arms_over_processes() -> None:
    assert bench.schedule(("vanilla", "passthrough", "tuned"), 3) == [
        ("vanilla", 0), ("passthrough", 0), ("tuned", 0), ("vanilla", 1), ("passthrough", 1), ("tuned", 1),
        ("vanilla", 2), ("passthrough", 2), ("tuned", 2)]
    assert bench.schedule(("tuned", "vanilla"), 2) == [("vanilla", 0), ("tuned", 0), ("vanilla", 1), ("tuned", 1)]


def _vllm_loads(value: str | None, names: list[str]) -> list[str]:
    """vLLM's load_plugins_by_group: VLLM_PLUGINS unset loads all, else the comma-split names."""
    allowed = None if value is None else value.split(",")
    return [n for n in names if allowed is None or n in allowed]


def test_plugin_allow_lists_follow_vllms_semantics() -> None:
    eps = {"vllm.general_plugins": ["qwen35_text", "tunekit"], "vllm.platform_plugins": ["oot_gpu"],
           "vllm.endpoint_plugins": ["routes"]}  # opt-in: off unless named, so never named here
    without, with_plugin = bench.plugin_allow_lists(eps, None)
    names = ["oot_gpu", "qwen35_text", "tunekit"]
    assert _vllm_loads(without, names) == ["oot_gpu", "qwen35_text"]  # the platform plugin stays
    assert _vllm_loads(with_plugin, names) == names
    # tunekit alone: an empty allow-list, which loads nothing (not everything, as an unset one would)
    without, with_plugin = bench.plugin_allow_lists({"vllm.general_plugins": ["tunekit"]}, None)
    assert without == "" and _vllm_loads(without, ["tunekit"]) == [] and with_plugin == "tunekit"
    # the caller's own allow-list is kept
    assert bench.plugin_allow_lists(eps, "qwen35_text,tunekit") == ("qwen35_text", "qwen35_text,tunekit")


def test_arm_env(tmp_path: Path) -> None:
    settings = bench.build_settings("qwen3.5-27b", None, [TABLE, TABLE], [1])
    probe = {"entry_points": {"vllm.general_plugins": ["qwen35_text", "tunekit"]}, "flashinfer": False}
    base = {"TUNEKIT_TABLE": "/stale.json", "TRITON_INTERPRET": "1", "PYTHONPATH": "/site", "KEEP": "1"}
    envs = {arm: bench.arm_env(arm, 1, base, settings, probe, tmp_path) for arm in ("vanilla", "passthrough", "tuned")}
    assert envs["vanilla"]["VLLM_PLUGINS"] == "qwen35_text"
    assert envs["passthrough"]["VLLM_PLUGINS"] == envs["tuned"]["VLLM_PLUGINS"] == "qwen35_text,tunekit"
    assert "TUNEKIT_TABLE" not in envs["vanilla"] and "TUNEKIT_TABLE" not in envs["passthrough"]
    assert envs["tuned"]["TUNEKIT_TABLE"].split(os.pathsep) == [str(TABLE.resolve())] * 2
    for arm, env in envs.items():
        assert env["TUNEKIT_DISPATCH_LOG"] == str(tmp_path.resolve() / "dispatch" / f"{arm}-1-{{pid}}.json")
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1" and env["KEEP"] == "1"
        assert "TRITON_INTERPRET" not in env
        assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/site"]
    with_fi = bench.arm_env("tuned", 0, {}, settings, dict(probe, flashinfer=True), tmp_path)
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in with_fi


# ---------------------------------------------------------------------------
# The whole parent on the stub engine
# ---------------------------------------------------------------------------


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    record = tmp_path / "record.txt"
    monkeypatch.setenv(bench.RUNNER_ENV, f"{sys.executable} {FAKE_RUNNER}")
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("FAKE_PROBE", raising=False)
    monkeypatch.delenv("FAKE_TUNED_MISMATCH", raising=False)
    monkeypatch.delenv("FAKE_FAIL_ARM", raising=False)
    monkeypatch.delenv("FAKE_ENGINE_SLEEP", raising=False)
    return record


def _settings(**kw) -> bench.Settings:
    opts = {"tokens": 16, "prompt_len": 8, "repeats": 2, "processes": 2, "layers": 4, "runner_timeout_s": 120.0}
    opts.update(kw)
    return bench.build_settings("qwen3.5-27b", None, [TABLE], [1, 2], **opts)


def test_prediction_equals_the_chains_for_the_same_tables() -> None:
    """The recorded H200 chain run predicted its saving per step from these two tables (Chain.kinds);
    the served-model prediction (ModelSpec.problems x table.lookup) must give the same figures."""
    from tunekit import table as table_mod
    from tunekit.problems.models import load_model

    run = REPO / "benchmarks" / "results" / "h200-chain-m1248-59df7cf" / "chain.json"
    chain = json.loads(run.read_text())
    merged = analysis.merged_table(table_mod.load(REPO / p) for p in chain["tables"])
    spec = load_model(chain["model"])
    for row in (r for r in chain["results"] if r["variant"] == "tuned"):
        pred = analysis.predicted_saving_us(spec, merged, row["m"])
        assert pred["saving_us"] == pytest.approx(row["predicted_saving_us"], rel=1e-9)
        assert pred["served_calls"] == row["tuned_steps"] and pred["calls"] == chain["calls_per_step"]


def test_run_offline_on_the_stub_engine(fake: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve"
    lines: list[str] = []
    serve = bench.run_offline(_settings(), out, lines.append)

    # one process per arm and round, in the alternating order, each seeing its arm's environment
    record = [ln.split() for ln in fake.read_text().splitlines()]
    assert [(a, int(i)) for a, i, _, _ in record] == bench.schedule(("vanilla", "passthrough", "tuned"), 2)
    assert all(arm == seen for arm, _, _, seen in record)  # the stub engine decided the arm from the env alone
    runs = {(r["arm"], r["index"]): r for docs in serve["arms"].values() for r in docs}
    assert runs[("vanilla", 0)]["env"]["VLLM_PLUGINS"] == "qwen35_text"
    assert runs[("tuned", 1)]["env"]["VLLM_PLUGINS"] == "qwen35_text,tunekit"
    assert runs[("tuned", 1)]["env"]["TUNEKIT_TABLE"] == str(TABLE.resolve())
    assert runs[("passthrough", 0)]["env"]["TUNEKIT_TABLE"] is None
    assert runs[("vanilla", 0)]["plugin"]["loaded"] is False and runs[("tuned", 0)]["plugin"]["loaded"] is True
    assert runs[("vanilla", 0)]["dispatch"] is None
    # the stub vLLM has no gdn_prefill_backend: dropped, not fatal
    assert runs[("tuned", 0)]["engine_args_dropped"] == ["gdn_prefill_backend"]
    assert (out / "model" / "config.json").is_file()
    assert json.loads((out / "model" / "config.json").read_text())["num_hidden_layers"] == 4

    # the stub's TPOT per arm comes back through the difference method
    assert serve["device"] == "Fake H200" and serve["vllm"] == "0.0.fake"
    for row in serve["batches"]:
        assert row["vanilla_tpot_ms"] == pytest.approx(2.0, rel=0.25)
        assert row["tuned_tpot_ms"] == pytest.approx(1.6, rel=0.25)
        assert row["passthrough_tpot_ms"] == pytest.approx(2.4, rel=0.25)
        assert 1.05 < row["speedup"] < 1.5 and row["speedup_min"] <= row["speedup_max"]
        assert row["passthrough_ratio"] < 1.0
        assert row["tpot"]["vanilla"]["processes"] == 2
        assert row["tokens_per_s"]["tuned"] == pytest.approx(row["batch"] / row["tuned_tpot_ms"] * 1000)
        assert row["measured_saving_ms"] == pytest.approx(row["vanilla_tpot_ms"] - row["tuned_tpot_ms"])

    # prediction from the table at M = B over the 4-layer model: 3 in_proj_ba GEMVs + layer 0's norm
    # (served at M=1 and 2 by the M=8 entry, the ops' lookup rule)
    b1, b2 = serve["batches"]
    assert b1["predicted_saving_ms"] == pytest.approx((3 * (7.2 - 2.5) + 1.0) / 1000)
    assert b2["predicted_saving_ms"] == pytest.approx((3 * (7.5 - 3.0) + 1.0) / 1000)
    assert b1["predicted_served_calls"] == 4
    v = b1["vanilla_tpot_ms"]
    assert b1["predicted_speedup"] == pytest.approx(v / (v - b1["predicted_saving_ms"]))

    # coverage merged from the dispatch files of both processes of the arm, at M = B only
    cov = b1["coverage"]["tuned"]
    assert cov["by_op"]["gemv"] == {"tuned:triton": 96}
    assert cov["by_op"]["gemma_rms_norm"] == {"fallback:no_entry": 2}
    assert b1["coverage"]["passthrough"]["tuned_calls"] == 0
    assert b1["coverage"]["passthrough"]["fallback_reasons"] == {"no_table": 98}
    top = serve["coverage"]["tuned"]
    assert top["processes"] == 2 and top["fallback_reasons"]["m_above_table"] == 2 * 2 * 48
    assert top["counted_at"]["capture"] > 0 and "capture" in top["note"]
    assert len(list((out / "dispatch").glob("tuned-*.json"))) == 2

    # agreement: tuned within the tolerance, the B=2 flip is a near tie; vanilla runs agree exactly
    ag1, ag2 = b1["agreement"], b2["agreement"]
    assert ag1["verdict"] == "pass" and ag1["tuned_vs_vanilla"]["ids_equal"] == 2 * 1
    assert ag1["tuned_vs_vanilla"]["max_abs_logprob_diff"] == pytest.approx(0.001, abs=1e-9)
    assert ag1["vanilla_vs_vanilla"]["max_abs_logprob_diff"] == 0.0
    assert ag1["passthrough_vs_vanilla"]["max_abs_logprob_diff"] == 0.0
    assert ag2["verdict"] == "pass" and ag2["tuned_vs_vanilla"]["near_ties"] == 2
    assert ag2["tuned_vs_vanilla"]["first_divergence"] == 5

    # files
    on_disk = json.loads((out / "serve.json").read_text())
    for key in ("model", "device", "vllm", "torch", "tunekit_commit", "arms", "batches"):
        assert key in on_disk
    assert set(on_disk["arms"]) == {"vanilla", "passthrough", "tuned"}
    for key in ("batch", "vanilla_tpot_ms", "passthrough_tpot_ms", "tuned_tpot_ms", "speedup", "speedup_min",
                "speedup_max", "passthrough_ratio", "predicted_speedup", "predicted_saving_ms",
                "measured_saving_ms", "tokens_per_s", "coverage", "agreement"):
        assert key in on_disk["batches"][0]
    md = (out / "serve.md").read_text()
    assert "| 1 |" in md and "tuned vs vanilla" in md and "counted at capture" in md
    assert (out / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(ln.startswith("B=1") and "speedup" in ln for ln in lines)

    # a rerun resumes: nothing runs again, the same report comes back
    fake.write_text("")
    again = bench.run_offline(_settings(), out, lines.append)
    assert fake.read_text() == "" and again["batches"][0]["speedup"] == serve["batches"][0]["speedup"]
    assert any("finished earlier, kept" in ln for ln in lines)
    # other settings in the same folder: refused
    with pytest.raises(UserError, match="other settings"):
        bench.run_offline(_settings(tokens=32), out, lines.append)
    # the report alone, from the files
    assert bench.report_dir(out, log=lines.append)["batches"][1]["agreement"]["verdict"] == "pass"


def test_profile_tells_where_the_saving_came_from(fake: Path, tmp_path: Path) -> None:
    """--profile-steps: each process profiles decode steps after its timing; the report puts vanilla's
    kernel time per category next to tuned's, and what is left of TPOT outside the kernels."""
    out = tmp_path / "serve"
    serve = bench.run_offline(_settings(profile_steps=4, arms=["vanilla", "tuned"]), out, lambda s: None)
    for row in serve["batches"]:
        prof = row["profile"]
        assert prof["vanilla"]["processes"] == prof["tuned"]["processes"] == 2
        # (1 + 4 tokens) - (1 token), over 4 steps: the stub's per-token kernels exactly, prefill cancelled
        assert prof["vanilla"]["per_step"]["vendor_gemm"] == {"us": 1500.0, "kernels": 300.0}
        assert prof["tuned"]["busy_us"] == pytest.approx(1420.0) and prof["tuned"]["kernels"] == 480
        cmp = row["profile_compare"]["categories"]
        assert cmp["vendor_gemm"]["saved_us"] == 1500.0 and cmp["tunekit_gemv"]["saved_us"] == -1150.0
        assert cmp["inductor"]["saved_us"] == 180.0 and cmp["other"]["saved_us"] == 0.0
        assert row["profile_compare"]["kernel_saved_us"] == pytest.approx(380.0)
        outside = row["profile_compare"]["outside_kernels_us"]
        assert outside["vanilla"] == pytest.approx(row["vanilla_tpot_ms"] * 1000 - 1800.0)
        assert outside["tuned"] == pytest.approx(row["tuned_tpot_ms"] * 1000 - 1420.0)
        changed = row["profile_compare"]["kernels_changed"]  # the stub names one kernel per category
        assert changed["vendor_gemm: vendor_gemm_kernel"]["saved_us"] == 1500.0
        assert list(changed)[:2] == ["vendor_gemm: vendor_gemm_kernel", "tunekit_gemv: tunekit_gemv_kernel"]
    md = (out / "serve.md").read_text()
    assert "Kernel time per decode step" in md and "| 1 | vendor_gemm | 1500.0 | 0.0 | +1500.0 | 300 / 0 |" in md
    assert "| 1 | `vendor_gemm: vendor_gemm_kernel` | 1500.0 | 0.0 | +1500.0 | 300 / 0 |" in md
    # the host ops of the 1-token generate: what the tuned arm's prefill spends beyond vanilla's
    assert "| 1 | `tunekit::gemv` | 0.000 | 2.000 | 0 / 10 |" in md
    assert "| 1 | **kernels, all** |  |  | +380.0 |  |" in md
    # ... and the Python between the ops (a real cProfile of the stub's 1-token generate): the tuned arm's
    # routed calls, 10 per generate, none in vanilla
    routed = [ln for ln in md.splitlines() if "fake_runner.py:" in ln and "(_routed_call)`" in ln]
    assert routed and all(ln.endswith("| 0 / 10 |") for ln in routed), routed
    py = serve["batches"][0]["profile"]["tuned"]["prefill_python"]
    assert any(k.endswith("(_routed_call)") and v["calls"] == 10 and v["us"] > 0 for k, v in py.items())
    # the same generate's work, counted: the stub's 1-token kernels, and at least its 10 routed calls more
    work = serve["batches"][0]["profile_compare"]["prefill_work"]
    assert work["vanilla"]["kernels"] == 500 and work["tuned"]["kernels"] == 520
    assert work["tuned"]["python_calls"] >= work["vanilla"]["python_calls"] + 10
    assert "Work of a 1-token generate, counted" in md and "| 1 | 500 / 520 |" in md
    # the profile is part of what a resume must match; a run without one keeps the old key
    with pytest.raises(UserError, match="other settings"):
        bench.run_offline(_settings(arms=["vanilla", "tuned"]), out, lambda s: None)
    assert "profile_steps" not in _settings().key()
    with pytest.raises(UserError, match="--profile-steps"):
        _settings(profile_steps=-1)


def test_a_failing_profiler_keeps_the_timing_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile runs after the timing: a profiler that raises is recorded on the row, never raised,
    so the process's TPOTs survive."""
    from tunekit.evidence.serve_bench import profile

    def no_kernels(run):  # CPU torch has no CUDA activity to profile: a profiler that sees no kernels
        run()
        return {}, {}, {}

    monkeypatch.setattr(profile, "profile_totals", no_kernels)
    monkeypatch.setattr(profile, "host_profile", lambda run: (run(), {})[1])

    def broken(n: int) -> None:
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    row = runner.profile_row(broken, 4, have_cuda=True)
    assert row == {"profile": None, "profile_error": "profiler failed: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}
    assert runner.profile_row(broken, 4, have_cuda=False)["profile_error"].startswith("no CUDA device")
    ok = runner.profile_row(lambda n: None, 4, have_cuda=True)
    assert ok["profile"]["kernels"] == 0 and "profile_error" not in ok


def test_kernel_categories_and_the_decode_step_difference(tmp_path: Path) -> None:
    """Kernel names as the H200's traces spell them; a gzip Chrome trace in torch's format."""
    import gzip

    from tunekit.evidence.serve_bench import profile

    names = {
        "_gemv_kernel": "tunekit_gemv", "_split_k_reduce_kernel": "tunekit_gemv", "tunekit_gemv": "tunekit_gemv",
        "_fused_add_rms_norm_kernel": "tunekit_elementwise", "tunekit_silu_and_mul": "tunekit_elementwise",
        "nvjet_tst_128x64_64x8_1x2_h_bz_coopB_NTN": "vendor_gemm",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)":
            "vendor_gemm",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>(...)": "vendor_gemm",
        "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<256, 64>>(...)": "attention",
        "fused_recurrent_gated_delta_rule_fwd_kernel": "recurrence", "_causal_conv1d_update_kernel": "recurrence",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "inductor",
        "triton_poi_fused_gemv_mul_silu_slice_1": "inductor",  # Inductor's, after the tunekit GEMV it reads
        "triton_per_fused_attention_0": "inductor",
        "void vllm::rms_norm_kernel<c10::BFloat16, 8>(...)": "other",
        "void at::native::vectorized_elementwise_kernel<4>(...)": "other",
    }
    assert {n: profile.categorize(n) for n in names} == names

    def trace(tokens: int) -> dict:
        events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99.0}, {"ph": "i", "cat": "kernel"}]
        for _ in range(1 + tokens):  # a prefill-like extra launch of each
            events.append({"ph": "X", "cat": "kernel", "name": "_gemv_kernel", "dur": 3.0})
            events.append({"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8", "dur": 5.0})
            events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "dur": 1.0})
        return {"traceEvents": events}

    paths = []
    for tokens in (1, 9):
        path = tmp_path / f"t{tokens}.pt.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump(trace(tokens), f)
        paths.append(path)
    short, long = (profile.kernel_totals(profile.read_trace(p)) for p in paths)
    assert short == {"tunekit_gemv": {"us": 6.0, "kernels": 2}, "vendor_gemm": {"us": 10.0, "kernels": 2},
                     "copies": {"us": 2.0, "kernels": 2}}
    step = profile.per_step(short, long, 8)
    assert step == {"copies": {"us": 1.0, "kernels": 1.0}, "tunekit_gemv": {"us": 3.0, "kernels": 1.0},
                    "vendor_gemm": {"us": 5.0, "kernels": 1.0}}
    # by kernel name: what a category's change is made of, largest first
    short, long = (profile.kernel_totals(profile.read_trace(p), by_name=True) for p in paths)
    named = profile.top_kernels(profile.per_step(short, long, 8), n=2)
    assert named == {"vendor_gemm: nvjet_tst_64x8": {"us": 5.0, "kernels": 1.0},
                     "tunekit_gemv: _gemv_kernel": {"us": 3.0, "kernels": 1.0}}
    # host ops: cpu_op events by name, inclusive time, largest first
    host = profile.host_totals(profile.read_trace(paths[1]), n=1)
    assert host == {"aten::mm": {"us": 99.0, "calls": 1}}


def test_launches_are_told_apart_by_grid_block_and_the_kernel_before() -> None:
    """One kernel name, three problems: two told apart by their grid, two of the same grid and block by
    the kernel that ran before each. Launch gaps inside a replay are charged to the launch after them,
    the host's turn between steps is not, and another stream's first event has no predecessor."""
    from tunekit.evidence.serve_bench import profile

    def kernel(name: str, ts: float, dur: float, grid: list[int], tid: int = 7) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid,
                "args": {"grid": grid, "block": [64, 1, 1]}}

    events = []
    for step in range(2):  # two decode steps, 1000 us apart (the host's turn between them)
        t = 1000.0 * step
        events += [kernel("_gated_rms_norm_kernel", t, 1.0, [12, 1, 1]),
                   kernel("_gemv_kernel", t + 1.5, 17.0, [1280, 1, 1]),  # out_proj: 0.5 us gap
                   kernel("_silu_and_mul_kernel", t + 19.0, 1.0, [34, 1, 1]),  # 0.5 us gap
                   kernel("_gemv_kernel", t + 20.25, 43.0, [1280, 1, 1]),  # down_proj: 0.25 us gap
                   kernel("_gemv_kernel", t + 63.5, 81.0, [34816, 1, 1])]  # gate_up: 0.25 us gap
    events.append({"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 5.0, "dur": 1.0, "tid": 9})
    events.reverse()  # the trace's order is not time order
    got = profile.launch_totals({"traceEvents": events})
    block = " block=(64,1,1)"
    assert got == {
        f"tunekit_elementwise: _gated_rms_norm_kernel grid=(12,1,1){block} after=-":
            {"us": 1.0, "kernels": 1, "gap_us": 0.0},
        f"tunekit_elementwise: _gated_rms_norm_kernel grid=(12,1,1){block} after=_gemv_kernel":
            {"us": 1.0, "kernels": 1, "gap_us": 0.0},  # 855.5 us after the last step's gate_up: not a gap
        f"tunekit_gemv: _gemv_kernel grid=(1280,1,1){block} after=_gated_rms_norm_kernel":
            {"us": 34.0, "kernels": 2, "gap_us": 1.0},
        f"tunekit_elementwise: _silu_and_mul_kernel grid=(34,1,1){block} after=_gemv_kernel":
            {"us": 2.0, "kernels": 2, "gap_us": 1.0},
        f"tunekit_gemv: _gemv_kernel grid=(1280,1,1){block} after=_silu_and_mul_kernel":
            {"us": 86.0, "kernels": 2, "gap_us": 0.5},
        f"tunekit_gemv: _gemv_kernel grid=(34816,1,1){block} after=_gemv_kernel":
            {"us": 162.0, "kernels": 2, "gap_us": 0.5},
        "copies: Memset (Device) after=-": {"us": 1.0, "kernels": 1, "gap_us": 0.0},
    }
    # per decode step, as the other tables: every field differenced, the gap too
    short = {"k": {"us": 10.0, "kernels": 1, "gap_us": 0.5}}
    long = {"k": {"us": 90.0, "kernels": 9, "gap_us": 4.5}}
    assert profile.per_step(short, long, 8) == {"k": {"gap_us": 0.5, "kernels": 1.0, "us": 10.0}}


def test_the_served_kernels_are_timed_again_in_the_process_that_served_them(tmp_path: Path,
                                                                            clean_ops: None) -> None:
    """in_process_kernel_times: every tuned kernel this process's routes hold, timed through the search's
    path beside its entry's time; vendor-served problems are not timed, an operand too large to
    rotate beside a KV cache is named, not timed."""
    import torch
    from test_ops import _entry, make_table

    from tunekit import ops
    from tunekit.backends import get
    from tunekit.evidence.serve_bench import profile
    from tunekit.problems.shapes import Problem

    params = get("triton").space(Problem("gemv", "bf16", 1, 40, 384)).default
    ops.load_tables(str(make_table(tmp_path / "t.json", [_entry("gemv", 1, 40, 384, params=params)])))
    torch.ops.tunekit.gemv(torch.randn(1, 384).bfloat16(), torch.randn(40, 384).bfloat16())  # tuned
    torch.ops.tunekit.gemv(torch.randn(1, 256).bfloat16(), torch.randn(40, 256).bfloat16())  # no entry
    got = profile.in_process_kernel_times()
    assert list(got) == ["gemv 1x40x384"]
    assert got["gemv 1x40x384"]["us"] > 0 and got["gemv 1x40x384"]["table_us"] == 1.0  # _entry's time
    original = profile.IN_PROCESS_MAX_BYTES
    try:
        profile.IN_PROCESS_MAX_BYTES = 40 * 384 * 2  # one copy fits, the rotation's two do not
        (row,) = profile.in_process_kernel_times().values()
        assert row["error"] == "rotated operand too large beside the KV cache" and row["us"] != row["us"]  # NaN
    finally:
        profile.IN_PROCESS_MAX_BYTES = original


def test_the_report_shows_each_arms_gemv_launches_and_in_process_timings(tmp_path: Path) -> None:
    """serve.md: a tunekit arm's GEMV launches per launch (time, count and gap divided by the launches
    per step; other categories and vanilla left out) and the in-process timings against the table."""
    from tunekit.evidence.serve_bench import report

    gemv = "tunekit_gemv: _gemv_kernel grid=(34816,1,1) block=(32,1,1) after=_gemv_kernel"
    serve = {"batches": [{"batch": 1, "profile": {
        "vanilla": {"by_launch": {"vendor_gemm: nvjet grid=(4,23,1) block=(384,1,1) after=-":
                                  {"us": 5600.0, "kernels": 64.0, "gap_us": 30.0}}},
        "folded": {"by_launch": {gemv: {"us": 5324.8, "kernels": 64.0, "gap_us": 27.52},
                                 "recurrence: fused_recurrent grid=(4,48,1) block=(32,1,1) after=x":
                                     {"us": 178.0, "kernels": 48.0, "gap_us": 20.0}},
                   "in_process": {"rms_gemv 1x34816x5120": {"us": 81.69, "table_us": 81.03},
                                  "gemv 1x248320x5120": {"us": float("nan"), "table_us": 555.49}}}}}]}
    assert report.tuned_launches_table(serve)[1] == [
        ["1", "folded", "`_gemv_kernel grid=(34816,1,1) block=(32,1,1) after=_gemv_kernel`", "83.20", "64", "0.43"]]
    assert report.in_process_table(serve)[1] == [["1", "folded", "gemv 1x248320x5120", "555.49", "-", "-"],
                                                 ["1", "folded", "rms_gemv 1x34816x5120", "81.03", "81.69", "1.008"]]


def test_stop_after_leaves_the_rest_to_a_rerun(fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    settings = _settings(processes=1, arms=("vanilla", "tuned"))
    monkeypatch.setenv("FAKE_ENGINE_SLEEP", "1.0")  # the first process takes > 1 s: the second would end late
    assert bench.run_offline(settings, tmp_path / "s", lines.append, stop_after_s=0.5) is None
    assert [ln.split()[0] for ln in fake.read_text().splitlines()] == ["vanilla"]
    assert any("1 of 2 processes left" in ln for ln in lines)
    monkeypatch.setenv("FAKE_ENGINE_SLEEP", "0.01")
    assert bench.run_offline(settings, tmp_path / "s", lines.append)["batches"][0]["speedup"] > 1.0
    assert [ln.split()[0] for ln in fake.read_text().splitlines()] == ["vanilla", "tuned"]


def test_a_table_tuned_elsewhere_warns_and_the_report_says_nothing_was_served(
        fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PROBE", json.dumps(
        {"table_mismatch": {str(TABLE.resolve()): ["gpu: table 'NVIDIA H200', here 'Fake H100'"]}}))
    monkeypatch.setenv("FAKE_TUNED_MISMATCH", "1")
    lines: list[str] = []
    serve = bench.run_offline(_settings(processes=1, arms=("vanilla", "tuned")), tmp_path / "s", lines.append)
    assert any(ln.startswith("warning:") and "another environment" in ln for ln in lines)
    assert [a for a, *_ in (ln.split() for ln in fake.read_text().splitlines())] == ["vanilla", "tuned"]
    assert any("the tuned arm served nothing" in n and "env_mismatch" in n for n in serve["notes"])
    assert serve["batches"][0]["predicted_saving_ms"] == 0.0  # the mismatched table predicts nothing
    assert "the tuned arm served nothing" in (tmp_path / "s" / "serve.md").read_text()


def test_no_vllm_and_no_plugin_stop_before_any_engine(fake: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PROBE", json.dumps({"vllm": None}))
    with pytest.raises(UserError, match="pip install vllm"):
        bench.run_offline(_settings(), tmp_path / "a", print)
    monkeypatch.setenv("FAKE_PROBE", json.dumps({"entry_points": {"vllm.general_plugins": ["qwen35_text"]}}))
    with pytest.raises(UserError, match="does not see tunekit's vLLM plugin"):
        bench.run_offline(_settings(), tmp_path / "b", print)
    assert not fake.exists()  # no arm process started


def test_a_failing_arm_is_one_error_naming_its_log(fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL_ARM", "passthrough")
    with pytest.raises(UserError, match=r"passthrough #0 failed: RuntimeError: CUDA out of memory .*log: .*"
                                        r"passthrough-0\.log"):
        bench.run_offline(_settings(), tmp_path / "s", print)
    assert "Traceback" in (tmp_path / "s" / "logs" / "passthrough-0.log").read_text() or \
        "traceback" in json.loads((tmp_path / "s" / "runs" / "passthrough-0.json").read_text())
    # the vanilla process before it finished and is kept for a resume
    assert json.loads((tmp_path / "s" / "runs" / "vanilla-0.json").read_text())["error"] is None


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-m", "tunekit", "serve-bench", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=120)


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    probe = json.dumps({"vllm": None})
    res = _cli("--model", "qwen3.5-27b", "--table", str(TABLE), "--out", str(tmp_path / "x"),
               env={bench.RUNNER_ENV: f"{sys.executable} {FAKE_RUNNER}", "FAKE_PROBE": probe})
    assert res.returncode == 2 and res.stderr.startswith("error: vLLM is not importable")
    assert len(res.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    # a bad table stops before the runner is ever asked (this runner would fail loudly)
    res = _cli("--model", "qwen3.5-27b", "--table", str(bad), env={bench.RUNNER_ENV: "/nonexistent/python"})
    assert res.returncode == 2 and "must be a JSON object" in res.stderr
    res = _cli("--endpoint", "tuned=http://127.0.0.1:1")
    assert res.returncode == 2 and "vanilla=URL" in res.stderr


# ---------------------------------------------------------------------------
# The runner against stub vLLM objects, and its result format
# ---------------------------------------------------------------------------


class _StubLLM:
    """generate() sleeps nothing; time is a counter that advances by 1 + tokens x TPOT per call."""

    def __init__(self, tpot_s: float) -> None:
        self.tpot_s = tpot_s
        self.calls: list[int] = []

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(params.max_tokens)
        _Clock.now += 0.5 + params.max_tokens * self.tpot_s
        lp = {7: SimpleNamespace(logprob=-1.5, rank=1), 9: SimpleNamespace(logprob=-2.0, rank=2)}
        comp = SimpleNamespace(token_ids=[7] * params.max_tokens,
                               logprobs=[lp] * params.max_tokens if params.logprobs else None)
        metrics = SimpleNamespace(first_token_ts=10.0, last_token_ts=10.0 + (params.max_tokens - 1) * self.tpot_s,
                                  num_generation_tokens=params.max_tokens, is_corrupted=False)
        return [SimpleNamespace(outputs=[comp], metrics=metrics) for _ in prompts]


class _Clock:
    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


def test_measure_batch_difference_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner.time, "perf_counter", _Clock.perf_counter)
    llm = _StubLLM(tpot_s=0.015)

    def sampling(n, logprobs=None):
        return SimpleNamespace(max_tokens=n, logprobs=logprobs)

    row = runner.measure_batch(llm, [{}] * 4, sampling, 4, {"tokens": 129, "repeats": 3, "prompt_len": 64})
    # warm-up (129, 1), then the pairs alternate their order: (1, 129), (129, 1), (1, 129)
    assert llm.calls == [129, 1, 1, 129, 129, 1, 1, 129]
    assert row["tpot_ms"] == pytest.approx([15.0] * 3) and row["tpot_ms_median"] == pytest.approx(15.0)
    assert row["tokens_per_s"] == pytest.approx(4 / 0.015) and row["short_outputs"] == 0
    assert row["vllm_metrics"]["tpot_ms_median"] == pytest.approx(15.0)
    assert len(row["t_1_host"]) == len(row["t_tokens_host"]) == 3
    assert all(h["allocator"] is None and len(h["gc_collections"]) == 3 for h in row["t_1_host"])
    rec = runner.agreement_record(llm.generate([{}] * 3, sampling(4, 2)), 2)
    assert len(rec) == 2 and rec[0]["token_ids"] == [7] * 4 and rec[0]["logprobs"] == [-1.5] * 4
    assert rec[0]["top"][0] == [[7, -1.5], [9, -2.0]]


def test_engine_kwargs_drop_what_this_vllm_lacks() -> None:
    from dataclasses import dataclass

    @dataclass
    class EngineArgs:
        model: str = ""
        max_model_len: int = 0

    engine = {"model": "m", "max_model_len": 256, "gdn_prefill_backend": "triton", "load_format": "dummy"}
    kept, dropped = runner.engine_kwargs(engine, runner.accepted_fields(EngineArgs))
    assert dropped == ["gdn_prefill_backend"] and kept["load_format"] == "dummy"  # required ones stay
    assert runner.engine_kwargs(engine, None) == (engine, [])


def test_prompts_are_distinct_and_in_vocabulary() -> None:
    prompts = runner.make_prompts(8, 64, 248320)
    assert len({tuple(p) for p in prompts}) == 8 and all(len(p) == 64 for p in prompts)
    assert all(100 <= t < 10100 for p in prompts for t in p)
    assert max(t for p in runner.make_prompts(2, 16, 150) for t in p) < 150
    assert prompts == runner.make_prompts(8, 64, 248320)  # the same in every arm and process


def test_the_runners_result_format_parses(tmp_path: Path) -> None:
    doc = json.loads((DATA / "run-sample.json").read_text())
    path = tmp_path / "runs" / "tuned-0.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc))
    assert analysis.load_runs(path.parent)["tuned"][0]["batches"][0]["tpot_ms_median"] == doc["batches"][0][
        "tpot_ms_median"]
    for key in ("t_tokens_s", "t_1_s", "tpot_ms", "tokens_per_s", "agreement"):
        assert key in doc["batches"][0]
    path.write_text(json.dumps(dict(doc, format="something/2")))
    with pytest.raises(UserError, match="unknown format"):
        analysis.load_runs(path.parent)


def test_probe_sees_entry_points_and_the_tables_stamp() -> None:
    doc = runner.probe([str(TABLE)])
    assert doc["format"] == runner.PROBE_FORMAT
    assert "tunekit" in doc["entry_points"].get("vllm.general_plugins", [])  # this checkout, installed
    assert doc["table_mismatch"][str(TABLE)]  # tuned on an H200, not on this CPU


# ---------------------------------------------------------------------------
# Agreement rules
# ---------------------------------------------------------------------------


def _seq(ids, lps, tops=None):
    return {"token_ids": ids, "logprobs": lps, "top": tops or [[[i, lp]] for i, lp in zip(ids, lps, strict=True)]}


def test_compare_sequences() -> None:
    tol = analysis.DEFAULT_TOL
    same = analysis.compare_sequences(_seq([1, 2], [-1.0, -2.0]), _seq([1, 2], [-1.001, -2.0]), tol)
    assert same["ok"] and same["ids_equal"] and same["max_abs_logprob_diff"] == pytest.approx(0.001)
    far = analysis.compare_sequences(_seq([1, 2], [-1.0, -2.0]), _seq([1, 2], [-1.0, -2.1]), tol)
    assert not far["ok"] and far["max_abs_logprob_diff"] == pytest.approx(0.1)
    tie_a = _seq([1, 5], [-1.0, -2.0], [[[1, -1.0]], [[5, -2.0], [6, -2.004]]])
    tie_b = _seq([1, 6], [-1.0, -2.0], [[[1, -1.0]], [[6, -2.0], [5, -2.003]]])
    tie = analysis.compare_sequences(tie_a, tie_b, tol)
    assert tie["ok"] and tie["first_divergence"] == 1 and tie["divergence_margin"] == pytest.approx(0.004)
    # a different token that is not even in the other run's top-K is a failure
    apart = analysis.compare_sequences(tie_a, _seq([1, 7], [-1.0, -2.0]), tol)
    assert not apart["ok"] and apart["divergence_margin"] is None


def test_merged_dispatch_keeps_what_served_each_fallback() -> None:
    from tunekit.evidence.serve_bench import report

    def call(m: int, impl: str, vendor: str | None, calls: int) -> dict:
        return {"op": "gemma_rms_norm", "dtype": "bf16", "shape": "64x64", "m": m, "bias": False, "impl": impl,
                "counted_at": "capture", "vendor": vendor, "calls": calls}

    above = "fallback:m_above_table"
    logs = [{"calls": [call(4, "tuned:triton", None, 3), call(16, above, "tunekit:triton-default", 2)]},
            {"calls": [call(16, above, "tunekit:triton-default", 1), call(16, above, "eager:default_eps", 5)]},
            {"calls": [{k: v for k, v in call(32, above, None, 1).items() if k != "vendor"}]}]  # an older log
    cov = analysis.merge_dispatch(logs)
    assert [(r["m"], r["vendor"], r["calls"]) for r in cov["rows"]] == [
        (16, "eager:default_eps", 5), (16, "tunekit:triton-default", 3), (32, None, 1), (4, None, 3)]
    assert cov["by_op"]["gemma_rms_norm"] == {"tuned:triton": 3, f"{above} [tunekit:triton-default]": 3,
                                              f"{above} [eager:default_eps]": 5, above: 1}
    assert cov["fallback_reasons"] == {"m_above_table": 9}
    assert cov["fallback_vendors"] == {"tunekit:triton-default": 3, "eager:default_eps": 5}
    _, rows = report.coverage_table({"batches": [{"batch": 16, "coverage": {"tuned": analysis.coverage_at(cov, 16)}}]})
    assert rows == [["16", "tuned", "gemma_rms_norm", "0",
                     "m_above_table [eager:default_eps] x5, m_above_table [tunekit:triton-default] x3"]]


# ---------------------------------------------------------------------------
# Endpoint mode against a fake OpenAI-compatible streaming server
# ---------------------------------------------------------------------------


def _server(tpot_s: float, seen: list[dict]) -> ThreadingHTTPServer:
    from completions_server import handler_class  # tests/ is on sys.path

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class("served-model", tpot_s, seen))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_endpoint_ab_against_fake_servers(tmp_path: Path) -> None:
    seen: list[dict] = []
    # 20 vs 10 ms per token: large against scheduling noise on a busy 2-core machine
    vanilla, tuned = _server(0.020, seen), _server(0.010, seen)
    try:
        urls = endpoint.parse_endpoints([f"tuned=http://127.0.0.1:{tuned.server_port}/v1",
                                         f"vanilla=http://127.0.0.1:{vanilla.server_port}"])
        assert list(urls) == ["vanilla", "tuned"] and not urls["tuned"].endswith("/v1")
        lines: list[str] = []
        serve = endpoint.run(urls, tmp_path, concurrency=[1, 3], tokens=8, prompt_len=5, repeats=2,
                             model="qwen3.5-27b", tables=[TABLE], log=lines.append)
    finally:
        vanilla.shutdown()
        tuned.shutdown()
    req = seen[0]
    assert req["model"] == "served-model" and req["stream"] and req["ignore_eos"] and req["temperature"] == 0
    assert isinstance(req["prompt"], list) and len(req["prompt"]) == 5 and req["max_tokens"] == 8
    # warm-up at C=3 per arm, then 2 rounds x (1 + 3) requests per arm
    assert len(seen) == 2 * 3 + 2 * 2 * 4
    arms = serve["arms"]
    assert [r["concurrency"] for r in arms["vanilla"]] == [1, 3, 1, 3]
    row1, row3 = serve["batches"]
    assert row1["vanilla_tpot_ms"] == pytest.approx(20.0, rel=0.35)
    assert row1["tuned_tpot_ms"] == pytest.approx(10.0, rel=0.35)
    assert row3["speedup"] > 1.3 and row3["speedup_min"] <= row3["speedup_max"]
    assert row1["ttft_ms"]["vanilla"] > 0 and row3["throughput_tokens_per_s"]["tuned"] > 0
    assert row1["predicted_saving_ms"] > 0  # model and table given: the full model's prediction
    assert row1["agreement"] is None and serve["mode"] == "endpoint"
    assert (tmp_path / "serve.png").is_file() and "| C |" in (tmp_path / "serve.md").read_text()
    assert any(ln.startswith("C=3") and "speedup" in ln for ln in lines)


def test_endpoint_script_starts_both_servers_runs_the_ab_and_stops_them(tmp_path: Path) -> None:
    """benchmarks/endpoint_ab.sh against two stand-in `vllm serve` processes (tests/data/fake_vllm_serve):
    each server gets its arm's environment and the serve options, the A/B runs, both stop cleanly."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    out, record = tmp_path / "ab", tmp_path / "record"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "data" / "fake_vllm_serve"), str(REPO)]),
           "FAKE_SERVE_RECORD": str(record), "PORT": str(port), "START_TIMEOUT": "120",
           "SERVE_BENCH_ARGS": "--concurrency 1,2 --tokens 8 --prompt-len 4 --repeats 2"}
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "endpoint_ab.sh"), sys.executable, str(model_dir),
                          str(TABLE), str(out), "--gdn-prefill-backend", "triton"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    servers = {json.loads(p.read_text())["argv"][3]: json.loads(p.read_text()) for p in record.glob("*.json")}
    vanilla, tuned = servers[str(port)], servers[str(port + 1)]
    assert "tunekit" not in (vanilla["env"]["VLLM_PLUGINS"] or "").split(",")
    assert vanilla["env"]["TUNEKIT_TABLE"] is None
    assert "tunekit" in tuned["env"]["VLLM_PLUGINS"].split(",") and tuned["env"]["TUNEKIT_TABLE"] == str(TABLE)
    for server in (vanilla, tuned):
        argv = server["argv"]
        assert argv[1] == str(model_dir) and argv[-2:] == ["--gdn-prefill-backend", "triton"]
        assert argv[argv.index("--load-format") + 1] == "dummy" and "--skip-tokenizer-init" in argv
        assert argv[argv.index("--shutdown-timeout") + 1] == "30"  # feature-detected: the engine core drains
    # stopped by SIGINT: the tuned server wrote its dispatch log on the way out, and the report merged it
    assert [p.name for p in (out / "dispatch").iterdir()] == [f"tuned-{tuned['pid']}.json"]
    serve = json.loads((out / "serve.json").read_text())
    assert serve["mode"] == "endpoint" and [b["batch"] for b in serve["batches"]] == [1, 2]
    assert all(b["speedup"] > 1.3 for b in serve["batches"])  # the tuned stand-in decodes twice as fast
    assert [b["coverage"]["tuned"]["tuned_calls"] for b in serve["batches"]] == [64, 64]
    assert endpoint.NOTE_NO_COVERAGE not in serve["notes"] and "Dispatch coverage" in (out / "serve.md").read_text()


def test_endpoint_report_says_when_the_dispatch_logs_hold_no_call(tmp_path: Path) -> None:
    """A server stopped without draining leaves its API process's log only (no call): the report says so;
    no log at all keeps the note that says how to add it."""
    # the H200's `vllm serve` A/B (vLLM 0.26.0, stopped without draining): its API server's log, 0 calls
    recorded = REPO / "benchmarks" / "results" / "h200-serve-fallbacks-34a4b7f" / "endpoint-llama-a4366bc"
    (tmp_path / "serve.json").write_text((recorded / "serve.json").read_text())
    got = bench.report_dir(tmp_path, log=lambda s: None)  # --report-only on an endpoint folder
    assert endpoint.NOTE_NO_COVERAGE in got["notes"] and all(b["coverage"] is None for b in got["batches"])
    assert [round(b["speedup"], 4) for b in got["batches"]] == [1.1255, 0.9696, 0.9686]  # the figures are kept
    (tmp_path / "dispatch").mkdir()
    for log in (recorded / "dispatch").iterdir():
        (tmp_path / "dispatch" / log.name).write_text(log.read_text())
    got = bench.report_dir(tmp_path, log=lambda s: None)
    assert "no call counted" in got["notes"][-1] and endpoint.NOTE_NO_COVERAGE not in got["notes"]
    count = len(got["notes"])
    got = bench.report_dir(tmp_path, log=lambda s: None)
    assert len(got["notes"]) == count  # rebuilt again: the note is replaced, not repeated


def test_endpoint_errors() -> None:
    with pytest.raises(UserError, match="vanilla=URL and tuned=URL"):
        endpoint.parse_endpoints(["vanilla=http://h:1"])
    with pytest.raises(UserError, match="ARM=http"):
        endpoint.parse_endpoints(["fast=http://h:1", "vanilla=http://h:2"])
    with pytest.raises(UserError, match="one of vanilla, passthrough, tuned"):  # a folded server is given as tuned
        endpoint.parse_endpoints(["folded=http://h:1", "vanilla=http://h:2"])
    with pytest.raises(UserError, match="no model listed"):
        endpoint.served_model("http://127.0.0.1:1", timeout=2)


# ---------------------------------------------------------------------------
# Real recorded files (the H200 run of benchmarks/results)
# ---------------------------------------------------------------------------

RECORDED = REPO / "benchmarks" / "results" / "h200-serve-qwen35-27b-2b88dba"
TTFT3 = REPO / "benchmarks" / "results" / "h200-serve-ttft3-2fac948"


def _rebuild(src: Path, out: Path, tables: list[str]) -> dict:
    """A recorded serve-bench folder's raw files (runs, dispatch logs, settings) copied to ``out``, the
    tables it served pointed at their copies in the repository, and the report rebuilt from them alone."""
    import shutil

    shutil.copytree(src / "runs", out / "runs")
    if (src / "dispatch").is_dir():
        shutil.copytree(src / "dispatch", out / "dispatch")
    key = json.loads((src / "serve-settings.json").read_text())
    key["tables"] = tables
    (out / "serve-settings.json").write_text(json.dumps(key))
    return bench.report_dir(out, log=lambda s: None)


def test_the_recorded_h200_run_parses_to_its_own_report(tmp_path: Path) -> None:
    """The runner results, dispatch logs and settings vLLM 0.26.0 wrote on the H200 rebuild the recorded
    serve.json: TPOTs, speedups, prediction, coverage and agreement come from the raw files alone."""
    out = tmp_path / "serve"
    # the table the tuned arm served lay on the GPU machine; its copy is recorded beside the run
    rebuilt = _rebuild(RECORDED, out, [str(RECORDED / "table-remeasure" / "table.json")])
    recorded = json.loads((RECORDED / "serve.json").read_text())
    assert recorded["vllm"] == rebuilt["vllm"] == "0.26.0" and rebuilt["device"] == "NVIDIA H200"
    assert [b["batch"] for b in rebuilt["batches"]] == [1, 2, 4, 8]
    for mine, theirs in zip(rebuilt["batches"], recorded["batches"], strict=True):
        for field in ("vanilla_tpot_ms", "passthrough_tpot_ms", "tuned_tpot_ms", "speedup", "speedup_min",
                      "speedup_max", "passthrough_ratio", "predicted_saving_ms", "measured_saving_ms"):
            assert mine[field] == pytest.approx(theirs[field], rel=1e-9), (mine["batch"], field)
        assert mine["agreement"]["verdict"] == theirs["agreement"]["verdict"] == "pass"
    # what the recorded numbers say, re-derived from the per-process medians
    b1 = rebuilt["batches"][0]
    per_arm = {arm: sorted(json.loads(p.read_text())["batches"][0]["tpot_ms_median"]
                           for p in (out / "runs").glob(f"{arm}-?.json"))
               for arm in ("vanilla", "passthrough", "tuned")}
    assert all(len(v) == 3 for v in per_arm.values())
    assert b1["vanilla_tpot_ms"] == pytest.approx(per_arm["vanilla"][1])
    assert b1["tuned_tpot_ms"] == pytest.approx(per_arm["tuned"][1])
    assert 1.08 < b1["speedup"] < 1.11 and abs(1 - b1["passthrough_ratio"]) < 0.01
    # every tuned process served the table inside vLLM's decode graph at M=1: tuned calls, no fallback
    cov = analysis.coverage_at(rebuilt["coverage"]["tuned"], 1)
    assert cov is not None and cov["tuned_calls"] > 0 and cov["fallback_calls"] == 0
    # ... but vLLM 0.26 never routed its gated norm ([T * H, D] against the table's H * D key, fixed
    # since): the prediction counted 48 calls per token that ran vLLM's own kernel, and the report says so
    assert set(b1["predicted_unserved_us"]) == {"gated_rms_norm"}
    assert b1["predicted_unserved_us"]["gated_rms_norm"] == pytest.approx(53.1, abs=0.1)
    assert any(n.startswith("B=1: the prediction counts ops that ran no tuned call") and "gated_rms_norm" in n
               for n in rebuilt["notes"])


def test_the_recorded_fold_run_parses_to_its_own_report(tmp_path: Path) -> None:
    """vanilla / tuned / folded on the H200 (8031457): the folded arm's speedup, its coverage by rms_gemv and
    gemv_add inside the decode graph and its agreement come back from the raw files alone."""
    src = REPO / "benchmarks" / "results" / "h200-serve-fold-8031457"
    rebuilt = _rebuild(src, tmp_path / "serve", [str(src / "table" / t / "table.json") for t in ("main", "fused")])
    b1, recorded = rebuilt["batches"][0], json.loads((src / "serve.json").read_text())["batches"][0]
    for field in ("vanilla_tpot_ms", "tuned_tpot_ms", "folded_tpot_ms", "speedup", "folded_speedup",
                  "folded_speedup_min", "folded_speedup_max", "folded_over_tuned"):
        assert b1[field] == pytest.approx(recorded[field], rel=1e-9), field
    assert 1.117 < b1["folded_speedup_min"] and b1["folded_speedup"] == pytest.approx(1.1224, abs=1e-4)
    folded = analysis.coverage_at(rebuilt["coverage"]["folded"], 1)
    assert folded["fallback_calls"] == 0
    assert {"rms_gemv", "gemv_add"} <= set(folded["by_op"]) and "rms_gemv" not in rebuilt["coverage"]["tuned"]["by_op"]
    assert b1["agreement"]["folded_vs_vanilla"]["ok"] and b1["agreement"]["verdict"] == "pass"


def test_the_recorded_llama_run_names_its_unserved_norms(tmp_path: Path) -> None:
    """Llama-3.1-8B on the H200 (a831b66): every norm fell back (the kernels took no eps, Llama's is 1e-5);
    the rebuilt report names them as predicted but not served."""
    src = REPO / "benchmarks" / "results" / "h200-serve-llama31-8b-a831b66"
    rebuilt = _rebuild(src / "tuned", tmp_path / "serve", [str(src / "table" / "table.json")])
    b1 = rebuilt["batches"][0]
    recorded = json.loads((src / "tuned" / "serve.json").read_text())["batches"][0]
    assert b1["speedup"] == pytest.approx(recorded["speedup"], rel=1e-9)
    assert set(b1["predicted_unserved_us"]) == {"fused_add_rms_norm", "rms_norm"}
    assert 15 < b1["predicted_unserved_us"]["fused_add_rms_norm"] < 25
    assert analysis.coverage_at(rebuilt["coverage"]["tuned"], 1)["fallback_reasons"] == {"eps": 780}


def test_the_recorded_llama_prefill_run_reports_the_later_first_token(tmp_path: Path) -> None:
    """Llama-3.1-8B above its M=1 table on the H200 (d993bdd): TPOT even at B=8, but the 1-token
    generate (prefill + one step) took longer with the table; the rebuilt report measures and names it."""
    src = REPO / "benchmarks" / "results" / "h200-serve-prefill-d993bdd" / "llama-offline-d993bdd"
    out = tmp_path / "serve"
    table = REPO / "benchmarks" / "results" / "h200-serve-llama31-8b-a831b66" / "table" / "table.json"
    rebuilt = _rebuild(src, out, [str(table)])
    recorded = json.loads((src / "serve.json").read_text())
    for mine, theirs in zip(rebuilt["batches"], recorded["batches"], strict=True):
        assert mine["speedup"] == pytest.approx(theirs["speedup"], rel=1e-9)
    b8 = rebuilt["batches"][0]
    assert b8["batch"] == 8 and 0.99 < b8["speedup"] < 1.01
    # re-derived from the raw t_1 samples: per process the median of its repeats, then the arm's median
    per_arm = {arm: sorted(statistics.median(json.loads(p.read_text())["batches"][0]["t_1_s"]) * 1000.0
                           for p in (out / "runs").glob(f"{arm}-?.json"))
               for arm in ("vanilla", "tuned")}
    assert b8["first_token"]["vanilla"]["median_ms"] == pytest.approx(statistics.median(per_arm["vanilla"]))
    assert b8["first_token"]["tuned"]["median_ms"] == pytest.approx(statistics.median(per_arm["tuned"]))
    assert b8["first_token_ratio"] > 1.5 and b8["first_token_ratio_min"] > 1.5
    note = next(n for n in rebuilt["notes"] if n.startswith("B=8: the first token"))
    assert "beyond vanilla's own spread over its 2 processes" in note  # 1.86x against vanilla's 1.04x
    report = (out / "serve.md").read_text()
    assert "1-token generate ms" in report


def test_the_recorded_64_layer_first_token_is_at_par(tmp_path: Path) -> None:
    """Qwen3.5-27B, all 64 layers, 3 processes per arm on the H200 (2fac948): the 1-token generate that one
    process pair had put at 1.34x is at par over 30 generates per arm, with the same kernels launched and
    the same Python calls made (+0.13%); TPOT 1.10x at B=1. Rebuilt from the raw files."""
    table = REPO / "benchmarks" / "results" / "h200-serve-ranges-477659f" / "qwen-search" / "table.json"
    rebuilt = _rebuild(TTFT3 / "ab", tmp_path / "serve", [str(table)])
    recorded = json.loads((TTFT3 / "ab" / "serve.json").read_text())
    for mine, theirs in zip(rebuilt["batches"], recorded["batches"], strict=True):
        for field in ("speedup", "first_token_ratio", "predicted_saving_ms", "measured_saving_ms"):
            assert mine[field] == pytest.approx(theirs[field], rel=1e-9), (mine["batch"], field)
    b1, b8 = rebuilt["batches"]
    assert (b1["batch"], b8["batch"]) == (1, 8)
    assert all(len(b1["first_token"][arm]["per_process_ms"]) == 3 for arm in ("vanilla", "tuned"))
    assert b1["speedup"] > 1.10 and b8["speedup"] > 1.05
    assert b1["first_token_ratio"] < 1.0 and b8["first_token_ratio"] < 1.0
    assert not [n for n in rebuilt["notes"] if "first token" in n]  # no later first token to note
    work = b1["profile_compare"]["prefill_work"]
    assert abs(work["tuned"]["kernels"] - work["vanilla"]["kernels"]) <= 1
    assert work["tuned"]["python_calls"] / work["vanilla"]["python_calls"] == pytest.approx(1.0, abs=0.005)


def test_the_recorded_passthrough_run_names_only_its_arms(tmp_path: Path) -> None:
    """vanilla against passthrough alone (no table): the report names the two arms that ran, no
    TUNEKIT_TABLE, and the plugin's cost as vanilla / passthrough TPOT (within 1% on the H200)."""
    rebuilt = _rebuild(TTFT3 / "passthrough", tmp_path / "serve", [])
    assert set(rebuilt["arms"]) == {"vanilla", "passthrough"}
    for row in rebuilt["batches"]:
        assert row["speedup"] is None and abs(1 - row["passthrough_ratio"]) < 0.01
        assert bench._line(row).count("passthrough x") == 1 and "speedup" not in bench._line(row)
    arms_line = next(ln for ln in (tmp_path / "serve" / "serve.md").read_text().splitlines()
                     if ln.startswith("Arms:"))
    assert "passthrough = plugin loaded" in arms_line and "TUNEKIT_TABLE" not in arms_line


def test_a_first_token_ratio_is_read_against_vanillas_spread() -> None:
    from tunekit.evidence.serve_bench import analysis

    two = {"per_process_ms": {"0": 90.0, "1": 120.0}}
    assert analysis.first_token_spread(two, 1.2).startswith("within vanilla's own spread over its 2 processes (1.33x)")
    assert analysis.first_token_spread(two, 1.4).startswith("beyond")
    assert analysis.first_token_spread({"per_process_ms": {"0": 90.0}}, 1.34).startswith("one vanilla process")


def test_git_commit_is_none_for_a_copy_inside_another_repository(tmp_path: Path) -> None:
    """An exported tree inside some other checkout must not report that checkout's HEAD as its own."""
    import shutil

    outer = tmp_path / "outer"
    (outer / "copy").mkdir(parents=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", str(outer)], check=True, env=env)
    subprocess.run(["git", "-C", str(outer), "commit", "-q", "--allow-empty", "-m", "x"], check=True, env=env)
    shutil.copytree(REPO / "tunekit", outer / "copy" / "tunekit")
    code = "from tunekit.evidence.serve_bench.bench import _git_commit; print(_git_commit())"
    res = subprocess.run([sys.executable, "-c", code], cwd=outer / "copy", capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(outer / "copy")}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "None"
    # and the checkout itself reports its HEAD (marked +dirty while tracked files differ from it)
    assert bench._git_commit().removesuffix("+dirty") == subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def test_git_commit_marks_sources_that_differ_from_head(tmp_path: Path) -> None:
    """A checkout whose tracked sources were changed after HEAD (a synced copy with an older .git) did not run
    HEAD: the commit carries +dirty. Untracked files (run outputs) do not count."""
    import shutil

    repo = tmp_path / "repo"
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # bytecode written by the child must not be what changed
    shutil.copytree(REPO / "tunekit", repo / "tunekit", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "add", "tunekit"], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", "x"], check=True, env=env)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    code = "from tunekit.evidence.serve_bench.bench import _git_commit; print(_git_commit())"

    def commit() -> str:
        res = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                             env={**env, "PYTHONPATH": str(repo)}, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    (repo / "runs").mkdir()
    (repo / "runs" / "out.json").write_text("{}")
    assert commit() == head
    with (repo / "tunekit" / "errors.py").open("a") as f:
        f.write("# changed after the commit\n")
    assert commit() == head + "+dirty"


def test_host_events_count_the_collections_inside_only() -> None:
    import gc

    def cycles() -> None:
        for _ in range(200):
            a: list = []
            a.append(a)

    with runner.HostEvents() as events:
        cycles()
        gc.collect()
    rec = events.record()
    assert rec["gc_collections"][2] >= 1 and rec["gc_ms"] > 0.0
    assert rec["allocator"] is None  # no CUDA initialized in this process: nothing counted, nothing invented
    gc.collect()  # after the block: the callback is gone
    assert events.record() == rec


def test_first_token_reads_the_host_events() -> None:
    from tunekit.evidence.serve_bench import analysis

    def run(index: int, gc_ms: list[float], stalls: int | None) -> dict:
        alloc = None if stalls is None else {"num_device_alloc": stalls, "num_device_free": 0, "num_alloc_retries": 0}
        host = [{"gc_ms": g, "gc_collections": [1, 0, 0], "allocator": alloc, "jit_compiles": index} for g in gc_ms]
        return {"index": index, "batches": [{"batch": 1, "t_1_s": [0.1] * len(gc_ms), "t_1_host": host}]}

    first = analysis.arm_first_token([run(0, [1.0, 3.0, 2.0], 4), run(1, [5.0, 6.0, 7.0], 0)], 1)
    assert first["gc_ms"] == pytest.approx(4.0) and first["allocator_stalls"] == pytest.approx(2.0)
    assert first["jit_compiles"] == pytest.approx(0.5)  # medians 0 and 1 over the two processes
    old = analysis.arm_first_token([{"index": 0, "batches": [{"batch": 1, "t_1_s": [0.1]}]}], 1)
    assert old["gc_ms"] is None and old["allocator_stalls"] is None and old["jit_compiles"] is None


def test_host_events_count_triton_compiles_through_the_hook_set_before() -> None:
    knobs = pytest.importorskip("triton").knobs
    seen = []

    def monitor(*args, **kwargs):  # a hook already there (vLLM's JIT monitor): still called, and put back
        seen.append(kwargs.get("key"))

    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = monitor
    try:
        with runner.HostEvents() as events:
            # what JITFunction._do_compile calls after a compile or a load from the disk cache
            knobs.runtime.jit_post_compile_hook(key="k1", repr="k", fn=None, compile=None, is_manual_warmup=False,
                                                already_compiled=False)
            knobs.runtime.jit_post_compile_hook(key="k2")
        assert events.record()["jit_compiles"] == 2 and seen == ["k1", "k2"]
        assert knobs.runtime.jit_post_compile_hook is monitor
    finally:
        knobs.runtime.jit_post_compile_hook = before
    with runner.HostEvents() as events:
        pass
    assert events.record()["jit_compiles"] == 0  # counted, and none happened


def test_the_folded_arm_serves_the_tables_with_the_fold_on(fake: Path, tmp_path: Path) -> None:
    """--arms vanilla,tuned,folded: the folded arm is the tuned arm plus TUNEKIT_FOLD_NORMS=1 (never set in the
    others, even when the caller's environment has it), reported over vanilla and over tuned, same run."""
    settings = bench.build_settings("qwen3.5-27b", None, [TABLE], [1])
    probe = {"entry_points": {"vllm.general_plugins": ["tunekit"]}, "flashinfer": True}
    base = {"TUNEKIT_FOLD_NORMS": "1"}
    envs = {arm: bench.arm_env(arm, 0, base, settings, probe, tmp_path) for arm in ("vanilla", "tuned", "folded")}
    assert envs["folded"]["TUNEKIT_FOLD_NORMS"] == "1" and envs["folded"]["TUNEKIT_TABLE"] == str(TABLE.resolve())
    assert "TUNEKIT_FOLD_NORMS" not in envs["tuned"] and "TUNEKIT_FOLD_NORMS" not in envs["vanilla"]
    assert bench.build_settings("qwen3.5-27b", None, [TABLE]).arms == ("vanilla", "passthrough", "tuned")
    with pytest.raises(UserError, match="--table"):
        bench.build_settings("qwen3.5-27b", None, [], arms=["vanilla", "folded"])

    out = tmp_path / "serve"
    lines: list[str] = []
    serve = bench.run_offline(_settings(arms=["folded", "tuned", "vanilla"]), out, lines.append)
    record = [ln.split() for ln in fake.read_text().splitlines()]
    assert [(a, int(i)) for a, i, _, _ in record] == bench.schedule(("vanilla", "tuned", "folded"), 2)
    assert all(arm == seen for arm, _, _, seen in record)
    for row in serve["batches"]:
        assert row["folded_tpot_ms"] == pytest.approx(1.5, rel=0.25)
        assert row["folded_speedup"] == pytest.approx(row["vanilla_tpot_ms"] / row["folded_tpot_ms"])
        assert row["folded_over_tuned"] == pytest.approx(row["tuned_tpot_ms"] / row["folded_tpot_ms"])
        assert row["folded_speedup_min"] <= row["folded_speedup"] <= row["folded_speedup_max"]
        assert row["coverage"]["folded"]["by_op"]["gemv"] == row["coverage"]["tuned"]["by_op"]["gemv"]
        assert row["agreement"]["folded_vs_vanilla"]["ok"] and row["agreement"]["verdict"] == "pass"
    md = (out / "serve.md").read_text()
    assert "folded speedup" in md and "folded vs vanilla" in md and "TUNEKIT_FOLD_NORMS=1" in md
    assert any(ln.startswith("B=1") and "folded x" in ln for ln in lines)


def test_a_folded_run_without_the_tuned_arm_reports_against_vanilla(fake: Path, tmp_path: Path) -> None:
    """--arms vanilla,folded (the GPU call that times the fold alone): no tuned figure is invented."""
    out = tmp_path / "serve"
    lines: list[str] = []
    serve = bench.run_offline(_settings(arms=["vanilla", "folded"], processes=1), out, lines.append)
    for row in serve["batches"]:
        assert row["folded_speedup"] == pytest.approx(row["vanilla_tpot_ms"] / row["folded_tpot_ms"])
        assert row.get("tuned_tpot_ms") is None and row.get("folded_over_tuned") is None
        assert row["agreement"]["folded_vs_vanilla"]["ok"]
    assert "folded speedup" in (out / "serve.md").read_text()


def test_the_report_says_whether_the_arm_joined_sibling_linears() -> None:
    from tunekit.evidence.serve_bench import report

    def serve(installed: bool | None) -> dict:
        hooks = {"linear": "..."}
        record = {"installed": dict(hooks), "skipped": {}}
        if installed is not None:
            record["installed" if installed else "skipped"]["merge_siblings"] = "..."
        return {"tables": ["t.json"], "plugin": {"tuned": [record, record], "folded": [record]}}

    assert "sibling linears joined" in report._arm_text("folded", serve(True))
    assert "apart (TUNEKIT_MERGE_SIBLINGS=0)" in report._arm_text("tuned", serve(False))
    assert "sibling" not in report._arm_text("tuned", serve(None))  # a plugin from before the join
    recorded = json.loads((REPO / "benchmarks/results/h200-serve-merge-df17426/serve.json").read_text())
    assert "sibling linears joined where the tables pay" in report._arm_text("folded", recorded)
