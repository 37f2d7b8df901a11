"""The tile walk of the pointwise kernels (silu_and_mul, bias_gelu): which
[ROWS, BLOCK_N] output tile a program owns.

Column blocks are the fast axis: consecutive programs stream consecutive bytes
of a row (a grid walking down the rows first lost ~4% to Inductor's flat
kernel at M=4096 on the H200). The grid is (column blocks, row blocks) while
the row blocks fit CUDA's limit of grid axis 1 (no integer division on the way
to the first load, which shows at the ~1.3 us of M=1), else 1D with the
row/column split computed in the kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: CUDA's limit on grid axis 1 (the row blocks of the 2D grid).
MAX_GRID_Y = 65535


def pointwise_grid(m: int, n: int, rows: int, block_n: int) -> tuple[tuple[int, ...], bool]:
    """(grid, GRID_2D) for an [m, n] output in [rows, block_n] tiles."""
    row_blocks, col_blocks = triton.cdiv(m, rows), triton.cdiv(n, block_n)
    if row_blocks <= MAX_GRID_Y:
        return (col_blocks, row_blocks), True
    return (col_blocks * row_blocks,), False


@triton.jit
def tile_offsets(N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, GRID_2D: tl.constexpr):
    """Row and column offsets of this program's tile (see the module docstring)."""
    if GRID_2D:
        offs_m = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        col_blocks = tl.cdiv(N, BLOCK_N)
        pid = tl.program_id(0)
        offs_m = (pid // col_blocks) * ROWS + tl.arange(0, ROWS)
        cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, cols
