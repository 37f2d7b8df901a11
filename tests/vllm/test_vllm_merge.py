"""Sibling linears joined and folded in real vLLM 0.33 on the CPU (run in the vLLM virtualenv).

Two decoder layers of vLLM's own layers (RMSNorm, ReplicatedLinear, SiluAndMul) named as vLLM's
Qwen3.5 ones: the input norm feeds a module named as vLLM's Gated DeltaNet, whose in_proj_qkvz and
in_proj_ba read the same x (a stand-in core between them and out_proj). Compiled by vLLM's Inductor
path with the plugin's compile ranges, after the plugin's load hook. What is checked: with the tables'
``rms_gemv`` entry at the joined shape only (what ``tunekit search --ops rms_gemv`` lists now), the
fold is priced joined and the two weights become one tensor; the range the tables serve runs one
``rms_gemv`` at the joined shape per layer and nothing per sibling; the result stays as close to the
fp32 model as vLLM's own compile of the unfolded one. With the merge switched off, those input norms
are not folded (no entry serves their consumers apart).
"""

from __future__ import annotations

from pathlib import Path

import test_vllm_fold as fold_tests
import test_vllm_plugin as base
import torch
from test_vllm_plugin import _entry, _impls
from torch import nn

from tunekit.integrations.vllm import compile as vllm_compile
from tunekit.integrations.vllm import load as vllm_load

plugin, _fresh_ops, compile_ranges = base.plugin, base._fresh_ops, fold_tests.compile_ranges

H, INTER, QKVZ, BA = fold_tests.H, fold_tests.INTER, 80, 8


