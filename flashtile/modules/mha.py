"""Attention modules over flashtile's public functions, in the spirit of ``flash_attn.modules.mha``.

- :class:`FlashSelfAttention`: packed qkv -> out (dense batch or varlen).
- :class:`FlashCrossAttention`: q and packed kv -> out (dense batch or varlen; GQA/MQA).
- :class:`MHA`: projections + rotary + attention + output projection, with GQA/MQA, causal,
  sliding window, ALiBi, key padding masks (through unpad_input / varlen / pad_input) and
  incremental decoding against a kv cache (:class:`InferenceParams`).

Only the functions exported by :mod:`flashtile` are called (never the kernels underneath), so
whatever wraps them (custom ops, torch.compile) applies here too.
"""

import math
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from .. import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache, pad_input, unpad_input)
from .rotary import RotaryEmbedding, packed_token_index


def get_alibi_slopes(nheads: int) -> List[float]:
    """The ALiBi paper's head slopes: a geometric series 2^(-8/n), 2^(-16/n), ... for n a power
    of two; otherwise the series of the power of two below, followed by every other slope of the
    series of the power of two above (as the paper's reference code does)."""

    def series(n: int) -> List[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if nheads <= 0:
        raise ValueError(f"nheads must be positive, got {nheads}")
    low = 2 ** int(math.floor(math.log2(nheads)))
    return series(low) + series(2 * low)[0::2][:nheads - low]


@dataclass
class InferenceParams:
    """State of incremental decoding, shared by all layers of a model (flash_attn's layout).

    max_seqlen, max_batch_size: the cache's capacity (positions and rows).
    seqlen_offset: tokens already in the cache; 0 means the next forward is the prefill. The
        caller advances it after each forward of the whole model.
    batch_size_offset: first cache row of the current batch.
    key_value_memory_dict: layer_idx -> kv cache (max_batch_size, max_seqlen, 2, nheads_k, headdim).
    lengths_per_sample: optional int32 (max_batch_size,): per-sequence cache lengths, used instead
        of seqlen_offset while decoding (prompts of different lengths); the caller keeps it up to date.
    """

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: Dict[int, torch.Tensor] = field(default_factory=dict)
    lengths_per_sample: Optional[torch.Tensor] = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        """Start a new generation, keeping the allocated caches."""
        self.max_seqlen, self.max_batch_size = max_seqlen, max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


class _AttentionOptions(nn.Module):
    """What FlashSelfAttention and FlashCrossAttention share: the score options and dropout."""

    def __init__(self, causal: bool = False, softmax_scale: Optional[float] = None, attention_dropout: float = 0.0,
                 window_size: Tuple[int, int] = (-1, -1), alibi_slopes: Optional[torch.Tensor] = None,
                 deterministic: bool = False):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)  # holds p; the kernels drop, not this module
        self.window_size = tuple(window_size)
        # A buffer so that module.to(device) moves it; cast back to float32 at each call, since
        # module.to(bfloat16) casts floating buffers too and the kernels take float32 slopes.
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.deterministic = deterministic

    def _options(self, causal: Optional[bool]) -> dict:
        return dict(dropout_p=self.drop.p if self.training else 0.0, softmax_scale=self.softmax_scale,
                    causal=self.causal if causal is None else causal, window_size=self.window_size,
                    alibi_slopes=None if self.alibi_slopes is None else self.alibi_slopes.float(),
                    deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, softmax_scale={self.softmax_scale}, dropout={self.drop.p}, "
                f"window_size={self.window_size}, alibi={self.alibi_slopes is not None}")


class FlashSelfAttention(_AttentionOptions):
    """softmax(q k^T * softmax_scale) v on packed qkv; dropout on the probabilities in training only.

    Arguments (constructor): causal, softmax_scale (default 1/sqrt(headdim)), attention_dropout,
    window_size (left, right), alibi_slopes (nheads,) or (batch, nheads) float32, deterministic
    (bit-identical backward) -- as :func:`flashtile.flash_attn_func`.

    ``forward(qkv, causal=None, cu_seqlens=None, max_seqlen=None)``:
        qkv: (batch, seqlen, 3, nheads, headdim), or packed (total, 3, nheads, headdim) with
        cu_seqlens int32 (batch + 1,) and max_seqlen (int). causal: overrides the default.
        Returns (batch, seqlen, nheads, headdim), or (total, nheads, headdim).
    """

    def forward(self, qkv: torch.Tensor, causal: Optional[bool] = None, cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None) -> torch.Tensor:
        options = self._options(causal)
        if cu_seqlens is None:
            if qkv.dim() != 5:
                raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}; "
                                 "packed (total, 3, nheads, headdim) needs cu_seqlens and max_seqlen")
            return flash_attn_qkvpacked_func(qkv, **options)
        if qkv.dim() != 4 or max_seqlen is None:
            raise ValueError("with cu_seqlens, qkv must be packed (total, 3, nheads, headdim) and max_seqlen given")
        return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **options)


