"""Every Triton GEMV family at every M = 1..16 (odd M included: speculative decoding's verify steps run
M = 1 + k), under the interpreter, through the one verify path (fp64 reference, the op's BF16 bound).

The fast tier runs every (op, M) once, the M layout and the shape cycling with M so each layout and
shape meets odd and even M; the slow tier runs the whole product of ops, M, layouts and shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels_triton import gemv as gemv_mod
from kernels_triton import rms_norm_gemv as norm_gemv_mod
from kernels_triton import silu_mul_gemv as act_gemv_mod
from kernels_triton.config import GEMV_MAX_M
from tunekit.measure import verify
from tunekit.problems import opspec
from tunekit.problems.shapes import GEMV_MAX_M as SHAPES_GEMV_MAX_M
from tunekit.problems.shapes import Problem

CPU = torch.device("cpu")
MS = range(1, 17)
#: (N, K): tails on both (N not a multiple of BLOCK_N, K not of BLOCK_K); the glu ops take N + 1 (even)
SHAPES = ((37, 200), (13, 77))

_G = gemv_mod.GemvConfig
#: the GEMV kernel's M layouts, each under the register budget at M = 16 (BLOCK_M 16 x 8 x 64 = 64 per thread)
GEMV_LAYOUTS = {
    "tile": _G(BLOCK_N=8, BLOCK_K=64, num_warps=2),
    "rows": _G(BLOCK_N=8, BLOCK_K=64, num_warps=2, M_MODE="rows"),
    "dot": _G(BLOCK_N=16, BLOCK_K=64, num_warps=1, M_MODE="dot"),
    "dot_w": _G(BLOCK_N=16, BLOCK_K=64, num_warps=1, M_MODE="dot_w"),
}
NORM_LAYOUTS = {
    "tile": norm_gemv_mod.RmsNormGemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=2, ONE_PASS=0),
    "one_pass": norm_gemv_mod.RmsNormGemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=2, ONE_PASS=1),
}
_A = act_gemv_mod.SiluMulGemvConfig
ACT_LAYOUTS = {
    "tile": _A(BLOCK_N=8, BLOCK_K=64, num_warps=2),
    "dot": _A(BLOCK_N=16, BLOCK_K=64, num_warps=1, M_MODE="dot"),
    "dot_w": _A(BLOCK_N=16, BLOCK_K=64, num_warps=1, M_MODE="dot_w"),
}


def _gemv_call(op: str) -> Callable[..., None]:
    if op == "gemv":
        return lambda inputs, out, config: gemv_mod.gemv(inputs[0], inputs[1], config, out=out)
    return lambda inputs, out, config: gemv_mod.launch(op, inputs, out, config, eps=opspec.EPS)


#: op -> (its kernel's predicate, how it is called, its layouts); ``fast``: in the fast tier
FAMILIES: dict[str, tuple[Callable[..., str | None], Callable[..., None], dict[str, Any]]] = {
    **{op: (gemv_mod.invalid_reason, _gemv_call(op), GEMV_LAYOUTS) for op in ("gemv", *gemv_mod.FUSED_OPS)},
    **{op: (norm_gemv_mod.invalid_reason,
            lambda inputs, out, config, op=op: norm_gemv_mod.launch(op, inputs, out, config, opspec.EPS),
            NORM_LAYOUTS) for op in norm_gemv_mod.OPS},
    "silu_mul_gemv": (act_gemv_mod.invalid_reason,
                      lambda inputs, out, config: act_gemv_mod.launch("silu_mul_gemv", inputs, out, config),
                      ACT_LAYOUTS),
}
#: the norm-prologue family's four ops differ in the norm's weight convention and residual only: the fast
#: tier takes one with and one without the residual
FAST_OPS = [op for op in FAMILIES if op not in ("gemma_rms_norm_gemv", "gemma_fused_add_rms_norm_gemv")]


def _check(op: str, m: int, shape: tuple[int, int], layout: str, seed: int) -> None:
    predicate, call, layouts = FAMILIES[op]
    config = layouts[layout]
    n, k = shape
    n += op.endswith("silu_mul") and n % 2  # gate_up's (gate, up) row pairs: even N
    problem = Problem(op, "bf16", m, n, k)
    assert predicate(config, m, n, k) is None, predicate(config, m, n, k)
    result = verify.verify(lambda inputs, out: call(inputs, out, config), opspec.get(op), problem, CPU, seed=seed)
    assert result.ok, f"{op} M={m} {n}x{k} {layout}: {result.reason}"
    assert 0 < result.err_ratio <= 1.0


def _layout_for(op: str, m: int) -> str:
    """The layout the fast tier runs (op, m) in: cycling with m, skipping "rows" at M=1 (the tile kernel)."""
    names = [name for name in FAMILIES[op][2] if not (name == "rows" and m == 1)]
    return names[m % len(names)]


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("op", FAST_OPS)
def test_every_family_at_every_m(op: str, m: int) -> None:
    _check(op, m, SHAPES[m % 2], _layout_for(op, m), seed=m)


@pytest.mark.slow  # the whole product: ~600 interpreted launches
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("op", list(FAMILIES))
def test_every_family_m_layout_and_shape(op: str, m: int, shape: tuple[int, int]) -> None:
    for layout in FAMILIES[op][2]:
        if not (layout == "rows" and m == 1):
            _check(op, m, shape, layout, seed=m)


def test_the_m_limit_is_16_everywhere_and_refused_past_it() -> None:
    assert GEMV_MAX_M == SHAPES_GEMV_MAX_M == gemv_mod.MAX_M == 16
    for op, (predicate, _, layouts) in FAMILIES.items():
        config = next(iter(layouts.values()))
        assert predicate(config, 16, 64, 256) is None, op
        reason = predicate(config, 17, 64, 256)
        assert reason is not None and "outside 1..16" in reason, (op, reason)


def test_the_defaults_run_every_m_on_the_model_shapes() -> None:
    # the fallback configs are what an entry-less search trial and a "tactic -1" start from
    for module in (gemv_mod, norm_gemv_mod, act_gemv_mod):
        for n, k in ((96, 5120), (5120, 17408), (248320, 5120), (34816, 5120), (37, 200)):
            for m in MS:
                assert module.invalid_reason(module.DEFAULT, m, n, k) is None, (module.__name__, m, n, k)


def test_sixteen_rows_pay_the_register_budget() -> None:
    # M = 16 rows of [BLOCK_N, BLOCK_K] accumulators: a tile M = 8 fits can be too large at M = 16
    config = _G(BLOCK_N=8, BLOCK_K=128, num_warps=2, M_MODE="rows")
    assert gemv_mod.invalid_reason(config, 8, 64, 512) is None
    assert "register budget" in gemv_mod.invalid_reason(config, 9, 64, 512)
