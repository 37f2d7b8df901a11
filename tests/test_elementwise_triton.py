"""Elementwise ops on the CPU tier: every Triton kernel under the interpreter, the rounding
locations, the one verification path with two outputs, rotation, and the baselines.

Sizes stay small (the interpreter runs each program in numpy) but odd: rows that
are not a multiple of any block, a single row, several rows per program.
"""

from __future__ import annotations

import pytest
import torch

from kernels_triton import bias_gelu, fused_add_rms_norm, gated_rms_norm, rms_norm, silu_and_mul
from tunekit import backends
from tunekit.measure import verify
from tunekit.measure.bench import Rotation, time_kernel
from tunekit.measure.device import DeviceInfo
from tunekit.problems import opspec, opspec_elementwise
from tunekit.problems.shapes import Problem

CPU = torch.device("cpu")
CPU_INFO = DeviceInfo("cpu", "x86", "cpu", 2, 1, 32 << 20, 0, "cpu", "cpu")
TRITON = backends.get("triton")

# (op, n, k): odd widths, a Qwen3.5 gated-norm geometry in small (5 groups of 128),
# an odd group size, silu/gelu widths that leave a partial column block.
SHAPES = [
    ("rms_norm", 1000, 1000),
    ("gemma_rms_norm", 13, 13),
    ("fused_add_rms_norm", 777, 777),
    ("gemma_fused_add_rms_norm", 1024, 1024),
    ("gated_rms_norm", 5 * 128, 128),
    ("gated_rms_norm", 3 * 100, 100),
    ("silu_and_mul", 999, 1998),
    ("bias_gelu", 1001, 1001),
]
#: Non-default configs per op: the chunked two-pass norm path (BLOCK_N < N), several
#: rows per program, a row split over column programs, VLLM_ROUNDING=0.
ALTERNATIVES = {
    "rms_norm": {"BLOCK_N": 256, "ROWS": 2, "num_warps": 2, "VLLM_ROUNDING": 0},
    "gemma_rms_norm": {"BLOCK_N": 256, "ROWS": 4, "num_warps": 1, "VLLM_ROUNDING": 1},
    "fused_add_rms_norm": {"BLOCK_N": 256, "ROWS": 2, "num_warps": 2, "VLLM_ROUNDING": 0},
    "gemma_fused_add_rms_norm": {"BLOCK_N": 2048, "ROWS": 2, "num_warps": 8, "VLLM_ROUNDING": 1},
    "gated_rms_norm": {"ROWS": 16, "num_warps": 2},
    "silu_and_mul": {"BLOCK_N": 256, "ROWS": 4, "num_warps": 2, "VLLM_ROUNDING": 0},
    "bias_gelu": {"BLOCK_N": 128, "ROWS": 2, "num_warps": 1, "VLLM_ROUNDING": 0},
}


def _params(op: str, alternative: bool) -> dict:
    space = TRITON.space(Problem(op, "bf16", 1, 1, 1))
    return dict(space.fixed) | (ALTERNATIVES[op] if alternative else dict(space.default))


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(("op", "n", "k"), SHAPES, ids=lambda v: str(v))
def test_triton_kernel_passes_the_one_verification(op: str, n: int, k: int, m: int) -> None:
    problem = Problem(op, "bf16", m, n, k)
    for alternative in (False, True):
        params = _params(op, alternative)
        assert TRITON.invalid_reason(problem, params) is None, params
        kernel = TRITON.build(problem, params, CPU_INFO)
        result = verify.verify(kernel, opspec.get(op), problem, CPU, seed=m)
        assert result.ok, (params, result.reason)
        assert 0 < result.err_ratio <= 1


def test_the_vendor_eager_compositions_pass_too() -> None:
    vendor = backends.get("vendor")
    for op, n, k in SHAPES:
        problem = Problem(op, "bf16", 2, n, k)
        result = verify.verify(vendor.build(problem, {}, CPU_INFO), opspec.get(op), problem, CPU, seed=3)
        assert result.ok, (op, result.reason)