class QwenGatedDeltaNetAttention(nn.Module):  # named as vLLM's: the projections its layer runs, a stand-in core
    def __init__(self) -> None:
        super().__init__()
        linear = fold_tests._linear
        self.in_proj_qkvz, self.in_proj_ba, self.out_proj = linear(H, QKVZ), linear(H, BA), linear(QKVZ // 2, H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mixed_qkvz, _ = self.in_proj_qkvz(h)
        ba, _ = self.in_proj_ba(h)
        qkv, z = mixed_qkvz.split([QKVZ // 2, QKVZ // 2], dim=-1)
        b, a = ba.chunk(2, dim=-1)
        core = torch.tanh(qkv) * torch.sigmoid(z) * (b.sum(-1, keepdim=True) - a.sum(-1, keepdim=True))
        return self.out_proj(core)[0]


def _model_class() -> type:
    return fold_tests._model_class(QwenGatedDeltaNetAttention)


def _entries() -> list[dict]:
    from tunekit.backends import get
    from tunekit.problems.shapes import Problem

    def tuned(op: str, n: int, k: int) -> dict:
        return _entry(op, 4, n, k, params=get("triton").space(Problem(op, "bf16", 4, n, k)).default)

    ew = [_entry(op, 4, n, k, backend="serving_backend:BACKEND", params={})
          for op, n, k in (("rms_norm", H, H), ("fused_add_rms_norm", H, H), ("silu_and_mul", INTER, 2 * INTER))]
    gemvs = [tuned("gemv", n, k) for n, k in ((QKVZ, H), (BA, H), (H, QKVZ // 2), (2 * INTER, H), (H, INTER))]
    folds = [tuned("rms_gemv", n, k) for n, k in ((QKVZ + BA, H), (2 * INTER, H))]  # joined siblings only
    adds = [tuned("gemv_add", n, k) for n, k in ((H, QKVZ // 2), (H, INTER))]
    return ew + gemvs + folds + adds


def _gdn_reference(w: dict, normed: torch.Tensor) -> torch.Tensor:
    qkvz, ba = normed @ w["linear_attn.in_proj_qkvz.weight"].T, normed @ w["linear_attn.in_proj_ba.weight"].T
    core = torch.tanh(qkvz[:, :QKVZ // 2]) * torch.sigmoid(qkvz[:, QKVZ // 2:]) * (
        ba[:, :BA // 2].sum(-1, keepdim=True) - ba[:, BA // 2:].sum(-1, keepdim=True))
    return core @ w["linear_attn.out_proj.weight"].T


def _load(plugin, monkeypatch, model: nn.Module, merge: bool) -> nn.Module:
    from tunekit.integrations.vllm import merge as vllm_merge

    vllm_merge.JOINED.clear()
    monkeypatch.setenv("TUNEKIT_MERGE_SIBLINGS", "1" if merge else "0")
    vllm_compile.RANGE_MERGES.clear()
    return fold_tests._load_folded(plugin, monkeypatch, model)


def _init(model: nn.Module) -> dict:
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        p.data.normal_(1.0 if name.endswith("layernorm.weight") or name == "norm.weight" else 0.0, 0.15)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_folded_siblings_run_as_one_rms_gemv_on_their_joined_weight(plugin, compile_ranges, monkeypatch,
                                                                     tmp_path: Path) -> None:
    from vllm.config import set_current_vllm_config

    from tunekit import ops
    from tunekit.dispatch.fused_gemv import joined_rows

    config = compile_ranges(_entries())
    ranges = config.compilation_config.get_compile_ranges()
    Model = _model_class()
    xs = {m: torch.randn(m, H, generator=torch.Generator().manual_seed(m)).bfloat16() for m in (3, 7)}
    with set_current_vllm_config(config):
        model = Model(vllm_config=config)
        state = _init(model)
        assert _load(plugin, monkeypatch, model, merge=True) is model
        assert vllm_load.FOLDS == {"rms_norm folded": 4}, vllm_load.FOLDS
        assert vllm_load.MERGES == {"in_proj_qkvz+in_proj_ba joined": 2}, vllm_load.MERGES
        got = {m: model(x) for m, x in xs.items()}
        impls = _impls()
        merges = dict(vllm_compile.RANGE_MERGES)
        ops.load_tables([])
        monkeypatch.delenv("TUNEKIT_FOLD_NORMS")
        plain = Model(vllm_config=config)
        plain.load_state_dict(state)
        want = {m: plain(x) for m, x in xs.items()}

    for layer in model.layers:
        gdn = layer.linear_attn
        assert joined_rows([gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight]) is not None
    # both layers' sibling pairs rewritten in the range the tables serve, none above it
    assert merges == {str(ranges[0]): 2}, merges
    rms = {(shape, m, impl) for op, shape, m, impl in impls if op == "rms_gemv"}
    assert rms == {(f"{QKVZ + BA}x{H}", 3, "tuned:triton"), (f"{2 * INTER}x{H}", 3, "tuned:triton")}, rms
    assert not [c for c in impls if c[0] == "sibling_gemv"], impls  # no layout lost: nothing per sibling
    assert not [c for c in impls if c[2] == 7], impls  # above the tables: vLLM's own math
    for m, x in xs.items():
        ref = fold_tests._reference(state, x, _gdn_reference)
        err = (got[m].float() - ref).abs().max().item()
        plain_err = (want[m].float() - ref).abs().max().item()
        assert err <= 2 * plain_err, (m, err, plain_err)


def test_without_the_merge_those_norms_stay_unfolded(plugin, compile_ranges, monkeypatch) -> None:
    from vllm.config import set_current_vllm_config

    config = compile_ranges(_entries())
    with set_current_vllm_config(config):
        model = _model_class()(vllm_config=config)
    state = _init(model)
    _load(plugin, monkeypatch, model, merge=False)
    # only the MLP norms: the siblings' rms_gemv entry is the joined one, and nothing joins them
    assert vllm_load.FOLDS == {"rms_norm (fold not in the tables or not paying)": 2,
                               "rms_norm folded": 2}, vllm_load.FOLDS
    assert vllm_load.MERGES == {}
    gdn = model.layers[0].linear_attn
    assert torch.equal(gdn.in_proj_qkvz.weight, state["layers.0.linear_attn.in_proj_qkvz.weight"])
    done, why = vllm_load.install_merge()
    assert not done and "TUNEKIT_MERGE_SIBLINGS" in why
