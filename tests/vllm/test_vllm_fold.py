"""Folded decoder norms in real vLLM 0.33 on the CPU (run in the vLLM virtualenv).

A two-layer model of vLLM's own layers (RMSNorm, ReplicatedLinear, SiluAndMul),
decoder layers named as vLLM's Qwen3 one, compiled by vLLM's Inductor path
with the plugin's compile ranges. What is checked: the load hook folds the
four decoder norms whose consumers the tables' ``rms_gemv`` entries cover, and
none without them; the range the tables serve runs ``rms_gemv`` for every
consumer and, where a ``gemv_add`` entry is there, the graph pass puts each
residual add into the output projection before it (rewrite), else leaves the
add (no rewrite); the range above the tables holds no tunekit op; the folded
model's output stays as close to the fp32 model as the unfolded one's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import test_vllm_plugin as base
import torch
from test_vllm_plugin import _entry, _impls, _table
from torch import nn

from tunekit.integrations.vllm import compile as vllm_compile
from tunekit.integrations.vllm import load as vllm_load

# the plugin tests' fixtures: the plugin loaded once per process, the ops' tables and markers reset per test
plugin, _fresh_ops = base.plugin, base._fresh_ops

H, INTER, Q = 64, 48, 80  # hidden, intermediate (gate_up: 2 * INTER), the attention stand-in's projection width


def _linear(k: int, n: int) -> nn.Module:
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return ReplicatedLinear(k, n, bias=False, params_dtype=torch.bfloat16)


def _model_class(mixer: type | None = None) -> type:
    """The two-layer model. ``mixer``: each layer's token mixer, default attention's projections around a
    stand-in core (``self_attn``, a layer named as vLLM's Qwen3 one); another (a stand-in named as vLLM's
    Gated DeltaNet) becomes ``linear_attn`` of a layer named as vLLM's Qwen3.5 one."""
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    class Attention(nn.Module):  # attention's projections around a stand-in for its core
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj, self.o_proj = _linear(H, Q), _linear(Q, H)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.o_proj(torch.tanh(self.qkv_proj(h)[0]))[0]

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj, self.down_proj, self.act = _linear(H, 2 * INTER), _linear(INTER, H), SiluAndMul()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act(self.gate_up_proj(h)[0]))[0]

    mixer_attr, layer_name = ("self_attn", "Qwen3DecoderLayer") if mixer is None else ("linear_attn",
                                                                                      "Qwen3_5DecoderLayer")

    class DecoderLayer(nn.Module):  # vLLM's Qwen3 / Qwen3.5 layer, as its forward calls its norms
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)
            self.post_attention_layernorm = RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)
            setattr(self, mixer_attr, (mixer or Attention)())
            self.mixer = mixer_attr
            self.mlp = MLP()

        def forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            if residual is None:
                residual, h = h, self.input_layernorm(h)
            else:
                h, residual = self.input_layernorm(h, residual)
            if self.mixer == "self_attn":  # the fold's finder takes the branch this attribute picks
                h = self.self_attn(h)
            else:
                h = self.linear_attn(h)
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual

    DecoderLayer.__name__ = DecoderLayer.__qualname__ = layer_name  # as vLLM's (the fold reads the forward)

    @support_torch_compile(dynamic_arg_dims={"x": 0})
    class Model(nn.Module):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__()
            self.layers = nn.ModuleList([DecoderLayer(), DecoderLayer()])
            self.norm = RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, residual = x, None
            for layer in self.layers:
                h, residual = layer(h, residual)
            return self.norm(h, residual)[0]

    return Model


