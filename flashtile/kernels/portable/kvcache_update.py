"""The kv-cache update of flash_attn_with_kvcache in one launch: rotary on the new keys and the
queries, and the new keys and values written into the (paged) cache in place.

One program per (token, head, sequence). A program whose token is a new key (t < seqlen_new) and
whose head is a kv head rotates that key and writes it and its value at cache position
cache_seqlens[b] + t, if that position is inside the sequence's seq_pages pages (a key that does
not fit is dropped: never written into another sequence's page); a program whose token is a query
rotates it into QOut. Program (0, 0, b) also writes the keys sequence b then holds,
cache_seqlens[b] + seqlen_new, into SeqUsedK (the forward's bound, with no extra launch). Positions: a new
key t sits at cache_seqlens + t; a query at cache_seqlens + t when causal or local, otherwise
at cache_seqlens (flash_attn's rule). Rotary: the first 2 * ROTARY_HALF channels turn, pairs
(2i, 2i + 1) when INTERLEAVED, else (i, i + ROTARY_HALF); the other channels are copied.
"""

import triton
import triton.language as tl


@triton.jit
def _rotate_row(src, dst, Cos, Sin, stride_cos, position, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                ROTARY_HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """dst[:HEAD_DIM] <- src[:HEAD_DIM] with its rotary channels turned by row ``position`` of the
    (cos, sin) tables (no rotary: a copy)."""
    if ROTARY_HALF > 0:
        cos_row = Cos + position.to(tl.int64) * stride_cos
        sin_row = Sin + position.to(tl.int64) * stride_cos
        offs_i = tl.arange(0, BLOCK_HALF)
        in_half = offs_i < ROTARY_HALF
        if INTERLEAVED:
            first = 2 * offs_i
            second = 2 * offs_i + 1
        else:
            first = offs_i
            second = offs_i + ROTARY_HALF
        c = tl.load(cos_row + offs_i, mask=in_half, other=1.0).to(tl.float32)
        s = tl.load(sin_row + offs_i, mask=in_half, other=0.0).to(tl.float32)
        x1 = tl.load(src + first, mask=in_half, other=0.0).to(tl.float32)
        x2 = tl.load(src + second, mask=in_half, other=0.0).to(tl.float32)
        tl.store(dst + first, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=in_half)
        tl.store(dst + second, (x1 * s + x2 * c).to(dst.dtype.element_ty), mask=in_half)
    offs_d = tl.arange(0, BLOCK_D)
    rest = (offs_d >= 2 * ROTARY_HALF) & (offs_d < HEAD_DIM)
    tl.store(dst + offs_d, tl.load(src + offs_d, mask=rest, other=0.0), mask=rest)


@triton.jit
def kvcache_update_kernel(
    Q, QOut, K, V, KCache, VCache, Cos, Sin, CacheSeqlens, BlockTable, SeqUsedK,
    stride_qb, stride_qs, stride_qh, stride_qob, stride_qos, stride_qoh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    stride_cos, stride_bt, seqlen_q, seqlen_new, nheads, nheads_k, page_size, num_pages, seq_pages,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY_HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, QUERY_PER_STEP: tl.constexpr, HEAD_DIM_V: tl.constexpr = None,
    BLOCK_DV: tl.constexpr = None,
):
    # V's head dim and tile width, when it differs from K's (None: the same).
    V_DIM: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V
    V_BLOCK_D: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    start = tl.load(CacheSeqlens + b)
    if (t == 0) & (h == 0):
        tl.store(SeqUsedK + b, start + seqlen_new)
    position = start + t
    if (t < seqlen_new) & (h < nheads_k) & (position >= 0) & (position < seq_pages * page_size):
        page = tl.load(BlockTable + b.to(tl.int64) * stride_bt + position // page_size)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        row = (position % page_size).to(tl.int64)
        k_src = K + b.to(tl.int64) * stride_kb + t * stride_ks + h * stride_kh
        k_dst = KCache + page * stride_kcp + row * stride_kcs + h * stride_kch
        _rotate_row(k_src, k_dst, Cos, Sin, stride_cos, position, HEAD_DIM, BLOCK_D, ROTARY_HALF, BLOCK_HALF,
                    INTERLEAVED)
        offs_dv = tl.arange(0, V_BLOCK_D)
        v = tl.load(V + b.to(tl.int64) * stride_vb + t * stride_vs + h * stride_vh + offs_dv, mask=offs_dv < V_DIM)
        tl.store(VCache + page * stride_vcp + row * stride_vcs + h * stride_vch + offs_dv, v, mask=offs_dv < V_DIM)
    if ROTARY_HALF > 0:  # without rotary the queries are used as they are
        if (t < seqlen_q) & (h < nheads):
            if QUERY_PER_STEP:
                position = start + t
            else:
                position = start
            q_src = Q + b.to(tl.int64) * stride_qb + t * stride_qs + h * stride_qh
            q_dst = QOut + b.to(tl.int64) * stride_qob + t * stride_qos + h * stride_qoh
            _rotate_row(q_src, q_dst, Cos, Sin, stride_cos, position, HEAD_DIM, BLOCK_D, ROTARY_HALF, BLOCK_HALF,
                        INTERLEAVED)
