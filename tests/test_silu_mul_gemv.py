"""Interpreter-mode correctness of SiLU-and-mul in the GEMV prologue (kernels_triton/silu_mul_gemv.py)."""

from __future__ import annotations

import pytest
import torch

from kernels_triton import gemv as gemv_mod
from kernels_triton import silu_and_mul as act_mod
from kernels_triton.silu_mul_gemv import DEFAULT, SiluMulGemvConfig, invalid_reason, launch, silu_mul_gemv
from tunekit import backends
from tunekit.backends.vendor import NORM_GEMV
from tunekit.errors import UserError
from tunekit.measure import verify
from tunekit.problems import opspec
from tunekit.problems.shapes import Problem, adhoc_problems, parse_m_list, parse_op_shape

CPU = torch.device("cpu")
OP = "silu_mul_gemv"
CONFIGS = {
    "narrow": SiluMulGemvConfig(BLOCK_N=1, BLOCK_K=64, num_warps=1, num_stages=1),
    "tail": SiluMulGemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1),
    "wide": SiluMulGemvConfig(BLOCK_N=16, BLOCK_K=128, num_warps=2, num_stages=3),
    "default": DEFAULT,
    "dot": SiluMulGemvConfig(BLOCK_N=16, BLOCK_K=64, num_warps=1, M_MODE="dot"),
    "dot_w": SiluMulGemvConfig(BLOCK_N=16, BLOCK_K=64, num_warps=1, M_MODE="dot_w"),
    "split": SiluMulGemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1, SPLIT_K=3),
    "split_dot_w": SiluMulGemvConfig(BLOCK_N=16, BLOCK_K=64, num_warps=1, M_MODE="dot_w", SPLIT_K=2),
}


def _kernel(config: SiluMulGemvConfig):
    def kernel(inputs, out) -> None:
        launch(OP, inputs, out, config)

    return kernel


def _verify(m: int, n: int, k: int, config: SiluMulGemvConfig, seed: int = 0) -> verify.VerifyResult:
    assert invalid_reason(config, m, n, k) is None, invalid_reason(config, m, n, k)
    return verify.verify(_kernel(config), opspec.get(OP), Problem(OP, "bf16", m, n, k), CPU, seed=seed)


