"""Inference against a kv cache: ``flash_attn_with_kvcache`` (flash_attn 2.x semantics).

The call (1) rotates q and the new k when rotary tables are given, (2) writes the new k, v into the
cache in place at each sequence's ``cache_seqlens``, and (3) attends q to the cache. Step 3 is the
portable forward over each sequence's first cache_seqlens + seqlen_new keys: a plain contiguous
cache (batch_cache, seqlen_cache, hk, d) is read in its rows; with ``cache_batch_idx`` or
``cache_leftpad`` it is a pool of one page per sequence (``cache_batch_idx`` the block table); a
paged cache comes with its own ``block_table``. No step reads the device from the host.

Split-KV (flash-decoding): with few query blocks per sequence the keys of each sequence are spread
over ``num_splits`` programs and merged by their lse (kernels/combine.py); ``num_splits=0`` picks
the count from the shape and the GPU's multiprocessor count. With one query per sequence, the
query heads of a GQA group are processed as rows of their kv head, which is read once for all of
them; with 2-64 query rows, the group's heads share each tile (the forward's PACK_GQA). Steps 1
and 2 are one launch (kernels/kvcache_update.py).

The public function checks its arguments and calls the ``flashtile::kvcache_fwd`` custom op
(flashtile/ops.py), which declares that it writes k_cache and v_cache; the op's body is
:func:`kvcache_attention` below, so ``torch.compile`` traces the call without graph breaks. Eager
calls run the body without the op's layers (ops.kvcache_attention_call); launch plans
(kernels/plans.py) replay the update and forward launches of a call signature.
"""

from typing import Optional, Tuple

import torch

from . import call_plans, checks, dispatch, mod_ops, ops, sinks
from .mods import call_mods
from .options import resolve_options


def _check_cache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      block_table, batch: int) -> None:
    checks.check_tensor(q, "q", 4)
    checks.check_tensor(k_cache, "k_cache", 4)
    checks.check_tensor(v_cache, "v_cache", 4)
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens to append), or both left None")
    if k is not None:
        checks.check_tensor(k, "k", 4)
        checks.check_tensor(v, "v", 4)
        tensors.update(k=k, v=v)
    checks.check_same_dtype_and_device(tensors)
    checks.check_qkv_shapes(q[0], k_cache[0], v_cache[0], names=("q", "k_cache", "v_cache"))
    if k is not None:
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            expected = (batch, k.shape[1]) + tuple(cache.shape[2:])
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected (batch, seqlen_new, nheads_k, headdim) "
                                 f"= {expected}")
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens must be an int or an int32 tensor of shape ({batch},), got "
                             f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
        checks.check_unit_stride(cache_seqlens, "cache_seqlens")
    elif cache_seqlens is not None and (not isinstance(cache_seqlens, int) or cache_seqlens < 0):
        raise TypeError(f"cache_seqlens must be an int >= 0, an int32 tensor or None, got {cache_seqlens!r}")
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx picks rows of a contiguous cache; with block_table the table does")
        if cache_batch_idx.dtype != torch.int32 or tuple(cache_batch_idx.shape) != (batch,):
            raise ValueError(f"cache_batch_idx must be an int32 tensor of shape ({batch},), got "
                             f"{cache_batch_idx.dtype} {tuple(cache_batch_idx.shape)}")
        checks.check_unit_stride(cache_batch_idx, "cache_batch_idx")
    if block_table is None and cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache has {k_cache.shape[0]} rows but q has batch {batch}: pass cache_batch_idx "
                         "or a cache with a row per sequence")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        rotary_dim = 2 * rotary_cos.shape[-1]
        if rotary_cos.dim() != 2 or tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
            raise ValueError(f"rotary_cos and rotary_sin must both have shape (seqlen_ro, rotary_dim / 2), got "
                             f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if rotary_dim > q.shape[-1]:
            raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} exceeds the head dim {q.shape[-1]}")


