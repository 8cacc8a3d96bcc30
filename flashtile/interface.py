"""The public API, drop-in for flash_attn 2.x's dense and varlen entry points.

Each entry point checks its arguments, then goes through a ``torch.autograd.Function``
whose forward and backward call the Triton launchers in :mod:`flashtile.kernels.launch`.
Packed variants take views into the packed tensor and write their gradient straight
into one packed gradient: no copies on either side. Varlen entry points hand the same
kernels (1, total, h, d) views of the packed tokens and a :class:`PackedSeqs`.
"""

import math
from typing import Optional, Tuple

import torch

from . import checks
from .runtime import empty, empty_like
from .kernels.launch import PackedSeqs, ScoreParams, attention_backward, attention_forward, attention_probs


def _score_params(q: torch.Tensor, k: torch.Tensor, dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, batch: Optional[int] = None) -> ScoreParams:
    """Check the options and fold them into the kernels' parameters (one place for all entry points).
    q: (b, s, h, d); ``batch`` overrides b for packed batches."""
    nheads, head_dim = q.shape[-2], q.shape[-1]
    batch = q.shape[0] if batch is None else batch
    checks.check_options(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         batch=batch, nheads=nheads, device=q.device)
    window_left, window_right = int(window_size[0]), int(window_size[1])
    if causal:
        window_right = 0
    if alibi_slopes is not None and alibi_slopes.stride(-1) != 1:
        alibi_slopes = alibi_slopes.contiguous()  # (h,) or (b, h) floats: a trivial copy
    dropout_seed = None
    if dropout_p > 0:
        # Drawn from the device's default generator: torch.manual_seed makes it
        # reproducible, and no host sync is needed (the kernels read it on the device).
        dropout_seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    return ScoreParams(
        softmax_scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim),
        softcap=float(softcap),
        window_left=window_left,
        window_right=window_right,
        alibi_slopes=alibi_slopes,
        dropout_p=float(dropout_p),
        dropout_seed=dropout_seed,
    )