def _inputs(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return opspec.get(OP).make_inputs(Problem(OP, "bf16", m, n, k), CPU, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize(("n", "k"), [(37, 200), (1, 200), (5, 96)])
def test_every_m_with_both_tails(m: int, n: int, k: int) -> None:
    # N=37 is not a multiple of BLOCK_N=8 and N=1 clamps 7 of 8 rows; K=200 is not a multiple of
    # BLOCK_K=64 (masked steps), K=96 is
    result = _verify(m, n, k, CONFIGS["tail"], seed=m + n)
    assert result.ok, result.reason
    assert 0 < result.err_ratio <= 1.0


@pytest.mark.parametrize("mode", ["dot", "dot_w"])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_tensor_core_modes_with_both_tails(mode: str, m: int) -> None:
    # M padded to 16 for tl.dot; N=37 leaves a partial 16-row block, K=200 a masked step
    for n, k in ((37, 200), (1, 64)):
        result = _verify(m, n, k, CONFIGS[mode], seed=m + n)
        assert result.ok, f"{mode} M={m} N={n} K={k}: {result.reason}"


@pytest.mark.parametrize("family", ["split", "split_dot_w"])
@pytest.mark.parametrize("m", [1, 3])
def test_split_k(family: str, m: int) -> None:
    # SPLIT_K=3 / 2 of 64-wide steps: K=448 -> 192, 192, 64 / 256, 192; K=330 -> 128, 128, 74 / 192, 138
    # (masked tails); K=384 -> 128 x 3 / 192 x 2 (even)
    for n, k in ((37, 448), (1, 330), (16, 384)):
        result = _verify(m, n, k, CONFIGS[family], seed=n)
        assert result.ok, f"{family} M={m} N={n} K={k}: {result.reason}"
    gate_up, w = _inputs(m, 37, 448, seed=2)
    first = silu_mul_gemv(gate_up, w, CONFIGS[family])
    assert torch.equal(silu_mul_gemv(gate_up, w, CONFIGS[family]).view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("family", ["narrow", "wide", "default"])
def test_config_families(family: str) -> None:
    # K=96 < BLOCK_K for "wide" and "default": one masked step; K=256 is even for all of them
    for m, n, k in ((2, 5, 96), (3, 33, 320), (1, 16, 256)):
        result = _verify(m, n, k, CONFIGS[family], seed=n)
        assert result.ok, f"{family} M={m} N={n} K={k}: {result.reason}"


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k", [192, 200])
def test_bitwise_equal_to_the_unfused_kernels_at_the_same_tile(m: int, k: int) -> None:
    # The fused kernel rounds the activation where vLLM's silu_and_mul does, and its K loop is the GEMV's
    # "tile" loop: with the same BLOCK_N / BLOCK_K it must give the unfused kernels' bits exactly.
    n = 24
    gate_up, w = _inputs(m, n, k, seed=7)
    act = act_mod.silu_and_mul(gate_up, act_mod.SiluAndMulConfig(VLLM_ROUNDING=1))
    assert torch.equal(act.view(torch.int16), act_mod.rounded_reference(gate_up, 1).view(torch.int16))
    unfused = gemv_mod.gemv(act, w, gemv_mod.GemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1, M_MODE="tile"))
    fused = silu_mul_gemv(gate_up, w, SiluMulGemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1))
    assert torch.equal(fused.view(torch.int16), unfused.view(torch.int16))


def test_vendor_baseline_is_the_unfused_sequence_and_within_the_bound() -> None:
    m, n, k = 2, 40, 160
    problem = Problem(OP, "bf16", m, n, k)
    result = verify.verify(backends.get("vendor").build(problem, {}, None), opspec.get(OP), problem, CPU, seed=3)
    assert result.ok, result.reason
    gate_up, w = _inputs(m, n, k, seed=3)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    NORM_GEMV[OP]((gate_up, w), out)
    expected = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:] @ w.t()
    assert torch.equal(out, expected)


def test_bound_rejects_swapped_halves_and_a_missing_silu() -> None:
    spec = opspec.get(OP)
    problem = Problem(OP, "bf16", 2, 32, 256)

    def swapped(inputs, out) -> None:  # silu(up) * gate
        gate_up, w = inputs
        k = w.shape[1]
        launch(OP, (torch.cat([gate_up[:, k:], gate_up[:, :k]], dim=1), w), out, DEFAULT)

    def no_silu(inputs, out) -> None:
        gate_up, w = inputs
        k = w.shape[1]
        out.copy_((gate_up[:, :k].float() * gate_up[:, k:].float()) @ w.float().t())

    for wrong in (swapped, no_silu):
        assert not verify.verify(wrong, spec, problem, CPU, seed=1).ok, wrong.__name__


def test_wrapper_checks_shapes() -> None:
    gate_up, w = _inputs(1, 8, 64)
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul_gemv(gate_up[:, :100], w)
    with pytest.raises(ValueError, match="unit stride"):
        silu_mul_gemv(gate_up, w.t().contiguous().t())


