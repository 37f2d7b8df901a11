"""Serving an M between two tabulated ones (entries at M = 1, 2, 4, 8, 16; calls at 3, 5, 12 ...): the next
tabulated M whose entry's config runs at that M, an entry that cannot passed over, the stock path only
where none can; the markers record which tabulated M served each call (``served_m``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_ops import _entry, _rows, _within_bound, _xw, make_table

from tunekit import ops

pytestmark = pytest.mark.usefixtures("clean_ops")  # conftest.py: no table, markers or vendor GEMM leak

N, K = 24, 192
#: valid at every M <= 16 (a [16, 4, 64] accumulator tile is 64 values per thread of 2 warps)
TILE = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 2, "num_stages": 1}
#: per-row accumulators: not a config M = 1 runs (it is the tile kernel there)
ROWS = dict(TILE, M_MODE="rows")


def _served(m: int, seed: int = 0) -> dict:
    """Call the GEMV at M = ``m``, check its output against the fp64 bound, return its marker row."""
    x, w = _xw(m, N, K, seed=seed)
    y = torch.ops.tunekit.gemv(x, w, None)
    assert _within_bound(y, x, w), m
    (row,) = _rows(shape=f"{N}x{K}", m=m)
    return row


def test_every_m_to_16_is_served_by_the_next_tabulated_m(tmp_path: Path) -> None:
    ops.load_tables(str(make_table(tmp_path / "t.json", [_entry("gemv", m, N, K, params=TILE)
                                                         for m in (1, 2, 4, 8, 16)])))
    served = {m: _served(m, seed=m) for m in range(1, 17)}
    assert {m: (r["impl"], r["served_m"]) for m, r in served.items()} == {
        m: ("tuned:triton", next(t for t in (1, 2, 4, 8, 16) if t >= m)) for m in range(1, 17)}
    assert _served(17)["impl"] == "fallback:m_above_table" and _rows(m=17)[0]["served_m"] is None


def test_an_entry_whose_config_cannot_run_the_m_is_passed_over_for_the_next(tmp_path: Path) -> None:
    # M = 1 has no entry; M = 2's winner runs per-row accumulators, which M = 1 cannot: M = 4's serves it
    rows = [_entry("gemv", 2, N, K, params=ROWS), _entry("gemv", 4, N, K, params=TILE)]
    ops.load_tables(str(make_table(tmp_path / "t.json", rows)))
    assert (_served(1)["impl"], _served(1)["served_m"]) == ("tuned:triton", 4)
    assert (_served(2)["impl"], _served(2)["served_m"]) == ("tuned:triton", 2)
    assert (_served(3)["impl"], _served(3)["served_m"]) == ("tuned:triton", 4)


def test_the_stock_path_only_where_no_entry_above_can_run_the_m(tmp_path: Path) -> None:
    rows = [_entry("gemv", 2, N, K, params=ROWS), _entry("gemv", 8, N, K, params=ROWS)]
    ops.load_tables(str(make_table(tmp_path / "t.json", rows)))
    row = _served(1)
    assert row["impl"] == "fallback:config_invalid_at_m" and row["served_m"] is None
    assert row["vendor"] is not None  # what served it is named, as every fallback's


def test_the_fused_gemvs_record_the_serving_m(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    ops.load_tables(str(make_table(tmp_path / "t.json", [_entry("gemv_add", m, N, K, params=TILE)
                                                         for m in (4, 16)])))
    for m in (3, 12):
        x, w = _xw(m, N, K, seed=m)
        r = torch.randn((m, N), generator=gen).bfloat16()
        torch.ops.tunekit.gemv_add(x, w, r)
    got = {row["m"]: (row["impl"], row["served_m"]) for row in _rows(op="gemv_add")}
    assert got == {3: ("tuned:triton", 4), 12: ("tuned:triton", 16)}
