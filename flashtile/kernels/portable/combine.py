"""Split-KV (flash-decoding) merge: each split of the keys produced a normalised partial output and
its logsumexp; the full result is their lse-weighted sum.

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i

A split that saw no key of a row has lse_i = -inf and weighs nothing; a row no split saw gets
out = 0 and lse = -inf, as everywhere else.
"""

import triton
import triton.language as tl

from .scores import LN2, LOG2E


@triton.jit
def attn_combine_kernel(
    OutPartial, LsePartial, Out, Lse,
    stride_ps, stride_pb, stride_pr, stride_ph,
    stride_ls, stride_lb, stride_lh,
    stride_ob, stride_or, stride_oh, stride_lse_b, stride_lse_h,
    num_rows, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """OutPartial (split, batch, row, head, d) float32, LsePartial (split, batch, head, row) float32
    -> Out (batch, row, head, d), Lse (batch, head, row); rows contiguous in the lse tensors. One
    program per (row block, head, batch entry)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    OutPartial += b * stride_pb
    LsePartial += b * stride_lb
    Out += b * stride_ob
    Lse += b * stride_lse_b
    offs_d = tl.arange(0, BLOCK_D)
    in_rows = rows < num_rows
    lse_base = LsePartial + h.to(tl.int64) * stride_lh + rows
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(lse_base + s * stride_ls, mask=in_rows, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    tile_mask = in_rows[:, None] & (offs_d[None, :] < HEAD_DIM)
    out_offsets = rows.to(tl.int64)[:, None] * stride_pr + h.to(tl.int64) * stride_ph + offs_d[None, :]
    for s in range(0, num_splits):
        lse_s = tl.load(lse_base + s * stride_ls, mask=in_rows, other=float("-inf"))
        weight = tl.exp2((lse_s - m_safe) * LOG2E)  # 0 for a split without keys (lse_s = -inf)
        part = tl.load(OutPartial + s * stride_ps + out_offsets, mask=tile_mask, other=0.0)
        acc += weight[:, None] * part
        total += weight
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), m_safe + tl.log2(tl.where(empty, 1.0, total)) * LN2)
    out_ptrs = Out + rows.to(tl.int64)[:, None] * stride_or + h.to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=tile_mask)
    tl.store(Lse + h.to(tl.int64) * stride_lse_h + rows, lse, mask=in_rows)
