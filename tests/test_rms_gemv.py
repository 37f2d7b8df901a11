"""The GEMV of a folded RMSNorm (``rms_gemv``: y = (x / rms(x)) @ W'^T): interpreter correctness at N=1
and K past a block (odd sizes and every M layout: test_gemv_epilogues.py), a bound that catches a missing
or misplaced scale, the weight folding it serves, the problems a model has, and the search's plumbing
(backend, space, seeds, vendor baseline)."""

from __future__ import annotations

import pytest
import torch
from gemv_epilogues import check

from kernels_triton.gemv import DEFAULT, GemvConfig, gemv
from tunekit.backends.triton import BACKEND as TRITON
from tunekit.backends.vendor import VendorBackend
from tunekit.measure import verify
from tunekit.measure.device import detect
from tunekit.problems import opspec, opspec_gemv, shapes
from tunekit.problems.models import load_model
from tunekit.problems.shapes import Problem

CPU = torch.device("cpu")


def test_n1_the_default_and_the_one_row_per_program_config() -> None:
    check("rms_gemv", 1, 1, 96, DEFAULT)
    check("rms_gemv", 2, 5, 4100, DEFAULT)
    check("rms_gemv", 1, 19, 5120, GemvConfig(BLOCK_N=1, BLOCK_K=256, num_warps=1, num_stages=4, W_EVICT="evict_first"))


def test_the_bound_catches_a_missing_or_misplaced_scale() -> None:
    problem = Problem("rms_gemv", "bf16", 3, 37, 200)
    config = GemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1)

    def unscaled(inputs, out):
        gemv(inputs[0], inputs[1], config, out=out)

    def rows_swapped(inputs, out):  # each row scaled by another row's rms
        x, w = inputs
        rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + opspec.EPS).flip(0)
        out.copy_((gemv(x, w, config).float() * rstd).bfloat16())

    for wrong in (unscaled, rows_swapped):
        result = verify.verify(wrong, opspec_gemv.RMS_GEMV, problem, CPU, seed=0)
        assert not result.ok and "exceeds the bound" in result.reason


def test_split_k_is_refused_with_the_scale() -> None:
    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(8, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="SPLIT_K = 1"):
        gemv(x, w, GemvConfig(BLOCK_K=64, SPLIT_K=2), rms_eps=1e-6)


@pytest.mark.parametrize("gemma", [False, True])
def test_folding_the_norm_weight_serves_the_norm_then_gemv(gemma: bool) -> None:
    """rms_gemv on W' = W diag(g) (Gemma: diag(1 + g)) is the weighted norm followed by the GEMV, up to
    BF16 roundings of the same size as the activation's own (the weight's instead)."""
    gen = torch.Generator().manual_seed(3)
    m, n, k = 2, 48, 320
    x = (3 * torch.randn(m, k, generator=gen)).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    g = (0.5 + 0.1 * torch.randn(k, generator=gen)).bfloat16()
    scale = (1.0 + g.float()) if gemma else g.float()
    folded = (w.float() * scale).bfloat16()
    y = gemv(x, folded, GemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1), rms_eps=1e-6).double()
    xd = x.double()
    normed = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * scale.double()
    exact = normed @ w.double().T
    # BF16 roundings of W' (instead of the normalised activation's): |dy| <= u sum |a_k W_k|
    bound = 2.0**-8 * (normed.abs() @ w.double().abs().T) + 2.0**-8 * exact.abs()
    assert ((y - exact).abs() <= bound).all()
    assert (y - (xd @ folded.double().T)).abs().max() > 0.5  # and the scale did something


def test_the_model_problems_are_every_consumer_of_a_decoder_norm() -> None:
    qwen = load_model("qwen3.5-27b")
    problems = qwen.problems(m_list=[1], ops=["rms_gemv"])
    # qkv_proj in 16 full-attention layers, in_proj_qkvz and in_proj_ba in 48 linear-attention ones
    # (one GEMV of their joined rows, 16384 + 96: tunekit serves the folded siblings as one launch),
    # gate_up_proj in all 64
    assert {(p.n, p.k, p.count) for p in problems} == {(14336, 5120, 16), (16480, 5120, 48), (34816, 5120, 64)}
    llama = load_model("llama-3.1-8b")
    assert {(p.n, p.k, p.count) for p in llama.problems(ops=["rms_gemv"])} == {(6144, 4096, 32), (28672, 4096, 32)}


def test_op_selection_and_ad_hoc_shapes() -> None:
    assert shapes.parse_ops("rms_gemv") == ("rms_gemv",)
    assert "rms_gemv" in shapes.parse_ops("fused_gemv")
    (problem,) = shapes.adhoc_problems(["rms_gemv:96x256"], [1])
    assert (problem.op, problem.n, problem.k) == ("rms_gemv", 96, 256)
    gemv_problem = Problem("gemv", "bf16", 1, 96, 256)
    assert opspec_gemv.RMS_GEMV.bytes_moved(problem) == opspec_gemv.GEMV.bytes_moved(gemv_problem)


def test_the_search_builds_it_on_the_gemv_kernel_without_split_k() -> None:
    """Triton serves rms_gemv from the GEMV's module with its tunables but SPLIT_K = 1, so a GEMV table
    seeds it (a split-K winner is left out); the vendor baseline is the unweighted norm then mm."""
    from tunekit.search.studies import _seeds_from_files

    problem = Problem("rms_gemv", "bf16", 2, 40, 384)
    space = TRITON.space(problem)
    assert space.domains["SPLIT_K"] == [1]
    params = dict(space.default, BLOCK_K=64, M_MODE="rows")
    assert TRITON.invalid_reason(problem, params) is None
    device = detect()
    tuned = TRITON.build(problem, params, device)
    assert verify.verify(tuned, opspec_gemv.RMS_GEMV, problem, CPU, seed=1).ok
    vendor = VendorBackend()
    assert "rms_gemv" in vendor.ops and "rms_norm_then_mm" in vendor.kernel_name(problem)
    assert verify.verify(vendor.build(problem, {}, device), opspec_gemv.RMS_GEMV, problem, CPU, seed=1).ok
    from pathlib import Path

    recorded = Path(__file__).resolve().parents[1] / "benchmarks/results/h200-decode-944f424/main/table.json"
    seeds = _seeds_from_files([recorded], "triton", Problem("rms_gemv", "bf16", 1, 14336, 5120), space.domains,
                              space.default)
    assert seeds and all(s["SPLIT_K"] == 1 for s in seeds)
