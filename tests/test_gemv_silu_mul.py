"""SiLU-and-mul in gate_up_proj's epilogue (``gemv_silu_mul``, and ``rms_gemv_silu_mul`` after a folded
norm): the paired weight layout, a bound that catches the wrong pairing, a missing SiLU or scale and
swapped halves, the problems a model has, the search's plumbing, and what the kernel refuses. Odd sizes
and every M layout: test_gemv_epilogues.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemv_epilogues import check

import search_spaces
from kernels_triton.gemv import DEFAULT, GemvConfig, gemv
from tunekit.backends.triton import BACKEND as TRITON
from tunekit.backends.vendor import VendorBackend
from tunekit.measure import verify
from tunekit.measure.device import detect
from tunekit.problems import opspec, opspec_gemv, shapes
from tunekit.problems.models import load_model
from tunekit.problems.shapes import Problem

CPU = torch.device("cpu")
CONFIG = GemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1)


def test_interleave_pairs_each_gate_row_with_its_up_row() -> None:
    w = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)  # gate rows 0..2, up rows 3..5
    paired = opspec_gemv.interleave_gate_up(w)
    assert [int(r[0]) // 3 for r in paired] == [0, 3, 1, 4, 2, 5]
    with pytest.raises(ValueError, match="even"):
        opspec_gemv.interleave_gate_up(torch.zeros(5, 3))


@pytest.mark.parametrize("op", shapes.GLU_GEMV_OPS)
def test_it_is_gate_up_then_vllms_silu_and_mul(op: str) -> None:
    """On the paired weight the kernel gives what mm on [gate; up] then SiLU-and-mul gives, up to BF16."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 200, generator=gen).bfloat16()
    w = (torch.randn(38, 200, generator=gen) / 200**0.5).bfloat16()
    rms = op.startswith("rms_")
    y = gemv(x, opspec_gemv.interleave_gate_up(w), CONFIG, rms_eps=opspec.EPS if rms else None, glu=True)
    xin = F.rms_norm(x.float(), (200,), eps=opspec.EPS) if rms else x.float()
    gate_up = xin @ w.float().T
    unfused = F.silu(gate_up[:, :19]) * gate_up[:, 19:]
    assert y.shape == (2, 19)
    assert (y.float() - unfused).abs().max() < 0.03 < unfused.abs().max()


def test_n2_one_pair_and_the_default_config() -> None:
    check("gemv_silu_mul", 1, 2, 96, DEFAULT)
    check("rms_gemv_silu_mul", 2, 2, 4100, DEFAULT)
    check("gemv_silu_mul", 1, 22, 5120, GemvConfig(BLOCK_N=2, BLOCK_K=256, num_warps=1, num_stages=4,
                                                    W_EVICT="evict_first"))


@pytest.mark.parametrize("op", shapes.GLU_GEMV_OPS)
def test_the_bound_catches_the_wrong_pairing_activation_or_scale(op: str) -> None:
    problem = Problem(op, "bf16", 3, 38, 200)
    rms_eps = opspec.EPS if op.startswith("rms_") else None

    def unpaired(inputs, out):  # the [gate; up] layout read as pairs
        x, w = inputs
        unpair = w.view(19, 2, 200).transpose(0, 1).reshape(38, 200)
        gemv(x, unpair, CONFIG, out=out, rms_eps=rms_eps, glu=True)

    def swapped(inputs, out):  # silu(up) * gate
        x, w = inputs
        gemv(x, w.view(19, 2, 200).flip(1).reshape(38, 200), CONFIG, out=out, rms_eps=rms_eps, glu=True)

    def no_silu(inputs, out):
        x, w = inputs
        dots = gemv(x, w, CONFIG, rms_eps=rms_eps).float()
        out.copy_(dots[:, 0::2] * dots[:, 1::2])

    wrongs = [unpaired, swapped, no_silu]
    if rms_eps is not None:
        def unscaled(inputs, out):
            gemv(inputs[0], inputs[1], CONFIG, out=out, glu=True)
        wrongs.append(unscaled)
    for wrong in wrongs:
        result = verify.verify(wrong, opspec.OPS[op], problem, CPU, seed=0)
        assert not result.ok and "exceeds the bound" in result.reason, wrong.__name__


@pytest.mark.parametrize("bad", [dict(SPLIT_K=2), dict(BLOCK_N=1)])
def test_split_k_and_a_single_row_per_program_are_refused(bad: dict) -> None:
    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(8, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="glu needs"):
        gemv(x, w, GemvConfig(BLOCK_K=64, **bad), glu=True)
    with pytest.raises(ValueError, match="even"):
        opspec.OPS["gemv_silu_mul"].make_inputs(Problem("gemv_silu_mul", "bf16", 1, 7, 64), CPU,
                                                 torch.Generator().manual_seed(0))


def test_a_model_lists_gate_up_with_its_activation_in_both_forms() -> None:
    spec = load_model("qwen3.5-27b")
    problems = {(p.op, p.n, p.k): p.count for p in spec.problems(ops=shapes.OP_FAMILIES["gemv_silu_mul"])}
    assert problems == {("gemv_silu_mul", 34816, 5120): 64, ("rms_gemv_silu_mul", 34816, 5120): 64}
    assert shapes.GLU_GEMV_OPS[0] in shapes.OP_FAMILIES["fused_gemv"]


def test_the_search_plumbing_space_kernel_and_vendor_baseline() -> None:
    space = search_spaces.load("rms_gemv_silu_mul", "triton")
    assert 1 not in space.domains["BLOCK_N"] and space.domains["SPLIT_K"] == [1]
    device = detect()
    for op in shapes.GLU_GEMV_OPS:
        problem = Problem(op, "bf16", 2, 38, 200)
        tuned = TRITON.build(problem, space.default, device)
        vendor = VendorBackend().build(problem, {}, device)
        for kernel in (tuned, vendor):
            result = verify.verify(kernel, opspec.OPS[op], problem, CPU, seed=1)
            assert result.ok, (op, result.reason)