@mod_ops.compiles_as_op
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[torch.Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False,
                            learnable_sink: Optional[torch.Tensor] = None, *, score_mod=None, mask_mod=None,
                            aux_tensors=None):
    """Attention of new queries against a kv cache, appending new keys and values first.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table a
            paged cache (num_blocks, page_block_size, nheads_k, headdim).
        k, v: optional (batch, seqlen_new, nheads_k, headdim): written into the cache in place at
            positions cache_seqlens[b] ... of sequence b (rotated first, with rotary tables).
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2): rotary embedding of the new k
            at positions cache_seqlens + t and of q at the same positions when causal or local,
            otherwise every query at position cache_seqlens. rotary_interleaved: pairs (0, 1), ...
            (True) or halves (False, GPT-NeoX).
        cache_seqlens: int or int32 (batch,): tokens already in each sequence's cache (default 0).
        cache_batch_idx: optional int32 (batch,): the cache row of each sequence (contiguous cache).
        cache_leftpad: optional int32 (batch,), contiguous caches only: sequence b's tokens start at
            position cache_leftpad[b] of its cache row (cache_seqlens[b] stays the end position).
        block_table: optional int32 (batch, max_blocks): the pages of each sequence (paged cache).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as flash_attn_func; causal and the
            window are aligned to each sequence's cache_seqlens + seqlen_new keys.
        num_splits: programs the keys of each sequence are split across (flash-decoding), merged
            by their logsumexp; 0 chooses from the shape and the GPU; 1 turns splitting off.
        return_softmax_lse: also return the logsumexp (batch, nheads, seqlen_q).
        learnable_sink: optional (nheads,) sink logits, as in flash_attn_func.
        score_mod, mask_mod, aux_tensors: as in flash_attn_func (no backward here: no score_mod_bwd;
            no block mask or attn_bias). The mods see raw positions: q_idx 0 .. seqlen_q - 1 for the
            queries, kv_idx 0 .. for the keys (from cache_leftpad on); query i sits at key position
            i + cache_seqlens[b] + seqlen_new - seqlen_q. (flashtile's extension.)
    The caller's contract (checked on CPU and with FLASHTILE_VALIDATE=1, before anything is
    written): the cache has room for the new tokens, cache_batch_idx and block_table point inside
    the cache, and the rotary tables cover every position rotated.
    Returns:
        out (batch, seqlen_q, nheads, headdim), and softmax_lse with return_softmax_lse.
    """
    programmable = not (score_mod is None and mask_mod is None and aux_tensors is None)
    key = None if programmable else call_plans.kvcache_key(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, learnable_sink)
    if key is not None and call_plans.replay_possible():
        step = call_plans.KVCACHE_STEPS.get(key)
        if step is not None:  # a call of this signature passed every check below
            out, lse = _run_step(step, q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin,
                                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink)
            return (out, lse) if return_softmax_lse else out
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        checks.check_tensor(q, "q", 4)
    batch, seqlen_q, nheads, head_dim = q.shape
    if cache_leftpad is not None:
        if block_table is not None:
            raise ValueError("cache_leftpad applies to contiguous caches; a paged cache's block_table starts "
                             "each sequence where its tokens start")
        if (not isinstance(cache_leftpad, torch.Tensor) or cache_leftpad.dtype != torch.int32
                or tuple(cache_leftpad.shape) != (batch,) or cache_leftpad.device != q.device):
            raise ValueError(f"cache_leftpad must be an int32 tensor of shape ({batch},) on {q.device}")
        checks.check_unit_stride(cache_leftpad, "cache_leftpad")
    if learnable_sink is not None:
        sinks.check_learnable_sink(learnable_sink, nheads, q.device)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic), got {num_splits!r}")
    _check_cache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      block_table, batch)
    if block_table is not None:
        checks.check_block_table(block_table, k_cache, batch, q.device)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        raise ValueError("flash_attn_with_kvcache serves inference: call it under torch.no_grad() or pass "
                         "tensors that do not require grad")
    mods = None
    if programmable:  # softcap as a built-in becomes the option; mods aligned to raw positions stay mods
        capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
        mods, softcap, alibi_slopes, causal, window_size = call_mods(
            score_mod, None, mask_mod, aux_tensors, None, softcap, alibi_slopes, batch, nheads, seqlen_q, capacity,
            False, q.device, causal=causal, window_size=window_size)
    # The window as two ints, read by the one parser of every entry point (any pair of int-likes). The
    # kernel's ints keep causal apart from the window (causal single-query decoding has its own path).
    window_left, window_right = checks.window_pair(window_size)
    alibi_slopes, _, (softmax_scale, softcap, _), _, _ = resolve_options(
        q, 0.0, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes).op_args()
    cache_seqlens = _seqlens_tensor(cache_seqlens, q)
    ints = [int(bool(causal)), window_left, window_right, int(bool(rotary_interleaved)), num_splits]
    extras = [rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink]
    if mods is not None:
        out, lse = mod_ops.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens, extras,
                                             [softmax_scale, softcap], ints, mods)
    elif key is not None and call_plans.may_keep(q.device):
        step = call_plans.KVCACHE_STEPS.put(key, dispatch.KVCacheStep(q, k_cache, v_cache, k, v, cache_seqlens, *extras,
                                                                      softmax_scale, softcap, *ints))
        out, lse = _run_step(step, q, k_cache, v_cache, k, v, cache_seqlens, *extras)
    else:
        out, lse = ops.kvcache_attention_call(q, k_cache, v_cache, k, v, cache_seqlens, extras,
                                              [softmax_scale, softcap], ints)
    return (out, lse) if return_softmax_lse else out


def _seqlens_tensor(cache_seqlens, q) -> torch.Tensor:
    """cache_seqlens as the int32 (batch,) tensor the kernels read (an int or None: every sequence)."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens
    return torch.full((q.shape[0],), cache_seqlens or 0, dtype=torch.int32, device=q.device)


def _run_step(step, q, k_cache, v_cache, k, v, cache_seqlens, *args) -> tuple:
    """A planned eager call: the step, then the caches marked as written (as the op marks them)."""
    result = step(q, k_cache, v_cache, k, v, _seqlens_tensor(cache_seqlens, q), *args)
    ops.mark_caches_written(k_cache, v_cache)
    return result
