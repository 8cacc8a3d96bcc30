"""Hopper (sm90) attention backward in Gluon, FlashAttention-3 style.

One CTA owns a key block of 2 x 64 keys of one (batch, kv head); each of its two consumer
warpgroups owns 64 of those keys and keeps their K, V tiles resident in shared memory and their
dK, dV accumulators in registers. The CTA walks every query block (of every query head of its
GQA group) that can see the key block:
  * a loader partition (1 warp) streams Q and dO tiles with TMA through a NUM_STAGES ring
    ("ready": bytes landed, "empty": both warpgroups done with the slot);
  * a consumer warpgroup works on transposed (keys x queries) tiles, so P and dS come out of the
    wgmma accumulators already in the register-A layout of the dV and dK products:
        S^T - lse = K Q^T - lse_log2 / scale_log2,  dP^T - delta = V dO^T - delta
                                                           (wgmma, shared x shared; the
                                                            accumulators start at -lse, -delta)
        P^T = exp2((S^T - lse) * scale_log2)
        dV += P^T dO                                       (wgmma, P^T from registers)
        dS^T = P^T (dP^T - delta)
        dK += dS^T Q                                       (wgmma, dS^T from registers)
    dS^T also goes to shared memory (double-buffered). While the dV and dK products of query
    block m run, a warpgroup computes its share of dQ = dS K of block m - 1 (one half of head
    dim, or one half of the query rows), whose halves from both warpgroups are in by then; so the
    warpgroups need not meet every block, and one's elementwise phase can overlap the other's
    wgmmas. Each share is added to a float32 dQ accumulator in global memory with a TMA
    reduce-add (cp.reduce.async.bulk.tensor), FA3's way. A small Triton kernel scales and casts
    that accumulator into dq.
Head dim 256 has its own consumer (gluon_attn_bwd_d256_kernel, same loader and bookkeeping):
64 keys per CTA, each warpgroup owning half of the head dim of dK and dV; see the section
"Head dim 256" below.
Causal: a key block only visits the query blocks that see it; only those on the diagonal (or a
ragged key block) pay for the mask. Rows past seqlen_q need no mask: TMA zero-fills Q, dO and
lse loads as +inf, so their P is exactly 0; the reduce-add and the dK/dV stores clip.

attn_bias (dense batches): added to S^T like the other score options. When TMA can address the bias,
the loader brings each (query block x key block) tile of it through the Q / dO ring (a slot's ready
barrier counts its bytes; TMA zero-fills rows and keys past the bias), and each warpgroup reads its
keys' half; otherwise each warpgroup loads its tile from global memory. Its gradient is dS^T: after
publishing dS^T for dQ, a warpgroup reads it back along the keys and stores it, or adds it with float32
atomics into a buffer that sums over the bias's broadcast batch and heads (scores.attn_bias_grad_t).

Varlen (IS_VARLEN, flash_attn_varlen_func's packed layout): the host passes the packed tensors as
batch-1 views (1, total, h, d), so the same descriptors serve; the grid's third axis is the
sequence, the first covers its longest key range, and every partition reads the sequence's
offsets and lengths from cu_seqlens (programs past a sequence's keys exit, all partitions on the
same condition). TMA coordinates are offset by the sequence's first row / key. Tiles running past
a sequence's end read the next sequence's rows: keys past it are masked (the ragged key block
takes the masked path), query rows past it are masked too, so their P and dS are exactly 0 and
their dQ rows add zeros into the next sequence's accumulator rows. lse / delta rows start at any
offset (a 1-D TMA box must start 16-byte aligned), so the loader warp reads them with plain loads
(+inf / 0 past the sequence) into the slot before arriving on its ready barrier; the consumers'
code is the dense one. dK / dV of a sequence's ragged last key tile are stored from registers
with a row mask (a TMA box would overwrite the next sequence's rows); the dQ convert stops at
the packed total. The dense path compiles to the same PTX as without varlen (behind constexprs).

Head dims 96 and 192 (HEAD_DIM_TRUE) run the d128 and d256 kernels with boxes of the padded width
over the true-width tensors: TMA zero-fills the missing columns of Q, dO, K, V (every product stays
exact; the padded columns of dK, dV, dQ come out zero) and clips them on the dK / dV stores and dQ
reduce-adds; the ragged-tile register stores and the dQ convert mask them. At d192 the S^T / dP^T
products skip the all-zero last 64 columns, and the second warpgroup its second (empty) dQ tile.
d64/d128/d256 compile to the same PTX as before.

Head dim 64 may also run persistent (GluonBwdConfig.persistent): one CTA per SM takes key block
after key block; see the section "Persistent backward" below.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...triton_compat import VERSION, barrier, reinterpret, tma_load, tma_reduce_add, tma_store
from .block_info import query_block_range
from .scores import (LOG2E, alibi_slope_log2, attn_bias_grad_keys, attn_bias_grad_t, attn_bias_head, attn_bias_log2,
                     attn_bias_tile_t, modded_scores_log2, relative_bias_far_entry, relative_bias_log2,
                     relative_bias_row)
from .seqlen_info import backward_sequence

# wgmma's M per warpgroup: each consumer warpgroup owns this many keys.
KEYS_PER_CONSUMER = 64
NUM_CONSUMERS = 2
BLOCK_N = KEYS_PER_CONSUMER * NUM_CONSUMERS
# The same, visible inside the kernels.
_KPC = gl.constexpr(KEYS_PER_CONSUMER)
_NC = gl.constexpr(NUM_CONSUMERS)
_BN = gl.constexpr(BLOCK_N)
# Triton 3.9 builds the K, V tiles' wgmma descriptors in a form that ptxas keeps live across the
# query-block loop instead of recomputing (d128: 548 / 1396 bytes of spills where 3.6 has 116 / 92):
# from 3.9 on, every kernel indexes them with _opaque_zero, as the persistent ones always do
# (132 / 352 bytes). Earlier releases keep constant indices, which are faster there.
_OPAQUE_KV = gl.constexpr(VERSION >= (3, 9))


# ----------------------------------------------------------------------------------------------
# The dQ convert overlapped with the kernel's last CTAs (GluonBwdConfig.overlap_convert).
# ----------------------------------------------------------------------------------------------
#
# The convert is launched as a programmatic dependent launch: it may start once every CTA of this
# kernel has started (each says so at its start), so its programs run on the SMs the kernel's last,
# partial wave leaves idle. Each consumer warpgroup, once its dK / dV stores and dQ reduce-adds have
# landed, adds 1 to its (batch, KV head)'s done count (release); a convert program waits (acquire)
# until its head's count is 2 x the key blocks, converts, and finally waits for the whole kernel
# (griddepcontrol.wait), so that what follows the convert in the stream sees a finished backward.

@gluon.jit
def _allow_dependent_launch():
    """griddepcontrol.launch_dependents: this CTA has started (see the section comment)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _warpgroup_writes_landed(stored):
    """This warpgroup's bulk (TMA) writes (dK, dV stores, dQ reduce-adds) have landed in global memory
    (cp.async.bulk.wait_group 0, not the .read form tma.store_wait emits) and are fenced against
    generic-proxy accesses; then it arrives on ``stored``. The loader warp counts the CTA in once
    both warpgroups have (so the consumers, short of registers, hold no counts pointer)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
                              "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    barrier()  # every thread's writes have landed before the arrival
    mbarrier.arrive(stored)


@gluon.jit
def _count_cta_done(done_counts, stored, kv_head, HEADS_FIRST: gl.constexpr):
    """In the loader warp: once both consumer warpgroups' writes have landed, one lane adds 1 to the
    CTA's (batch, KV head) done count with release semantics (gpu scope). Dense grids only (the
    third axis is the batch)."""
    mbarrier.wait(stored, 0)
    if HEADS_FIRST:
        nheads_k = gl.num_programs(0)
    else:
        nheads_k = gl.num_programs(1)
    count = done_counts + gl.program_id(2) * nheads_k + kv_head
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .u32 lane;\n\tmov.u32 lane, %laneid;\n\tsetp.eq.u32 first, lane, 0;"
        "\n\t@first red.release.gpu.global.add.u32 [$1], 1;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l", [count.to(gl.int64, bitcast=True)], dtype=gl.int32, is_pure=False, pack=1)


# ----------------------------------------------------------------------------------------------
# Masking of the transposed scores S^T (keys x query columns), shared by every head dim.
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _past_used_rows(row_values, start, seqlen_q, fill, BLOCK: gl.constexpr, col_layout: gl.constexpr):
    """A per-query vector (lse or delta) of rows start + [0, BLOCK) with ``fill`` for rows past
    seqlen_q, whose lse / delta come from row padding or a later head or sequence (anything, NaN
    included). lse = +inf starts S^T at -inf there, so P^T = 0, and delta = 0 keeps dP^T - delta
    finite, so dS^T = 0: the ragged query end is masked per column (BLOCK / 4 selects per thread),
    not per score."""
    offsets = gl.arange(0, BLOCK, layout=col_layout)
    return gl.where(offsets < seqlen_q - start, row_values, fill)


@gluon.jit
def _mask_keys(x, keys, start, seqlen_k, diag, BLOCK: gl.constexpr, CAUSAL: gl.constexpr,
               col_layout: gl.constexpr, LOCAL: gl.constexpr = False, window_left=0, window_right=0):
    """x = S^T, or the start of its accumulator (rows: keys; columns: queries start + [0, BLOCK)),
    with -inf where the key is past seqlen_k or, when CAUSAL, after the query's diagonal (key <=
    query + diag visible). One compare per score: the column's offset (a constant per thread)
    against its key row's first visible column offset. (Comparing absolute indices against every
    bound per score cost the d64 loop 2.4x its unmasked instructions: ptxas kept the predicates in
    packed registers.) Applied to the accumulator's start (-lse), the mask costs no register past
    the wgmma and the start's broadcast is the select's other operand: the d64 causal masked loop
    went from 995 SASS instructions (26 spill instructions) to 878 (none). LOCAL: the query's
    window too (key visible iff query + diag - window_left <= key <= query + diag + window_right)."""
    offsets = gl.arange(0, BLOCK, layout=col_layout)
    first = gl.where(keys < seqlen_k, 0, BLOCK)
    if CAUSAL:
        first = gl.maximum(first, keys - diag - start)
    if LOCAL:
        first = gl.maximum(first, keys - diag - window_right - start)
    keep = gl.expand_dims(offsets, 0) >= gl.expand_dims(first, 1)
    if LOCAL:
        keep = keep & (gl.expand_dims(offsets, 0) <= gl.expand_dims(keys - diag + window_left - start, 1))
    return gl.where(keep, x, float("-inf"))


# ----------------------------------------------------------------------------------------------
# Loader partition: K, V once, then the Q/dO ring.
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _key_block_and_head(HEADS_FIRST: gl.constexpr):
    """(key block index, KV head) of this program. The grid is (key blocks, KV heads, sequences),
    or with HEADS_FIRST (KV heads, key blocks, batch): CTAs then start with every head's first key
    block of a batch, then every head's second, ... (GluonBwdConfig.heads_first). Both stay
    special-register reads, which ptxas re-issues instead of holding them in registers."""
    if HEADS_FIRST:
        return gl.program_id(1), gl.program_id(0)
    else:
        return gl.program_id(0), gl.program_id(1)


@gluon.jit
def _load_blocks(q_desc, do_desc, kv_desc_k, kv_desc_v, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                 lse_smem, delta_smem, kv_ready, q_ready, q_empty, start_n, kv_head, batch, tma_batch, q_start,
                 k_start, seqlen_q, seqlen_k, nheads, head_group, lse_row_stride, lse_ptr, delta_ptr,
                 BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr,
                 it0=0, LOCAL: gl.constexpr = False, window_left=0, window_right=0, bias_desc=None, bias_smem=None,
                 bias_batches=1, bias_heads=1):
    """K, V of the key block at start_n, then the Q, dO (lse, delta) tiles of every query block that
    sees it through the ring, from ring position it0 on; returns the position after the last. With
    bias_desc, each slot also takes the (query block x key block) tile of attn_bias (bias_batches,
    bias_heads: its batch and head dims, 1 where it broadcasts)."""
    NKV: gl.constexpr = k_smem.shape[0]
    BN: gl.constexpr = NKV * _KPC
    mbarrier.expect(kv_ready, NKV * (kv_desc_k.block_type.nbytes + kv_desc_v.block_type.nbytes))
    for c in gl.static_range(NKV):
        tma_load(kv_desc_k, [tma_batch, k_start + start_n + c * _KPC, kv_head, 0], kv_ready,
                                        k_smem.index(c))
        tma_load(kv_desc_v, [tma_batch, k_start + start_n + c * _KPC, kv_head, 0], kv_ready,
                                        v_smem.index(c))

    m_lo, m_full, m_tail, m_end = query_block_range(start_n, seqlen_q, seqlen_k, BLOCK_M, BN, CAUSAL, LOCAL,
                                                    window_left, window_right)
    if IS_VARLEN:
        # lse / delta rows of a sequence start at any q_start, and a 1-D TMA box must start 16-byte
        # aligned: this warp loads them itself (rows past the sequence: lse +inf, so P = 0) and
        # stores them into the slot before it arrives on the slot's ready barrier.
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
        row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        offs = gl.arange(0, BLOCK_M, layout=row_layout)
    else:
        q_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                 + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    BIAS_TMA: gl.constexpr = bias_desc is not None
    if BIAS_TMA:
        slot_bytes: gl.constexpr = q_bytes + bias_desc.block_type.nbytes
    else:
        slot_bytes: gl.constexpr = q_bytes
    it = it0
    for g in range(head_group):
        head = kv_head * head_group + g
        if IS_VARLEN:
            # lse / delta: (1, h, total_q) rows lse_row_stride apart.
            row_base = head * lse_row_stride + q_start
        else:
            # lse / delta: (b, h, sq) rows lse_row_stride apart (a multiple of 4: 16-byte aligned boxes).
            row_base = (batch * nheads + head) * lse_row_stride
        for m in range(m_lo, m_end):
            slot = it % NUM_STAGES
            if IS_VARLEN:
                # Issued before the wait for the slot: the latency hides behind it.
                rows = m * BLOCK_M + offs
                in_seq = rows < seqlen_q
                lse = gl.load(lse_ptr + row_base + rows, mask=in_seq, other=float("inf"))
                delta = gl.load(delta_ptr + row_base + rows, mask=in_seq, other=0.0)
            # Waiting on the opposite parity passes at once on a fresh barrier (first lap).
            mbarrier.wait(q_empty.index(slot), ((it // NUM_STAGES) & 1) ^ 1)
            if IS_VARLEN:
                lse_smem.index(slot).store(lse)
                delta_smem.index(slot).store(delta)
                # Every lane's stores precede the (one-thread, release) arrive below.
                barrier()
            mbarrier.expect(q_ready.index(slot), slot_bytes)
            tma_load(q_desc, [tma_batch, q_start + m * BLOCK_M, head, 0], q_ready.index(slot),
                                            q_smem.index(slot))
            tma_load(do_desc, [tma_batch, q_start + m * BLOCK_M, head, 0], q_ready.index(slot),
                                            do_smem.index(slot))
            if not IS_VARLEN:
                tma_load(lse_desc, [row_base + m * BLOCK_M], q_ready.index(slot),
                                                lse_smem.index(slot))
                tma_load(delta_desc, [row_base + m * BLOCK_M], q_ready.index(slot),
                                                delta_smem.index(slot))
            if BIAS_TMA:
                tma_load(bias_desc, [batch % bias_batches, head % bias_heads, m * BLOCK_M, start_n],
                         q_ready.index(slot), bias_smem.index(slot))
            it += 1
    return it


@gluon.jit
def _loader(q_desc, do_desc, kv_desc_k, kv_desc_v, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
            lse_smem, delta_smem, kv_ready, q_ready, q_empty, seqlen_q, seqlen_k, nheads, head_group, lse_row_stride,
            cu_seqlens_q, cu_seqlens_k, seqused_q, lse_ptr, delta_ptr, done_counts, stored, window_left, window_right,
            BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr,
            HEADS_FIRST: gl.constexpr, LOCAL: gl.constexpr, bias_desc=None, bias_smem=None, bias_batches=1,
            bias_heads=1):
    # The key block is k_smem.shape[0] tiles of 64 keys (2 at d64/d128, 1 at d256).
    NKV: gl.constexpr = k_smem.shape[0]
    BN: gl.constexpr = NKV * _KPC
    key_block, kv_head = _key_block_and_head(HEADS_FIRST)
    start_n = key_block * BN
    batch = gl.program_id(2)
    tma_batch, q_start, k_start, seqlen_q, seqlen_k = backward_sequence(cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                                        seqlen_q, seqlen_k, IS_VARLEN)
    if IS_VARLEN:
        # The grid covers the longest sequence: a key block past this one's keys has no work (the
        # consumers skip it on the same condition, so no barrier is left waiting).
        if start_n < seqlen_k:
            _load_blocks(q_desc, do_desc, kv_desc_k, kv_desc_v, lse_desc, delta_desc, q_smem, do_smem, k_smem,
                         v_smem, lse_smem, delta_smem, kv_ready, q_ready, q_empty, start_n, kv_head, batch,
                         tma_batch, q_start, k_start, seqlen_q, seqlen_k, nheads, head_group, lse_row_stride,
                         lse_ptr, delta_ptr, BLOCK_M, NUM_STAGES, CAUSAL, IS_VARLEN, 0, LOCAL, window_left,
                         window_right, bias_desc, bias_smem, bias_batches, bias_heads)
    else:
        _load_blocks(q_desc, do_desc, kv_desc_k, kv_desc_v, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                     lse_smem, delta_smem, kv_ready, q_ready, q_empty, start_n, kv_head, batch, tma_batch, q_start,
                     k_start, seqlen_q, seqlen_k, nheads, head_group, lse_row_stride, lse_ptr, delta_ptr,
                     BLOCK_M, NUM_STAGES, CAUSAL, IS_VARLEN, 0, LOCAL, window_left, window_right, bias_desc,
                     bias_smem, bias_batches, bias_heads)
        if done_counts is not None:
            _count_cta_done(done_counts, stored, kv_head, HEADS_FIRST)


@gluon.jit
def _store_rows(ptr, stride_s, stride_h, row0, head, col0, vals, n_rows, layout: gl.constexpr,
                N_COLS: gl.constexpr):
    """Rows [0, n_rows) and columns [0, N_COLS) of the register tile vals to (s, h, d) memory at row
    row0, column col0, one head (a ragged tile at a sequence's end, which a TMA box would write past;
    N_COLS < the tile's width: a padded tile, whose last columns are the next head's). The tensor has
    a TMA descriptor, so its strides are multiples of 8 elements: spelled out (x // 8 * 8) so the
    compiler can vectorize."""
    R: gl.constexpr = vals.shape[0]
    C: gl.constexpr = vals.shape[1]
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    row_off = (row0 + rows).to(gl.int64) * (stride_s // 8 * 8) + head.to(gl.int64) * (stride_h // 8 * 8) + col0
    ptrs = ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(cols, 0)
    keep = gl.expand_dims(rows < n_rows, 1)
    if N_COLS < C:
        keep = keep & gl.expand_dims(cols < N_COLS, 0)
    gl.store(ptrs, vals, mask=keep)


# ----------------------------------------------------------------------------------------------
# Consumer partition: one warpgroup, 64 keys.
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _issue_dq(ds_smem, k_smem, buf, dq_layout: gl.constexpr, CONSUMER: gl.constexpr, DQ_SPLIT_M: gl.constexpr,
              zero=0):
    """This warpgroup's share of dQ = dS K for the query block whose dS^T halves (both
    warpgroups') are in buffer buf: one half of the head dim, or (DQ_SPLIT_M) of the query rows.
    zero: 0, or a run-time 0 for the K tiles' index (see _opaque_zero)."""
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    DQ_N: gl.constexpr = dq_layout.instr_shape[1]
    dq_tok = gl.zeros([_KPC, DQ_N], gl.float32, dq_layout)
    for c in gl.static_range(_NC):
        ds_c = ds_smem.index(buf * _NC + c).permute([1, 0])           # [BLOCK_M, 64 keys]
        k_c = k_smem.index(c + zero).reshape([_KPC, HEAD_DIM])  # [64 keys, HEAD_DIM]
        if DQ_SPLIT_M:
            ds_c = ds_c.slice(CONSUMER * _KPC, _KPC, dim=0)
        else:
            k_c = k_c.slice(CONSUMER * DQ_N, DQ_N, dim=1)
        dq_tok = warpgroup_mma(ds_c, k_c, dq_tok, use_acc=c > 0, is_async=True)
    return dq_tok


@gluon.jit
def _opaque_zero(it):
    """0 as a run-time value ptxas cannot fold (a ring position is < 2**30). The persistent kernel
    and the head-dim-256 one index their K, V tiles with it, so every query-block loop computes
    their wgmma descriptors itself: ptxas 12.8 once computed one only in an earlier loop's
    preheader, which an empty loop skips, and descriptors held across a loop cost registers. The
    persistent d64 kernel spills 0 / 16 bytes (full / causal) instead of 16 / 92, the d256 one none
    instead of 412 / 344. (At d128 it cut
    the spills from 116 / 268 bytes to 16 / 16 but ran slower on 3.6: used there from Triton 3.9
    only, see _OPAQUE_KV.)"""
    return it >> 30


@gluon.jit
def _wait_dkdv(pending: gl.constexpr, dv_tok, dk_tok, p_op, ds_op, q_buf, do_buf):
    """dV, dK once their wgmmas retire (pending: how many later wgmma groups may stay in flight)."""
    dv, dk, _, _, _, _ = warpgroup_mma_wait(pending, deps=[dv_tok, dk_tok, p_op, ds_op, q_buf, do_buf])
    return dv, dk


@gluon.jit
def _wait_dq(dq_tok, ds_smem):
    """The dQ share once its wgmmas (reading the dS^T buffers) retire."""
    dq, _ = warpgroup_mma_wait(0, deps=[dq_tok, ds_smem])
    return dq


@gluon.jit
def _reduce_add_dq(dq, dq_smem, dq_desc, tma_batch, q_row, head, CONSUMER: gl.constexpr, DQ_SPLIT_M: gl.constexpr):
    """Stage this warpgroup's dQ share and add it to the float32 accumulator (rows from q_row)."""
    DQ_N: gl.constexpr = dq_smem.shape[4]
    dq_stage = dq_smem.index(CONSUMER)
    dq_stage.reshape([_KPC, DQ_N]).store(dq)
    fence_async_shared()
    if DQ_SPLIT_M:
        tma_reduce_add(dq_desc, [tma_batch, q_row + CONSUMER * _KPC, head, 0], dq_stage)
    else:
        tma_reduce_add(dq_desc, [tma_batch, q_row, head, CONSUMER * DQ_N], dq_stage)


@gluon.jit
def _modded_probabilities(s, lse, keys, key0, start_m, seqlen_k, diag, qk_scale_log2, score, bias,
                          BLOCK_M: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, LOCAL: gl.constexpr,
                          SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, REL_BIAS: gl.constexpr, BIAS: gl.constexpr,
                          col_layout: gl.constexpr):
    """(P^T, t) of a block of raw S^T (keys along rows) with the score options (scores.py; t: softcap's
    tanh, for its derivative), masked when MASK. bias: with BIAS, the block's attn_bias tile as loaded
    (scores.attn_bias_tile_t)."""
    slope_log2, softcap_scale, softcap_log2, window_left, window_right, rel_row, rel_distance, _bias = score
    KEYS: gl.constexpr = s.shape[0]
    # query + diag - key, for ALiBi's distance.
    offset = gl.expand_dims(start_m + diag + gl.arange(0, BLOCK_M, layout=col_layout), 0) - gl.expand_dims(keys, 1)
    s, t = modded_scores_log2(s, offset, qk_scale_log2, softcap_scale, softcap_log2, slope_log2, SOFTCAP, ALIBI)
    if REL_BIAS:
        queries = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        entry = relative_bias_far_entry(key0 - (start_m + BLOCK_M - 1), key0 + (KEYS - 1) - start_m, rel_distance)
        s = relative_bias_log2(s, gl.expand_dims(keys, 1), gl.expand_dims(queries, 0), entry, rel_row, rel_distance)
    if BIAS:
        s = s + attn_bias_log2(bias)
    s = s - gl.expand_dims(lse, 0)
    if MASK:
        s = _mask_keys(s, keys, start_m, seqlen_k, diag, BLOCK_M, CAUSAL, col_layout, LOCAL, window_left, window_right)
    return gl.exp2(s), t


@gluon.jit
def _ring_bias_tile_t(bias_smem, slot, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, _KPC: gl.constexpr,
                      s_layout: gl.constexpr):
    """This consumer's keys of the attn_bias tile in ring slot ``slot``, transposed as S^T (keys x queries), as
    stored."""
    tile = bias_smem.index(slot).reshape([BLOCK_M, 2 * _KPC]).slice(CONSUMER * _KPC, _KPC, dim=1)
    return tile.permute([1, 0]).load(s_layout)


@gluon.jit
def _query_blocks(it, dk, dv, grad_sum, prev_row, prev_head, m_start, m_stop, head, tma_batch, q_start, key0,
                  q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, q_ready, q_empty, ds_ready,
                  ds_free, dq_desc, seqlen_q, seqlen_k, qk_scale_log2,
                  CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                  MASK: gl.constexpr, CAUSAL: gl.constexpr, DQ_SPLIT_M: gl.constexpr,
                  s_layout: gl.constexpr, a_layout: gl.constexpr, dq_layout: gl.constexpr, first_it=0,
                  OPAQUE_KV: gl.constexpr = False, score=None, LOCAL: gl.constexpr = False,
                  SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False, REL_BIAS: gl.constexpr = False,
                  BIAS: gl.constexpr = False, BIAS_GRAD: gl.constexpr = 0, bias_smem=None,
                  av_layout: gl.constexpr = None):
    """Query blocks [m_start, m_stop) of one query head: accumulate dK, dV, and reduce-add the dQ
    of the block before each (its dS^T halves are in shared memory by then: the warpgroups need
    not meet every block, so one's elementwise phase can overlap the other's wgmmas). prev_row,
    prev_head: where that previous block's dQ goes (the caller drains the last one). first_it: the
    ring position of the key block's first query block (a persistent CTA's key blocks continue the
    ring and the dS^T buffers' phases). OPAQUE_KV: index the K, V tiles with _opaque_zero. grad_sum:
    with BIAS_GRAD 3, this warpgroup's keys' sums of dS^T over the query blocks so far (attn_bias's
    gradient summed along the queries), else 0.
    score: (ALiBi slope, softcap scale, softcap, window left, window right, relative-bias row, its
    distance, attn_bias) of SOFTCAP / ALIBI / LOCAL / REL_BIAS / BIAS (scores.py; the forward's
    _softmax_block takes the same); attn_bias is (the (batch, head)'s first bias element, the bias's
    query stride, the same of its gradient's buffer), whose BIAS_GRAD (scores.attn_bias_grad_t) says
    how dS^T goes into it; with bias_smem, the bias tiles come through the Q / dO ring instead. With
    softcap, ALiBi or a loaded bias the scores are formed from the raw S^T (the accumulator starts at 0,
    not -lse) and masked after the options. A bias from the ring (without softcap, which it would follow)
    starts S^T's accumulator instead, in score units: it is not live while the products run, and without
    ALiBi P^T comes out as plain attention's."""
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    V_DIM: gl.constexpr = v_smem.shape[4]
    dtype: gl.constexpr = k_smem.dtype
    diag = seqlen_k - seqlen_q
    k_mine = k_smem.index(CONSUMER).reshape([_KPC, HEAD_DIM])
    v_mine = v_smem.index(CONSUMER).reshape([_KPC, V_DIM])
    keys = key0 + gl.arange(0, _KPC, layout=gl.SliceLayout(1, s_layout))
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    lse_to_score = 1.0 / qk_scale_log2
    # BIAS 2: the bias is one row (it broadcasts along the queries): this warpgroup's keys of it, read once.
    BIAS_IN_ACC: gl.constexpr = BIAS and (bias_smem is not None or BIAS == 2) and not SOFTCAP
    BIAS_ADDED: gl.constexpr = BIAS and not BIAS_IN_ACC
    MODDED: gl.constexpr = SOFTCAP or ALIBI or REL_BIAS or BIAS_ADDED
    # The relative bias alone, on unmasked blocks: those beyond its distance take one table entry.
    FAR_BIAS_FOLDS: gl.constexpr = REL_BIAS and not (SOFTCAP or ALIBI or MASK)
    if LOCAL or MODDED or BIAS:
        slope_log2, softcap_scale, softcap_log2, window_left, window_right, rel_row, rel_distance, attn_bias = score
        bias_head, stride_bias_m, grad_head, stride_grad_m = attn_bias
    else:
        window_left = 0
        window_right = 0
    if BIAS == 2:
        bias_row = gl.load(bias_head + keys, mask=keys < seqlen_k, other=0.0).to(gl.float32)

    for m in range(m_start, m_stop):
        slot = it % NUM_STAGES
        buf = it % 2
        start_m = m * BLOCK_M
        mbarrier.wait(q_ready.index(slot), (it // NUM_STAGES) & 1)
        q_buf = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do_buf = do_smem.index(slot).reshape([BLOCK_M, V_DIM])
        if OPAQUE_KV:
            zero = _opaque_zero(it)
            k_cur = k_smem.index(CONSUMER + zero).reshape([_KPC, HEAD_DIM])
            v_cur = v_smem.index(CONSUMER + zero).reshape([_KPC, V_DIM])
        else:
            zero = 0
            k_cur = k_mine
            v_cur = v_mine
        # S^T starts at -lse in score units (lse_log2 / scale_log2), so x = S^T * scale_log2 comes
        # straight out of the wgmma; dP^T starts at -delta, so delta is not live while dS^T is
        # formed. Both are read before either wgmma claims shared memory, and the two wgmmas
        # issue back to back.
        lse = lse_smem.index(slot).load(col_layout)
        delta = delta_smem.index(slot).load(col_layout)
        if MASK:
            lse = _past_used_rows(lse, start_m, seqlen_q, float("inf"), BLOCK_M, col_layout)
            delta = _past_used_rows(delta, start_m, seqlen_q, 0.0, BLOCK_M, col_layout)
        if BIAS_IN_ACC:
            # In raw score units: this warpgroup's keys of the slot's bias tile (TMA zero-fills rows and keys
            # past the bias), or of the bias's one row.
            if bias_smem is not None:
                s_start = (_ring_bias_tile_t(bias_smem, slot, CONSUMER, BLOCK_M, _KPC, s_layout).to(gl.float32)
                           * (LOG2E * lse_to_score))
            else:
                s_start = (gl.zeros([_KPC, BLOCK_M], gl.float32, s_layout)
                           + gl.expand_dims(bias_row * (LOG2E * lse_to_score), 1))
        else:
            s_start = gl.zeros([_KPC, BLOCK_M], gl.float32, s_layout)
        if MODDED:
            s_init = s_start
            if FAR_BIAS_FOLDS:
                # A block beyond the table's distance from every query adds one entry to all its
                # scores: it joins -lse in S^T's start, and P^T comes out as plain attention's.
                entry = relative_bias_far_entry(key0 - (start_m + BLOCK_M - 1), key0 + (_KPC - 1) - start_m,
                                                rel_distance)
                if entry >= 0:
                    bias = gl.load(rel_row + entry) * LOG2E
                    s_init = s_init - gl.expand_dims((lse - bias) * lse_to_score, 0)
        else:
            s_init = s_start - gl.expand_dims(lse * lse_to_score, 0)
            if MASK:
                # -inf in the accumulator's start stays -inf through the product: masked before the
                # wgmma issues, off the path from S^T to P^T.
                s_init = _mask_keys(s_init, keys, start_m, seqlen_k, diag, BLOCK_M, CAUSAL, col_layout, LOCAL,
                                    window_left, window_right)
        dp_init = gl.zeros([_KPC, BLOCK_M], gl.float32, s_layout) - gl.expand_dims(delta, 0)
        s_tok = warpgroup_mma(k_cur, q_buf.permute([1, 0]), s_init, is_async=True)
        dp_tok = warpgroup_mma(v_cur, do_buf.permute([1, 0]), dp_init, is_async=True)
        bias = 0
        if BIAS_ADDED:
            # Read while both products are in flight: this warpgroup's keys of the slot's tile, or loaded from
            # global memory.
            if bias_smem is not None:
                bias = _ring_bias_tile_t(bias_smem, slot, CONSUMER, BLOCK_M, _KPC, s_layout)
            elif BIAS == 2:
                bias = gl.expand_dims(bias_row, 1)
            else:
                bias = attn_bias_tile_t(bias_head, stride_bias_m, key0, start_m, seqlen_q, seqlen_k, _KPC, BLOCK_M,
                                        MASK, s_layout)

        # P^T while dP^T is still in flight.
        s, _, _ = warpgroup_mma_wait(1, deps=[s_tok, k_cur, q_buf])
        if FAR_BIAS_FOLDS:
            if entry >= 0:
                p = gl.exp2(s * qk_scale_log2)
            else:
                p, t = _modded_probabilities(s, lse, keys, key0, start_m, seqlen_k, diag, qk_scale_log2, score, bias,
                                             BLOCK_M, MASK, CAUSAL, LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS_ADDED,
                                             col_layout)
        elif MODDED:
            p, t = _modded_probabilities(s, lse, keys, key0, start_m, seqlen_k, diag, qk_scale_log2, score, bias,
                                         BLOCK_M, MASK, CAUSAL, LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS_ADDED, col_layout)
        else:
            p = gl.exp2(s * qk_scale_log2)
        # dS^T = P^T (dP^T - delta); then dV and dK are issued back to back (FA3 order: P^T in
        # float32 dies before the dV/dK operands are materialised).
        dp_minus_delta, _, _ = warpgroup_mma_wait(0, deps=[dp_tok, v_cur, do_buf])
        ds = p * dp_minus_delta
        if BIAS_GRAD == 3:
            # Summed in float32 before softcap's derivative (the bias adds to the capped score).
            grad_sum = grad_sum + gl.sum(ds, axis=1)
        if SOFTCAP:
            if BIAS_GRAD == 1 or BIAS_GRAD == 2:
                ds_bias = ds.to(dtype)  # the bias adds to the capped score: dS^T before softcap's derivative
            ds = ds * (1.0 - t * t)  # d(softcap * tanh(x / softcap)) / dx
        ds = ds.to(dtype)
        if av_layout is None:
            p_op = gl.convert_layout(p.to(dtype), a_layout)
        else:
            # dV's accumulator is V_DIM wide (head_dim_v != head_dim_qk): P^T as its operand.
            p_op = gl.convert_layout(p.to(dtype), av_layout)
        dv_tok = warpgroup_mma(p_op, do_buf, dv, is_async=True)
        ds_op = gl.convert_layout(ds, a_layout)
        dk_tok = warpgroup_mma(ds_op, q_buf, dk, is_async=True)

        # Publish this warpgroup's dS^T rows (buffer free once both have used it two blocks ago).
        mbarrier.wait(ds_free.index(buf), ((it // 2) & 1) ^ 1)
        ds_smem.index(buf * _NC + CONSUMER).store(ds)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(buf))
        if BIAS_GRAD == 1 or BIAS_GRAD == 2:
            # attn_bias's gradient, while dV and dK run: dS^T as just published (read back along the keys),
            # or with softcap the one before its derivative (moved through scratch shared memory).
            if SOFTCAP:
                attn_bias_grad_t(ds_bias, grad_head, stride_grad_m, key0, start_m, seqlen_q, seqlen_k, MASK,
                                 BIAS_GRAD)
            else:
                attn_bias_grad_t(ds_smem.index(buf * _NC + CONSUMER), grad_head, stride_grad_m, key0, start_m,
                                 seqlen_q, seqlen_k, MASK, BIAS_GRAD, True)

        if it > first_it:
            # dQ of the previous block, whose halves are both in by now (the other warpgroup
            # published its own a whole block ago, unless it runs a block behind).
            prev = it - 1
            mbarrier.wait(ds_ready.index(prev % 2), (prev // 2) & 1)
            dq_tok = _issue_dq(ds_smem, k_smem, prev % 2, dq_layout, CONSUMER, DQ_SPLIT_M, zero)
            # dV, dK retired: the Q/dO slot is free.
            dv, dk = _wait_dkdv(1, dv_tok, dk_tok, p_op, ds_op, q_buf, do_buf)
            mbarrier.arrive(q_empty.index(slot))
            # The previous reduce-add must have read the staging buffer before it is overwritten.
            tma.store_wait(0)
            barrier()
            dq = _wait_dq(dq_tok, ds_smem)
            mbarrier.arrive(ds_free.index(prev % 2))
            _reduce_add_dq(dq, dq_smem, dq_desc, tma_batch, prev_row, prev_head, CONSUMER, DQ_SPLIT_M)
        else:
            dv, dk = _wait_dkdv(0, dv_tok, dk_tok, p_op, ds_op, q_buf, do_buf)
            mbarrier.arrive(q_empty.index(slot))
        prev_row = q_start + start_m
        prev_head = head
        it += 1
    return it, dk, dv, grad_sum, prev_row, prev_head


@gluon.jit
def _attn_bias_heads(attn_bias, bias_grad, batch, head, BIAS: gl.constexpr, BIAS_GRAD: gl.constexpr):
    """(bias's first element of (batch, head), its query stride, the same of the gradient's buffer)
    from the (tensor, batch stride, head stride, query stride) tuples (0 for what is absent)."""
    if BIAS:
        bias, stride_b, stride_h, stride_m = attn_bias
        bias_head = attn_bias_head(bias, stride_b, stride_h, batch, head, bias is not None)
        if BIAS_GRAD != 0:
            grad, grad_stride_b, grad_stride_h, grad_stride_m = bias_grad
            grad_head = attn_bias_head(grad, grad_stride_b, grad_stride_h, batch, head, True)
        else:
            grad_head = 0
            grad_stride_m = 0
        heads = (bias_head, stride_m, grad_head, grad_stride_m)
    else:
        heads = (0, 0, 0, 0)
    return heads


@gluon.jit
def _consume_keys(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready,
                  q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc, start_n, kv_head, tma_batch, q_start,
                  k_start, seqlen_q, seqlen_k, head_group, qk_scale_log2, softmax_scale,
                  dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s, stride_dv_h,
                  CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, DQ_SPLIT_M: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM_TRUE: gl.constexpr,
                  it0=0, kv_empty=None, batch=0, alibi_slopes=None, stride_alibi_b=0, window_left=0, window_right=0,
                  softcap_scale=0.0, softcap_log2=0.0, LOCAL: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                  ALIBI: gl.constexpr = False, rel_bias_table=None, rel_bias_distance=0,
                  REL_BIAS: gl.constexpr = False, attn_bias=None, bias_grad=None, BIAS: gl.constexpr = False,
                  BIAS_GRAD: gl.constexpr = 0, bias_smem=None, HEAD_DIM_V_TRUE: gl.constexpr = None):
    """This warpgroup's share of the key block at start_n: its dK, dV over every query block that
    sees the key block, its share of their dQ. A persistent CTA (kv_empty given) starts at ring
    position it0 with K, V already waited for, and returns the position after its last block.
    batch (the batch or packed sequence, for ALiBi's (b, h) slopes) onwards: the score options;
    attn_bias, bias_grad: (tensor, batch stride, head stride, query stride) of the bias and of its
    gradient's buffer (BIAS, BIAS_GRAD); bias_smem: the bias tiles' ring (the tensor is then None).
    V, dO, dV may be narrower or wider than Q, K (head_dim_v != head_dim_qk: v_smem's tile width,
    HEAD_DIM_V_TRUE of its columns in the tensors)."""
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    V_DIM: gl.constexpr = v_smem.shape[4]
    V_TRUE: gl.constexpr = HEAD_DIM_TRUE if HEAD_DIM_V_TRUE is None else HEAD_DIM_V_TRUE
    DQ_N: gl.constexpr = dq_smem.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_N, 16])
    # P^T, dS^T feed wgmma as register A operands; with matching M tiling this layout is the
    # S^T accumulator layout, so the conversion moves no data.
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if V_DIM != HEAD_DIM:
        accv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, V_DIM, 16])
        av_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=accv_layout, k_width=2)
    else:
        accv_layout: gl.constexpr = acc_layout
        av_layout: gl.constexpr = None

    key0 = start_n + CONSUMER * _KPC
    m_lo, m_full, m_tail, m_end = query_block_range(start_n, seqlen_q, seqlen_k, BLOCK_M, _BN, CAUSAL, LOCAL,
                                                    window_left, window_right)

    dk = gl.zeros([_KPC, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([_KPC, V_DIM], gl.float32, accv_layout)
    PERSISTENT: gl.constexpr = kv_empty is not None
    if not PERSISTENT:
        mbarrier.wait(kv_ready, 0)
    it = it0
    prev_row = 0
    prev_head = 0
    for g in range(head_group):
        head = kv_head * head_group + g
        score = (alibi_slope_log2(alibi_slopes, stride_alibi_b, batch, head, ALIBI), softcap_scale, softcap_log2,
                 window_left, window_right, relative_bias_row(rel_bias_table, head, rel_bias_distance, REL_BIAS),
                 rel_bias_distance, _attn_bias_heads(attn_bias, bias_grad, batch, head, BIAS, BIAS_GRAD))
        grad_sum = 0
        if BIAS_GRAD == 3:
            grad_sum = gl.zeros([_KPC], gl.float32, gl.SliceLayout(1, s_layout))
        it, dk, dv, grad_sum, prev_row, prev_head = _query_blocks(
            it, dk, dv, grad_sum, prev_row, prev_head, m_lo, m_full, head, tma_batch, q_start, key0, q_smem, do_smem,
            lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, q_ready, q_empty, ds_ready, ds_free, dq_desc,
            seqlen_q, seqlen_k, qk_scale_log2, CONSUMER, BLOCK_M, NUM_STAGES, True, CAUSAL, DQ_SPLIT_M,
            s_layout, a_layout, dq_layout, it0, PERSISTENT or _OPAQUE_KV, score, LOCAL, SOFTCAP, ALIBI, REL_BIAS,
            BIAS, BIAS_GRAD, bias_smem, av_layout)
        it, dk, dv, grad_sum, prev_row, prev_head = _query_blocks(
            it, dk, dv, grad_sum, prev_row, prev_head, m_full, m_tail, head, tma_batch, q_start, key0, q_smem, do_smem,
            lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, q_ready, q_empty, ds_ready, ds_free, dq_desc,
            seqlen_q, seqlen_k, qk_scale_log2, CONSUMER, BLOCK_M, NUM_STAGES, False, CAUSAL, DQ_SPLIT_M,
            s_layout, a_layout, dq_layout, it0, PERSISTENT or _OPAQUE_KV, score, LOCAL, SOFTCAP, ALIBI, REL_BIAS,
            BIAS, BIAS_GRAD, bias_smem, av_layout)
        it, dk, dv, grad_sum, prev_row, prev_head = _query_blocks(
            it, dk, dv, grad_sum, prev_row, prev_head, m_tail, m_end, head, tma_batch, q_start, key0, q_smem, do_smem,
            lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, q_ready, q_empty, ds_ready, ds_free, dq_desc,
            seqlen_q, seqlen_k, qk_scale_log2, CONSUMER, BLOCK_M, NUM_STAGES, True, CAUSAL, DQ_SPLIT_M,
            s_layout, a_layout, dq_layout, it0, PERSISTENT or _OPAQUE_KV, score, LOCAL, SOFTCAP, ALIBI, REL_BIAS,
            BIAS, BIAS_GRAD, bias_smem, av_layout)
        if BIAS_GRAD == 3:
            _, _, _, _, _, _, _, bias_heads = score
            attn_bias_grad_keys(grad_sum, bias_heads[2], key0, seqlen_k)

    if it > it0:
        # dQ of the last query block.
        prev = it - 1
        mbarrier.wait(ds_ready.index(prev % 2), (prev // 2) & 1)
        if PERSISTENT or _OPAQUE_KV:
            zero = _opaque_zero(it)
        else:
            zero = 0
        dq_tok = _issue_dq(ds_smem, k_smem, prev % 2, dq_layout, CONSUMER, DQ_SPLIT_M, zero)
        tma.store_wait(0)
        barrier()
        dq = _wait_dq(dq_tok, ds_smem)
        if PERSISTENT:
            # The next key block's query blocks take this dS^T buffer in turn.
            mbarrier.arrive(ds_free.index(prev % 2))
        _reduce_add_dq(dq, dq_smem, dq_desc, tma_batch, prev_row, prev_head, CONSUMER, DQ_SPLIT_M)

    if PERSISTENT:
        # This warpgroup's reads of K, V are over: the loader may bring the next key block's. dK, dV
        # go out through its own dQ staging tile, with no wait for the other warpgroup.
        mbarrier.arrive(kv_empty)
        _store_dkdv_staged(dk, dv, dq_smem, dk_desc, dv_desc, tma_batch, key0, kv_head, softmax_scale, CONSUMER)
    else:
        # The other warpgroup's dQ wgmmas read our K tile: wait until both are done, then stage
        # dK, dV in the K, V tiles and store them with TMA (rows past seqlen_k are clipped).
        mbarrier.arrive(done)
        mbarrier.wait(done, 0)
        if IS_VARLEN:
            if key0 + _KPC <= seqlen_k:
                _store_dkdv_tma(dk, dv, k_smem, v_smem, dk_desc, dv_desc, tma_batch, k_start + key0, kv_head, 0,
                                softmax_scale, CONSUMER)
            else:
                # The sequence's ragged last keys: a TMA box would overwrite the next sequence's rows.
                _store_rows(dk_ptr, stride_dk_s, stride_dk_h, k_start + key0, kv_head, 0,
                            (dk * softmax_scale).to(k_smem.dtype), seqlen_k - key0, acc_layout, HEAD_DIM_TRUE)
                _store_rows(dv_ptr, stride_dv_s, stride_dv_h, k_start + key0, kv_head, 0, dv.to(v_smem.dtype),
                            seqlen_k - key0, accv_layout, V_TRUE)
                # The last dQ reduce-add must have read its staging before the CTA exits.
                tma.store_wait(0)
        else:
            _store_dkdv_tma(dk, dv, k_smem, v_smem, dk_desc, dv_desc, tma_batch, key0, kv_head, 0, softmax_scale,
                            CONSUMER)
    return it


@gluon.jit
def _copy_out_dkdv(dk, dv, k_stage, v_stage, dk_desc, dv_desc, tma_batch, row, kv_head, col, softmax_scale):
    """dK (scaled), dV into the staging tiles k_stage, v_stage, then TMA stores from them (no wait)."""
    k_stage.reshape([dk.shape[0], dk.shape[1]]).store((dk * softmax_scale).to(k_stage.dtype))
    v_stage.reshape([dv.shape[0], dv.shape[1]]).store(dv.to(v_stage.dtype))
    fence_async_shared()
    tma_store(dk_desc, [tma_batch, row, kv_head, col], k_stage)
    tma_store(dv_desc, [tma_batch, row, kv_head, col], v_stage)


@gluon.jit
def _store_dkdv_tma(dk, dv, k_smem, v_smem, dk_desc, dv_desc, tma_batch, row, kv_head, col,
                    softmax_scale, CONSUMER: gl.constexpr):
    """Stage this warpgroup's dK, dV tiles in its K, V tiles (free once both warpgroups are done)
    and store them with TMA; the wait also covers the last dQ reduce-add."""
    _copy_out_dkdv(dk, dv, k_smem.index(CONSUMER), v_smem.index(CONSUMER), dk_desc, dv_desc, tma_batch, row,
                   kv_head, col, softmax_scale)
    tma.store_wait(0)


@gluon.jit
def _store_dkdv_staged(dk, dv, dq_smem, dk_desc, dv_desc, tma_batch, row, kv_head, softmax_scale,
                       CONSUMER: gl.constexpr):
    """Persistent CTAs: stage this warpgroup's dK, dV in its dQ staging tile (64 x 64 float32: room
    for both 16-bit tiles) once the last dQ reduce-add has read it, and store them with TMA. No wait
    for the stores: the next reduce-add's wait for its staging covers them (and the CTA's last)."""
    gl.static_assert(dq_smem.shape[4] * 4 == 2 * dk_desc.block_type.shape[3] * 2, "dK + dV fill a dQ staging tile")
    gl.static_assert(dv_desc.block_type.shape[3] == dk_desc.block_type.shape[3], "dV as wide as dK (head_dim_v)")
    tiles = reinterpret(dq_smem.index(CONSUMER), dk_desc.dtype, [2] + dk_desc.block_type.shape, dk_desc.layout)
    # The wait is the issuing thread's: the barrier holds every thread until it has returned.
    tma.store_wait(0)
    barrier()
    _copy_out_dkdv(dk, dv, tiles.index(0), tiles.index(1), dk_desc, dv_desc, tma_batch, row, kv_head, 0,
                   softmax_scale)


@gluon.jit
def _consumer(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty,
              ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc,
              seqlen_q, seqlen_k, nheads, head_group, qk_scale_log2, softmax_scale,
              cu_seqlens_q, cu_seqlens_k, seqused_q, dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s,
              stride_dv_h, stored, window_left, window_right, softcap_scale, softcap_log2, alibi_slopes, stride_alibi_b,
              CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, DQ_SPLIT_M: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM_TRUE: gl.constexpr,
              COUNT_DONE: gl.constexpr, HEADS_FIRST: gl.constexpr, LOCAL: gl.constexpr, SOFTCAP: gl.constexpr,
              ALIBI: gl.constexpr, rel_bias_table, rel_bias_distance, REL_BIAS: gl.constexpr, attn_bias, bias_grad,
              BIAS: gl.constexpr, BIAS_GRAD: gl.constexpr, bias_smem, HEAD_DIM_V_TRUE: gl.constexpr):
    key_block, kv_head = _key_block_and_head(HEADS_FIRST)
    start_n = key_block * _BN
    tma_batch, q_start, k_start, seqlen_q, seqlen_k = backward_sequence(cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                                        seqlen_q, seqlen_k, IS_VARLEN)
    # Varlen: the grid spans the longest sequence; a key block past this one's keys has no work
    # (the loader skips it on the same test). Dense grids are exact: a static True.
    has_keys = True
    if IS_VARLEN:
        has_keys = start_n < seqlen_k
    if has_keys:
        _consume_keys(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready,
                      q_ready, q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc, start_n, kv_head,
                      tma_batch, q_start, k_start, seqlen_q, seqlen_k, head_group, qk_scale_log2,
                      softmax_scale, dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s, stride_dv_h,
                      CONSUMER, BLOCK_M, NUM_STAGES, CAUSAL, DQ_SPLIT_M, IS_VARLEN, HEAD_DIM_TRUE, 0, None,
                      gl.program_id(2), alibi_slopes, stride_alibi_b, window_left, window_right, softcap_scale,
                      softcap_log2, LOCAL, SOFTCAP, ALIBI, rel_bias_table, rel_bias_distance, REL_BIAS, attn_bias,
                      bias_grad, BIAS, BIAS_GRAD, bias_smem, HEAD_DIM_V_TRUE)
    if COUNT_DONE:
        _warpgroup_writes_landed(stored)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _barriers(NUM_STAGES: gl.constexpr, COUNT_DONE: gl.constexpr):
    """The mbarriers both backward kernels share, initialized: kv_ready (K, V landed), done (both
    warpgroups finished their key block), the Q/dO ring's q_ready / q_empty, the dS buffers'
    ds_ready / ds_free, and with COUNT_DONE stored (both warpgroups' writes landed; else done
    stands in, unused). With COUNT_DONE this CTA also allows the dependent convert to launch."""
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(done, count=_NC)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=_NC)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=_NC)
        mbarrier.init(ds_free.index(i), count=_NC)
    if COUNT_DONE:
        stored = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(stored, count=_NC)
    else:
        stored = done
    fence_async_shared()
    if COUNT_DONE:
        _allow_dependent_launch()
    return kv_ready, done, q_ready, q_empty, ds_ready, ds_free, stored


@gluon.jit
def _shared_buffers(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc, BLOCK_M: gl.constexpr,
                    NUM_STAGES: gl.constexpr):
    """The shared memory of the two-warpgroup kernels: the Q / dO (lse, delta) ring, the K, V tiles
    of the key block (one per warpgroup), the dS^T buffers and the dQ staging tiles."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [_NC] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [_NC] + v_desc.block_type.shape, v_desc.layout)
    # dS^T, double-buffered so one warpgroup can run ahead by an iteration:
    # [buf * _NC + consumer, key, query].
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KPC, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2 * _NC, _KPC, BLOCK_M], ds_layout)
    # dQ share of each warpgroup, staged for the TMA reduce-add.
    dq_smem = gl.allocate_shared_memory(gl.float32, [_NC] + dq_desc.block_type.shape, dq_desc.layout)
    return q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "nheads", "head_group", "lse_row_stride", "stride_dk_s",
                              "stride_dk_h", "stride_dv_s", "stride_dv_h", "window_left", "window_right",
                              "stride_alibi_b", "rel_bias_distance"])
def gluon_attn_bwd_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc,
                          seqlen_q, seqlen_k, nheads, head_group, lse_row_stride, qk_scale_log2, softmax_scale,
                          cu_seqlens_q, cu_seqlens_k, seqused_q, lse_ptr, delta_ptr,
                          dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s, stride_dv_h, done_counts,
                          BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          LOADER_REGS: gl.constexpr, CAUSAL: gl.constexpr, DQ_SPLIT_M: gl.constexpr,
                          IS_VARLEN: gl.constexpr, HEAD_DIM_TRUE: gl.constexpr, HEADS_FIRST: gl.constexpr,
                          LOCAL: gl.constexpr = False, SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False,
                          window_left=0, window_right=0, softcap_scale=0.0, softcap_log2=0.0, alibi_slopes=None,
                          stride_alibi_b=0, rel_bias_table=None, rel_bias_distance=0, attn_bias=None, stride_bias_b=0,
                          stride_bias_h=0, stride_bias_m=0, bias_grad=None, stride_grad_b=0, stride_grad_h=0,
                          stride_grad_m=0, BIAS_GRAD: gl.constexpr = 0, bias_desc=None, bias_batches=1,
                          bias_heads=1, HEAD_DIM_V_TRUE: gl.constexpr = None, BIAS_ROW: gl.constexpr = False):
    # rel_bias_table, attn_bias: as the forward's (forward.py), or None. bias_grad: the buffer of
    # attn_bias's gradient, stored into (BIAS_GRAD 1) or added into (2) as scores.attn_bias_grad_t says, or
    # summed along the queries and added into (3: scores.attn_bias_grad_keys).
    # bias_desc: instead of attn_bias, a descriptor of its (batch, head, query, key) view, whose (query
    # block x key block) tiles come through the Q / dO ring (bias_batches, bias_heads: its batch and head
    # dims, 1 where it broadcasts). HEAD_DIM_V_TRUE: V's (dO's, dV's) head dim when it differs from Q's and K's
    # (v_desc's, do_desc's and dv_desc's boxes are its padded width); None: the same.
    # BIAS_ROW: attn_bias has one row (it broadcasts along the queries). BIAS: 0 none, 1 tiles (loaded or
    # through the ring), 2 one row.
    REL_BIAS: gl.constexpr = rel_bias_table is not None
    BIAS: gl.constexpr = (attn_bias is not None) * (1 + BIAS_ROW) + (bias_desc is not None)
    V_TRUE: gl.constexpr = HEAD_DIM_TRUE if HEAD_DIM_V_TRUE is None else HEAD_DIM_V_TRUE
    if bias_desc is not None:
        bias_smem = gl.allocate_shared_memory(bias_desc.dtype, [NUM_STAGES] + bias_desc.block_type.shape,
                                              bias_desc.layout)
    else:
        bias_smem: gl.constexpr = None
    bias = (attn_bias, stride_bias_b, stride_bias_h, stride_bias_m)
    grad = (bias_grad, stride_grad_b, stride_grad_h, stride_grad_m)
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = _shared_buffers(
        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc, BLOCK_M, NUM_STAGES)

    # With done counts (GluonBwdConfig.overlap_convert), the convert may launch once every CTA has started.
    COUNT_DONE: gl.constexpr = done_counts is not None
    kv_ready, done, q_ready, q_empty, ds_ready, ds_free, stored = _barriers(NUM_STAGES, COUNT_DONE)

    # Each consumer gets its index as a literal (a constexpr) in the inline argument tuple.
    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready,
                     q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc,
                     seqlen_q, seqlen_k, nheads, head_group, qk_scale_log2, softmax_scale,
                     cu_seqlens_q, cu_seqlens_k, seqused_q, dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s,
                     stride_dv_h, stored, window_left, window_right, softcap_scale, softcap_log2, alibi_slopes,
                     stride_alibi_b, 0, BLOCK_M, NUM_STAGES, CAUSAL, DQ_SPLIT_M, IS_VARLEN, HEAD_DIM_TRUE,
                     COUNT_DONE, HEADS_FIRST, LOCAL, SOFTCAP, ALIBI, rel_bias_table, rel_bias_distance, REL_BIAS, bias,
                     grad, BIAS, BIAS_GRAD, bias_smem, V_TRUE)),
        (_consumer, (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready,
                     q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc,
                     seqlen_q, seqlen_k, nheads, head_group, qk_scale_log2, softmax_scale,
                     cu_seqlens_q, cu_seqlens_k, seqused_q, dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s,
                     stride_dv_h, stored, window_left, window_right, softcap_scale, softcap_log2, alibi_slopes,
                     stride_alibi_b, 1, BLOCK_M, NUM_STAGES, CAUSAL, DQ_SPLIT_M, IS_VARLEN, HEAD_DIM_TRUE,
                     COUNT_DONE, HEADS_FIRST, LOCAL, SOFTCAP, ALIBI, rel_bias_table, rel_bias_distance, REL_BIAS, bias,
                     grad, BIAS, BIAS_GRAD, bias_smem, V_TRUE)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                   lse_smem, delta_smem, kv_ready, q_ready, q_empty, seqlen_q, seqlen_k, nheads, head_group,
                   lse_row_stride, cu_seqlens_q, cu_seqlens_k, seqused_q, lse_ptr, delta_ptr, done_counts, stored,
                   window_left, window_right, BLOCK_M, NUM_STAGES, CAUSAL, IS_VARLEN, HEADS_FIRST, LOCAL, bias_desc,
                   bias_smem, bias_batches, bias_heads)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

# ----------------------------------------------------------------------------------------------
# Persistent backward (GluonBwdConfig.persistent; dense batches, the two-warpgroup kernel)
# ----------------------------------------------------------------------------------------------
#
# One CTA per SM (at most one per key block) runs key blocks ("units", numbered in the grid's order:
# key block fastest, then KV head, then batch) one after another, drawing each from a counter in
# global memory (an atomic add in the loader warp: CTAs that finish early take more, so the
# schedule balances a causal grid by itself). Between units no CTA ends and none starts, and the
# next unit's first Q / dO tiles stream in through the ring while the current one ends. Its K, V
# wait for both warpgroups' last reads of the current ones: one K, V buffer (with two, indexed at
# run time, the bundled ptxas 12.8 reused a shared-memory descriptor computed in a block that does
# not dominate its use). dK, dV go out through the dQ
# staging tiles, so the warpgroups need not meet at a unit's end. The loader hands each unit's
# number to the warpgroups in shared memory, behind the K, V barrier; -1 ends the CTA. The ring
# position and the dS^T buffers' phases carry over from unit to unit. The arguments that follow the
# sequence lengths are not specialized: one compile serves every length, and with seqlen_q = 1
# compiled in as a constant, ptxas 12.8 produced a wgmma that read past shared memory (CUDA 13.0's
# ptxas did not). The head counts are (head_group = 1 drops the GQA loop: fewer spills).

@gluon.jit
def _draw_unit(counter_ptr):
    """In the loader warp: lane 0 takes the next unit number (atomic add), broadcast to the warp."""
    return gl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .u32 lane, t;\n\tmov.u32 t, 0;\n\tmov.u32 lane, %laneid;"
        "\n\tsetp.eq.u32 first, lane, 0;\n\t@first atom.global.relaxed.gpu.add.u32 t, [$1], 1;"
        "\n\tshfl.sync.idx.b32 $0, t, 0, 31, -1;\n\t}",
        "=r,l", [counter_ptr.to(gl.int64, bitcast=True)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _publish_unit(unit_smem, unit):
    """In the loader warp: the unit number to shared memory, every lane's store done before the
    (one-thread, release) arrival on the K, V barrier that follows."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    unit_smem.store(gl.full([32], unit, gl.int32, layout))
    barrier()


@gluon.jit
def _read_unit(unit_smem):
    """In a consumer warpgroup, after the K, V barrier: the unit number the loader published."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(unit_smem.load(layout), axis=0)


@gluon.jit
def _unit_coords(unit, n_key_blocks, nheads_k):
    """(first key, KV head, batch) of a unit."""
    return (unit % n_key_blocks) * _BN, (unit // n_key_blocks) % nheads_k, unit // (n_key_blocks * nheads_k)


@gluon.jit
def _loader_persistent(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                       lse_smem, delta_smem, unit_smem, kv_ready, kv_empty, q_ready, q_empty, seqlen_q, seqlen_k,
                       nheads, head_group, lse_row_stride, counter_ptr, n_key_blocks, nheads_k, n_units,
                       BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    it = 0
    u = 0
    unit = _draw_unit(counter_ptr)
    while unit < n_units:
        # The warpgroups are done with the previous unit's K, V (and have read its number).
        mbarrier.wait(kv_empty, (u & 1) ^ 1)
        _publish_unit(unit_smem, unit)
        start_n, kv_head, batch = _unit_coords(unit, n_key_blocks, nheads_k)
        it = _load_blocks(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                          lse_smem, delta_smem, kv_ready, q_ready, q_empty, start_n, kv_head, batch, batch, 0, 0,
                          seqlen_q, seqlen_k, nheads, head_group, lse_row_stride, None, None,
                          BLOCK_M, NUM_STAGES, CAUSAL, False, it)
        u += 1
        unit = _draw_unit(counter_ptr)
    # No unit left: -1, with a plain arrival (no bytes) on the K, V barrier.
    mbarrier.wait(kv_empty, (u & 1) ^ 1)
    _publish_unit(unit_smem, -1)
    mbarrier.arrive(kv_ready)


@gluon.jit
def _consumer_persistent(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, unit_smem,
                         kv_ready, kv_empty, q_ready, q_empty, ds_ready, ds_free, dk_desc, dv_desc, dq_desc,
                         seqlen_q, seqlen_k, head_group, qk_scale_log2, softmax_scale, n_key_blocks, nheads_k,
                         CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr, DQ_SPLIT_M: gl.constexpr, HEAD_DIM_TRUE: gl.constexpr):
    it = 0
    u = 0
    mbarrier.wait(kv_ready, 0)
    unit = _read_unit(unit_smem)
    while unit >= 0:
        start_n, kv_head, batch = _unit_coords(unit, n_key_blocks, nheads_k)
        it = _consume_keys(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready,
                           q_ready, q_empty, ds_ready, ds_free, None, dk_desc, dv_desc, dq_desc, start_n, kv_head,
                           batch, 0, 0, seqlen_q, seqlen_k, head_group, qk_scale_log2, softmax_scale,
                           None, None, None, None, None, None, CONSUMER, BLOCK_M, NUM_STAGES, CAUSAL, DQ_SPLIT_M,
                           False, HEAD_DIM_TRUE, it, kv_empty)
        u += 1
        mbarrier.wait(kv_ready, u & 1)
        unit = _read_unit(unit_smem)
    # The last dK, dV stores have read their staging before the CTA ends.
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "lse_row_stride", "n_key_blocks", "n_units"])
def gluon_attn_bwd_persistent_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, lse_desc,
                                     delta_desc, seqlen_q, seqlen_k, nheads, head_group, lse_row_stride,
                                     qk_scale_log2, softmax_scale, counter_ptr, n_key_blocks, nheads_k, n_units,
                                     BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                     LOADER_REGS: gl.constexpr, CAUSAL: gl.constexpr, DQ_SPLIT_M: gl.constexpr,
                                     HEAD_DIM_TRUE: gl.constexpr):
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem = _shared_buffers(
        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc, BLOCK_M, NUM_STAGES)
    unit_smem = gl.allocate_shared_memory(gl.int32, [32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_ready, _, q_ready, q_empty, ds_ready, ds_free, _ = _barriers(NUM_STAGES, False)
    # Both warpgroups done with a unit's K, V.
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_empty, count=_NC)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer_persistent, (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, unit_smem,
                                kv_ready, kv_empty, q_ready, q_empty, ds_ready, ds_free, dk_desc, dv_desc, dq_desc,
                                seqlen_q, seqlen_k, head_group, qk_scale_log2, softmax_scale, n_key_blocks,
                                nheads_k, 0, BLOCK_M, NUM_STAGES, CAUSAL, DQ_SPLIT_M, HEAD_DIM_TRUE)),
        (_consumer_persistent, (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, unit_smem,
                                kv_ready, kv_empty, q_ready, q_empty, ds_ready, ds_free, dk_desc, dv_desc, dq_desc,
                                seqlen_q, seqlen_k, head_group, qk_scale_log2, softmax_scale, n_key_blocks,
                                nheads_k, 1, BLOCK_M, NUM_STAGES, CAUSAL, DQ_SPLIT_M, HEAD_DIM_TRUE)),
        (_loader_persistent, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                              lse_smem, delta_smem, unit_smem, kv_ready, kv_empty, q_ready, q_empty, seqlen_q,
                              seqlen_k, nheads, head_group, lse_row_stride, counter_ptr, n_key_blocks, nheads_k,
                              n_units, BLOCK_M, NUM_STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------
# Head dim 256: one CTA per 64 keys; each consumer warpgroup owns half of the head dim.
# ----------------------------------------------------------------------------------------------
#
# dK and dV of 64 keys x 256 columns would take 256 float32 registers per thread of one
# warpgroup, so the two warpgroups split the head dim instead of the keys: warpgroup c keeps
# dK[:, 128c:128c+128] and dV[:, 128c:128c+128] (128 registers). The score work of a query block
# is split over its query rows, not repeated: warpgroup c forms S^T, dP^T, P^T and dS^T of the 64
# keys against query rows [c*BLOCK_M/2, (c+1)*BLOCK_M/2) and writes its P^T, dS^T columns to
# shared memory; once both halves are there (mbarrier), it adds P^T dO and dS^T Q over all the
# rows into its dV, dK columns and computes dQ = dS K for its columns.
#
# Every tile is addressed as a whole view (index of a reinterpreted buffer), never as a row slice
# of a multi-chunk swizzled tile. A (1, rows, 1, 256) TMA box lands as 4 chunks of 64 columns,
# each chunk rows x 128 bytes (128-byte swizzle); so
#   * chunk j of K (or V) is a (64, 64) tile, and chunks 2c, 2c+1 are the (64, 128) tile of head
#     dim half c: the dK, dV staging for the (1, 64, 1, 128) output boxes;
#   * rows [h*BLOCK_M/2, ...) of chunk j of Q (or dO) are one (BLOCK_M/2, 64) tile;
#   * chunks 2c, 2c+1 of a Q or dO slot (16 KB at BLOCK_M = 64) are read by no one but
#     warpgroup c's dK (dV) once both warpgroups have formed their scores: after those retire,
#     warpgroup c stages its dQ columns there, as two (BLOCK_M, 64) float32 tiles (the same
#     bytes), and reduce-adds them with TMA. The slot goes back to the loader one iteration
#     later, once those reduce-adds have read it. (At BLOCK_M = 64, two Q/dO stages, K, V and two
#     P^T/dS^T buffers already take 230400 of the 232448 bytes a CTA may have: no room for a
#     separate dQ staging buffer.)
# P^T and dS^T: (64 keys, BLOCK_M queries) tiles with a (BLOCK_M)-byte swizzle, so the column
# half of each warpgroup is one whole swizzle chunk; double-buffered so a warpgroup can start
# the next query block before the other has finished reading them.

_D256_HALF = gl.constexpr(128)  # head-dim columns per consumer warpgroup
_DQ_N = gl.constexpr(64)        # dQ columns per reduce-add tile


@gluon.jit
def _query_blocks_d256(it, dk, dv, m_start, m_stop, head, tma_batch, q_start, start_n, q_smem, do_smem, lse_smem,
                       delta_smem, k_smem, v_smem, p_smem, ds_smem, dq_stage_smem, q_ready, q_empty, ds_ready,
                       ds_free, dq_desc, seqlen_q, seqlen_k, qk_scale_log2,
                       CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                       MASK: gl.constexpr, CAUSAL: gl.constexpr, DQ_OVERLAP: gl.constexpr,
                       s_layout: gl.constexpr, dq_layout: gl.constexpr, HEAD_DIM_TRUE: gl.constexpr,
                       HEAD_DIM_V_TRUE: gl.constexpr):
    """Query blocks [m_start, m_stop) of one query head (head dim 256, or a head dim in (128, 256)
    padded to it: HEAD_DIM_TRUE). V and dO may be narrower (head_dim_v != head_dim_qk: a tile of
    128 or 256 columns, HEAD_DIM_V_TRUE of them in the tensors): each warpgroup then owns half of
    V's columns of dV, and a dQ tile that its half of dO cannot stage goes to dq_stage_smem."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    NCHUNK: gl.constexpr = HEAD_DIM // 64
    V_DIM: gl.constexpr = v_smem.shape[4]
    V_NCHUNK: gl.constexpr = V_DIM // 64
    V_NCHUNK_USED: gl.constexpr = (HEAD_DIM_V_TRUE + 63) // 64
    # Chunks that hold columns of the tensors; the others are TMA's zero fill: the score products
    # skip them, and so does the dQ tile of a warpgroup that lies wholly past the head dim.
    NCHUNK_USED: gl.constexpr = (HEAD_DIM_TRUE + 63) // 64
    DQ_SECOND: gl.constexpr = HEAD_DIM_TRUE > CONSUMER * _D256_HALF + _DQ_N
    dtype: gl.constexpr = k_smem.dtype
    # 128-byte swizzle, as the TMA boxes land: chunks of 64 columns and halves of 128 columns.
    chunk_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    half_layout: gl.constexpr = chunk_layout
    pt_half_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=HALF_M * 2, element_bitwidth=16, rank=2)
    stage_layout: gl.constexpr = dq_desc.layout
    diag = seqlen_k - seqlen_q

    # K, V: 4 chunks of (64 keys, 64 columns).
    k_chunks = reinterpret(k_smem, dtype, [NCHUNK, _KPC, 64], chunk_layout)
    v_chunks = reinterpret(v_smem, dtype, [V_NCHUNK, _KPC, 64], chunk_layout)
    # P^T, dS^T: [buffer, 64 keys, BLOCK_M queries] and [buffer * 2 + warpgroup, 64 keys, HALF_M].
    p_halves = reinterpret(p_smem, dtype, [4, _KPC, HALF_M], pt_half_layout)
    ds_halves = reinterpret(ds_smem, dtype, [4, _KPC, HALF_M], pt_half_layout)

    keys = start_n + gl.arange(0, _KPC, layout=gl.SliceLayout(1, s_layout))
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    lse_to_score = 1.0 / qk_scale_log2

    for m in range(m_start, m_stop):
        slot = it % NUM_STAGES
        buf = it % 2
        start_m = m * BLOCK_M
        mbarrier.wait(q_ready.index(slot), (it // NUM_STAGES) & 1)
        # The K, V chunks are indexed with a run-time zero (_opaque_zero): with constant indices
        # ptxas holds their loop-invariant wgmma descriptors in registers across the loop, and the
        # consumers spilled 412 / 344 bytes (full / causal); recomputed in the loop, none.
        zero = _opaque_zero(it)
        # Q, dO slot as (chunk, row half) tiles of (HALF_M, 64), and as head-dim halves (BLOCK_M, 128).
        q_tiles = reinterpret(q_smem.index(slot), dtype, [2 * NCHUNK, HALF_M, 64], chunk_layout)
        do_tiles = reinterpret(do_smem.index(slot), dtype, [2 * V_NCHUNK, HALF_M, 64], chunk_layout)
        q_mine = reinterpret(q_smem.index(slot), dtype, [2, BLOCK_M, _D256_HALF], half_layout).index(CONSUMER)
        do_mine = reinterpret(do_smem.index(slot), dtype, [2, BLOCK_M, V_DIM // 2], half_layout).index(CONSUMER)

        # S^T = K Q_c^T and dP^T = V dO_c^T for this warpgroup's query rows, summed over the
        # head-dim chunks. (Starting dP^T at -delta, as at d64/d128, makes ptxas wait for S^T
        # before issuing dP^T.)
        # S^T starts at -lse in score units, as at d64/d128.
        lse = lse_smem.index(slot).slice(CONSUMER * HALF_M, HALF_M).load(col_layout)
        if MASK:
            lse = _past_used_rows(lse, start_m + CONSUMER * HALF_M, seqlen_q, float("inf"), HALF_M, col_layout)
        s_tok = gl.zeros([_KPC, HALF_M], gl.float32, s_layout) - gl.expand_dims(lse * lse_to_score, 0)
        if MASK:
            # As at d64/d128: -inf in the accumulator's start masks the product.
            s_tok = _mask_keys(s_tok, keys, start_m + CONSUMER * HALF_M, seqlen_k, diag, HALF_M, CAUSAL, col_layout)
        for j in gl.static_range(NCHUNK_USED):
            s_tok = warpgroup_mma(k_chunks.index(j + zero), q_tiles.index(2 * j + CONSUMER).permute([1, 0]), s_tok,
                                  is_async=True)
        dp_tok = gl.zeros([_KPC, HALF_M], gl.float32, s_layout)
        for j in gl.static_range(V_NCHUNK_USED):
            dp_tok = warpgroup_mma(v_chunks.index(j + zero), do_tiles.index(2 * j + CONSUMER).permute([1, 0]), dp_tok,
                                   use_acc=j > 0, is_async=True)

        # S^T is done once no more than the dP^T products (issued after it) are in flight.
        s, _, _, _ = warpgroup_mma_wait(V_NCHUNK_USED, deps=[s_tok, k_chunks, q_tiles, q_smem])
        p = gl.exp2(s * qk_scale_log2)
        dp, _, _, _ = warpgroup_mma_wait(0, deps=[dp_tok, v_chunks, do_tiles, do_smem])
        delta = delta_smem.index(slot).slice(CONSUMER * HALF_M, HALF_M).load(col_layout)
        if MASK:
            delta = _past_used_rows(delta, start_m + CONSUMER * HALF_M, seqlen_q, 0.0, HALF_M, col_layout)
        ds = p * (dp - gl.expand_dims(delta, 0))

        # Publish this warpgroup's columns of P^T and dS^T.
        ds_phase = (it // 2) & 1
        mbarrier.wait(ds_free.index(buf), ds_phase ^ 1)
        p_halves.index(buf * 2 + CONSUMER).store(p.to(dtype))
        ds_halves.index(buf * 2 + CONSUMER).store(ds.to(dtype))
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(buf))
        # The previous query block's dQ reduce-adds (staged in its Q/dO slot) have read their
        # tiles by now, mostly: then that slot can go back to the loader.
        if it > 0:
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index((it - 1) % NUM_STAGES))
        mbarrier.wait(ds_ready.index(buf), ds_phase)

        # dV[:, half] += P^T dO[:, half], dK[:, half] += dS^T Q[:, half] over all BLOCK_M rows;
        # dQ[:, half] = dS K[:, half], as two 64-column tiles.
        pt = p_smem.index(buf)
        dst = ds_smem.index(buf)
        # dQ is stored in this warpgroup's halves of the Q and dO tiles (read by nobody else once
        # its dK, dV products retire). One 64-column tile at a time: dK, dV and two dQ tiles
        # in registers at once would spill.
        stage_shape: gl.constexpr = [2, 1, BLOCK_M, 1, _DQ_N]
        stage_q = reinterpret(q_smem.index(slot), gl.float32, stage_shape, stage_layout).index(CONSUMER)
        if V_DIM < HEAD_DIM:
            # This warpgroup's half of a narrower dO tile holds less than a dQ tile.
            stage_do = dq_stage_smem.index(CONSUMER)
        else:
            stage_do = reinterpret(do_smem.index(slot), gl.float32, stage_shape, stage_layout).index(CONSUMER)
        col0 = CONSUMER * _D256_HALF
        dv_tok = warpgroup_mma(pt, do_mine, dv, is_async=True)
        dk_tok = warpgroup_mma(dst, q_mine, dk, is_async=True)
        dq_tok = warpgroup_mma(dst.permute([1, 0]), k_chunks.index(2 * CONSUMER + zero),
                               gl.zeros([BLOCK_M, _DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
        dv, dk, _, _, _, _ = warpgroup_mma_wait(1, deps=[dv_tok, dk_tok, pt, dst, q_mine, do_mine])
        if DQ_SECOND:
            if DQ_OVERLAP:
                # The second tile's product runs while the first is stored (32 more registers).
                dq1_tok = warpgroup_mma(dst.permute([1, 0]), k_chunks.index(2 * CONSUMER + 1 + zero),
                                        gl.zeros([BLOCK_M, _DQ_N], gl.float32, dq_layout), use_acc=False,
                                        is_async=True)
                dq, _, _ = warpgroup_mma_wait(1, deps=[dq_tok, dst, k_chunks])
                stage_q.reshape([BLOCK_M, _DQ_N]).store(dq)
                fence_async_shared()
                tma_reduce_add(dq_desc, [tma_batch, q_start + start_m, head, col0], stage_q)
                dq, _, _ = warpgroup_mma_wait(0, deps=[dq1_tok, dst, k_chunks])
            else:
                dq, _, _ = warpgroup_mma_wait(0, deps=[dq_tok, dst, k_chunks])
                stage_q.reshape([BLOCK_M, _DQ_N]).store(dq)
                fence_async_shared()
                tma_reduce_add(dq_desc, [tma_batch, q_start + start_m, head, col0], stage_q)
                dq_tok = warpgroup_mma(dst.permute([1, 0]), k_chunks.index(2 * CONSUMER + 1 + zero),
                                       gl.zeros([BLOCK_M, _DQ_N], gl.float32, dq_layout), use_acc=False,
                                       is_async=True)
                dq, _, _ = warpgroup_mma_wait(0, deps=[dq_tok, dst, k_chunks])
            mbarrier.arrive(ds_free.index(buf))
            stage_do.reshape([BLOCK_M, _DQ_N]).store(dq)
            fence_async_shared()
            tma_reduce_add(dq_desc, [tma_batch, q_start + start_m, head, col0 + _DQ_N], stage_do)
        else:
            # Padded head dim: only the first of this warpgroup's dQ tiles is in the tensor.
            dq, _, _ = warpgroup_mma_wait(0, deps=[dq_tok, dst, k_chunks])
            mbarrier.arrive(ds_free.index(buf))
            stage_q.reshape([BLOCK_M, _DQ_N]).store(dq)
            fence_async_shared()
            tma_reduce_add(dq_desc, [tma_batch, q_start + start_m, head, col0], stage_q)
        it += 1
    return it, dk, dv


@gluon.jit
def _consume_keys_d256(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem, dq_stage_smem,
                       kv_ready, q_ready, q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc, start_n,
                       kv_head, tma_batch,
                       q_start, k_start, seqlen_q, seqlen_k, head_group, qk_scale_log2, softmax_scale,
                       dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s, stride_dv_h,
                       CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, DQ_OVERLAP: gl.constexpr, IS_VARLEN: gl.constexpr,
                       HEAD_DIM_TRUE: gl.constexpr, HEAD_DIM_V_TRUE: gl.constexpr):
    HALF_M: gl.constexpr = BLOCK_M // 2
    V_HALF: gl.constexpr = v_smem.shape[4] // 2  # dV columns per warpgroup
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, _D256_HALF, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, _DQ_N, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, V_HALF, 16])
    m_lo, m_full, m_tail, m_end = query_block_range(start_n, seqlen_q, seqlen_k, BLOCK_M, _KPC, CAUSAL)

    dk = gl.zeros([_KPC, _D256_HALF], gl.float32, acc_layout)
    dv = gl.zeros([_KPC, V_HALF], gl.float32, dv_layout)
    mbarrier.wait(kv_ready, 0)
    it = 0
    for g in range(head_group):
        head = kv_head * head_group + g
        it, dk, dv = _query_blocks_d256(
            it, dk, dv, m_lo, m_full, head, tma_batch, q_start, start_n, q_smem, do_smem, lse_smem, delta_smem,
            k_smem, v_smem, p_smem, ds_smem, dq_stage_smem, q_ready, q_empty, ds_ready, ds_free, dq_desc, seqlen_q,
            seqlen_k, qk_scale_log2, CONSUMER, BLOCK_M, NUM_STAGES, True, CAUSAL, DQ_OVERLAP, s_layout, dq_layout,
            HEAD_DIM_TRUE, HEAD_DIM_V_TRUE)
        it, dk, dv = _query_blocks_d256(
            it, dk, dv, m_full, m_tail, head, tma_batch, q_start, start_n, q_smem, do_smem, lse_smem, delta_smem,
            k_smem, v_smem, p_smem, ds_smem, dq_stage_smem, q_ready, q_empty, ds_ready, ds_free, dq_desc, seqlen_q,
            seqlen_k, qk_scale_log2, CONSUMER, BLOCK_M, NUM_STAGES, False, CAUSAL, DQ_OVERLAP, s_layout, dq_layout,
            HEAD_DIM_TRUE, HEAD_DIM_V_TRUE)
        it, dk, dv = _query_blocks_d256(
            it, dk, dv, m_tail, m_end, head, tma_batch, q_start, start_n, q_smem, do_smem, lse_smem, delta_smem,
            k_smem, v_smem, p_smem, ds_smem, dq_stage_smem, q_ready, q_empty, ds_ready, ds_free, dq_desc, seqlen_q,
            seqlen_k, qk_scale_log2, CONSUMER, BLOCK_M, NUM_STAGES, True, CAUSAL, DQ_OVERLAP, s_layout, dq_layout,
            HEAD_DIM_TRUE, HEAD_DIM_V_TRUE)

    # Both warpgroups' scores read all of K and V: wait for both, then stage this warpgroup's
    # dK, dV columns in its halves of the K, V tiles. The last dQ reduce-adds must be done with
    # their staging (and every bulk op before the CTA exits).
    mbarrier.arrive(done)
    mbarrier.wait(done, 0)
    tma.store_wait(0)
    if IS_VARLEN:
        if start_n + _KPC <= seqlen_k:
            _store_dkdv_tma_d256(dk, dv, k_smem, v_smem, dk_desc, dv_desc, tma_batch, k_start + start_n, kv_head,
                                 softmax_scale, CONSUMER)
        else:
            # The sequence's ragged last keys: a TMA box would overwrite the next sequence's rows.
            MY_COLS: gl.constexpr = HEAD_DIM_TRUE - CONSUMER * _D256_HALF  # in the tensor
            MY_V_COLS: gl.constexpr = HEAD_DIM_V_TRUE - CONSUMER * V_HALF
            _store_rows(dk_ptr, stride_dk_s, stride_dk_h, k_start + start_n, kv_head, CONSUMER * _D256_HALF,
                        (dk * softmax_scale).to(dtype), seqlen_k - start_n, acc_layout, MY_COLS)
            _store_rows(dv_ptr, stride_dv_s, stride_dv_h, k_start + start_n, kv_head, CONSUMER * V_HALF,
                        dv.to(dtype), seqlen_k - start_n, dv_layout, MY_V_COLS)
    else:
        _store_dkdv_tma_d256(dk, dv, k_smem, v_smem, dk_desc, dv_desc, tma_batch, start_n, kv_head, softmax_scale,
                             CONSUMER)


@gluon.jit
def _store_dkdv_tma_d256(dk, dv, k_smem, v_smem, dk_desc, dv_desc, tma_batch, row, kv_head, softmax_scale,
                         CONSUMER: gl.constexpr):
    """Stage this warpgroup's head-dim half of dK, dV in its halves of the K, V tiles and store
    them with TMA."""
    dtype: gl.constexpr = k_smem.dtype
    V_HALF: gl.constexpr = v_smem.shape[4] // 2
    k_stage = reinterpret(k_smem, dtype, [2, 1, _KPC, 1, _D256_HALF], dk_desc.layout).index(CONSUMER)
    v_stage = reinterpret(v_smem, dtype, [2, 1, _KPC, 1, V_HALF], dv_desc.layout).index(CONSUMER)
    k_stage.reshape([_KPC, _D256_HALF]).store((dk * softmax_scale).to(dtype))
    v_stage.reshape([_KPC, V_HALF]).store(dv.to(dtype))
    fence_async_shared()
    tma_store(dk_desc, [tma_batch, row, kv_head, CONSUMER * _D256_HALF], k_stage)
    tma_store(dv_desc, [tma_batch, row, kv_head, CONSUMER * V_HALF], v_stage)
    tma.store_wait(0)


@gluon.jit
def _consumer_d256(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem, dq_stage_smem, kv_ready,
                   q_ready, q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc,
                   seqlen_q, seqlen_k, nheads, head_group, qk_scale_log2, softmax_scale,
                   cu_seqlens_q, cu_seqlens_k, seqused_q, dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s,
                   stride_dv_h, stored, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, DQ_OVERLAP: gl.constexpr, IS_VARLEN: gl.constexpr,
                   HEAD_DIM_TRUE: gl.constexpr, COUNT_DONE: gl.constexpr, HEADS_FIRST: gl.constexpr,
                   HEAD_DIM_V_TRUE: gl.constexpr):
    key_block, kv_head = _key_block_and_head(HEADS_FIRST)
    start_n = key_block * _KPC
    tma_batch, q_start, k_start, seqlen_q, seqlen_k = backward_sequence(cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                                        seqlen_q, seqlen_k, IS_VARLEN)
    # Varlen: the grid spans the longest sequence; a key block past this one's keys has no work
    # (the loader skips it on the same test). Dense grids are exact: a static True.
    has_keys = True
    if IS_VARLEN:
        has_keys = start_n < seqlen_k
    if has_keys:
        _consume_keys_d256(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem, dq_stage_smem,
                           kv_ready, q_ready, q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc, start_n,
                           kv_head, tma_batch, q_start, k_start, seqlen_q, seqlen_k, head_group, qk_scale_log2,
                           softmax_scale, dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s, stride_dv_h,
                           CONSUMER, BLOCK_M, NUM_STAGES, CAUSAL, DQ_OVERLAP, IS_VARLEN, HEAD_DIM_TRUE,
                           HEAD_DIM_V_TRUE)
    if COUNT_DONE:
        _warpgroup_writes_landed(stored)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "nheads", "head_group", "lse_row_stride", "stride_dk_s",
                              "stride_dk_h", "stride_dv_s", "stride_dv_h"])
def gluon_attn_bwd_d256_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc,
                               seqlen_q, seqlen_k, nheads, head_group, lse_row_stride, qk_scale_log2, softmax_scale,
                               cu_seqlens_q, cu_seqlens_k, seqused_q, lse_ptr, delta_ptr,
                               dk_ptr, stride_dk_s, stride_dk_h, dv_ptr, stride_dv_s, stride_dv_h, done_counts,
                               BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               LOADER_REGS: gl.constexpr, CAUSAL: gl.constexpr, DQ_OVERLAP: gl.constexpr,
                               IS_VARLEN: gl.constexpr, HEAD_DIM_TRUE: gl.constexpr,
                               HEADS_FIRST: gl.constexpr, HEAD_DIM_V_TRUE: gl.constexpr = None):
    """HEAD_DIM_V_TRUE: V's (and dO's, dV's) head dim when it differs from Q's and K's (v_desc's boxes
    are its padded width, 128 or 256); None: the same."""
    gl.static_assert(NUM_STAGES >= 2, "a slot is released one query block late (dQ staging)")
    V_TRUE: gl.constexpr = HEAD_DIM_TRUE if HEAD_DIM_V_TRUE is None else HEAD_DIM_V_TRUE
    dtype: gl.constexpr = q_desc.dtype
    HALF_M: gl.constexpr = BLOCK_M // 2
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    # P^T, dS^T: [buffer, 64 keys, BLOCK_M queries]; each warpgroup's HALF_M columns are one
    # swizzle chunk.
    pt_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=HALF_M * 2, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [2, _KPC, BLOCK_M], pt_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, _KPC, BLOCK_M], pt_layout)
    if v_desc.block_type.shape[3] < q_desc.block_type.shape[3]:
        # A narrower dO tile cannot stage a warpgroup's second dQ tile: one (BLOCK_M, 64) float32 tile per
        # warpgroup of its own (reused each query block: the block's first reduce-add wait drains it).
        dq_stage_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    else:
        dq_stage_smem = p_smem  # unused (warp_specialize's arguments cannot be None)

    # With done counts (GluonBwdConfig.overlap_convert), the convert may launch once every CTA has started.
    COUNT_DONE: gl.constexpr = done_counts is not None
    kv_ready, done, q_ready, q_empty, ds_ready, ds_free, stored = _barriers(NUM_STAGES, COUNT_DONE)

    # Each consumer gets its index as a literal (a constexpr) in the inline argument tuple.
    gl.warp_specialize([
        (_consumer_d256, (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem, dq_stage_smem,
                          kv_ready, q_ready, q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc,
                          seqlen_q, seqlen_k, nheads, head_group, qk_scale_log2, softmax_scale,
                          cu_seqlens_q, cu_seqlens_k, seqused_q, dk_ptr, stride_dk_s, stride_dk_h, dv_ptr,
                          stride_dv_s, stride_dv_h, stored, 0, BLOCK_M, NUM_STAGES, CAUSAL, DQ_OVERLAP, IS_VARLEN,
                          HEAD_DIM_TRUE, COUNT_DONE, HEADS_FIRST, V_TRUE)),
        (_consumer_d256, (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem, dq_stage_smem,
                          kv_ready, q_ready, q_empty, ds_ready, ds_free, done, dk_desc, dv_desc, dq_desc,
                          seqlen_q, seqlen_k, nheads, head_group, qk_scale_log2, softmax_scale,
                          cu_seqlens_q, cu_seqlens_k, seqused_q, dk_ptr, stride_dk_s, stride_dk_h, dv_ptr,
                          stride_dv_s, stride_dv_h, stored, 1, BLOCK_M, NUM_STAGES, CAUSAL, DQ_OVERLAP, IS_VARLEN,
                          HEAD_DIM_TRUE, COUNT_DONE, HEADS_FIRST, V_TRUE)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                   lse_smem, delta_smem, kv_ready, q_ready, q_empty, seqlen_q, seqlen_k, nheads, head_group,
                   lse_row_stride, cu_seqlens_q, cu_seqlens_k, seqused_q, lse_ptr, delta_ptr, done_counts, stored,
                   0, 0, BLOCK_M, NUM_STAGES, CAUSAL, IS_VARLEN, HEADS_FIRST, False)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr.to(tl.int64, bitcast=True)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pause():
    tl.inline_asm_elementwise("nanosleep.u32 256;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def gluon_bwd_dq_convert_kernel(Acc, DQ, stride_dqb, stride_dqs, stride_dqh, seqlen_q, nheads, scale, RowsEnd,
                                DoneCounts, nheads_k, done_target,
                                HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq (strided (b, sq, h, d) view) <- scale * acc (contiguous float32 (b, sq, h, d)).
    RowsEnd: None, or (varlen) a pointer to the packed total (cu_seqlens_q[-1]): rows past it
    belong to no sequence and are left alone. BLOCK_D: HEAD_DIM padded to a power of two.
    DoneCounts: None, or (launched as a dependent of the Gluon backward, dense batches) its int32
    (b, nheads_k) done counts: wait until this head's reaches done_target (see "The dQ convert
    overlapped with the kernel's last CTAs")."""
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if DoneCounts is not None:
        count = DoneCounts + b * nheads_k + h // (nheads // nheads_k)
        done = _load_acquire(count)
        while done < done_target:
            _pause()
            done = _load_acquire(count)
    offs_d = tl.arange(0, BLOCK_D)
    if RowsEnd is not None:
        ok = (rows < tl.minimum(tl.load(RowsEnd), seqlen_q))[:, None]
    else:
        ok = (rows < seqlen_q)[:, None]
    if BLOCK_D != HEAD_DIM:
        ok = ok & (offs_d < HEAD_DIM)[None, :]
    acc_rows = ((b * seqlen_q + rows).to(tl.int64) * nheads + h) * HEAD_DIM
    # .cg: written at L2 by other SMs' reduce-adds while this program may already have been resident.
    acc = tl.load(Acc + acc_rows[:, None] + offs_d[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    dq_ptrs = (DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
               + rows.to(tl.int64)[:, None] * stride_dqs + offs_d[None, :])
    tl.store(dq_ptrs, (acc * scale).to(DQ.dtype.element_ty), mask=ok)
    if DoneCounts is not None:
        last = ((tl.program_id(0) == tl.num_programs(0) - 1) & (tl.program_id(1) == tl.num_programs(1) - 1)
                & (tl.program_id(2) == tl.num_programs(2) - 1))
        if last:
            # Stream order: what follows this kernel must find the backward kernel finished, not only
            # every head counted. One program waiting for it is enough (this kernel ends with its last
            # program), and leaves the others free to exit and make room.
            gdc_wait()
