"""The residual add in the GEMV epilogue (``gemv_add``): interpreter correctness (odd sizes and every M
layout: test_gemv_epilogues.py), every store site of the kernel, the problems a model has, and the
search's plumbing (backend, space, vendor baseline)."""

from __future__ import annotations

import pytest
import torch
from gemv_epilogues import check

import search_spaces
from kernels_triton.gemv import DEFAULT, GemvConfig, gemv, reference
from tunekit.backends.triton import BACKEND as TRITON
from tunekit.backends.vendor import VendorBackend
from tunekit.measure import verify
from tunekit.measure.device import detect
from tunekit.problems import opspec_gemv, shapes
from tunekit.problems.models import load_model
from tunekit.problems.shapes import Problem

CPU = torch.device("cpu")


@pytest.mark.parametrize("split_reduce", ["kernel", "fused"])
def test_split_k_adds_the_residual_once(split_reduce: str) -> None:
    """With SPLIT_K > 1 the residual is added where the partials are summed (the reduce kernel, or the last
    split): once, whichever split finishes last."""
    check("gemv_add", 3, 29, 330, GemvConfig(BLOCK_N=4, BLOCK_K=16, num_warps=1, SPLIT_K=3, SPLIT_REDUCE=split_reduce))


def test_n1_and_the_default_config() -> None:
    check("gemv_add", 1, 1, 96, DEFAULT)
    check("gemv_add", 2, 5, 4100, DEFAULT)


def test_in_place_on_the_residual_gives_the_same_bits() -> None:
    """vLLM updates the residual stream in place: out may be the residual itself."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 256, generator=gen).bfloat16()
    w = (torch.randn(24, 256, generator=gen) / 16).bfloat16()  # |x W^T| ~ 1, as the residual
    residual = torch.randn(2, 24, generator=gen).bfloat16()
    for config in (GemvConfig(BLOCK_N=4, BLOCK_K=64, num_warps=1),
                   GemvConfig(BLOCK_N=4, BLOCK_K=64, num_warps=1, SPLIT_K=4, SPLIT_REDUCE="fused")):
        separate = gemv(x, w, config, residual=residual)
        stream = residual.clone()
        gemv(x, w, config, out=stream, residual=stream)
        assert torch.equal(separate.view(torch.int16), stream.view(torch.int16))
        # and it is the residual added: far from the plain GEMV, close to the fp64 sum
        err = (separate.double() - reference(x, w, residual)).abs().max().item()
        assert err < 0.05 < (gemv(x, w, config).double() - reference(x, w, residual)).abs().max().item()


def test_the_bound_catches_a_missing_or_doubled_residual_and_admits_vllms_sequence() -> None:
    problem = Problem("gemv_add", "bf16", 3, 37, 200)
    config = GemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1)

    def missing(inputs, out):
        gemv(inputs[0], inputs[1], config, out=out)

    def doubled(inputs, out):
        gemv(inputs[0], inputs[1], config, out=out, residual=(2 * inputs[2].float()).bfloat16())

    def vllm_sequence(inputs, out):  # BF16 GEMV output, then the add in fp32 rounded again
        out.copy_((gemv(inputs[0], inputs[1], config).float() + inputs[2].float()).bfloat16())

    for wrong in (missing, doubled):
        result = verify.verify(wrong, opspec_gemv.GEMV_ADD, problem, CPU, seed=0)
        assert not result.ok and "exceeds the bound" in result.reason
    assert verify.verify(vllm_sequence, opspec_gemv.GEMV_ADD, problem, CPU, seed=0).ok


def test_a_residual_of_the_wrong_shape_is_refused() -> None:
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual must be"):
        gemv(x, w, residual=torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual must be"):
        gemv(x, w, residual=torch.zeros(8, 2, dtype=torch.bfloat16).t())


def test_the_model_problems_are_the_gemvs_that_write_the_residual() -> None:
    qwen = load_model("qwen3.5-27b")
    problems = qwen.problems(m_list=[1], ops=["gemv_add"])
    # o_proj (16 full-attention layers) and out_proj (48 linear-attention layers) share 5120x6144
    assert {(p.n, p.k, p.count) for p in problems} == {(5120, 6144, 64), (5120, 17408, 64)}
    assert {n for p in problems for n in p.names} == {"o_proj", "linear_attn.out_proj", "mlp.down_proj"}
    llama = load_model("llama-3.1-8b")
    assert {(p.n, p.k, p.count) for p in llama.problems(ops=["gemv_add"])} == {(4096, 4096, 32), (4096, 14336, 32)}
    # tensor parallel: the partial sums are all-reduced before the add; no rank can fuse it
    assert llama.residual_gemvs(tp=2) == [] and llama.problems(tp=2, ops=["gemv_add"]) == []


def test_op_selection_and_ad_hoc_shapes() -> None:
    assert shapes.parse_ops("gemv_add") == ("gemv_add",)
    assert "gemv_add" in shapes.parse_ops("fused_gemv")
    (problem,) = shapes.adhoc_problems(["gemv_add:96x256"], [1])
    assert (problem.op, problem.n, problem.k, problem.shape_text) == ("gemv_add", 96, 256, "96x256")
    assert problem.weight_bytes == 96 * 256 * 2
    # the bytes a call must move: W, x, y and the residual read
    assert opspec_gemv.GEMV_ADD.bytes_moved(problem) == (96 * 256 + 256 + 96 + 96) * 2


def test_the_search_builds_it_on_the_gemv_kernel_and_space() -> None:
    """Triton serves gemv_add from the GEMV's module and TOML (the same tunables, so a GEMV table seeds it);
    the vendor baseline is BLAS with its own epilogue, addmm; both pass the op's verification."""
    problem = Problem("gemv_add", "bf16", 2, 40, 384)
    space = TRITON.space(problem)
    assert space.domains == search_spaces.load("gemv", "triton").domains
    params = dict(space.default, BLOCK_K=64, SPLIT_K=3, SPLIT_REDUCE="fused")
    assert TRITON.invalid_reason(problem, params) is None
    device = detect()
    tuned = TRITON.build(problem, params, device)
    assert verify.verify(tuned, opspec_gemv.GEMV_ADD, problem, CPU, seed=1).ok
    vendor = VendorBackend()
    assert "gemv_add" in vendor.ops and "addmm" in vendor.kernel_name(problem)
    assert verify.verify(vendor.build(problem, {}, device), opspec_gemv.GEMV_ADD, problem, CPU, seed=1).ok
