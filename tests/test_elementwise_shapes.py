"""Elementwise problems from the model, the CLI's --ops / --m / --shape rules, the search
end to end on the CPU, and the dispatch table and report gated on the faster baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tunekit import table as table_mod
from tunekit.errors import UserError
from tunekit.problems import shapes
from tunekit.problems.models import list_models, load_model
from tunekit.problems.shapes import Problem

REPO = Path(__file__).resolve().parents[1]
ELEMENTWISE = ("rms_norm", "fused_add_rms_norm", "gated_rms_norm", "silu_and_mul", "bias_gelu")
ALL_OPS = "gemv," + ",".join(ELEMENTWISE)


def _run(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _summary(problems: list[Problem]) -> set[tuple[str, int, int, int]]:
    return {(p.op, p.n, p.k, p.count) for p in problems}


# ----------------------------------------------------------------- derivation
def test_qwen35_27b_elementwise_problems() -> None:
    spec = load_model("qwen3.5-27b")
    ops = shapes.parse_ops(",".join(ELEMENTWISE))
    problems = spec.problems(ops=ops)
    assert _summary(problems) == {
        ("gemma_rms_norm", 5120, 5120, 1),  # layer 0's input_layernorm: no residual yet
        ("gemma_fused_add_rms_norm", 5120, 5120, 63 + 64 + 1),  # later input, every post-attention, final
        ("gated_rms_norm", 48 * 128, 128, 48),  # one group per value head, 48 linear-attention layers
        ("silu_and_mul", 17408, 34816, 64),
    }
    fused = next(p for p in problems if p.op == "gemma_fused_add_rms_norm")
    assert fused.names == ("input_layernorm", "post_attention_layernorm", "norm (final)")
    assert next(p for p in problems if p.op == "gated_rms_norm").shape_text == "48x128"
    # TP=4: hidden-size norms stay full size, head-parallel ops shrink
    at_tp4 = _summary(spec.problems(tp=4, ops=ops))
    assert ("gemma_fused_add_rms_norm", 5120, 5120, 128) in at_tp4
    assert ("gated_rms_norm", 12 * 128, 128, 48) in at_tp4 and ("silu_and_mul", 4352, 8704, 64) in at_tp4
    # default ops: GEMV only, as before
    assert {p.op for p in spec.problems()} == {"gemv"}


def test_dense_model_elementwise_problems() -> None:
    spec = load_model("llama-3.1-8b-instruct")
    problems = spec.problems(tp=2, m_list=(1, 4096), ops=shapes.parse_ops(",".join(ELEMENTWISE)))
    assert _summary(problems) == {
        ("rms_norm", 4096, 4096, 1),
        ("fused_add_rms_norm", 4096, 4096, 64),
        ("silu_and_mul", 14336 // 2, 14336, 32),
    }
    assert sorted({p.m for p in problems}) == [1, 4096]
    assert spec.gated_norm_groups is None  # no linear attention, no gated norm


@pytest.mark.parametrize("spec", list_models(), ids=lambda s: s.name)
def test_derivation_matches_the_recorded_facts(spec) -> None:
    # configs/*.json record each model's per-token elementwise ops (checked facts);
    # the derivation from the config fields must agree for the ops tunekit tunes.
    doc = json.loads((REPO / "tunekit" / "problems" / "models" / "configs" / f"{spec.name}.json").read_text())
    names = {"rms_norm": "rms_norm", "gemma_rms_norm": "gemma_rms_norm", "fused_add_rms_norm": "fused_add_rms_norm",
             "gemma_fused_add_rms_norm": "gemma_fused_add_rms_norm", "rms_norm_gated": "gated_rms_norm",
             "silu_and_mul": "silu_and_mul"}
    facts: dict[tuple[str, int, int], int] = {}
    for entry in doc["elementwise"]:
        op = names.get(entry["op"])
        if op is None:
            continue
        if op == "gated_rms_norm":
            key = (op, entry["size"], entry["group"])
        elif op == "silu_and_mul":
            key = (op, entry["size"], entry["in_size"])
        else:
            key = (op, entry["size"], entry["size"])
        facts[key] = facts.get(key, 0) + entry["count"]
    assert _merge(spec.elementwise(1)) == facts


def _merge(items) -> dict[tuple[str, int, int], int]:
    out: dict[tuple[str, int, int], int] = {}
    for _, op, n, k, count in items:
        out[(op, n, k)] = out.get((op, n, k), 0) + count
    return out


# ------------------------------------------------------------ parsing rules
def test_m_list_gemv_stays_at_sixteen_elementwise_go_large() -> None:
    assert shapes.parse_m_list("1,16") == [1, 16]
    with pytest.raises(UserError, match=r"outside 1\.\.16"):
        shapes.parse_m_list("1,17")
    assert shapes.parse_m_list("4096,1,2,8,256", ops=("silu_and_mul",)) == [1, 2, 8, 256, 4096]
    with pytest.raises(UserError, match="leave gemv out of --ops"):
        shapes.parse_m_list("1,4096", ops=("gemv", "rms_norm"))
    with pytest.raises(UserError, match="65536"):
        shapes.parse_m_list("1,100000", ops=("rms_norm",))


def test_ops_and_adhoc_shapes() -> None:
    assert shapes.parse_ops("rms_norm,gemv") == ("rms_norm", "gemma_rms_norm", "gemv")
    assert shapes.parse_ops("gemma_fused_add_rms_norm") == ("gemma_fused_add_rms_norm",)
    with pytest.raises(UserError, match="unknown op 'layernorm'"):
        shapes.parse_ops("gemv,layernorm")
    assert shapes.parse_op_shape("gated_rms_norm:48x128") == ("gated_rms_norm", 6144, 128)
    assert shapes.parse_op_shape("silu_and_mul:17408") == ("silu_and_mul", 17408, 34816)
    assert shapes.parse_op_shape("bias_gelu: 4096") == ("bias_gelu", 4096, 4096)
    for bad, fragment in (("gated_rms_norm:6144", "GROUPSxSIZE"), ("bias_gelu:4x4", "one size"),
                          ("softmax:128", "unknown op"), ("rms_norm:", "OP:SIZE")):
        with pytest.raises(UserError, match=fragment):
            shapes.parse_op_shape(bad)
    problems = shapes.adhoc_problems(["96x5120", "bias_gelu:4096"], [1, 4096])
    assert [(p.op, p.m, p.n, p.k) for p in problems] == [
        ("gemv", 1, 96, 5120), ("gemv", 4096, 96, 5120), ("bias_gelu", 1, 4096, 4096), ("bias_gelu", 4096, 4096, 4096)]
    # the key stays op|dtype|mM|nN|kK, and the weight convention keeps keys apart
    keys = {Problem(op, "bf16", 1, 5120, 5120).key for op in shapes.NORM_OPS}
    assert len(keys) == 4 and Problem("gemma_rms_norm", "bf16", 1, 5120, 5120).key == \
        "gemma_rms_norm|bf16|m1|n5120|k5120"


def test_cli_shapes_lists_every_op() -> None:
    res = _run("shapes", "--model", "qwen3.5-27b", "--ops", ALL_OPS, "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    gemv = [r for r in rows if r["op"] == "gemv"]
    assert sum(r["count"] for r in gemv) == 305 and sum(r["bytes_per_token"] for r in gemv) == 51_243_909_120
    assert all("bytes_moved_per_call" not in r for r in gemv)  # GEMV rows exactly as before
    other = {(r["op"], r["n"], r["k"]): r for r in rows if r["op"] != "gemv"}
    assert other[("gemma_fused_add_rms_norm", 5120, 5120)]["count"] == 128
    assert other[("silu_and_mul", 17408, 34816)]["bytes_moved_per_call"] == 2 * 3 * 17408
    res = _run("shapes", "--model", "qwen3.5-27b", "--ops", ",".join(ELEMENTWISE), "--m", "1,2,8,256,4096",
               "--shape", "bias_gelu:5120")
    assert res.returncode == 0, res.stderr
    assert "gated_rms_norm" in res.stdout and "48x128" in res.stdout and "4096" in res.stdout
    assert "bias_gelu" in res.stdout and "elementwise calls" in res.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model", "qwen3-8b", "--ops", "gemv,silu_and_mul", "--m", "1,4096"], "leave gemv out of --ops"),
        (["--model", "qwen3-8b", "--ops", "gelu"], "unknown op"),
        (["--model", "qwen3.5-0.8b", "--ops", "bias_gelu"], "--shape bias_gelu:SIZE"),
        (["--shape", "gated_rms_norm:100"], "GROUPSxSIZE"),
    ],
)
def test_cli_elementwise_user_errors(args, fragment) -> None:
    res = _run("shapes", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], res.stderr


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_cli_search_elementwise_on_the_cpu(tmp_path) -> None:
    # The acceptance command: Triton interpreter, two ops of the model, M = 1.
    out = tmp_path / "run"
    res = _run("search", "--model", "qwen3.5-0.8b", "--ops", "silu_and_mul,fused_add_rms_norm", "--backend",
               "triton", "--m", "1", "--trials", "2", "--out", str(out), "--no-progress", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "inductor baseline: not measured" in res.stdout  # CPU: eager is the only baseline
    trials = pd.read_csv(out / "trials.csv")
    measured = trials[trials["measured"] == True]  # noqa: E712
    assert set(measured["op"]) == {"silu_and_mul", "gemma_fused_add_rms_norm"}
    assert len(measured) == 4 and (measured["status"] == "ok").all() and (measured["err_ratio"] <= 1).all()
    final = pd.read_csv(out / "final.csv")
    assert set(final["backend"]) == {"vendor", "triton"} and set(final["baseline"]) == {"vendor"}
    assert {(r.op, r.n, r.k, r.count) for r in final.itertuples()} == {
        ("silu_and_mul", 3584, 7168, 24), ("gemma_fused_add_rms_norm", 1024, 1024, 48)}
    assert json.loads(final[final.backend == "triton"].iloc[0]["params"])["VLLM_ROUNDING"] == 1
    table = table_mod.load(out / "table.json")
    assert bool(table["entries"]) == bool((final[final.backend == "triton"]["speedup"] >= 1.01).any())
    assert (out / "report.md").is_file() and "gemma_fused_add_rms_norm" in (out / "report.md").read_text()


# ---------------------------------------------------------- table and report gating
DEVICE = {"name": "NVIDIA H200", "arch": "sm_90", "cu_count": 132, "wave_size": 32, "l2_bytes": 62914560,
          "memory_bytes": 1, "runtime": "cuda 13.0", "vendor": "nvidia", "torch_device": "cuda:0"}
PROBE = {"read_gbps": 4500.0, "copy_gbps": 4000.0, "kind": "gpu"}


def _row(op, m, n, k, backend, time_us, label=None):
    nbytes = 2 * (2 * m * n + n)
    return {"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "count": 128, "names": "norm", "backend": backend,
            "label": label or backend, "trial": None, "params": "{}", "time_us": time_us, "time_p25_us": time_us,
            "time_p75_us": time_us, "spread": 0.0, "baseline_us": 0.0, "speedup": 0.0,
            "gbps": nbytes / (time_us * 1e-6) / 1e9, "pct_of_limit": None, "max_abs_err": None, "err_ratio": None,
            "timing_kind": "gpu", "numerics": "bounded"}


ROWS = [
    # M=1: triton beats eager (4 us) but not Inductor (2.5 us): no entry
    _row("gemma_rms_norm", 1, 5120, 5120, "vendor", 4.0),
    _row("gemma_rms_norm", 1, 5120, 5120, "inductor", 2.5),
    _row("gemma_rms_norm", 1, 5120, 5120, "triton", 3.0, "triton#1"),
    # M=4096: triton beats both: entry with the Inductor time as its baseline
    _row("gemma_rms_norm", 4096, 5120, 5120, "vendor", 60.0),
    _row("gemma_rms_norm", 4096, 5120, 5120, "inductor", 50.0),
    _row("gemma_rms_norm", 4096, 5120, 5120, "triton", 40.0, "triton#2"),
]


def test_table_gates_on_the_faster_of_eager_and_inductor() -> None:
    table = table_mod.build_table(ROWS, DEVICE, PROBE, min_gain=0.01, backends=["triton"])
    (entry,) = table_mod.entries(table)
    assert (entry.m, entry.backend, entry.baseline_us) == (4096, "triton", 50.0)
    assert entry.speedup == pytest.approx(1.25)


def test_report_takes_inductor_as_a_baseline(tmp_path) -> None:
    from tunekit.evidence import compare as report
    from tunekit.evidence.comparison import load_comparison

    run = tmp_path / "run"
    run.mkdir()
    meta = {"command": "tunekit search", "model": None, "backends": ["triton"], "min_gain": 0.01,
            "problems": [{"op": "gemma_rms_norm", "dtype": "bf16", "m": m, "n": 5120, "k": 5120, "count": 128,
                          "names": ["norm"]} for m in (1, 4096)],
            "device": DEVICE, "probe": PROBE, "environment": {}}
    (run / "run.json").write_text(json.dumps(meta))
    pd.DataFrame(ROWS).to_csv(run / "final.csv", index=False)
    comp = load_comparison(run)
    p1, p4096 = sorted(comp.problems, key=lambda p: p.m)
    assert set(p1.baselines) == {"inductor"} and "inductor" not in p1.best and comp.present == ["triton"]
    assert p1.baseline.backend == "inductor" and p1.winner.backend == "inductor" and p1.served_us() == 2.5
    assert p4096.best["triton"].speedup == pytest.approx(50 / 40)
    # % of the copy bandwidth (the elementwise limit), not of the read bandwidth
    nbytes = 2 * (2 * 4096 * 5120 + 5120)
    assert p4096.best["triton"].pct_of_limit == pytest.approx(100 * nbytes / 40e-6 / 1e9 / 4000.0)
    assert comp.tokens[0].vendor_us == 128 * 2.5  # the per-token baseline is the faster one
    head, rows = report.problem_table(comp)
    assert "inductor µs" in head and rows[0][head.index("inductor µs")] == "2.50"
    report.write_markdown(comp, [])
    assert "copy bandwidth" in (run / "report.md").read_text()
