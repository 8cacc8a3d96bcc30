"""Padding utilities for the varlen entry points: padded (batch, seqlen, ...) <-> packed (total, ...).

    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, attention_mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    hidden = pad_input(out, indices, batch, seqlen)

Both directions are differentiable. Indices are unique, so the gathers and scatters run
without atomics (deterministic gradients).
"""

from typing import Optional, Tuple

import torch


class _GatherRows(torch.autograd.Function):
    """x[indices] along dim 0, with the backward scattering into zeros."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        full = grad.new_zeros((ctx.num_rows,) + tuple(grad.shape[1:]))
        return full.index_copy_(0, indices, grad), None


class _ScatterRows(torch.autograd.Function):
    """zeros(num_rows, ...) with rows ``indices`` set to x; the backward gathers them back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, indices: torch.Tensor, num_rows: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        full = x.new_zeros((num_rows,) + tuple(x.shape[1:]))
        return full.index_copy_(0, indices, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad.index_select(0, indices), None, None


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] along dim 0 (flash_attn.bert_padding's name), differentiable: the backward copies
    the gradient rows into zeros (the indices are unique: no atomics, so runs are bit-identical)."""
    return _GatherRows.apply(x, indices)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the tokens the masks mark, batch entry after batch entry, in position order.

    Arguments:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), bool or 0/1: the tokens in use.
        unused_mask: optional (batch, seqlen): tokens to keep in the packed tensor without
            attending to them (reserved room, e.g. for decoding); in each row they must come
            after the used tokens, so that seqused counts a prefix.
    Returns:
        (packed (total, ...), indices (total,) int64 into the flattened batch * seqlen rows,
        cu_seqlens (batch + 1,) int32, max_seqlen (Python int: one host sync), seqused (batch,) int32:
        the used tokens per sequence, for flash_attn_varlen_func's seqused_q / seqused_k).
    """
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, seqlen) = "
                         f"{tuple(hidden_states.shape[:2])}, the first two dims of hidden_states")
    keep = attention_mask.bool()
    if unused_mask is not None:
        if tuple(unused_mask.shape) != tuple(attention_mask.shape):
            raise ValueError(f"unused_mask has shape {tuple(unused_mask.shape)}; expected that of "
                             f"attention_mask, {tuple(attention_mask.shape)}")
        keep = keep | unused_mask.bool()
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    batch, seqlen = hidden_states.shape[:2]
    flat = hidden_states.reshape((batch * seqlen,) + tuple(hidden_states.shape[2:]))
    return _GatherRows.apply(flat, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of :func:`unpad_input`: packed (total, ...) -> (batch, seqlen, ...), zeros where
    no token was packed."""
    if hidden_states.shape[0] != indices.shape[0]:
        raise ValueError(f"hidden_states has {hidden_states.shape[0]} rows but indices has {indices.shape[0]}: "
                         "they must match (indices as returned by unpad_input)")
    full = _ScatterRows.apply(hidden_states, indices, batch * seqlen)
    return full.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))
