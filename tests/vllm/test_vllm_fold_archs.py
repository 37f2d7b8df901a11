"""Which decoder norms fold in vLLM 0.33's own model classes, found from their forwards (run in the vLLM
virtualenv): Llama, Mistral, Qwen2, Qwen3, Qwen3.5 (hybrid), Gemma 2, Gemma 3 and Phi-3, each a tiny random
two-layer model built from a Hugging Face config object (no network). vLLM's attention core needs a GPU
backend to be built: a stand-in takes its place (the finder never reads it: q, k and v come out of the
linears; the layers' forwards run it as attention's output = q, so that output still depends on every
linear); everything the finder reads is vLLM's code. Then the real fold on each: what it folded, the weights
it wrote, and each layer's output against the unfolded layer's."""

from __future__ import annotations

import importlib

import pytest
import test_vllm_plugin as base
import torch
from torch import nn

from tunekit.integrations.vllm import fold as vllm_fold

# the plugin tests' fixtures: the plugin loaded once per process (a model built after it has tunekit's norms
# and GEMM route, which the fold needs), the ops' tables and markers reset per test
plugin, _fresh_ops = base.plugin, base._fresh_ops

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
        # the Gated DeltaNet's heads as small as the rest (its defaults make in_proj_qkvz 12288 rows)
        kwargs.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16)
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
        # the CPU wheel has none of vLLM's CUDA kernels (rotary, activations, norms): every CustomOp takes
        # its native torch forward, as under vLLM's Inductor compile, so the layers can run here
        config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                            compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]))
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


# ----------------------------------------------------------------------------- the fold itself

T = 3  # tokens per forward: inside the tables' M=4 entries, so every folded consumer runs the tuned rms_gemv


def _is_norm_module(module: nn.Module) -> bool:
    # by class name, as the fold's finder tells norms: RMSNorm, GemmaRMSNorm (their tunekit subclasses too),
    # the Gated DeltaNet's RMSNormGated
    return type(module).__name__.endswith("Norm") or type(module).__name__.endswith("NormGated")


def _seed_weights(model: nn.Module) -> None:
    """Seeded weights in place of vLLM's uninitialised ones: a norm's gain around its convention's unit scale
    (g ~ 1 for RMSNorm; g ~ 0 for Gemma's zero-centred x * (1 + g)), spread so the fold's scale differs per
    channel; every other parameter N(0, 0.15)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                gemma = "Gemma" in type(module).__name__
                mean = (0.0 if gemma else 1.0) if _is_norm_module(module) and name == "weight" else 0.0
                p.normal_(mean, 0.15)


def _tables(monkeypatch, tmp_path, model: nn.Module, plans) -> None:
    """Serve a table of the model's decoder GEMVs (each linear's (N, K)) and the rms_gemv of every folded
    consumer, at M=4 with the Triton kernels' default configs. rms_gemv is timed below the GEMV alone, so
    the fold pays by the tables' M=1 rule with no norm entry."""
    from test_vllm_plugin import _entry, _table

    from tunekit import ops
    from tunekit.backends import get
    from tunekit.problems.shapes import Problem

    def tuned(op: str, n: int, k: int, time_us: float) -> dict:
        entry = _entry(op, 4, n, k, params=get("triton").space(Problem(op, "bf16", 4, n, k)).default)
        return {**entry, "time_us": time_us, "speedup": entry["baseline_us"] / time_us}

    gemvs = {tuple(m.weight.shape) for name, m in model.named_modules()
             if name.startswith("model.layers.") and vllm_fold._is_linear(m) and m.weight.dim() == 2}
    folds = {tuple(c.weight.shape) for p in plans for c in p.consumers}
    entries = [tuned("gemv", n, k, 1.0) for n, k in sorted(gemvs)]
    entries += [tuned("rms_gemv", n, k, 0.5) for n, k in sorted(folds)]
    path = _table(tmp_path / "archs.json", entries)
    monkeypatch.setenv("TUNEKIT_TABLE", str(path))
    ops.load_tables(str(path))


def _first(out):
    """A vLLM linear returns (output, bias); a norm its output, or (output, residual)."""
    return out[0] if isinstance(out, tuple) else out


