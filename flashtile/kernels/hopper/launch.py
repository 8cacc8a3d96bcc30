"""The Hopper kernels as the dispatcher calls them: the forward plan under the dispatcher's calling
convention, and the whole backward (the portable preprocess, which also zeroes the float32 dQ
accumulator, then the Gluon kernel and the dQ convert), run head chunk by head chunk when the
accumulator would be large."""

from typing import Optional

import torch

from ...options import PackedSeqs, ScoreParams, grid_lengths
from ..portable import mods as builtin
from ..portable.launch import (SinkGrad, preprocess_call, preprocess_seq_tensors, row_stats_buffers,
                               row_stats_by_shape, row_stats_shape)
from .backward_plan import BackwardPlan, done_counts_buffer, dq_accumulator
from .forward_plan import ForwardPlan


class GluonForward:
    """forward_plan.ForwardPlan called as attention_forward's plans are: packed batches pass their
    prefix sums, and lse as its (h, total_q) view; the score options come from ScoreParams.

    query_group g > 1: a GQA call of a few query rows per sequence (decode-shaped:
    dispatch.packed_gqa_on_hopper), a kv head's group of g query heads packed as the rows of its tiles
    (the kernel's QUERY_GROUP): row p * g + i of kv head hk is query head hk * g + i at position p. Each
    K and V tile then serves the whole group, and s * g rows fill the 128-row tiles that s rows would
    leave mostly empty. Q and O move through TMA boxes of (positions, group) over the call's own q and
    out, and lse is stored by (head, position): no copies. Such calls carry no per-head options."""

    def __init__(self, q, k, v, out, lse, params: ScoreParams, cfg, seqs: Optional[PackedSeqs] = None,
                 query_group: int = 1):
        # seqs without prefix sums: a dense batch whose keys are a kv cache's rows, seqused_k of them in use.
        self.varlen = seqs is not None and seqs.cu_seqlens_q is not None
        self.plan = ForwardPlan(q, k, v, out, lse[0] if self.varlen else lse, params.softmax_scale, params.causal,
                                cfg, max_seqlen_q=seqs.max_seqlen_q if self.varlen else None,
                                softcap=params.softcap, window_left=params.window_left,
                                window_right=params.window_right, alibi_slopes=params.alibi_slopes,
                                learnable_sink=params.learnable_sink, rel_bias_table=_rel_bias_table(params),
                                query_group=query_group, **_attn_bias(params), **forward_seq_tensors(seqs))

    def __call__(self, q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs] = None):
        tensors = dict(alibi_slopes=params.alibi_slopes, learnable_sink=params.learnable_sink,
                       rel_bias_table=_rel_bias_table(params), attn_bias=_attn_bias(params).get("attn_bias"))
        self.plan(q, k, v, out, lse[0] if self.varlen else lse, **tensors, **forward_seq_tensors(seqs))


def _rel_bias_table(params: ScoreParams):
    """The relative-position bias table of a call whose only mod is mods.relative_bias (the one mod the
    Hopper kernels take: dispatch.hopper_takes), else None."""
    return None if params.mods is None else params.mods.relative_bias_table


def _attn_bias(params: ScoreParams) -> dict:
    """The forward's attn_bias arguments (the tensor it reads, its strides) when the call's only mod is
    attn_bias (dispatch.hopper_takes sends no other mods here), else none."""
    bias = None if params.mods is None else params.mods.attn_bias
    return {} if bias is None else dict(attn_bias=bias.read, attn_bias_strides=bias.strides)


# How the backward writes attn_bias's gradient, by the gradient mod the call carries: stores it (1), adds it
# (2), or adds its sums along the queries (3).
_BIAS_GRAD_MODES = {builtin.attn_bias_grad_store: 1, builtin.attn_bias_grad: 2,
                    builtin.attn_bias_grad_sum_queries: 3}


def _bias_grad(params: ScoreParams) -> dict:
    """The backward's arguments for attn_bias's gradient: its buffer (mods.AttnBias.backward_mods), strides,
    and whether the kernel stores into it (1), adds into it (2) or adds its sums along the queries into it
    (3); none when the bias takes no gradient."""
    mods = params.mods
    if mods is None or mods.attn_bias is None or mods.dq_score_mod_bwd is None:
        return {}
    aux = mods.dq_score_aux
    return dict(bias_grad=aux[4], bias_grad_strides=tuple(aux[5:8]),
                bias_grad_mode=_BIAS_GRAD_MODES[mods.dq_score_mod_bwd])


# Above this many bytes of float32 dQ accumulator, the Gluon backward runs head chunk by head chunk,
# each with an accumulator of at most GLUON_DQ_CHUNK_BYTES (the sweep's shapes stay in one launch).
GLUON_DQ_ACCUMULATOR_LIMIT = 256 * 2**20


GLUON_DQ_CHUNK_BYTES = 64 * 2**20


