"""Where one sequence of the batch lives: the same kernels serve dense and packed (varlen) batches.

Dense: the tensors are (b, s, h, d) and every sequence has the given seqlen_q / seqlen_k.
Varlen: the host passes the packed (total, h, d) tensors as (1, total, h, d) views with a batch
stride of 0, seqlen_q / seqlen_k are the totals, and each program reads its sequence's first
token and length from cu_seqlens (int32 prefix sums, batch + 1 entries) and optionally seqused
(int32, batch entries: tokens in use out of those cu_seqlens reserves). Either cu_seqlens may be
None: that side is then laid out as when dense, (b, s, h, d) with s rows per batch entry, of which
seqused says how many are in use (a kv cache: the queries of each sequence, and its cache row).
"""

import triton
import triton.language as tl


@triton.jit
def sequence_bounds(b, seqlen_q, seqlen_k, CuSeqlensQ, CuSeqlensK, SeqUsedQ, SeqUsedK, IS_VARLEN: tl.constexpr):
    """(q_start, k_start, seqlen_q, seqlen_k) of batch entry ``b``.

    q_start, k_start: the sequence's first row in the (packed) tensors, int64 (0 when dense).
    Bounds are clamped to the totals, so a malformed cu_seqlens can never make a program
    read or write outside the tensors (it gives a wrong answer the debug check catches).
    """
    if IS_VARLEN:
        if CuSeqlensQ is not None:
            q_end = tl.minimum(tl.load(CuSeqlensQ + b + 1), seqlen_q)
            q_begin = tl.minimum(tl.maximum(tl.load(CuSeqlensQ + b), 0), q_end)
            len_q = q_end - q_begin
            q_start = q_begin.to(tl.int64)
        else:  # one (b, seqlen_q) row block per batch entry, as when dense
            len_q = seqlen_q
            q_start = 0
        if CuSeqlensK is not None:
            k_end = tl.minimum(tl.load(CuSeqlensK + b + 1), seqlen_k)
            k_begin = tl.minimum(tl.maximum(tl.load(CuSeqlensK + b), 0), k_end)
            len_k = k_end - k_begin
            k_start = k_begin.to(tl.int64)
        else:
            len_k = seqlen_k
            k_start = 0
        if SeqUsedQ is not None:
            len_q = tl.maximum(tl.minimum(tl.load(SeqUsedQ + b), len_q), 0)
        if SeqUsedK is not None:
            len_k = tl.maximum(tl.minimum(tl.load(SeqUsedK + b), len_k), 0)
    else:
        q_start = 0
        k_start = 0
        len_q = seqlen_q
        len_k = seqlen_k
    return q_start, k_start, len_q, len_k
