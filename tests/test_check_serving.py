"""tunekit check-serving: CLI input errors, the pure judging / ratio logic, a tiny HF model on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ops import _entry, make_table  # the sibling test module's table helpers (tests/ is on sys.path)

from tunekit.errors import UserError
from tunekit.evidence.check_serving import judging
from tunekit.evidence.check_serving import model_check as serving
from tunekit.evidence.check_serving.hf_decode import layer_types

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "tunekit", "check-serving", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=300)


# ----------------------------------------------------------------------------- CLI input


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model", "gpt-2", "--tiny"], "unknown model 'gpt-2'"),
        (["--table", "no/such/table.json", "--tiny"], "no such table: no/such/table.json"),
        (["--layers", "0", "--tiny"], "--layers must be at least 1"),
        (["--tol-factor", "0.5", "--tiny"], "--tol-factor must be a number >= 1"),
        ([], "no GPU here"),  # TRITON_INTERPRET=1: nothing timed or graphed without --tiny
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(args: list[str], fragment: str) -> None:
    res = _run(*args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], res.stderr
    assert "Traceback" not in res.stderr and not res.stdout.strip()


def test_corrupt_table_is_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "table.json"
    bad.write_text("{not json")
    res = _run("--tiny", "--table", str(bad))
    assert res.returncode == 2 and res.stderr.startswith("error: table not usable") and res.stderr.count("\n") == 1


def test_help_names_the_options() -> None:
    res = _run("--help")
    assert res.returncode == 0
    for option in ("--model", "--table", "--layers", "--steps", "--out", "--tiny", "--rounds"):
        assert option in res.stdout


def test_validate_asks_for_a_gpu_unless_tiny() -> None:
    serving.validate(serving.Settings(tiny=True, skip_model=True), cuda_available=False)
    serving.validate(serving.Settings(skip_model=True), cuda_available=True)
    with pytest.raises(UserError, match="no GPU"):
        serving.validate(serving.Settings(skip_model=True), cuda_available=False)
    with pytest.raises(UserError, match="no GPU"):
        serving.validate(serving.Settings(skip_model=True, device="cpu"), cuda_available=True)


# ----------------------------------------------------------------------------- pure logic


def test_timing_summary_medians_and_same_run_ratios() -> None:
    times = {
        "eager_unpatched": [[10.0, 10.0, 12.0], [20.0, 20.0, 20.0]],  # round 2 twice as slow (clock change)
        "eager_patched": [[8.0, 8.0, 9.0], [16.0, 16.0, 16.0]],
        "graphed_unpatched": [[2.0, 2.0, 2.0], [4.0, 4.0, 4.0]],
        "graphed_patched": [[1.6, 1.6, 1.6], [4.0, 4.0, 4.0]],
    }
    s = judging.timing_summary(times)
    assert s["variants"]["eager_unpatched"]["median_ms"] == 16.0  # over all six steps
    assert s["variants"]["eager_unpatched"]["round_medians_ms"] == [10.0, 20.0]
    eager = s["ratios"]["patched_speedup_eager"]
    assert eager["per_round"] == [10.0 / 8.0, 20.0 / 16.0] and eager["median"] == pytest.approx(1.25)
    graphed = s["ratios"]["patched_speedup_graphed"]
    assert graphed["per_round"] == pytest.approx([1.25, 1.0]) and graphed["median"] == pytest.approx(1.125)
    assert (graphed["min"], graphed["max"]) == pytest.approx((1.0, 1.25))
    assert s["ratios"]["graph_speedup_unpatched"]["median"] == pytest.approx(5.0)
    assert set(s["ratios"]) == set(judging.RATIOS)


def test_timing_summary_without_the_graphed_variants_and_with_uneven_rounds() -> None:
    s = judging.timing_summary({"eager_unpatched": [[2.0]], "eager_patched": [[4.0]]})
    assert set(s["ratios"]) == {"patched_speedup_eager"} and s["ratios"]["patched_speedup_eager"]["median"] == 0.5
    with pytest.raises(ValueError, match="rounds"):
        judging.timing_summary({"eager_unpatched": [[2.0], [2.0]], "eager_patched": [[4.0]]})


def _run_of(rows: list[list[float]]) -> dict:
    logits = [torch.tensor(r) for r in rows]
    return {"logits": logits, "tokens": [int(t.argmax()) for t in logits]}


def test_agreement_equal_runs_pass() -> None:
    base = _run_of([[0.0, 1.0, 5.0, 2.0], [3.0, 0.0, 1.0, 0.5]])
    fp32 = _run_of([[0.0, 1.0, 5.01, 2.0], [3.01, 0.0, 1.0, 0.5]])
    result = judging.compare_logits(base, base, fp32, tol_factor=2.0, rel_tol_fallback=0.25)
    assert result["ok"] and result["max_abs_diff"] == 0.0 and result["tol_abs"] == pytest.approx(3 * 0.01, rel=1e-3)
    verdict = judging.tokens_verdict(result["steps"], result["tol_abs"])
    assert verdict == {"steps": 2, "agree": 2, "tokens_equal": True, "differing_steps": [], "ok": True}


def test_agreement_near_tie_flip_passes_and_a_real_flip_fails() -> None:
    base = _run_of([[0.0, 2.0, 2.02, 1.0], [4.0, 0.0, 1.0, 0.0]])  # step 0: top-2 gap 0.02
    fp32 = _run_of([[0.0, 2.0, 2.05, 1.0], [4.05, 0.0, 1.0, 0.0]])  # max |unpatched - fp32| 0.05
    near = _run_of([[0.0, 2.03, 2.01, 1.0], [4.0, 0.0, 1.0, 0.0]])  # moves two logits by 0.03 / 0.01
    result = judging.compare_logits(base, near, fp32, tol_factor=2.0, rel_tol_fallback=0.25)
    verdict = judging.tokens_verdict(result["steps"], result["tol_abs"])
    assert verdict["differing_steps"] == [0] and verdict["ok"] and not verdict["tokens_equal"]
    assert result["steps"][0]["near_tie"]
    far = _run_of([[0.0, 2.0, 2.02, 1.0], [0.0, 0.0, 1.0, 5.0]])  # step 1: a clear winner replaced
    result = judging.compare_logits(base, far, fp32, tol_factor=2.0, rel_tol_fallback=0.25)
    verdict = judging.tokens_verdict(result["steps"], result["tol_abs"])
    assert verdict["differing_steps"] == [1] and not verdict["ok"] and not result["ok"]
    assert result["steps"][1]["near_tie"] is False


def test_agreement_without_fp32_uses_the_relative_tolerance() -> None:
    base = _run_of([[0.0, 1.0, 2.0, 3.0]])
    off = _run_of([[0.0, 1.0, 2.0, 3.5]])
    std = float(base["logits"][0].std())
    assert judging.compare_logits(base, off, None, 2.0, rel_tol_fallback=0.5 / std + 1e-6)["ok"]
    assert not judging.compare_logits(base, off, None, 2.0, rel_tol_fallback=0.5 / std - 1e-3)["ok"]


def test_dispatch_classification_fails_broken_paths_only() -> None:
    rows = [
        {"op": "gemv", "shape": "256x128", "m": 1, "impl": "tuned:triton", "calls": 5},
        {"op": "gemv", "shape": "256x128", "m": 1, "impl": "tuned:triton", "calls": 1, "counted_at": "capture"},
        {"op": "gemv", "shape": "128x256", "m": 8, "impl": "fallback:m_above_table", "calls": 2},
        {"op": "rms_norm", "shape": "128x128", "m": 1, "impl": "fallback:no_table", "calls": 3},
        {"op": "gemv", "shape": "64x128", "m": 1, "impl": "fallback:not_built_at_capture", "calls": 1,
         "counted_at": "capture"},
    ]
    c = judging.classify_dispatch(rows)
    assert (c["tuned_calls"], c["calls"]) == (6, 12)
    assert c["broken"] == ["gemv 64x128 m=1: fallback:not_built_at_capture (at capture) x1"]
    assert c["uncovered"] == ["gemv 128x256 m=8: fallback:m_above_table x2"]
    assert c["vendor"] == ["rms_norm 128x128 m=1: fallback:no_table x3"]
    assert c["grouped"]["gemv 256x128 m=1"] == {"tuned:triton": 5, "tuned:triton (at capture)": 1}


def test_layer_types_keep_the_pattern_and_add_full_attention() -> None:
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    assert layer_types(pattern, 2) == ["linear_attention", "full_attention"]
    assert layer_types(pattern, 4) == pattern
    assert layer_types(pattern, 6) == pattern + ["linear_attention", "linear_attention"]


# ----------------------------------------------------------------------------- tiny HF model, CPU


@pytest.mark.usefixtures("clean_ops")
@pytest.mark.needs("hf")
@pytest.mark.parametrize("model", ["qwen3.5-27b", "llama-3.1-8b"])
def test_tiny_model_patched_agrees_with_unpatched_on_the_cpu(tmp_path: Path, model: str) -> None:
    # The tiny model's lm_head (256x128) and down_proj (128x256) at M=1, served by the interpreted kernel.
    # Few large programs: the interpreter's cost is per program.
    params = {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}
    table = make_table(tmp_path / "t.json", [_entry("gemv", 1, 256, 128, params=params),
                                             _entry("gemv", 1, 128, 256, params=params)])
    settings = serving.Settings(model=model, tables=[str(table)], layers=2, steps=3, prompt_len=4, tiny=True,
                                device="cpu", skip_ops=True, out=str(tmp_path / "out"))
    serving.validate(settings, cuda_available=False)
    lines: list[str] = []
    results = serving.run_check(settings, log=lines.append, argv=["test"])
    assert results["failures"] == 0, "\n".join(lines)
    m = results["model"]
    eager = m["comparison"]["eager_patched"]
    assert eager["ok"] and eager["tokens"]["ok"] and 0 < eager["max_abs_diff"] <= eager["tol_abs"]
    assert len(m["patched_tokens"]) == 3 and eager["tokens"]["steps"] == 3
    for row in eager["steps"]:  # a differing greedy token only as a judged near tie
        assert row["token_patched"] == row["token_unpatched"] or row["near_tie"]
    decode = m["dispatch_decode"]["grouped"]
    for key in ("gemv 256x128 m=1", "gemv 128x256 m=1"):  # every decode call of the tabulated shapes is tuned
        assert set(decode[key]) == {"tuned:triton"} and decode[key]["tuned:triton"] % 2 == 0  # 2 decode forwards
    assert m["unpatch_bitwise_equal"] and m["unpatch_restored"] > 0
    statuses = {c["check"]: c["status"] for c in results["checks"]}
    assert statuses["model graphed decode"] == "SKIP" and statuses["model timing"] == "SKIP"
    written = json.loads((tmp_path / "out" / "serving_check.json").read_text())
    assert written["format"] == serving.FORMAT and written["settings"]["model"] == model
    assert written["failures"] == 0 and not math.isnan(written["model"]["comparison"]["eager_patched"]["rms_diff"])


@pytest.mark.usefixtures("clean_ops")
@pytest.mark.needs("hf")
@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_tiny_qwen3_5_with_folded_norms_agrees_with_unpatched_on_the_cpu(tmp_path: Path) -> None:
    """--fold-norms: the decoder norms go into their consumers' weights where the table's M=1 entries say
    it pays (rms_gemv 0.9 us against the GEMV's 1.0), and the patched model still agrees."""
    from tunekit.evidence.check_serving import hf_decode
    from tunekit.integrations.torch_patch import fold_shapes

    config = hf_decode.build_config("qwen3.5-27b", 2, tiny=True)
    shapes = fold_shapes(hf_decode.meta_model("qwen3.5-27b", config))
    params = {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}
    rows = []
    for n, k in shapes:
        rows += [dict(_entry("rms_gemv", 1, n, k, params=params), time_us=0.9),
                 dict(_entry("gemv", 1, n, k, params=params), time_us=1.0)]
    table = make_table(tmp_path / "t.json", rows)
    settings = serving.Settings(model="qwen3.5-27b", tables=[str(table)], layers=2, steps=3, prompt_len=4,
                                tiny=True, device="cpu", skip_ops=True, fold_norms=True, out=str(tmp_path / "out"))
    lines: list[str] = []
    results = serving.run_check(settings, log=lines.append, argv=["test"])
    assert results["failures"] == 0, "\n".join(lines)
    m = results["model"]
    # 2 layers x (input, post-attention), but layer 0's Gated DeltaNet masks its normed input
    # (apply_mask_to_padding_states) before its projections read it: not a linear reader, so that norm stays
    assert m["patch_counts"]["gemma_rms_norm folded"] == 3
    assert m["patch_counts"]["gemma_rms_norm (not folded: read by a non-linear)"] == 1
    assert m["comparison"]["eager_patched"]["ok"] and m["unpatch_bitwise_equal"]
    decode = m["dispatch_decode"]["grouped"]
    folded = [key for key in decode if key.startswith("rms_gemv ") and key.endswith(" m=1")]
    assert len(folded) == len(shapes) and all(set(decode[key]) == {"tuned:triton"} for key in folded)


@pytest.mark.usefixtures("clean_ops")
@pytest.mark.needs("hf")
def test_tiny_qwen3_5_with_merged_siblings_agrees_with_unpatched_on_the_cpu(tmp_path: Path) -> None:
    """Siblings merged (the default): a table of vLLM's merged shapes only (what ``tunekit search --model``
    tunes) serves HF's separate q/k/v, gate/up, qkv/z and b/a, one tuned GEMV per group and decode step."""
    from tunekit.evidence.check_serving import hf_decode
    from tunekit.integrations.torch_patch import merged_shapes

    config = hf_decode.build_config("qwen3.5-27b", 2, tiny=True)
    shapes = merged_shapes(hf_decode.meta_model("qwen3.5-27b", config))
    assert len(shapes) == 4  # qkv+z, b+a, q+k+v, gate+up
    params = {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}
    table = make_table(tmp_path / "t.json", [_entry("gemv", 1, n, k, params=params) for n, k in shapes])
    settings = serving.Settings(model="qwen3.5-27b", tables=[str(table)], layers=2, steps=3, prompt_len=4,
                                tiny=True, device="cpu", skip_ops=True, out=str(tmp_path / "out"))
    lines: list[str] = []
    results = serving.run_check(settings, log=lines.append, argv=["test"])
    assert results["failures"] == 0, "\n".join(lines)
    m = results["model"]
    assert m["patch_counts"]["linear merged"] == 4 + 3 + 2 * 2
    assert m["comparison"]["eager_patched"]["ok"] and m["unpatch_bitwise_equal"]
    decode = m["dispatch_decode"]["grouped"]
    for n, k in shapes:  # 2 decode forwards; the MLP group runs in both layers, the others in one
        calls = decode[f"gemv {n}x{k} m=1"]
        assert set(calls) == {"tuned:triton"} and calls["tuned:triton"] == (4 if n == 2 * 256 else 2)


@pytest.mark.usefixtures("clean_ops")
def test_the_predicted_saving_prices_tuned_calls_from_their_serving_entries(tmp_path: Path) -> None:
    from tunekit import ops

    # _entry: time_us 1.0, baseline_us 2.0 (1 us saved per call); M=4 entries serve M=3 calls too
    ops.load_tables(str(make_table(tmp_path / "t.json", [_entry("gemv", 1, 64, 128), _entry("rms_norm", 4, 64, 64)])))
    rows = [
        {"op": "gemv", "dtype": "bf16", "shape": "64x128", "m": 1, "impl": "tuned:triton", "calls": 30},
        {"op": "rms_norm", "dtype": "bf16", "shape": "64x64", "m": 3, "impl": "tuned:triton", "calls": 12},
        {"op": "gemv", "dtype": "bf16", "shape": "64x128", "m": 8, "impl": "fallback:m_above_table", "calls": 9},
        {"op": "gated_rms_norm", "dtype": "bf16", "shape": "16x16", "m": 4, "impl": "tuned:triton", "calls": 6},
    ]
    got = serving.predicted_saving(rows, 6, "cpu")
    assert got == {"saving_us_per_step": (30 + 12) / 6, "priced_calls": 42, "unpriced_calls": 6, "steps": 6}
    # a folded consumer: priced against the plain GEMV's vendor time (2.0 - 1.5), not its own eager
    # norm + mm baseline (3.0); without a gemv entry of its shape, unpriced
    ops.load_tables(str(make_table(tmp_path / "fold.json", [
        _entry("gemv", 1, 64, 128), dict(_entry("rms_gemv", 1, 64, 128), time_us=1.5, baseline_us=3.0, speedup=2.0),
        _entry("rms_gemv", 1, 32, 128)])))
    folded = [{"op": "rms_gemv", "dtype": "bf16", "shape": "64x128", "m": 1, "impl": "tuned:triton", "calls": 8},
              {"op": "rms_gemv", "dtype": "bf16", "shape": "32x128", "m": 1, "impl": "tuned:triton", "calls": 4}]
    assert serving.predicted_saving(folded, 2, "cpu") == {"saving_us_per_step": 8 * 0.5 / 2, "priced_calls": 8,
                                                          "unpriced_calls": 4, "steps": 2}
    summary = {"variants": {"graphed_unpatched": {"median_ms": 0.107}},
               "ratios": {"patched_speedup_graphed": {"median": 1.05}}}

    class Report:
        lines: list = []

        def add(self, status, check, detail):
            self.lines.append((status, check, detail))

    report = Report()
    serving.report_prediction(report, summary, got)
    assert math.isclose(got["graphed_speedup"], 107 / 100) and "1.070x predicted, 1.050x measured" in report.lines[0][2]
