"""vllm_skinny and the peer baselines against vLLM 0.33's real classes (run in the vLLM virtualenv, on the CPU).

What is checked: the search space is SkinnyGemmConfig's own fields and every legal point of it constructs
vLLM's SkinnyGemmConfig and round-trips; the default is vLLM's heuristic (``ShapeDynamicSkinnyGemm._config``);
the mirrored rules agree with the kernel's constructor (``CuteSkinnyGemm.__init__``) and admit every config
vLLM ships in its hand-tuned Qwen4Exp plans; the unavailability reasons with the real packages installed;
a table entry of backend ``vllm_skinny`` loaded by the plugin routes a vLLM linear to ``tunekit::gemv``,
which on this CPU serves the vendor path with the reason "no GPU" in the markers and the log.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import vllm
from vllm.model_executor.kernels.linear.cute_dsl import skinny_gemm

from tunekit import backends
from tunekit.backends import vllm_skinny as vs
from tunekit.measure.device import DeviceInfo, detect
from tunekit.problems.shapes import Problem

H200 = DeviceInfo("nvidia", "NVIDIA H200", "sm_90", 132, 32, 60 << 20, 141 << 30, "cuda 13.0", "cuda:0")
B200 = dataclasses.replace(H200, name="NVIDIA B200", arch="sm_100")
#: Shapes of the built-in models (Qwen3.5-27B, Llama-3.1-8B) and of vLLM's Qwen4Exp plans, at decode Ms.
PROBLEMS = [Problem(op, "bf16", m, n, k) for op, m, n, k in (
    ("gemv", 1, 5120, 17408), ("gemv", 2, 96, 5120), ("gemv_add", 4, 5120, 6144), ("gemv", 8, 14336, 4096),
    ("gemv", 16, 24, 2560), ("gemv", 1, 62080, 2560), ("gemv_add", 2, 2560, 1536), ("gemv", 3, 320, 10240))]


def test_the_space_is_skinny_gemm_configs_fields() -> None:
    fields = {f.name for f in dataclasses.fields(skinny_gemm.SkinnyGemmConfig)}
    assert fields == {"num_rows", "block_size", "outputs_per_block", "k_unroll", "vector_width", "static_k"}
    for problem in PROBLEMS:
        space = backends.get("vllm_skinny").space(problem)
        assert set(space.domains) | set(space.fixed) == fields
        assert space.fixed == {"num_rows": problem.m}


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.key)
def test_every_legal_point_constructs_vllms_config(problem: Problem) -> None:
    backend = backends.get("vllm_skinny")
    space = backend.space(problem)
    names, legal = list(space.domains), 0
    for values in itertools.product(*space.domains.values()):
        params = space.fixed | dict(zip(names, values, strict=True))
        if backend.invalid_reason(problem, params) is not None:
            continue
        legal += 1
        config = vs.make_config(problem, params)
        assert type(config) is skinny_gemm.SkinnyGemmConfig
        expected = params | {"static_k": params["static_k"] or None}
        assert dataclasses.asdict(config) == expected
        assert vs.config_params(config) == params
    assert legal > 0


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.key)
def test_the_default_is_vllms_heuristic(problem: Problem) -> None:
    heuristic = skinny_gemm.ShapeDynamicSkinnyGemm._config(problem.m, problem.n, problem.k)
    space = backends.get("vllm_skinny").space(problem)
    assert vs.make_config(problem, space.fixed | space.default) == heuristic
    assert vs.heuristic_config(problem) == heuristic
    # vLLM's heuristic is legal on these shapes: the baseline serves them, and the search measures it first
    assert backends.get("vllm_skinny_heuristic").invalid_reason(problem, {}) is None
    assert backends.get("vllm_skinny").invalid_reason(problem, space.fixed | space.default) is None


def test_the_mirrored_rules_agree_with_the_kernels_constructor() -> None:
    import cutlass
    from vllm.model_executor.kernels.linear.cute_dsl import _skinny_gemm

    assert vs.PREFETCH_TILES == _skinny_gemm._PREFETCH_TILES
    assert vs.cute_min_arch() == (8, 0)
    problem = Problem("gemv", "bf16", 2, 96, 6144)
    refused = 0
    for block_size, vector_width, static_k in itertools.product((32, 48, 64, 96, 128, 384, 768), (2, 4, 8),
                                                                (None, 6144)):
        config = skinny_gemm.SkinnyGemmConfig(2, block_size, 1, 1, vector_width, static_k)
        mine = vs.config_reason(problem, config)
        try:
            _skinny_gemm.CuteSkinnyGemm(element_type=cutlass.BFloat16, num_rows=2, block_size=block_size,
                                        outputs_per_block=1, vector_width=vector_width, static_k=static_k)
        except ValueError as exc:
            refused += 1
            assert mine is not None, (config, exc)
        else:
            # what the constructor admits, the call's shape checks may still refuse (K % tile)
            assert mine is None or mine.startswith("K must be divisible"), (config, mine)
    assert refused > 0


def test_every_config_vllm_ships_in_its_plans_is_legal_for_its_shape() -> None:
    from vllm.models.qwen4_exp.nvidia import low_latency_gemm

    checked = 0
    for plans in low_latency_gemm.QWEN4_EXP_GEMM_PLANS_BY_CAPABILITY.values():
        for (n, k), by_m in plans.items():
            for m, config in by_m.items():
                assert vs.config_reason(Problem("gemv", "bf16", m, n, k), config) is None, (n, k, m, config)
                checked += 1
    assert checked > 50


def test_unavailability_with_the_real_packages(monkeypatch) -> None:
    skinny, heuristic, flashinfer = (backends.get(n) for n in ("vllm_skinny", "vllm_skinny_heuristic", "flashinfer"))
    assert detect().vendor == "cpu"
    assert skinny.unavailable_reason(detect()) == "no GPU (vLLM's CuTe-DSL skinny GEMM runs on NVIDIA GPUs)"
    assert skinny.unavailable_reason(H200) is None and heuristic.unavailable_reason(H200) is None
    assert skinny.unavailable_reason(dataclasses.replace(H200, arch="sm_75")) == (
        "architecture sm_75 unsupported (the CuTe DSL targets sm_80 and newer)")
    assert flashinfer.unavailable_reason(B200) is None
    from tunekit.backends import flashinfer as fi

    monkeypatch.setattr(fi.shutil, "which", lambda name: "/usr/local/cuda/bin/nvcc")
    assert flashinfer.unavailable_reason(H200) is None  # tinygemm_bf16, JIT-compiled with nvcc
    assert flashinfer.unavailable_reason(dataclasses.replace(H200, arch="sm_89")) == (
        "architecture sm_89 unsupported (FlashInfer's BF16 small-M GEMM: tinygemm_bf16 on sm_90, mm_bf16 backend "
        "'cute-dsl' (vLLM's --linear-backend flashinfer_cutedsl) on sm_100, sm_103, sm_107)")
    assert len(skinny.source_hash()) == 16 and skinny.source_hash() == heuristic.source_hash()


# ----------------------------------------------------------------------------- served by the plugin


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch):
    from tunekit import ops
    from tunekit import table as table_mod

    if not os.environ.get("TUNEKIT_TABLE"):
        empty = {"format": table_mod.FORMAT, "created": "test", "read_limit_gbps": None, "entries": [],
                 "environment": table_mod.environment_stamp(detect().as_dict(), [])}
        monkeypatch.setenv("TUNEKIT_TABLE", str(table_mod.save(empty, tmp_path / "empty.json")))
    vllm.plugins.load_general_plugins()  # once per process: a no-op after another test module did it
    ops.load_tables([])
    ops.reset_stats()
    yield ops
    ops.load_tables([])
    ops.reset_stats()


def test_a_vllm_skinny_entry_routes_and_falls_back_for_lack_of_a_gpu(plugin, vllm_config, tmp_path: Path) -> None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from tunekit import table as table_mod

    ops = plugin
    problem = Problem("gemv", "bf16", 2, 48, 512)
    space = backends.get("vllm_skinny").space(problem)
    params = space.fixed | space.default  # vLLM's heuristic for the shape: SkinnyGemmConfig(2, 64, 2, 2)
    entry = {"op": "gemv", "dtype": "bf16", "m": 2, "n": 48, "k": 512, "backend": "vllm_skinny", "params": params,
             "kernel": "test", "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0}
    table = {"format": table_mod.FORMAT, "created": "test", "read_limit_gbps": None, "entries": [entry],
             "environment": table_mod.environment_stamp(detect().as_dict(), ["vllm_skinny"])}
    path = table_mod.save(table, tmp_path / "skinny.json")
    assert table_mod.load(path, strict=True)["entries"][0].params == params  # valid against vLLM's class
    records = _Records()
    logging.getLogger("tunekit.ops").addHandler(records)
    try:
        ops.load_tables(str(path))
        torch.manual_seed(0)
        layer = MergedColumnParallelLinear(512, [32, 16], bias=False, params_dtype=torch.bfloat16)
        assert getattr(layer.quant_method._gemm_impl, "_tunekit_wrapped", False)
        layer.weight.data.normal_(0, 512**-0.5)
        x = torch.randn(2, 512).bfloat16()
        y, _ = layer(x)
    finally:
        logging.getLogger("tunekit.ops").removeHandler(records)
    assert torch.equal(y, F.linear(x, layer.weight))  # the stock path's bits
    rows = [(r["op"], r["shape"], r["m"], r["impl"]) for r in ops.dispatch_stats()]
    assert rows == [("gemv", "48x512", 2, "fallback:backend_unavailable")]
    why = "no GPU (vLLM's CuTe-DSL skinny GEMM runs on NVIDIA GPUs)"
    assert f"tunekit: backend vllm_skinny unavailable here ({why}); vendor path for its entries" in records.messages
