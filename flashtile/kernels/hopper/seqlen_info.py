"""Where a Hopper CTA's sequence lives: its batch (or packed sequence), the first row and key of the
sequence in the tensors, and the rows and keys it uses (cu_seqlens, seqused), for the forward's
tiles (with the causal launch order) and the backward's key blocks."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .tile_order import grouped_tile_order


@gluon.jit
def forward_tile(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, head_group,
                 heads_per_group, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr,
                 QUERY_GROUP: gl.constexpr = 1, block_table=None, key_shift=None, table_keys=0):
    """What this CTA works on: (start_m, head, kv head, batch, q_start, k_start, seqlen_q, seqlen_k,
    rows_end, valid). start_m is relative to its sequence, whose rows start at q_start and keys at
    k_start; seqlen_q / seqlen_k are the rows / keys the sequence uses, rows_end its rows (>= seqlen_q,
    the rows past seqlen_q get out 0 and lse -inf); valid: the tile starts inside the sequence.
    Dense: batch is the TMA batch coordinate and every offset is 0 (with seqused_k, batch b uses its
    first seqused_k[b] keys). Varlen: the sequences are packed
    along a batch-1 tensor, batch is the sequence, the TMA batch coordinate is 0.
    Causal: the longest tiles (the most key blocks) launch first; dense grids with heads_per_group
    (not None) go through groups of that many (batch, head) pairs (tile_order.py).
    QUERY_GROUP: rows per query position (GQA groups packed as rows): a packed sequence's rows are its
    positions times QUERY_GROUP.
    block_table (not None): the keys are read through a table of pages, each sequence's row of it
    addressing table_keys keys; k_start is then the sequence's first key there (key_shift[b], a kv
    cache's left padding, or 0), and the sequence uses no keys past what its row addresses."""
    pid_m = gl.program_id(0)
    head = gl.program_id(1)
    batch = gl.program_id(2)
    if IS_VARLEN:
        q_start = gl.load(cu_seqlens_q + batch)
        rows_end = gl.load(cu_seqlens_q + batch + 1) - q_start
        if QUERY_GROUP > 1:
            q_start = q_start * QUERY_GROUP
            rows_end = rows_end * QUERY_GROUP
        k_start = gl.load(cu_seqlens_k + batch)
        if seqused_q is not None:
            seqlen_q = gl.load(seqused_q + batch)
        else:
            seqlen_q = rows_end
        if seqused_k is not None:
            seqlen_k = gl.load(seqused_k + batch)
        else:
            seqlen_k = gl.load(cu_seqlens_k + batch + 1) - k_start
        if CAUSAL:
            # The grid covers the longest sequence; count back from this one's last tile (a
            # negative index is a tile past the sequence).
            pid_m = gl.cdiv(rows_end, BLOCK_M) - 1 - pid_m
        start_m = pid_m * BLOCK_M
        valid = (start_m >= 0) & (start_m < rows_end)
    else:
        if CAUSAL:
            if heads_per_group is not None:
                pid_m, head, batch = grouped_tile_order(pid_m, head, batch, gl.num_programs(0), gl.num_programs(1),
                                                        gl.num_programs(2), heads_per_group)
            pid_m = gl.num_programs(0) - 1 - pid_m
        start_m = pid_m * BLOCK_M
        q_start = 0
        k_start = 0
        rows_end = seqlen_q
        valid = True
        if seqused_k is not None:  # a kv cache's rows, seqused_k of them in use
            seqlen_k = gl.load(seqused_k + batch)
    if block_table is not None:
        k_start = 0
        if key_shift is not None:
            k_start = gl.maximum(gl.load(key_shift + batch), 0)
        seqlen_k = gl.maximum(gl.minimum(seqlen_k, table_keys - k_start), 0)
    return start_m, head, head // head_group, batch, q_start, k_start, seqlen_q, seqlen_k, rows_end, valid


@gluon.jit
def backward_sequence(cu_seqlens_q, cu_seqlens_k, seqused_q, seqlen_q, seqlen_k, IS_VARLEN: gl.constexpr):
    """(tma_batch, q_start, k_start, seqlen_q, seqlen_k) of this program's sequence: the TMA batch
    coordinate, the sequence's first query row and first key in the tensors, and its query rows and
    keys. Dense: the batch entry, offsets 0. Varlen: the sequence is program_id(2) of a packed
    batch-1 tensor; with seqused_q it uses only its first seqused_q[b] rows."""
    batch = gl.program_id(2)
    if IS_VARLEN:
        tma_batch = 0
        q_start = gl.load(cu_seqlens_q + batch)
        k_start = gl.load(cu_seqlens_k + batch)
        seqlen_k = gl.load(cu_seqlens_k + batch + 1) - k_start
        seqlen_q = gl.load(cu_seqlens_q + batch + 1) - q_start
        if seqused_q is not None:
            seqlen_q = gl.maximum(gl.minimum(gl.load(seqused_q + batch), seqlen_q), 0)
    else:
        tma_batch = batch
        q_start = 0
        k_start = 0
    return tma_batch, q_start, k_start, seqlen_q, seqlen_k
