"""tunekit.integrations.vllm.fold without vLLM: which decoder norms fold, what a fold writes.

Stand-in modules carry the structure and attributes the fold reads from vLLM's
(a decoder layer's forward, as vLLM's Qwen3.5 one calls its norms, in a
``ModuleList``; the plugin's ``TunekitRMSNorm`` / ``TunekitGemmaRMSNorm``;
linears deriving from a ``LinearBase``, ``quant_method`` of class
``UnquantizedLinearMethod``);
the real classes and vLLM's compile path are in tests/vllm/test_vllm_fold.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_ops import make_table, timed_entry
from torch import nn

from tunekit import ops
from tunekit.integrations import fold_check
from tunekit.integrations.vllm import fold as vllm_fold
from tunekit.integrations.vllm import marks

pytestmark = pytest.mark.usefixtures("clean_ops")

H, N_QKVZ, N_BA, N_GU = 32, 48, 8, 64


class UnquantizedLinearMethod:  # the name the fold checks
    pass


class OtherMethod:  # a quantized linear's method
    pass


class LinearBase(nn.Module):  # the base the finder knows vLLM's linears by
    pass


class Linear(LinearBase):
    def __init__(self, n: int, k: int, method: type = UnquantizedLinearMethod) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, k).bfloat16(), requires_grad=False)
        self.quant_method = method()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.T, None


class TunekitGemmaRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.randn(width) * 0.2).bfloat16(), requires_grad=False)
        self.variance_epsilon = eps


class TunekitRMSNorm(TunekitGemmaRMSNorm):
    pass


class GatedDeltaNet(nn.Module):  # its input projections, as vLLM's forward_cuda reads the input
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.size(0)
        qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        return (qkvz[:num_tokens, :H] + ba.sum(-1, keepdim=True)).to(hidden_states.dtype)


class MLP(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        return gate_up[:, :H]


class DecoderLayer(nn.Module):  # as vLLM's Qwen3.5 layer calls its norms
    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.linear_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def _layer(*, ba: bool = True, method: type = UnquantizedLinearMethod, norm=TunekitGemmaRMSNorm):
    """A decoder layer with Gated DeltaNet input projections and a dense MLP."""
    layer = DecoderLayer()
    layer.input_layernorm, layer.post_attention_layernorm = norm(H), norm(H, eps=1e-5)
    layer.linear_attn, layer.mlp = GatedDeltaNet(), MLP()
    layer.linear_attn.in_proj_qkvz = Linear(N_QKVZ, H, method)
    if ba:
        layer.linear_attn.in_proj_ba = Linear(N_BA, H)
    layer.mlp.gate_up_proj = Linear(N_GU, H)
    return layer


def _everything(module: nn.Module) -> bool:
    return True


def test_the_plan_takes_a_norm_only_with_every_reader_known_and_routed() -> None:
    model = nn.ModuleList([_layer(), _layer(ba=False), _layer(method=OtherMethod)])
    plan = {(id(norm), op, eps): [id(c) for c in consumers]
            for norm, op, eps, consumers in vllm_fold.fold_plan(model, _everything)}
    full, no_ba, quantized = model
    assert plan == {
        (id(full.input_layernorm), "gemma_rms_norm", 1e-6): [id(full.linear_attn.in_proj_qkvz),
                                                             id(full.linear_attn.in_proj_ba)],
        (id(full.post_attention_layernorm), "gemma_rms_norm", 1e-5): [id(full.mlp.gate_up_proj)],
        # in_proj_ba missing: the forward calls what the layer lacks, so only the MLP's norm folds
        (id(no_ba.post_attention_layernorm), "gemma_rms_norm", 1e-5): [id(no_ba.mlp.gate_up_proj)],
        (id(quantized.post_attention_layernorm), "gemma_rms_norm", 1e-5): [id(quantized.mlp.gate_up_proj)],
    }
    # a module whose forward / GEMM is not tunekit's route would ignore the marks: never folded
    assert vllm_fold.fold_plan(model, lambda m: not isinstance(m, TunekitGemmaRMSNorm)) == []
    assert vllm_fold.fold_plan(model, lambda m: not isinstance(m, Linear) or m is not full.mlp.gate_up_proj) == [
        p for p in vllm_fold.fold_plan(model, _everything) if p[0] is not full.post_attention_layernorm]


def _tables(tmp_path: Path, rms_gemv_us: float, norm_op: str = "gemma_fused_add_rms_norm") -> None:
    # every entry beats its 2 us baseline (a table keeps winners only)
    rows = [timed_entry(norm_op, H, H, 0.5)]
    rows += [timed_entry("gemv", n, H, 0.6) for n in (N_QKVZ, N_BA, N_GU)]
    rows += [timed_entry("rms_gemv", n, H, rms_gemv_us) for n in (N_QKVZ, N_BA, N_GU)]
    ops.load_tables(str(make_table(tmp_path / "t.json", rows)))


@pytest.mark.parametrize(("norm", "scale"), [(TunekitGemmaRMSNorm, lambda g: 1.0 + g), (TunekitRMSNorm, lambda g: g)])
def test_a_fold_that_pays_rescales_the_consumers_once_and_marks_both_sides(tmp_path: Path, norm, scale) -> None:
    torch.manual_seed(0)
    layer = _layer(norm=norm)
    g = layer.input_layernorm.weight.float()
    before = {n: layer.get_submodule(n).weight.clone() for n in ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba")}
    op = "gemma_rms_norm" if norm is TunekitGemmaRMSNorm else "rms_norm"
    # two consumers: 1.3 us against a 0.5 us norm (its fused-add form, the convention's) + 1.2 us of GEMVs
    _tables(tmp_path, 0.65, "gemma_fused_add_rms_norm" if op == "gemma_rms_norm" else "fused_add_rms_norm")
    counts = vllm_fold.fold_model(nn.ModuleList([layer]), _everything)
    assert counts == {f"{op} folded": 2}  # the MLP's norm too: 0.65 us against 0.5 + 0.6
    for name, w in before.items():
        c = layer.get_submodule(name)
        assert torch.equal(c.weight, (w.float() * scale(g)).bfloat16())  # fp32 product, rounded once
        assert getattr(c, marks.FOLD_EPS) == 1e-6
    assert getattr(layer.input_layernorm, marks.FOLDED) is True
    # a second plan finds nothing left to fold for that norm
    assert all(n is not layer.input_layernorm for n, *_ in vllm_fold.fold_plan(nn.ModuleList([layer]), _everything))


def test_a_fold_the_tables_do_not_pay_for_changes_nothing(tmp_path: Path) -> None:
    layer = _layer()
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    _tables(tmp_path, rms_gemv_us=0.9)  # 1.8 us for qkvz + ba against 0.5 + 1.2: not paying
    counts = vllm_fold.fold_model(nn.ModuleList([layer]), _everything)
    assert counts == {"gemma_rms_norm (fold not in the tables or not paying)": 1, "gemma_rms_norm folded": 1}
    assert torch.equal(layer.linear_attn.in_proj_qkvz.weight, state["linear_attn.in_proj_qkvz.weight"])
    assert not getattr(layer.input_layernorm, marks.FOLDED, False)
    assert getattr(layer.post_attention_layernorm, marks.FOLDED)  # one consumer: 0.9 < 0.5 + 0.6
    ops.load_tables([])
    fresh = _layer()
    assert vllm_fold.fold_model(nn.ModuleList([fresh]), _everything) == {
        "gemma_rms_norm (fold not in the tables or not paying)": 2}


def test_the_folded_norm_passes_x_on_or_returns_the_residual_sum_twice() -> None:
    x, r = torch.randn(3, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    assert vllm_fold.folded_norm_forward(x) is x
    summed, residual = vllm_fold.folded_norm_forward(x, r)
    assert summed is residual and torch.equal(summed, x + r)


# ----------------------------------------------------------------------------- the check at load


def _realistic(layer: nn.Module, seed: int = 1) -> None:
    """Norm gains as checkpoints have them (scale 1 + g: most near 1, some above 10, some near 0, one 0) and
    weights at the GEMV's scale."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        if name.endswith("layernorm.weight"):
            scale = 1.0 + 0.3 * torch.randn(p.shape, generator=gen)
            scale[:4] = torch.tensor([12.0, 25.0, 1e-3, 0.0])
            p.data.copy_(scale - 1.0)  # Gemma's zero-centred convention: the layer holds g, the scale is 1 + g
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)


