"""The Hopper kernels' score options, written once for the forward and the backward: softcap and
ALiBi on a tile of raw dot products, and the sliding-window band; the relative-position bias table
(flashtile.mods.relative_bias); and attn_bias's tiles (the backward's transposed) and its gradient's
writes. Same order and meaning as the portable kernels' pipeline (portable/scores.py): q.k * scale ->
softcap -> + ALiBi bias -> + attn_bias -> the causal / window / bounds mask, scores in log2 units so the
softmax uses exp2.

Window sides travel as runtime ints, an unbounded side as UNBOUNDED_WINDOW (a key index no sequence
reaches, with room to add a row index without overflowing int32): a sliding window, causal or not,
compiles one band test whatever its sides."""

from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)

# What the host passes for a window side of -1 (no bound): 2^30 keys.
UNBOUNDED_WINDOW = 1 << 30


@gluon.jit
def tanh_approx(x):
    """tanh by the multi-function unit (one instruction, about 2^-11 relative error: below bf16's
    and fp16's rounding of the scores it caps)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def modded_scores_log2(s, offset, qk_scale_log2, softcap_scale, softcap_log2, slope_log2,
                       SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """Raw dot products ``s`` (a float32 tile) -> scores in log2 units, with softcap and ALiBi.

    Returns (scores, t): t = tanh(q.k * softmax_scale / softcap), whose 1 - t^2 is the backward's
    softcap derivative (t is s when not capping). qk_scale_log2: softmax_scale * log2(e);
    softcap_scale: softmax_scale / softcap; softcap_log2: softcap * log2(e); slope_log2: the
    (batch, head)'s ALiBi slope * log2(e). offset: query position + (seqlen_k - seqlen_q) - key
    position (int32), broadcastable against s (ALiBi only; the bias is -slope * |offset|). Kept int
    until here: float offsets held the tile's column positions in 64 more registers per thread,
    which the d128 forward spilled."""
    if SOFTCAP:
        t = tanh_approx(s * softcap_scale)
        s = t * softcap_log2
    else:
        t = s
        s = s * qk_scale_log2
    if ALIBI:
        s = s - slope_log2 * gl.abs(offset).to(gl.float32)
    return s, t


@gluon.jit
def alibi_slope_log2(alibi_slopes, stride_alibi_b, batch, head, ALIBI: gl.constexpr):
    """The (batch, head)'s ALiBi slope times log2(e) (stride_alibi_b is 0 for (nheads,) slopes); 0 without."""
    if ALIBI:
        slope = gl.load(alibi_slopes + batch.to(gl.int64) * stride_alibi_b + head) * LOG2E
    else:
        slope = 0.0
    return slope


@gluon.jit
def relative_bias_row(table, head, max_distance, REL_BIAS: gl.constexpr):
    """The head's row of a relative-position bias table (nheads, 2 * max_distance + 1); 0 without one."""
    if REL_BIAS:
        row = table + head * (2 * max_distance + 1)
    else:
        row = 0
    return row


@gluon.jit
def relative_bias_far_entry(nearest, farthest, max_distance):
    """The table entry every score of a tile takes when the tile lies farther than D = max_distance
    from every one of its rows (the table is constant beyond D on either side): 0 on the left, 2 * D on
    the right; -1 when the tile needs more than one entry. nearest, farthest: the least and the
    greatest key - query over the tile."""
    return gl.where(farthest <= -max_distance, 0, gl.where(nearest >= max_distance, 2 * max_distance, -1))


@gluon.jit
def relative_bias_log2(s, key_positions, query_positions, entry, table_row, max_distance):
    """s (scores in log2 units) + T[clamp(kv - q, -D, D) + D] * log2(e): T the head's row of the table,
    D max_distance, kv - q = key_positions - query_positions (an axis each, broadcast against s).
    entry: relative_bias_far_entry's for the tile: one entry of T for all its scores, or (-1) a gather
    per score (from L1: T is a few KB)."""
    if entry >= 0:
        s = s + gl.load(table_row + entry) * LOG2E
    else:
        distance = key_positions - query_positions
        index = gl.minimum(gl.maximum(distance, -max_distance), max_distance) + max_distance
        s = s + gl.load(table_row + index) * LOG2E
    return s


