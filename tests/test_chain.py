"""tunekit.evidence.chain / `tunekit chain`: the decode-step chain holds exactly the model's problems, in vLLM's order,
wires activations like the decoder, and serves tabulated steps through the tunekit ops (CPU tier)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_cli import _run  # the sibling test module's CLI runner (tests/ is on sys.path)
from test_ops import _entry, make_table

from tunekit import backends
from tunekit.errors import UserError
from tunekit.evidence import chain as chain_mod
from tunekit.problems.models import list_models, load_model
from tunekit.problems.shapes import ELEMENTWISE_OPS, Problem

#: A Qwen3.5-shaped model small enough for the interpreter: layers 0-2 Gated DeltaNet, layer 3 full attention.
TINY = {
    "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 100,
    "rms_norm_eps": 1e-6, "full_attention_interval": 4, "hidden_act": "silu",
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
}


pytestmark = pytest.mark.usefixtures("clean_ops")  # conftest.py: no table, markers or vendor GEMM leak


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def _default_entry(op: str, m: int, n: int, k: int) -> dict:
    # the Triton family's fallback config, valid for every shape
    return _entry(op, m, n, k, params=backends.get("triton").space(Problem(op, "bf16", m, n, k)).default)


def _counts(spec, tp: int) -> tuple[Counter, Counter]:
    steps = chain_mod.chain_steps(spec, tp)
    problems = spec.problems(tp=tp, ops=("gemv",) + ELEMENTWISE_OPS)
    return Counter((s.op, s.n, s.k) for s in steps), Counter({(p.op, p.n, p.k): p.count for p in problems})


@pytest.mark.parametrize("tp", [1, 2])
def test_chain_holds_exactly_the_problems_of_every_builtin_model(tp: int) -> None:
    for spec in list_models():
        if spec.tp_error(tp) is None:
            in_chain, listed = _counts(spec, tp)
            assert in_chain == listed, spec.name


def test_qwen35_27b_chain_order() -> None:
    steps = chain_mod.chain_steps(load_model("qwen3.5-27b"))
    assert len(steps) == 546  # 305 GEMVs + 241 elementwise calls
    first = [(s.name, s.op) for s in steps[:9]]
    assert first == [
        ("input_layernorm", "gemma_rms_norm"), ("linear_attn.in_proj_qkvz", "gemv"),
        ("linear_attn.in_proj_ba", "gemv"), ("linear_attn.norm", "gated_rms_norm"),
        ("linear_attn.out_proj", "gemv"), ("post_attention_layernorm", "gemma_fused_add_rms_norm"),
        ("mlp.gate_up_proj", "gemv"), ("mlp.act_fn", "silu_and_mul"), ("mlp.down_proj", "gemv"),
    ]
    layer3 = [s.name for s in steps if s.layer == 3]  # every fourth layer is full attention
    assert layer3[:3] == ["input_layernorm", "qkv_proj", "o_proj"]
    assert steps[9].op == "gemma_fused_add_rms_norm"  # later layers add the residual
    assert [(s.layer, s.name) for s in steps[-2:]] == [(-1, "norm (final)"), (-1, "lm_head")]


def test_layers_option_truncates_and_is_checked() -> None:
    spec = load_model("qwen3.5-27b")
    steps = chain_mod.chain_steps(spec, layers=2)
    assert {s.layer for s in steps} == {0, 1, -1} and len(steps) == 2 * 9 + 2
    with pytest.raises(UserError, match="--layers"):
        chain_mod.chain_steps(spec, layers=65)


def test_chain_wiring_follows_the_decoder(tiny: Path) -> None:
    spec = load_model(str(tiny))
    chain = chain_mod.Chain(chain_mod.chain_steps(spec), 2, "cpu")
    chain.build("vendor", chain_mod.vendor_elementwise(torch.device("cpu")), lambda step: False)
    base = chain.forward("vendor").clone()
    assert base.shape == (2, 128) and torch.isfinite(base).all()

    def logits_after(name: str, layer: int) -> torch.Tensor:
        index = next(i for i, s in enumerate(chain.steps) if s.name == name and s.layer == layer)
        saved = chain.weights[index].clone()
        chain.weights[index].mul_(-1.5)
        try:
            return chain.forward("vendor").clone()
        finally:
            chain.weights[index].copy_(saved)

    # the MLP and the mixer's output projection feed the residual stream ...
    assert not torch.equal(logits_after("mlp.down_proj", 0), base)
    assert not torch.equal(logits_after("linear_attn.out_proj", 1), base)
    assert not torch.equal(logits_after("linear_attn.norm", 2), base)
    # ... the input projections feed only the omitted token mixers (fixed buffers here)
    assert torch.equal(logits_after("linear_attn.in_proj_qkvz", 0), base)
    assert torch.equal(logits_after("qkv_proj", 3), base)
    assert torch.equal(chain.forward("vendor"), base)  # the weights were put back


def test_chain_cli_serves_tabulated_steps_on_the_interpreter(tiny: Path, tmp_path: Path) -> None:
    # M=1 entries: down_proj, in_proj_ba and the fused add, gated norm, SiLU-and-mul; the rest stays vendor
    table = make_table(tmp_path / "t.json", [
        _default_entry("gemv", 1, 64, 96), _default_entry("gemv", 1, 8, 64),
        _default_entry("gemma_fused_add_rms_norm", 1, 64, 64), _default_entry("gated_rms_norm", 1, 64, 16),
        _default_entry("silu_and_mul", 1, 96, 192),
    ])
    res = _run("chain", "--config", str(tiny), "--table", str(table), "--m", "1,2", "--out", str(tmp_path / "o"))
    assert res.returncode == 0, res.stderr
    assert "nothing was timed" in res.stdout
    report = json.loads((tmp_path / "o" / "chain.json").read_text())
    assert report["calls_per_step"] == 36 and report["timed"] is False
    tuned = {(r["m"], r["variant"]): r["tuned_steps"] for r in report["results"]}
    # 4 down_proj + 3 in_proj_ba; + 8 fused adds (3 input, 4 post-attention, final) + 3 gated + 4 SiLU
    assert tuned == {(1, "vendor"): 0, (1, "tuned_gemv"): 7, (1, "tuned"): 22,
                     (2, "vendor"): 0, (2, "tuned_gemv"): 0, (2, "tuned"): 0}  # no entry serves M=2
    for r in report["results"]:
        assert r["tuned_steps"] + r["vendor_steps"] == 36
        assert r["rel_diff"] is not None and r["rel_diff"] <= 0.05  # BF16 kernels vs vendor, 4 layers
    for m in (1, 2):
        rms = {r["variant"]: r["rms_err_fp32"] for r in report["results"] if r["m"] == m}
        assert rms["vendor"] > 0  # the BF16 chain is not the fp32 one: the reference is really fp32
        assert rms["tuned"] <= 2 * rms["vendor"] and rms["tuned_gemv"] <= 2 * rms["vendor"]
    m1 = {r["variant"]: r for r in report["results"] if r["m"] == 1}
    # the predicted saving sums (baseline - time) of the served entries: 1 us each in make_table's rows
    assert m1["tuned_gemv"]["predicted_saving_us"] == pytest.approx(7.0)
    assert m1["tuned"]["predicted_saving_us"] == pytest.approx(22.0)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["chain", "--model", "qwen3.5-27b", "--table", "no/such/table.json"], "no such table"),
        (["chain", "--table", "x.json"], "--model or --config"),
        (["chain", "--model", "qwen3.5-27b", "--config", "c.json", "--table", "x.json"], "--model or --config"),
        (["chain", "--model", "qwen3.5-27b", "--table", "x.json", "--m", "17"], "1..16"),
        (["chain", "--model", "qwen3.5-27b", "--table", "x.json", "--profile-replays", "-1"], "--profile-replays"),
    ],
)
def test_chain_cli_errors_are_one_line(args: list[str], fragment: str) -> None:
    res = _run(*args)
    assert res.returncode == 2
    assert fragment in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_corrupt_table_is_an_error_not_a_silent_vendor_run(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = _run("chain", "--config", str(tiny), "--table", str(bad))
    # refused before any chain is built: one line naming the file and what is wrong with it
    assert res.returncode == 2 and "corrupt table" in res.stderr and str(bad) in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_profiled_replays_are_read_per_replay_with_serve_benchs_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--profile-replays``: a graph's N replays under the profiler become one replay's by_launch rows
    (serve-bench's key), largest first. The profiler itself needs a GPU: its trace is stubbed here."""
    from tunekit.evidence.chain import timing
    from tunekit.evidence.serve_bench import profile

    class Graph:
        replays = 0

        def replay(self) -> None:
            self.replays += 1

    def trace(run, activity):
        run()
        events = []
        for r in range(graph.replays):  # per replay: a norm, then a 40 us GEMV after it
            t = 100.0 * r
            events += [{"ph": "X", "cat": "kernel", "name": "_rms_norm_kernel", "ts": t, "dur": 2.0, "tid": 1},
                       {"ph": "X", "cat": "kernel", "name": "_gemv_kernel", "ts": t + 3.0, "dur": 40.0, "tid": 1,
                        "args": {"grid": [16480, 1, 1], "block": [32, 1, 1]}}]
        assert activity == "CUDA"
        return {"traceEvents": events}

    graph = Graph()
    monkeypatch.setattr(profile, "traced", trace)
    rows = timing._profiled_launches(graph, 4)
    assert graph.replays == 4
    assert list(rows) == ["tunekit_gemv: _gemv_kernel grid=(16480,1,1) block=(32,1,1) after=_rms_norm_kernel",
                          "tunekit_elementwise: _rms_norm_kernel after=_gemv_kernel",  # 3 of 4 replays' norms
                          "tunekit_elementwise: _rms_norm_kernel after=-"]  # the first has no predecessor
    gemv = rows["tunekit_gemv: _gemv_kernel grid=(16480,1,1) block=(32,1,1) after=_rms_norm_kernel"]
    assert gemv == {"us": 40.0, "kernels": 1.0, "gap_us": 1.0}  # per replay; the 1 us launch gap included
