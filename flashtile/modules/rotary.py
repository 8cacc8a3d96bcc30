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


def apply_rotary_emb_func(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                          inplace: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                          cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
    """:func:`apply_rotary_emb` with the signature of flash_attn.layers.rotary.apply_rotary_emb
    (which flash_attn also names apply_rotary_emb_func): positions from sequence offsets.

    x: (batch, seqlen, nheads, headdim), or packed (total, nheads, headdim) with cu_seqlens
    (batch + 1,) int32 and max_seqlen. cos, sin: (seqlen_ro, rotary_dim / 2). seqlen_offsets: int,
    or a (batch,) integer tensor: row t of sequence b is at position seqlen_offsets[b] + t. As in
    flash_attn, an int offset must keep every position inside the tables, and positions a tensor
    offset puts past them are left unrotated. inplace: write the result into x and return x.
    Differentiable; computed in float32 and returned in x's dtype.
    """
    if cos.dim() != 2 or tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"cos and sin must both have shape (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {2 * cos.shape[1]} exceeds the head dim {x.shape[-1]}")
    seqlen_ro = cos.shape[0]
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"x must be (batch, seqlen, nheads, headdim) without cu_seqlens, got {tuple(x.shape)}")
        batch, seqlen = x.shape[:2]
        seq, row = None, torch.arange(seqlen, device=x.device).expand(batch, seqlen)
    else:
        if x.dim() != 3 or max_seqlen is None:
            raise ValueError("with cu_seqlens, x must be packed (total, nheads, headdim) and max_seqlen given")
        seqlen = int(max_seqlen)
        seq, row = packed_token_index(cu_seqlens, x.shape[0])
    if isinstance(seqlen_offsets, torch.Tensor):
        offsets = seqlen_offsets.to(device=x.device, dtype=torch.long)
        positions = row + (offsets[:, None] if seq is None else offsets[seq])
        # Past the tables: cos 1, sin 0 (flash_attn's kernel reads them masked that way).
        cos = torch.cat([cos, cos.new_ones((1, cos.shape[1]))])
        sin = torch.cat([sin, sin.new_zeros((1, sin.shape[1]))])
        positions = positions.clamp(max=seqlen_ro)
    else:
        if int(seqlen_offsets) + seqlen > seqlen_ro:
            raise ValueError(f"seqlen_offsets {int(seqlen_offsets)} + seqlen {seqlen} exceeds the {seqlen_ro} "
                             "positions of cos and sin")
        positions = row + int(seqlen_offsets)
    out = apply_rotary_emb(x, cos, sin, positions, interleaved)
    return x.copy_(out) if inplace else out


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding with cached float32 cos/sin tables.

    Arguments:
        dim: rotary channels per head (even, <= headdim).
        base: frequency base; channel pair i turns by position * base ** (-2i / dim).
        interleaved: rotate pairs (0, 1), (2, 3), ... (True) or halves (False, GPT-NeoX).
        scale_base: None, or xPos (Sun et al., 2022) as flash_attn's RotaryEmbedding has it:
            rotary channel pair i of q at position p is also scaled by
            ((2i + 0.4 dim) / (1.4 dim)) ** ((p - L // 2) / scale_base), and of k by its inverse, so
            scores decay with distance. L is the table length flash_attn would hold: the longest
            position bound seen so far (rebuilt on a new device), which centres the scales;
            scores do not depend on it. Not supported while decoding from a kv cache.
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

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False,
                 scale_base: Optional[float] = None, device=None):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"rotary dim must be a positive even number, got {dim}")
        if scale_base is not None and not (isinstance(scale_base, (int, float)) and scale_base > 0):
            raise ValueError(f"scale_base must be None or a number > 0 (xPos), got {scale_base!r}")
        self.dim, self.base, self.interleaved = int(dim), float(base), bool(interleaved)
        self.scale_base = None if scale_base is None else float(scale_base)
        self._xpos: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (q, k) scales (L, dim / 2)
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

    def xpos_scales(self, seqlen: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """xPos scales (L, dim / 2) float32 for q and for k (its inverse), L >= seqlen as flash_attn's
        cache length: grown to seqlen when that is longer, rebuilt on a new device."""
        device = torch.device(device)
        if self._xpos is None or self._xpos[0].shape[0] < seqlen or self._xpos[0].device != device:
            length = int(seqlen)
            pairs = torch.arange(0, self.dim, 2, device=device, dtype=torch.float64)
            channel = (pairs + 0.4 * self.dim) / (1.4 * self.dim)
            power = (torch.arange(length, device=device, dtype=torch.float64) - length // 2) / self.scale_base
            scale = channel[None, :] ** power[:, None]
            self._xpos = (scale.float(), (1.0 / scale).float())
        return self._xpos

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
        if self.scale_base is None:
            cos, sin = self.cos_sin(max_seqlen, q.device)
            cos_k, sin_k = cos, sin
        else:
            scale_q, scale_k = self.xpos_scales(max_seqlen, q.device)
            length = scale_q.shape[0]  # >= max_seqlen
            cos, sin = (t[:length] for t in self.cos_sin(length, q.device))
            cos, sin, cos_k, sin_k = cos * scale_q, sin * scale_q, cos * scale_k, sin * scale_k
        if kv is None:
            q_rot = apply_rotary_emb(qkv[..., 0, :, :], cos, sin, positions, self.interleaved)
            k_rot = apply_rotary_emb(qkv[..., 1, :, :], cos_k, sin_k, positions, self.interleaved)
            return torch.stack([q_rot, k_rot, qkv[..., 2, :, :]], dim=-3)
        q_rot = apply_rotary_emb(qkv, cos, sin, positions, self.interleaved)
        k_rot = apply_rotary_emb(kv[..., 0, :, :], cos_k, sin_k, positions, self.interleaved)
        return q_rot, torch.stack([k_rot, kv[..., 1, :, :]], dim=-3)

    def extra_repr(self) -> str:
        xpos = "" if self.scale_base is None else f", scale_base={self.scale_base}"
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}{xpos}"
