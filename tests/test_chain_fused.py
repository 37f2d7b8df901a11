"""tunekit.evidence.chain's tuned_fused variant: fused norm -> GEMV and SiLU-and-mul -> GEMV kernels in place of
their pairs of steps, on a tiny Qwen3.5-shaped model under the interpreter (CPU tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_chain import TINY  # the sibling test module's tiny Qwen3.5 config (tests/ is on sys.path)
from test_ops import _entry, make_table, timed_entry

from tunekit import backends
from tunekit.dispatch.fused_gemv import joined_rows
from tunekit.evidence import chain as chain_mod
from tunekit.evidence.chain import kernels as chain_kernels
from tunekit.evidence.chain import steps as chain_steps
from tunekit.problems import shapes
from tunekit.problems.models import load_model
from tunekit.problems.models.spec import ModelSpec
from tunekit.problems.shapes import Problem

# The slow tier (`python -m pytest -q -m slow`, run by .ci/run):
# the fused chain variants on the interpreter.
# clean_ops (conftest.py): no table, markers or vendor GEMM leak.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_ops")]

CPU = torch.device("cpu")


def _spec() -> ModelSpec:
    return ModelSpec.from_config(TINY, name="tiny")


def _joined_n() -> int:
    """N of the one rms_gemv ``ModelSpec.rms_gemvs`` lists for a linear-attention layer's input norm:
    in_proj_qkvz + in_proj_ba, their rows joined."""
    return next(n for name, _, n, _, _ in _spec().rms_gemvs() if name.endswith("in_proj_qkvz+in_proj_ba"))


def _default_kernel(m: int, skip: tuple[str, ...] = (), fold: bool = False, merged: bool = False):
    """fused(op, n, k, replaced, added) of Chain.build: every fused op but ``skip`` at its search space's
    default config; the folded norm's rms_gemv only where asked: ``fold``, at each consumer's own shape (an
    older table's entries); ``merged``, at the linear-attention siblings' joined shape (``_joined_n``)."""
    triton = backends.get("triton")
    joined = _joined_n()

    def fused(op: str, n: int, k: int, replaced=None, added=()):
        if op in skip or (op == "rms_gemv" and not (merged if n == joined else fold)):
            return None
        problem = Problem(op, "bf16", m, n, k)
        return triton.build(problem, triton.space(problem).default, None)

    return fused


def _bound_chain(m: int, fused=None) -> chain_mod.Chain:
    chain = chain_mod.Chain(chain_mod.chain_steps(_spec()), m, CPU)
    fns = chain_mod.vendor_elementwise(CPU)
    for variant in chain_mod.VARIANTS:
        chain.build(variant, fns, lambda step: False, fused or _default_kernel(m))
    return chain


def test_every_pair_is_fused_and_its_problem_is_the_listed_one() -> None:
    # the prologue families alone (the residual epilogue turns the norms after it into plain ones: below)
    chain = _bound_chain(2, _default_kernel(2, skip=("gemv_add",)))
    kinds = chain.kinds["tuned_fused"]
    # 4 layers x (input norm + its 1-2 projections, post norm + gate_up, act_fn + down_proj);
    # left unfused: the mixers' output projections, the gated norm, the final norm and lm_head
    unfused = [s.name for s, kind in zip(chain.steps, kinds, strict=True) if kind != "fused"]
    assert sorted(set(unfused)) == ["linear_attn.norm", "linear_attn.out_proj", "lm_head", "norm (final)", "o_proj"]
    assert len(chain.fused["tuned_fused"]) == 12 and kinds.count("fused") == 27
    assert chain.kinds["tuned"] == ["vendor"] * len(chain.steps)  # nothing else served: tuned is vendor
    # the fused problems are those `--ops fused_gemv` lists for the model (names, shapes and counts)
    spec = _spec()
    listed = {(p.op, p.n, p.k): p.count for p in spec.problems(ops=shapes.parse_ops("rms_norm_gemv,silu_mul_gemv"))}
    used: dict[tuple, int] = {}
    for step in chain.fused["tuned_fused"]:
        used[(step.op, step.n, step.k)] = used.get((step.op, step.n, step.k), 0) + 1
    assert used == listed


#: every fused family but the residual epilogue (and the fold, which ``_default_kernel`` leaves out)
_ALL_BUT_ADD = ("silu_mul_gemv", *shapes.NORM_GEMV_OPS, *shapes.GLU_GEMV_OPS)


def _fused_names(chain: chain_mod.Chain) -> list[str]:
    return [f"{s.op} {s.name}" for s in chain.fused["tuned_fused"]]


def test_the_residual_epilogue_turns_the_next_norm_plain() -> None:
    """Every family served: o_proj / out_proj add the residual (gemv_add), so each post_attention_layernorm
    is the plain norm fused with gate_up_proj; down_proj takes the SiLU prologue (decided first), so the
    next input norm keeps its add. Only gemv_add served: every layer output adds the residual and each
    norm after one runs as the plain norm (retyped), the final norm included."""
    chain = _bound_chain(2)
    kinds = chain.kinds["tuned_fused"]
    unfused = [s.name for s, kind in zip(chain.steps, kinds, strict=True) if kind != "fused"]
    assert sorted(set(unfused)) == ["linear_attn.norm", "lm_head", "norm (final)"]
    names = _fused_names(chain)
    assert sorted(n for n in names if n.startswith("gemv_add")) == sorted(
        ["gemv_add linear_attn.out_proj+post_attention_layernorm"] * 3 + ["gemv_add o_proj+post_attention_layernorm"])
    assert names.count("gemma_rms_norm_gemv post_attention_layernorm+mlp.gate_up_proj") == 4
    assert not [n for n in names if n.startswith("gemma_fused_add_rms_norm_gemv post_attention")]
    assert len(names) == 16 and kinds.count("fused") == 31 and chain.retyped["tuned_fused"] == []
    adds = chain.adds["tuned_fused"]
    assert {chain.steps[i].name for i in adds} == {"o_proj", "linear_attn.out_proj"}

    only = _bound_chain(2, _default_kernel(2, skip=_ALL_BUT_ADD))
    assert {only.steps[i].name for i in only.adds["tuned_fused"]} == {"o_proj", "linear_attn.out_proj",
                                                                        "mlp.down_proj"}
    retyped = only.retyped["tuned_fused"]
    assert len(retyped) == 8 and {s.op for s in retyped} == {"gemma_rms_norm"}
    assert sorted({s.name for s in retyped}) == ["input_layernorm", "norm (final)", "post_attention_layernorm"]
    # 4 layers x 2 layer outputs: 8 gemv_add kernels, each with its plain norm (16 steps)
    assert len(only.fused["tuned_fused"]) == 8 and only.kinds["tuned_fused"].count("fused") == 16
    # each pair: the GEMV returns x W^T + residual, the norm after it the plain norm of that sum and the
    # sum itself as the residual
    gen = torch.Generator().manual_seed(7)
    fused, vendor = only._impls["tuned_fused"], only._impls["vendor"]
    for i in sorted(only.adds["tuned_fused"]):
        step = only.steps[i]
        src = torch.randn(2, step.k, generator=gen).bfloat16()
        residual = torch.randn(2, step.n, generator=gen).bfloat16()
        total = fused[i](src, only.weights[i], residual)
        expected = F.linear(src.double(), only.weights[i].double()) + residual.double()
        assert (total.double() - expected).abs().max() <= 2.0**-6 * expected.abs().max()
        normed, passed = fused[i + 1](total, residual, only.weights[i + 1])
        assert passed is total
        plain_vendor = chain_kernels.vendor_impl(retyped[0], chain_mod.vendor_elementwise(CPU), only)
        assert torch.equal(normed, plain_vendor(total, only.weights[i + 1]))  # served by nothing: vendor's
        assert not torch.equal(normed, vendor[i + 1](total, residual, only.weights[i + 1])[0])  # no second add


@pytest.mark.parametrize("skip", [(), _ALL_BUT_ADD], ids=["all", "gemv_add only"])
def test_the_residual_epilogue_keeps_the_logits(skip: tuple[str, ...]) -> None:
    chain = _bound_chain(3, _default_kernel(3, skip=skip))
    results = {r.variant: r for r in chain_mod.compare_eager(chain, chain_mod.VARIANTS)}
    fused = results["tuned_fused"]
    assert fused.fused_kernels == len(chain.fused["tuned_fused"]) > 0
    assert fused.rel_diff is not None and 0 < fused.rel_diff <= 0.05
    assert fused.rms_err_fp32 <= 2 * results["vendor"].rms_err_fp32
    # a chain whose gemv_add forgot the residual is far off: the check can fail
    for i in chain.adds["tuned_fused"]:
        kernel = chain._impls["tuned_fused"][i]
        chain._impls["tuned_fused"][i] = lambda x, w, residual, kernel=kernel: kernel(x, w, torch.zeros_like(residual))
    broken = chain_mod.compare_eager(chain, ["vendor", "tuned_fused"])[1]
    assert broken.rel_diff > 10 * fused.rel_diff


def test_qkvz_and_ba_weights_are_row_slices_of_one_tensor() -> None:
    chain = chain_mod.Chain(chain_mod.chain_steps(_spec()), 1, CPU)
    names = [s.name for s in chain.steps]
    i = names.index("linear_attn.in_proj_qkvz")
    qkvz, ba = chain.weights[i], chain.weights[i + 1]
    joined = joined_rows([qkvz, ba])
    assert joined is not None and joined.shape == (qkvz.shape[0] + ba.shape[0], qkvz.shape[1])
    assert torch.equal(joined[: qkvz.shape[0]], qkvz) and torch.equal(joined[qkvz.shape[0]:], ba)
    assert qkvz.is_contiguous() and ba.is_contiguous()  # the unfused variants read them as before
    assert joined_rows([qkvz, chain.weights[names.index("mlp.gate_up_proj")]]) is None


@pytest.mark.parametrize("m", [1, 3])
def test_fused_pairs_compute_what_the_unfused_steps_do(m: int) -> None:
    # per pair: the fused kernel's outputs (the consumers' slices, the residual) against the vendor steps
    # (the prologue families; the residual epilogue's pairs are checked below)
    chain = _bound_chain(m, _default_kernel(m, skip=("gemv_add",)))
    gen = torch.Generator().manual_seed(m)
    steps, fused, vendor = chain.steps, chain._impls["tuned_fused"], chain._impls["vendor"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        # a few BF16 ulps of the outputs' scale: one rounding location and a sum order apart
        assert (a.float() - b.float()).abs().max() <= 2.0**-6 * b.float().abs().max(), (a, b)

    for layer in (0, 1, 3):  # plain first norm + qkvz/ba; fused add + qkvz/ba; fused add + qkv_proj
        i = next(j for j, s in enumerate(steps) if s.layer == layer and s.name == "input_layernorm")
        consumers = [j for j in range(i + 1, i + 3) if chain.kinds["tuned_fused"][j] == "fused"]
        x, residual, g = rand(m, steps[i].n), rand(m, steps[i].n), chain.weights[i]
        if layer == 0:
            normed_v, normed_f = vendor[i](x, g).clone(), None
        else:
            normed_v, res_v = (t.clone() for t in vendor[i](x, residual, g))
            _, res_f = fused[i](x, residual, g)
            assert torch.equal(res_f, x + residual)  # the BF16 sum, as vLLM's Gemma fused add
        if layer == 0:
            fused[i](x, g)
        for j in consumers:
            close(fused[j](normed_f, chain.weights[j]), F.linear(normed_v, chain.weights[j]))
    # act_fn -> down_proj: the act step passes gate_up_proj's output through, down_proj computes the rest
    i = next(j for j, s in enumerate(steps) if s.name == "mlp.act_fn")
    gate_up = rand(m, 2 * steps[i].n) * 2
    assert fused[i](gate_up) is gate_up
    close(fused[i + 1](gate_up, chain.weights[i + 1]), F.linear(vendor[i](gate_up), chain.weights[i + 1]))


def test_logits_are_as_close_to_fp32_as_vendor() -> None:
    chain = _bound_chain(2, _default_kernel(2, skip=("gemv_add",)))
    results = {r.variant: r for r in chain_mod.compare_eager(chain, chain_mod.VARIANTS)}
    fused = results["tuned_fused"]
    assert fused.fused_kernels == 12 and fused.fused_steps == 27 and fused.vendor_steps == 9
    assert fused.rel_diff is not None and 0 < fused.rel_diff <= 0.05  # BF16 kernels vs vendor, 4 layers
    assert 0 < results["vendor"].rms_err_fp32 and fused.rms_err_fp32 <= 2 * results["vendor"].rms_err_fp32


def test_a_pair_without_an_entry_keeps_the_tuned_steps() -> None:
    # only silu_mul_gemv is served: the norms and their projections are the tuned variant's
    only_act = _default_kernel(1)
    chain = _bound_chain(1, lambda op, n, k, replaced, added: only_act(op, n, k) if op == "silu_mul_gemv" else None)
    fused_names = {s.name for s, kind in zip(chain.steps, chain.kinds["tuned_fused"], strict=True) if kind == "fused"}
    assert fused_names == {"mlp.act_fn", "mlp.down_proj"} and len(chain.fused["tuned_fused"]) == 4


def test_run_reports_tuned_fused_where_a_fused_entry_serves(tmp_path: Path) -> None:
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    spec = load_model(str(config))

    def default(op: str, m: int, n: int, k: int) -> dict:
        return _entry(op, m, n, k, params=backends.get("triton").space(Problem(op, "bf16", m, n, k)).default)

    table = make_table(tmp_path / "t.json", [
        dict(default("gemv", 1, 64, 96), time_us=1.5, speedup=2.0 / 1.5),  # down_proj, unfused (tuned)
        default("silu_mul_gemv", 1, 64, 96),  # act_fn -> down_proj
        default("gemma_fused_add_rms_norm_gemv", 1, 192, 64),  # post_attention_layernorm -> gate_up_proj
        default("gemma_fused_add_rms_norm_gemv", 1, 200, 64),  # input_layernorm -> in_proj_qkvz + in_proj_ba
    ])
    lines: list[str] = []
    report = chain_mod.run(spec, [str(table)], [1, 2], log=lines.append)
    rows = {(r["m"], r["variant"]): r for r in report["results"]}
    assert set(rows) == {(1, v) for v in chain_mod.VARIANTS} | {(2, v) for v in chain_mod.VARIANTS[:3]}
    assert any("M=2 tuned_fused: no fused entry" in line for line in lines)
    tuned, fused = rows[(1, "tuned")], rows[(1, "tuned_fused")]
    assert tuned["tuned_steps"] == 4 and tuned["fused_kernels"] == 0
    # 4 act_fn + down_proj, 4 post norms + gate_up, 2 later linear-attention input norms + qkvz + ba,
    # layer 3's input norm + qkv_proj (192 x 64 as gate_up); layer 0's plain norm has no entry
    assert fused["fused_kernels"] == 11 and fused["fused_steps"] == 8 + 8 + 6 + 2 and fused["tuned_steps"] == 0
    assert fused["tuned_steps"] + fused["vendor_steps"] + fused["fused_steps"] == report["calls_per_step"]
    # the predicted saving sums (baseline - time) of the served entries: 1 us each in make_table's rows
    assert fused["predicted_saving_us"] == pytest.approx(11.0)
    assert fused["rms_err_fp32"] <= 2 * rows[(1, "vendor")]["rms_err_fp32"]
    assert any("fused kernels" in line for line in lines)


def test_a_fused_entry_slower_than_the_tuned_steps_it_replaces_is_left_unfused(tmp_path: Path) -> None:
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    spec = load_model(str(config))

    table = make_table(tmp_path / "t.json", [
        timed_entry("gemv", 64, 96, 1.0),  # down_proj, tuned: 1.0 us
        timed_entry("silu_mul_gemv", 64, 96, 1.2),  # beats the eager pair (2 us), loses to the tuned down_proj
    ])
    lines: list[str] = []
    report = chain_mod.run(spec, [str(table)], [1], log=lines.append)
    variants = [r["variant"] for r in report["results"]]
    assert "tuned_fused" not in variants  # nothing pays: tuned_fused is tuned, not measured twice
    assert any("silu_mul_gemv 64x96: fused 1.20 us >= the tuned steps it replaces 1.00 us" in line
               for line in lines), lines


def test_run_moves_the_residual_add_only_where_the_plain_norm_pays(tmp_path: Path) -> None:
    """gemv_add replaces a layer output's GEMV and turns the fused add + norm after it into the plain norm:
    taken where gemv_add + the plain norm beat the tuned GEMV + the tuned fused add + norm (o_proj /
    out_proj, 1.1 + 0.5 < 1.0 + 1.0 us), left with a log line where not (down_proj, 1.6 + 0.5 >= 2.0)."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    spec = load_model(str(config))

    table = make_table(tmp_path / "t.json", [
        timed_entry("gemv", 64, 64, 1.0), timed_entry("gemv", 64, 96, 1.0),  # o_proj / out_proj, down_proj
        timed_entry("gemma_fused_add_rms_norm", 64, 64, 1.0), timed_entry("gemma_rms_norm", 64, 64, 0.5),
        timed_entry("gemv_add", 64, 64, 1.1), timed_entry("gemv_add", 64, 96, 1.6),
    ])
    lines: list[str] = []
    report = chain_mod.run(spec, [str(table)], [1], log=lines.append)
    rows = {r["variant"]: r for r in report["results"]}
    fused, tuned = rows["tuned_fused"], rows["tuned"]
    # 3 out_proj + 1 o_proj, each with the post-attention norm after it
    assert fused["fused_kernels"] == 4 and fused["fused_steps"] == 8
    assert fused["tuned_steps"] == tuned["tuned_steps"] - 8
    assert any("gemv_add 64x96: fused 1.60 us + gemma_rms_norm 0.50 >= the tuned steps it replaces 2.00 us"
               in line for line in lines), lines
    # prediction: the 4 gemv_add entries and their 4 plain norms replace 4 GEMV and 4 fused-add entries
    saving = {op: 2.0 - t for op, t in (("gemv", 1.0), ("add", 1.0), ("gemv_add", 1.1), ("plain", 0.5))}
    moved = 4 * (saving["gemv_add"] + saving["plain"] - saving["gemv"] - saving["add"])
    assert fused["predicted_saving_us"] == pytest.approx(tuned["predicted_saving_us"] + moved)
    assert fused["rms_err_fp32"] <= 2 * rows["vendor"]["rms_err_fp32"]


def test_run_keeps_the_add_where_no_table_serves_the_plain_norm(tmp_path: Path) -> None:
    """Without the plain norm's entry the cost of the norm gemv_add would leave is unknown: not fused."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    spec = load_model(str(config))
    params = backends.get("triton").space(Problem("gemv_add", "bf16", 1, 64, 64)).default
    table = make_table(tmp_path / "t.json", [_entry("gemv_add", 1, 64, 64, params=params)])
    report = chain_mod.run(spec, [str(table)], [1], log=lambda s: None)
    assert "tuned_fused" not in [r["variant"] for r in report["results"]]


def _folding_chain(m: int, glu: bool = False, fold: bool = True, merged: bool = False) -> chain_mod.Chain:
    # the residual epilogue and the folded norm only (no prologue family); ``glu``: and SiLU-and-mul in
    # gate_up's epilogue; ``fold`` / ``merged``: which rms_gemv entries there are (``_default_kernel``)
    skip = ("silu_mul_gemv", *shapes.NORM_GEMV_OPS, *(() if glu else shapes.GLU_GEMV_OPS))
    return _bound_chain(m, _default_kernel(m, skip=skip, fold=fold, merged=merged))


def test_folded_norms_leave_no_norm_but_the_final_one() -> None:
    """gemv_add and rms_gemv served: every layer output adds the residual and the norm after it is folded
    into its consumers (rms_gemv on W diag(1 + g)); layer 0's plain input norm is folded as well. Only the
    final norm, which feeds lm_head, stays a (plain) norm."""
    chain = _folding_chain(2)
    kinds = chain.kinds["tuned_fused"]
    names = _fused_names(chain)
    assert names.count("rms_gemv linear_attn.in_proj_qkvz") == 3 and names.count("rms_gemv qkv_proj") == 1
    assert names.count("rms_gemv mlp.gate_up_proj") == 4 and names.count("rms_gemv linear_attn.in_proj_ba") == 3
    assert sum(n.startswith("gemv_add") for n in names) == 8
    assert [s.name for s in chain.retyped["tuned_fused"]] == ["norm (final)"]
    unfused = {s.name for s, kind in zip(chain.steps, kinds, strict=True) if kind != "fused"}
    assert unfused == {"linear_attn.norm", "mlp.act_fn", "lm_head"}
    # a folded norm passes its input on; each consumer normalises it with the folded weight
    gen = torch.Generator().manual_seed(4)
    i = next(j for j, s in enumerate(chain.steps) if s.layer == 3 and s.name == "input_layernorm")
    s_in = torch.randn(2, 64, generator=gen).bfloat16()
    passed, residual = chain._impls["tuned_fused"][i](s_in, torch.zeros_like(s_in), chain.weights[i])
    assert passed is s_in and residual is s_in
    # every folded consumer computes its GEMV of the weighted norm of its input
    from kernels_triton.gemv import gemv

    xd = s_in.double()
    unit = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
    norm = None
    for j, (step, kind) in enumerate(zip(chain.steps, kinds, strict=True)):
        if step.op.endswith("rms_norm"):
            norm = chain.weights[j]
        elif kind == "fused" and step.op == "gemv" and step.name.endswith(chain_steps.NORM_CONSUMERS):
            expected = F.linear(unit * (1 + norm.double()), chain.weights[j].double())
            y = chain._impls["tuned_fused"][j](s_in, chain.weights[j])
            assert (y.double() - expected).abs().max() <= 2.0**-6 * expected.abs().max(), step
            # the check can fail: a fold in the wrong convention (g for Gemma's 1 + g)
            wrong = gemv(s_in, (chain.weights[j].float() * norm.float()).bfloat16(), rms_eps=1e-6)
            assert (wrong.double() - expected).abs().max() > 0.5 * expected.abs().max()


def test_folded_norms_keep_the_logits() -> None:
    chain = _folding_chain(3)
    results = {r.variant: r for r in chain_mod.compare_eager(chain, chain_mod.VARIANTS)}
    fused = results["tuned_fused"]
    assert fused.fused_kernels == 19
    assert fused.rel_diff is not None and 0 < fused.rel_diff <= 0.05
    assert fused.rms_err_fp32 <= 2 * results["vendor"].rms_err_fp32


def test_a_folded_gate_up_takes_the_activation_and_keeps_the_logits() -> None:
    """With the GLU epilogue too, every folded gate_up_proj runs rms_gemv_silu_mul on its folded weight
    with the rows paired, and act_fn is gone: no elementwise step but the gated norm is left."""
    chain = _folding_chain(3, glu=True)
    names = _fused_names(chain)
    assert names.count("rms_gemv_silu_mul mlp.gate_up_proj") == 4 and "rms_gemv mlp.gate_up_proj" not in names
    unfused = {s.name for s, kind in zip(chain.steps, chain.kinds["tuned_fused"], strict=True) if kind != "fused"}
    assert unfused == {"linear_attn.norm", "lm_head"}
    results = {r.variant: r for r in chain_mod.compare_eager(chain, chain_mod.VARIANTS)}
    fused = results["tuned_fused"]
    assert fused.fused_kernels == 19
    assert fused.rel_diff is not None and 0 < fused.rel_diff <= 0.05
    assert fused.rms_err_fp32 <= 2 * results["vendor"].rms_err_fp32


#: the name of the one rms_gemv step that serves both linear-attention siblings (``Chain._fold_options``)
_SIBLINGS = "linear_attn.in_proj_qkvz+linear_attn.in_proj_ba"


def _linear_input_norms(chain: chain_mod.Chain) -> list[int]:
    """The step indices of the linear-attention layers' input norms (each followed by in_proj_qkvz, in_proj_ba)."""
    return [i for i, s in enumerate(chain.steps)
            if s.name == "input_layernorm" and chain.steps[i + 1].name == "linear_attn.in_proj_qkvz"]


def _weighted_unit(x: torch.Tensor, norm: chain_mod.Step, g: torch.Tensor) -> torch.Tensor:
    """The norm's output in fp64: x / rms(x) times its weight (1 + g for Gemma's)."""
    xd = x.double()
    unit = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
    return unit * ((1 + g.double()) if "gemma" in norm.op else g.double())


def test_a_joined_entry_folds_the_linear_attention_input_norm_into_one_kernel() -> None:
    """rms_gemv tabulated only at the siblings' joined shape (a fresh ``--ops rms_gemv`` table): every
    linear-attention input norm (layer 0's plain one; the later ones, whose add moved into down_proj's
    gemv_add) is folded into ONE rms_gemv on the joined folded weight. in_proj_qkvz launches it and returns
    its columns; in_proj_ba returns its columns of the same output without a launch. Logits stay as close."""
    m = 3
    chain = _folding_chain(m, fold=False, merged=True)
    spec, kinds, impls = _spec(), chain.kinds["tuned_fused"], chain._impls["tuned_fused"]
    norms = _linear_input_norms(chain)
    assert len(norms) == spec.layer_types.count("linear_attention") > 1
    qkvz_n, ba_n = chain.steps[norms[0] + 1].n, chain.steps[norms[0] + 2].n
    folds = [s for s in chain.fused["tuned_fused"] if s.op == "rms_gemv"]
    assert [(s.layer, s.name, s.n, s.k) for s in folds] == [
        (chain.steps[i].layer, _SIBLINGS, _joined_n(), spec.hidden_size) for i in norms]
    assert qkvz_n + ba_n == _joined_n()
    gen = torch.Generator().manual_seed(5)
    for i in norms:
        assert kinds[i:i + 3] == ["fused"] * 3
        x = torch.randn(m, spec.hidden_size, generator=gen).bfloat16()
        g = chain.weights[i]
        passed = impls[i](x, g) if i == norms[0] else impls[i](x, torch.zeros_like(x), g)[0]
        assert passed is x  # the folded norm passes its input on
        qkvz = impls[i + 1](x, chain.weights[i + 1])
        ba = impls[i + 2](torch.zeros_like(x), chain.weights[i + 2])  # a launch here would read zeros
        assert qkvz.shape == (m, qkvz_n) and ba.shape == (m, ba_n)
        assert ba.data_ptr() == qkvz.data_ptr() + qkvz_n * qkvz.element_size()  # one output, two column blocks
        unit = _weighted_unit(x, chain.steps[i], g)
        for y, j in ((qkvz, i + 1), (ba, i + 2)):
            expected = F.linear(unit, chain.weights[j].double())
            assert (y.double() - expected).abs().max() <= 2.0**-6 * expected.abs().max(), chain.steps[j]
    results = {r.variant: r for r in chain_mod.compare_eager(chain, chain_mod.VARIANTS)}
    fused = results["tuned_fused"]
    assert fused.fused_kernels == len(chain.fused["tuned_fused"])
    assert fused.rel_diff is not None and 0 < fused.rel_diff <= 0.05
    assert fused.rms_err_fp32 <= 2 * results["vendor"].rms_err_fp32


def test_per_consumer_entries_fold_as_before_and_a_joined_entry_takes_their_place() -> None:
    """An older table (rms_gemv at each consumer's shape only): in_proj_qkvz and in_proj_ba each run an
    rms_gemv of their own, each launching it. With the joined entry tabulated as well, one rms_gemv serves
    both: the same steps fused, one kernel fewer per linear-attention layer, logits as close."""
    m = 2
    old = _folding_chain(m)
    both = _folding_chain(m, merged=True)
    norms = _linear_input_norms(old)
    old_names, both_names = _fused_names(old), _fused_names(both)
    per_consumer = ["rms_gemv linear_attn.in_proj_qkvz", "rms_gemv linear_attn.in_proj_ba"]
    assert [old_names.count(name) for name in per_consumer] == [len(norms)] * 2
    assert f"rms_gemv {_SIBLINGS}" not in old_names
    for i in norms:
        layer = old.steps[i].layer
        assert [s.n for s in old.fused["tuned_fused"] if s.layer == layer and f"{s.op} {s.name}" in per_consumer] \
            == [old.steps[i + 1].n, old.steps[i + 2].n]
    # each per-consumer kernel launches on its own input (in_proj_ba's of zeros is zero)
    i = norms[0]
    x = torch.randn(m, old.steps[i].n, generator=torch.Generator().manual_seed(6)).bfloat16()
    impls = old._impls["tuned_fused"]
    ba = impls[i + 2](x, old.weights[i + 2]).clone()
    expected = F.linear(_weighted_unit(x, old.steps[i], old.weights[i]), old.weights[i + 2].double())
    assert (ba.double() - expected).abs().max() <= 2.0**-6 * expected.abs().max()
    assert not impls[i + 2](torch.zeros_like(x), old.weights[i + 2]).any()

    assert both_names.count(f"rms_gemv {_SIBLINGS}") == len(norms)
    assert not [name for name in both_names if name in per_consumer]
    assert sorted(n for n in both_names if n != f"rms_gemv {_SIBLINGS}") == sorted(
        n for n in old_names if n not in per_consumer)
    assert both.kinds["tuned_fused"] == old.kinds["tuned_fused"]
    results = {r.variant: r for r in chain_mod.compare_eager(both, chain_mod.VARIANTS)}
    fused = results["tuned_fused"]
    assert fused.fused_kernels == len(old.fused["tuned_fused"]) - len(norms)
    assert fused.rel_diff is not None and 0 < fused.rel_diff <= 0.05
    assert fused.rms_err_fp32 <= 2 * results["vendor"].rms_err_fp32


@pytest.mark.parametrize("joined_us", [1.0, 1.23, 1.3])
def test_run_prices_the_joined_fold_against_the_norm_and_both_gemvs(tmp_path: Path, joined_us: float) -> None:
    """A fresh table: rms_gemv at the siblings' joined shape (200x64, ``joined_us``) and at 192x64 (gate_up,
    qkv_proj), none at in_proj_ba's own 8x64; every entry beats its 2 us baseline (else it is not served),
    so only the pricing decides. The joined kernel replaces the norm and both GEMVs: layer 0's plain norm
    (0.25 us) + qkvz + ba (0.5 us each) = 1.25 us; after down_proj, with gemv_add (0.8 us), the GEMV + the
    fused add + norm + qkvz + ba = 2.0 us. So at 1.0 us every linear-attention input norm is folded, at
    1.23 us only layer 0's (0.8 + 1.23 >= 2.0), at 1.3 us none (1.3 >= 1.25)."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    spec = load_model(str(config))
    joined = _joined_n()
    gemv_us, norm_us, plain_us, add_us = 0.5, 0.5, 0.25, 0.8
    table = make_table(tmp_path / "t.json", [
        timed_entry("gemv", 192, 64, gemv_us), timed_entry("gemv", 8, 64, gemv_us),
        timed_entry("gemv", 64, 64, gemv_us), timed_entry("gemv", 64, 96, gemv_us),
        timed_entry("gemma_fused_add_rms_norm", 64, 64, norm_us), timed_entry("gemma_rms_norm", 64, 64, plain_us),
        timed_entry("gemv_add", 64, 64, add_us), timed_entry("gemv_add", 64, 96, add_us),
        timed_entry("rms_gemv", 192, 64, 0.525), timed_entry("rms_gemv", joined, 64, joined_us),
    ])
    lines: list[str] = []
    report = chain_mod.run(spec, [str(table)], [1], log=lines.append)
    rows = {r["variant"]: r for r in report["results"]}
    fused = rows["tuned_fused"]
    plain_pays = joined_us < plain_us + 2 * gemv_us  # layer 0: the joined fold of the plain norm
    add_pays = add_us + joined_us < gemv_us + norm_us + 2 * gemv_us  # layers 1, 2: with down_proj's gemv_add
    # folded with the add at each layer output: 4 mixer outputs -> gate_up, layer 2's down_proj -> qkv_proj
    # (0.8 + 0.525 < 1.5 us), and where the joined fold pays with the add, layers 0 and 1's down_proj -> the
    # next linear-attention input norm
    with_add = 5 + (2 if add_pays else 0)
    joined_kernels = (1 if plain_pays else 0) + (2 if add_pays else 0)
    # per kernel: gemv_add 2 steps (GEMV + norm), 192x64 rms_gemv 1 (5 of them), the joined one its 2
    # consumers (+ layer 0's plain norm, folded)
    assert fused["fused_kernels"] == with_add + 5 + joined_kernels
    assert fused["fused_steps"] == 2 * with_add + 5 + 2 * joined_kernels + (1 if plain_pays else 0)
    assert fused["tuned_steps"] + fused["vendor_steps"] + fused["fused_steps"] == report["calls_per_step"]
    replaced = "input_layernorm+linear_attn.in_proj_qkvz+linear_attn.in_proj_ba"
    assert any(f"rms_gemv {joined}x64: fused {joined_us:.2f} us >= the tuned steps it replaces 1.25 us "
               f"({replaced})" in line for line in lines) != plain_pays, lines
    assert any(f"gemv_add 64x96: fused 0.80 us + rms_gemv {joined_us:.2f} >= the tuned steps it replaces 2.00 us"
               in line for line in lines) != add_pays, lines
    assert fused["rel_diff"] is not None and 0 < fused["rel_diff"] <= 0.05
    assert fused["rms_err_fp32"] <= 2 * rows["vendor"]["rms_err_fp32"]


@pytest.mark.parametrize("glu", [False, True])
def test_run_folds_where_the_add_and_the_fold_pay_together(tmp_path: Path, glu: bool) -> None:
    """Priced jointly: gemv_add with the plain norm it leaves loses (1.6 + 0.5 >= 2.0 us) and each rms_gemv
    loses to its GEMV alone (1.05 > 1.0), but gemv_add + the consumers' rms_gemv beat the GEMV, the fused
    add + norm and the consumers' GEMVs (1.6 + 1.05 < 3.0; 1.6 + 2.1 < 4.0): folded. After the last
    down_proj (the final norm feeds lm_head) the add stays. ``glu``: a folded gate_up_proj then takes the
    SiLU-and-mul after it into its epilogue (rms_gemv_silu_mul, 1.0 < its rms_gemv's 1.05 us)."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    spec = load_model(str(config))

    table = make_table(tmp_path / "t.json", [
        timed_entry("gemv", 192, 64, 1.0), timed_entry("gemv", 8, 64, 1.0),
        timed_entry("gemv", 64, 64, 1.0), timed_entry("gemv", 64, 96, 1.0),
        timed_entry("gemma_fused_add_rms_norm", 64, 64, 1.0), timed_entry("gemma_rms_norm", 64, 64, 0.5),
        timed_entry("gemv_add", 64, 64, 1.6), timed_entry("gemv_add", 64, 96, 1.6),
        timed_entry("rms_gemv", 192, 64, 1.05), timed_entry("rms_gemv", 8, 64, 1.05),
    ] + ([timed_entry("rms_gemv_silu_mul", 192, 64, 1.0)] if glu else []))
    lines: list[str] = []
    report = chain_mod.run(spec, [str(table)], [1], log=lines.append)
    rows = {r["variant"]: r for r in report["results"]}
    fused = rows["tuned_fused"]
    # 7 gemv_add (4 mixer outputs, 3 down_proj) + 11 rms_gemv (2 + 2 + 2 + 1 input, 4 post-attention; with
    # glu those 4 run as rms_gemv_silu_mul)
    assert fused["fused_kernels"] == 18
    # the 7 pairs, the 11 consumers and layer 0's folded input norm (glu: and the 4 act_fn steps)
    assert fused["fused_steps"] == 14 + 11 + 1 + (4 if glu else 0)
    assert any("gemv_add 64x96: fused 1.60 us + gemma_rms_norm 0.50 >= the tuned steps it replaces 2.00 us"
               in line for line in lines), lines
    assert fused["rms_err_fp32"] <= 2 * rows["vendor"]["rms_err_fp32"]


@pytest.mark.parametrize(("glu_us", "kernels"), [(1.2, 4), (1.6, 0)])
def test_run_takes_silu_and_mul_into_gate_up_where_it_pays(tmp_path: Path, glu_us: float, kernels: int) -> None:
    """gate_up_proj (1.0 us) + act_fn (0.5 us) -> gemv_silu_mul on gate_up's weight with its rows paired:
    taken at 1.2 us in all 4 layers, with the logits of the unfused chain; left unfused at 1.6 us."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    spec = load_model(str(config))
    table = make_table(tmp_path / "t.json", [
        timed_entry("gemv", 192, 64, 1.0), timed_entry("silu_and_mul", 96, 192, 0.5),
        timed_entry("gemv_silu_mul", 192, 64, glu_us),
    ])
    lines: list[str] = []
    report = chain_mod.run(spec, [str(table)], [1], log=lines.append)
    rows = {r["variant"]: r for r in report["results"]}
    if not kernels:
        assert "tuned_fused" not in rows
        assert any("gemv_silu_mul 192x64: fused 1.60 us >= the tuned steps it replaces 1.50 us" in line
                   for line in lines), lines
        return
    fused = rows["tuned_fused"]
    assert fused["fused_kernels"] == kernels and fused["fused_steps"] == 2 * kernels
    assert fused["tuned_steps"] == rows["tuned"]["tuned_steps"] - 2 * kernels
    assert fused["rel_diff"] is not None and 0 < fused["rel_diff"] <= 0.05
    assert fused["rms_err_fp32"] <= 2 * rows["vendor"]["rms_err_fp32"]


# ----------------------------------------------------------------------------- the measured fusion check


def _ratios(table: dict[frozenset, float]):
    """A fake same-run timing: tuned_fused / tuned per set of families left out; records what was asked."""
    asked: list[frozenset] = []

    def ratio(excluded: frozenset) -> float:
        asked.append(excluded)
        return table[frozenset(excluded)]

    return ratio, asked


def test_the_fusion_check_drops_a_family_that_measures_slower_and_keeps_the_rest() -> None:
    f = frozenset
    # gemv_add pays, rms_gemv costs 0.6% in the chain although its standalone price said it pays
    ratio, asked = _ratios({f(): 0.995, f({"gemv_add"}): 1.003, f({"rms_gemv"}): 0.989,
                            f({"rms_gemv", "gemv_add"}): 1.0})
    excluded, trace = chain_mod.select_fusions(["gemv_add", "rms_gemv"], ratio)
    assert excluded == {"rms_gemv"}
    assert asked == [f(), f({"gemv_add"}), f({"rms_gemv"}), f({"rms_gemv", "gemv_add"})]
    assert trace[0] == {"excluded": [], "ratio": 0.995} and len(trace) == 4


def test_the_fusion_check_keeps_everything_within_the_margin_and_drops_all_when_none_is_faster() -> None:
    f = frozenset
    # leaving gemv_add out gains 0.1%: within the margin, nothing is dropped
    ratio, _ = _ratios({f(): 0.990, f({"gemv_add"}): 0.989, f({"gemv_silu_mul"}): 0.999})
    assert chain_mod.select_fusions(["gemv_add", "gemv_silu_mul"], ratio)[0] == f()
    # every subset is slower than tuned: no family is fused
    ratio, _ = _ratios({f(): 1.004, f({"a"}): 1.002, f({"b"}): 1.003, f({"a", "b"}): 1.0})
    assert chain_mod.select_fusions(["a", "b"], ratio)[0] == {"a", "b"}


def test_a_family_left_out_is_bound_as_the_chain_would_without_its_entries() -> None:
    m = 2
    full = _bound_chain(m, _default_kernel(m, fold=True))
    glu = tuple(shapes.GLU_GEMV_OPS)
    assert {s.op for s in full.fused["tuned_fused"]} & set(glu)  # SiLU-and-mul goes into gate_up's epilogue
    chain = chain_mod.Chain(chain_mod.chain_steps(_spec()), m, CPU)
    fns = chain_mod.vendor_elementwise(CPU)
    chain.build("tuned_fused", fns, lambda step: False,
                chain_mod.excluding(_default_kernel(m, fold=True), frozenset(glu)))
    without = _bound_chain(m, _default_kernel(m, skip=glu, fold=True))  # no GLU entry in the tables at all
    assert _fused_names(chain) == _fused_names(without) and not {s.op for s in chain.fused["tuned_fused"]} & set(glu)
    assert chain.kinds["tuned_fused"] == without.kinds["tuned_fused"] != full.kinds["tuned_fused"]
