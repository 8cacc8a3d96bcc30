"""Forward kernel: FlashAttention-2 online softmax over key blocks, one program per
(query block, head, batch). Writes the output and the natural-log logsumexp."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .dropout import dropout_keep, dropout_row_offset
from .scores import (LN2, LOG2E, band_block_range, listed_tile_start, mask_mod_scores, mask_scores, mod_positions,
                     score_mod_log2, scores_log2)
from .seqlens import sequence_bounds
from .sink import fold_sink, load_sink_log2
from .tile_io import load_kv_rows, load_rows, store_rows


@triton.jit
def load_alibi_slope_log2(AlibiSlopes, b, h, stride_alibi_b, HAS_ALIBI: tl.constexpr):
    """This (batch, head)'s ALiBi slope in log2 units (0 when ALiBi is off)."""
    if HAS_ALIBI:
        return tl.load(AlibiSlopes + b * stride_alibi_b + h).to(tl.float32) * LOG2E
    else:
        return 0.0


@triton.jit
def _fwd_key_blocks(acc, m_i, l_i, q, k_src, v_src, b, h, h_kv, stride_ks, stride_vs,
                    col_start, col_end, rows, offs_n, offs_d, offs_dv,
                    seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2,
                    window_left, window_right, dropout_seed, dropout_row, dropout_row_len, dropout_p,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_N: tl.constexpr,
                    APPLY_MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, SCALE_IN_EXP2: tl.constexpr,
                    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                    BlockTable, stride_bt, page_stride_k, page_stride_v, num_pages, key_shift,
                    PAGE_SIZE: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, score_aux, mask_aux,
                    block_list=None, MASK_BLOCK_N: tl.constexpr = 1, LOOP_IN_BOUNDS: tl.constexpr = False):
    """Fold key blocks [col_start, col_end) into the running (acc, m_i, l_i). APPLY_MASK: the
    element masks (bounds, band, mask_mod); without it the blocks must lie wholly inside.
    LOOP_IN_BOUNDS: every key block ends inside the sequence, so mods see key positions unclamped.
    With a ``block_list`` (a block mask's, scores.py): its tiles [col_start, col_end) instead, tile
    t being BLOCK_N keys of the block of MASK_BLOCK_N keys listed at t // (MASK_BLOCK_N // BLOCK_N)."""
    step_size: tl.constexpr = BLOCK_N if block_list is None else 1
    for step in tl.range(col_start, col_end, step_size, warp_specialize=WARP_SPECIALIZE):
        if block_list is None:
            start_n = step
            if SCORE_MOD is not None:  # the band's edges are tile multiples: aligned mod loads
                start_n = tl.multiple_of(step, BLOCK_N)
        else:
            start_n = listed_tile_start(block_list, step, MASK_BLOCK_N, BLOCK_N)
        cols = start_n + offs_n
        k = load_kv_rows(k_src, b, h_kv, start_n, cols, offs_d, stride_ks, seqlen_k, BlockTable, stride_bt,
                         page_stride_k, num_pages, key_shift, HEAD_DIM, BLOCK_D, APPLY_MASK, USE_TMA, PAGE_SIZE)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SCALE_IN_EXP2:
            # Plain scaled scores (scale > 0): keep them raw so the scale and the max
            # subtraction fuse into one multiply-add before exp2.
            s = qk
            scale = qk_scale
        else:
            s, _ = scores_log2(qk, rows, cols, diag, qk_scale, softcap_log2, alibi_slope_log2,
                               HAS_SOFTCAP, HAS_ALIBI)
            scale = 1.0
            if SCORE_MOD is not None:
                q_idx, kv_idx = mod_positions(rows, cols, seqlen_q, seqlen_k, False, APPLY_MASK and not LOOP_IN_BOUNDS)
                s, _ = score_mod_log2(s, b, h, q_idx, kv_idx, SCORE_MOD, score_aux)
        if APPLY_MASK:
            s = mask_scores(s, rows, cols, seqlen_q, seqlen_k, diag, window_left, window_right,
                            HAS_LEFT, HAS_RIGHT)
            if MASK_MOD is not None:
                q_idx, kv_idx = mod_positions(rows, cols, seqlen_q, seqlen_k, False, APPLY_MASK and not LOOP_IN_BOUNDS)
                s = mask_mod_scores(s, b, h, q_idx, kv_idx, MASK_MOD, mask_aux)
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        if APPLY_MASK or (SCORE_MOD is not None):
            # A row with every key masked so far (or scored -inf by a score_mod) keeps m = -inf;
            # subtract 0 instead so exp2 gives 0, not NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.exp2(s * scale - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            # lse is of the undropped scores; only the p @ v product sees the mask.
            keep = dropout_keep(dropout_seed, rows[:, None], cols[None, :], dropout_row, dropout_row_len, dropout_p)
            p = tl.where(keep, p, 0.0)
        v = load_kv_rows(v_src, b, h_kv, start_n, cols, offs_dv, stride_vs, seqlen_k, BlockTable, stride_bt,
                         page_stride_v, num_pages, key_shift, HEAD_DIM_V, BLOCK_DV, APPLY_MASK, USE_TMA, PAGE_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# seq_pages is not specialized: at 1 (a block table of one column) Triton 3.6.0's ptxas crashed on the
# packed decode tile at head dim 32 (docs/experiments.md, 2026-12-03).
@triton.jit(do_not_specialize=["seq_pages"])
def attn_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lse_b, stride_lse_h,
    CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK,
    BlockTable, stride_bt, seq_pages, num_pages, KeyShift,
    num_splits, keys_per_split, split_stride_o, split_stride_lse,
    AlibiSlopes, DropoutSeed, stride_alibi_b,
    nheads, head_group, seqlen_q, seqlen_k,
    qk_scale, softcap_log2, window_left, window_right, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT_KV: tl.constexpr, SCALE_IN_EXP2: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PACK_GQA: tl.constexpr = False, stride_lse_r=1,
    SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None, ScoreAux=None, MaskAux=None,
    BlockLists=None, stride_lists_b=0, stride_lists_h=0, list_width=0,
    MASK_BLOCK_M: tl.constexpr = 1, MASK_BLOCK_N: tl.constexpr = 1, FULL_TILES_MASKED: tl.constexpr = False,
    LOOP_IN_BOUNDS: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
    Sink=None, LAUNCH_DEPENDENTS: tl.constexpr = 0,
):
    """Q, K, V, Out are (b, s, h, d) pointers, or 4-D tensor descriptors when USE_TMA (dense only).
    Varlen: see seqlens.py (seqlen_q, seqlen_k are the packed totals). Paged K/V (PAGE_SIZE > 0,
    varlen only): K, V are (num_pages, PAGE_SIZE, hk, d) and BlockTable (batch, pages per
    sequence) int32 maps each sequence's key positions to pages (tile_io.load_kv_rows); KeyShift
    (batch,) int32 or None: where each sequence's keys start in its pages (left padding).
    SPLIT_KV (flash-decoding): program id 0 is query block * num_splits + split; each split folds
    keys [split * keys_per_split, + keys_per_split) and writes its normalised float32 output and
    its lse to Out / Lse at split * split_stride_o / _lse, for combine.attn_combine_kernel.
    Lse rows lie stride_lse_r apart (1 but for a packed decode step's GQA heads as rows).
    PACK_GQA (decoding a few query rows with GQA; not with TMA, ALiBi or dropout): program id 1 is a
    kv head, and the tile's rows are (query row, query head of its group) pairs, row r being query
    r // head_group of head h_kv * head_group + r % head_group: the group's heads share each K and
    V tile instead of reading it once per head.
    SCORE_MOD / MASK_MOD (not with PACK_GQA): the user's jit functions (scores.py), reading the
    tuples ScoreAux / MaskAux. BlockLists (count, indices, full count, full indices) of a block mask
    (flashtile/block_mask.py): per (batch, head, MASK_BLOCK_M query rows) the partial and the full
    blocks of MASK_BLOCK_N keys; a row of counts lies at b * stride_lists_b + h * stride_lists_h,
    its lists list_width apart. BLOCK_M and BLOCK_N divide the mask's blocks. Full blocks need no
    element mask (the host folded the band and the sequence ends into the lists) unless
    FULL_TILES_MASKED. HEAD_DIM_V / BLOCK_DV: V's and Out's head dim and its tile width, when it differs
    from Q's and K's (None: the same). Sink: None, or (nheads,) learnable sink logits (sink.py), taken in
    here unless SPLIT_KV (the combine kernel takes them then). LAUNCH_DEPENDENTS: 0, or when the next
    launch (the split-KV combine, a programmatic dependent launch, which waits for this kernel's results
    itself) may start: once every program has started (1) or has folded its keys (2)."""
    if LAUNCH_DEPENDENTS == 1:
        gdc_launch_dependents()
    V_DIM: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V
    V_BLOCK_D: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    split = 0
    pid_m = tl.program_id(0)
    if SPLIT_KV:
        split = pid_m % num_splits
        pid_m = pid_m // num_splits
    start_m = pid_m * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    h_kv = h // head_group  # GQA: consecutive query heads share a kv head
    if PACK_GQA:
        h_kv = h
    dropout_row_len = seqlen_k
    total_q = seqlen_q
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(b, seqlen_q, seqlen_k, CuSeqlensQ, CuSeqlensK,
                                                           SeqUsedQ, SeqUsedK, IS_VARLEN)
    packed_rows = seqlen_q * head_group if PACK_GQA else seqlen_q
    if IS_VARLEN:
        # The grid fits the longest sequence. (Dense grids are exact; an early return there
        # also breaks Triton's warp specialization of the key loop.)
        if start_m >= packed_rows:
            return
    key_shift = 0
    if PAGE_SIZE > 0:
        if KeyShift is not None:  # a kv cache's left padding: its keys start at this position
            key_shift = tl.maximum(tl.load(KeyShift + b), 0)
        # What the block table can address.
        seqlen_k = tl.maximum(tl.minimum(seqlen_k, seq_pages * PAGE_SIZE - key_shift), 0)
    diag = seqlen_k - seqlen_q

    if USE_TMA:
        q_src = Q
        k_src = K
        v_src = V
        o_dst = Out
    else:
        q_src = Q + b.to(tl.int64) * stride_qb + q_start * stride_qs + h.to(tl.int64) * stride_qh
        if PAGE_SIZE > 0:  # rows are found through the block table; stride_kb is the page stride
            k_src = K + h_kv.to(tl.int64) * stride_kh
            v_src = V + h_kv.to(tl.int64) * stride_vh
        else:
            k_src = K + b.to(tl.int64) * stride_kb + k_start * stride_ks + h_kv.to(tl.int64) * stride_kh
            v_src = V + b.to(tl.int64) * stride_vb + k_start * stride_vs + h_kv.to(tl.int64) * stride_vh
        o_dst = Out + b.to(tl.int64) * stride_ob + q_start * stride_os + h.to(tl.int64) * stride_oh
        if SPLIT_KV:
            o_dst += split.to(tl.int64) * split_stride_o

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, V_BLOCK_D)
    if PACK_GQA:
        # Query positions and heads of the tile's rows; positions drive the masks from here on.
        row_heads = (h_kv * head_group + rows % head_group).to(tl.int64)
        rows = rows // head_group
        start_q = start_m // head_group
        in_tile = (start_m + tl.arange(0, BLOCK_M)) < packed_rows
        row_offsets = rows.to(tl.int64) * stride_qs + row_heads * stride_qh
        q_base = Q + b.to(tl.int64) * stride_qb + q_start * stride_qs
        q = tl.load(q_base + row_offsets[:, None] + offs_d[None, :],
                    mask=in_tile[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        start_q = start_m
        q = load_rows(q_src, b, h, start_m, rows, offs_d, stride_qs, seqlen_q, HEAD_DIM, BLOCK_D, True, USE_TMA)

    alibi_slope_log2 = load_alibi_slope_log2(AlibiSlopes, b, h, stride_alibi_b, HAS_ALIBI)
    dropout_seed = 0
    if HAS_DROPOUT:
        dropout_seed = tl.load(DropoutSeed)
    dropout_row = dropout_row_offset(b, h, nheads, total_q, q_start)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_BLOCK_D], dtype=tl.float32)

    # Packed rows span query positions start_q .. at most start_q + BLOCK_M - 1: a superset, so the
    # blocks it calls unmasked are unmasked for every row and the rest get element masks.
    lo, full_lo, full_hi, hi = band_block_range(start_q, seqlen_q, seqlen_k, diag, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if SPLIT_KV:
        # This split's share of the band; sub-ranges keep their masked / unmasked kinds.
        first = split * keys_per_split  # a multiple of BLOCK_N
        lo = tl.maximum(lo, first)
        hi = tl.maximum(tl.minimum(hi, first + keys_per_split), lo)
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    if BlockLists is None:
        # Edge blocks on the left of the band, blocks wholly inside it (masked only for a mask_mod), edge
        # blocks on the right.
        acc, m_i, l_i = _fwd_key_blocks(
            acc, m_i, l_i, q, k_src, v_src, b, h, h_kv, stride_ks, stride_vs, lo, full_lo, rows, offs_n, offs_d,
            offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_seed, dropout_row, dropout_row_len, dropout_p,
            HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
            HAS_DROPOUT, DOT_PRECISION, SCALE_IN_EXP2, USE_TMA, WARP_SPECIALIZE,
            BlockTable, stride_bt, stride_kb, stride_vb, num_pages, key_shift, PAGE_SIZE,
            SCORE_MOD, MASK_MOD, ScoreAux, MaskAux, LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
        acc, m_i, l_i = _fwd_key_blocks(
            acc, m_i, l_i, q, k_src, v_src, b, h, h_kv, stride_ks, stride_vs, full_lo, full_hi, rows, offs_n, offs_d,
            offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_seed, dropout_row, dropout_row_len, dropout_p,
            HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_N, MASK_MOD is not None, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, SCALE_IN_EXP2, USE_TMA, WARP_SPECIALIZE,
            BlockTable, stride_bt, stride_kb, stride_vb, num_pages, key_shift, PAGE_SIZE,
            SCORE_MOD, MASK_MOD, ScoreAux, MaskAux, LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
        acc, m_i, l_i = _fwd_key_blocks(
            acc, m_i, l_i, q, k_src, v_src, b, h, h_kv, stride_ks, stride_vs, full_hi, hi, rows, offs_n, offs_d,
            offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_seed, dropout_row, dropout_row_len, dropout_p,
            HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
            HAS_DROPOUT, DOT_PRECISION, SCALE_IN_EXP2, USE_TMA, WARP_SPECIALIZE,
            BlockTable, stride_bt, stride_kb, stride_vb, num_pages, key_shift, PAGE_SIZE,
            SCORE_MOD, MASK_MOD, ScoreAux, MaskAux, LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
    else:
        # The block mask's partial tiles (element masks, mask_mod included), then its full ones (element
        # masks only when FULL_TILES_MASKED: packed sequences end anywhere); empty ones never come.
        count, indices, full_count, full_indices = BlockLists
        list_row = b * stride_lists_b + h * stride_lists_h + start_q // MASK_BLOCK_M
        acc, m_i, l_i = _fwd_key_blocks(
            acc, m_i, l_i, q, k_src, v_src, b, h, h_kv, stride_ks, stride_vs,
            0, tl.load(count + list_row) * (MASK_BLOCK_N // BLOCK_N), rows, offs_n, offs_d,
            offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_seed, dropout_row, dropout_row_len, dropout_p,
            HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
            HAS_DROPOUT, DOT_PRECISION, SCALE_IN_EXP2, USE_TMA, False,
            BlockTable, stride_bt, stride_kb, stride_vb, num_pages, key_shift, PAGE_SIZE,
            SCORE_MOD, MASK_MOD, ScoreAux, MaskAux, indices + list_row.to(tl.int64) * list_width, MASK_BLOCK_N,
            LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
        acc, m_i, l_i = _fwd_key_blocks(
            acc, m_i, l_i, q, k_src, v_src, b, h, h_kv, stride_ks, stride_vs,
            0, tl.load(full_count + list_row) * (MASK_BLOCK_N // BLOCK_N), rows, offs_n, offs_d,
            offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left, window_right,
            dropout_seed, dropout_row, dropout_row_len, dropout_p,
            HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_N, FULL_TILES_MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, SCALE_IN_EXP2, USE_TMA, False,
            BlockTable, stride_bt, stride_kb, stride_vb, num_pages, key_shift, PAGE_SIZE,
            SCORE_MOD, None, ScoreAux, MaskAux, full_indices + list_row.to(tl.int64) * list_width, MASK_BLOCK_N,
            LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)

    if LAUNCH_DEPENDENTS == 2:
        gdc_launch_dependents()
    if Sink is not None:
        if not SPLIT_KV:
            if PACK_GQA:
                alpha, m_i, l_i = fold_sink(m_i, l_i, load_sink_log2(Sink, row_heads))
            else:
                alpha, m_i, l_i = fold_sink(m_i, l_i, load_sink_log2(Sink, h))
            acc = acc * alpha[:, None]
    # A row that saw no key at all (l = 0) outputs zeros and lse = -inf.
    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    out = acc / l_safe[:, None]
    if HAS_DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)

    if USE_TMA:
        out = out.to(q.dtype)
    else:
        out = out.to(Out.dtype.element_ty)  # float32 partial results under SPLIT_KV
    if PACK_GQA:
        o_base = Out + b.to(tl.int64) * stride_ob + q_start * stride_os
        if SPLIT_KV:
            o_base += split.to(tl.int64) * split_stride_o
        o_offsets = rows.to(tl.int64) * stride_os + row_heads * stride_oh
        tl.store(o_base + o_offsets[:, None] + offs_dv[None, :], out,
                 mask=in_tile[:, None] & (offs_dv[None, :] < V_DIM))
        lse_ptrs = (Lse + b.to(tl.int64) * stride_lse_b + row_heads * stride_lse_h
                    + (q_start + rows) * stride_lse_r)
        lse_mask = in_tile
    else:
        store_rows(o_dst, out, b, h, start_m, rows, offs_dv, stride_os, seqlen_q,
                   V_DIM, V_BLOCK_D, USE_TMA)
        lse_ptrs = (Lse + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
                    + (q_start + rows) * stride_lse_r)
        lse_mask = rows < seqlen_q
    if SPLIT_KV:
        lse_ptrs += split.to(tl.int64) * split_stride_lse
    tl.store(lse_ptrs, lse, mask=lse_mask)
