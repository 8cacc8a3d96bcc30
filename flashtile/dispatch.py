"""The dispatcher: for each call, which kernels run (the Hopper Gluon kernels or the portable
Triton ones) and with which config, decided in one place (:func:`gluon_decision`; flashtile.explain
asks the same function), then launched through a plan kept per call signature (kernels/plans.py)
so that later calls skip the host work. Entry points: :func:`attention_forward`,
:func:`attention_forward_split`, :func:`attention_backward`, :func:`attention_probs` and
:func:`kvcache_attention` (flash_attn_with_kvcache's body, through :class:`KVCacheStep`); they
take tensors, a :class:`~flashtile.options.ScoreParams` and, for packed batches, a
:class:`~flashtile.options.PackedSeqs`.
"""

import dataclasses
import functools
import warnings
from typing import Callable, Optional, Tuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from . import autotune, checks
from .configs import (BWD_DKDV, BWD_DQ, BWD_GLUON, BWD_PREPROCESS, DECODE_MAX_ROWS, DECODE_PACKED_MAX_ROWS,
                      DECODE_ROUTE_KEYS_PER_ROW, DECODE_ROUTE_MAX_ROWS, FWD, PACKED_GQA_HOPPER_TILES_PER_SM,
                      FWD_DECODE, FWD_DECODE_PACKED, FWD_GLUON, GLUON_CANDIDATES, PORTABLE_CANDIDATES, Config,
                      get_config, overridden, packed_gqa_config, padded_head_dim, tile_head_dim)
from .kernels.hopper import status as hopper_status
from .kernels.hopper.tma import qkv_unsupported, tma_aligned, values_supported
from .kernels.plans import PlanCache, tensor_signature
from .kernels.plans import enabled as plans_enabled
from .kernels.portable.launch import (PortableBackward, PortableForward, SplitForward, forward_config, forward_kernel,
                                      kvcache_update_plan, launch_forward, launch_preprocess, portable_bwd_call,
                                      portable_bwd_tensors, row_stats_buffers)
from .kernels.portable import mods as builtin
from .kernels.portable.launch import attention_probs as portable_attention_probs
from .options import Mods, PackedSeqs, ScoreParams, grid_lengths
from .runtime import arch_of, capability_of, empty_allocator, multiprocessor_count, portable_only, validate_enabled


_gluon_fallback_warned = False


def reset_gluon_fallback_warning() -> None:
    """Let the next call that falls back for want of Gluon warn again (tests)."""
    global _gluon_fallback_warned
    _gluon_fallback_warned = False


def _warn_gluon_fallback(reason: str) -> None:
    # Once per process: every plan of every shape would take this path, and one warning says it.
    global _gluon_fallback_warned
    if _gluon_fallback_warned:
        return
    _gluon_fallback_warned = True
    warnings.warn(f"flashtile: Triton {triton.__version__} cannot run the Hopper (Gluon) kernels ({reason}); this "
                  "call and later ones run on the portable Triton kernels instead, which are slower. "
                  "`python -m flashtile.env` prints the details.", RuntimeWarning, stacklevel=3)


def _score_options(params: ScoreParams) -> list:
    """The names of the options on top of plain or causal attention that ``params`` sets (dropout aside)."""
    options = []
    if params.softcap > 0.0:
        options.append(f"softcap={params.softcap}")
    if params.alibi_slopes is not None:
        options.append("ALiBi (alibi_slopes)")
    if params.window_left >= 0 or params.window_right not in (-1, 0):
        options.append(f"a sliding window (window_size=({params.window_left}, {params.window_right}))")
    if params.mods is not None and params.mods.relative_bias_table is not None:
        options.append("a relative-position bias table (mods.relative_bias)")
    return options


def hopper_takes(kernel: str, params: ScoreParams, head_dim: int) -> bool:
    """Whether the Hopper kernel ``kernel`` computes these score options: anything but dropout (and a
    scale <= 0) and mods (but for a relative-bias table alone: mods.relative_bias; and at head dims 65 to
    128, attn_bias alone), except that the backward's head-dim-256 kernel (head dims
    above 128) takes no softcap, ALiBi, window or table."""
    if params.dropout_p > 0.0 or params.softmax_scale <= 0 or not _hopper_takes_mods(kernel, params, head_dim):
        return False
    return kernel == FWD_GLUON or padded_head_dim(head_dim) <= 128 or not _score_options(params)


def _hopper_takes_mods(kernel: str, params: ScoreParams, head_dim: int) -> bool:
    mods = params.mods
    if mods is None or mods.relative_bias_table is not None:
        return True
    # attn_bias alone, 16-bit, varying along the keys (one along the queries only changes no probability):
    # its tiles come through the kernels' TMA rings, or the consumers load them (kernels/hopper/forward.py,
    # backward.py). At head dim 64 the portable forward was the faster (docs/experiments.md), 256 is
    # unmeasured, and a float32 bias's tiles overflow shared memory. The backward writes the bias's
    # gradient: stored, added up over the batch and heads, or summed along the queries.
    bias = mods.attn_bias
    if (bias is None or mods.mask_mod is not None or mods.block_mask is not None or bias.read.shape[-1] == 1
            or bias.read.element_size() != 2 or padded_head_dim(head_dim) != 128):
        return False
    return kernel == FWD_GLUON or mods.dq_score_mod_bwd in (
        None, builtin.attn_bias_grad_store, builtin.attn_bias_grad, builtin.attn_bias_grad_sum_queries)


def _options_off_hopper(kernel: str, params: ScoreParams, head_dim: int) -> str:
    """Why ``params`` keeps off the Hopper kernel ``kernel``, in the user's terms (the rule itself is
    hopper_takes)."""
    if params.dropout_p > 0.0:
        return f"dropout (dropout_p={params.dropout_p}): the Hopper kernels take no dropout"
    if params.softmax_scale <= 0:
        return f"softmax_scale={params.softmax_scale} <= 0: the Hopper kernels take positive scales"
    if not _hopper_takes_mods(kernel, params, head_dim):
        return (f"{' and '.join(params.mods.names())}: the Hopper kernels take no user mods (the portable ones do; "
                "the Hopper kernels take mods.relative_bias alone, and attn_bias alone: float16 or bfloat16, "
                "varying along the keys, at head dims 65 to 128)")
    return (f"{' and '.join(_score_options(params))} at head dim {head_dim}: the Hopper backward takes score "
            "options at head dims up to 128 (its head-dim-256 kernel takes plain or causal attention only)")