def _fold_tables(tmp_path: Path, backend: str = "triton") -> None:
    rows = [timed_entry("gemma_fused_add_rms_norm", H, H, 0.5)]
    rows += [timed_entry("gemv", n, H, 0.6) for n in (N_QKVZ, N_BA, N_GU)]
    rows += [dict(timed_entry("rms_gemv", n, H, 0.4), backend=backend) for n in (N_QKVZ, N_BA, N_GU)]
    ops.load_tables(str(make_table(tmp_path / f"{backend.replace(':', '-')}.json", rows)))


def test_folds_under_realistic_gains_and_outlier_activations_pass_their_check(tmp_path: Path) -> None:
    layer = _layer()
    _realistic(layer)
    _fold_tables(tmp_path)
    report = vllm_fold.FoldReport()
    counts = vllm_fold.fold_model(nn.ModuleList([layer]), _everything, report=report)
    assert counts == {"gemma_rms_norm folded": 2}, report.failed
    assert report.checked == 2 and report.failed == [] and report.seconds > 0
    assert [p.name for p in report.folded] == ["0.input_layernorm", "0.post_attention_layernorm"]
    # what was checked is what serves: rms_gemv on the folded weight within the bound of the unfolded math
    plan = report.folded[0]
    x = fold_check.activations(2, H, torch.bfloat16, torch.device("cpu"), 5)
    scale = fold_check.fold_scale(plan.norm.weight, "gemma_rms_norm")
    raw = layer.linear_attn.in_proj_qkvz.weight.float() / scale.where(scale != 0, torch.ones(()))
    y = torch.ops.tunekit.rms_gemv(x, layer.linear_attn.in_proj_qkvz.weight, 1e-6)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * scale) @ raw.T
    assert (y.float() - want).abs().max() < 0.05 * want.abs().max()


