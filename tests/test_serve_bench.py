"""tunekit serve-bench's parent and runner: settings, arms and their environment, the whole parent on a stub
engine (resume, the report, failures), the CLI, the runner against stub vLLM objects, provenance. Nothing here
needs vLLM or a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from serve_bench_helpers import DATA, FAKE_RUNNER, REPO, TABLE, rebuild, small_settings, use_fake_runner

from tunekit.errors import UserError
from tunekit.evidence.serve_bench import analysis, bench, provenance, runner
from tunekit.evidence.serve_bench.settings import build_settings, vllm_model_config

# ---------------------------------------------------------------------------
# Settings, model folder, arms
# ---------------------------------------------------------------------------


def test_vllm_config_of_a_builtin_shrinks_layers_and_takes_the_form_that_ran() -> None:
    settings = build_settings("qwen3.5-27b", None, [TABLE], [1, 2], layers=4)
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
    cfg = vllm_model_config({"model_type": "llama", "num_hidden_layers": 32, "rope_theta": 5e5}, 2)
    assert cfg == {"model_type": "llama", "num_hidden_layers": 2, "rope_theta": 5e5,
                   "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    nested = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "rope_theta": 1e7,
                              "layer_types": ["linear_attention"] * 7 + ["full_attention"]}}
    out = vllm_model_config(nested, 4)
    assert out["text_config"]["num_hidden_layers"] == 4 and len(out["text_config"]["layer_types"]) == 4
    assert out["text_config"]["rope_parameters"]["rope_theta"] == 1e7
    with pytest.raises(UserError, match="--layers must be 1..8"):
        vllm_model_config(nested, 9)


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
        build_settings(**kwargs)


def test_plugin_cost_alone_needs_no_table() -> None:
    """vanilla against passthrough measures the plugin's own cost: no tuned arm, so no --table needed."""
    s = build_settings("qwen3.5-27b", None, [], arms=["passthrough", "vanilla"])
    assert s.arms == ("vanilla", "passthrough") and s.tables == ()


def test_corrupt_table_is_one_error(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="corrupt table"):
        build_settings("qwen3.5-27b", None, [bad])


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
    settings = build_settings("qwen3.5-27b", None, [TABLE, TABLE], [1])
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
    return use_fake_runner(tmp_path, monkeypatch)


