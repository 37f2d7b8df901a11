"""Which decoder norms fold in vLLM 0.33's own model classes, found from their forwards (run in the vLLM
virtualenv): Llama, Mistral, Qwen2, Qwen3, Qwen3.5 (hybrid), Gemma 2, Gemma 3 and Phi-3, each a tiny random
two-layer model built from a Hugging Face config object (no network). vLLM's attention core needs a GPU
backend to be built: a stand-in takes its place (the finder never reads it: q, k and v come out of the
linears); everything the finder reads is vLLM's code."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from tunekit.integrations.vllm import fold as vllm_fold

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, head_dim=16, max_position_embeddings=256)
PLAIN = {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "mlp.gate_up_proj"}
GEMMA = {"input_layernorm": "self_attn.qkv_proj", "pre_feedforward_layernorm": "mlp.gate_up_proj"}
GEMMA_REFUSED = {"post_attention_layernorm": "read by another norm", "post_feedforward_layernorm": "leaves the layer"}


class StandInAttention(nn.Module):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return q


def _config(name: str):
    import transformers

    make = {"llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
            "mistral": (transformers.MistralConfig, "MistralForCausalLM"),
            "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM"),
            "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM"),
            "qwen3_5": (transformers.Qwen3_5TextConfig, "Qwen3_5ForCausalLM"),
            "gemma2": (transformers.Gemma2Config, "Gemma2ForCausalLM"),
            "gemma3": (transformers.Gemma3TextConfig, "Gemma3ForCausalLM"),
            "phi3": (transformers.Phi3Config, "Phi3ForCausalLM")}
    cls, arch = make[name]
    kwargs = dict(COMMON)
    if name == "phi3":
        kwargs.pop("head_dim")
        kwargs["pad_token_id"] = 0
    if name == "qwen3_5":
        kwargs["layer_types"] = ["linear_attention", "full_attention"]
    config = cls(**kwargs)
    config.architectures = [arch]
    return config, arch


@pytest.fixture
def build(vllm_config, monkeypatch, tmp_path):
    """build(name) -> vLLM's own model of that architecture, tiny and random, on the CPU."""
    from vllm.config import (
        CompilationConfig,
        CompilationMode,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms import current_platform

    for module in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_next", "qwen3_5", "mistral"):
        models = importlib.import_module(f"vllm.model_executor.models.{module}")
        if hasattr(models, "Attention"):
            monkeypatch.setattr(models, "Attention", StandInAttention)
    monkeypatch.setattr(current_platform, "current_device", lambda: torch.device("cpu"), raising=False)

    def make(name: str) -> nn.Module:
        config, arch = _config(name)
        folder = tmp_path / name
        config.save_pretrained(folder)
        model_config = ModelConfig(model=str(folder), tokenizer=str(folder), skip_tokenizer_init=True,
                                   dtype="bfloat16", max_model_len=128)
        config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                            compilation_config=CompilationConfig(mode=CompilationMode.NONE))
        default = torch.get_default_dtype()
        try:
            with set_current_vllm_config(config):
                cls, _ = ModelRegistry.resolve_model_cls([arch], model_config)
                torch.set_default_dtype(torch.bfloat16)
                return cls(vllm_config=config)
        finally:
            torch.set_default_dtype(default)

    return make


@pytest.mark.parametrize(("name", "folds", "refused"), [
    ("llama", PLAIN, {}), ("mistral", PLAIN, {}), ("qwen2", PLAIN, {}), ("qwen3", PLAIN, {}), ("phi3", PLAIN, {}),
    ("gemma2", GEMMA, GEMMA_REFUSED), ("gemma3", GEMMA, GEMMA_REFUSED),
    ("qwen3_5", {"input_layernorm": "linear_attn.in_proj_qkvz+linear_attn.in_proj_ba",
                 "post_attention_layernorm": "mlp.gate_up_proj"}, {})])
def test_every_architecture_folds_its_linear_fed_norms_and_names_the_rest(build, name, folds, refused) -> None:
    model = build(name)
    plans, skipped = vllm_fold.survey(model, lambda m: True)
    got = {p.name: "+".join(c.removeprefix(p.name.rsplit(".", 1)[0] + ".") for c in p.consumer_names)
           for p in plans}
    want = {f"model.layers.{i}.{norm}": readers for i in range(2) for norm, readers in folds.items()}
    if name == "qwen3_5":  # layer 1 is full attention
        want["model.layers.1.input_layernorm"] = "self_attn.qkv_proj"
    assert got == want
    assert {(n, why.split(" (")[0]) for n, _, why in skipped} == {
        (f"model.layers.{i}.{norm}", why) for i in range(2) for norm, why in refused.items()}
    # Gemma's zero-centred norm: the fold's scale is 1 + g
    ops = {p.op for p in plans}
    assert ops == ({"gemma_rms_norm"} if name.startswith(("gemma", "qwen3_5")) else {"rms_norm"})