def test_a_broken_rms_gemv_kernel_is_caught_at_load_and_the_layer_stays_unfolded(tmp_path: Path) -> None:
    layer = _layer()
    _realistic(layer)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    _fold_tables(tmp_path, "fault_backend:WRONG")
    report = vllm_fold.FoldReport()
    counts = vllm_fold.fold_model(nn.ModuleList([layer]), _everything, report=report)
    assert counts == {"gemma_rms_norm (kept unfolded: failed the check)": 2}
    assert [(name, op) for name, op, _ in report.failed] == [("0.input_layernorm", "gemma_rms_norm"),
                                                            ("0.post_attention_layernorm", "gemma_rms_norm")]
    result = report.failed[0][2]
    assert not result.ok and result.ratio > 1 and result.error > result.bound > 0 and result.unfolded_ratio <= 1
    assert "bound" in result.describe()
    # weights untouched, no mark: the layer runs as it was
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())
    assert not any(getattr(m, marks.FOLDED, False) or getattr(m, marks.FOLD_EPS, None) for m in layer.modules())
    assert ops.dispatch_stats() == []  # the check's calls are not service calls


def test_a_fold_corrupted_on_purpose_is_caught_at_load(tmp_path: Path, monkeypatch) -> None:
    layer = _layer()
    _realistic(layer)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    _fold_tables(tmp_path)
    folded_weights = vllm_fold.folded_weights

    def corrupted(op, gain, consumers):  # the gain multiplied in wrong by 1.5
        return folded_weights(op, (1.0 + gain.float()) * 1.5 - 1.0, consumers)

    monkeypatch.setattr(vllm_fold, "folded_weights", corrupted)
    counts = vllm_fold.fold_model(nn.ModuleList([layer]), _everything)
    assert counts == {"gemma_rms_norm (kept unfolded: failed the check)": 2}
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())


