"""tunekit.integrations.vllm.merge without vLLM: which sibling linears join, what a join writes, and
the fold priced on the joined GEMV.

Stand-ins as tests/test_vllm_fold.py's (a module class named as vLLM's Gated DeltaNet, linears with an
``UnquantizedLinearMethod``); vLLM's own layers under its compile path are in tests/vllm/.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_ops import make_table, timed_entry
from test_vllm_fold import (
    MLP,
    N_BA,
    N_GU,
    N_QKVZ,
    DecoderLayer,
    GatedDeltaNet,
    H,
    Linear,
    OtherMethod,
    TunekitGemmaRMSNorm,
)
from torch import nn

from tunekit import ops
from tunekit.dispatch.fused_gemv import joined_rows
from tunekit.integrations.vllm import fold as vllm_fold
from tunekit.integrations.vllm import marks
from tunekit.integrations.vllm import merge as vllm_merge

pytestmark = pytest.mark.usefixtures("clean_ops")


@pytest.fixture(autouse=True)
def _no_joined_layouts():
    vllm_merge.JOINED.clear()
    yield
    vllm_merge.JOINED.clear()


def _gdn(name: str = "QwenGatedDeltaNetAttention", method: type | None = None) -> nn.Module:
    gdn = type(name, (GatedDeltaNet,), {})()  # the merge knows its siblings by the class's name
    gdn.in_proj_qkvz = Linear(N_QKVZ, H) if method is None else Linear(N_QKVZ, H, method)
    gdn.in_proj_ba = Linear(N_BA, H)
    return gdn


def _layer() -> nn.Module:
    """A Qwen3.5 linear-attention decoder layer: its input norm feeds the Gated DeltaNet's two linears."""
    layer = DecoderLayer()
    layer.input_layernorm, layer.post_attention_layernorm = TunekitGemmaRMSNorm(H), TunekitGemmaRMSNorm(H, 1e-5)
    layer.linear_attn, layer.mlp = _gdn(), MLP()
    layer.mlp.gate_up_proj = Linear(N_GU, H)
    return layer


def _everything(module: nn.Module) -> bool:
    return True


def _tables(tmp_path: Path, rows: list[dict]) -> None:
    ops.load_tables(str(make_table(tmp_path / "t.json", rows)))


def test_the_plan_takes_a_group_only_when_every_linear_is_plain_and_routed() -> None:
    plain, quantized, other = _gdn(), _gdn(method=OtherMethod), _gdn("SomeAttention")
    biased = _gdn()
    biased.in_proj_ba.bias = nn.Parameter(torch.zeros(N_BA), requires_grad=False)
    folded_one = _gdn()
    setattr(folded_one.in_proj_qkvz, marks.FOLD_EPS, 1e-6)  # one folded, one not: two different GEMVs
    folded_both = _gdn()
    for c in (folded_both.in_proj_qkvz, folded_both.in_proj_ba):
        setattr(c, marks.FOLD_EPS, 1e-6)
    model = nn.ModuleList([plain, quantized, other, biased, folded_one, folded_both])
    plan = [(op, names, [id(c) for c in linears]) for op, names, linears in vllm_merge.merge_plan(model, _everything)]
    assert plan == [("gemv", "in_proj_qkvz+in_proj_ba", [id(plain.in_proj_qkvz), id(plain.in_proj_ba)]),
                    ("rms_gemv", "in_proj_qkvz+in_proj_ba", [id(folded_both.in_proj_qkvz),
                                                             id(folded_both.in_proj_ba)])]
    # a linear whose GEMM is not tunekit's route would never see the joined op
    assert vllm_merge.merge_plan(model, lambda m: m is not plain.in_proj_ba)[0][2][0] is folded_both.in_proj_qkvz


