"""Programmable attention: score and mask mods (the ``score_mod=``, ``score_mod_bwd=``,
``mask_mod=``, ``aux_tensors=`` and ``block_mask=`` arguments of flash_attn_func and
flash_attn_varlen_func), and built-in mods with their derivatives.

A mod is a ``@triton.jit`` function that the portable kernels call on every tile:

- ``score_mod(score, batch, head, q_idx, kv_idx, aux) -> score``: ``score`` is a float32 tile of
  scores in natural units (scaled, capped, ALiBi added); ``q_idx`` / ``kv_idx`` are the positions
  of its rows and columns within the sequence, broadcastable against it (the backward's dK/dV
  kernel passes keys-by-queries tiles, so use them elementwise); ``aux`` the tuple of aux tensors.
- ``score_mod_bwd(grad, score, batch, head, q_idx, kv_idx, aux) -> grad``: the gradient with respect
  to the mod's input ``score``, given ``grad``, the one with respect to its output.
- ``mask_mod(batch, head, q_idx, kv_idx, aux) -> keep``: True where the query sees the key; applied
  with causal / window_size (both must keep a key).

Positions past a sequence's end are clamped to its last position (their results are discarded), so
a mod may index its aux tensors with them. The built-ins below return ScoreMod / MaskMod objects
that carry their functions and tensors.
"""

from typing import Optional

import torch

from . import checks
from .block_mask import BlockMask, create_block_mask
from .kernels.portable import mods as builtin
from .options import AttnBias, MaskMod, Mods, ScoreMod
from .triton_compat import is_jit_function

__all__ = ["ScoreMod", "MaskMod", "BlockMask", "create_block_mask", "alibi", "softcap", "relative_bias",
           "document_mask", "sliding_window", "native_options", "native_window", "native_documents", "given",
           "call_mods",
           "resolve_mods", "resolve_attn_bias"]