@gluon.jit
def attn_bias_head(attn_bias, stride_bias_b, stride_bias_h, batch, head, BIAS: gl.constexpr):
    """The (batch, head)'s first attn_bias element (0 without one)."""
    if BIAS:
        ptr = attn_bias + batch.to(gl.int64) * stride_bias_b + head.to(gl.int64) * stride_bias_h
    else:
        ptr = 0
    return ptr


@gluon.jit
def attn_bias_rows(bias_head, rows, seqlen_q, stride_bias_m):
    """Pointers to the attn_bias rows of query rows ``rows`` (bias_head: the (batch, head)'s (0, 0)
    element). Rows past the sequence read its last row (or the first, in a sequence that uses none):
    their scores are discarded."""
    return bias_head + gl.minimum(rows, gl.maximum(seqlen_q - 1, 0)).to(gl.int64) * stride_bias_m


@gluon.jit
def attn_bias_tile(bias_rows, start_n, seqlen_k, BLOCK_N: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr):
    """attn_bias over a score tile's rows (bias_rows: attn_bias_rows') and keys [start_n, start_n +
    BLOCK_N), as stored (convert with attn_bias_log2), in the scores' layout. Unit key stride. MASK: the
    keys may pass seqlen_k (their scores are masked, the loads skipped); without it, no key index is
    clamped or tested, so each load is a row pointer plus a constant offset, 16 bytes wide."""
    # Loaded in 16-byte pieces along rows (a warp reads whole 128-byte lines), then moved into the scores'
    # layout through shared memory. Loaded in that layout, each load instruction touched 8 lines for 16
    # bytes of each, and the forward was slower (docs/experiments.md).
    VEC: gl.constexpr = 128 // bias_rows.dtype.element_ty.primitive_bitwidth
    ACROSS: gl.constexpr = min(BLOCK_N // VEC, 32)
    coalesced: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // ACROSS, ACROSS], [4, 1], [1, 0])
    rows = gl.convert_layout(bias_rows, gl.SliceLayout(1, coalesced))
    cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, coalesced))
    ptrs = gl.expand_dims(rows, 1) + gl.expand_dims(cols, 0)
    return _load_tile(ptrs, gl.expand_dims(cols < seqlen_k, 0), MASK, s_layout)


@gluon.jit
def _load_tile(ptrs, keep, MASK: gl.constexpr, layout: gl.constexpr):
    """The tile at ptrs (with MASK only where keep holds, 0 elsewhere), moved into ``layout``."""
    if MASK:
        tile = gl.load(ptrs, mask=keep, other=0.0)
    else:
        tile = gl.load(ptrs)
    return gl.convert_layout(tile, layout)


@gluon.jit
def attn_bias_log2(bias):
    """An attn_bias tile as attn_bias_tile loaded it -> float32 in log2 units, to add to the scores."""
    return bias.to(gl.float32) * LOG2E


# The backward's tiles are transposed (keys x queries, S^T): a bias row (one query) runs down a tile's
# column. Its loads and the gradient's writes go along the keys, the bias's unit stride, 16 bytes per
# thread, and reach the tiles' wgmma layout through shared memory (attn_bias_tile's way).