def test_invalid_reason() -> None:
    assert invalid_reason(SiluMulGemvConfig(BLOCK_N=3), 1, 64, 256) is not None
    assert invalid_reason(SiluMulGemvConfig(num_stages=5), 1, 64, 256) is not None
    assert invalid_reason(DEFAULT, 17, 64, 256) is not None
    assert "register" in invalid_reason(SiluMulGemvConfig(BLOCK_N=64, BLOCK_K=4096, num_warps=1), 8, 64, 8192)
    assert "threads" in invalid_reason(SiluMulGemvConfig(BLOCK_N=1, BLOCK_K=64, num_warps=4), 1, 64, 256)
    assert "far larger" in invalid_reason(SiluMulGemvConfig(BLOCK_K=4096), 1, 64, 256)
    assert "tl.dot" in invalid_reason(SiluMulGemvConfig(BLOCK_N=8, M_MODE="dot"), 2, 64, 256)
    assert "M_MODE" in invalid_reason(SiluMulGemvConfig(M_MODE="rows"), 2, 64, 256)
    assert "empty" in invalid_reason(SiluMulGemvConfig(BLOCK_K=256, SPLIT_K=3), 1, 64, 512)
    assert invalid_reason(SiluMulGemvConfig(SPLIT_K=0), 1, 64, 512) is not None
    assert "W_EVICT" in invalid_reason(SiluMulGemvConfig(W_EVICT="evict_last"), 1, 64, 512)
    assert invalid_reason(SiluMulGemvConfig(BLOCK_N=64, BLOCK_K=512, num_warps=4, M_MODE="dot_w"), 8, 5120, 17408) \
        is None
    with pytest.raises(TypeError):
        SiluMulGemvConfig.from_params({"BLOCK_N": 4, "ROWS": 1})  # strict: unknown tunables are errors
    # DEFAULT serves every M and the models' down_proj shapes at several TPs
    for m in range(1, 9):
        for n, k in ((5120, 17408), (5120, 8704), (4096, 14336), (2048, 6144), (1, 200), (37, 96)):
            assert invalid_reason(DEFAULT, m, n, k) is None
    # the search space's default and reference load and are valid
    space = backends.get("triton").space(Problem(OP, "bf16", 1, 5120, 17408))
    assert SiluMulGemvConfig.from_params(space.default) == DEFAULT
    assert backends.get("triton").invalid_reason(Problem(OP, "bf16", 8, 5120, 17408), space.reference) is None


def test_shapes_parse_the_op() -> None:
    assert parse_op_shape("silu_mul_gemv:5120x17408") == (OP, 5120, 17408)
    with pytest.raises(UserError):
        parse_op_shape("silu_mul_gemv:17408")
    assert parse_m_list("1,16", (OP,)) == [1, 16]
    with pytest.raises(UserError):
        parse_m_list("1,17", (OP,))
    (problem,) = adhoc_problems(["silu_mul_gemv:5120x17408"], [2])
    assert (problem.op, problem.m, problem.n, problem.k) == (OP, 2, 5120, 17408)
    assert problem.shape_text == "5120x17408" and problem.weight_bytes == 5120 * 17408 * 2
    assert opspec.get(OP).bytes_moved(Problem(OP, "bf16", 2, 4, 8)) == 2 * (4 * 8 + 2 * 2 * 8 + 2 * 4)


def test_models_list_down_proj_only_when_asked() -> None:
    from tunekit.problems import shapes
    from tunekit.problems.models import list_models, load_model

    assert OP not in shapes.OPS and shapes.parse_ops("silu_mul_gemv") == (OP,)
    assert set(shapes.parse_ops("fused_gemv")) == (set(shapes.NORM_GEMV_OPS) | {OP} | set(shapes.GEMV_ADD_OPS)
                                                   | set(shapes.RMS_GEMV_OPS) | set(shapes.GLU_GEMV_OPS))
    qwen = load_model("qwen3.5-27b")
    assert not [p for p in qwen.problems(tp=1, m_list=(1,), ops=shapes.OPS) if p.op == OP]
    for spec in list_models():
        for tp in (1, 2):
            if spec.tp_error(tp) is not None:
                continue
            linears = {name: (n, k, c) for name, n, k, c in spec.linears(tp)}
            listed = [p for p in spec.problems(tp=tp, m_list=(1, 8), ops=(OP,))]
            n, k, count = linears[f"{spec.mlp_prefix}down_proj"]
            assert [(p.m, p.n, p.k, p.count) for p in listed] == [(1, n, k, count), (8, n, k, count)], spec.name
            # the fused op's input is gate_up_proj's output
            assert linears[f"{spec.mlp_prefix}gate_up_proj"][0] == 2 * k
    listed = {(p.op, p.n, p.k): p.count for p in qwen.problems(tp=1, m_list=(1,), ops=shapes.parse_ops("fused_gemv"))}
    # + 4 norm -> GEMV, 2 gemv_add, 3 rms_gemv (in_proj_qkvz + in_proj_ba as one) and 2 gate_up + SiLU-and-mul
    assert listed[(OP, 5120, 17408)] == 64 and len(listed) == 12
