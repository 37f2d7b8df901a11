"""serve-bench's hooks into real vLLM 0.33 on the CPU (run in the vLLM virtualenv): the realistic-weights recipe at
the end of vLLM's own DummyModelLoader, on a model of vLLM's layers, the token clock on vLLM's own
OutputProcessor, and speculative decoding's pieces (``--speculative``).

A whole vLLM engine does not start on this CPU-only machine: vLLM resolves to its UnspecifiedPlatform, whose
empty device type fails ``LLM(...)`` in DeviceConfig ("Device string must not be empty"). So the spec-decode arm
is tested by its pieces: vLLM accepts the speculative config the runner builds (EngineArgs, SpeculativeConfig on
a tiny local model config, no network); vLLM's own spec-decode counters, read through its metrics reader, parse
to the acceptance; and the plugin serves a vLLM linear at a verify step's M = 1 + k from a table whose entry
covers that M, the markers counted. The whole arm runs on a GPU machine (docs/serving.md)."""

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


# ----------------------------------------------------------------------------- speculative decoding


def _tiny_model_dir(tmp_path) -> str:
    import json

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("k", [3, 5])
def test_vllm_takes_the_speculative_config_the_runner_builds(plugin, tmp_path, k: int) -> None:
    # (plugin: EngineArgs and ModelConfig load vLLM's general plugins, once per process: with a table named first,
    # so the routing test below still finds the plugin's hooks installed)
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    from tunekit.evidence.serve_bench import runner, spec_decode

    engine = {"model": _tiny_model_dir(tmp_path), "load_format": "dummy", "skip_tokenizer_init": True,
              "dtype": "bfloat16", "max_model_len": 256, "max_num_seqs": 2, "gpu_memory_utilization": 0.5,
              **spec_decode.engine_args(f"ngram:{k}")}
    kwargs, dropped = runner.engine_kwargs(engine, runner.accepted_fields(EngineArgs))
    assert dropped == [] and kwargs["speculative_config"]["num_speculative_tokens"] == k
    args = EngineArgs(**kwargs)
    assert args.disable_log_stats is False
    target = ModelConfig(model=kwargs["model"], dtype="bfloat16", max_model_len=256, skip_tokenizer_init=True)
    config = SpeculativeConfig(**kwargs["speculative_config"], target_model_config=target,
                               target_parallel_config=ParallelConfig())
    assert config.method == "ngram" and config.num_speculative_tokens == k
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (spec_decode.LOOKUP_MIN, spec_decode.LOOKUP_MAX)


def test_vllms_own_spec_decode_counters_parse_to_the_acceptance() -> None:
    from vllm.v1.metrics.reader import get_metrics_snapshot
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    from tunekit.evidence.serve_bench import spec_decode

    before = spec_decode.counters(get_metrics_snapshot())
    prom = SpecDecodingProm(type("Spec", (), {"num_speculative_tokens": 3})(), ["model_name", "engine"],
                            {0: ["tiny", "0"]})
    stats = SpecDecodingStats.new(3)
    for accepted in (3, 1, 0, 2):
        stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=accepted)
    prom.observe(stats, 0)
    d = spec_decode.delta({k: v or (0 if k != "accepted_per_pos" else []) for k, v in before.items()},
                          spec_decode.counters(get_metrics_snapshot()))
    assert d == {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 6, "accepted_per_pos": [3, 2, 1]}
    assert spec_decode.acceptance(d)["acceptance_rate"] == pytest.approx(0.5)
    assert spec_decode.acceptance(d)["mean_accepted_length"] == pytest.approx(2.5)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """vLLM's general plugins loaded the way vLLM does, with a table named (tests/vllm/test_vllm_plugin.py)."""
    import os

    import vllm.plugins

    if not os.environ.get("TUNEKIT_TABLE"):
        os.environ["TUNEKIT_TABLE"] = str(_table(tmp_path_factory.mktemp("tables") / "empty.json", []))
    vllm.plugins.load_general_plugins()
    from tunekit.integrations.vllm import plugin as vllm_plugin

    return vllm_plugin


def _table(path, entries):
    from tunekit import table as table_mod
    from tunekit.measure.device import detect

    table = {"format": table_mod.FORMAT, "created": "test", "environment": table_mod.environment_stamp(
        detect().as_dict(), []), "read_limit_gbps": None, "entries": entries}
    return table_mod.save(table, path)


def test_a_verify_steps_linear_is_served_from_the_table(plugin, vllm_config, tmp_path) -> None:
    """A verify step at k = 3 and 5 calls every linear with 1 + k rows; a table whose entries cover those M
    (here M = 4 and 8: M = 6 takes the next tabulated M) serves them, and the markers count them at that M."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from tunekit import ops
    from tunekit.evidence.serve_bench import analysis, spec_decode

    params = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 1, "num_stages": 1}
    entries = [{"op": "gemv", "dtype": "bf16", "m": m, "n": 48, "k": 64, "backend": "triton", "params": params,
                "kernel": "test", "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0} for m in (4, 8)]
    ops.load_tables(str(_table(tmp_path / "t.json", entries)))
    ops.reset_stats()
    try:
        torch.manual_seed(0)
        layer = MergedColumnParallelLinear(64, [32, 16], bias=False, params_dtype=torch.bfloat16)
        layer.weight.data.normal_(0, 64**-0.5)
        for k in (3, 5):
            x = torch.randn(1 + k, 64).bfloat16()
            y, _ = layer(x)
            ref = x.double() @ layer.weight.data.double().T
            assert y.shape == (1 + k, 48) and (y.double() - ref).abs().max() < 0.05
        log = {"calls": ops.dispatch_stats()}
        cov = spec_decode.verify_coverage(analysis.merge_dispatch([log]), spec_decode.verify_bound([1], "ngram:5"))
        assert cov["by_m"]["4"]["ops"] == {"gemv": {"tuned:triton": 1}}
        assert cov["by_m"]["6"]["ops"] == {"gemv": {"tuned:triton": 1}}
        assert cov["fallback_calls"] == 0
    finally:
        ops.load_tables([])
        ops.reset_stats()