@constexpr_function
def _keys_coalesced(keys, dtype):
    """A layout of (keys x queries) tiles whose threads hold 16 bytes along the keys (whole 128-byte lines
    per warp)."""
    vec = 128 // dtype.primitive_bitwidth
    across = min(keys // vec, 32)
    return gl.BlockedLayout([vec, 1], [across, 32 // across], [1, 4], [0, 1])


@gluon.jit
def _key_query_pointers(head, stride_m, key0, start_m, KEYS: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr,
                        last_query=None):
    """Pointers to (key0 + keys, start_m + queries) of a (queries x keys) array with unit key stride from
    ``head``, queries clamped to last_query when given; and the keys, queries."""
    keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, layout))
    queries = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
    rows = queries
    if last_query is not None:
        rows = gl.minimum(queries, last_query)
    ptrs = head + gl.expand_dims(keys, 1) + gl.expand_dims(rows.to(gl.int64) * stride_m, 0)
    return ptrs, keys, queries


@gluon.jit
def attn_bias_tile_t(bias_head, stride_bias_m, key0, start_m, seqlen_q, seqlen_k, KEYS: gl.constexpr,
                     BLOCK_M: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr):
    """attn_bias over a transposed score tile (keys key0 + [0, KEYS) x queries start_m + [0, BLOCK_M)),
    as stored, in the layout s_layout. Queries past seqlen_q read its last row (their scores are
    discarded); MASK: keys past seqlen_k are not read."""
    layout: gl.constexpr = _keys_coalesced(KEYS, bias_head.dtype.element_ty)
    ptrs, keys, _ = _key_query_pointers(bias_head, stride_bias_m, key0, start_m, KEYS, BLOCK_M, layout,
                                        gl.maximum(seqlen_q - 1, 0))
    return _load_tile(ptrs, gl.expand_dims(keys < seqlen_k, 1), MASK, s_layout)


@gluon.jit
def attn_bias_grad_t(ds, grad_head, stride_grad_m, key0, start_m, seqlen_q, seqlen_k, MASK: gl.constexpr,
                     GRAD: gl.constexpr, FROM_SHARED: gl.constexpr = False):
    """The backward's share of attn_bias's gradient: ``ds``, the dS^T tile (keys key0 + rows x queries
    start_m + columns) in the inputs' 16-bit dtype as dK and dQ take it, which is the gradient of the
    scores the bias adds to; in registers, or (FROM_SHARED) in shared memory. GRAD 1: stored into a
    gradient of the call's full shape (one score per element); GRAD 2: added (float32 atomics) into a
    float32 buffer that sums over broadcast dimensions. Queries past seqlen_q (and with MASK keys past
    seqlen_k) write nothing. (GRAD 3, a gradient summed along the queries: attn_bias_grad_keys.)"""
    KEYS: gl.constexpr = ds.shape[0]
    # Stores: 16 bytes of the gradient's dtype per thread. Atomics: 16 bytes of float32 (a v4 atomic),
    # so that a warp's instruction covers whole 32-byte sectors.
    if GRAD == 1:
        layout: gl.constexpr = _keys_coalesced(KEYS, grad_head.dtype.element_ty)
    else:
        layout: gl.constexpr = _keys_coalesced(KEYS, gl.float32)
    ptrs, keys, queries = _key_query_pointers(grad_head, stride_grad_m, key0, start_m, KEYS, ds.shape[1], layout)
    keep = gl.expand_dims(queries < seqlen_q, 0)
    if MASK:
        keep = keep & gl.expand_dims(keys < seqlen_k, 1)
    if FROM_SHARED:
        ds = ds.load(layout)
    else:
        ds = gl.convert_layout(ds, layout)
    if GRAD == 1:
        gl.store(ptrs, ds.to(grad_head.dtype.element_ty), mask=keep)
    else:
        gl.atomic_add(ptrs, ds.to(gl.float32), mask=keep, sem="relaxed")


@gluon.jit
def attn_bias_grad_keys(grad_sum, grad_head, key0, seqlen_k):
    """The backward's share of the gradient of an attn_bias broadcast along the queries (GRAD 3): grad_sum,
    the sums of dS^T over a query head's query blocks for keys key0 + [0, len), added (float32 atomics)
    into the (batch, head)'s row of the float32 buffer from grad_head; keys past seqlen_k add nothing."""
    keys = key0 + gl.arange(0, grad_sum.shape[0], layout=grad_sum.type.layout)
    gl.atomic_add(grad_head + keys, grad_sum, mask=keys < seqlen_k, sem="relaxed")
