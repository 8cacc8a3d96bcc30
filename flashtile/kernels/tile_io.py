"""Loads and stores of (rows x head_dim) tiles with the masks they need, and no more."""

import triton
import triton.language as tl


@triton.jit
def load_tile(base, rows, offs_d, stride_row, n_rows,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load base[rows, :HEAD_DIM] into a (len(rows), BLOCK_D) tile, zeros where masked."""
    ptrs = base + rows[:, None] * stride_row + offs_d[None, :]
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def store_tile(base, tile, rows, offs_d, stride_row, n_rows,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a (len(rows), BLOCK_D) tile to base[rows, :HEAD_DIM], skipping rows >= n_rows."""
    ptrs = base + rows[:, None] * stride_row + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