def gluon_decision(kernel: str, q, k, v, params: ScoreParams, seqs: Optional[PackedSeqs] = None, *,
                   deterministic: bool = False, device_capability: Optional[tuple] = None,
                   warn: bool = True) -> Tuple[Optional[Config], str]:
    """(config, reason): the config of the Hopper Gluon kernel ``kernel`` (FWD_GLUON or BWD_GLUON)
    when it serves this call, else None (the call runs on the portable Triton kernels), and why, in
    the user's terms. The one place the rules live: the launch path (gluon_config) and
    flashtile.explain both ask it.

    ``deterministic``: the backward's flag (BWD_GLUON only). ``device_capability``: (major, minor)
    of a hypothetical CUDA device to decide for in place of q's (flashtile.explain on CPU; never
    the launch path). ``warn``: when the call would take the Hopper path but this Triton cannot
    run the Gluon kernels, warn once per process (RuntimeWarning) that it falls back.
    """
    if device_capability is None:
        if q.device.type != "cuda":
            return None, f"q is on {q.device.type}, not a CUDA tensor"
        device_capability = capability_of(q.device)
    major, minor = device_capability
    arch = f"sm{major}{minor}"
    if (major, minor) != (9, 0):
        return None, f"the GPU is {arch} (compute capability {major}.{minor}); the Hopper kernels need sm90"
    if portable_only():
        return None, "FLASHTILE_PORTABLE=1 keeps every call on the portable kernels"
    if kernel == BWD_GLUON and deterministic:
        return None, ("deterministic=True: the Hopper backward adds dQ up with float32 atomics in no fixed "
                      "order; the portable backward sums every gradient in a fixed order")
    if not hopper_takes(kernel, params, q.shape[-1]):
        return None, _options_off_hopper(kernel, params, q.shape[-1])
    if kernel == BWD_GLUON and not values_supported(q.shape[-1], v.shape[-1]):
        return None, (f"v has head dim {v.shape[-1]} and q has {q.shape[-1]}: the Hopper backward takes a value head "
                      "dim of its own no wider than q's tiles with q, k head dims up to 128, and of 65 or more with "
                      "q, k head dims above 128 (the portable one takes any)")
    # A kv cache's dense rows (no prefix sums on either side, seqused_k) run on the forward.
    cache_rows = (kernel == FWD_GLUON and seqs is not None and seqs.cu_seqlens_q is None
                  and seqs.cu_seqlens_k is None and seqs.seqused_k is not None and seqs.seqused_q is None)
    if cache_rows and params.mods is not None:
        # Verified on the GPU without them; with them the cache's step keeps the portable kernels.
        return None, "a kv cache's rows with mods: the portable kernels"
    if seqs is not None and (seqs.cu_seqlens_q is None or seqs.cu_seqlens_k is None) and not cache_rows:
        return None, "a side without cu_seqlens (the decode layout): the Hopper kernels read packed sequences only"
    if seqs is not None and kernel == BWD_GLUON and (seqs.seqused_k is not None or seqs.seqused_q is not None):
        # The Gluon backward reads whole tiles past a sequence's end and masks them; slots past
        # seqused may hold anything, and it adds them into dK and dV (P^T dO, dS^T Q with a zero P,
        # dS; NaN * 0 is NaN). The portable backward does not load them. (The forward zeroes V's
        # rows past seqused_k and selects unused query rows away.)
        used = "seqused_k" if seqs.seqused_k is not None else "seqused_q"
        return None, (f"{used} is set: the Hopper backward reads whole tiles past each sequence's used tokens, "
                      "which may hold anything")
    tensors_reason = qkv_unsupported(q, k, v, paged=seqs is not None and seqs.paged)
    if tensors_reason is not None:
        return None, tensors_reason
    portable = (FWD, FWD_DECODE, FWD_DECODE_PACKED) if kernel == FWD_GLUON else (BWD_DKDV, BWD_DQ)
    if any(overridden(name) for name in portable) and not overridden(kernel):
        overrides = ", ".join(name for name in portable if overridden(name))
        return None, f"an explicit portable config is set (configs.override of {overrides})"
    _, _, max_seqlen_k = grid_lengths(q, k, seqs)
    cfg = get_config(kernel, arch, tile_head_dim(q, v), *_table_mask(params, max_seqlen_k), q.dtype,
                     varlen=seqs is not None and not cache_rows)
    direction = "forward" if kernel == FWD_GLUON else "backward"
    mask = "causal" if params.causal else "full"
    if params.window_left >= 0 or params.window_right not in (-1, 0):
        mask = f"sliding window ({params.window_left}, {params.window_right})"
    mods = [name for on, name in ((params.softcap > 0, "softcap"), (params.alibi_slopes is not None, "ALiBi")) if on]
    if mods:
        mask += " with " + " and ".join(mods)
    if cfg is None:
        layout = "packed" if seqs is not None else "dense"
        return None, (f"the {arch} config table has no Hopper {direction} for head dim {q.shape[-1]}, {mask}, "
                      f"{max_seqlen_k} keys, {layout} batches: the portable kernels serve these")
    if kernel == FWD_GLUON and not pages_fit(seqs, k, cfg.block_n):  # (paged calls have no backward)
        return None, (f"paged KV (block_table) with pages of {k.shape[1]} keys: the Hopper forward reads whole "
                      f"{cfg.block_n}-key blocks, so it takes pages of a multiple of {cfg.block_n} keys (or one page "
                      "per sequence)")
    available, why = hopper_status.gluon_status()
    if not available:
        if warn:
            _warn_gluon_fallback(why)
        return None, f"the Gluon kernels are unavailable on Triton {triton.__version__}: {why}"
    return cfg, (f"{arch}, {str(q.dtype).replace('torch.', '')}, head dim {q.shape[-1]}, {mask} attention: "
                 f"the Hopper Gluon {direction}")


def pages_fit(seqs: Optional[PackedSeqs], k, block_n: int) -> bool:
    """Whether the Hopper forward reads this call's keys in block_n-key blocks: no table of pages, or pages of a
    multiple of block_n keys (a block never spans two; k is then the paged cache), or one page per sequence (a
    contiguous cache's rows, picked by cache_batch_idx or left-padded)."""
    if seqs is None or not seqs.paged:
        return True
    return seqs.block_table.shape[1] == 1 or (k.shape[1] % block_n == 0 and seqs.key_shift is None)


def _table_mask(params: ScoreParams, max_seqlen_k: int) -> Tuple[bool, int]:
    """(causal, keys) to look the Hopper tables up with: a sliding window's keys are the most a row
    sees (its band, at most max_seqlen_k), and a window bounded on both sides takes the causal
    configs (small tiles, several CTAs per SM at short keys): its tiles' work is a band too."""
    left, right = params.window_left, params.window_right
    if left < 0 and right in (-1, 0):
        return params.causal, max_seqlen_k
    if left < 0 or right < 0:
        return False, max_seqlen_k
    return True, max(1, min(left + right + 1, max_seqlen_k))


def gluon_config(kernel: str, q, k, v, params: ScoreParams, seqs: Optional[PackedSeqs] = None,
                 deterministic: bool = False) -> Optional[Config]:
    """The config of a Hopper Gluon kernel (FWD_GLUON or BWD_GLUON) when it serves this
    call, else None: the call runs on the portable Triton kernels (see gluon_decision)."""
    return gluon_decision(kernel, q, k, v, params, seqs, deterministic=deterministic)[0]


