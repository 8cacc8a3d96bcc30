"""Counter-based dropout: the keep mask of element (batch, head, i, j) is a pure
function of (seed, its flat index), so the backward regenerates the forward's mask
whatever its tiling, and nothing of size N^2 is stored."""

import triton
import triton.language as tl


@triton.jit
def dropout_row_offset(b, h, nheads, total_q, q_start):
    """Flat index of this (batch, head, sequence)'s first query row, for :func:`dropout_keep`.

    total_q: seqlen_q (dense) or the packed total (varlen); q_start: the sequence's first row
    in the packed tensor (0 when dense). Rows of different (b, h, sequence) never share an index.
    """
    return (b * nheads + h).to(tl.int64) * total_q + q_start


@triton.jit
def dropout_keep(seed, query_idx, key_idx, row_offset, row_len, dropout_p):
    """Boolean tile: True where the element is kept (probability 1 - dropout_p).

    query_idx, key_idx: broadcastable 2-D index grids, e.g. rows[:, None] and cols[None, :],
    or transposed for a (keys x queries) tile: the same element draws the same bits.
    row_offset: from :func:`dropout_row_offset`; row_len: seqlen_k, or the packed total of keys
    (varlen), an upper bound of every key index. The 64-bit element index feeds Philox's
    counter, so no two elements share one.
    """
    index = (row_offset + query_idx).to(tl.int64) * row_len + key_idx
    return tl.rand(seed, index) >= dropout_p
