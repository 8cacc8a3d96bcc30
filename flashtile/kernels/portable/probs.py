"""The attention probabilities P = softmax(scores), written out in full (N^2 memory).

Only for ``return_attn_probs=True`` and debugging: it recomputes P from q, k and the
forward's logsumexp with the same score pipeline. Dropped entries are stored negated
(flash_attn's convention: the sign carries the dropout mask).
"""

import triton
import triton.language as tl

from .dropout import dropout_keep, dropout_row_offset
from .forward import load_alibi_slope_log2
from .scores import LOG2E, mask_mod_scores, mask_scores, mod_positions, score_mod_log2, scores_log2
from .seqlens import sequence_bounds
from .tile_io import load_kv_rows, load_tile


@triton.jit
def attn_probs_kernel(
    Q, K, Lse, Probs,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_lse_b, stride_lse_h,
    stride_pb, stride_ph, stride_ps,
    CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK,
    BlockTable, stride_bt, seq_pages, num_pages,
    AlibiSlopes, DropoutSeed, stride_alibi_b,
    nheads, head_group, seqlen_q, seqlen_k,
    qk_scale, softcap_log2, window_left, window_right, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None, ScoreAux=None, MaskAux=None,
):
    """Probs: (b, h, max_seqlen_q, max_seqlen_k); entries outside a sequence's own
    (seqlen_q, seqlen_k) are left as they are (the host zero-fills them for varlen)."""
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
    if PAGE_SIZE > 0:
        seqlen_k = tl.minimum(seqlen_k, seq_pages * PAGE_SIZE)
    diag = seqlen_k - seqlen_q
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(Q + b.to(tl.int64) * stride_qb + q_start * stride_qs + h.to(tl.int64) * stride_qh,
                  rows, offs_d, stride_qs, seqlen_q, HEAD_DIM, BLOCK_D, True)
    lse = tl.load(Lse + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h + q_start + rows,
                  mask=rows < seqlen_q, other=0.0)
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    if PAGE_SIZE > 0:  # rows are found through the block table; stride_kb is the page stride
        k_base = K + h_kv.to(tl.int64) * stride_kh
    else:
        k_base = K + b.to(tl.int64) * stride_kb + k_start * stride_ks + h_kv.to(tl.int64) * stride_kh
    p_base = Probs + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph
    alibi_slope_log2 = load_alibi_slope_log2(AlibiSlopes, b, h, stride_alibi_b, HAS_ALIBI)
    dropout_seed = 0
    if HAS_DROPOUT:
        dropout_seed = tl.load(DropoutSeed)
    dropout_row = dropout_row_offset(b, h, nheads, total_q, q_start)

    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + offs_n
        k = load_kv_rows(k_base, b, h_kv, start_n, cols, offs_d, stride_ks, seqlen_k, BlockTable, stride_bt,
                         stride_kb, num_pages, 0, HEAD_DIM, BLOCK_D, True, False, PAGE_SIZE)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, _ = scores_log2(qk, rows, cols, diag, qk_scale, softcap_log2, alibi_slope_log2,
                           HAS_SOFTCAP, HAS_ALIBI)
        if (SCORE_MOD is not None) or (MASK_MOD is not None):
            q_idx, kv_idx = mod_positions(rows, cols, seqlen_q, seqlen_k, False)
        if SCORE_MOD is not None:
            s, _ = score_mod_log2(s, b, h, q_idx, kv_idx, SCORE_MOD, ScoreAux)
        s = mask_scores(s, rows, cols, seqlen_q, seqlen_k, diag, window_left, window_right,
                        HAS_LEFT, HAS_RIGHT)
        if MASK_MOD is not None:
            s = mask_mod_scores(s, b, h, q_idx, kv_idx, MASK_MOD, MaskAux)
        p = tl.exp2(s - lse_log2[:, None])
        if HAS_DROPOUT:
            keep = dropout_keep(dropout_seed, rows[:, None], cols[None, :], dropout_row, dropout_row_len, dropout_p)
            p = tl.where(keep, p, -p)
        ptrs = p_base + rows[:, None].to(tl.int64) * stride_ps + cols[None, :]
        tl.store(ptrs, p.to(Probs.dtype.element_ty), mask=(rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))
