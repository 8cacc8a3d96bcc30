"""The public API, drop-in for flash_attn 2.x's dense and varlen entry points.

Each entry point checks its arguments (in Python, so under ``torch.compile`` the checks run once
at trace time), folds the options into the kernels' scalars and calls the custom operators of
:mod:`flashtile.ops` (through ops.dense_attention / ops.varlen_attention: the ops themselves
while torch.compile traces, the same functions in a plain autograd.Function in eager mode, which
costs less host time per call). Either way the backward kernels run from the same formula.
Packed variants hand the packed tensor itself to the op, which takes views of it and writes one
packed gradient: no copies on either side.
"""

from typing import Optional, Tuple

import torch

from . import call_plans, checks, mod_ops, ops, sinks
from .mods import call_mods
from .mods import given as mods_given
from .mods import native_documents
from .options import Mods, resolve_options
from .varlen import flash_attn_varlen_func

def _dense(q, k, v, q_view, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs, call_key=None, learnable_sink=None, mods: Optional[Mods] = None):
    """The dense entry points after their layout checks; k / v None mark packed layouts (ops.py).
    ``call_key``: the call_plans key of a flash_attn_func call that may leave a plan. ``mods``:
    resolved score / mask mods (mods.resolve_mods)."""
    if learnable_sink is not None:
        sinks.check_learnable_sink(learnable_sink, q_view.shape[2], q_view.device)
    params = resolve_options(q_view, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                             deterministic=deterministic, return_attn_probs=return_attn_probs)
    if call_key is not None and call_plans.may_keep(q.device):
        call = call_plans.DENSE_CALLS.put(call_key, call_plans.DenseCall(q, v, params, bool(deterministic)))
        return call(q, k, v, call.call_params(params.alibi_slopes, learnable_sink, params.dropout_seed), learnable_sink)
    alibi_slopes, dropout_seed, floats, window_left, window_right = params.op_args()
    tensors = (alibi_slopes, dropout_seed)
    ints = [window_left, window_right, int(bool(deterministic))]
    if mods is not None:
        out, lse = mod_ops.attention(q, k, v, [], *tensors, learnable_sink, floats, ints, mods)
    else:
        out, lse = ops.dense_attention(q, k, v, *tensors, learnable_sink, floats, ints)
    if not return_attn_probs:
        return out
    if mods is not None:
        return out, lse, mod_ops.attention_probabilities(q, k, v, lse, [], tensors, floats, ints, mods)
    return out, lse, ops.attention_probabilities(q, k, v, lse, None, None, None, None, None, tensors, floats, ints)


