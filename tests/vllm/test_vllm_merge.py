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

plugin, _fresh_ops, compile_ranges = base.plugin, base._fresh_ops, fold_tests.compile_ranges

H, INTER, QKVZ, BA = 64, 48, 80, 8


def _model_class() -> type:
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ReplicatedLinear

    def linear(k: int, n: int) -> nn.Module:
        return ReplicatedLinear(k, n, bias=False, params_dtype=torch.bfloat16)

    class QwenGatedDeltaNetAttention(nn.Module):  # the projections vLLM's layer runs, around a stand-in core
        def __init__(self) -> None:
            super().__init__()
            self.in_proj_qkvz, self.in_proj_ba, self.out_proj = linear(H, QKVZ), linear(H, BA), linear(QKVZ // 2, H)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            mixed_qkvz, _ = self.in_proj_qkvz(h)
            ba, _ = self.in_proj_ba(h)
            qkv, z = mixed_qkvz.split([QKVZ // 2, QKVZ // 2], dim=-1)
            b, a = ba.chunk(2, dim=-1)
            core = torch.tanh(qkv) * torch.sigmoid(z) * (b.sum(-1, keepdim=True) - a.sum(-1, keepdim=True))
            return self.out_proj(core)[0]

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj, self.down_proj, self.act = linear(H, 2 * INTER), linear(INTER, H), SiluAndMul()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act(self.gate_up_proj(h)[0]))[0]

    class Qwen3_5DecoderLayer(nn.Module):  # a linear-attention layer of vLLM's Qwen3.5, as it calls its norms
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)
            self.post_attention_layernorm = RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)
            self.linear_attn, self.mlp = QwenGatedDeltaNetAttention(), MLP()

        def forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            if residual is None:
                residual, h = h, self.input_layernorm(h)
            else:
                h, residual = self.input_layernorm(h, residual)
            h, residual = self.post_attention_layernorm(self.linear_attn(h), residual)
            return self.mlp(h), residual

    @support_torch_compile(dynamic_arg_dims={"x": 0})
    class Model(nn.Module):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__()
            self.layers = nn.ModuleList([Qwen3_5DecoderLayer(), Qwen3_5DecoderLayer()])
            self.norm = RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, residual = x, None
            for layer in self.layers:
                h, residual = layer(h, residual)
            return self.norm(h, residual)[0]

    return Model


def _entries() -> list[dict]:
    from tunekit.backends import get
    from tunekit.opspec import Problem

    def tuned(op: str, n: int, k: int) -> dict:
        return _entry(op, 4, n, k, params=get("triton").space(Problem(op, "bf16", 4, n, k)).default)

    ew = [_entry(op, 4, n, k, backend="serving_backend:BACKEND", params={})
          for op, n, k in (("rms_norm", H, H), ("fused_add_rms_norm", H, H), ("silu_and_mul", INTER, 2 * INTER))]
    gemvs = [tuned("gemv", n, k) for n, k in ((QKVZ, H), (BA, H), (H, QKVZ // 2), (2 * INTER, H), (H, INTER))]
    folds = [tuned("rms_gemv", n, k) for n, k in ((QKVZ + BA, H), (2 * INTER, H))]  # joined siblings only
    adds = [tuned("gemv_add", n, k) for n, k in ((H, QKVZ // 2), (H, INTER))]
    return ew + gemvs + folds + adds


def _reference(state: dict, x: torch.Tensor) -> torch.Tensor:
    """The unfolded model in fp32 (eager, plain torch math)."""
    with torch.no_grad():
        h, residual = x.float(), None
        for i in range(2):
            w = {k.removeprefix(f"layers.{i}."): v.float() for k, v in state.items() if k.startswith(f"layers.{i}.")}

            def norm(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
                return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * g

            residual = h if residual is None else h + residual
            normed = norm(residual, w["input_layernorm.weight"])
            qkvz, ba = normed @ w["linear_attn.in_proj_qkvz.weight"].T, normed @ w["linear_attn.in_proj_ba.weight"].T
            core = torch.tanh(qkvz[:, :QKVZ // 2]) * torch.sigmoid(qkvz[:, QKVZ // 2:]) * (
                ba[:, :BA // 2].sum(-1, keepdim=True) - ba[:, BA // 2:].sum(-1, keepdim=True))
            residual = core @ w["linear_attn.out_proj.weight"].T + residual
            gu = norm(residual, w["post_attention_layernorm.weight"]) @ w["mlp.gate_up_proj.weight"].T
            h = (torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w["mlp.down_proj.weight"].T
        residual = h + residual
        return residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * state["norm.weight"].float()


def _load(plugin, monkeypatch, model: nn.Module, merge: bool) -> nn.Module:
    from tunekit.integrations import vllm_merge

    vllm_merge.JOINED.clear()
    monkeypatch.setenv("TUNEKIT_MERGE_SIBLINGS", "1" if merge else "0")
    plugin.RANGE_MERGES.clear()
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
    from tunekit.serving.fused_gemv import joined_rows

    config = compile_ranges(_entries())
    ranges = config.compilation_config.get_compile_ranges()
    Model = _model_class()
    xs = {m: torch.randn(m, H, generator=torch.Generator().manual_seed(m)).bfloat16() for m in (3, 7)}
    with set_current_vllm_config(config):
        model = Model(vllm_config=config)
        state = _init(model)
        assert _load(plugin, monkeypatch, model, merge=True) is model
        assert plugin.FOLDS == {"rms_norm folded": 4}, plugin.FOLDS
        assert plugin.MERGES == {"in_proj_qkvz+in_proj_ba joined": 2}, plugin.MERGES
        got = {m: model(x) for m, x in xs.items()}
        impls = _impls()
        merges = dict(plugin.RANGE_MERGES)
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
        ref = _reference(state, x)
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
    assert plugin.FOLDS == {"rms_norm (fold not in the tables or not paying)": 2, "rms_norm folded": 2}, plugin.FOLDS
    assert plugin.MERGES == {}
    gdn = model.layers[0].linear_attn
    assert torch.equal(gdn.in_proj_qkvz.weight, state["layers.0.linear_attn.in_proj_qkvz.weight"])
    done, why = plugin._install_merge()
    assert not done and "TUNEKIT_MERGE_SIBLINGS" in why
