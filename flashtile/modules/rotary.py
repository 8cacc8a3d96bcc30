"""Rotary position embedding (RoPE) for the attention modules.

Training and prefill rotate q and k here, in plain PyTorch (float32 math, result in the input
dtype). Decoding steps hand the cached tables to ``flash_attn_with_kvcache`` instead, which
rotates q and the new k itself, at each sequence's cache position.

Conventions, as in flash_attn: ``interleaved=False`` rotates the two halves of the rotary
channels together (GPT-NeoX), ``interleaved=True`` the pairs (0, 1), (2, 3), ... (GPT-J); only
the first ``dim`` channels of each head rotate, the rest pass through.
"""

from typing import Optional, Tuple, Union

import torch


def packed_token_index(cu_seqlens: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of each packed token, two (total,) int64 tensors.

    Row r of sequence b (rows cu_seqlens[b]:cu_seqlens[b + 1]) is at position r - cu_seqlens[b].
    Found by a search rather than repeat_interleave, so no sequence length is read on the host.
    """
    rows = torch.arange(total, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
    return seq, rows - cu_seqlens.long()[seq]


def rotary_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each packed token inside its own sequence, (total,) int64."""
    return packed_token_index(cu_seqlens, total)[1]


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` (..., nheads, headdim) at ``positions`` (x.shape[:-2], integer).

    cos, sin: (seqlen_ro, rotary_dim / 2) tables; channels past rotary_dim pass through.
    Differentiable (the rotation is linear; its gradient is the inverse rotation).
    """
    half = cos.shape[-1]
    cos_p = cos[positions].unsqueeze(-2).float()  # (..., 1, half): the same for every head
    sin_p = sin[positions].unsqueeze(-2).float()
    rot = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos_p - x2 * sin_p, x1 * sin_p + x2 * cos_p], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x1 * cos_p - x2 * sin_p, x1 * sin_p + x2 * cos_p], dim=-1)
    if 2 * half == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding with cached float32 cos/sin tables.

    Arguments:
        dim: rotary channels per head (even, <= headdim).
        base: frequency base; channel pair i turns by position * base ** (-2i / dim).
        interleaved: rotate pairs (0, 1), (2, 3), ... (True) or halves (False, GPT-NeoX).
        device: where to build the first tables (they follow the inputs afterwards).

    ``forward(qkv, kv=None, seqlen_offset=0, positions=None, max_seqlen=None)``:
        qkv (batch, seqlen, 3, nheads, headdim) -> rotated q and k, v untouched; or, with kv,
        qkv is q (batch, seqlen, nheads, headdim) and kv (batch, seqlen, 2, nheads_k, headdim),
        returning (q, kv) rotated. seqlen_offset: int or (batch,) tensor, the position of the
        first token. positions: explicit integer positions, shape qkv.shape[:-3] (or q.shape[:-2]),
        e.g. from :func:`rotary_positions` for packed batches; overrides seqlen_offset.
        max_seqlen: optional bound on every position + 1 (sizes the tables without reading the
        device; needed only with tensor offsets or explicit positions, else one host sync).
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, device=None):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"rotary dim must be a positive even number, got {dim}")
        self.dim, self.base, self.interleaved = int(dim), float(base), bool(interleaved)
        # Plain attributes, not buffers: module.to(bfloat16) must not round the tables (positions
        # in the thousands need float32 angles), and they are rebuilt on demand anyway.
        self._cos: Optional[torch.Tensor] = None
        self._sin: Optional[torch.Tensor] = None
        if device is not None:
            self.cos_sin(1, device)

    def cos_sin(self, seqlen: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """float32 tables (>= seqlen, dim / 2) on ``device``, also the format ``flash_attn_with_kvcache``
        takes as rotary_cos / rotary_sin. Grown by powers of two, so decoding rebuilds them rarely."""
        device = torch.device(device)
        if self._cos is None or self._cos.shape[0] < seqlen or self._cos.device != device:
            length = max(16, 1 << max(int(seqlen) - 1, 0).bit_length())
            # Angles in float64 and then rounded once: float32 products lose digits at long positions.
            inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float64)
                                            / self.dim))
            angles = torch.arange(length, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
            self._cos, self._sin = angles.cos().float(), angles.sin().float()
        return self._cos, self._sin

    def _positions(self, shape, device, seqlen_offset: Union[int, torch.Tensor]) -> torch.Tensor:
        batch, seqlen = shape
        steps = torch.arange(seqlen, device=device)
        if isinstance(seqlen_offset, torch.Tensor):
            return seqlen_offset.to(device=device, dtype=torch.long)[:, None] + steps[None, :]
        return (steps + int(seqlen_offset)).expand(batch, seqlen)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Union[int, torch.Tensor] = 0, positions: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None):
        q = qkv if kv is not None else qkv[..., 0, :, :]
        if self.dim > q.shape[-1]:
            raise ValueError(f"rotary dim {self.dim} exceeds the head dim {q.shape[-1]}")
        if positions is None:
            if q.dim() != 4:
                raise ValueError("packed (total, ...) inputs need explicit positions (see rotary_positions)")
            positions = self._positions(q.shape[:2], q.device, seqlen_offset)
            if max_seqlen is None and not isinstance(seqlen_offset, torch.Tensor):
                max_seqlen = int(seqlen_offset) + q.shape[1]
        if max_seqlen is None:  # the table length from the device: one host sync
            max_seqlen = int(positions.max().item()) + 1 if positions.numel() else 1
        cos, sin = self.cos_sin(max_seqlen, q.device)
        if kv is None:
            q_rot = apply_rotary_emb(qkv[..., 0, :, :], cos, sin, positions, self.interleaved)
            k_rot = apply_rotary_emb(qkv[..., 1, :, :], cos, sin, positions, self.interleaved)
            return torch.stack([q_rot, k_rot, qkv[..., 2, :, :]], dim=-3)
        q_rot = apply_rotary_emb(qkv, cos, sin, positions, self.interleaved)
        k_rot = apply_rotary_emb(kv[..., 0, :, :], cos, sin, positions, self.interleaved)
        return q_rot, torch.stack([k_rot, kv[..., 1, :, :]], dim=-3)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}"
