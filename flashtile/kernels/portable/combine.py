"""Split-KV (flash-decoding) merge: each split of the keys produced a normalised partial output and
its logsumexp; the full result is their lse-weighted sum.

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i

A split that saw no key of a row has lse_i = -inf and weighs nothing; a row no split saw gets
out = 0 and lse = -inf, as everywhere else. A learnable sink (sink.py) joins here, once per row.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .scores import LN2, LOG2E
from .sink import fold_sink, load_sink_log2


@triton.jit
def attn_combine_kernel(
    OutPartial, LsePartial, Out, Lse,
    stride_ps, stride_pb, stride_pr, stride_ph,
    stride_ls, stride_lb, stride_lh,
    stride_ob, stride_or, stride_oh, stride_lse_b, stride_lse_h,
    num_rows, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, stride_lse_r=1,
    Sink=None, WAIT_PRIOR: tl.constexpr = False,
):
    """OutPartial (split, batch, row, head, d) float32, LsePartial (split, batch, head, row) float32
    -> Out (batch, row, head, d), Lse (batch, head, row) (rows stride_lse_r apart; the partial lse
    rows contiguous). One program per (row block, head, batch entry).

    Splits are read BLOCK_S at a time, as one tile: a decode step merges a handful of rows over
    8-128 splits, and a loop of one split per step would wait on each load in turn (a chain of
    memory latencies longer than the split forward itself). Sink: None, or (nheads,) sink logits.
    WAIT_PRIOR: launched as a programmatic dependent launch (sm90 on) behind the split forward, so its
    programs may start before that kernel ends: they wait for its results (griddepcontrol.wait) first."""
    if WAIT_PRIOR:
        gdc_wait()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    OutPartial += b * stride_pb
    LsePartial += b * stride_lb
    Out += b * stride_ob
    Lse += b * stride_lse_b
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    in_rows = rows < num_rows
    lse_tile_ptrs = LsePartial + h.to(tl.int64) * stride_lh + rows[None, :] + splits[:, None].to(tl.int64) * stride_ls
    row_offsets = rows.to(tl.int64)[:, None] * stride_pr + h.to(tl.int64) * stride_ph + offs_d[None, :]
    part_ptrs = OutPartial + splits[:, None, None].to(tl.int64) * stride_ps + row_offsets[None, :, :]
    row_mask = in_rows[:, None] & (offs_d[None, :] < HEAD_DIM)
    # One pass, the running max rescaling what is summed so far (as the forward's online softmax):
    # a tile's lse and outputs load together.
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        in_splits = (s0 + splits) < num_splits
        lse_s = tl.load(lse_tile_ptrs + s0 * stride_ls, mask=in_splits[:, None] & in_rows[None, :],
                        other=float("-inf"))
        part = tl.load(part_ptrs + s0 * stride_ps, mask=in_splits[:, None, None] & row_mask[None, :, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2((m - m_safe) * LOG2E)  # 0 while m is -inf (nothing summed yet)
        weight = tl.exp2((lse_s - m_safe[None, :]) * LOG2E)  # 0 for a split without keys (lse_s = -inf)
        acc = acc * rescale[:, None] + tl.sum(weight[:, :, None] * part, axis=0)
        total = total * rescale + tl.sum(weight, axis=0)
        m = m_new
    if Sink is not None:
        alpha, m_log2, total = fold_sink(m * LOG2E, total, load_sink_log2(Sink, h))
        acc = acc * alpha[:, None]
        m = m_log2 * LN2
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), m_safe + tl.log2(tl.where(empty, 1.0, total)) * LN2)
    out_ptrs = Out + rows.to(tl.int64)[:, None] * stride_or + h.to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_mask)
    tl.store(Lse + h.to(tl.int64) * stride_lse_h + rows * stride_lse_r, lse, mask=in_rows)