@mod_ops.compiles_as_op
def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, learnable_sink: Optional[torch.Tensor] = None, *,
                    score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, block_mask=None,
                    attn_bias=None):
    """Exact attention, ``softmax(q k^T * softmax_scale) v``, with O(seqlen) memory.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), with
            nheads a multiple of nheads_k (MQA/GQA: query head i uses kv head i // (nheads // nheads_k)).
            float16, bfloat16 (or float32); headdim <= 256; last dim unit-stride (other strides free).
        dropout_p: dropout probability on the attention probabilities (pass 0.0 in evaluation).
        softmax_scale: scale of q k^T; default 1 / sqrt(headdim).
        causal: mask aligned to the bottom-right corner (query i sees keys j <= i + seqlen_k - seqlen_q).
        window_size: (left, right) sliding window around i + seqlen_k - seqlen_q, inclusive; -1 = unbounded.
            Any pair of int-likes: ints, numpy ints, one-element integer tensors, a 2-element tensor.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before masking and ALiBi.
        alibi_slopes: float32 (nheads,) or (batch, nheads); adds -slope * |i + seqlen_k - seqlen_q - j|.
        deterministic: if True, the backward sums every gradient in a fixed order (bit-identical
            runs). If False (default), the Hopper backward may add dQ up with float32
            reductions in arbitrary order (last-bit differences between runs).
        return_attn_probs: also return softmax_lse (batch, nheads, seqlen_q) float32 and the
            probabilities (batch, nheads, seqlen_q, seqlen_k) (testing only: O(N^2) memory).
        learnable_sink: optional floating-point (nheads,) tensor, one logit per query head that
            joins each row's softmax with no value (gpt-oss's sinks): the row's weights sum to
            1 - exp(sink - lse), and lse includes it. Its gradient is returned when it requires
            grad; a row that sees no key gets out 0 and lse = sink. (flashtile's extension.)
        score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask: programmable attention
            (flashtile.mods: @triton.jit functions that change the scores and the mask, the tensors
            they read, a block mask from flashtile.create_block_mask). They run on the portable
            kernels (under torch.compile as one op: mod_ops.py); built-ins that are flash_attn
            options run as those, a document mask as packed sequences (docs/programmable.md).
            (flashtile's extension.)
        attn_bias: optional floating-point tensor broadcastable to (batch, nheads, seqlen_q, seqlen_k),
            added to the scores after softmax_scale, softcap and ALiBi; its gradient is returned (in
            its shape, summed over the broadcast dimensions) when it requires grad. O(seqlen^2) memory;
            not with score_mod. Portable kernels, as the mods. (flashtile's extension.)
    Returns:
        out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, S_dmask) with return_attn_probs.
    """
    programmable = mods_given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias)
    key = None if programmable else call_plans.dense_key(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        learnable_sink)
    if key is not None and call_plans.replay_possible():
        call = call_plans.DENSE_CALLS.get(key)
        if call is not None:  # a call of this signature passed every check below
            return call(q, k, v, call.call_params(alibi_slopes, learnable_sink), learnable_sink)
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(t, name, 4)
    checks.check_same_dtype_and_device({"q": q, "k": k, "v": v})
    checks.check_qkv_shapes(q, k, v)
    mods = None
    head_slopes = alibi_slopes is None or (isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 1)
    # (Packed sequences take (batch, nheads) slopes per sequence: such slopes keep the mask.)
    if programmable and not return_attn_probs and head_slopes:
        documents = native_documents(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias,
                                     q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device)
        if documents is not None:
            cu_seqlens, longest = documents
            out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, cu_seqlens,
                                         longest, longest, dropout_p, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, deterministic, learnable_sink=learnable_sink)
            return out.unflatten(0, q.shape[:2])
    if programmable:
        mods, softcap, alibi_slopes, causal, window_size = call_mods(
            score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, softcap, alibi_slopes, q.shape[0], q.shape[2],
            q.shape[1], k.shape[1], q.shape[1] == k.shape[1], q.device, attn_bias=attn_bias,
            deterministic=deterministic, causal=causal, window_size=window_size)
    return _dense(q, k, v, q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs, key, learnable_sink, mods)


@mod_ops.compiles_as_op
def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                              softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                              deterministic: bool = False, return_attn_probs: bool = False,
                              learnable_sink: Optional[torch.Tensor] = None, *, score_mod=None, score_mod_bwd=None,
                              mask_mod=None, aux_tensors=None, block_mask=None, attn_bias=None):
    """:func:`flash_attn_func` with q, k, v packed as qkv (batch, seqlen, 3, nheads, headdim).

    The backward writes one dqkv of qkv's shape; no q/k/v copies are made. learnable_sink and the
    mod arguments as in flash_attn_func.
    """
    checks.check_tensor(qkv, "qkv", 5)
    checks.check_same_dtype_and_device({"qkv": qkv})
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=2)
    checks.check_qkv_shapes(q, k, v, names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"))
    mods = None
    if mods_given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias):
        mods, softcap, alibi_slopes, causal, window_size = call_mods(
            score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, softcap, alibi_slopes, q.shape[0], q.shape[2],
            q.shape[1], k.shape[1], True, q.device, attn_bias=attn_bias, deterministic=deterministic, causal=causal,
            window_size=window_size)
    return _dense(qkv, None, None, q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs, learnable_sink=learnable_sink, mods=mods)


@mod_ops.compiles_as_op
def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                             deterministic: bool = False, return_attn_probs: bool = False,
                             learnable_sink: Optional[torch.Tensor] = None, *, score_mod=None, score_mod_bwd=None,
                             mask_mod=None, aux_tensors=None, block_mask=None, attn_bias=None):
    """:func:`flash_attn_func` with k, v packed as kv (batch, seqlen_k, 2, nheads_k, headdim);
    learnable_sink and the mod arguments as in flash_attn_func."""
    checks.check_tensor(q, "q", 4)
    checks.check_tensor(kv, "kv", 5)
    checks.check_same_dtype_and_device({"q": q, "kv": kv})
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    checks.check_qkv_shapes(q, *kv.unbind(dim=2), names=("q", "kv[:, :, 0]", "kv[:, :, 1]"))
    mods = None
    if mods_given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias):
        mods, softcap, alibi_slopes, causal, window_size = call_mods(
            score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, softcap, alibi_slopes, q.shape[0], q.shape[2],
            q.shape[1], kv.shape[1], q.shape[1] == kv.shape[1], q.device, attn_bias=attn_bias,
            deterministic=deterministic, causal=causal, window_size=window_size)
    return _dense(q, kv, None, q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs, learnable_sink=learnable_sink, mods=mods)
