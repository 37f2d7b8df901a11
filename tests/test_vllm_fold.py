"""tunekit.integrations.vllm.fold without vLLM: which decoder norms fold, what a fold writes.

Stand-in modules carry the names and attributes the fold reads from vLLM's
(a decoder layer's class name, the plugin's ``TunekitRMSNorm`` /
``TunekitGemmaRMSNorm``, ``quant_method`` of class ``UnquantizedLinearMethod``);
the real classes and vLLM's compile path are in tests/vllm/test_vllm_fold.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_ops import make_table, timed_entry
from torch import nn

from tunekit import ops
from tunekit.integrations.vllm import fold as vllm_fold
from tunekit.integrations.vllm import marks

pytestmark = pytest.mark.usefixtures("clean_ops")

H, N_QKVZ, N_BA, N_GU = 32, 48, 8, 64


class UnquantizedLinearMethod:  # the name the fold checks
    pass


class OtherMethod:  # a quantized linear's method
    pass


class Linear(nn.Module):
    def __init__(self, n: int, k: int, method: type = UnquantizedLinearMethod) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, k).bfloat16(), requires_grad=False)
        self.quant_method = method()


class TunekitGemmaRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.randn(width) * 0.2).bfloat16(), requires_grad=False)
        self.variance_epsilon = eps


class TunekitRMSNorm(TunekitGemmaRMSNorm):
    pass


def _layer(name: str, *, ba: bool = True, method: type = UnquantizedLinearMethod, norm=TunekitGemmaRMSNorm):
    """A decoder layer named ``name`` with Gated DeltaNet input projections and a dense MLP."""
    layer = type(name, (nn.Module,), {})()
    layer.input_layernorm, layer.post_attention_layernorm = norm(H), norm(H, eps=1e-5)
    layer.linear_attn, layer.mlp = nn.Module(), nn.Module()
    layer.linear_attn.in_proj_qkvz = Linear(N_QKVZ, H, method)
    if ba:
        layer.linear_attn.in_proj_ba = Linear(N_BA, H)
    layer.mlp.gate_up_proj = Linear(N_GU, H)
    return layer


def _everything(module: nn.Module) -> bool:
    return True


def test_the_plan_takes_a_norm_only_with_every_reader_known_and_routed() -> None:
    model = nn.ModuleList([_layer("Qwen3_5DecoderLayer"), _layer("Qwen3_5DecoderLayer", ba=False),
                           _layer("Qwen3_5DecoderLayer", method=OtherMethod), _layer("SomeOtherDecoderLayer")])
    plan = {(id(norm), op, eps): [id(c) for c in consumers]
            for norm, op, eps, consumers in vllm_fold.fold_plan(model, _everything)}
    full, no_ba, quantized, _ = model
    assert plan == {
        (id(full.input_layernorm), "gemma_rms_norm", 1e-6): [id(full.linear_attn.in_proj_qkvz),
                                                             id(full.linear_attn.in_proj_ba)],
        (id(full.post_attention_layernorm), "gemma_rms_norm", 1e-5): [id(full.mlp.gate_up_proj)],
        # in_proj_ba missing: some reader of the input norm is unknown, so only the MLP's norm folds
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
    layer = _layer("Qwen3_5DecoderLayer", norm=norm)
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
    layer = _layer("Qwen3_5DecoderLayer")
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    _tables(tmp_path, rms_gemv_us=0.9)  # 1.8 us for qkvz + ba against 0.5 + 1.2: not paying
    counts = vllm_fold.fold_model(nn.ModuleList([layer]), _everything)
    assert counts == {"gemma_rms_norm (fold not in the tables or not paying)": 1, "gemma_rms_norm folded": 1}
    assert torch.equal(layer.linear_attn.in_proj_qkvz.weight, state["linear_attn.in_proj_qkvz.weight"])
    assert not getattr(layer.input_layernorm, marks.FOLDED, False)
    assert getattr(layer.post_attention_layernorm, marks.FOLDED)  # one consumer: 0.9 < 0.5 + 0.6
    ops.load_tables([])
    fresh = _layer("Qwen3_5DecoderLayer")
    assert vllm_fold.fold_model(nn.ModuleList([fresh]), _everything) == {
        "gemma_rms_norm (fold not in the tables or not paying)": 2}


def test_the_folded_norm_passes_x_on_or_returns_the_residual_sum_twice() -> None:
    x, r = torch.randn(3, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    assert vllm_fold.folded_norm_forward(x) is x
    summed, residual = vllm_fold.folded_norm_forward(x, r)
    assert summed is residual and torch.equal(summed, x + r)