def _forward(q, k, v, params: ScoreParams, return_probs: bool, seqs: Optional[PackedSeqs] = None):
    """out (b, sq, h, d), lse (b, h, sq), probs or None. Packed batches: q, k, v are
    (1, total, h, d) views and so are out, lse (1, h, total_q)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    if seqs is not None and seqs.seqused_q is not None:
        # Rows past seqused_q see no key: out 0 and lse -inf, like any row without keys.
        out = torch.zeros((batch, seqlen_q, nheads, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        out = empty((batch, seqlen_q, nheads, head_dim), q.dtype, q.device)
        lse = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    attention_forward(q, k, v, out, lse, params, seqs)
    probs = attention_probs(q, k, lse, params, q.dtype, seqs) if return_probs else None
    return out, lse, probs


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # Incoming gradients can be expanded views (stride 0), e.g. from out.sum().backward().
    return t if t.stride(-1) == 1 else t.contiguous()


def _save(ctx, q, k, v, out, lse, params: ScoreParams, deterministic: bool, seqs: Optional[PackedSeqs] = None) -> None:
    seq_tensors = (None,) * 4 if seqs is None else (seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_q,
                                                    seqs.seqused_k)
    ctx.save_for_backward(q, k, v, out, lse, params.alibi_slopes, params.dropout_seed, *seq_tensors)
    ctx.params = params
    ctx.deterministic = bool(deterministic)
    ctx.max_seqlens = None if seqs is None else (seqs.max_seqlen_q, seqs.max_seqlen_k)


def _saved(ctx):
    """q, k, v, out, lse, params, seqs as the forward saw them."""
    q, k, v, out, lse, alibi_slopes, dropout_seed, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
    params = ScoreParams(**{**ctx.params.__dict__, "alibi_slopes": alibi_slopes, "dropout_seed": dropout_seed})
    seqs = None if ctx.max_seqlens is None else PackedSeqs(cu_q, cu_k, *ctx.max_seqlens, used_q, used_k)
    return q, k, v, out, lse, params, seqs


def _outputs(ctx, out, lse, probs, return_attn_probs: bool):
    if not return_attn_probs:
        return out
    ctx.mark_non_differentiable(lse, probs)
    return out, lse, probs


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs):
        params = _score_params(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
        out, lse, probs = _forward(q, k, v, params, return_attn_probs)
        _save(ctx, q, k, v, out, lse, params, deterministic)
        return _outputs(ctx, out, lse, probs, return_attn_probs)

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse, params, _ = _saved(ctx)
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        attention_backward(q, k, v, out, _unit_last_stride(dout), lse, dq, dk, dv, params,
                           ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs):
        q, k, v = qkv.unbind(dim=2)
        params = _score_params(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
        out, lse, probs = _forward(q, k, v, params, return_attn_probs)
        _save(ctx, qkv, None, None, out, lse, params, deterministic)
        return _outputs(ctx, out, lse, probs, return_attn_probs)

    @staticmethod
    def backward(ctx, dout, *_):
        qkv, _, _, out, lse, params, _ = _saved(ctx)
        dqkv = empty_like(qkv)
        attention_backward(*qkv.unbind(dim=2), out, _unit_last_stride(dout), lse, *dqkv.unbind(dim=2), params,
                           ctx.deterministic)
        return dqkv, None, None, None, None, None, None, None, None


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs):
        k, v = kv.unbind(dim=2)
        params = _score_params(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
        out, lse, probs = _forward(q, k, v, params, return_attn_probs)
        _save(ctx, q, kv, None, out, lse, params, deterministic)
        return _outputs(ctx, out, lse, probs, return_attn_probs)

    @staticmethod
    def backward(ctx, dout, *_):
        q, kv, _, out, lse, params, _ = _saved(ctx)
        dq, dkv = empty_like(q), empty_like(kv)
        attention_backward(q, *kv.unbind(dim=2), out, _unit_last_stride(dout), lse, dq, *dkv.unbind(dim=2), params,
                           ctx.deterministic)
        return dq, dkv, None, None, None, None, None, None, None, None


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False):
    """Exact attention, ``softmax(q k^T * softmax_scale) v``, with O(seqlen) memory.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), with
            nheads a multiple of nheads_k (MQA/GQA: query head i uses kv head i // (nheads // nheads_k)).
            float16, bfloat16 (or float32); headdim <= 256; last dim unit-stride (other strides free).
        dropout_p: dropout probability on the attention probabilities (pass 0.0 in evaluation).
        softmax_scale: scale of q k^T; default 1 / sqrt(headdim).
        causal: mask aligned to the bottom-right corner (query i sees keys j <= i + seqlen_k - seqlen_q).
        window_size: (left, right) sliding window around i + seqlen_k - seqlen_q, inclusive; -1 = unbounded.
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before masking and ALiBi.
        alibi_slopes: float32 (nheads,) or (batch, nheads); adds -slope * |i + seqlen_k - seqlen_q - j|.
        deterministic: if True, the backward sums every gradient in a fixed order (bit-identical
            runs). If False (default), the Hopper backward may add dQ up with float32
            reductions in arbitrary order (last-bit differences between runs).
        return_attn_probs: also return softmax_lse (batch, nheads, seqlen_q) float32 and the
            probabilities (batch, nheads, seqlen_q, seqlen_k) (testing only: O(N^2) memory).
    Returns:
        out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, S_dmask) with return_attn_probs.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(t, name, 4)
    checks.check_same_dtype_and_device({"q": q, "k": k, "v": v})
    checks.check_qkv_shapes(q, k, v)
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                              softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                              deterministic: bool = False, return_attn_probs: bool = False):
    """:func:`flash_attn_func` with q, k, v packed as qkv (batch, seqlen, 3, nheads, headdim).

    The backward writes one dqkv of qkv's shape; no q/k/v copies are made.
    """
    checks.check_tensor(qkv, "qkv", 5)
    checks.check_same_dtype_and_device({"qkv": qkv})
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    checks.check_qkv_shapes(*qkv.unbind(dim=2), names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"))
    return FlashAttnQKVPackedFunc.apply(qkv, dropout_p, softmax_scale, causal, window_size, softcap,
                                        alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                             deterministic: bool = False, return_attn_probs: bool = False):
    """:func:`flash_attn_func` with k, v packed as kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    checks.check_tensor(q, "q", 4)
    checks.check_tensor(kv, "kv", 5)
    checks.check_same_dtype_and_device({"q": q, "kv": kv})
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    checks.check_qkv_shapes(q, *kv.unbind(dim=2), names=("q", "kv[:, :, 0]", "kv[:, :, 1]"))
    return FlashAttnKVPackedFunc.apply(q, kv, dropout_p, softmax_scale, causal, window_size, softcap,
                                       alibi_slopes, deterministic, return_attn_probs)