def test_a_join_that_pays_lays_the_weights_out_as_one_tensor_and_keeps_every_value(tmp_path: Path) -> None:
    model = nn.ModuleList([_gdn(), _gdn()])
    before = [(g.in_proj_qkvz.weight.clone(), g.in_proj_ba.weight.clone()) for g in model]
    # one 1.0 us GEMV against 0.6 + 0.6 us apart
    _tables(tmp_path, [timed_entry("gemv", n, H, 0.6) for n in (N_QKVZ, N_BA)]
            + [timed_entry("gemv", N_QKVZ + N_BA, H, 1.0)])
    assert vllm_merge.merge_model(model, _everything) == {"in_proj_qkvz+in_proj_ba joined": 2}
    assert vllm_merge.JOINED == {((N_QKVZ, N_BA), H)}
    for gdn, (qkvz, ba) in zip(model, before, strict=True):
        joined = joined_rows([gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight])
        assert joined is not None and joined.shape == (N_QKVZ + N_BA, H)
        assert torch.equal(joined, torch.cat([qkvz, ba])) and torch.equal(gdn.in_proj_ba.weight, ba)
    # each layer its own tensor
    assert model[0].in_proj_qkvz.weight.data_ptr() != model[1].in_proj_qkvz.weight.data_ptr()


@pytest.mark.parametrize("joined_us", [1.3, None])
def test_a_join_the_tables_do_not_pay_for_moves_nothing(tmp_path: Path, joined_us) -> None:
    gdn = _gdn()
    ptr = gdn.in_proj_ba.weight.data_ptr()
    rows = [timed_entry("gemv", n, H, 0.6) for n in (N_QKVZ, N_BA)]
    _tables(tmp_path, rows + ([timed_entry("gemv", N_QKVZ + N_BA, H, joined_us)] if joined_us else []))
    assert vllm_merge.merge_model(nn.ModuleList([gdn]), _everything) == {
        "in_proj_qkvz+in_proj_ba (not in the tables or not paying)": 1}
    assert gdn.in_proj_ba.weight.data_ptr() == ptr and vllm_merge.JOINED == set()
    assert joined_rows([gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight]) is None


def test_the_fold_is_priced_on_the_joined_gemv_and_the_merge_then_joins_it(tmp_path: Path) -> None:
    # the tables a search of rms_gemv now makes: the joined shape only (ModelSpec.rms_gemvs)
    _tables(tmp_path, [timed_entry("gemma_fused_add_rms_norm", H, H, 0.5)]
            + [timed_entry("gemv", n, H, 0.6) for n in (N_QKVZ, N_BA, N_GU)]
            + [timed_entry("rms_gemv", N_QKVZ + N_BA, H, 1.0), timed_entry("rms_gemv", N_GU, H, 0.65)])
    apart = _layer()
    assert vllm_fold.fold_model(nn.ModuleList([apart]), _everything) == {
        "gemma_rms_norm (fold not in the tables or not paying)": 1, "gemma_rms_norm folded": 1}
    layer = _layer()
    g = layer.input_layernorm.weight.float()
    qkvz = layer.linear_attn.in_proj_qkvz.weight.clone()
    # joined: 1.0 us against the norm's 0.5 + 0.6 + 0.6 us
    assert vllm_fold.fold_model(nn.ModuleList([layer]), _everything, join_siblings=True) == {
        "gemma_rms_norm folded": 2}
    assert vllm_merge.merge_model(nn.ModuleList([layer]), _everything) == {"in_proj_qkvz+in_proj_ba joined": 1}
    joined = joined_rows([layer.linear_attn.in_proj_qkvz.weight, layer.linear_attn.in_proj_ba.weight])
    assert joined is not None and torch.equal(joined[:N_QKVZ], (qkvz.float() * (1.0 + g)).bfloat16())
    # and the joined op serves both consumers with one rms_gemv at the joined shape
    x = torch.randn(1, H).bfloat16()
    ops.reset_stats()
    y = torch.ops.tunekit.sibling_gemv(x, [layer.linear_attn.in_proj_qkvz.weight,
                                           layer.linear_attn.in_proj_ba.weight], 1e-6)
    want = torch.ops.tunekit.rms_gemv(x, joined.clone(), 1e-6)
    assert torch.equal(y, want)
    shapes = {(r["op"], r["shape"]) for r in ops.dispatch_stats()}
    assert shapes == {("rms_gemv", f"{N_QKVZ + N_BA}x{H}")}, shapes