class FlashCrossAttention(_AttentionOptions):
    """Attention of q over packed kv (MQA/GQA when kv has fewer heads); options as
    :class:`FlashSelfAttention` (causal is aligned to the bottom-right corner, as in flash_attn).

    ``forward(q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None)``:
        q: (batch, seqlen_q, nheads, headdim), kv: (batch, seqlen_k, 2, nheads_k, headdim); or packed
        q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim) with cu_seqlens /
        max_seqlen for q and cu_seqlens_k / max_seqlen_k for kv.
        Returns q's shape.
    """

    def forward(self, q: torch.Tensor, kv: torch.Tensor, causal: Optional[bool] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_k: Optional[int] = None) -> torch.Tensor:
        options = self._options(causal)
        if cu_seqlens is None:
            if cu_seqlens_k is not None or q.dim() != 4 or kv.dim() != 5:
                raise ValueError(f"expected q (batch, seqlen_q, nheads, headdim) and kv (batch, seqlen_k, 2, nheads_k, "
                                 f"headdim), got {tuple(q.shape)} and {tuple(kv.shape)}; packed inputs need "
                                 "cu_seqlens, max_seqlen, cu_seqlens_k and max_seqlen_k")
            return flash_attn_kvpacked_func(q, kv, **options)
        if None in (max_seqlen, cu_seqlens_k, max_seqlen_k) or q.dim() != 3 or kv.dim() != 4:
            raise ValueError("packed cross attention takes q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, "
                             "headdim), cu_seqlens, max_seqlen, cu_seqlens_k and max_seqlen_k")
        return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **options)


# flash_attn MHA arguments that select parts of flash-attn's CUDA build; flashtile accepts them
# (code written for flash-attn runs unchanged) and says once per process that they change nothing.
_BUILD_FLAGS = {
    "use_flash_attn": "attention always runs on flashtile's kernels, whatever its value",
    "fused_bias_fc": "the projections are torch.nn.Linear (flash-attn's fused_dense CUDA extension is not part of "
                     "flashtile)",
}
_warned_build_flags = set()


def _warn_build_flag(name: str) -> None:
    if name not in _warned_build_flags:
        _warned_build_flags.add(name)
        warnings.warn(f"MHA({name}=True) has no effect in flashtile: {_BUILD_FLAGS[name]}", UserWarning,
                      stacklevel=3)