def attention_forward(q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs] = None) -> Optional[Callable]:
    """out (b, sq, h, d) <- attention; lse (b, h, sq) float32 <- natural-log logsumexp.
    Packed batches: (1, total, h, d) views, lse (1, h, total_q), and ``seqs``. Returns the plan that
    ran, which later calls of this signature may run directly (None: nothing to launch)."""
    if out.numel() == 0:
        return None
    if params.mods is not None:  # no plan is kept: the mods' tensors are bound into the launch
        if decode_route(q, k, params, seqs) is not None:
            _forward_plan(q, k, v, out, lse, params, seqs)(q, k, v, out, lse, params, seqs)
            return None
        gluon_cfg = _gluon_forward_config(q, k, v, out, params, seqs)
        if gluon_cfg is not None:  # a relative-bias table alone
            _gluon_forward_plan(q, k, v, out, lse, params, seqs, gluon_cfg)(q, k, v, out, lse, params, seqs)
            return None
        _, _, max_seqlen_k = grid_lengths(q, k, seqs)
        cfg = forward_config(forward_kernel(q, k, seqs), q, v, params, max_seqlen_k, seqs)
        _within_resources(lambda c: launch_forward(q, k, v, out, lse, params, c, seqs), cfg)
        return None
    plan = _FORWARD_PLANS.get_or_make(_plan_key(params, seqs, q, k, v, out, lse),
                                      lambda: _forward_plan(q, k, v, out, lse, params, seqs))
    plan(q, k, v, out, lse, params, seqs)
    return plan


def decode_route(q, k, params: ScoreParams, seqs: Optional[PackedSeqs]) -> Optional[str]:
    """Why a call runs as decoding (DecodeForward), or None. The rule: at most DECODE_MAX_ROWS query
    rows per sequence (decoding, speculative decoding), or up to DECODE_ROUTE_MAX_ROWS against at least
    DECODE_ROUTE_KEYS_PER_ROW keys per row (a short chunk of a long context), dense or packed, keys
    present, no dropout, no block mask (its lists follow its own tiles, not the decode kernel's). Such
    calls spend their time streaming K and V, which the Hopper kernel reads once per query head into a
    128-row tile at most half full and with one program per (sequence, head); the decode kernels share
    each K/V tile among a GQA group's heads and split the keys until every multiprocessor reads. Score
    and mask mods keep each query head on its own rows (a mod sees query heads)."""
    if params.dropout_p > 0.0 or k.shape[1] == 0 or (params.mods is not None and params.mods.block_mask is not None):
        return None
    if seqs is None:
        rows, keys = q.shape[1], k.shape[1]
    elif seqs.cu_seqlens_q is None or seqs.seqused_q is not None:
        return None  # kv caches take this path through kvcache_attention already
    else:
        rows, keys = seqs.max_seqlen_q, seqs.max_seqlen_k
    if rows < 1 or rows > DECODE_ROUTE_MAX_ROWS:
        return None
    if rows <= DECODE_MAX_ROWS:
        why = f"at most {DECODE_MAX_ROWS}"
    elif keys >= DECODE_ROUTE_KEYS_PER_ROW * rows:
        why = f"at most {DECODE_ROUTE_MAX_ROWS}, against {keys} keys"
    else:
        return None
    return (f"{rows} query row{'s' * (rows > 1)} per sequence ({why}): the decode kernels, "
            "split-KV" + (", GQA heads as rows" if _rows_from_heads(q, k, params, seqs) else ""))


def options_allow_heads_as_rows(params: ScoreParams) -> bool:
    """Whether a call's options let the query heads of a GQA group run as the rows of their kv head
    (given one query per sequence, which sees every key whatever the right side of the window): no
    left window, no ALiBi and no learnable sink (the kernels read both per head, not per row), and no
    score or mask mods (they see query heads and rows)."""
    return (params.window_left < 0 and params.alibi_slopes is None and params.learnable_sink is None
            and params.mods is None)


def _rows_from_heads(q, k, params: ScoreParams, seqs: Optional[PackedSeqs]) -> bool:
    """Whether the query heads of each GQA group can run as the rows of their kv head: one query per
    sequence and options that allow it (options_allow_heads_as_rows). Packed calls qualify when every
    sequence has exactly one query (total rows == sequences, each at most one)."""
    if q.shape[2] == k.shape[2] or not options_allow_heads_as_rows(params):
        return False
    if seqs is None:
        return q.shape[1] == 1
    return seqs.max_seqlen_q == 1 and q.shape[1] == seqs.batch


def decode_kernel(q, k, params: ScoreParams, seqs: Optional[PackedSeqs]) -> Tuple[str, bool]:
    """(config family, pack_gqa) of a decode-shaped call: with several query rows and GQA (no ALiBi)
    the group's heads share tiles (the kernel's PACK_GQA); the decode tile (16 rows) while the rows
    fit one, the packed decode tile (64 rows) while they fit that (16 rows x 4 heads: one tile, not
    four), above it the prefill tile or several 64-row ones (_packed_rows_on_64_row_tiles). One query
    with its group's heads as rows: a tile of the group."""
    rows = q.shape[1] if seqs is None else seqs.max_seqlen_q
    group = q.shape[2] // k.shape[2]
    as_rows = _rows_from_heads(q, k, params, seqs)
    pack = not as_rows and group > 1 and params.alibi_slopes is None and params.mods is None
    # Heads as rows is one query per sequence with the group's heads sharing its tile.
    heads, tile_rows = decode_tile(rows, q.shape[2], k.shape[2], as_rows or pack)
    family = _decode_family(tile_rows)
    batch = grid_lengths(q, k, seqs)[0]
    if family == FWD and pack and _packed_rows_on_64_row_tiles(
            tile_rows, _family_programs(batch * heads, tile_rows, FWD), q.shape[-1], k.device):
        family = FWD_DECODE_PACKED
    return family, pack


