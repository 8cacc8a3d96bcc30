"""Inference against a kv cache: ``flash_attn_with_kvcache`` (flash_attn 2.x semantics).

The call (1) rotates q and the new k when rotary tables are given, (2) writes the new k, v into the
cache in place at each sequence's ``cache_seqlens``, and (3) attends q to the cache. Step 3 is the
packed (varlen) forward over a paged cache: a contiguous cache (batch_cache, seqlen_cache, hk, d) is
a pool of one page per sequence, with ``cache_batch_idx`` as the block table; a paged cache comes
with its own ``block_table``. No step reads the device from the host.

Split-KV (flash-decoding): with few query blocks per sequence the keys of each sequence are spread
over ``num_splits`` programs and merged by their lse (kernels/combine.py); ``num_splits=0`` picks
the count from the shape and the GPU's multiprocessor count. With one query per sequence, the
query heads of a GQA group are processed as rows of their kv head, which is read once for all of
them. Steps 1 and 2 are one launch (kernels/kvcache_update.py).

The public function checks its arguments and calls the ``flashtile::kvcache_fwd`` custom op
(flashtile/ops.py), which declares that it writes k_cache and v_cache; the op's body is
:func:`kvcache_attention` below, so ``torch.compile`` traces the call without graph breaks. Eager
calls run the body without the op's layers (ops.kvcache_attention_call); launch plans
(kernels/plans.py) replay the update and forward launches of a call signature.
"""

import functools
from typing import Optional, Tuple

import torch

from . import checks, ops
from .configs import DECODE_MAX_ROWS
from .interface import _score_options
from .kernels.launch import PackedSeqs, ScoreParams, attention_forward, attention_forward_split, launch_kvcache_update
from .runtime import empty, multiprocessor_count, validate_enabled


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
        expected = (batch, k.shape[1]) + tuple(k_cache.shape[2:])
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected (batch, seqlen_new, nheads_k, headdim) "
                                 f"= {expected}")
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens must be an int or an int32 tensor of shape ({batch},), got "
                             f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    elif cache_seqlens is not None and (not isinstance(cache_seqlens, int) or cache_seqlens < 0):
        raise TypeError(f"cache_seqlens must be an int >= 0, an int32 tensor or None, got {cache_seqlens!r}")
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx picks rows of a contiguous cache; with block_table the table does")
        if cache_batch_idx.dtype != torch.int32 or tuple(cache_batch_idx.shape) != (batch,):
            raise ValueError(f"cache_batch_idx must be an int32 tensor of shape ({batch},), got "
                             f"{cache_batch_idx.dtype} {tuple(cache_batch_idx.shape)}")
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


