"""Counter-based dropout: the keep mask of element (batch, head, i, j) is a pure
function of (seed, its flat index), so the backward regenerates the forward's mask
whatever its tiling, and nothing of size N^2 is stored."""

import triton
import triton.language as tl


@triton.jit
def dropout_keep(seed, query_idx, key_idx, row_offset, seqlen_k, dropout_p):
    """Boolean tile: True where the element is kept (probability 1 - dropout_p).

    query_idx, key_idx: broadcastable 2-D index grids, e.g. rows[:, None] and cols[None, :],
    or transposed for a (keys x queries) tile: the same element draws the same bits.
    row_offset: flat index of this (batch, head)'s first query row, (b * nheads + h) * seqlen_q.
    The 64-bit element index feeds Philox's counter, so no two elements share one.
    """
    index = (row_offset + query_idx).to(tl.int64) * seqlen_k + key_idx
    return tl.rand(seed, index) >= dropout_p