# ------------------------------------------------------------ rounding locations
def _agree(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of elements with equal bits; the rest must be one BF16 ulp apart.

    Not all bits can match a torch emulation: the sum of squares and exp are
    fp32 in a different order / implementation, which flips a rounding now and
    then. A different rounding *location* changes far more (measured below).
    """
    g, w = got.view(torch.int16).int(), want.view(torch.int16).int()
    assert int((g - w).abs().max()) <= 1, "more than one BF16 ulp from the emulation"
    return float((g == w).float().mean())


def _norm_inputs(op: str, m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return opspec.get(op).make_inputs(Problem(op, "bf16", m, n, k), CPU, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rounds_the_sum_before_the_variance_as_vllm(gemma: bool) -> None:
    # VLLM_ROUNDING=1: y is exactly the norm of the stored (rounded) residual, i.e. an
    # unfused add followed by rms_norm gives the same bits; VLLM_ROUNDING=0 normalises
    # the fp32 sum and differs on a large share of elements.
    op = "gemma_fused_add_rms_norm" if gemma else "fused_add_rms_norm"
    x, residual, w = _norm_inputs(op, 16, 384, 384, seed=11)
    outs = {}
    for flag in (1, 0):
        config = fused_add_rms_norm.FusedAddRmsNormConfig(BLOCK_N=512, ROWS=1, num_warps=4, VLLM_ROUNDING=flag)
        y, s = fused_add_rms_norm.fused_add_rms_norm(x, residual, w, config, gemma=gemma)
        assert torch.equal(s, (x.float() + residual.float()).to(torch.bfloat16))  # residual_out: one rounding
        norm_config = rms_norm.RmsNormConfig(BLOCK_N=512, ROWS=1, num_warps=4, VLLM_ROUNDING=flag)
        unfused = rms_norm.rms_norm(s, w, norm_config, gemma=gemma)
        outs[flag] = (y, unfused)
        for variant in (flag, 1 - flag):
            emulated, _ = fused_add_rms_norm.rounded_reference(x, residual, w, gemma=gemma, vllm_rounding=variant)
            share = float((y.view(torch.int16) == emulated.view(torch.int16)).float().mean())
            if variant == flag:
                assert _agree(y, emulated) >= 0.99
            else:
                assert share < 0.9, f"VLLM_ROUNDING={flag} is indistinguishable from {variant}"
    y1, unfused1 = outs[1]
    assert torch.equal(y1, unfused1)  # rounded sum: fused == add, then norm
    y0, unfused0 = outs[0]
    assert not torch.equal(y0, unfused0)


def test_plain_rms_norm_rounds_the_normalised_value_before_the_weight() -> None:
    x, w = _norm_inputs("rms_norm", 16, 384, 384, seed=5)
    for flag in (1, 0):
        config = rms_norm.RmsNormConfig(BLOCK_N=128, ROWS=2, num_warps=2, VLLM_ROUNDING=flag)
        y = rms_norm.rms_norm(x, w, config)
        assert _agree(y, rms_norm.rounded_reference(x, w, vllm_rounding=flag)) >= 0.99
        other = rms_norm.rounded_reference(x, w, vllm_rounding=1 - flag)
        assert float((y.view(torch.int16) == other.view(torch.int16)).float().mean()) < 0.9
    # Gemma: one rounding either way (vLLM GemmaRMSNorm); the flag changes nothing
    config = rms_norm.RmsNormConfig(BLOCK_N=512, ROWS=1, num_warps=4, VLLM_ROUNDING=1)
    gemma = [rms_norm.rms_norm(x, w, rms_norm.RmsNormConfig(**(config.as_params() | {"VLLM_ROUNDING": f})),
                               gemma=True) for f in (0, 1)]
    assert torch.equal(gemma[0], gemma[1])
    assert _agree(gemma[0], rms_norm.rounded_reference(x, w, gemma=True)) >= 0.99


def test_silu_and_mul_and_bias_gelu_rounding_variants() -> None:
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(8, 2 * 300, generator=gen) * 2).to(torch.bfloat16)
    b = torch.randn(600, generator=gen).to(torch.bfloat16)
    for flag in (1, 0):
        y = silu_and_mul.silu_and_mul(x, silu_and_mul.SiluAndMulConfig(BLOCK_N=128, VLLM_ROUNDING=flag))
        assert _agree(y, silu_and_mul.rounded_reference(x, vllm_rounding=flag)) >= 0.99
        other = silu_and_mul.rounded_reference(x, vllm_rounding=1 - flag)
        assert float((y.view(torch.int16) == other.view(torch.int16)).float().mean()) < 0.9
        g = bias_gelu.bias_gelu(x, b, bias_gelu.BiasGeluConfig(BLOCK_N=256, ROWS=2, VLLM_ROUNDING=flag))
        assert _agree(g, bias_gelu.rounded_reference(x, b, vllm_rounding=flag)) >= 0.99
        other = bias_gelu.rounded_reference(x, b, vllm_rounding=1 - flag)
        assert float((g.view(torch.int16) == other.view(torch.int16)).float().mean()) < 0.9
    # VLLM_ROUNDING=1 is what eager PyTorch computes for silu_and_mul: F.silu(a) * b in BF16
    ours = silu_and_mul.silu_and_mul(x, silu_and_mul.DEFAULT)
    eager = torch.nn.functional.silu(x[:, :300]) * x[:, 300:]
    assert _agree(ours, eager) >= 0.99


def test_gated_norm_rounds_once() -> None:
    x, z, w = _norm_inputs("gated_rms_norm", 4, 6 * 128, 128, seed=2)
    y = gated_rms_norm.gated_rms_norm(x, z, w, gated_rms_norm.GatedRmsNormConfig(ROWS=8, num_warps=2))
    assert _agree(y, gated_rms_norm.rounded_reference(x, z, w)) >= 0.99
    # groups really are separate: scaling one group's x leaves the others' outputs unchanged
    x2 = x.clone()
    x2[:, :128] *= 4
    y2 = gated_rms_norm.gated_rms_norm(x2, z, w)
    assert torch.equal(y2[:, 128:], gated_rms_norm.gated_rms_norm(x, z, w)[:, 128:])


def test_in_place_fused_add_matches_out_of_place() -> None:
    x, residual, w = _norm_inputs("gemma_fused_add_rms_norm", 3, 640, 640, seed=4)
    want_y, want_s = fused_add_rms_norm.fused_add_rms_norm(x, residual, w, gemma=True,
                                                           config=fused_add_rms_norm.FusedAddRmsNormConfig(1024))
    xi, ri = x.clone(), residual.clone()
    fused_add_rms_norm.fused_add_rms_norm(xi, ri, w, fused_add_rms_norm.FusedAddRmsNormConfig(1024),
                                          out=(xi, ri), gemma=True)
    assert torch.equal(xi, want_y) and torch.equal(ri, want_s)
    with pytest.raises(ValueError, match="one-pass"):
        fused_add_rms_norm.fused_add_rms_norm(xi, ri, w, fused_add_rms_norm.FusedAddRmsNormConfig(256),
                                              out=(xi, ri))


# ---------------------------------------------------- verification with two outputs
FUSED = Problem("gemma_fused_add_rms_norm", "bf16", 2, 96, 96)


def _fused_good(inputs, out):
    x, residual, w = inputs
    y, s = fused_add_rms_norm.reference(x, residual, w, eps=opspec.EPS, gemma=True)
    out[0].copy_(y.to(torch.bfloat16))
    out[1].copy_(s.to(torch.bfloat16))


def test_two_outputs_are_each_poisoned_and_checked() -> None:
    spec = opspec.get(FUSED.op)
    assert spec.output_names == ("out", "residual_out")
    assert verify.verify(_fused_good, spec, FUSED, CPU, seed=0).ok

    def no_residual(inputs, out):
        _fused_good(inputs, out)
        out[1][1, 5:] = float("nan")  # left as the poison would be

    result = verify.verify(no_residual, spec, FUSED, CPU, seed=0)
    assert not result.ok and result.reason.startswith("residual_out:") and "not written" in result.reason

    def stale_residual(inputs, out):
        _fused_good(inputs, out)
        out[1].copy_(inputs[1])  # the residual not updated

    result = verify.verify(stale_residual, spec, FUSED, CPU, seed=0)
    assert not result.ok and result.reason.startswith("residual_out:") and "exceeds the bound" in result.reason

    def plain_weight(inputs, out):
        x, residual, w = inputs
        y, s = fused_add_rms_norm.reference(x, residual, w, eps=opspec.EPS, gemma=False)  # w, not 1 + w
        out[0].copy_(y.to(torch.bfloat16))
        out[1].copy_(s.to(torch.bfloat16))

    result = verify.verify(plain_weight, spec, FUSED, CPU, seed=0)
    assert not result.ok and result.reason.startswith("out:") and result.err_ratio > 10

    def flaky_residual(inputs, out, calls=[0]):  # noqa: B006 - call counter
        _fused_good(inputs, out)
        calls[0] += 1
        if calls[0] == 2:
            out[1].view(torch.int16)[0, 0] ^= 1

    result = verify.verify(flaky_residual, spec, FUSED, CPU, seed=0)
    assert not result.ok and "residual_out: two runs" in result.reason


def test_exact_numerics_on_two_outputs() -> None:
    kernel = TRITON.build(FUSED, _params(FUSED.op, False), CPU_INFO)
    spec = opspec.get(FUSED.op)
    assert verify.verify(kernel, spec, FUSED, CPU, seed=1, numerics="exact", reference_kernel=kernel).ok

    def one_ulp(inputs, out):
        kernel(inputs, out)
        out[1].view(torch.int16)[0, 1] += 1

    result = verify.verify(one_ulp, spec, FUSED, CPU, seed=1, numerics="exact", reference_kernel=kernel)
    # the residual is checked against its bound first: one ulp passes it, the bits do not
    assert not result.ok and "residual_out: not bit-identical" in result.reason


def test_error_bounds_reject_classic_mistakes() -> None:
    gated = Problem("gated_rms_norm", "bf16", 2, 4 * 32, 32)

    def whole_row_norm(inputs, out):  # one group over the whole row instead of 4
        x, z, w = inputs
        normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + opspec.EPS)
        out.copy_((normed * w.double().repeat(4) * z.double() * torch.sigmoid(z.double())).to(out.dtype))

    result = verify.verify(whole_row_norm, opspec.get(gated.op), gated, CPU, seed=0)
    assert not result.ok and "exceeds the bound" in result.reason

    silu = Problem("silu_and_mul", "bf16", 2, 64, 128)

    def swapped_halves(inputs, out):
        (x,) = inputs
        out.copy_(silu_and_mul.reference(torch.cat([x[:, 64:], x[:, :64]], dim=1)).to(out.dtype))

    assert not verify.verify(swapped_halves, opspec.get(silu.op), silu, CPU, seed=0).ok


# ------------------------------------------------------------------------ rotation
def test_rotation_rotates_activations_and_caps_copies() -> None:
    gpu = DeviceInfo("nvidia", "H200 (no run)", "sm_90", 132, 32, 60 << 20, 0, "cuda", "cpu")
    problem = Problem("fused_add_rms_norm", "bf16", 1, 64, 64)
    spec = opspec.get(problem.op)
    assert spec.rotated_inputs == (0, 1) and spec.limit == "copy"
    rotation = Rotation(spec, problem, gpu)  # tensors on the CPU; sizes as a GPU would get
    # 256 bytes of activations would need ~1M copies for 4x L2: capped
    assert rotation.copies == opspec_elementwise.ELEMENTWISE_MAX_COPIES
    first, second = rotation.inputs[0], rotation.inputs[1]
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    assert first[2] is second[2]  # the weight is shared (not rotated)
    assert isinstance(rotation.outputs[0], tuple) and rotation.outputs[0][0] is not rotation.outputs[1][0]
    big = Problem("silu_and_mul", "bf16", 4096, 17408, 34816)
    assert opspec.get("gemv").rotated_inputs == (1,)
    from tunekit.measure.bench import rotation_copies

    assert rotation_copies(4096 * 34816 * 2, 60 << 20) == 2  # M = 4096: 285 MB of input, cold anyway
    assert opspec.get(big.op).bytes_moved(big) == 3 * 4096 * 17408 * 2


@pytest.mark.parametrize("op", sorted(opspec.OPS))
def test_rotation_size_is_what_a_rotation_allocates(op: str) -> None:
    """bench.rotation_size (what the in-process timing checks before it allocates) sizes every op's
    rotation from meta tensors exactly as Rotation then builds it, on a GPU-described device (copies
    from L2 and max_copies) and on the CPU (two)."""
    from tunekit.measure.bench import rotation_size

    gpu = DeviceInfo("nvidia", "H200 (no run)", "sm_90", 132, 32, 1 << 20, 0, "cuda", "cpu")
    problem = Problem(op, "bf16", 2, 96, 1024)
    spec = opspec.get(op)
    for device in (gpu, CPU_INFO):
        rotation = Rotation(spec, problem, device)
        allocated = sum(copy[i].numel() * copy[i].element_size() for copy in rotation.inputs
                        for i in spec.rotated_inputs)
        assert rotation_size(spec, problem, device) == (rotation.copies, allocated)
    assert rotation_size(spec, problem, gpu)[0] > 2  # the L2 sets the copies here, not the floor


def test_cpu_timing_of_a_two_output_kernel() -> None:
    problem = Problem("fused_add_rms_norm", "bf16", 2, 64, 64)
    kernel = TRITON.build(problem, _params(problem.op, False), CPU_INFO)
    timing = time_kernel(kernel, Rotation(opspec.get(problem.op), problem, CPU_INFO), repeats=1)
    assert timing.kind == "cpu" and timing.median_us > 0 and timing.copies == 2


def test_bytes_moved_are_the_roofline_numerators() -> None:
    def nbytes(op: str, m: int, n: int, k: int) -> int:
        return opspec.get(op).bytes_moved(Problem(op, "bf16", m, n, k))

    assert nbytes("gemma_rms_norm", 4, 5120, 5120) == 2 * (2 * 4 * 5120 + 5120)
    assert nbytes("gemma_fused_add_rms_norm", 4, 5120, 5120) == 2 * (4 * 4 * 5120 + 5120)
    assert nbytes("gated_rms_norm", 4, 6144, 128) == 2 * (3 * 4 * 6144 + 128)
    assert nbytes("silu_and_mul", 4, 17408, 34816) == 2 * (4 * 34816 + 4 * 17408)
    assert nbytes("bias_gelu", 4, 4096, 4096) == 2 * (2 * 4 * 4096 + 4096)


# ------------------------------------------------------------------------ baselines
def test_inductor_baseline_compiles_the_same_composition() -> None:
    inductor = backends.get("inductor")
    assert inductor.kind == "baseline" and "inductor" in backends.BASELINES
    assert inductor.unavailable_reason(CPU_INFO)  # timed on GPUs only
    assert inductor.unavailable_reason(DeviceInfo("nvidia", "x", "sm_90", 1, 32, 1, 1, "cuda", "cuda:0")) is None
    problem = Problem("silu_and_mul", "bf16", 2, 64, 128)
    kernel = inductor.build(problem, {}, CPU_INFO)  # compiles (C++ on the CPU) at the first call
    result = verify.verify(kernel, opspec.get(problem.op), problem, CPU, seed=0)
    assert result.ok, result.reason


@pytest.mark.parametrize("module_name", ["silu_and_mul", "bias_gelu"])
def test_pointwise_kernels_give_the_same_bits_on_the_1d_grid_past_cudas_grid_y_limit(module_name, monkeypatch):
    # M / ROWS above 65535 row blocks takes the 1D grid; force it at a small M.
    import importlib

    module = importlib.import_module(f"kernels_triton.{module_name}")
    gen = torch.Generator().manual_seed(7)
    cfg = module.Config(BLOCK_N=128, ROWS=2, num_warps=4)
    if module_name == "silu_and_mul":
        inputs = (torch.randn(5, 2 * 300, generator=gen).to(torch.bfloat16),)
    else:
        inputs = (torch.randn(5, 300, generator=gen).to(torch.bfloat16),
                  torch.randn(300, generator=gen).to(torch.bfloat16))
    run = module.silu_and_mul if module_name == "silu_and_mul" else module.bias_gelu
    two_d = run(*inputs, cfg)
    from kernels_triton import tiles

    monkeypatch.setattr(tiles, "MAX_GRID_Y", 1)
    assert torch.equal(run(*inputs, cfg), two_d)