def _errors(got, want) -> list[float]:
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return [(g.float() - w.float()).abs().max().item() for g, w in zip(got, want, strict=True)]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_5"])
def test_every_architecture_folds_what_the_finder_lists_and_each_layer_still_computes_the_same(
        plugin, build, monkeypatch, tmp_path, name) -> None:
    """The real fold (``fold.fold_model`` with the plugin's routes) on each architecture, its tables holding
    the model's GEMVs and the ``rms_gemv`` of every consumer: every norm the finder lists is folded and passed
    its check, each consumer's weight is W diag(g) (Gemma's zero-centred norms: W diag(1 + g)) rounded once,
    nothing else changed, and each decoder layer's forward (the stand-in attention, seeded inputs with outlier
    channels) stays as close to the fp32 layer as the unfolded bf16 layer does, the consumers running the
    tuned ``rms_gemv``. Qwen3.5's Gated DeltaNet layer cannot run here (its core reads the engine's forward
    context: attention metadata and the conv / SSM state caches): for that layer each folded consumer's output
    (``rms_gemv`` on its folded weight) is compared instead with the unfolded norm then the original linear."""
    from test_vllm_plugin import _impls

    from tunekit.integrations.fold_check import activations
    from tunekit.integrations.vllm.load import _module_honours_fold
    from tunekit.integrations.vllm.marks import FOLDED

    model = build(name)
    _seed_weights(model)
    plans, skipped = vllm_fold.survey(model, _module_honours_fold)
    listed = [p.name for p in plans]
    # the plugin routes every norm and linear the finder lists: none is lost to a route that is not tunekit's
    assert listed and listed == [p.name for p in vllm_fold.survey(model, lambda m: True)[0]]
    _tables(monkeypatch, tmp_path, model, plans)
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    # the same weights unfolded, in bf16 and in fp32 (the yardstick of both bf16 layers)
    unfolded, reference = build(name), build(name)
    unfolded.load_state_dict(raw)
    reference.load_state_dict(raw)
    unfolded, reference = unfolded.model.layers, reference.float().model.layers

    report = vllm_fold.FoldReport()
    counts = vllm_fold.fold_model(model, _module_honours_fold, report=report)
    assert report.failed == [] and report.checked == len(listed), report.failed
    assert [p.name for p in report.folded] == listed
    (op,) = {p.op for p in plans}
    refused: dict[str, int] = {}
    for _, norm_op, why in skipped:
        key = f"{norm_op} (not folded: {why.split(' (')[0]})"
        refused[key] = refused.get(key, 0) + 1
    assert counts == {f"{op} folded": len(listed), **refused}, counts

    consumers = {}
    for plan in report.folded:
        assert getattr(plan.norm, FOLDED, False)
        g = raw[f"{plan.name}.weight"].float()
        scale = 1 + g if op == "gemma_rms_norm" else g
        for path in plan.consumer_names:
            consumers[f"{path}.weight"] = (raw[f"{path}.weight"].float() * scale).bfloat16()
    state = model.state_dict()
    for key, value in state.items():  # the consumers' weights hold their norm's scale; nothing else moved
        assert torch.equal(value, consumers.get(key, raw[key])), key

    cpu = torch.device("cpu")
    for i, layer in enumerate(model.model.layers):
        width = layer.input_layernorm.weight.shape[0]
        h = activations(T, width, torch.bfloat16, cpu, 7 + i)
        with torch.no_grad():
            if getattr(layer, "layer_type", None) == "linear_attention":
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    paths = next(p.consumer_names for p in plans if p.name == f"model.layers.{i}.{norm}")
                    for path in (p.removeprefix(f"model.layers.{i}.") for p in paths):
                        got = _first(layer.get_submodule(path)(_first(getattr(layer, norm)(h))))
                        want = _first(unfolded[i].get_submodule(path)(_first(getattr(unfolded[i], norm)(h))))
                        ref = _first(reference[i].get_submodule(path)(_first(getattr(reference[i], norm)(h.float()))))
                        (folded_err,), (plain_err,) = _errors(got, ref), _errors(want, ref)
                        assert folded_err <= 2 * plain_err, (i, path, folded_err, plain_err)
                continue
            # layer 0 takes the plain norm form (no residual yet), layer 1 the fused add
            res = None if i == 0 else activations(T, width, torch.bfloat16, cpu, 70 + i, False)
            got = layer(positions=torch.arange(T), hidden_states=h, residual=res)
            want = unfolded[i](positions=torch.arange(T), hidden_states=h, residual=res)
            ref = reference[i](positions=torch.arange(T), hidden_states=h.float(),
                               residual=None if res is None else res.float())
        # the hidden states and the residual stream each, against the fp32 layer: the fold rounds W diag(g)
        # once where the unfolded layer rounds the normalised activation, the same order of error
        for what, folded_err, plain_err in zip(("hidden", "residual"), _errors(got, ref), _errors(want, ref),
                                               strict=True):
            assert folded_err <= 2 * plain_err, (i, what, folded_err, plain_err)
    # every folded consumer ran rms_gemv, tuned (its table entry), at the forwards' M
    impls = {(op_, shape, m): impl for op_, shape, m, impl in _impls()}
    for key, weight in consumers.items():
        n, k = weight.shape
        assert impls[("rms_gemv", f"{n}x{k}", T)] == "tuned:triton", (key, impls)
