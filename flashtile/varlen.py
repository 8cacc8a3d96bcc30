"""The varlen half of the flash_attn API: packed batches of sequences of different lengths.

Sequence b holds rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of the packed (total, nheads, headdim)
tensors. The same kernels as the dense entry points run on (1, total, h, d) views of them and
read each sequence's bounds per program (kernels/seqlens.py): no padding, no copies.
"""

from typing import Optional, Tuple

import torch

from . import call_plans, checks, mod_ops, ops, sinks
from .mods import call_mods
from .mods import given as mods_given
from .options import Mods, resolve_options

def _check_layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                  block_table=None) -> None:
    """Check the sequence layout's dtypes, shapes and devices. Its contents need the device's values:
    the op checks them (on CPU tensors, or with FLASHTILE_VALIDATE=1), so tracing never reads them."""
    checks.check_varlen_batch(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                              validate=False, block_table=block_table)


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                  block_table) -> None:
    """flash_attn_varlen_func's tensor and layout checks (also flash_attn's private varlen forward).
    A paged forward runs whether or not the inputs require grad (as in flash_attn); a backward
    through it raises (ops.py)."""
    paged = block_table is not None
    checks.check_tensor(q, "q", 3)
    for name, t in (("k", k), ("v", v)):
        checks.check_tensor(t, name, 4 if paged else 3)
    checks.check_same_dtype_and_device({"q": q, "k": k, "v": v})
    if paged:
        checks.check_qkv_shapes(q, k[0], v[0])  # heads and head dims; a page stands for the keys
    else:
        checks.check_qkv_shapes(q, k, v)
    _check_layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, block_table)


def _varlen(q, k, v, q_view, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
            block_table, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, call_key=None, learnable_sink=None, mods: Optional[Mods] = None):
    """The varlen entry points after their checks; k / v None mark packed layouts (ops.py).
    ``call_key``: the call_plans key of a flash_attn_varlen_func call that may leave a plan.
    ``mods``: resolved score / mask mods (mods.resolve_mods)."""
    if learnable_sink is not None:
        sinks.check_learnable_sink(learnable_sink, q_view.shape[1], q_view.device)
    params = resolve_options(q_view, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                             batch=cu_seqlens_q.shape[0] - 1, deterministic=deterministic,
                             return_attn_probs=return_attn_probs)
    if call_key is not None and call_plans.may_keep(q.device):
        call = call_plans.VARLEN_CALLS.put(call_key, call_plans.VarlenCall(q, v, params, max_seqlen_q, max_seqlen_k,
                                                                           bool(deterministic)))
        return call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                    call.call_params(params.alibi_slopes, learnable_sink, params.dropout_seed), learnable_sink)
    alibi_slopes, dropout_seed, floats, window_left, window_right = params.op_args()
    tensors = (alibi_slopes, dropout_seed)
    ints = [int(max_seqlen_q), int(max_seqlen_k), window_left, window_right, int(bool(deterministic))]
    layout = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table)
    if mods is not None:
        out, lse = mod_ops.attention(q, k, v, list(layout), *tensors, learnable_sink, floats, ints, mods)
    else:
        out, lse = ops.varlen_attention(q, k, v, *layout, *tensors, learnable_sink, floats, ints)
    if not return_attn_probs:
        return out
    if mods is not None:
        return out, lse, mod_ops.attention_probabilities(q, k, v, lse, list(layout), tensors, floats, ints, mods)
    return out, lse, ops.attention_probabilities(q, k, v, lse, *layout, tensors, floats, ints)


def _call_mods(q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, aligned: bool, *mod_args_and_options,
               **options) -> tuple:
    """mods.call_mods for a packed batch: its sequences as the batch, the maxima as the lengths."""
    *mod_args, softcap, alibi_slopes = mod_args_and_options
    return call_mods(*mod_args, softcap, alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], int(max_seqlen_q),
                     int(max_seqlen_k), aligned, q.device, **options)


