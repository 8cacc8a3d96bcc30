"""The varlen half of the flash_attn API: packed batches of sequences of different lengths.

Sequence b holds rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of the packed (total, nheads, headdim)
tensors. The same kernels as the dense entry points run on (1, total, h, d) views of them and
read each sequence's bounds per program (kernels/seqlens.py): no padding, no copies.
"""

from typing import Optional, Tuple

import torch

from . import checks
from .interface import _forward, _outputs, _save, _saved, _score_params, _unit_last_stride
from .kernels.launch import PackedSeqs, attention_backward
from .runtime import empty_like, validate_enabled


def _packed_seqs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                 block_table=None) -> PackedSeqs:
    """Check the sequence layout (contents too under FLASHTILE_VALIDATE=1, or on CPU) and pack it."""
    checks.check_varlen_batch(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                              validate=validate_enabled() or q.device.type == "cpu", block_table=block_table)
    return PackedSeqs(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), int(max_seqlen_q), int(max_seqlen_k),
                      None if seqused_q is None else seqused_q.contiguous(),
                      None if seqused_k is None else seqused_k.contiguous(), block_table)


def _paged_forward(q, k_cache, v_cache, seqs: PackedSeqs, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, return_attn_probs):
    """The forward over a paged K/V cache (no autograd: the cache is not differentiated through)."""
    params = _score_params(q.unsqueeze(0), k_cache, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, batch=seqs.batch)
    out, lse, probs = _forward(q.unsqueeze(0), k_cache, v_cache, params, return_attn_probs, seqs)
    return (out[0], lse[0], probs) if return_attn_probs else out[0]


def _grad_buffer(t: torch.Tensor, seqused: Optional[torch.Tensor]) -> torch.Tensor:
    """Tokens past seqused are never visited by the kernels; their gradient is 0."""
    return empty_like(t) if seqused is None else torch.zeros_like(t)


def _varlen_forward(ctx, q, k, v, seqs, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, return_attn_probs, saved):
    """The forward all three varlen Functions share; ``saved`` are the tensors to keep for backward."""
    params = _score_params(q.unsqueeze(0), k.unsqueeze(0), dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, batch=seqs.batch)
    out, lse, probs = _forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), params, return_attn_probs, seqs)
    out, lse = out[0], lse[0]  # (total_q, h, d), (h, total_q)
    _save(ctx, *saved, out, lse, params, deterministic, seqs)
    return _outputs(ctx, out, lse, probs, return_attn_probs)


def _varlen_backward(q, k, v, out, dout, lse, dq, dk, dv, params, seqs, deterministic):
    attention_backward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                       _unit_last_stride(dout).unsqueeze(0), lse.unsqueeze(0),
                       dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0), params, deterministic, seqs)


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seqs, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs):
        return _varlen_forward(ctx, q, k, v, seqs, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs, (q, k, v))

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse, params, seqs = _saved(ctx)
        dq = _grad_buffer(q, seqs.seqused_q)
        dk, dv = _grad_buffer(k, seqs.seqused_k), _grad_buffer(v, seqs.seqused_k)
        _varlen_backward(q, k, v, out, dout, lse, dq, dk, dv, params, seqs, ctx.deterministic)
        return (dq, dk, dv) + (None,) * 9


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, seqs, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs):
        q, k, v = qkv.unbind(dim=1)
        return _varlen_forward(ctx, q, k, v, seqs, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs, (qkv, None, None))

    @staticmethod
    def backward(ctx, dout, *_):
        qkv, _, _, out, lse, params, seqs = _saved(ctx)
        dqkv = _grad_buffer(qkv, seqs.seqused_q)
        _varlen_backward(*qkv.unbind(dim=1), out, dout, lse, *dqkv.unbind(dim=1), params, seqs, ctx.deterministic)
        return (dqkv,) + (None,) * 9


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, seqs, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs):
        k, v = kv.unbind(dim=1)
        return _varlen_forward(ctx, q, k, v, seqs, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs, (q, kv, None))

    @staticmethod
    def backward(ctx, dout, *_):
        q, kv, _, out, lse, params, seqs = _saved(ctx)
        dq, dkv = _grad_buffer(q, seqs.seqused_q), _grad_buffer(kv, seqs.seqused_k)
        _varlen_backward(q, *kv.unbind(dim=1), out, dout, lse, dq, *dkv.unbind(dim=1), params, seqs,
                         ctx.deterministic)
        return (dq, dkv) + (None,) * 10


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[torch.Tensor] = None,
                           seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None):
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
            sequence's key count. Inference only (no backward through the cache), portable kernels.
    Returns:
        out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q) float32,
        S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k)) with return_attn_probs.
    """
    paged = block_table is not None
    checks.check_tensor(q, "q", 3)
    for name, t in (("k", k), ("v", v)):
        checks.check_tensor(t, name, 4 if paged else 3)
    checks.check_same_dtype_and_device({"q": q, "k": k, "v": v})
    if paged:
        checks.check_qkv_shapes(q, k[0], v[0])  # heads and head dims; a page stands for the keys
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError("block_table (paged K/V) serves inference: there is no backward through a paged "
                             "cache; call under torch.no_grad() or pass tensors that do not require grad")
        seqs = _packed_seqs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                            block_table)
        return _paged_forward(q, k, v, seqs, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              return_attn_probs)
    checks.check_qkv_shapes(q, k, v)
    seqs = _packed_seqs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    return FlashAttnVarlenFunc.apply(q, k, v, seqs, dropout_p, softmax_scale, causal, window_size, softcap,
                                     alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False):
    """:func:`flash_attn_varlen_func` with q, k, v packed as qkv (total, 3, nheads, headdim) and
    one cu_seqlens / max_seqlen for queries and keys. The backward writes one dqkv."""
    checks.check_tensor(qkv, "qkv", 4)
    checks.check_same_dtype_and_device({"qkv": qkv})
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=1)
    checks.check_qkv_shapes(q, k, v, names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"))
    seqs = _packed_seqs(q, k, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, None, None)
    return FlashAttnVarlenQKVPackedFunc.apply(qkv, seqs, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                                    softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                                    deterministic: bool = False, return_attn_probs: bool = False):
    """:func:`flash_attn_varlen_func` with k, v packed as kv (total_k, 2, nheads_k, headdim)."""
    checks.check_tensor(q, "q", 3)
    checks.check_tensor(kv, "kv", 4)
    checks.check_same_dtype_and_device({"q": q, "kv": kv})
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(dim=1)
    checks.check_qkv_shapes(q, k, v, names=("q", "kv[:, 0]", "kv[:, 1]"))
    seqs = _packed_seqs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, None)
    return FlashAttnVarlenKVPackedFunc.apply(q, kv, seqs, dropout_p, softmax_scale, causal, window_size, softcap,
                                             alibi_slopes, deterministic, return_attn_probs)