def test_norms_without_a_safe_fold_are_counted_with_the_reason(tmp_path: Path) -> None:
    class MergedColumnParallelLinearWithLoRA(nn.Module):
        def __init__(self, base: nn.Module) -> None:
            super().__init__()
            self.base_layer = base

    class TappedMLP(MLP):  # the normed input also gates the output: a non-linear reads it
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate_up, _ = self.gate_up_proj(x)
            return gate_up[:, :H] * torch.sigmoid(x)

    namespace: dict = {}  # a forward compiled from a string: no source to read
    exec("def forward(self, hidden_states):\n    return self.in_proj_qkvz(hidden_states)[0]", namespace)

    tapped = _layer()
    tapped.mlp = TappedMLP()
    tapped.mlp.gate_up_proj = Linear(N_GU, H)
    lora = _layer()
    lora.mlp.gate_up_proj = MergedColumnParallelLinearWithLoRA(lora.mlp.gate_up_proj)
    hidden = _layer()
    hidden.linear_attn.__class__ = type("NoSourceMixer", (GatedDeltaNet,), {"forward": namespace["forward"]})
    quantized = _layer(method=OtherMethod)
    model = nn.ModuleList([tapped, lora, hidden, quantized])
    plans, skipped = vllm_fold.survey(model, _everything)
    assert {(name, why.split(" (")[0]) for name, _, why in skipped} == {
        ("0.post_attention_layernorm", "read by a non-linear"), ("1.post_attention_layernorm", "LoRA"),
        ("2.input_layernorm", "read by a module without source"), ("3.input_layernorm", "quantized consumer")}
    assert [p.name for p in plans] == ["0.input_layernorm", "1.input_layernorm", "2.post_attention_layernorm",
                                       "3.post_attention_layernorm"]
    reasons = {n: w for n, _, w in skipped}
    assert "OtherMethod" in reasons["3.input_layernorm"] and "torch.sigmoid(x)" in reasons["0.post_attention_layernorm"]
    # an engine with LoRA adapters (vLLM wraps the linears after loading): nothing folds
    plans, skipped = vllm_fold.survey(nn.ModuleList([_layer()]), _everything, lora=True)
    assert plans == [] and {why.split(" (")[0] for *_, why in skipped} == {"LoRA"}
    _fold_tables(tmp_path)
    report = vllm_fold.FoldReport()
    counts = vllm_fold.fold_model(model, _everything, report=report)
    assert counts == {"gemma_rms_norm (not folded: read by a non-linear)": 1, "gemma_rms_norm (not folded: LoRA)": 1,
                      "gemma_rms_norm (not folded: read by a module without source)": 1,
                      "gemma_rms_norm (not folded: quantized consumer)": 1, "gemma_rms_norm folded": 4}
    assert len(report.not_folded) == 4 and report.checked == 4


# ----------------------------------------------------------------------------- weights written later


def _folded_layer(tmp_path: Path) -> tuple[nn.Module, nn.Module]:
    from tunekit.integrations.vllm import refold

    layer = _layer()
    _realistic(layer)
    model = nn.ModuleList([layer])
    _fold_tables(tmp_path)
    report = vllm_fold.FoldReport()
    vllm_fold.fold_model(model, _everything, report=report)
    assert len(report.folded) == 2
    refold.register(model, report.folded, [])
    return model, layer