def decode_tile(rows: int, nheads: int, nheads_k: int, pack: bool) -> Tuple[int, int]:
    """(heads in the grid, rows per tile) of a decode-shaped launch of ``rows`` query rows per
    sequence: with the query heads of a GQA group sharing tiles (pack), a tile per kv head holds
    every row of every head of its group; otherwise a tile per query head holds that head's rows."""
    return (nheads_k, rows * (nheads // nheads_k)) if pack else (nheads, rows)


# The query rows of one program of each decode-shaped family's tile, as _auto_splits counts them.
_FAMILY_ROWS = {FWD_DECODE: DECODE_MAX_ROWS, FWD_DECODE_PACKED: DECODE_PACKED_MAX_ROWS, FWD: 128}


def _family_programs(tiles: int, tile_rows: int, family: str) -> int:
    """Programs of a decode-shaped grid of ``tiles`` (sequence, head) tiles of ``tile_rows`` rows on
    ``family``'s query tile (before splitting the keys)."""
    return max(1, tiles * -(-tile_rows // _FAMILY_ROWS[family]))


def _decode_family(tile_rows: int) -> str:
    """The config family whose query tile takes a call of this many rows per tile (packed GQA rows
    counted): the decode tiles for few, the prefill tile above."""
    if tile_rows <= DECODE_MAX_ROWS:
        return FWD_DECODE
    return FWD_DECODE_PACKED if tile_rows <= DECODE_PACKED_MAX_ROWS else FWD


def _packed_rows_on_64_row_tiles(tile_rows: int, programs_of_128: int, head_dim: int, device: torch.device) -> bool:
    """Whether packed GQA rows above 64 per kv head go to 64-row tiles (FWD_DECODE_PACKED) rather than
    128-row ones (FWD): where those hold them with fewer empty rows (136 rows: three tiles of 64, 192
    rows, not two of 128, 256) and the call waits on its reads rather than its matmuls: head dims up
    to 64, or a grid of at most a fifth as many 128-row programs as multiprocessors (at head dim 128
    grids of a quarter to a half ran faster on the prefill tile; docs/experiments.md, 2026-12-02)."""
    def held(family: str) -> int:
        return -(-tile_rows // _FAMILY_ROWS[family]) * _FAMILY_ROWS[family]
    if held(FWD_DECODE_PACKED) >= held(FWD):
        return False
    if head_dim <= 64:
        return True
    return device.type == "cuda" and 5 * programs_of_128 <= multiprocessor_count(
        device.index if device.index is not None else torch.cuda.current_device())


def packed_gqa_tiles(q, k, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs], block_m: int = 1) -> int:
    """The block_m-row tiles of a decode-shaped call (decode_route) run on the Hopper forward with each GQA
    group's query heads packed as rows (kernels/hopper/launch.GluonForward's query_group), or 0 where it cannot run
    so: calls of 2 or more rows per sequence whose group is a power of two up to 64, packing into more than
    DECODE_PACKED_MAX_ROWS rows per kv head and at least one whole tile, with no per-head options (ALiBi,
    sinks, mods) and contiguous out (TMA-aligned) and lse (None: not known yet, flashtile.explain). Packed
    batches count the grid's tiles (every sequence as long as the longest) and need both prefix sums (or
    neither: a kv cache's rows with seqused_k) and no seqused_q; pages must fit the config's key blocks
    (pages_fit). The default block_m asks only whether the call qualifies before a config is looked up."""
    if any(t is not None and not t.is_contiguous() for t in (out, lse)) or (out is not None and not tma_aligned(out)):
        return 0
    if seqs is not None and (seqs.seqused_q is not None
                             or (seqs.cu_seqlens_q is None) != (seqs.cu_seqlens_k is None)
                             or (seqs.cu_seqlens_q is None and seqs.seqused_k is None)):
        return 0
    batch, rows, nheads, _ = q.shape  # packed batches: (1, total, h, d)
    if seqs is not None:
        batch, rows = seqs.batch, seqs.max_seqlen_q
    group = nheads // k.shape[2]
    if rows < 2:
        return 0
    if group < 2 or group > 64 or group & (group - 1) or rows * group <= max(DECODE_PACKED_MAX_ROWS, block_m - 1):
        return 0
    if params.alibi_slopes is not None or params.learnable_sink is not None or params.mods is not None:
        return 0
    return batch * k.shape[2] * -(-rows * group // block_m)


def packed_gqa_on_hopper(q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs]) -> Optional[Config]:
    """The Hopper forward's config for a decode-shaped call that runs there with its GQA groups packed as
    rows (packed_gqa_tiles), else None: where its tiles number at least PACKED_GQA_HOPPER_TILES_PER_SM per
    multiprocessor, the decode kernels' work is matmuls on full tiles, which the Hopper kernel does
    faster, and split-KV has little left to fill."""
    if q.device.type != "cuda" or packed_gqa_tiles(q, k, out, lse, params, seqs) == 0:
        return None
    cfg = gluon_config(FWD_GLUON, q, k, v, params, seqs)
    if cfg is None:
        return None
    cfg = packed_gqa_config(arch_of(q.device), padded_head_dim(q.shape[-1]), cfg)
    if not pages_fit(seqs, k, cfg.block_n):
        return None
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    tiles = packed_gqa_tiles(q, k, out, lse, params, seqs, cfg.block_m)
    return cfg if tiles > 0 and tiles >= PACKED_GQA_HOPPER_TILES_PER_SM * multiprocessor_count(device) else None


def heads_as_rows(q, out, lse, nheads_k: int) -> tuple:
    """(q, out, lse) of a call of one query per sequence, (b, 1, h, d) and (b, h, 1), as views whose
    rows are the query heads of one kv head: (b, group, hk, d) and (b, hk, group). Row g of kv head
    hk is query head hk * group + g. The views start where the tensors do (same data pointers)."""
    group = q.shape[2] // nheads_k
    q_rows, out_rows = (t[:, 0].unflatten(1, (nheads_k, group)).transpose(1, 2) for t in (q, out))
    return q_rows, out_rows, lse[:, :, 0].unflatten(1, (nheads_k, group))


class DecodeForward:
    """attention_forward for a decode-shaped call (decode_route) of one signature: the portable
    forward with the decode config, split-KV with the count _auto_splits picks, the query heads of
    a GQA group sharing tiles (one query: as the rows of a view; more: the kernel's PACK_GQA). A
    dense call runs as a batch of sequences of (rows, keys); a packed call of one query per
    sequence sees its queries as a (batch, 1, h, d) tensor and keeps its packed keys
    (cu_seqlens_k); other packed calls keep their layout. The inner plans are built on views that
    start where the tensors do, so later calls pass the tensors themselves."""

    def __init__(self, q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs], num_splits: int = 0,
                 cfg: Optional[Config] = None):
        """cfg: the decode config (None: the table's; self.cfg is the one used)."""
        self.as_rows = _rows_from_heads(q, k, params, seqs)
        kernel, pack = decode_kernel(q, k, params, seqs)
        self.one_query_each = seqs is not None and seqs.max_seqlen_q == 1 and q.shape[1] == seqs.batch
        if self.one_query_each:  # (1, total = batch, h, d) -> (batch, 1, h, d); lse (1, h, total) -> (batch, h, 1)
            # (as rows, a kv head's query heads then lie `total` floats apart: the kernels' stride_lse_r)
            q, out, lse = q[0][:, None], out[0][:, None], lse[0].t()[:, :, None]
        if self.as_rows:
            q, out, lse = heads_as_rows(q, out, lse, k.shape[2])
            params = ScoreParams(softmax_scale=params.softmax_scale, softcap=params.softcap)
        if seqs is None or self.one_query_each:
            max_seqlen_k = k.shape[1] if seqs is None else seqs.max_seqlen_k
            self.seqs = PackedSeqs(None, None if seqs is None else seqs.cu_seqlens_k, q.shape[1], max_seqlen_k,
                                   seqused_k=None if seqs is None else seqs.seqused_k,
                                   block_table=None if seqs is None else seqs.block_table, dense_batch=q.shape[0])
        else:
            self.seqs = seqs
        batch, rows, max_seqlen_k = grid_lengths(q, k, self.seqs)
        heads, tile_rows = decode_tile(rows, q.shape[2], k.shape[2], pack)
        splits = num_splits or _auto_splits(batch, heads, tile_rows, max_seqlen_k, tile_head_dim(q, v), q.device,
                                            kernel)
        if cfg is None:
            cfg = forward_config(kernel, q, v, params, max_seqlen_k, self.seqs)
        self.params, self.cfg = params, cfg
        if splits > 1:
            self.plan = SplitForward(q, k, v, out, lse, params, self.seqs, splits, cfg, pack_gqa=pack)
        else:
            self.plan = PortableForward(q, k, v, out, lse, params, cfg, self.seqs, pack_gqa=pack)

    def __call__(self, q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs] = None):
        decode_seqs = self.seqs
        if self.one_query_each:  # this call's key prefix sums, used lengths and pages
            decode_seqs = PackedSeqs(None, seqs.cu_seqlens_k, 1, self.seqs.max_seqlen_k, seqused_k=seqs.seqused_k,
                                     block_table=seqs.block_table, dense_batch=self.seqs.dense_batch)
        elif seqs is not None:
            decode_seqs = seqs
        # The views start at the tensors' data pointers, which is all a launch reads of them. The
        # options are this call's (the plan key holds their values; the ALiBi slopes are a tensor).
        self.plan(q, k, v, out, lse, self.params if self.as_rows else params, decode_seqs)


def _forward_plan(q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs]) -> Callable:
    """The launch of attention_forward for this call's signature (configs chosen, autotuned if
    asked): a callable taking (q, k, v, out, lse, params, seqs)."""
    if decode_route(q, k, params, seqs) is not None:
        packed_cfg = packed_gqa_on_hopper(q, k, v, out, lse, params, seqs)
        if packed_cfg is not None:
            from .kernels.hopper.launch import GluonForward

            return GluonForward(q, k, v, out, lse, params, packed_cfg, seqs, query_group=q.shape[2] // k.shape[2])
        table_plan = DecodeForward(q, k, v, out, lse, params, seqs)
        return _FittedPlan(lambda c: table_plan if c is table_plan.cfg else
                           DecodeForward(q, k, v, out, lse, params, seqs, cfg=c), table_plan.cfg)
    _, _, max_seqlen_k = grid_lengths(q, k, seqs)
    gluon_cfg = _gluon_forward_config(q, k, v, out, params, seqs)
    if gluon_cfg is not None:
        cfg = _tuned(FWD_GLUON, q, v, params, max_seqlen_k, gluon_cfg, GLUON_CANDIDATES[FWD_GLUON],
                     lambda c: _gluon_forward_plan(q, k, v, out, lse, params, seqs, c)(q, k, v, out, lse, params, seqs))
        return _gluon_forward_plan(q, k, v, out, lse, params, seqs, cfg)
    kernel = forward_kernel(q, k, seqs)
    cfg = forward_config(kernel, q, v, params, max_seqlen_k, seqs)
    cfg = _tuned(kernel, q, v, params, max_seqlen_k, cfg, PORTABLE_CANDIDATES[kernel],
                 lambda c: launch_forward(q, k, v, out, lse, params, c, seqs))
    return _FittedPlan(lambda c: PortableForward(q, k, v, out, lse, params, c, seqs), cfg)


def _gluon_forward_config(q, k, v, out, params: ScoreParams, seqs: Optional[PackedSeqs]) -> Optional[Config]:
    """The Hopper forward's config for this call, or None (a packed call's out must be TMA-aligned too; a kv
    cache's step of at most DECODE_MAX_ROWS rows per sequence stays on the decode kernels, whose tiles it fills)."""
    if seqs is not None and seqs.cu_seqlens_q is None and seqs.max_seqlen_q <= DECODE_MAX_ROWS:
        return None
    cfg = gluon_config(FWD_GLUON, q, k, v, params, seqs)
    return cfg if cfg is not None and (seqs is None or tma_aligned(out)) else None


def _gluon_forward_plan(q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs], cfg) -> Callable:
    from .kernels.hopper.launch import GluonForward

    return GluonForward(q, k, v, out, lse, params, cfg, seqs)


class _FittedPlan:
    """A plan made from a config on its first call, shrunk until its kernels fit the GPU's shared
    memory (_within_resources): the tables' tiles are sized for 16-bit inputs, and float32 ones
    (or a wider value head dim) may need twice the room. Later calls run the plan that fitted.

    ``make`` closes over the first call's tensors; it is dropped once the plan fits, or a cached
    plan would keep them (a decoding step's whole K and V) alive as long as it stays cached."""

    def __init__(self, make: Callable, cfg: Config):
        self.make, self.cfg, self.plan = make, cfg, None

    def __call__(self, *args):
        if self.plan is not None:
            return self.plan(*args)

        def first(cfg):
            plan = self.make(cfg)
            plan(*args)
            return plan
        self.plan = _within_resources(first, self.cfg)
        self.make = None
        return None


# Plans by call signature (kernels/plans.py): dense and packed calls of the forward, the split
# forward, the backward, and the kv-cache update.
_FORWARD_PLANS = PlanCache()


_BACKWARD_PLANS = PlanCache()


_SPLIT_FORWARD_PLANS = PlanCache()


def _plan_key(params: ScoreParams, seqs: Optional[PackedSeqs], *tensors) -> Optional[tuple]:
    """The plan-cache key of a call on these tensors, or None when no plan may serve it (CPU calls;
    plans.enabled() false). It holds all that the long way reads on the host: the score options,
    every tensor's signature (shape, strides, dtype, 16-byte alignment; the ALiBi slopes, the
    dropout seed and the packed batch's tensors included) and the packed batch's host lengths.
    Never the tensors' contents: a plan serves any sequence lengths under the same maxima. Calls
    with score or mask mods keep no plan: their aux tensors are bound into the launch."""
    q = tensors[0]
    if not q.is_cuda or not plans_enabled() or params.mods is not None:
        return None
    key = (q.device, portable_only(), params.softmax_scale, params.softcap, params.window_left, params.window_right,
           params.dropout_p, tensor_signature(params.alibi_slopes), tensor_signature(params.dropout_seed),
           tensor_signature(params.learnable_sink), *(tensor_signature(t) for t in tensors))
    if seqs is not None:
        key += (seqs.max_seqlen_q, seqs.max_seqlen_k,
                *(tensor_signature(t) for t in (seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_q,
                                                seqs.seqused_k, seqs.block_table, seqs.key_shift)))
    return key


def _tuned(kernel: str, q, v, params: ScoreParams, seqlen_k: int, cfg: Config, candidates: dict,
           run: Callable[[Config], None]) -> Config:
    """``cfg`` (the table's), or with FLASHTILE_AUTOTUNE=1 the fastest of it and ``candidates``
    (per padded head dim) for this shape class, timed through ``run`` once and remembered on
    disk (flashtile/autotune.py). Never replaces a config given with override()."""
    if not autotune.enabled() or q.device.type != "cuda" or overridden(kernel):
        return cfg
    head_dim = tile_head_dim(q, v)
    options = candidates.get(padded_head_dim(head_dim), {})
    options = list(options.values()) if isinstance(options, dict) else list(options)
    key = autotune.shape_key(kernel, q.device, arch_of(q.device), head_dim, params.causal, seqlen_k, q.dtype)
    return autotune.choose(key, [cfg, *options], run)


def attention_forward_split(q, k, v, out, lse, params: ScoreParams, seqs: PackedSeqs, num_splits: int,
                            pack_gqa: bool = False, family: Optional[str] = None) -> Optional[Callable]:
    """:func:`attention_forward` with the keys of each sequence split across ``num_splits`` programs
    per query block (flash-decoding: a few long sequences with few queries fill the GPU), their
    partial results merged by the combine kernel. Packed batches, portable kernels. ``pack_gqa``:
    the query heads of a GQA group share tiles (decode_kernel's choice; its config family). Returns
    the plan that ran (None: nothing to launch)."""
    if out.numel() == 0:
        return None
    plan_key = _plan_key(params, seqs, q, k, v, out, lse)

    def make():
        kernel = family or _decode_family(decode_tile(seqs.max_seqlen_q, q.shape[2], k.shape[2], pack_gqa)[1])
        cfg = forward_config(kernel, q, v, params, seqs.max_seqlen_k, seqs)
        table_plan = SplitForward(q, k, v, out, lse, params, seqs, num_splits, cfg, pack_gqa=pack_gqa)
        return _FittedPlan(lambda c: table_plan if c is table_plan.cfg else
                           SplitForward(q, k, v, out, lse, params, seqs, num_splits, c, pack_gqa=pack_gqa),
                           table_plan.cfg)
    plan = _SPLIT_FORWARD_PLANS.get_or_make(None if plan_key is None else (num_splits, pack_gqa, *plan_key), make)
    plan(q, k, v, out, lse, params, seqs)
    return plan


def attention_probs(q, k, lse, params: ScoreParams, dtype: torch.dtype,
                    seqs: Optional[PackedSeqs] = None) -> torch.Tensor:
    """The (b, h, sq, sk) probabilities of the attention whose forward gave ``lse`` (return_attn_probs;
    kernels/portable/launch.attention_probs), on the forward table's tiles shrunk until they fit."""
    _, _, max_seqlen_k = grid_lengths(q, k, seqs)
    cfg = get_config(FWD, arch_of(q.device), q.shape[3], params.causal, max_seqlen_k, q.dtype)
    return _within_resources(lambda c: portable_attention_probs(q, k, lse, params, dtype, seqs, c), cfg)


def attention_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams,
                       deterministic: bool = False, seqs: Optional[PackedSeqs] = None,
                       dsink: Optional[torch.Tensor] = None) -> Optional[Callable]:
    """dq, dk, dv <- gradients of the attention whose forward gave ``out`` and ``lse``; with a
    learnable sink (params), dsink (float32, (nheads,)) <- its gradient.

    On sm90 the Gluon backward serves plain (full or causal) attention unless
    ``deterministic``: it adds dQ up across key blocks with float32 reductions. Packed batches
    take it too, except with seqused_q / seqused_k (see gluon_config). The portable path
    (preprocess, dK/dV, dQ kernels) sums every gradient in a fixed order.
    Packed batches: as :func:`attention_forward`; dk / dv rows of tokens past seqused_k
    are not written (the caller zero-fills them). Returns the plan when one plan did all of it on
    these very tensors (later calls of this signature may run it directly), else None.
    """
    if dsink is not None and dq.numel() == 0:
        dsink.zero_()  # no query row: the sink's gradient is an empty sum
    if dq.numel() == 0 and dk.numel() == 0:
        return None
    if dq.numel() == 0 or q.shape[1] == 0:
        # No query attends: the keys and values got no gradient.
        dk.zero_()
        dv.zero_()
        return None
    plan_key = _plan_key(params, seqs, q, k, v, out, dout, lse, dq, dk, dv)
    if plan_key is not None:
        plan_key = (deterministic, *plan_key)
        plan = _BACKWARD_PLANS.get(plan_key)
        if plan is not None:
            plan(q, k, v, out, dout, lse, dq, dk, dv, params, seqs, dsink=dsink)
            return plan
    arch = arch_of(q.device)
    head_dim = tile_head_dim(q, v)
    max_seqlen_k = grid_lengths(q, k, seqs)[2]
    pre_cfg = get_config(BWD_PREPROCESS, arch, head_dim, params.causal, max_seqlen_k, q.dtype)
    gluon_cfg = gluon_config(BWD_GLUON, q, k, v, params, seqs, deterministic=deterministic)
    if gluon_cfg is not None:
        plan = _gluon_backward(q, k, v, out, dout, lse, dq, dk, dv, params, gluon_cfg, pre_cfg, seqs, dsink)
    else:
        plan = _portable_backward(q, k, v, out, dout, lse, dq, dk, dv, params, pre_cfg, seqs, dsink)
    if plan_key is None or plan is None:
        return None
    _BACKWARD_PLANS.put(plan_key, plan)
    return plan