@mod_ops.compiles_as_op
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[torch.Tensor] = None,
                           seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None,
                           learnable_sink: Optional[torch.Tensor] = None, *, score_mod=None, score_mod_bwd=None,
                           mask_mod=None, aux_tensors=None, block_mask=None, attn_bias=None):
    """:func:`flashtile.flash_attn_func` on a packed batch of sequences of different lengths.

    Arguments:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim): the sequences' tokens
            end to end. Same dtypes, head dims, GQA rule and options as flash_attn_func; every
            option (causal bottom-right, window, softcap, ALiBi, dropout) applies per sequence
            with that sequence's own lengths.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: sequence b is rows
            cu_seqlens[b]:cu_seqlens[b + 1]. Zero-length sequences are fine.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence (they size the
            launch grid, so no call reads the device). The caller's contract, as in flash_attn:
            cu_seqlens start at 0, never decrease, end at total_q / total_k, and no sequence is
            longer than max_seqlen; FLASHTILE_VALIDATE=1 checks all of it (one host sync per call).
            Whatever they hold, the kernels never touch memory outside the tensors.
        seqused_q, seqused_k: optional int32 (batch,): sequence b uses only the first seqused[b]
            of the tokens cu_seqlens reserves for it. Unused query rows get out 0 and lse -inf,
            unused tokens a zero gradient.
        block_table: optional int32 (batch, pages per sequence): k and v are then paged caches
            (num_pages, page_size, nheads_k, headdim), and key t of sequence b lives at page
            block_table[b, t // page_size], row t % page_size; cu_seqlens_k (or seqused_k) gives each
            sequence's key count. For inference, on the portable kernels: the forward runs on
            inputs that require grad too, and a backward through it raises a RuntimeError.
        learnable_sink: optional (nheads,) sink logits, as in flash_attn_func (rows past seqused_q
            get lse = sink).
        score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask: as in flash_attn_func; the mods
            see each sequence's own positions and its index as the batch. A block mask is built for
            (batch, nheads, max_seqlen_q, max_seqlen_k).
        attn_bias: as in flash_attn_func, broadcastable to (batch, nheads, max_seqlen_q, max_seqlen_k):
            sequence b reads the top-left (seqlen_q_b, seqlen_k_b) corner of its slice.
    Returns:
        out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q) float32,
        S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k)) with return_attn_probs.
    """
    programmable = mods_given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias)
    key = None if programmable else call_plans.varlen_key(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_q, seqused_k, learnable_sink)
    if key is not None and call_plans.replay_possible():
        call = call_plans.VARLEN_CALLS.get(key)
        if call is not None:  # a call of this signature passed every check below
            return call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                        call.call_params(alibi_slopes, learnable_sink), learnable_sink)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, block_table)
    mods = None
    if programmable:  # queries line up with keys when both sides share one cu_seqlens and use every token
        aligned = cu_seqlens_q is cu_seqlens_k and seqused_q is None and seqused_k is None and block_table is None
        mods, softcap, alibi_slopes, causal, window_size = _call_mods(
            q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, aligned, score_mod, score_mod_bwd, mask_mod, aux_tensors,
            block_mask, softcap, alibi_slopes, attn_bias=attn_bias, deterministic=deterministic, causal=causal,
            window_size=window_size)
    return _varlen(q, k, v, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                   block_table, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, key, learnable_sink, mods)


@mod_ops.compiles_as_op
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, learnable_sink: Optional[torch.Tensor] = None,
                                     *, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                                     block_mask=None, attn_bias=None):
    """:func:`flash_attn_varlen_func` with q, k, v packed as qkv (total, 3, nheads, headdim) and
    one cu_seqlens / max_seqlen for queries and keys. The backward writes one dqkv. learnable_sink
    and the mod arguments as in flash_attn_varlen_func."""
    checks.check_tensor(qkv, "qkv", 4)
    checks.check_same_dtype_and_device({"qkv": qkv})
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=1)
    checks.check_qkv_shapes(q, k, v, names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"))
    _check_layout(q, k, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, None, None)
    mods = None
    if mods_given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias):
        mods, softcap, alibi_slopes, causal, window_size = _call_mods(
            q, cu_seqlens, max_seqlen, max_seqlen, True, score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask,
            softcap, alibi_slopes, attn_bias=attn_bias, deterministic=deterministic, causal=causal,
            window_size=window_size)
    return _varlen(qkv, None, None, q, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, None, None, None, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                   learnable_sink=learnable_sink, mods=mods)


@mod_ops.compiles_as_op
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                                    softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                                    deterministic: bool = False, return_attn_probs: bool = False,
                                    learnable_sink: Optional[torch.Tensor] = None, *, score_mod=None,
                                    score_mod_bwd=None, mask_mod=None, aux_tensors=None, block_mask=None,
                                    attn_bias=None):
    """:func:`flash_attn_varlen_func` with k, v packed as kv (total_k, 2, nheads_k, headdim);
    learnable_sink and the mod arguments as in flash_attn_varlen_func."""
    checks.check_tensor(q, "q", 3)
    checks.check_tensor(kv, "kv", 4)
    checks.check_same_dtype_and_device({"q": q, "kv": kv})
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(dim=1)
    checks.check_qkv_shapes(q, k, v, names=("q", "kv[:, 0]", "kv[:, 1]"))
    _check_layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, None)
    mods = None
    if mods_given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias):
        mods, softcap, alibi_slopes, causal, window_size = _call_mods(
            q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, cu_seqlens_q is cu_seqlens_k, score_mod, score_mod_bwd,
            mask_mod, aux_tensors, block_mask, softcap, alibi_slopes, attn_bias=attn_bias, deterministic=deterministic,
            causal=causal, window_size=window_size)
    return _varlen(q, kv, None, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, None, None,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, learnable_sink=learnable_sink, mods=mods)
