"""The agreement verdict on a real checkpoint through the vLLM plugin, on the CPU (run in the vLLM virtualenv).

SmolLM2-135M-Instruct (built by ``tunekit real-weights smollm2``; the main tier's set-up builds it) as a model of
vLLM's own layers: RMSNorm (with its fused residual add), ReplicatedLinear for the merged qkv_proj and gate_up_proj,
o_proj, down_proj and the lm_head, decoder layers named as vLLM's Llama one so the plugin's load hook folds their
norms. The attention core (RoPE, causal GQA) and SiLU-and-mul are plain PyTorch: this tier builds layers, not an
engine (vLLM's attention backends need a GPU). The plugin routes every layer the table covers; the table is
``fault_backend:REORDERED`` at M = 8 (correct kernels in another order, faults per weight).

Teacher-forced: vanilla (no table: vLLM's own forwards) decodes 6 tokens greedily after each prompt; each arm's
logits for those positions come from one forward over the prompt and the forced tokens (M = 8: the tables serve
it); vanilla's spread is the same positions computed one prefix at a time (M = 3..8). The verdict is
``tunekit.evidence.verdict`` through ``check_serving.forced_hf.agreement``, BF16 caps: the correct table passes,
unfolded and folded by the plugin's load hook; a dropped K block in one layer's down_proj and a residual add
dropped in one layer (the fused add + norm that carries it) fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import fault_backend
import pytest
import test_vllm_plugin as base
import torch
import torch.nn.functional as F
from test_vllm_plugin import _entry, _table
from torch import nn

from tunekit.evidence.check_serving import forced_hf
from tunekit.integrations.vllm import load as vllm_load

plugin, _fresh_ops = base.plugin, base._fresh_ops

PROMPTS = ([504, 3575, 282], [1604, 3987, 46477])  # "The capital of", "def fibonacci("
STEPS, TOPK, M = 6, 20, 8


def _checkpoint() -> Path:
    from tunekit.evidence import real_weights

    path = real_weights.built("smollm2")
    if path is None:
        if os.environ.get("TUNEKIT_REQUIRE_REAL") == "1":
            pytest.fail("TUNEKIT_REQUIRE_REAL=1 but smollm2 is not built (tunekit real-weights smollm2)", pytrace=False)
        pytest.skip("needs the real checkpoint smollm2: tunekit real-weights smollm2 (scripts/setup.sh builds it)")
    return path


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None, :], torch.cat([ang.sin()] * 2, -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _model(folder: Path) -> nn.Module:
    """SmolLM2 of vLLM's layers with the checkpoint's weights (built after the plugin registered its classes)."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ReplicatedLinear

    cfg = json.loads((folder / "config.json").read_text())
    h, inter, heads, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    hd, eps, theta = h // heads, cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    sd = load_file(str(folder / "model.safetensors"))
    bf16 = torch.bfloat16

    def linear(k: int, n: int, weight: torch.Tensor) -> nn.Module:
        lin = ReplicatedLinear(k, n, bias=False, params_dtype=bf16)
        lin.weight.data.copy_(weight)
        return lin

    def norm(weight: torch.Tensor) -> nn.Module:
        mod = RMSNorm(h, eps=eps, dtype=bf16)
        mod.weight.data.copy_(weight)
        return mod

    class Attention(nn.Module):
        def __init__(self, p: str) -> None:
            super().__init__()
            qkv = torch.cat([sd[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
            self.qkv_proj = linear(h, qkv.shape[0], qkv)
            self.o_proj = linear(heads * hd, h, sd[f"{p}.self_attn.o_proj.weight"])

        def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv_proj(x)[0].split([heads * hd, kv * hd, kv * hd], -1)
            t = x.shape[0]
            q = _rope(q.float().view(t, heads, hd), positions, theta)
            k = _rope(k.float().view(t, kv, hd), positions, theta).to(bf16).float()
            q = q.to(bf16).float()
            v = v.float().view(t, kv, hd)
            k, v = (z.repeat_interleave(heads // kv, 1).transpose(0, 1) for z in (k, v))
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
            return self.o_proj(o.transpose(0, 1).reshape(t, heads * hd).to(bf16))[0]

    class MLP(nn.Module):
        def __init__(self, p: str) -> None:
            super().__init__()
            gu = torch.cat([sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"]])
            self.gate_up_proj = linear(h, 2 * inter, gu)
            self.down_proj = linear(inter, h, sd[f"{p}.mlp.down_proj.weight"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g, u = self.gate_up_proj(x)[0].float().chunk(2, -1)
            return self.down_proj((F.silu(g) * u).to(bf16))[0]

    class LlamaDecoderLayer(nn.Module):  # vLLM's Llama layer, as its forward calls its norms
        def __init__(self, i: int) -> None:
            super().__init__()
            p = f"model.layers.{i}"
            self.input_layernorm = norm(sd[f"{p}.input_layernorm.weight"])
            self.self_attn = Attention(p)
            self.post_attention_layernorm = norm(sd[f"{p}.post_attention_layernorm.weight"])
            self.mlp = MLP(p)

        def forward(self, positions, x, residual):
            if residual is None:
                residual, x = x, self.input_layernorm(x)
            else:
                x, residual = self.input_layernorm(x, residual)
            x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
            return self.mlp(x), residual

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = sd["model.embed_tokens.weight"]
            self.layers = nn.ModuleList([LlamaDecoderLayer(i) for i in range(cfg["num_hidden_layers"])])
            self.norm = norm(sd["model.norm.weight"])
            self.lm_head = linear(h, cfg["vocab_size"], self.embed)

        @torch.no_grad()
        def forward(self, ids: list[int]) -> torch.Tensor:
            x, residual = self.embed[torch.tensor(ids)], None
            positions = torch.arange(len(ids))
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
            return self.lm_head(self.norm(x, residual)[0])[0]

    return Model()


def _top(logits: torch.Tensor) -> list[list]:
    lp = torch.log_softmax(logits.float(), -1)
    v, i = lp.topk(TOPK)
    return [[int(a), float(b)] for a, b in zip(i.tolist(), v.tolist(), strict=True)]


def _record(model: nn.Module, forced: list[list[int]] | None = None, prefixes: bool = False) -> dict:
    """Each prompt's STEPS positions: greedy where ``forced`` is None (one forward per prefix), else the forced
    tokens in one forward (M = prompt + STEPS - 1), or one prefix at a time (``prefixes``: other Ms)."""
    requests = []
    for r, prompt in enumerate(PROMPTS):
        if forced is None or prefixes:
            tokens, tops = [], []
            for s in range(STEPS):
                logits = model(list(prompt) + (forced[r][:s] if forced else tokens))[-1]
                tops.append(_top(logits))
                tokens.append(forced[r][s] if forced else int(logits.argmax()))
        else:
            tokens = forced[r]
            logits = model(list(prompt) + tokens[:-1])
            tops = [_top(logits[len(prompt) - 1 + s]) for s in range(STEPS)]
        requests.append({"forced": tokens, "top": tops})
    return {"steps": STEPS, "topk": TOPK, "requests": requests}


def _entries(model: nn.Module) -> list[dict]:
    shapes = {tuple(m.weight.shape) for m in model.modules() if hasattr(m, "weight") and m.weight.dim() == 2
              and not isinstance(m, nn.Embedding)}
    h = model.norm.weight.shape[0]
    backend = "fault_backend:REORDERED"
    gemvs = [_entry("gemv", M, n, k, backend=backend, params={}) for n, k in shapes]
    folds = [dict(_entry("rms_gemv", M, n, k, backend=backend, params={}), time_us=0.5)
             for n, k in shapes if k == h and n != model.lm_head.weight.shape[0]]
    norms = [_entry(op, M, h, h, backend=backend, params={}) for op in ("rms_norm", "fused_add_rms_norm")]
    return gemvs + folds + norms


@pytest.fixture(scope="module")
def subject(plugin, vllm_config, tmp_path_factory):
    folder = _checkpoint()
    torch.set_num_threads(1)
    model = _model(folder)
    ref = _record(model)  # no table loaded (_fresh_ops): vLLM's own forwards
    forced = forced_hf.forced_of(ref)
    spread = _record(model, forced, prefixes=True)
    table = _table(tmp_path_factory.mktemp("real") / "smollm2.json", _entries(model))
    return {"folder": folder, "model": model, "ref": ref, "forced": forced, "spread": spread, "table": table}


def _judge(subject, model: nn.Module) -> dict:
    from tunekit import ops

    ops.load_tables(str(subject["table"]))
    try:
        rec = _record(model, subject["forced"])
    finally:
        fault_backend.FAULTS.clear()
    served = {r["impl"] for r in ops.dispatch_stats()}
    assert "tuned:fault_backend:REORDERED" in served, served
    return forced_hf.agreement(subject["ref"], rec, [subject["spread"]], dtype="bf16")


def test_the_correct_table_passes_unfolded_and_folded_by_the_load_hook(subject, monkeypatch) -> None:
    doc = _judge(subject, subject["model"])
    assert doc["verdict"] == "pass", (doc["why"], doc["max_abs_logprob_diff"], doc["kl_max"])
    spread = doc["spread"][0]
    assert spread["max_abs_logprob_diff"] <= doc["caps"]["logprob"], spread
    # a second model folded by the plugin's load hook, as vLLM's loader ends
    from vllm.model_executor.model_loader import base_loader

    from tunekit import ops

    ops.load_tables(str(subject["table"]))
    folded = _model(subject["folder"])
    monkeypatch.setattr(base_loader.BaseModelLoader, "load_model", lambda self, *a, **k: folded)
    monkeypatch.setenv("TUNEKIT_FOLD_NORMS", "1")
    done, why = vllm_load.install_fold()
    assert done, why
    assert base_loader.BaseModelLoader.load_model(None, vllm_config=None, model_config=None) is folded
    assert vllm_load.FOLDS.get("rms_norm folded", 0) >= 2 * len(folded.layers) - 1, vllm_load.FOLDS
    doc = _judge(subject, folded)
    assert doc["verdict"] == "pass", (doc["why"], doc["max_abs_logprob_diff"], doc["kl_max"])


@pytest.mark.parametrize("fault", ["drop_k_block", "no_residual"])
def test_a_gross_defect_in_one_layer_fails(subject, fault) -> None:
    layer = subject["model"].layers[len(subject["model"].layers) // 2]
    weight = layer.mlp.down_proj.weight if fault == "drop_k_block" else layer.post_attention_layernorm.weight
    fault_backend.FAULTS[weight.data_ptr()] = fault
    doc = _judge(subject, subject["model"])
    assert doc["verdict"] == "fail", (fault, doc["max_abs_logprob_diff"], doc["kl_max"])