def _gluon_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, gluon_cfg, pre_cfg,
                    seqs: Optional[PackedSeqs], dsink: Optional[torch.Tensor] = None) -> Optional[object]:
    """attention_backward on the Hopper kernels; returns the plan when one launch on the given
    tensors did it all (no head chunks, no copies: a plan later calls may replay)."""
    from .kernels.hopper.backward_plan import tma_addressable
    from .kernels.hopper.launch import GluonBackward, gluon_head_chunks

    dout_given = dout
    dout, dk, dv, copy_back = tma_addressable(dout, dk, dv)
    # The Gluon backward adds dQ up in a float32 (b, sq, h, d) buffer: at long context, run it
    # a few heads at a time so that buffer stays small next to the inputs and gradients.
    nheads, nheads_k, head_dim = q.shape[2], k.shape[2], q.shape[3]
    chunks = gluon_head_chunks(q.shape[0], q.shape[1], nheads, nheads_k, head_dim)
    if params.mods is not None and params.mods.attn_bias is not None:
        # One launch: next to an O(seqlen^2) bias the dQ accumulator is small (the chunks slice no bias).
        chunks = [(0, nheads, 0, nheads_k)]
    max_seqlen_k = grid_lengths(q, k, seqs)[2]
    for h0, h1, hk0, hk1 in chunks:
        chunk_params, chunk_dsink = params, dsink
        if len(chunks) == 1:
            chunk = (q, k, v, out, dout, lse, dq, dk, dv)
        else:
            chunk = (q[:, :, h0:h1], k[:, :, hk0:hk1], v[:, :, hk0:hk1], out[:, :, h0:h1], dout[:, :, h0:h1],
                     lse[:, h0:h1], dq[:, :, h0:h1], dk[:, :, hk0:hk1], dv[:, :, hk0:hk1])
            # The chunk's heads' slopes ((h,) or (b, h)), sinks and relative-bias table rows (the one
            # mod the Hopper kernels take).
            mods = params.mods
            chunk_params = dataclasses.replace(
                params, alibi_slopes=None if params.alibi_slopes is None else params.alibi_slopes[..., h0:h1],
                learnable_sink=None if params.learnable_sink is None else params.learnable_sink[h0:h1],
                mods=None if mods is None else dataclasses.replace(
                    mods, relative_bias_table=mods.relative_bias_table[h0:h1]))
            chunk_dsink = None if dsink is None else dsink[h0:h1]

        def run_gluon(cfg, chunk=chunk, chunk_params=chunk_params, chunk_dsink=chunk_dsink):
            GluonBackward(*chunk, chunk_params, cfg, pre_cfg, seqs)(*chunk, chunk_params, seqs, dsink=chunk_dsink)
        cfg = _tuned(BWD_GLUON, q, v, params, max_seqlen_k, gluon_cfg, GLUON_CANDIDATES[BWD_GLUON], run_gluon)
        plan = GluonBackward(*chunk, chunk_params, cfg, pre_cfg, seqs)
        plan(*chunk, chunk_params, seqs, dsink=chunk_dsink)
    if copy_back is not None:
        copy_back()
    return plan if len(chunks) == 1 and dout is dout_given and copy_back is None else None


