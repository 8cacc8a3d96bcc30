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


@triton.jit
def load_rows(src, b, h, start, rows, offs_d, stride_row, n_rows,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``rows = start + arange`` of one (batch, head) as a (len(rows), BLOCK_D) tile.

    With USE_TMA, ``src`` is a 4-D tensor descriptor over the whole (b, s, h, d) tensor
    (block (1, len(rows), 1, BLOCK_D)) and the copy engine zero-fills rows and columns
    out of range; otherwise ``src`` points at this (batch, head)'s row 0.
    """
    if USE_TMA:
        tile = src.load([b, start, h, 0])
        tile = tile.reshape(tile.shape[1], tile.shape[3])
    else:
        tile = load_tile(src, rows, offs_d, stride_row, n_rows, HEAD_DIM, BLOCK_D, CHECK_ROWS)
    return tile


@triton.jit
def store_rows(dst, tile, b, h, start, rows, offs_d, stride_row, n_rows,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """The inverse of :func:`load_rows`: rows and columns out of range are not written."""
    if USE_TMA:
        dst.store([b, start, h, 0], tile.reshape(1, tile.shape[0], 1, tile.shape[1]))
    else:
        store_tile(dst, tile, rows, offs_d, stride_row, n_rows, HEAD_DIM, BLOCK_D)


@triton.jit
def load_kv_rows(src, b, h, start, rows, offs_d, stride_row, n_rows, BlockTable, stride_bt, page_stride,
                 num_pages, row_shift, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr,
                 USE_TMA: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """:func:`load_rows` for keys and values, which may live in a paged cache.

    PAGE_SIZE > 0: logical row t of sequence b is cache position p = t + row_shift (a kv cache's
    left padding), which lives in page BlockTable[b, p // PAGE_SIZE], at row p % PAGE_SIZE;
    ``src`` points at (page 0, row 0) of this head and ``page_stride`` is the distance between
    pages. Page numbers are clamped into [0, num_pages): a bad block table gives wrong numbers,
    never an access outside the pool. When PAGE_SIZE is a multiple of len(rows), the rows (which
    start at a multiple of len(rows)) lie in one page: one table entry per tile, not one per row.
    That needs row_shift 0 or one page per sequence, the only tables with a shift (its positions
    then all lie in page 0). PAGE_SIZE == 0: load_rows.
    """
    if PAGE_SIZE > 0:
        positions = rows + row_shift
        if tl.constexpr(PAGE_SIZE) % rows.shape[0] == 0:
            page = tl.load(BlockTable + b.to(tl.int64) * stride_bt + (start + row_shift) // PAGE_SIZE)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            ptrs = (src + page.to(tl.int64) * page_stride + ((positions % PAGE_SIZE) * stride_row)[:, None]
                    + offs_d[None, :])
        else:
            page = tl.load(BlockTable + b.to(tl.int64) * stride_bt + positions // PAGE_SIZE, mask=rows < n_rows,
                           other=0)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            offsets = page.to(tl.int64) * page_stride + (positions % PAGE_SIZE) * stride_row
            ptrs = src + offsets[:, None] + offs_d[None, :]
        if CHECK_ROWS:
            mask = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
        else:
            mask = offs_d[None, :] < HEAD_DIM
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = load_rows(src, b, h, start, rows, offs_d, stride_row, n_rows, HEAD_DIM, BLOCK_D, CHECK_ROWS, USE_TMA)
    return tile
