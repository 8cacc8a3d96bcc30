"""Backward kernels (FlashAttention-2): P is recomputed from the saved logsumexp.

1. ``attn_bwd_preprocess_kernel``: delta = rowsum(dO * O), and lse in log2 units.
2. ``attn_bwd_dkdv_kernel``: one program per (key block, kv head, batch) accumulates
   dK and dV over every query block and every query head of its GQA group.
3. ``attn_bwd_dq_kernel``: one program per (query block, head, batch) accumulates dQ.
No atomics: every gradient element is summed by one program in a fixed order, so the
result is bit-identical run to run.
"""

import triton
import triton.language as tl

from .dropout import dropout_keep, dropout_row_offset
from .forward import load_alibi_slope_log2
from .scores import (LOG2E, band_block_range, listed_tile_start, mask_mod_scores, mask_scores, mod_positions,
                     score_mod_log2, scores_log2)
from .seqlens import sequence_bounds
from .sink import sink_grad_part
from .tile_io import load_tile, store_tile


@triton.jit
def attn_bwd_preprocess_kernel(
    Out, DOut, Lse, Delta, LseLog2,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lse_b, stride_lse_h,
    stride_delta_b, stride_delta_h,
    CuSeqlensQ, SeqUsedQ,
    ZeroRows, stride_zero_b, stride_zero_s, stride_zero_h,
    ZeroCounts, nheads_k,
    nheads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
    HEAD_DIM_ZERO: tl.constexpr = None, BLOCK_D_ZERO: tl.constexpr = None, Sink=None, SinkGradParts=None,
):
    """Delta, LseLog2: float32 with (batch, head) strides stride_delta_*, rows contiguous;
    laid out like lse (a row of a packed sequence starts at its q_start).
    ZeroRows: None, or a float32 (b, sq, h, d) buffer (the Gluon backward's dQ accumulator) whose
    rows this pass zeroes: its writes ride along with the reads of out and dout, instead of a
    memset of its own. Its head dim (q's) is HEAD_DIM_ZERO where it differs from out's.
    ZeroCounts: None, or int32 (b, nheads_k) counts (the Gluon backward's key blocks done per KV
    head) zeroed here too.
    Sink: None, or (nheads,) learnable sink logits; each program then writes its share of their
    gradient (sink.sink_grad_part) to SinkGradParts, float32 (batch, nheads, programs along axis 0)."""
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    if Sink is not None:
        sink_part_ptr = SinkGradParts + (b * nheads + h).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    if ZeroCounts is not None:
        if (start_m == 0) & (h < nheads_k):
            tl.store(ZeroCounts + b * nheads_k + h, 0)
    q_start, _, seqlen_q, _ = sequence_bounds(b, seqlen_q, 0, CuSeqlensQ, CuSeqlensQ, SeqUsedQ, None, IS_VARLEN)
    if IS_VARLEN:  # the grid fits the longest sequence (dense grids are exact)
        if start_m >= seqlen_q:
            if Sink is not None:
                tl.store(sink_part_ptr, 0.0)
            return
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_tile(Out + b.to(tl.int64) * stride_ob + q_start * stride_os + h.to(tl.int64) * stride_oh,
                  rows, offs_d, stride_os, seqlen_q, HEAD_DIM, BLOCK_D, True)
    do = load_tile(DOut + b.to(tl.int64) * stride_dob + q_start * stride_dos + h.to(tl.int64) * stride_doh,
                   rows, offs_d, stride_dos, seqlen_q, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(Lse + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h + q_start + rows,
                  mask=rows < seqlen_q, other=0.0)
    # A row with no key has lse = -inf; +inf makes its recomputed P exactly 0.
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    row_ids = b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h + q_start + rows
    tl.store(Delta + row_ids, delta, mask=rows < seqlen_q)
    tl.store(LseLog2 + row_ids, lse_log2, mask=rows < seqlen_q)
    if Sink is not None:
        tl.store(sink_part_ptr, sink_grad_part(Sink, h, lse, delta, rows < seqlen_q))
    if ZeroRows is not None:
        ZERO_DIM: tl.constexpr = HEAD_DIM if HEAD_DIM_ZERO is None else HEAD_DIM_ZERO
        ZERO_BLOCK: tl.constexpr = BLOCK_D if BLOCK_D_ZERO is None else BLOCK_D_ZERO
        zero_base = ZeroRows + b.to(tl.int64) * stride_zero_b + q_start * stride_zero_s + h.to(tl.int64) * stride_zero_h
        store_tile(zero_base, tl.zeros([BLOCK_M, ZERO_BLOCK], tl.float32), rows, tl.arange(0, ZERO_BLOCK),
                   stride_zero_s, seqlen_q, ZERO_DIM, ZERO_BLOCK)


@triton.jit
def _dkdv_query_blocks(dk, dv, k, v, q_base, do_base, lse_log2_base, delta_base, stride_qs, stride_dos, b, h,
                       row_start, row_end, cols, offs_m, offs_d, offs_dv,
                       seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2,
                       window_left, window_right, dropout_seed, dropout_row, dropout_row_len, dropout_p,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                       BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                       APPLY_MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_MOD_BWD: tl.constexpr,
                       MASK_MOD: tl.constexpr, score_aux, mask_aux, block_list=None, MASK_BLOCK_M: tl.constexpr = 1,
                       LOOP_IN_BOUNDS: tl.constexpr = False):
    """Add the contributions of query blocks [row_start, row_end) to this key block's dK, dV (with a
    block mask's ``block_list``: its tiles, as forward._fwd_key_blocks walks them).

    Works on transposed (keys x queries) tiles, so that every tl.dot takes loaded tiles
    or tiles in their natural layout (no transposes of computed tiles). The score and
    mask helpers see the band from the keys' side: diag negated, left and right swapped.
    """
    step_size: tl.constexpr = BLOCK_M if block_list is None else 1
    for step in range(row_start, row_end, step_size):
        if block_list is None:
            start_m = step
            if SCORE_MOD is not None:  # the band's edges are tile multiples: aligned mod loads
                start_m = tl.multiple_of(step, BLOCK_M)
        else:
            start_m = listed_tile_start(block_list, step, MASK_BLOCK_M, BLOCK_M)
        rows = start_m + offs_m
        q = load_tile(q_base, rows, offs_d, stride_qs, seqlen_q, HEAD_DIM, BLOCK_D, APPLY_MASK)
        do = load_tile(do_base, rows, offs_dv, stride_dos, seqlen_q, HEAD_DIM_V, BLOCK_DV, APPLY_MASK)
        if APPLY_MASK:
            lse_log2 = tl.load(lse_log2_base + rows, mask=rows < seqlen_q, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse_log2 = tl.load(lse_log2_base + rows)
            delta = tl.load(delta_base + rows)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        s_t, t_t = scores_log2(qk_t, cols, rows, -diag, qk_scale, softcap_log2, alibi_slope_log2,
                               HAS_SOFTCAP, HAS_ALIBI)
        if (SCORE_MOD is not None) or (MASK_MOD is not None):
            q_idx, kv_idx = mod_positions(rows, cols, seqlen_q, seqlen_k, True, APPLY_MASK and not LOOP_IN_BOUNDS)
        if SCORE_MOD is not None:
            s_t, s_in_t = score_mod_log2(s_t, b, h, q_idx, kv_idx, SCORE_MOD, score_aux)
        if APPLY_MASK:
            s_t = mask_scores(s_t, cols, rows, seqlen_k, seqlen_q, -diag, window_right, window_left,
                              HAS_RIGHT, HAS_LEFT)
            if MASK_MOD is not None:
                s_t = mask_mod_scores(s_t, b, h, q_idx, kv_idx, MASK_MOD, mask_aux)
        p_t = tl.exp2(s_t - lse_log2[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep_t = dropout_keep(dropout_seed, rows[None, :], cols[:, None], dropout_row, dropout_row_len,
                                  dropout_p)
            keep_scale = 1.0 / (1.0 - dropout_p)
            p_dropped_t = tl.where(keep_t, p_t * keep_scale, 0.0)
            dv += tl.dot(p_dropped_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.where(keep_t, dp_t * keep_scale, 0.0)
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SCORE_MOD is not None:
            ds_t = SCORE_MOD_BWD(ds_t, s_in_t, b, h, q_idx, kv_idx, score_aux)
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DOut, LseLog2, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_delta_b, stride_delta_h,
    CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK,
    AlibiSlopes, DropoutSeed, stride_alibi_b,
    nheads, head_group, seqlen_q, seqlen_k,
    softmax_scale, qk_scale, softcap_log2, window_left, window_right, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_BWD: tl.constexpr = None, MASK_MOD: tl.constexpr = None,
    ScoreAux=None, MaskAux=None, BlockLists=None, stride_lists_b=0, stride_lists_h=0, list_width=0,
    MASK_BLOCK_M: tl.constexpr = 1, MASK_BLOCK_N: tl.constexpr = 1, FULL_TILES_MASKED: tl.constexpr = False,
    LOOP_IN_BOUNDS: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
):
    # V's, dO's and dV's head dim and tile width, when they differ from Q's and K's (None: the same).
    V_DIM: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V
    V_BLOCK_D: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    start_n = tl.program_id(0) * BLOCK_N
    h_kv = tl.program_id(1)
    b = tl.program_id(2)
    dropout_row_len = seqlen_k
    total_q = seqlen_q
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(b, seqlen_q, seqlen_k, CuSeqlensQ, CuSeqlensK,
                                                           SeqUsedQ, SeqUsedK, IS_VARLEN)
    if IS_VARLEN:  # the grid fits the longest sequence (dense grids are exact)
        if start_n >= seqlen_k:
            return
    diag = seqlen_k - seqlen_q

    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, V_BLOCK_D)
    k = load_tile(K + b.to(tl.int64) * stride_kb + k_start * stride_ks + h_kv.to(tl.int64) * stride_kh,
                  cols, offs_d, stride_ks, seqlen_k, HEAD_DIM, BLOCK_D, True)
    v = load_tile(V + b.to(tl.int64) * stride_vb + k_start * stride_vs + h_kv.to(tl.int64) * stride_vh,
                  cols, offs_dv, stride_vs, seqlen_k, V_DIM, V_BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, V_BLOCK_D], dtype=tl.float32)

    # Query rows that see key block [start_n, start_n + BLOCK_N): the band seen from
    # the keys' side (diag negated, left and right swapped).
    lo, full_lo, full_hi, hi = band_block_range(start_n, seqlen_k, seqlen_q, -diag, window_right, window_left,
                                                BLOCK_N, BLOCK_M, HAS_RIGHT, HAS_LEFT)
    dropout_seed = 0
    if HAS_DROPOUT:
        dropout_seed = tl.load(DropoutSeed)

    for g in range(0, head_group):
        h = h_kv * head_group + g
        q_base = Q + b.to(tl.int64) * stride_qb + q_start * stride_qs + h.to(tl.int64) * stride_qh
        do_base = DOut + b.to(tl.int64) * stride_dob + q_start * stride_dos + h.to(tl.int64) * stride_doh
        row_offset = b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h + q_start  # LseLog2, Delta
        dropout_row = dropout_row_offset(b, h, nheads, total_q, q_start)
        alibi_slope_log2 = load_alibi_slope_log2(AlibiSlopes, b, h, stride_alibi_b, HAS_ALIBI)
        if BlockLists is None:
            dk, dv = _dkdv_query_blocks(
                dk, dv, k, v, q_base, do_base, LseLog2 + row_offset, Delta + row_offset, stride_qs, stride_dos, b, h,
                lo, full_lo, cols, offs_m, offs_d, offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2,
                alibi_slope_log2, window_left, window_right, dropout_seed, dropout_row, dropout_row_len, dropout_p,
                HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_M, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                HAS_DROPOUT, DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD, ScoreAux, MaskAux,
                LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
            dk, dv = _dkdv_query_blocks(
                dk, dv, k, v, q_base, do_base, LseLog2 + row_offset, Delta + row_offset, stride_qs, stride_dos, b, h,
                full_lo, full_hi, cols, offs_m, offs_d, offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2,
                alibi_slope_log2, window_left, window_right, dropout_seed, dropout_row, dropout_row_len, dropout_p,
                HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_M, MASK_MOD is not None, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD, ScoreAux, MaskAux,
                LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
            dk, dv = _dkdv_query_blocks(
                dk, dv, k, v, q_base, do_base, LseLog2 + row_offset, Delta + row_offset, stride_qs, stride_dos, b, h,
                full_hi, hi, cols, offs_m, offs_d, offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2,
                alibi_slope_log2, window_left, window_right, dropout_seed, dropout_row, dropout_row_len, dropout_p,
                HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_M, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                HAS_DROPOUT, DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD, ScoreAux, MaskAux,
                LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
        else:
            # The block mask's lists seen from the keys (query blocks per key block): partial, then full.
            count, indices, full_count, full_indices = BlockLists
            list_row = b * stride_lists_b + h * stride_lists_h + start_n // MASK_BLOCK_N
            dk, dv = _dkdv_query_blocks(
                dk, dv, k, v, q_base, do_base, LseLog2 + row_offset, Delta + row_offset, stride_qs, stride_dos, b, h, 0,
                tl.load(count + list_row) * (MASK_BLOCK_M // BLOCK_M), cols, offs_m, offs_d, offs_dv, seqlen_q,
                seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left, window_right, dropout_seed,
                dropout_row, dropout_row_len, dropout_p, HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_M, True, HAS_LEFT,
                HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD,
                ScoreAux, MaskAux, indices + list_row.to(tl.int64) * list_width, MASK_BLOCK_M,
                LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
            dk, dv = _dkdv_query_blocks(
                dk, dv, k, v, q_base, do_base, LseLog2 + row_offset, Delta + row_offset, stride_qs, stride_dos, b, h, 0,
                tl.load(full_count + list_row) * (MASK_BLOCK_M // BLOCK_M), cols, offs_m, offs_d, offs_dv, seqlen_q,
                seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left, window_right, dropout_seed,
                dropout_row, dropout_row_len, dropout_p, HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_M,
                FULL_TILES_MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, SCORE_MOD,
                SCORE_MOD_BWD, None, ScoreAux, MaskAux, full_indices + list_row.to(tl.int64) * list_width, MASK_BLOCK_M,
                LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)

    dk = dk * softmax_scale
    store_tile(DK + b.to(tl.int64) * stride_dkb + k_start * stride_dks + h_kv.to(tl.int64) * stride_dkh,
               dk.to(DK.dtype.element_ty), cols, offs_d, stride_dks, seqlen_k, HEAD_DIM, BLOCK_D)
    store_tile(DV + b.to(tl.int64) * stride_dvb + k_start * stride_dvs + h_kv.to(tl.int64) * stride_dvh,
               dv.to(DV.dtype.element_ty), cols, offs_dv, stride_dvs, seqlen_k, V_DIM, V_BLOCK_D)


@triton.jit
def _dq_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_ks, stride_vs, b, h,
                   col_start, col_end, rows, offs_n, offs_d, offs_dv,
                   seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2,
                   window_left, window_right, dropout_seed, dropout_row, dropout_row_len, dropout_p,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_N: tl.constexpr,
                   APPLY_MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_MOD_BWD: tl.constexpr,
                   MASK_MOD: tl.constexpr, score_aux, mask_aux, block_list=None, MASK_BLOCK_N: tl.constexpr = 1,
                   LOOP_IN_BOUNDS: tl.constexpr = False):
    """Add the contributions of key blocks [col_start, col_end) to this query block's dQ (with a
    block mask's ``block_list``: its tiles, as forward._fwd_key_blocks walks them)."""
    step_size: tl.constexpr = BLOCK_N if block_list is None else 1
    for step in range(col_start, col_end, step_size):
        if block_list is None:
            start_n = step
            if SCORE_MOD is not None:  # the band's edges are tile multiples: aligned mod loads
                start_n = tl.multiple_of(step, BLOCK_N)
        else:
            start_n = listed_tile_start(block_list, step, MASK_BLOCK_N, BLOCK_N)
        cols = start_n + offs_n
        k = load_tile(k_base, cols, offs_d, stride_ks, seqlen_k, HEAD_DIM, BLOCK_D, APPLY_MASK)
        v = load_tile(v_base, cols, offs_dv, stride_vs, seqlen_k, HEAD_DIM_V, BLOCK_DV, APPLY_MASK)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, t = scores_log2(qk, rows, cols, diag, qk_scale, softcap_log2, alibi_slope_log2,
                           HAS_SOFTCAP, HAS_ALIBI)
        if (SCORE_MOD is not None) or (MASK_MOD is not None):
            q_idx, kv_idx = mod_positions(rows, cols, seqlen_q, seqlen_k, False, APPLY_MASK and not LOOP_IN_BOUNDS)
        if SCORE_MOD is not None:
            s, s_in = score_mod_log2(s, b, h, q_idx, kv_idx, SCORE_MOD, score_aux)
        if APPLY_MASK:
            s = mask_scores(s, rows, cols, seqlen_q, seqlen_k, diag, window_left, window_right,
                            HAS_LEFT, HAS_RIGHT)
            if MASK_MOD is not None:
                s = mask_mod_scores(s, b, h, q_idx, kv_idx, MASK_MOD, mask_aux)
        p = tl.exp2(s - lse_log2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = dropout_keep(dropout_seed, rows[:, None], cols[None, :], dropout_row, dropout_row_len, dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if SCORE_MOD is not None:
            ds = SCORE_MOD_BWD(ds, s_in, b, h, q_idx, kv_idx, score_aux)
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DOut, LseLog2, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_delta_b, stride_delta_h,
    CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK,
    AlibiSlopes, DropoutSeed, stride_alibi_b,
    nheads, head_group, seqlen_q, seqlen_k,
    softmax_scale, qk_scale, softcap_log2, window_left, window_right, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_BWD: tl.constexpr = None, MASK_MOD: tl.constexpr = None,
    ScoreAux=None, MaskAux=None, BlockLists=None, stride_lists_b=0, stride_lists_h=0, list_width=0,
    MASK_BLOCK_M: tl.constexpr = 1, MASK_BLOCK_N: tl.constexpr = 1, FULL_TILES_MASKED: tl.constexpr = False,
    LOOP_IN_BOUNDS: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
):
    # V's, dO's and dV's head dim and tile width, when they differ from Q's and K's (None: the same).
    V_DIM: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V
    V_BLOCK_D: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    h_kv = h // head_group
    dropout_row_len = seqlen_k
    total_q = seqlen_q
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(b, seqlen_q, seqlen_k, CuSeqlensQ, CuSeqlensK,
                                                           SeqUsedQ, SeqUsedK, IS_VARLEN)
    if IS_VARLEN:  # the grid fits the longest sequence (dense grids are exact)
        if start_m >= seqlen_q:
            return
    diag = seqlen_k - seqlen_q

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, V_BLOCK_D)
    q = load_tile(Q + b.to(tl.int64) * stride_qb + q_start * stride_qs + h.to(tl.int64) * stride_qh,
                  rows, offs_d, stride_qs, seqlen_q, HEAD_DIM, BLOCK_D, True)
    do = load_tile(DOut + b.to(tl.int64) * stride_dob + q_start * stride_dos + h.to(tl.int64) * stride_doh,
                   rows, offs_dv, stride_dos, seqlen_q, V_DIM, V_BLOCK_D, True)
    row_offset = b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h + q_start
    lse_log2 = tl.load(LseLog2 + row_offset + rows, mask=rows < seqlen_q, other=float("inf"))
    delta = tl.load(Delta + row_offset + rows, mask=rows < seqlen_q, other=0.0)
    dropout_row = dropout_row_offset(b, h, nheads, total_q, q_start)
    k_base = K + b.to(tl.int64) * stride_kb + k_start * stride_ks + h_kv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + k_start * stride_vs + h_kv.to(tl.int64) * stride_vh
    alibi_slope_log2 = load_alibi_slope_log2(AlibiSlopes, b, h, stride_alibi_b, HAS_ALIBI)
    dropout_seed = 0
    if HAS_DROPOUT:
        dropout_seed = tl.load(DropoutSeed)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = band_block_range(start_m, seqlen_q, seqlen_k, diag, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if BlockLists is None:
        dq = _dq_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_ks, stride_vs, b, h, lo, full_lo,
                            rows, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2,
                            alibi_slope_log2, window_left, window_right, dropout_seed, dropout_row, dropout_row_len,
                            dropout_p, HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD,
                            ScoreAux, MaskAux, LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
        dq = _dq_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_ks, stride_vs, b, h, full_lo, full_hi,
                            rows, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2,
                            alibi_slope_log2, window_left, window_right, dropout_seed, dropout_row, dropout_row_len,
                            dropout_p, HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_N, MASK_MOD is not None, HAS_LEFT,
                            HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD,
                            MASK_MOD, ScoreAux, MaskAux, LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
        dq = _dq_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_ks, stride_vs, b, h, full_hi, hi,
                            rows, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2,
                            alibi_slope_log2, window_left, window_right, dropout_seed, dropout_row, dropout_row_len,
                            dropout_p, HEAD_DIM, BLOCK_D, V_DIM, V_BLOCK_D, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD,
                            ScoreAux, MaskAux, LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
    else:
        # The block mask's partial key tiles, then its full ones (as the forward visits them).
        count, indices, full_count, full_indices = BlockLists
        list_row = b * stride_lists_b + h * stride_lists_h + start_m // MASK_BLOCK_M
        dq = _dq_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_ks, stride_vs, b, h,
                            0, tl.load(count + list_row) * (MASK_BLOCK_N // BLOCK_N), rows, offs_n, offs_d, offs_dv,
                            seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left,
                            window_right, dropout_seed, dropout_row, dropout_row_len, dropout_p, HEAD_DIM, BLOCK_D,
                            V_DIM, V_BLOCK_D, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                            DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD, ScoreAux, MaskAux,
                            indices + list_row.to(tl.int64) * list_width, MASK_BLOCK_N, LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
        dq = _dq_key_blocks(dq, q, do, lse_log2, delta, k_base, v_base, stride_ks, stride_vs, b, h,
                            0, tl.load(full_count + list_row) * (MASK_BLOCK_N // BLOCK_N), rows, offs_n, offs_d,
                            offs_dv, seqlen_q, seqlen_k, diag, qk_scale, softcap_log2, alibi_slope_log2, window_left,
                            window_right, dropout_seed, dropout_row, dropout_row_len, dropout_p, HEAD_DIM, BLOCK_D,
                            V_DIM, V_BLOCK_D, BLOCK_N, FULL_TILES_MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                            HAS_DROPOUT, DOT_PRECISION, SCORE_MOD, SCORE_MOD_BWD, None, ScoreAux, MaskAux,
                            full_indices + list_row.to(tl.int64) * list_width, MASK_BLOCK_N,
                            LOOP_IN_BOUNDS=LOOP_IN_BOUNDS)
    dq = dq * softmax_scale
    store_tile(DQ + b.to(tl.int64) * stride_dqb + q_start * stride_dqs + h.to(tl.int64) * stride_dqh,
               dq.to(DQ.dtype.element_ty), rows, offs_d, stride_dqs, seqlen_q, HEAD_DIM, BLOCK_D)