def _portable_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, pre_cfg,
                       seqs: Optional[PackedSeqs], dsink: Optional[torch.Tensor] = None) -> PortableBackward:
    """attention_backward on the portable kernels; returns the plan."""
    arch, head_dim = arch_of(q.device), tile_head_dim(q, v)
    max_seqlen_k = grid_lengths(q, k, seqs)[2]
    dkdv_cfg = get_config(BWD_DKDV, arch, head_dim, params.causal, max_seqlen_k, q.dtype)
    dq_cfg = get_config(BWD_DQ, arch, head_dim, params.causal, max_seqlen_k, q.dtype)
    if autotune.enabled() and q.is_cuda:
        prepared = []

        def prepared_tensors() -> tuple:
            # Timing a dK/dV or dQ config needs this call's delta and lse_log2 (once, and only if a
            # config is timed: the choices are remembered on disk).
            if not prepared:
                delta, lse_log2 = row_stats_buffers(lse)
                launch_preprocess(out, dout, lse, delta, lse_log2, seqs, pre_cfg.block_m, pre_cfg.num_warps)
                prepared.append((delta, portable_bwd_tensors(q, k, v, dout, lse_log2, delta, params.alibi_slopes,
                                                              params.dropout_seed, seqs)))
            return prepared[0]

        def time_config(kernel, cfg):
            delta, tensors = prepared_tensors()
            grads = (dk, dv) if kernel == BWD_DKDV else (dq,)
            portable_bwd_call(kernel, q, k, v, dout, delta, grads, params, cfg, seqs)(*tensors, *grads)
        if k.shape[1] > 0:
            dkdv_cfg = _tuned(BWD_DKDV, q, v, params, max_seqlen_k, dkdv_cfg, PORTABLE_CANDIDATES[BWD_DKDV],
                              lambda c: time_config(BWD_DKDV, c))
        dq_cfg = _tuned(BWD_DQ, q, v, params, max_seqlen_k, dq_cfg, PORTABLE_CANDIDATES[BWD_DQ],
                        lambda c: time_config(BWD_DQ, c))
    def run(dkdv_cfg, dq_cfg):
        plan = PortableBackward(q, k, v, out, dout, lse, dq, dk, dv, params, pre_cfg, dkdv_cfg, dq_cfg, seqs)
        plan(q, k, v, out, dout, lse, dq, dk, dv, params, seqs, dsink=dsink)
        return plan
    # (The tables' tiles may not fit float32 inputs, nor a mod's own tiles: shrunk until they do.)
    return _within_resources(run, dkdv_cfg, dq_cfg)