def _float32(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    return t.detach().to(torch.float32).contiguous()


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi as a score mod: adds ``-slopes[head] * |q_idx - kv_idx|`` (raw positions: the same as
    ``alibi_slopes=`` when seqlen_q == seqlen_k). slopes: (nheads,)."""
    slopes = _float32(slopes, "slopes")
    if slopes.dim() != 1:
        raise ValueError(f"slopes must have shape (nheads,), got {tuple(slopes.shape)}")
    return ScoreMod(builtin.alibi_score, builtin.additive_bwd, (slopes,), native={"alibi_slopes": slopes},
                    native_needs_aligned=True)


def softcap(cap: float, device=None) -> ScoreMod:
    """Softcapping as a score mod: ``cap * tanh(score / cap)``, on ``device`` (default: the current
    CUDA device, else the CPU)."""
    if not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"cap must be a number > 0, got {cap!r}")
    return ScoreMod(builtin.softcap_score, builtin.softcap_bwd,
                    (torch.tensor([float(cap)], dtype=torch.float32, device=_device(device)),),
                    native={"softcap": float(cap)})


def relative_bias(table: torch.Tensor) -> ScoreMod:
    """A clipped relative-position bias (Shaw et al.; T5 without buckets): adds
    ``table[head, clamp(kv_idx - q_idx, -D, D) + D]`` for a table of shape (nheads, 2 * D + 1). The
    table is read as a constant (no gradient flows into it)."""
    table = _float32(table, "table")
    if table.dim() != 2 or table.shape[1] % 2 != 1:
        raise ValueError(f"table must have shape (nheads, 2 * max_distance + 1), got {tuple(table.shape)}")
    max_distance = torch.tensor([table.shape[1] // 2], dtype=torch.int32, device=table.device)
    return ScoreMod(builtin.relative_bias_score, builtin.additive_bwd, (table, max_distance))


def document_mask(document_ids: torch.Tensor) -> MaskMod:
    """A mask of packed documents in one sequence: a query sees the keys of its own document.
    document_ids: an integer (seqlen,) tensor, the document of each position (queries and keys
    alike: self-attention)."""
    if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 1 or document_ids.is_floating_point():
        raise ValueError("document_ids must be an integer (seqlen,) tensor")
    ids = document_ids.to(torch.int32).contiguous()
    return MaskMod(builtin.document_mask, (ids,), native={"documents": DocumentRuns(ids)})


class DocumentRuns:
    """A document mask's ids as packed sequences: where every document is one run of positions, the
    mask is attention within each run, which flash_attn_varlen_func computes on the batch's rows laid
    end to end (on the Hopper kernels where those serve it). The runs are found once per batch size
    (a host sync) and kept while the ids are not changed in place. Under torch.compile there is no
    host sync to find them: the mask runs as a mask_mod (with a block mask where the call gives one)."""

    def __init__(self, ids: torch.Tensor):
        self.ids, self.version, self.layouts = ids, None, {}

    def sequences(self, batch: int) -> Optional[tuple]:
        """(cu_seqlens int32 (batch * runs + 1,), longest run) of ``batch`` rows of these documents, or
        None when a document has positions in two runs (the mask is then no set of sequences), or
        while torch.compile traces."""
        if torch.compiler.is_compiling():
            return None
        if self.ids._version != self.version:
            self.version, self.layouts = self.ids._version, {}
        if batch not in self.layouts:
            self.layouts[batch] = self._sequences(batch)
        return self.layouts[batch]

    def _sequences(self, batch: int) -> Optional[tuple]:
        ids = self.ids
        if ids.numel() == 0 or ids.device.type == "meta":
            return None
        _, lengths = torch.unique_consecutive(ids, return_counts=True)
        if torch.unique(ids).numel() != lengths.numel():
            return None
        seqlen = ids.numel()
        ends = torch.cumsum(lengths, 0)[None, :] + seqlen * torch.arange(batch, device=ids.device)[:, None]
        cu_seqlens = torch.cat([ends.new_zeros(1), ends.flatten()]).to(torch.int32)
        return cu_seqlens, int(lengths.max())


def native_documents(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias, batch: int, nheads: int,
                     seqlen_q: int, seqlen_k: int, device: torch.device) -> Optional[tuple]:
    """(cu_seqlens, longest) of a dense call whose only mod is the built-in document_mask (as the
    mask_mod or as the mask of the block mask), with as many queries and keys as documented positions,
    when its documents are runs of positions (DocumentRuns): such a call is attention within packed
    sequences and runs as one. Else None."""
    if any(x is not None for x in (score_mod, score_mod_bwd, aux_tensors, attn_bias)):
        return None
    if (mask_mod is None) == (block_mask is None):
        return None
    source = mask_mod if block_mask is None else block_mask
    native = source.native if isinstance(source, (MaskMod, BlockMask)) else None
    if native is None or "documents" not in native:
        return None
    runs = native["documents"]
    if not seqlen_q == seqlen_k == runs.ids.numel() or runs.ids.device != device:
        return None
    if block_mask is not None:
        block_mask.check_call(batch, nheads, seqlen_q, seqlen_k, device)
    return runs.sequences(batch)


def sliding_window(left: int, right: int = 0, device=None) -> MaskMod:
    """A sliding window as a mask mod: a query at q sees the keys q - left .. q + right (raw positions;
    ``right=0`` is causal), on ``device`` (default: the current CUDA device, else the CPU). Alone (or
    as the mask of a block mask), where queries and keys line up, it runs as ``window_size=``."""
    for name, value in (("left", left), ("right", right)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    window = torch.tensor([left, right], dtype=torch.int32, device=_device(device))
    return MaskMod(builtin.sliding_window_mask, (window,), native={"window_size": (left, right)})


def _device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def native_options(score_mod, only_score_mod: bool, softcap, alibi_slopes, aligned: bool) -> Optional[dict]:
    """The flash_attn option that computes ``score_mod`` when it is a built-in with one (softcap, and
    ALiBi where queries and keys line up: ``aligned``, every sequence's seqlen_q == seqlen_k, raw
    positions then being flash_attn's bottom-right ones), the call sets no other mod (``only_score_mod``)
    and does not set that option itself; else None. Such calls run as if the option were given: on
    the Hopper kernels where those serve it."""
    if not isinstance(score_mod, ScoreMod) or score_mod.native is None or not only_score_mod:
        return None
    if score_mod.native_needs_aligned and not aligned:
        return None
    if softcap or alibi_slopes is not None:
        return None
    return score_mod.native


def given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias=None) -> bool:
    """Whether a call sets any mod argument (attn_bias runs as one)."""
    return not (score_mod is None and score_mod_bwd is None and mask_mod is None and aux_tensors is None
                and block_mask is None and attn_bias is None)


def native_window(mask_mod, block_mask, only_mask: bool, aligned: bool, causal, window_size) -> Optional[tuple]:
    """The window_size that computes a call's mask when it is a built-in with one (sliding_window, as
    the mask_mod or as the mask of the block mask), the call sets no other mod (``only_mask``) and
    queries line up with keys (``aligned``): the built-in's window intersected with the call's own
    causal / window_size. Else None. Such calls run as if that window_size were given: on the
    Hopper kernels where those serve it."""
    if not only_mask or not aligned or (mask_mod is None) == (block_mask is None):
        return None
    source = mask_mod if block_mask is None else block_mask
    native = source.native if isinstance(source, (MaskMod, BlockMask)) else None
    if native is None or "window_size" not in native:
        return None
    left, right = checks.window_pair(window_size)
    if causal:
        right = 0

    def tighter(mine: int, built_in: int) -> int:  # -1 is unbounded
        return built_in if mine < 0 else mine if built_in < 0 else min(mine, built_in)

    built_left, built_right = native["window_size"]
    return tighter(left, built_left), tighter(right, built_right)


def call_mods(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, softcap, alibi_slopes, batch: int,
              nheads: int, seqlen_q: int, seqlen_k: int, aligned: bool, device: torch.device, attn_bias=None,
              deterministic: bool = False, causal=False, window_size=(-1, -1)) -> tuple:
    """(mods, softcap, alibi_slopes, causal, window_size) of a call that sets mod arguments: a built-in
    that is one of the options becomes that option (native_options, native_window; mods None), else
    resolve_mods' Mods and the options as given."""
    only_score_mod = (score_mod_bwd is None and mask_mod is None and aux_tensors is None and block_mask is None
                      and attn_bias is None)
    native = native_options(score_mod, only_score_mod, softcap, alibi_slopes, aligned)
    if native is not None:
        return (None, native.get("softcap", softcap), native.get("alibi_slopes", alibi_slopes), causal,
                window_size)
    only_mask = score_mod is None and score_mod_bwd is None and aux_tensors is None and attn_bias is None
    window = native_window(mask_mod, block_mask, only_mask, aligned, causal, window_size)
    if window is not None:
        if block_mask is not None:
            block_mask.check_call(batch, nheads, seqlen_q, seqlen_k, device)
        return None, softcap, alibi_slopes, False, window
    return (resolve_mods(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, batch, nheads, seqlen_q,
                         seqlen_k, device, attn_bias, deterministic), softcap, alibi_slopes, causal, window_size)


def resolve_attn_bias(attn_bias, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, device: torch.device,
                      deterministic: bool = False) -> AttnBias:
    """Check ``attn_bias`` (a floating-point tensor broadcastable to (batch, nheads, seqlen_q, seqlen_k);
    packed calls: per sequence, seqlen_* the longest) and resolve it for the kernels."""
    target = (batch, nheads, seqlen_q, seqlen_k)
    if not isinstance(attn_bias, torch.Tensor):
        raise TypeError(f"attn_bias must be a torch.Tensor or None, got {type(attn_bias).__name__}")
    if not attn_bias.is_floating_point():
        raise ValueError(f"attn_bias must be a floating-point tensor, got {attn_bias.dtype}")
    if attn_bias.device != device:
        raise ValueError(f"attn_bias is on {attn_bias.device} but q is on {device}")
    shape = (1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape)
    if attn_bias.dim() > 4 or any(n not in (1, t) for n, t in zip(shape, target)):
        raise ValueError(f"attn_bias must broadcast to (batch, nheads, seqlen_q, seqlen_k) = {target}, got shape "
                         f"{tuple(attn_bias.shape)}")
    read = attn_bias.detach()
    if shape[3] > 1 and read.stride(-1) != 1:
        read = read.contiguous()  # the kernels read along keys with stride 1 (kernels/portable/mods.py)
    strides = (0,) * (4 - read.dim()) + read.stride()
    strides = [0 if n == 1 else st for n, st in zip(shape, strides)]
    grad_shape = target if deterministic else shape
    grad_strides = [0 if n == 1 else st for n, st in zip(grad_shape, torch.empty(grad_shape, device="meta").stride())]
    grad_dtype = torch.float32
    if tuple(grad_shape) == target:
        # One score per element: stored once, in the bias's dtype when no sum over broadcast dimensions follows.
        grad_fn = builtin.attn_bias_grad_store
        if shape == target:
            grad_dtype = attn_bias.dtype
    elif grad_shape[2] > 1 and grad_shape[3] > 1:
        grad_fn = builtin.attn_bias_grad
    elif grad_shape[3] > 1:
        grad_fn = builtin.attn_bias_grad_sum_queries
    elif grad_shape[2] > 1:
        grad_fn = builtin.attn_bias_grad_sum_keys
    else:
        grad_fn = builtin.attn_bias_grad_sum_tile
    score_fn = builtin.attn_bias_score if shape[3] > 1 else builtin.attn_bias_score_keys_broadcast
    return AttnBias(attn_bias, read, tuple(strides[:3]), tuple(grad_strides[:3]), grad_shape, score_fn, grad_fn,
                    grad_dtype)


def resolve_mods(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, batch: int, nheads: int,
                 seqlen_q: int, seqlen_k: int, device: torch.device, attn_bias=None,
                 deterministic: bool = False) -> Optional[Mods]:
    """Check a call's mod arguments and resolve them into one options.Mods (None: none given).
    A raw function reads ``aux_tensors``; a ScoreMod / MaskMod reads its own; a block mask brings
    its mask_mod (and its aux tensors, when the call gives none). ``attn_bias`` becomes the score
    mod that adds it (resolve_attn_bias)."""
    if not given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias):
        return None
    bias = None
    if attn_bias is not None:
        if score_mod is not None or score_mod_bwd is not None:
            raise ValueError("attn_bias and score_mod were both given: a call takes one score mod; add the bias "
                             "inside score_mod (reading it from aux_tensors), or pass attn_bias alone")
        bias = resolve_attn_bias(attn_bias, batch, nheads, seqlen_q, seqlen_k, device, deterministic)
        # The forward never reads the gradient's slot (aux[2]): the bias stands in for it.
        score_mod = ScoreMod(bias.score_fn, builtin.additive_bwd, bias.forward_aux())
    aux = ()
    if aux_tensors is not None:
        checks.check_aux_tensors(aux_tensors, device)
        aux = tuple(aux_tensors)
    score_aux = aux
    relative_bias_table = None
    if isinstance(score_mod, ScoreMod):
        if score_mod.fn is builtin.relative_bias_score and score_mod.aux_tensors[0].shape[0] == nheads:
            relative_bias_table = score_mod.aux_tensors[0]
        if score_mod_bwd is not None:
            raise ValueError("score_mod_bwd: a flashtile.mods.ScoreMod carries its own backward; pass a plain "
                             "function as score_mod to give one")
        score_mod, score_mod_bwd, score_aux = score_mod.fn, score_mod.bwd, score_mod.aux_tensors
        if bias is None:  # the bias is read by its strides, whatever they are
            checks.check_aux_tensors(score_aux, device, "score_mod's aux_tensors")
    for name, fn in (("score_mod", score_mod), ("score_mod_bwd", score_mod_bwd)):
        if fn is not None and not is_jit_function(fn):
            raise TypeError(f"{name} must be a @triton.jit function or None, got {type(fn).__name__}")
    if score_mod_bwd is not None and score_mod is None:
        raise ValueError("score_mod_bwd was given without score_mod")
    mask_aux = aux
    if isinstance(mask_mod, MaskMod):
        mask_mod, mask_aux = mask_mod.fn, mask_mod.aux_tensors
        checks.check_aux_tensors(mask_aux, device, "mask_mod's aux_tensors")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a flashtile.BlockMask (from flashtile.create_block_mask), got "
                            f"{type(block_mask).__name__}")
        block_mask.check_call(batch, nheads, seqlen_q, seqlen_k, device)
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
            mask_aux = aux if aux_tensors is not None else block_mask.aux_tensors
        elif mask_mod is not block_mask.mask_mod:
            raise ValueError("mask_mod differs from the mask_mod block_mask was built with; pass block_mask alone "
                             "(it brings its mask_mod), or the same function")
    if mask_mod is not None and not is_jit_function(mask_mod):
        raise TypeError(f"mask_mod must be a @triton.jit function or None, got {type(mask_mod).__name__}")
    if score_mod is None and mask_mod is None:
        raise ValueError("aux_tensors were given without a score_mod or mask_mod to read them")
    only_score_mod = mask_mod is None and block_mask is None
    return Mods(score_mod, score_mod_bwd, mask_mod, score_aux, mask_aux, block_mask, bias,
                relative_bias_table=relative_bias_table if only_score_mod else None)