def gluon_head_chunks(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int) -> list:
    """[(h0, h1, hk0, hk1)]: query heads h0:h1 over KV heads hk0:hk1 per Gluon backward launch.
    Chunks are whole KV-head groups (dK / dV of a KV head are summed over its query heads inside
    one program), so MQA (one KV head) always runs in one launch."""
    group = nheads // nheads_k
    group_bytes = batch * seqlen_q * group * head_dim * 4
    if group_bytes * nheads_k <= GLUON_DQ_ACCUMULATOR_LIMIT:
        return [(0, nheads, 0, nheads_k)]
    kv_per_chunk = max(1, GLUON_DQ_CHUNK_BYTES // max(group_bytes, 1))
    return [(hk0 * group, min(hk0 + kv_per_chunk, nheads_k) * group, hk0, min(hk0 + kv_per_chunk, nheads_k))
            for hk0 in range(0, nheads_k, kv_per_chunk)]


class GluonBackward:
    """The Hopper backward of one call signature (kernels/plans.py): the preprocess (delta,
    lse_log2, and the float32 dQ accumulator zeroed in the same pass), then the Gluon kernel and
    the dQ convert (backward_plan.BackwardPlan). dout, dk, dv must be TMA-aligned; the
    accumulator covers every row the backward adds into (gluon_config keeps packed batches with
    seqused_q, whose unused rows the preprocess would skip, off this kernel)."""

    def __init__(self, q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, cfg, pre_cfg,
                 seqs: Optional[PackedSeqs] = None):
        assert seqs is None or seqs.seqused_q is None
        # The plan needs the layouts of the buffers each call allocates, not memory.
        delta, lse_log2 = row_stats_buffers(lse, device="meta")
        dq_acc = dq_accumulator(q, device="meta")
        self.kernels = BackwardPlan(q, k, v, dout, lse_log2, delta, dq, dk, dv, dq_acc, params.softmax_scale,
                                    params.causal, cfg, max_seqlen_k=grid_lengths(q, k, seqs)[2],
                                    softcap=params.softcap, window_left=params.window_left,
                                    window_right=params.window_right, alibi_slopes=params.alibi_slopes,
                                    rel_bias_table=_rel_bias_table(params), **_attn_bias(params),
                                    **_bias_grad(params), **gluon_seq_tensors(seqs))
        done_counts = done_counts_buffer(q, k, "meta") if self.kernels.needs_counts else None
        self.preprocess = preprocess_call(out, dout, lse, delta, lse_log2, seqs, pre_cfg.block_m, pre_cfg.num_warps,
                                          zero=dq_acc, zero_counts=done_counts)
        self.sink_grad = None if params.learnable_sink is None else SinkGrad(out, seqs, pre_cfg.block_m)
        # What each call allocates, by shape: a call reads only its tensors' data pointers.
        self.device = q.device
        self.stats_shape, self.dq_acc_shape = row_stats_shape(lse), tuple(dq_acc.shape)
        self.counts_shape = None if done_counts is None else tuple(done_counts.shape)

    def __call__(self, q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, seqs: Optional[PackedSeqs] = None,
                 dsink: Optional[torch.Tensor] = None):
        """dsink: a float32 (nheads,) tensor for the learnable sink's gradient, with a sink."""
        # The host work (buffers, TMA descriptors) comes before the preprocess kernel, so that the
        # preprocess, backward and dQ-convert kernels go out back to back: done between them, it left
        # the GPU idle after the short preprocess. The preprocess zeroes the accumulator (and the
        # done counts) as it goes, which saves a memset kernel.
        delta, lse_log2 = row_stats_by_shape(self.stats_shape, self.device)
        dq_acc = torch.empty(self.dq_acc_shape, device=self.device, dtype=torch.float32)
        done_counts = (None if self.counts_shape is None
                       else torch.empty(self.counts_shape, device=self.device, dtype=torch.int32))
        sink_parts = None if self.sink_grad is None else self.sink_grad.parts()
        descriptors = self.kernels.descriptors(q, dout, k, v, dk, dv, dq_acc, lse_log2, delta)
        self.preprocess(out, dout, lse, delta, lse_log2, dq_acc, done_counts, *preprocess_seq_tensors(seqs),
                        params.learnable_sink, sink_parts)
        self.kernels.launch(descriptors, dq, dk, dv, dq_acc, lse_log2, delta, done_counts=done_counts,
                            alibi_slopes=params.alibi_slopes, rel_bias_table=_rel_bias_table(params),
                            attn_bias=_attn_bias(params).get("attn_bias"),
                            bias_grad=_bias_grad(params).get("bias_grad"), **gluon_seq_tensors(seqs))
        if sink_parts is not None:
            SinkGrad.finish(sink_parts, dsink)


def gluon_seq_tensors(seqs: Optional[PackedSeqs]) -> dict:
    """The packed-batch keyword arguments of gluon_backward.BackwardPlan."""
    if seqs is None:
        return {}
    return dict(cu_seqlens_q=seqs.cu_seqlens_q, cu_seqlens_k=seqs.cu_seqlens_k, seqused_q=seqs.seqused_q)


def forward_seq_tensors(seqs: Optional[PackedSeqs]) -> dict:
    """The packed-batch (or kv-cache) keyword arguments of forward_plan.ForwardPlan."""
    if seqs is None:
        return {}
    return dict(gluon_seq_tensors(seqs), seqused_k=seqs.seqused_k, block_table=seqs.block_table,
                key_shift=seqs.key_shift)