# _within_resources' steps: (stages fewer, halvings of block_n, halvings of block_m), the config as it
# is first. (float32 at head dim 256: the dQ kernel's 128-row Q and dO tiles alone fill shared memory.)
_SHRINKS = ((0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2))


def _within_resources(run: Callable, *cfgs: Config):
    """run(*cfgs), retried with shallower pipelines, then narrower tiles, while the kernels need more
    shared memory than the GPU has: the tables' configs plan for 16-bit inputs without mods, and
    float32 inputs or a call's mods (a bias gathered per score, pipelined like K and V) may need more.
    The first fit runs."""
    error = None
    for fewer_stages, n_halvings, m_halvings in _SHRINKS:
        candidates = [dataclasses.replace(cfg, num_stages=max(cfg.num_stages - fewer_stages, 1),
                                          block_n=max(cfg.block_n >> n_halvings, 16),
                                          block_m=max(cfg.block_m >> m_halvings, 16)) for cfg in cfgs]
        try:
            return run(*candidates)
        except OutOfResources as exc:
            error = exc
    raise error


# Split-KV bounds: keys per split at least (below, the merge costs more than the extra programs
# gain), and splits at most.
_MIN_SPLIT_KEYS = 256
_MAX_SPLITS = 128
# Programs of the 16-row decode tile counted per multiprocessor at head dims up to 64: its K/V ring
# (96 KB by default, 64 KB in sm90's table) leaves room for a second, and grids sized for two read
# faster than for one or three (docs/experiments.md, 2026-12-02). The other tiles count one: at head
# dim 128 the ring fills the shared memory, and the 64-row packed tile measured best with grids of one
# per multiprocessor.
_DECODE_RESIDENT_D64 = 2


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments; decoding asks once per layer and token
def _auto_splits(batch: int, nheads: int, tile_rows: int, max_seqlen_k: int, head_dim: int,
                 device: torch.device, family: str) -> int:
    """How many programs share the keys of one (sequence, head, query block) (flash-decoding).

    Decoding streams K and V: what counts is that every multiprocessor keeps reading until the end.
    The model: the grid runs in waves of a fixed number of programs per multiprocessor (one; two
    for the 16-row tile at head dims up to 64, _DECODE_RESIDENT_D64), and a thin last wave idles
    most of the GPU. Takes the fewest splits within 5% of the best modelled efficiency, each split
    with at least _MIN_SPLIT_KEYS keys."""
    if device.type != "cuda":
        return 1
    programs = _family_programs(batch * nheads, tile_rows, family)
    resident = _DECODE_RESIDENT_D64 if family == FWD_DECODE and head_dim <= 64 else 1
    slots = resident * multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())

    def efficiency(grid: int) -> float:
        return grid / (slots * -(-grid // slots))
    # A split's keys are whole key tiles (SplitForward rounds them up; every block_n divides 128),
    # so the counts that can occur are those of 128, 256, ... keys per split.
    fill = {1: efficiency(programs)}
    for keys in range(_MIN_SPLIT_KEYS, max_seqlen_k, 128):
        splits = -(-max_seqlen_k // keys)
        if splits <= _MAX_SPLITS:
            fill[splits] = efficiency(programs * splits)
    best = max(fill.values())
    return min(s for s, f in fill.items() if f >= 0.95 * best)


class KVCacheStep:
    """flash_attn_with_kvcache's body for one call signature: the layout chosen once (the cache read
    in its rows or through a table of pages, GQA heads as rows or sharing tiles, the split count);
    a call then writes the cache and attends, through the update and forward plans the first call
    left. Its arguments are the ``flashtile::kvcache_fwd`` op's, spread out (kvcache_attention)."""

    def __init__(self, q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                 cache_leftpad, block_table, alibi_slopes, learnable_sink, softmax_scale: float, softcap: float,
                 causal: int, window_left: int, window_right: int, rotary_interleaved: int, num_splits: int,
                 mods: Optional[Mods] = None):
        batch, seqlen_q, nheads, _ = q.shape
        # Score / mask mods see query heads and query rows: no heads as rows, no packed GQA tiles.
        self.mods = mods
        seqlen_new = 0 if k is None else k.shape[1]
        paged = block_table is not None
        self.capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
        # A contiguous cache is a pool of one page per sequence for the update, and for the forward
        # when its rows are picked or left-padded. A plain one is read in its (batch, rows) layout,
        # which spares the forward the paged kernel's per-tile table lookups.
        self.read_through_table = paged or cache_batch_idx is not None or cache_leftpad is not None
        self.rows_table = not paged and (self.read_through_table or seqlen_new > 0 or rotary_cos is not None)
        self.local = bool(causal or window_left >= 0 or window_right >= 0)
        self.rotary_interleaved = bool(rotary_interleaved)
        self.params = ScoreParams(softmax_scale=softmax_scale, softcap=softcap, window_left=window_left,
                                  window_right=0 if causal else window_right)
        nheads_k = k_cache.shape[2]
        # One query per sequence and GQA: the group's query heads become the rows of one kv head,
        # so each program reads that head's keys and values once for all of them. A single query
        # sees every key whether causal or not, so the rows need no mask between them. Rows are
        # strided views of q, out and lse: row g of kv head hk is query head hk * group + g.
        self.rows_from_heads = seqlen_q == 1 and nheads > nheads_k and mods is None and options_allow_heads_as_rows(
            self.params.with_tensors(alibi_slopes).with_sink(learnable_sink))
        if self.rows_from_heads:
            self.params = ScoreParams(softmax_scale=softmax_scale, softcap=softcap)
            self.rows, heads = nheads // nheads_k, nheads_k
        else:
            self.rows, heads = seqlen_q, nheads
        # A few query rows (speculative decoding) with GQA: the group's query heads share each K/V tile.
        q_rows = q.new_empty((batch, self.rows, heads, q.shape[3]), device="meta")
        seqs = PackedSeqs(None, None, self.rows, self.capacity, seqused_k=cache_seqlens)
        self.family, self.pack = decode_kernel(q_rows, k_cache, self.params.with_tensors(alibi_slopes), seqs)
        if seqlen_q > DECODE_ROUTE_MAX_ROWS or mods is not None:  # a tile per query head
            self.pack = False
            self.family = _decode_family(self.rows)
        heads, tile_rows = decode_tile(self.rows, heads, nheads_k, self.pack)
        self.splits = num_splits or _auto_splits(batch, heads, tile_rows, self.capacity, tile_head_dim(q, v_cache),
                                                 q.device, self.family)
        self.table_of_rows = None  # a contiguous cache's rows as a table (rows_table without cache_batch_idx)
        self.update = None  # the update's and the forward's plans, from the first call
        self.forward = None
        self.empty = empty_allocator()  # a call plan's key holds the setting; the op's step lives one call

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                 cache_leftpad, block_table, alibi_slopes, learnable_sink) -> tuple:
        """(out, lse) of q against the cache after the update."""
        if self.rows_table and cache_batch_idx is not None:
            block_table = cache_batch_idx[:, None]
        elif self.rows_table:
            if self.table_of_rows is None:  # constant, read only: made once
                self.table_of_rows = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)[:, None]
            block_table = self.table_of_rows
        # Keys [cache_leftpad, cache_seqlens + seqlen_new) of each sequence (the update writes the end).
        update = self.update
        if update is None:
            update = self.update = kvcache_update_plan(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin,
                                                       cache_seqlens, block_table, self.rotary_interleaved,
                                                       self.local)
        q, seqlens_k = update(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table)
        if cache_leftpad is not None:
            seqlens_k = seqlens_k - cache_leftpad
        params = self.params.with_tensors(alibi_slopes).with_sink(learnable_sink).with_mods(self.mods)
        out = self.empty((*q.shape[:3], v_cache.shape[-1]), q.dtype, q.device)  # v's head dim
        lse = self.empty((q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device)
        # The queries keep their (batch, rows) layout; the keys theirs, or the table of pages.
        seqs = PackedSeqs(None, None, self.rows, self.capacity, seqused_k=seqlens_k,
                          block_table=block_table if self.read_through_table else None, key_shift=cache_leftpad)
        if self.forward is not None:
            # A plan reads only the data pointers of its tensors, and the views of rows start where
            # q, out and lse do: no views on later calls.
            self.forward(q, k_cache, v_cache, out, lse, params, seqs)
            return out, lse
        # A few query rows per sequence with GQA, their groups packing whole tiles (packed_gqa_on_hopper): the
        # Hopper forward, which zeroes the values past each sequence's cache length.
        packed_cfg = None if self.rows_from_heads or q.shape[1] > DECODE_ROUTE_MAX_ROWS \
            else packed_gqa_on_hopper(q, k_cache, v_cache, out, lse, params, seqs)
        if packed_cfg is not None:
            self.forward = _packed_gqa_plan(q, k_cache, v_cache, out, lse, params, seqs, packed_cfg)
            self.forward(q, k_cache, v_cache, out, lse, params, seqs)
            return out, lse
        q_rows, out_rows, lse_rows = heads_as_rows(q, out, lse, k_cache.shape[2]) if self.rows_from_heads \
            else (q, out, lse)
        if self.splits > 1 or self.pack:
            self.forward = attention_forward_split(q_rows, k_cache, v_cache, out_rows, lse_rows, params, seqs,
                                                   self.splits, self.pack, self.family)
        else:
            self.forward = attention_forward(q_rows, k_cache, v_cache, out_rows, lse_rows, params, seqs)
        return out, lse


def _packed_gqa_plan(q, k, v, out, lse, params: ScoreParams, seqs: PackedSeqs, cfg) -> Callable:
    """The Hopper forward of a kv-cache step with its GQA groups packed as rows, from the plan cache: a step
    made per call (the op under torch.compile) builds no new plan."""
    from .kernels.hopper.launch import GluonForward

    def make():
        return GluonForward(q, k, v, out, lse, params, cfg, seqs, query_group=q.shape[2] // k.shape[2])
    key = _plan_key(params, seqs, q, k, v, out, lse)
    return make() if key is None else _FORWARD_PLANS.get_or_make(("packed-gqa", cfg, *key), make)


def kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                      cache_leftpad, block_table, alibi_slopes, learnable_sink, softmax_scale: float, softcap: float,
                      causal: int, window_left: int, window_right: int, rotary_interleaved: int, num_splits: int,
                      mods: Optional[Mods] = None):
    """The body of the ``flashtile::kvcache_fwd`` op (flash_attn_with_kvcache's arguments checked,
    options resolved, cache_seqlens a tensor): check the contents (CPU, FLASHTILE_VALIDATE=1), then
    one :class:`KVCacheStep`. (out, lse). ``mods``: score / mask mods (mod_ops.kvcache_attention)."""
    if validate_enabled() or q.device.type == "cpu":
        seqlen_new = 0 if k is None else k.shape[1]
        paged = block_table is not None
        capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
        rotated_end = seqlen_new
        if rotary_cos is not None and (causal or window_left >= 0 or window_right >= 0):
            rotated_end = max(seqlen_new, q.shape[1])
        checks.check_kvcache_contents(cache_seqlens, seqlen_new, capacity, cache_batch_idx, k_cache.shape[0],
                                      block_table, k_cache.shape[0],
                                      None if rotary_cos is None else rotary_cos.shape[0], max(rotated_end, 1),
                                      cache_leftpad)
    args = (q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, learnable_sink)
    step = KVCacheStep(*args, softmax_scale, softcap, causal, window_left, window_right, rotary_interleaved,
                       num_splits, mods)
    return step(*args)
