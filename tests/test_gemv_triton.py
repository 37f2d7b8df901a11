"""Interpreter-mode correctness of the Triton GEMV family (tails, M, SPLIT_K; every M to 16: test_gemv_m16.py)."""

from __future__ import annotations

import pytest
import torch

from kernels_triton.gemv import DEFAULT, GemvConfig, gemv, invalid_reason, reference
from tunekit.measure import verify
from tunekit.problems import opspec_gemv
from tunekit.problems.shapes import Problem


def _check(m: int, n: int, k: int, config: GemvConfig, seed: int = 0) -> None:
    assert invalid_reason(config, m, n, k) is None, invalid_reason(config, m, n, k)
    problem = Problem("gemv", "bf16", m, n, k)

    def kernel(inputs, out):
        gemv(inputs[0], inputs[1], config, out=out)

    result = verify.verify(kernel, opspec_gemv.GEMV, problem, torch.device("cpu"), seed=seed)
    assert result.ok, result.reason
    assert 0 < result.err_ratio <= 1.0


@pytest.mark.parametrize("m", range(1, 9))
def test_every_m_with_both_tails(m: int) -> None:
    # N=37 is not a multiple of BLOCK_N=8; K=200 not a multiple of BLOCK_K=64.
    _check(m, 37, 200, GemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1), seed=m)


@pytest.mark.parametrize("split_reduce", ["kernel", "fused"])
@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_split_k_tails(split_k: int, split_reduce: str) -> None:
    _check(3, 29, 330, GemvConfig(BLOCK_N=4, BLOCK_K=16, num_warps=1, SPLIT_K=split_k,
                                  SPLIT_REDUCE=split_reduce))


def test_fused_and_separate_split_reduce_give_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=gen).bfloat16()
    w = torch.randn(24, 256, generator=gen).bfloat16()
    base = dict(BLOCK_N=4, BLOCK_K=64, num_warps=1, SPLIT_K=4)
    a = gemv(x, w, GemvConfig(**base, SPLIT_REDUCE="kernel"))
    b = gemv(x, w, GemvConfig(**base, SPLIT_REDUCE="fused"))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # and the fused path re-arms its tickets: a second call is still right
    c = gemv(x, w, GemvConfig(**base, SPLIT_REDUCE="fused"))
    assert torch.equal(a.view(torch.int16), c.view(torch.int16))


def test_one_masked_step_larger_than_k() -> None:
    _check(1, 16, 96, GemvConfig(BLOCK_N=2, BLOCK_K=128, num_warps=2))


def test_default_config_is_valid_for_every_m_and_the_model_shapes() -> None:
    shapes = [(96, 5120), (5120, 17408), (248320, 5120), (14336, 5120), (37, 200)]
    for m in range(1, 9):
        for n, k in shapes:
            assert invalid_reason(DEFAULT, m, n, k) is None


def test_default_config_runs_on_an_odd_shape_at_m8() -> None:
    _check(8, 13, 77, DEFAULT)


def test_reference_is_fp64_of_the_bf16_values() -> None:
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    w = torch.tensor([[3.0, 4.0], [0.5, -1.0]], dtype=torch.bfloat16)
    assert reference(x, w).dtype == torch.float64
    assert reference(x, w).tolist() == [[11.0, -1.5]]


@pytest.mark.parametrize(
    ("config", "m", "n", "k", "fragment"),
    [
        (GemvConfig(BLOCK_N=3), 1, 64, 64, "power of two"),
        (GemvConfig(BLOCK_N=64, BLOCK_K=1024, num_warps=1), 8, 64, 4096, "register budget"),
        (GemvConfig(SPLIT_K=16, BLOCK_K=256), 1, 64, 512, "empty"),
        (GemvConfig(SPLIT_REDUCE="fused"), 1, 64, 512, "SPLIT_K > 1"),
        (GemvConfig(W_EVICT="bogus"), 1, 64, 512, "W_EVICT"),
        (GemvConfig(), 17, 64, 512, "outside 1..16"),
    ],
)
def test_invalid_configs_are_refused_with_a_reason(config, m, n, k, fragment) -> None:
    reason = invalid_reason(config, m, n, k)
    assert reason is not None and fragment in reason


def test_launcher_rejects_mismatched_operands() -> None:
    with pytest.raises(ValueError):
        gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("mode", ["dot", "dot_w"])  # dot_w: W as the MMA's M side (acc^T = W x^T)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_tensor_core_paths_every_m_with_tails(m: int, mode: str) -> None:
    _check(m, 37, 200, GemvConfig(BLOCK_N=16, BLOCK_K=64, num_warps=1, M_MODE=mode), seed=10 + m)


@pytest.mark.parametrize(("mode", "block_n", "warps"), [("dot", 16, 1), ("dot_w", 64, 4)])
def test_tensor_core_paths_with_split_k(mode: str, block_n: int, warps: int) -> None:
    _check(4, 70, 330, GemvConfig(BLOCK_N=block_n, BLOCK_K=16, num_warps=warps, M_MODE=mode, SPLIT_K=3,
                                  SPLIT_REDUCE="fused"))


def test_tensor_core_path_needs_16_wide_tiles() -> None:
    assert "tl.dot" in invalid_reason(GemvConfig(BLOCK_N=8, M_MODE="dot"), 2, 64, 512)
    assert "tl.dot" in invalid_reason(GemvConfig(BLOCK_N=8, M_MODE="dot_w"), 2, 64, 512)


@pytest.mark.parametrize("m", [2, 3, 4, 5, 8])
def test_per_row_accumulator_path_every_m_with_tails(m: int) -> None:
    _check(m, 37, 200, GemvConfig(BLOCK_N=2, BLOCK_K=64, num_warps=1, M_MODE="rows"), seed=20 + m)


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_per_row_path_with_fused_split_k() -> None:
    _check(6, 21, 330, GemvConfig(BLOCK_N=2, BLOCK_K=16, num_warps=1, M_MODE="rows", SPLIT_K=3,
                                  SPLIT_REDUCE="fused"))


def test_rows_mode_is_refused_at_m1_where_it_is_the_tile_kernel() -> None:
    assert "M=1" in invalid_reason(GemvConfig(M_MODE="rows"), 1, 64, 512)


def test_recorded_configs_with_the_old_use_dot_name_still_load() -> None:
    assert GemvConfig.from_params({"BLOCK_N": 16, "USE_DOT": 1}).M_MODE == "dot"
    assert GemvConfig.from_params({"BLOCK_N": 16, "USE_DOT": 0}).M_MODE == "tile"


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(1, 1), (8, 32), (64, 64), (96, 127), (5, 4099)])
def test_the_fallback_config_is_valid_for_every_shape(m, n, k) -> None:
    assert invalid_reason(DEFAULT, m, n, k) is None