def _folded_from(raw: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (raw.float() * (1.0 + g.float())).bfloat16()


def test_row_prints_see_any_one_element_change() -> None:
    from tunekit.integrations.vllm.refold import row_prints

    w = torch.randn(6, 40).bfloat16()
    prints = row_prints(w)
    for row, col in ((0, 0), (3, 17), (5, 39)):
        changed = w.clone()
        changed.view(torch.int16)[row, col] += 1  # one ulp
        assert torch.nonzero(row_prints(changed) != prints).flatten().tolist() == [row]
    assert torch.equal(row_prints(w.clone()), prints)


def test_weights_written_after_the_fold_are_folded_again_exactly(tmp_path: Path) -> None:
    from tunekit.integrations.vllm import refold

    model, layer = _folded_layer(tmp_path)
    qkvz, norm = layer.linear_attn.in_proj_qkvz, layer.input_layernorm
    gen = torch.Generator().manual_seed(9)
    # a whole write (reload, refit): raw weights and a new gain
    new_raw = (torch.randn(N_QKVZ, H, generator=gen) * H**-0.5).bfloat16()
    new_ba = (torch.randn(N_BA, H, generator=gen) * H**-0.5).bfloat16()
    new_g = (torch.randn(H, generator=gen) * 0.5).bfloat16()
    qkvz.weight.data.copy_(new_raw)
    layer.linear_attn.in_proj_ba.weight.data.copy_(new_ba)
    norm.weight.data.copy_(new_g)
    assert refold.resync(model, "a test write") == {"gemma_rms_norm folded again": 1}
    assert torch.equal(qkvz.weight, _folded_from(new_raw, new_g))
    assert torch.equal(layer.linear_attn.in_proj_ba.weight, _folded_from(new_ba, new_g))
    assert refold.resync(model, "nothing written") == {}
    # some rows written (one shard of a merged weight): those rows folded, the others as they were
    before = qkvz.weight.detach().clone()
    part = (torch.randn(8, H, generator=gen) * H**-0.5).bfloat16()
    qkvz.weight.data[8:16] = part
    assert refold.resync(model, "a shard") == {"gemma_rms_norm folded again": 1}
    want = before.clone()
    want[8:16] = _folded_from(part, new_g)
    assert torch.equal(qkvz.weight, want)


def test_a_gain_written_alone_rescales_its_consumers_within_one_rounding(tmp_path: Path) -> None:
    from tunekit.integrations.vllm import refold

    model, layer = _folded_layer(tmp_path)
    mlp_norm, gate_up = layer.post_attention_layernorm, layer.mlp.gate_up_proj
    g_old = mlp_norm.weight.detach().clone()
    scale_old = 1.0 + g_old.float()
    kept = scale_old != 0
    raw = gate_up.weight.float()[:, kept] / scale_old[kept]
    g_new = (g_old.float() * 0.5).bfloat16()
    mlp_norm.weight.data.copy_(g_new)
    assert refold.resync(model, "a gain") == {"gemma_rms_norm folded again (partly rescaled)": 1}
    exact = raw * (1.0 + g_new.float())[kept]
    rel = (gate_up.weight.float()[:, kept] - exact).abs() / exact.abs().clamp_min(1e-30)
    assert rel.max() <= 2 * 2**-8  # two roundings, not one: the raw weights were gone


def test_a_write_that_fails_its_check_refuses_the_kernel_and_serves_the_fallback(tmp_path: Path, caplog) -> None:
    from tunekit.integrations.vllm import refold

    model, layer = _folded_layer(tmp_path)
    _fold_tables(tmp_path, "fault_backend:WRONG")  # the kernel serving rms_gemv breaks
    gate_up = layer.mlp.gate_up_proj
    new_raw = (torch.randn(N_GU, H, generator=torch.Generator().manual_seed(3)) * H**-0.5).bfloat16()
    gate_up.weight.data.copy_(new_raw)
    with caplog.at_level("ERROR", logger="vllm.tunekit"):
        assert refold.resync(model, "a refit") == {"gemma_rms_norm refused at reload": 1,
                                                   "gemma_rms_norm folded again": 1}
    assert "post_attention_layernorm" in caplog.text and "fallback" in caplog.text and "passes" in caplog.text
    g = layer.post_attention_layernorm.weight
    assert torch.equal(gate_up.weight, _folded_from(new_raw, g))
    x = fold_check.activations(1, H, torch.bfloat16, torch.device("cpu"), 4)
    y = torch.ops.tunekit.rms_gemv(x, gate_up.weight, 1e-6)
    assert {r["impl"] for r in ops.dispatch_stats() if r["op"] == "rms_gemv"} == {"fallback:kernel_error"}
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + g.float())) @ new_raw.float().T
    assert (y.float() - want).abs().max() < 0.05 * want.abs().max()


def test_a_load_weights_call_is_a_write_boundary_and_nested_calls_wait_for_the_outermost(tmp_path: Path) -> None:
    from tunekit.integrations.vllm import refold

    model, layer = _folded_layer(tmp_path)
    gen = torch.Generator().manual_seed(11)
    seen = []

    def load_weights(weights):
        for name, value in weights:
            model.get_parameter(name).data.copy_(value)
            seen.append(torch.equal(layer.mlp.gate_up_proj.weight, value))  # raw until the call returns
        return {name for name, _ in weights}

    model.load_weights = load_weights
    refold.register(model, [r.plan for r in refold.MODELS[model][0]], [])
    new = (torch.randn(N_GU, H, generator=gen) * H**-0.5).bfloat16()
    written = model.load_weights([("0.mlp.gate_up_proj.weight", new)])
    assert written == {"0.mlp.gate_up_proj.weight"} and seen == [True]
    assert torch.equal(layer.mlp.gate_up_proj.weight, _folded_from(new, layer.post_attention_layernorm.weight))
    # inside an outer write (reload_weights) the fold waits for the outer one's end
    outer = refold._boundary(lambda: model.load_weights([("0.mlp.gate_up_proj.weight", new * 2)]), "outer")
    refold._WRITES["depth"] += 1
    try:
        model.load_weights([("0.mlp.gate_up_proj.weight", new * 3)])
        assert torch.equal(layer.mlp.gate_up_proj.weight, new * 3)  # not folded yet
    finally:
        refold._WRITES["depth"] -= 1
    outer()
    assert torch.equal(layer.mlp.gate_up_proj.weight, _folded_from(new * 2, layer.post_attention_layernorm.weight))
