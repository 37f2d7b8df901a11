"""The GEMV kernel's fused variants (``gemv_add``: the residual in the epilogue; ``rms_gemv``: a folded
RMSNorm's scale; ``gemv_silu_mul`` / ``rms_gemv_silu_mul``: SiLU-and-mul of (gate, up) row pairs) at odd
sizes and in every M layout, under the interpreter, against their bounds."""

from __future__ import annotations

import pytest
from gemv_epilogues import VARIANTS, check

from kernels_triton.gemv import GemvConfig


@pytest.mark.parametrize("op", sorted(VARIANTS))
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_every_m_with_both_tails(op: str, m: int) -> None:
    # N=37 (38 pairs of rows: gate_up is even) not a multiple of BLOCK_N=8, K=200 not a multiple of
    # BLOCK_K=64 (rms_: the masked x loads add no squares)
    assert 0 < check(op, m, _n(op), 200, GemvConfig(BLOCK_N=8, BLOCK_K=64, num_warps=1), seed=m) <= 1


@pytest.mark.parametrize("op", sorted(VARIANTS))
@pytest.mark.parametrize("mode", ["rows", "dot", "dot_w"])
def test_the_other_m_layouts(op: str, mode: str) -> None:
    block_n = 4 if mode == "rows" else 16
    check(op, 3, _n(op), 200, GemvConfig(BLOCK_N=block_n, BLOCK_K=64, num_warps=1, M_MODE=mode))


def _n(op: str) -> int:
    return 38 if op.endswith("silu_mul") else 37
