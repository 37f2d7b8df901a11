"""serve-bench's hooks into real vLLM 0.33 on the CPU (run in the vLLM virtualenv): the realistic-weights recipe at
the end of vLLM's own DummyModelLoader, on a model of vLLM's layers, and the token clock on vLLM's own
OutputProcessor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tunekit.evidence.serve_bench import tpot, weights

H, V = 64, 256


def _model() -> nn.Module:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)
            self.post_attention_layernorm = GemmaRMSNorm(H, eps=1e-6)
            self.self_attn = nn.Module()
            self.self_attn.qkv_proj = ReplicatedLinear(H, 3 * H, bias=False, params_dtype=torch.bfloat16)
            self.self_attn.o_proj = ReplicatedLinear(H, H, bias=False, params_dtype=torch.bfloat16)

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(V, H, params_dtype=torch.bfloat16)
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.norm = RMSNorm(H, eps=1e-6, dtype=torch.bfloat16)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.lm_head = ParallelLMHead(V, H, params_dtype=torch.bfloat16)

    return Model()


def test_the_recipe_runs_at_the_end_of_vllms_dummy_load(vllm_config) -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    original = DummyModelLoader.load_weights
    try:
        assert weights.install_load_hook(seed=0) is None
        assert weights.install_load_hook(seed=0) is None  # once: a second call finds its own hook
        model = _model()
        DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(model, None)
        assert weights.APPLIED["applied"] == "at load"
        assert weights.APPLIED["counts"] == {"embedding": 1, "norm": 4, "final_norm": 1, "linear": 2,
                                             "output_linear": 2, "lm_head": 1}
        layer = model.model.layers[0]
        plain, zero_centred = layer.input_layernorm.weight.float(), layer.post_attention_layernorm.weight.float()
        assert 0.7 < float(plain.median()) < 1.4 and float(plain.max()) >= 10.0  # gains, outliers
        assert abs(float(zero_centred.median())) < 0.4  # GemmaRMSNorm: gain 1 + w
        qkv = layer.self_attn.qkv_proj.weight.float()
        assert abs(float(qkv.std()) - 0.02) < 0.004  # not the dummy loader's +-1e-3
        again = _model()
        DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(again, None)
        for (name, a), b in zip(model.named_parameters(), again.parameters(), strict=True):
            assert torch.equal(a, b), name  # seeded per name: every process gets the same weights
    finally:
        DummyModelLoader.load_weights = original


def test_the_token_clock_reads_vllms_output_processor() -> None:
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.output_processor import OutputProcessor

    processor = OutputProcessor(None, log_stats=False)
    llm = type("LLM", (), {})()
    llm.llm_engine = type("Engine", (), {})()
    llm.llm_engine.output_processor = processor
    with tpot.TokenClock(llm) as clock:
        for step in range(3):
            outs = [EngineCoreOutput(request_id=r, new_token_ids=[step]) for r in ("a", "b")]
            processor.process_outputs(outs, engine_core_timestamp=0.0, iteration_stats=None)
    assert "process_outputs" not in vars(processor)
    rec = clock.record()
    assert rec["steps"] == 3 and rec["requests"] == 2 and rec["tokens"] == 6 and rec["tpot_ms"] is not None


@pytest.mark.parametrize("logprobs", [20])
def test_sampling_params_take_the_forced_top_k(logprobs: int) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=logprobs)
    assert params.logprobs == logprobs