def _validate_contents(cache_seqlens, seqlen_new, capacity, cache_batch_idx, rows, block_table, num_pages,
                       rotary_len, rotated_positions_end, cache_leftpad) -> None:
    """Checks that need the device's values (CPU tensors, or FLASHTILE_VALIDATE=1): run before the
    cache is written, so a bad call leaves it untouched."""
    lengths = cache_seqlens.cpu().long()
    if cache_leftpad is not None:
        pad = cache_leftpad.cpu().long()
        if ((pad < 0) | (pad > lengths)).any():
            at = int(((pad < 0) | (pad > lengths)).nonzero()[0])
            raise ValueError(f"cache_leftpad[{at}] = {pad[at].item()} is outside [0, cache_seqlens[{at}] = "
                             f"{lengths[at].item()}]")
    if (lengths < 0).any() or (lengths + seqlen_new > capacity).any():
        at = int(((lengths < 0) | (lengths + seqlen_new > capacity)).nonzero()[0])
        raise ValueError(f"cache_seqlens[{at}] = {lengths[at].item()} plus {seqlen_new} new tokens does not fit the "
                         f"cache's {capacity} positions per sequence")
    if cache_batch_idx is not None:
        idx = cache_batch_idx.cpu().long()
        if ((idx < 0) | (idx >= rows)).any():
            raise ValueError(f"cache_batch_idx holds {idx[(idx < 0) | (idx >= rows)][0].item()}, outside the "
                             f"{rows} rows of k_cache")
    if block_table is not None:
        checks.validate_block_table_pages(block_table.cpu().long(), lengths + seqlen_new,
                                          capacity // block_table.shape[1], num_pages, "k_cache")
    if rotary_len is not None and (lengths + rotated_positions_end).max().item() > rotary_len:
        raise ValueError(f"rotary_cos has {rotary_len} positions but the call rotates up to position "
                         f"{(lengths + rotated_positions_end).max().item() - 1}: the tables are too short")


# Programs per multiprocessor, on sm90: resident at once (the FWD_DECODE config takes 74 KB of
# shared memory, so 3 fit; the FWD config 1) and enough to saturate memory bandwidth (2 decode
# programs already read as fast as 3). Measured with bench/decode_probe.py on the H200.
_RESIDENT_PER_SM = {True: 3, False: 1}
_SATURATING_PER_SM = {True: 2, False: 1}


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments; decoding asks once per layer and token
def _auto_splits(batch: int, nheads: int, seqlen_q: int, max_seqlen_k: int, device: torch.device) -> int:
    """How many programs share the keys of one (sequence, head, query block) (flash-decoding).

    Decoding streams K and V: what counts is that every multiprocessor keeps reading until the end.
    A grid that fits at once reads at full speed once it has enough programs to saturate memory; a
    larger one runs in waves of resident programs, and a thin last wave idles most of the GPU (on
    the H200, 512 decode programs read 15% slower than 256 or 1024). Takes the fewest splits within
    5% of the best modelled efficiency, with at least 512 keys per split (fewer cost more than
    they gain: bench/decode_probe.py)."""
    if device.type != "cuda":
        return 1
    decode = seqlen_q <= DECODE_MAX_ROWS
    rows_per_program = 16 if decode else 128  # the FWD_DECODE / FWD query tiles
    programs = batch * nheads * -(-seqlen_q // rows_per_program)
    processors = multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    resident, saturating = processors * _RESIDENT_PER_SM[decode], processors * _SATURATING_PER_SM[decode]

    def efficiency(grid: int) -> float:
        if grid <= resident:
            return min(1.0, grid / saturating)
        return grid / (resident * -(-grid // resident))
    most = max(1, min(64, max_seqlen_k // 512))
    fill = {s: efficiency(programs * s) for s in range(1, most + 1)}
    best = max(fill.values())
    return min(s for s, f in fill.items() if f >= 0.95 * best)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[torch.Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
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
    The caller's contract (checked on CPU and with FLASHTILE_VALIDATE=1, before anything is
    written): the cache has room for the new tokens, cache_batch_idx and block_table point inside
    the cache, and the rotary tables cover every position rotated.
    Returns:
        out (batch, seqlen_q, nheads, headdim), and softmax_lse with return_softmax_lse.
    """
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
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic), got {num_splits!r}")
    _check_cache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      block_table, batch)
    if block_table is not None:
        checks.check_block_table(block_table, k_cache, batch, q.device)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        raise ValueError("flash_attn_with_kvcache serves inference: call it under torch.no_grad() or pass "
                         "tensors that do not require grad")
    # The window as two ints, read by the one parser of every entry point (any pair of int-likes). The
    # kernel's ints keep causal apart from the window (causal single-query decoding has its own path).
    window_left, window_right = checks.window_pair(window_size)
    alibi_slopes, _, (softmax_scale, softcap, _), _, _ = _score_options(
        q, 0.0, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes)
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens or 0, dtype=torch.int32, device=q.device)
    ints = [int(bool(causal)), window_left, window_right, int(bool(rotary_interleaved)), num_splits]
    extras = [rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes]
    out, lse = ops.kvcache_attention_call(q, k_cache, v_cache, k, v, cache_seqlens, extras, [softmax_scale, softcap],
                                          ints)
    return (out, lse) if return_softmax_lse else out


def kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                      cache_leftpad, block_table, alibi_slopes, softmax_scale: float, softcap: float, causal: int,
                      window_left: int, window_right: int, rotary_interleaved: int, num_splits: int):
    """The body of the ``flashtile::kvcache_fwd`` op (arguments checked, options resolved, cache_seqlens
    a tensor): check the contents (CPU, FLASHTILE_VALIDATE=1), write the cache, attend. (out, lse)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device
    seqlen_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if block_table is None:
        # A contiguous cache is a pool of one page per sequence. (Reading cache row b as plain rows,
        # without a table, read 3-12% slower than the paged path at most points on the H200.)
        rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(batch, dtype=torch.int32,
                                                                                 device=device)
        block_table = rows[:, None]
    local = causal or window_left >= 0 or window_right >= 0
    rotated_end = seqlen_new
    if rotary_cos is not None and local:
        rotated_end = max(seqlen_new, seqlen_q)
    if validate_enabled() or device.type == "cpu":
        _validate_contents(cache_seqlens, seqlen_new, capacity, cache_batch_idx, k_cache.shape[0],
                           block_table if paged else None, k_cache.shape[0],
                           None if rotary_cos is None else rotary_cos.shape[0], max(rotated_end, 1), cache_leftpad)

    q = launch_kvcache_update(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table,
                              bool(rotary_interleaved), bool(local))

    # Keys [cache_leftpad, cache_seqlens + seqlen_new) of each sequence.
    seqlens_k = cache_seqlens + seqlen_new if seqlen_new else cache_seqlens
    if cache_leftpad is not None:
        seqlens_k = seqlens_k - cache_leftpad
    if alibi_slopes is not None and alibi_slopes.stride(-1) != 1:
        alibi_slopes = alibi_slopes.contiguous()
    params = ScoreParams(softmax_scale=softmax_scale, softcap=softcap, window_left=window_left,
                         window_right=0 if causal else window_right, alibi_slopes=alibi_slopes)
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    # One query per sequence and GQA: the group's query heads become the rows of one kv head,
    # so each program reads that head's keys and values once for all of them. A single query
    # sees every key whether causal or not, so the rows need no mask between them. Rows are
    # strided views of q, out and lse: row g of kv head hk is query head hk * group + g.
    heads_as_rows = (seqlen_q == 1 and group > 1 and window_left < 0 and window_right < 0
                     and alibi_slopes is None)
    out = empty(q.shape, q.dtype, device)
    lse = empty((batch, nheads, seqlen_q), torch.float32, device)
    if heads_as_rows:
        params = ScoreParams(softmax_scale=softmax_scale, softcap=softcap)
        q_rows, out_rows = (t[:, 0].unflatten(1, (nheads_k, group)).transpose(1, 2) for t in (q, out))
        lse_rows = lse[:, :, 0].unflatten(1, (nheads_k, group))
    else:
        q_rows, out_rows, lse_rows = q, out, lse
    # The queries keep their (batch, rows) layout; the keys are read through the table of pages.
    seqs = PackedSeqs(None, None, q_rows.shape[1], capacity, seqused_k=seqlens_k, block_table=block_table,
                      key_shift=cache_leftpad)
    splits = num_splits or _auto_splits(batch, q_rows.shape[2], q_rows.shape[1], capacity, device)
    if splits > 1:
        attention_forward_split(q_rows, k_cache, v_cache, out_rows, lse_rows, params, seqs, splits)
    else:
        attention_forward(q_rows, k_cache, v_cache, out_rows, lse_rows, params, seqs)
    return out, lse