def test_run_offline_on_the_stub_engine(fake: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve"
    lines: list[str] = []
    serve = bench.run_offline(small_settings(), out, lines.append)

    # one process per arm and round, in the alternating order, each seeing its arm's environment
    record = [ln.split() for ln in fake.read_text().splitlines()]
    assert [(a, int(i)) for a, i, _, _ in record] == bench.schedule(("vanilla", "passthrough", "tuned"), 2)
    assert all(arm == seen for arm, _, _, seen in record)  # the stub engine decided the arm from the env alone
    runs = {(r["arm"], r["index"]): r for files in serve["runs"].values()
            for r in (json.loads((out / name).read_text()) for name in files)}
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

    # prediction from the table at M = B over the 4-layer model: the 3 in_proj_ba GEMVs. Layer 0's norm has
    # an entry at M = 8 only, whose params (BLOCK_K) today's rms_norm kernel does not take: the ops serve
    # neither M = 1 nor 2 from it (table.serving_lookup, the ops' rule), so the prediction counts it nowhere
    b1, b2 = serve["batches"]
    assert b1["predicted_saving_ms"] == pytest.approx(3 * (7.2 - 2.5) / 1000)
    assert b2["predicted_saving_ms"] == pytest.approx(3 * (7.5 - 3.0) / 1000)
    assert b1["predicted_served_calls"] == 3
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
    for key in ("model", "device", "vllm", "torch", "tunekit_commit", "runs", "batches"):
        assert key in on_disk
    assert set(on_disk["runs"]) == {"vanilla", "passthrough", "tuned"}
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
    again = bench.run_offline(small_settings(), out, lines.append)
    assert fake.read_text() == "" and again["batches"][0]["speedup"] == serve["batches"][0]["speedup"]
    assert any("finished earlier, kept" in ln for ln in lines)
    # other settings in the same folder: refused
    with pytest.raises(UserError, match="other settings"):
        bench.run_offline(small_settings(tokens=32), out, lines.append)
    # the report alone, from the files
    assert bench.report_dir(out, log=lines.append)["batches"][1]["agreement"]["verdict"] == "pass"


def _run_documents(doc: object) -> list[dict]:
    """Every runner result (``tunekit.serve_run/1`` document) anywhere inside ``doc``."""
    if isinstance(doc, dict):
        found = [doc] if doc.get("format") == runner.FORMAT else []
        return found + [d for v in doc.values() for d in _run_documents(v)]
    if isinstance(doc, list):
        return [d for v in doc for d in _run_documents(v)]
    return []


def test_serve_json_names_its_runs_and_a_report_rebuilt_from_them_has_the_same_figures(fake: Path,
                                                                                          tmp_path: Path) -> None:
    """serve.json holds the analysis and names the runner results it came from (DIR/runs/{arm}-{i}.json), never
    a copy of them; the report rebuilt from a copy of runs/, dispatch/ and the settings alone is the same."""
    out = tmp_path / "serve"
    serve = bench.run_offline(small_settings(processes=2, arms=["vanilla", "tuned"]), out, lambda s: None)
    on_disk = json.loads((out / "serve.json").read_text())
    assert on_disk == json.loads(json.dumps(serve))
    assert "arms" not in on_disk and not _run_documents(on_disk)
    assert on_disk["runs"] == {arm: [f"runs/{arm}-{i}.json" for i in (0, 1)] for arm in ("vanilla", "tuned")}
    for arm, names in on_disk["runs"].items():
        for i, name in enumerate(names):
            assert (out / name).is_file() and analysis.run_file(arm, i) == Path(name).name
            run = analysis.load_run(out / name)
            assert (run["arm"], run["index"]) == (arm, i)
    # --report-only in another folder that holds only the raw files
    key = json.loads((out / "serve-settings.json").read_text())
    rebuilt = rebuild(out, tmp_path / "again", key["tables"])
    for doc in (rebuilt, json.loads((tmp_path / "again" / "serve.json").read_text())):
        assert {k: v for k, v in doc.items() if k != "tunekit_commit"} == \
            {k: v for k, v in on_disk.items() if k != "tunekit_commit"}
    assert (tmp_path / "again" / "serve.md").read_text() == (out / "serve.md").read_text()


def test_profile_tells_where_the_saving_came_from(fake: Path, tmp_path: Path) -> None:
    """--profile-steps: each process profiles decode steps after its timing; the report puts vanilla's
    kernel time per category next to tuned's, and what is left of TPOT outside the kernels."""
    out = tmp_path / "serve"
    serve = bench.run_offline(small_settings(profile_steps=4, arms=["vanilla", "tuned"]), out, lambda s: None)
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
        bench.run_offline(small_settings(arms=["vanilla", "tuned"]), out, lambda s: None)
    assert "profile_steps" not in small_settings().key()
    with pytest.raises(UserError, match="--profile-steps"):
        small_settings(profile_steps=-1)


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


def test_stop_after_leaves_the_rest_to_a_rerun(fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    settings = small_settings(processes=1, arms=("vanilla", "tuned"))
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
    serve = bench.run_offline(small_settings(processes=1, arms=("vanilla", "tuned")), tmp_path / "s", lines.append)
    assert any(ln.startswith("warning:") and "another environment" in ln for ln in lines)
    assert [a for a, *_ in (ln.split() for ln in fake.read_text().splitlines())] == ["vanilla", "tuned"]
    assert any("the tuned arm served nothing" in n and "env_mismatch" in n for n in serve["notes"])
    assert serve["batches"][0]["predicted_saving_ms"] == 0.0  # the mismatched table predicts nothing
    assert "the tuned arm served nothing" in (tmp_path / "s" / "serve.md").read_text()


def test_no_vllm_and_no_plugin_stop_before_any_engine(fake: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PROBE", json.dumps({"vllm": None}))
    with pytest.raises(UserError, match="pip install vllm"):
        bench.run_offline(small_settings(), tmp_path / "a", print)
    monkeypatch.setenv("FAKE_PROBE", json.dumps({"entry_points": {"vllm.general_plugins": ["qwen35_text"]}}))
    with pytest.raises(UserError, match="does not see tunekit's vLLM plugin"):
        bench.run_offline(small_settings(), tmp_path / "b", print)
    assert not fake.exists()  # no arm process started


def test_a_failing_arm_is_one_error_naming_its_log(fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL_ARM", "passthrough")
    with pytest.raises(UserError, match=r"passthrough #0 failed: RuntimeError: CUDA out of memory .*log: .*"
                                        r"passthrough-0\.log"):
        bench.run_offline(small_settings(), tmp_path / "s", print)
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

# ---------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------


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
    code = "from tunekit.evidence.serve_bench.provenance import git_commit; print(git_commit())"
    res = subprocess.run([sys.executable, "-c", code], cwd=outer / "copy", capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(outer / "copy")}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "None"
    # and the checkout itself reports its HEAD (marked +dirty while tracked files differ from it)
    assert provenance.git_commit().removesuffix("+dirty") == subprocess.run(
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
    code = "from tunekit.evidence.serve_bench.provenance import git_commit; print(git_commit())"

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

# ---------------------------------------------------------------------------
# The folded arm
# ---------------------------------------------------------------------------


def test_the_folded_arm_serves_the_tables_with_the_fold_on(fake: Path, tmp_path: Path) -> None:
    """--arms vanilla,tuned,folded: the folded arm is the plugin's default (the tables, TUNEKIT_FOLD_NORMS unset
    whatever the caller's environment holds), the tuned arm the tables with the fold off (TUNEKIT_FOLD_NORMS=0),
    reported over vanilla and over tuned, same run."""
    settings = build_settings("qwen3.5-27b", None, [TABLE], [1])
    probe = {"entry_points": {"vllm.general_plugins": ["tunekit"]}, "flashinfer": True}
    base = {"TUNEKIT_FOLD_NORMS": "1"}
    envs = {arm: bench.arm_env(arm, 0, base, settings, probe, tmp_path) for arm in ("vanilla", "tuned", "folded")}
    assert "TUNEKIT_FOLD_NORMS" not in envs["folded"] and envs["folded"]["TUNEKIT_TABLE"] == str(TABLE.resolve())
    assert envs["tuned"]["TUNEKIT_FOLD_NORMS"] == "0" and "TUNEKIT_FOLD_NORMS" not in envs["vanilla"]
    assert build_settings("qwen3.5-27b", None, [TABLE]).arms == ("vanilla", "passthrough", "tuned")
    with pytest.raises(UserError, match="--table"):
        build_settings("qwen3.5-27b", None, [], arms=["vanilla", "folded"])

    out = tmp_path / "serve"
    lines: list[str] = []
    serve = bench.run_offline(small_settings(arms=["folded", "tuned", "vanilla"]), out, lines.append)
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
    assert "folded speedup" in md and "folded vs vanilla" in md and "TUNEKIT_FOLD_NORMS=0" in md and "the default" in md
    assert any(ln.startswith("B=1") and "folded x" in ln for ln in lines)


def test_a_folded_run_without_the_tuned_arm_reports_against_vanilla(fake: Path, tmp_path: Path) -> None:
    """--arms vanilla,folded (the GPU call that times the fold alone): no tuned figure is invented."""
    out = tmp_path / "serve"
    lines: list[str] = []
    serve = bench.run_offline(small_settings(arms=["vanilla", "folded"], processes=1), out, lines.append)
    for row in serve["batches"]:
        assert row["folded_speedup"] == pytest.approx(row["vanilla_tpot_ms"] / row["folded_tpot_ms"])
        assert row.get("tuned_tpot_ms") is None and row.get("folded_over_tuned") is None
        assert row["agreement"]["folded_vs_vanilla"]["ok"]
    assert "folded speedup" in (out / "serve.md").read_text()