class MHA(nn.Module):
    """Multi-head attention layer: x -> Wqkv -> (rotary) -> attention -> out_proj.

    Arguments:
        embed_dim: model width; num_heads: query heads (headdim = embed_dim // num_heads).
        num_heads_kv: key/value heads (default num_heads); fewer is GQA, 1 is MQA: query head i
            uses kv head i // (num_heads // num_heads_kv).
        cross_attn: queries from x, keys and values from x_kv (separate Wq and Wkv).
        qkv_proj_bias, out_proj_bias: biases of the projections.
        dropout: attention dropout (on the probabilities, training mode only).
        softmax_scale: default 1 / sqrt(headdim). causal: bottom-right aligned causal mask.
        layer_idx: key of this layer's kv cache in InferenceParams.key_value_memory_dict.
        dwconv: flash_attn's depthwise convolution after the projections: not implemented (True raises).
        rotary_emb_dim: channels per head rotated by RoPE (0: none); rotary_emb_base,
            rotary_emb_interleaved, rotary_emb_scale_base (xPos; None: plain RoPE): see
            :class:`RotaryEmbedding`. Self attention only; xPos not while decoding.
        use_alibi: ALiBi biases with the paper's slopes (float32 buffer).
        window_size: (left, right) sliding window; -1 = unbounded.
        fused_bias_fc, use_flash_attn: flash-attn build choices, accepted for its callers; they
            change nothing here (a warning says so once, when one is True).
        return_residual: forward returns (out, x), as flash_attn's MHA (for fused post-norm residuals).
        checkpointing: recompute the attention in the backward instead of keeping its activations
            (torch.utils.checkpoint, non-reentrant; dropout draws the same mask again).
        device, dtype: of the parameters.
        The arguments and their order are flash_attn.modules.mha.MHA's (2.8).

    ``forward(x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, inference_params=None)``:
        x: (batch, seqlen, embed_dim), or packed (total, embed_dim) with cu_seqlens int32 (batch + 1,)
            and max_seqlen (int) for varlen batches.
        x_kv: (batch, seqlen_k, embed_dim), cross attention only (packed: pass cu_seqlens_k and
            max_seqlen_k too).
        key_padding_mask: (batch, seqlen) bool, True = real token (of x_kv under cross attention).
            Self attention packs the real tokens (unpad_input), runs the varlen kernels and puts
            the result back (pad_input): padded rows of the output are 0. Rotary positions count
            real tokens only, so left and right padding give the same result.
        inference_params: :class:`InferenceParams`. With seqlen_offset == 0 (prefill) the layer
            attends as usual and writes its rotated keys and values into the cache (with a
            key_padding_mask, each sequence's tokens land at positions 0.. of its cache row; then
            set lengths_per_sample = key_padding_mask.sum(-1) for decoding). With seqlen_offset > 0
            every call is one flash_attn_with_kvcache: the new k, v are appended in place and q and
            the new k are rotated inside the call, at each sequence's cache length. Call under
            torch.no_grad().
        Returns (batch, seqlen, embed_dim), or (total, embed_dim); with return_residual, (that, x).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_heads_kv: Optional[int] = None, cross_attn: bool = False,
                 qkv_proj_bias: bool = True, out_proj_bias: bool = True, dropout: float = 0.0,
                 softmax_scale: Optional[float] = None, causal: bool = False, layer_idx: Optional[int] = None,
                 dwconv: bool = False, rotary_emb_dim: int = 0, rotary_emb_base: float = 10000.0,
                 rotary_emb_scale_base: Optional[float] = None, rotary_emb_interleaved: bool = False,
                 use_alibi: bool = False, window_size: Tuple[int, int] = (-1, -1), fused_bias_fc: bool = False,
                 use_flash_attn: bool = False, return_residual: bool = False, checkpointing: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if dwconv:
            raise NotImplementedError("MHA(dwconv=True): flashtile does not implement flash_attn's depthwise "
                                      "convolution of q, k, v")
        for name, value in (("fused_bias_fc", fused_bias_fc), ("use_flash_attn", use_flash_attn)):
            if value:
                _warn_build_flag(name)
        self.dwconv, self.use_flash_attn = False, bool(use_flash_attn)
        self.return_residual, self.checkpointing = bool(return_residual), bool(checkpointing)
        factory = dict(device=device, dtype=dtype)
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not a multiple of num_heads {num_heads}")
        if num_heads % num_heads_kv:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_heads_kv {num_heads_kv}")
        if cross_attn and rotary_emb_dim:
            raise ValueError("rotary embedding applies to self attention (cross_attn=False)")
        self.embed_dim, self.num_heads, self.num_heads_kv = embed_dim, num_heads, num_heads_kv
        self.head_dim = embed_dim // num_heads
        self.cross_attn, self.causal, self.layer_idx = cross_attn, causal, layer_idx
        self.softmax_scale, self.window_size = softmax_scale, tuple(window_size)
        self.rotary_emb_dim = rotary_emb_dim
        self.rotary_emb = (RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base, interleaved=rotary_emb_interleaved,
                                           scale_base=rotary_emb_scale_base, device=device)
                           if rotary_emb_dim > 0 else None)
        alibi = (torch.tensor(get_alibi_slopes(num_heads), dtype=torch.float32, device=device) if use_alibi
                 else None)
        kv_dim = 2 * num_heads_kv * self.head_dim
        if cross_attn:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wqkv = nn.Linear(embed_dim, embed_dim + kv_dim, bias=qkv_proj_bias, **factory)
        options = dict(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout, window_size=window_size,
                       alibi_slopes=alibi)
        # Both hold the same options; the self-attention one takes one packed qkv (no split) when
        # every head has its own keys, the cross one takes q and kv apart (GQA, cross attention).
        self.inner_attn = FlashSelfAttention(**options)
        self.inner_cross_attn = FlashCrossAttention(**options)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    # ----------------------------------------------------------------------------------------- cache
    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None) -> torch.Tensor:
        """A zeroed kv cache (batch_size, max_seqlen, 2, num_heads_kv, headdim) for this layer."""
        weight = self.out_proj.weight
        return torch.zeros(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim,
                           dtype=weight.dtype if dtype is None else dtype, device=weight.device)

    def _kv_cache(self, inference_params: InferenceParams, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """This layer's cache rows for the current batch (allocated on first use, in the activations' dtype)."""
        if self.layer_idx is None:
            raise ValueError("MHA needs a layer_idx to keep a kv cache in inference_params")
        caches = inference_params.key_value_memory_dict
        if self.layer_idx not in caches:
            caches[self.layer_idx] = self.allocate_inference_cache(inference_params.max_batch_size,
                                                                   inference_params.max_seqlen, dtype)
        cache = caches[self.layer_idx]
        if cache.dtype != dtype:
            raise TypeError(f"the kv cache of layer {self.layer_idx} is {cache.dtype} but the keys are {dtype}")
        start = inference_params.batch_size_offset
        if start + batch > cache.shape[0]:
            raise ValueError(f"batch rows {start}..{start + batch} exceed the cache's {cache.shape[0]} rows")
        return cache[start:start + batch]

    # ------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, x_kv: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None, inference_params: Optional[InferenceParams] = None,
                cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_k: Optional[int] = None):
        out = self._forward(x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, inference_params, cu_seqlens_k,
                            max_seqlen_k)
        return (out, x) if self.return_residual else out

    def _attention(self, module: nn.Module, *args, **kwargs) -> torch.Tensor:
        """module(*args, **kwargs), recomputed in the backward under checkpointing (only what autograd
        would keep is saved: the inputs, not out / lse). torch's RNG state is restored for the
        recomputation, so dropout draws the same seed and mask."""
        if self.checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False, **kwargs)
        return module(*args, **kwargs)

    def _forward(self, x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, inference_params, cu_seqlens_k,
                 max_seqlen_k) -> torch.Tensor:
        if cu_seqlens is not None and (key_padding_mask is not None or max_seqlen is None):
            raise ValueError("cu_seqlens takes packed x with max_seqlen, and no key_padding_mask")
        if self.cross_attn:
            if x_kv is None:
                raise ValueError("cross attention needs x_kv")
            if inference_params is not None:
                raise NotImplementedError("incremental decoding is for self attention")
            return self._cross_forward(x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
        if x_kv is not None:
            raise ValueError("x_kv is for cross attention (cross_attn=True)")
        if inference_params is not None and inference_params.seqlen_offset > 0:
            if key_padding_mask is not None or cu_seqlens is not None:
                raise ValueError("decoding steps take dense x (batch, seqlen_new, embed_dim); per-sequence lengths "
                                 "go in inference_params.lengths_per_sample")
            return self._decode(x, inference_params)
        if key_padding_mask is None:
            return self._self_forward(x, cu_seqlens, max_seqlen, inference_params)
        batch, seqlen = x.shape[:2]
        # Projections, rotary and attention run on the real tokens only.
        x_packed, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, key_padding_mask)
        out = self._self_forward(x_packed, cu_seqlens, max_seqlen, inference_params)
        return pad_input(out, indices, batch, seqlen)

    def _self_forward(self, x, cu_seqlens, max_seqlen, inference_params) -> torch.Tensor:
        """x (batch, seqlen, E) or packed (total, E) with cu_seqlens; returns x's shape."""
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        qkv = self.Wqkv(x).unflatten(-1, (h + 2 * hk, d))
        packed = cu_seqlens is not None
        seq_pos = packed_token_index(cu_seqlens, x.shape[0]) if packed else None
        rotary = dict(positions=None if seq_pos is None else seq_pos[1], max_seqlen=max_seqlen)
        if hk == h:
            qkv = qkv.unflatten(-2, (3, h))  # (..., 3, h, d): a view, no copy
            if self.rotary_emb is not None:
                qkv = self.rotary_emb(qkv, **rotary)
            kv = qkv[..., 1:, :, :]
            attend = lambda: self._attention(self.inner_attn, qkv, cu_seqlens=cu_seqlens,  # noqa: E731
                                             max_seqlen=max_seqlen)
        else:
            q, kv = qkv[..., :h, :], qkv[..., h:, :].unflatten(-2, (2, hk))
            if self.rotary_emb is not None:
                q, kv = self.rotary_emb(q, kv, **rotary)
            attend = lambda: self._attention(self.inner_cross_attn, q, kv, cu_seqlens=cu_seqlens,  # noqa: E731
                                             max_seqlen=max_seqlen, cu_seqlens_k=cu_seqlens, max_seqlen_k=max_seqlen)
        if inference_params is not None:
            self._prefill_cache(kv, inference_params, cu_seqlens, seq_pos)
        return self.out_proj(attend().flatten(-2))

    def _prefill_cache(self, kv, inference_params, cu_seqlens, seq_pos) -> None:
        """Write the prompt's (rotated) keys and values at positions 0.. of each sequence's cache row."""
        batch = kv.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        cache = self._kv_cache(inference_params, batch, kv.dtype)
        with torch.no_grad():
            if cu_seqlens is None:
                if kv.shape[1] > cache.shape[1]:
                    raise ValueError(f"the prompt ({kv.shape[1]} tokens) exceeds the cache's {cache.shape[1]}")
                cache[:, :kv.shape[1]] = kv
            else:
                seq, pos = seq_pos
                cache[seq, pos] = kv

    def _decode(self, x: torch.Tensor, inference_params: InferenceParams) -> torch.Tensor:
        """One decoding step, x (batch, seqlen_new, E): append the new k, v and attend, in one kernel call."""
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        qkv = self.Wqkv(x).unflatten(-1, (h + 2 * hk, d))
        q, k, v = qkv[..., :h, :], qkv[..., h:h + hk, :], qkv[..., h + hk:, :]
        cache = self._kv_cache(inference_params, x.shape[0], qkv.dtype)
        if inference_params.lengths_per_sample is not None:
            start = inference_params.batch_size_offset
            cache_seqlens = inference_params.lengths_per_sample[start:start + x.shape[0]]
        else:
            cache_seqlens = inference_params.seqlen_offset
        cos = sin = None
        if self.rotary_emb is not None and self.rotary_emb.scale_base is not None:
            # The kv-cache kernel rotates q and k with one pair of tables; xPos scales them apart
            # (flash_attn's fused decoding path refuses xPos too).
            raise NotImplementedError("decoding from a kv cache with xPos (rotary_emb_scale_base) is not supported")
        if self.rotary_emb is not None:
            # The kernel rotates q and the new k at each sequence's cache length.
            cos, sin = self.rotary_emb.cos_sin(inference_params.max_seqlen, x.device)
        alibi = self.inner_attn.alibi_slopes
        out = flash_attn_with_kvcache(
            q, cache[:, :, 0], cache[:, :, 1], k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens,
            softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
            rotary_interleaved=self.rotary_emb.interleaved if self.rotary_emb is not None else False,
            alibi_slopes=None if alibi is None else alibi.float())
        return self.out_proj(out.flatten(-2))

    def _cross_forward(self, x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k):
        hk, d = self.num_heads_kv, self.head_dim
        q = self.Wq(x).unflatten(-1, (self.num_heads, d))
        if cu_seqlens is not None:  # packed queries and keys
            if cu_seqlens_k is None or max_seqlen_k is None:
                raise ValueError("packed cross attention needs cu_seqlens_k and max_seqlen_k for x_kv")
            kv = self.Wkv(x_kv).unflatten(-1, (2, hk, d))
            out = self._attention(self.inner_cross_attn, q, kv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                  cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
            return self.out_proj(out.flatten(-2))
        if key_padding_mask is None:
            kv = self.Wkv(x_kv).unflatten(-1, (2, hk, d))
            return self.out_proj(self._attention(self.inner_cross_attn, q, kv).flatten(-2))
        # Padded keys: pack the real ones; every query sequence keeps its seqlen_q rows.
        batch, seqlen_q = x.shape[:2]
        x_kv_packed, _, cu_k, max_k, _ = unpad_input(x_kv, key_padding_mask)
        kv = self.Wkv(x_kv_packed).unflatten(-1, (2, hk, d))
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=x.device) * seqlen_q
        out = self._attention(self.inner_cross_attn, q.flatten(0, 1), kv, cu_seqlens=cu_q, max_seqlen=seqlen_q,
                              cu_seqlens_k=cu_k, max_seqlen_k=max_k)
        return self.out_proj(out.flatten(-2)).unflatten(0, (batch, seqlen_q))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_heads_kv={self.num_heads_kv}, "
                f"cross_attn={self.cross_attn}, causal={self.causal}, window_size={self.window_size}, "
                f"layer_idx={self.layer_idx}" + (", return_residual=True" if self.return_residual else "")
                + (", checkpointing=True" if self.checkpointing else ""))
