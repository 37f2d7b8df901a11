"""The one correctness path rejects every kind of wrong kernel it promises to catch."""

from __future__ import annotations

import torch

from tunekit.measure import verify
from tunekit.problems import opspec_gemv
from tunekit.problems.shapes import Problem

CPU = torch.device("cpu")
PROBLEM = Problem("gemv", "bf16", 2, 24, 64)


def _exact(inputs, out):
    x, w = inputs
    out.copy_((x.double() @ w.double().T).to(out.dtype))


def test_a_correct_kernel_passes_and_records_its_error() -> None:
    result = verify.verify(_exact, opspec_gemv.GEMV, PROBLEM, CPU, seed=0)
    assert result.ok
    assert result.max_abs_err >= 0 and result.err_ratio <= 1


def test_unwritten_elements_are_caught_by_the_poison() -> None:
    def skips_last_row(inputs, out):
        x, w = inputs
        out[:, :-1] = (x.double() @ w[:-1].double().T).to(out.dtype)

    result = verify.verify(skips_last_row, opspec_gemv.GEMV, PROBLEM, CPU, seed=0)
    assert not result.ok and "not written" in result.reason


def test_a_dropped_k_chunk_exceeds_the_bound() -> None:
    def drops_chunk(inputs, out):
        x, w = inputs
        out.copy_((x[:, 8:].double() @ w[:, 8:].double().T).to(out.dtype))

    result = verify.verify(drops_chunk, opspec_gemv.GEMV, PROBLEM, CPU, seed=0)
    assert not result.ok and "exceeds the bound" in result.reason and result.err_ratio > 1


def test_non_finite_output_is_caught() -> None:
    def inf_kernel(inputs, out):
        _exact(inputs, out)
        out[0, 0] = float("inf")

    result = verify.verify(inf_kernel, opspec_gemv.GEMV, PROBLEM, CPU, seed=0)
    assert not result.ok and "non-finite" in result.reason


def test_nondeterminism_is_caught() -> None:
    calls = {"n": 0}

    def flaky(inputs, out):
        _exact(inputs, out)
        calls["n"] += 1
        if calls["n"] == 2:  # the second run flips one low bit of one element
            bits = out.view(torch.int16)
            bits[0, 0] ^= 1

    result = verify.verify(flaky, opspec_gemv.GEMV, PROBLEM, CPU, seed=0)
    assert not result.ok and "differ" in result.reason


def test_exact_mode_accepts_equal_bits_and_rejects_one_ulp() -> None:
    assert verify.verify(_exact, opspec_gemv.GEMV, PROBLEM, CPU, seed=1, numerics="exact", reference_kernel=_exact).ok

    def one_ulp_off(inputs, out):
        _exact(inputs, out)
        out.view(torch.int16)[1, 3] += 1

    result = verify.verify(one_ulp_off, opspec_gemv.GEMV, PROBLEM, CPU, seed=1, numerics="exact",
                           reference_kernel=_exact)
    assert not result.ok and "bit-identical" in result.reason


def test_inputs_are_fresh_random_and_never_zero() -> None:
    gen = torch.Generator().manual_seed(5)
    x, w = opspec_gemv.GEMV.make_inputs(PROBLEM, CPU, gen)
    assert x.dtype == torch.bfloat16 and w.shape == (24, 64)
    assert (x != 0).float().mean() > 0.95 and (w != 0).float().mean() > 0.95
    x2, _ = opspec_gemv.GEMV.make_inputs(PROBLEM, CPU, torch.Generator().manual_seed(6))
    assert not torch.equal(x, x2)