def _entries(gemv_add: bool) -> list[dict]:
    from tunekit.backends import get
    from tunekit.problems.shapes import Problem

    def tuned(op: str, n: int, k: int) -> dict:
        return _entry(op, 4, n, k, params=get("triton").space(Problem(op, "bf16", 4, n, k)).default)

    ew = [_entry(op, 4, n, k, backend="serving_backend:BACKEND", params={})
          for op, n, k in (("rms_norm", H, H), ("fused_add_rms_norm", H, H), ("silu_and_mul", INTER, 2 * INTER))]
    gemvs = [tuned("gemv", n, k) for n, k in ((Q, H), (H, Q), (2 * INTER, H), (H, INTER))]
    folds = [tuned("rms_gemv", n, k) for n, k in ((Q, H), (2 * INTER, H))]
    adds = [tuned("gemv_add", n, k) for n, k in ((H, Q), (H, INTER))] if gemv_add else []
    return ew + gemvs + folds + adds


@pytest.fixture
def compile_ranges(plugin, vllm_config, monkeypatch, tmp_path: Path):
    """vLLM's Inductor compile with the plugin's ranges and passes: install(entries) -> its VllmConfig."""
    from vllm.compilation.passes import pass_manager
    from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig

    monkeypatch.setattr(VllmConfig, "_set_compile_ranges", VllmConfig._set_compile_ranges)
    monkeypatch.setattr(pass_manager.PostGradPassManager, "configure", pass_manager.PostGradPassManager.configure)
    # vLLM's last post-grad pass names its _C ops, which a CPU wheel lacks; this graph holds none of them
    monkeypatch.setattr(pass_manager.FixFunctionalizationPass, "__call__", lambda self, graph: None)
    # every test compiles afresh: the plugin's cache factor is the tables' digest at its registration,
    # once per process as in vLLM, and these tests change tables and the fold inside one process
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")

    def install(entries: list[dict]) -> VllmConfig:
        from tunekit import ops

        path = _table(tmp_path / "fold.json", entries)
        monkeypatch.setenv("TUNEKIT_TABLE", str(path))
        done, why = vllm_compile.install_compile_ranges()
        assert done, why
        ops.load_tables(str(path))
        vllm_compile.RANGE_ROUTES.clear()
        vllm_compile.RANGE_FUSIONS.clear()
        # made after the hook went in: its compile ranges end at the tables' largest M
        return VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, backend="inductor", cudagraph_mode="NONE", compile_sizes=[],
            custom_ops=["none"], pass_config=vllm_config.compilation_config.pass_config))

    return install


def _load_folded(plugin, monkeypatch, model: nn.Module) -> nn.Module:
    """The plugin's load hook around a loader whose load_model returns ``model`` (as vLLM's loaders end)."""
    from vllm.model_executor.model_loader import base_loader

    monkeypatch.setattr(base_loader.BaseModelLoader, "load_model", lambda self, *args, **kwargs: model)
    monkeypatch.setenv("TUNEKIT_FOLD_NORMS", "1")
    done, why = vllm_load.install_fold()
    assert done, why
    return base_loader.BaseModelLoader.load_model(None, vllm_config=None, model_config=None)


def _folded(plugin, monkeypatch, Model: type, config) -> tuple[nn.Module, dict]:
    """(a model with the tests' weights, folded by the plugin's load hook; its state before the fold).
    Called under ``set_current_vllm_config(config)``."""
    torch.manual_seed(0)
    model = Model(vllm_config=config)
    for name, p in model.named_parameters():
        p.data.normal_(1.0 if name.endswith("layernorm.weight") or name == "norm.weight" else 0.0, 0.15)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert _load_folded(plugin, monkeypatch, model) is model
    assert vllm_load.FOLDS == {"rms_norm folded": 4}, vllm_load.FOLDS
    return model, state


def _attention_reference(w: dict, normed: torch.Tensor) -> torch.Tensor:
    return torch.tanh(normed @ w["self_attn.qkv_proj.weight"].T) @ w["self_attn.o_proj.weight"].T


def _reference(state: dict, x: torch.Tensor, mixer=_attention_reference) -> torch.Tensor:
    """The unfolded model in fp32 (eager, plain torch math): the yardstick of both bf16 runs. ``mixer(w,
    normed)``: the token mixer's output from the layer's fp32 weights ``w`` and its normed input."""
    with torch.no_grad():
        h, residual = x.float(), None
        for i in range(2):
            w = {k.removeprefix(f"layers.{i}."): v.float() for k, v in state.items() if k.startswith(f"layers.{i}.")}

            def norm(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
                return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * g

            residual = h if residual is None else h + residual
            residual = mixer(w, norm(residual, w["input_layernorm.weight"])) + residual
            gu = norm(residual, w["post_attention_layernorm.weight"]) @ w["mlp.gate_up_proj.weight"].T
            h = (torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w["mlp.down_proj.weight"].T
        residual = h + residual
        return residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * state["norm.weight"].float()


@pytest.mark.parametrize("gemv_add", [True, False], ids=["gemv_add tabulated", "no gemv_add entry"])
def test_folded_norms_serve_rms_gemv_and_the_pass_moves_each_residual_add_into_its_gemv(
        plugin, compile_ranges, monkeypatch, gemv_add: bool) -> None:
    from vllm.config import set_current_vllm_config

    from tunekit import ops

    config = compile_ranges(_entries(gemv_add))
    ranges = config.compilation_config.get_compile_ranges()
    assert [(r.start, r.end) for r in ranges][0] == (1, 4), ranges
    Model = _model_class()
    xs = {m: torch.randn(m, H, generator=torch.Generator().manual_seed(m)).bfloat16() for m in (3, 7)}
    with set_current_vllm_config(config):
        model, state = _folded(plugin, monkeypatch, Model, config)
        got = {m: model(x) for m, x in xs.items()}
        impls = {(op, m): impl for op, _, m, impl in _impls()}
        fusions, routes = dict(vllm_compile.RANGE_FUSIONS), dict(vllm_compile.RANGE_ROUTES)
        # the same model unfolded, with no table: vLLM's own compile of it
        monkeypatch.delenv("TUNEKIT_FOLD_NORMS")
        ops.load_tables([])
        plain = Model(vllm_config=config)
        plain.load_state_dict(state)
        want = {m: plain(x) for m, x in xs.items()}

    # every consumer's weight holds its norm's: W diag(g), rounded once
    for i in range(2):
        g = state[f"layers.{i}.input_layernorm.weight"].float()
        w = state[f"layers.{i}.self_attn.qkv_proj.weight"].float()
        assert torch.equal(model.layers[i].self_attn.qkv_proj.weight, (w * g).bfloat16())
    # inside the tables' range: rms_gemv for each consumer, gemv_add for the three residual adds a fold leaves
    # (o_proj -> post_attention_layernorm twice, layer 0's down_proj -> layer 1's input_layernorm)
    assert impls[("rms_gemv", 3)] == "tuned:triton" and ("rms_norm", 3) not in impls
    assert fusions == ({str(ranges[0]): 3} if gemv_add else {}), fusions
    assert (impls.get(("gemv_add", 3)) == "tuned:triton") == gemv_add
    assert impls[("fused_add_rms_norm", 3)].startswith("tuned:")  # the final norm: not a decoder layer's
    # above the tables: no tunekit op at all
    assert not [c for c in impls if c[1] == 7]
    assert set(routes[str(ranges[1])]) >= {"rms_gemv", "gemv", "fused_add_rms_norm", "silu_and_mul"}, routes
    for m, x in xs.items():
        ref = _reference(state, x.float())
        folded_err = (got[m].float() - ref).abs().max().item()
        plain_err = (want[m].float() - ref).abs().max().item()
        # the fold rounds W diag(g) once where the unfolded model rounds the normalised activation: the
        # same order of error (measured 1.3-1.45x the unfolded model's here)
        assert folded_err <= 2 * plain_err, (m, folded_err, plain_err)


def test_a_fused_table_of_fewer_ms_keeps_the_tuned_gemv_above_its_entries(plugin, compile_ranges, monkeypatch) -> None:
    """The fused table searched at M=1, the main one at M=4 (the fold's weights are in place at every M):
    the ranges end at 2 and 4. In [3, 4] the pass hands each rms_gemv back as the unweighted norm around
    tunekit::gemv, tuned there; at M=2, inside [1, 2] but above the fused entries, rms_gemv's fallback
    runs the norm kernel (one launch) and the tuned GEMV. Values within the fold's bound at both."""
    from vllm.config import set_current_vllm_config

    from tunekit import ops
    from tunekit.backends import get
    from tunekit.dispatch.state import STATE
    from tunekit.problems.shapes import Problem

    def at_m1(op: str, n: int, k: int) -> dict:
        return _entry(op, 1, n, k, params=get("triton").space(Problem(op, "bf16", 1, n, k)).default)

    fused = [at_m1("rms_gemv", Q, H), at_m1("rms_gemv", 2 * INTER, H), at_m1("gemv_add", H, Q),
             at_m1("gemv_add", H, INTER)]
    config = compile_ranges([e for e in _entries(False) if e["op"] != "rms_gemv"] + fused)
    assert vllm_compile.range_endpoints(vllm_compile.tables_tops()) == [2, 4]
    ranges = config.compilation_config.get_compile_ranges()
    assert [(r.start, r.end) for r in ranges][:2] == [(1, 2), (3, 4)], ranges
    Model = _model_class()
    xs = {m: torch.randn(m, H, generator=torch.Generator().manual_seed(m)).bfloat16() for m in (2, 3)}
    with set_current_vllm_config(config):
        model, state = _folded(plugin, monkeypatch, Model, config)
        got = {m: model(x) for m, x in xs.items()}
        impls = {(op, shape, m): impl for op, shape, m, impl in _impls()}
        routes, fusions = dict(vllm_compile.RANGE_ROUTES), dict(vllm_compile.RANGE_FUSIONS)
        norm_kernel = STATE.defaults.get(("gemma_rms_norm", "bf16", 2, H, H, "cpu"))  # gone with the tables
        monkeypatch.delenv("TUNEKIT_FOLD_NORMS")
        ops.load_tables([])
        plain = Model(vllm_config=config)
        plain.load_state_dict(state)
        want = {m: plain(x) for m, x in xs.items()}

    qkv, gate_up = f"{Q}x{H}", f"{2 * INTER}x{H}"
    # M=3: no rms_gemv or gemv_add call; the folded consumers' GEMVs (their only GEMV calls) stay tuned
    assert routes[str(ranges[1])].get("rms_gemv") == 4, routes
    assert not [key for key in impls if key[2] == 3 and key[0] in ("rms_gemv", "gemv_add")], impls
    assert impls[("gemv", qkv, 3)] == impls[("gemv", gate_up, 3)] == "tuned:triton"
    # M=2: the fused ops' fallbacks, their GEMVs tuned, the norm one launch of tunekit's kernel
    assert impls[("rms_gemv", qkv, 2)] == impls[("gemv_add", f"{H}x{Q}", 2)] == "fallback:m_above_table"
    assert fusions == {str(ranges[0]): 3}, fusions
    assert impls[("gemv", qkv, 2)] == impls[("gemv", gate_up, 2)] == "tuned:triton"
    assert norm_kernel is not None and norm_kernel.kernel is not None
    for m, x in xs.items():
        ref = _reference(state, x.float())
        folded_err = (got[m].float() - ref).abs().max().item()
        plain_err = (want[m].float() - ref).abs().max().item()
        assert folded_err <= 2 * plain_err, (m, folded_err, plain_err)


def test_nothing_folds_without_rms_gemv_entries_or_with_the_switch_off(plugin, compile_ranges, monkeypatch) -> None:
    from vllm.config import set_current_vllm_config

    config = compile_ranges([e for e in _entries(True) if e["op"] != "rms_gemv"])
    with set_current_vllm_config(config):
        model = _model_class()(vllm_config=config)
    for p in model.parameters():
        p.data.normal_(1.0, 0.15)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _load_folded(plugin, monkeypatch, model)
    assert vllm_load.FOLDS == {}, vllm_load.FOLDS  # no rms_gemv entry at all: no fold is even considered
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(getattr(m, "_tunekit_folded", False) for m in model.modules())
    # with TUNEKIT_FOLD_NORMS=0 the hook is not installed at all (unset, it is: the fold is on by default)
    monkeypatch.delenv("TUNEKIT_FOLD_NORMS")
    assert vllm_load.install_fold()[0]
    monkeypatch.setenv("TUNEKIT_FOLD_NORMS", "0")
    done, why = vllm_load.install_fold()
    assert not done and "TUNEKIT_FOLD_NORMS=0" in why
    assert os.environ.get("TUNEKIT_FOLD_NORMS") == "0"


def test_the_fold_and_the_epilogue_follow_the_tables_measured_decision(plugin, compile_ranges, monkeypatch) -> None:
    """A table whose entries would pay for every fold, but whose fusions section (the search's same-run
    measurement) decided against the attention input norm's fold and the o_proj epilogue: those stay a norm and
    an add, the MLP norms fold; the plugin's report gives one line per decided group."""
    import json

    from vllm.config import set_current_vllm_config

    from tunekit import table as table_mod
    from tunekit.table_fusions import FusionGroup, Measured, record

    def decided(family: str, norm: str | None, n: int, k: int, fuse: bool) -> tuple[str, dict]:
        group = FusionGroup(family, "bf16", ((n, k),), norm)
        return group.key, record(group, {4: Measured(1.0, 2.0) if fuse else Measured(2.0, 1.0)})

    config = compile_ranges(_entries(True))
    path = Path(os.environ["TUNEKIT_TABLE"])
    table = json.loads(path.read_text())
    table["fusions"] = dict([decided("rms_gemv", "rms_norm", Q, H, False),
                             decided("rms_gemv", "rms_norm", 2 * INTER, H, True),
                             decided("gemv_add", None, H, Q, False), decided("gemv_add", None, H, INTER, True)])
    table_mod.save(table, path)
    from tunekit import ops

    ops.load_tables(str(path))
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    with set_current_vllm_config(config):
        torch.manual_seed(0)
        model = _model_class()(vllm_config=config)
        for name, p in model.named_parameters():
            p.data.normal_(1.0 if name.endswith("layernorm.weight") or name == "norm.weight" else 0.0, 0.15)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        _load_folded(plugin, monkeypatch, model)
        model(x)
        impls = {(op, shape, m): impl for op, shape, m, impl in _impls()}
    assert vllm_load.FOLDS == {"rms_norm folded": 2, "rms_norm (not fused per the table)": 2}, vllm_load.FOLDS
    for i in range(2):  # the attention's input norm kept its weights and runs as a norm
        assert torch.equal(model.layers[i].self_attn.qkv_proj.weight, state[f"layers.{i}.self_attn.qkv_proj.weight"])
    assert vllm_load.FOLD_REPORT["gemv_add not fused per the table"] == [f"bf16 {H}x{Q}"]
    lines = vllm_load.FOLD_REPORT["decisions"]
    assert any(line.startswith(f"not fused: rms_gemv (rms_norm|bf16|{Q}x{H}): slower at M=4") for line in lines), lines
    assert any(line.startswith(f"fused: rms_gemv (rms_norm|bf16|{2 * INTER}x{H}): faster at M=4") for line in lines)
    assert impls.get(("rms_gemv", f"{2 * INTER}x{H}", 3)) == "tuned:triton"
    assert ("rms_gemv", f"{Q}x{H}", 3) not in impls and impls[("gemv", f"{Q}x{H}", 3)] == "tuned:triton"
    # no residual add is left where gemv_add was decided for (layer 1's input norm is not folded: its add stays
    # inside the fused-add norm), and o_proj's add after the folded MLP norm stays an add
    assert not [key for key in impls if key[0] == "gemv_add"], impls
