"""Launchers: turn tensors and attention options into kernel arguments and grids.

Tensors arrive as (batch, seqlen, heads, head_dim) views with a unit-stride last dim;
outputs are preallocated by the caller, so packed layouts (qkv, kv) and their
gradients are written in place without copies. A packed (varlen) batch arrives as
(1, total, heads, head_dim) views, lse as (1, heads, total), plus a :class:`PackedSeqs`
saying where each sequence lives; the same kernels serve both (see kernels/seqlens.py).
"""

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import triton

from .. import autotune, triton_compat
from ..configs import (BWD_DKDV, BWD_DQ, BWD_GLUON, BWD_PREPROCESS, DECODE_MAX_ROWS, FWD, FWD_DECODE, FWD_GLUON,
                       PORTABLE_CANDIDATES, Config, get_config, overridden, padded_head_dim)
from ..runtime import arch_of, device_capability, empty, portable_only
from .backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .combine import attn_combine_kernel
from .kvcache_update import kvcache_update_kernel
from .forward import attn_fwd_kernel
from .hopper import TileDescriptorTemplate, qkv_unsupported, tma_aligned
from .plans import CompiledCall, PlanCache, tensor_signature
from .plans import enabled as plans_enabled
from .probs import attn_probs_kernel

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class ScoreParams:
    """Everything that shapes the scores, shared by forward, backward and probs.

    window_left / window_right: -1 means unbounded; causal is window_right = 0.
    alibi_slopes: fp32 (nheads,) or (batch, nheads), or None.
    dropout_seed: int64 tensor of one element on the inputs' device, or None.
    """

    softmax_scale: float
    softcap: float = 0.0
    window_left: int = -1
    window_right: int = -1
    alibi_slopes: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    dropout_seed: Optional[torch.Tensor] = None

    @property
    def causal(self) -> bool:
        """Plain causal: the band is everything up to the diagonal (the config tables' key)."""
        return self.window_left < 0 and self.window_right == 0

    @property
    def scaled_dot_products(self) -> bool:
        """Scores are q.k times a positive scale (no softcap, no ALiBi), so the scale can
        be folded into exp2's multiply-add after the row max."""
        return self.softcap == 0.0 and self.alibi_slopes is None and self.softmax_scale > 0

    @property
    def plain(self) -> bool:
        """Scaled dot products with at most a causal mask, no dropout: what the Hopper kernels handle."""
        return (self.scaled_dot_products and self.dropout_p == 0.0
                and self.window_left < 0 and self.window_right in (-1, 0))

    def kernel_args(self, dtype: torch.dtype) -> dict:
        """Keyword arguments every attention kernel takes."""
        has_softcap = self.softcap > 0.0
        if has_softcap:
            qk_scale = self.softmax_scale / self.softcap
            softcap_log2 = self.softcap * _LOG2E
        else:
            qk_scale = self.softmax_scale * _LOG2E
            softcap_log2 = 0.0
        alibi = self.alibi_slopes
        return dict(
            AlibiSlopes=alibi,
            DropoutSeed=self.dropout_seed,
            stride_alibi_b=(alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0),
            qk_scale=qk_scale,
            softcap_log2=softcap_log2,
            window_left=max(self.window_left, 0),
            window_right=max(self.window_right, 0),
            dropout_p=self.dropout_p,
            HAS_LEFT=self.window_left >= 0,
            HAS_RIGHT=self.window_right >= 0,
            HAS_SOFTCAP=has_softcap,
            HAS_ALIBI=alibi is not None,
            HAS_DROPOUT=self.dropout_p > 0.0,
            # fp32 inputs get true fp32 products (tests compare against fp32/fp64);
            # 16-bit inputs ignore this.
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        )


@dataclass(frozen=True)
class PackedSeqs:
    """Where the sequences of a packed (varlen) batch live in the (total, h, d) tensors.

    cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) prefix sums on the tensors' device.
    max_seqlen_q / max_seqlen_k: host ints, at least every sequence's length (they size the grid).
    seqused_q / seqused_k: optional int32 (batch,): sequence b uses only its first seqused[b] tokens.
    block_table: optional int32 (batch, pages per sequence): K and V are then a paged cache
    (num_pages, page_size, hk, d) and key t of sequence b lives at page block_table[b, t // page_size]
    (forward only); cu_seqlens_k then only gives the key counts.
    Either cu_seqlens may be None (forward only): that side keeps its dense (b, s, h, d) layout,
    s rows per sequence of which seqused says how many are in use. A kv cache runs so: its queries
    are (batch, seqlen_q, ...) and its keys one cache row (or pages) per sequence, seqused_k long.
    """

    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_q: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    # With block_table: optional int32 (batch,), the position of each sequence's first key in its
    # pages (a kv cache's left padding).
    key_shift: Optional[torch.Tensor] = None

    @property
    def batch(self) -> int:
        for prefix_sums in (self.cu_seqlens_q, self.cu_seqlens_k):
            if prefix_sums is not None:
                return prefix_sums.shape[0] - 1
        return self.seqused_k.shape[0]

    @property
    def paged(self) -> bool:
        return self.block_table is not None


_DENSE_SEQ_ARGS = dict(CuSeqlensQ=None, CuSeqlensK=None, SeqUsedQ=None, SeqUsedK=None, IS_VARLEN=False)


def _seq_args(seqs: Optional[PackedSeqs]) -> dict:
    """The sequence-bound arguments every kernel takes."""
    if seqs is None:
        return _DENSE_SEQ_ARGS
    return dict(CuSeqlensQ=seqs.cu_seqlens_q, CuSeqlensK=seqs.cu_seqlens_k, SeqUsedQ=seqs.seqused_q,
                SeqUsedK=seqs.seqused_k, IS_VARLEN=True)


_NO_PAGES = dict(BlockTable=None, stride_bt=0, seq_pages=0, num_pages=0, PAGE_SIZE=0)


def _page_args(k: torch.Tensor, seqs: Optional[PackedSeqs]) -> dict:
    """The paged-K/V arguments of the forward and probs kernels (k: the paged cache)."""
    if seqs is None or not seqs.paged:
        return _NO_PAGES
    table = seqs.block_table
    return dict(BlockTable=table, stride_bt=table.stride(0), seq_pages=table.shape[1], num_pages=k.shape[0],
                PAGE_SIZE=k.shape[1])


def _grid_lengths(q: torch.Tensor, k: torch.Tensor, seqs: Optional[PackedSeqs]) -> tuple:
    """(batch, seqlen_q, seqlen_k) the grid spans: the longest sequence when packed."""
    if seqs is None:
        return q.shape[0], q.shape[1], k.shape[1]
    return seqs.batch, seqs.max_seqlen_q, seqs.max_seqlen_k


def _batch_stride(t: torch.Tensor) -> int:
    # A batch of one is never indexed past entry 0; stride 0 also lets the packed (1, total, ...)
    # views serve every sequence, which sits at its own row offset instead.
    return t.stride(0) if t.shape[0] > 1 else 0


def _bsh_strides(t: torch.Tensor) -> tuple:
    """(batch, seqlen, head) strides of a (b, s, h, d) tensor."""
    return _batch_stride(t), t.stride(1), t.stride(2)


def _bh_strides(t: torch.Tensor) -> tuple:
    """(batch, head) strides of a (b, h, s) lse-like tensor."""
    return _batch_stride(t), t.stride(1)


def _shape_args(q: torch.Tensor, k: torch.Tensor, seqs: Optional[PackedSeqs] = None) -> dict:
    """Sizes every kernel takes: seqlen_q / seqlen_k are the packed totals when varlen (for a
    paged cache no total bounds the keys: the block table does, in the kernel)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = 2**31 - 1 if seqs is not None and seqs.paged else k.shape[1]
    return dict(nheads=nheads, head_group=nheads // k.shape[2], seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim))


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


def _options_off_hopper(params: ScoreParams) -> str:
    """Names the options that make ``params`` not plain (the rule itself is ScoreParams.plain)."""
    options = []
    if params.dropout_p > 0.0:
        options.append(f"dropout (dropout_p={params.dropout_p})")
    if params.softcap > 0.0:
        options.append(f"softcap={params.softcap}")
    if params.alibi_slopes is not None:
        options.append("ALiBi (alibi_slopes)")
    if params.window_left >= 0 or params.window_right not in (-1, 0):
        options.append(f"a sliding window (window_size=({params.window_left}, {params.window_right}))")
    if params.softmax_scale <= 0:
        options.append(f"softmax_scale={params.softmax_scale} <= 0")
    return " and ".join(options) or "these score options"


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
        device_capability = _capability(q.device)
    major, minor = device_capability
    arch = f"sm{major}{minor}"
    if (major, minor) != (9, 0):
        return None, f"the GPU is {arch} (compute capability {major}.{minor}); the Hopper kernels need sm90"
    if portable_only():
        return None, "FLASHTILE_PORTABLE=1 keeps every call on the portable kernels"
    if kernel == BWD_GLUON and deterministic:
        return None, ("deterministic=True: the Hopper backward adds dQ up with float32 atomics in no fixed "
                      "order; the portable backward sums every gradient in a fixed order")
    if not params.plain:
        return None, f"{_options_off_hopper(params)}: the Hopper kernels take plain or causal attention only"
    if seqs is not None and seqs.paged:
        return None, "paged KV (block_table): the Hopper kernels do not read paged caches"
    if seqs is not None and (seqs.seqused_k is not None or (kernel == BWD_GLUON and seqs.seqused_q is not None)):
        # The Gluon kernels read whole tiles past a sequence's end and mask them; slots past
        # seqused may hold anything (NaN * 0 is NaN), so those go to the portable kernels, which do
        # not load them. The forward reads unused query rows harmlessly (their output is selected
        # away), the backward adds them into dK and dV (P^T dO, dS^T Q with a zero P, dS).
        used = "seqused_k" if seqs.seqused_k is not None else "seqused_q"
        return None, (f"{used} is set: the Hopper kernels read whole tiles past each sequence's used tokens, "
                      "which may hold anything")
    tensors_reason = qkv_unsupported(q, k, v)
    if tensors_reason is not None:
        return None, tensors_reason
    portable = (FWD, FWD_DECODE) if kernel == FWD_GLUON else (BWD_DKDV, BWD_DQ)
    if any(overridden(name) for name in portable) and not overridden(kernel):
        overrides = ", ".join(name for name in portable if overridden(name))
        return None, f"an explicit portable config is set (configs.override of {overrides})"
    _, _, max_seqlen_k = _grid_lengths(q, k, seqs)
    cfg = get_config(kernel, arch, q.shape[-1], params.causal, max_seqlen_k, q.dtype, varlen=seqs is not None)
    direction = "forward" if kernel == FWD_GLUON else "backward"
    mask = "causal" if params.causal else "full"
    if cfg is None:
        layout = "packed" if seqs is not None else "dense"
        return None, (f"the {arch} config table has no Hopper {direction} for head dim {q.shape[-1]}, {mask}, "
                      f"{max_seqlen_k} keys, {layout} batches: the portable kernels serve these")
    available, why = triton_compat.gluon_status()
    if not available:
        if warn:
            _warn_gluon_fallback(why)
        return None, f"the Gluon kernels are unavailable on Triton {triton.__version__}: {why}"
    return cfg, (f"{arch}, {str(q.dtype).replace('torch.', '')}, head dim {q.shape[-1]}, {mask} attention: "
                 f"the Hopper Gluon {direction}")


def _capability(device: torch.device) -> tuple:
    return device_capability(device.index if device.index is not None else torch.cuda.current_device())


def gluon_config(kernel: str, q, k, v, params: ScoreParams, seqs: Optional[PackedSeqs] = None,
                 deterministic: bool = False) -> Optional[Config]:
    """The config of a Hopper Gluon kernel (FWD_GLUON or BWD_GLUON) when it serves this
    call, else None: the call runs on the portable Triton kernels (see gluon_decision)."""
    return gluon_decision(kernel, q, k, v, params, seqs, deterministic=deterministic)[0]


def attention_forward(q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs] = None) -> None:
    """out (b, sq, h, d) <- attention; lse (b, h, sq) float32 <- natural-log logsumexp.
    Packed batches: (1, total, h, d) views, lse (1, h, total_q), and ``seqs``."""
    if out.numel() == 0:
        return
    plan = _FORWARD_PLANS.get_or_make(_plan_key(params, seqs, q, k, v, out, lse),
                                      lambda: _forward_plan(q, k, v, out, lse, params, seqs))
    plan(q, k, v, out, lse, params, seqs)


def _forward_plan(q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs]) -> Callable:
    """The launch of attention_forward for this call's signature (configs chosen, autotuned if
    asked): a callable taking (q, k, v, out, lse, params, seqs)."""
    _, _, max_seqlen_k = _grid_lengths(q, k, seqs)
    gluon_cfg = gluon_config(FWD_GLUON, q, k, v, params, seqs)
    if gluon_cfg is not None and (seqs is None or tma_aligned(out)):
        from .gluon_forward import CANDIDATES, ForwardPlan

        max_seqlen_q = None if seqs is None else seqs.max_seqlen_q

        def plan_for(cfg):
            return _GluonForward(ForwardPlan(q, k, v, out, lse if seqs is None else lse[0], params.softmax_scale,
                                             params.causal, cfg, max_seqlen_q=max_seqlen_q, **_gluon_seq_tensors(seqs)))
        cfg = _tuned(FWD_GLUON, q, params, max_seqlen_k, gluon_cfg, CANDIDATES,
                     lambda c: plan_for(c)(q, k, v, out, lse, params, seqs))
        return plan_for(cfg)
    kernel = forward_kernel(q, k, seqs)
    cfg = get_config(kernel, arch_of(q.device), q.shape[-1], params.causal, max_seqlen_k, q.dtype)
    cfg = _tuned(kernel, q, params, max_seqlen_k, cfg, PORTABLE_CANDIDATES[kernel],
                 lambda c: launch_forward(q, k, v, out, lse, params, c, seqs))
    return PortableForward(q, k, v, out, lse, params, cfg, seqs)


class _GluonForward:
    """gluon_forward.ForwardPlan called as attention_forward's plans are: packed batches pass their
    prefix sums, and lse as its (h, total_q) view."""

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs] = None):
        if seqs is None:
            self.plan(q, k, v, out, lse)
        else:
            self.plan(q, k, v, out, lse[0], **_gluon_seq_tensors(seqs))


# Plans by call signature (kernels/plans.py): dense and packed calls of the forward, the split
# forward, the backward, and the kv-cache update.
_FORWARD_PLANS = PlanCache()
_BACKWARD_PLANS = PlanCache()
_SPLIT_FORWARD_PLANS = PlanCache()
_KVCACHE_UPDATE_PLANS = PlanCache()


def _plan_key(params: ScoreParams, seqs: Optional[PackedSeqs], *tensors) -> Optional[tuple]:
    """The plan-cache key of a call on these tensors, or None when no plan may serve it (CPU calls;
    plans.enabled() false). It holds all that the long way reads on the host: the score options,
    every tensor's signature (shape, strides, dtype, 16-byte alignment; the ALiBi slopes, the
    dropout seed and the packed batch's tensors included) and the packed batch's host lengths.
    Never the tensors' contents: a plan serves any sequence lengths under the same maxima."""
    q = tensors[0]
    if not q.is_cuda or not plans_enabled():
        return None
    key = (q.device, portable_only(), params.softmax_scale, params.softcap, params.window_left, params.window_right,
           params.dropout_p, tensor_signature(params.alibi_slopes), tensor_signature(params.dropout_seed),
           *(tensor_signature(t) for t in tensors))
    if seqs is not None:
        key += (seqs.max_seqlen_q, seqs.max_seqlen_k,
                *(tensor_signature(t) for t in (seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_q,
                                                seqs.seqused_k, seqs.block_table, seqs.key_shift)))
    return key


def forward_kernel(q, k, seqs: Optional[PackedSeqs]) -> str:
    """Which portable forward config serves the call: FWD_DECODE for packed batches of a few
    query rows per sequence (kv-cache decoding), FWD otherwise."""
    _, max_seqlen_q, _ = _grid_lengths(q, k, seqs)
    return FWD_DECODE if seqs is not None and max_seqlen_q <= DECODE_MAX_ROWS else FWD


def _tuned(kernel: str, q, params: ScoreParams, seqlen_k: int, cfg: Config, candidates: dict,
           run: Callable[[Config], None]) -> Config:
    """``cfg`` (the table's), or with FLASHTILE_AUTOTUNE=1 the fastest of it and ``candidates``
    (per padded head dim) for this shape class, timed through ``run`` once and remembered on
    disk (flashtile/autotune.py). Never replaces a config given with override()."""
    if not autotune.enabled() or q.device.type != "cuda" or overridden(kernel):
        return cfg
    head_dim = q.shape[-1]
    options = candidates.get(padded_head_dim(head_dim), {})
    options = list(options.values()) if isinstance(options, dict) else list(options)
    key = autotune.shape_key(kernel, q.device, arch_of(q.device), head_dim, params.causal, seqlen_k, q.dtype)
    return autotune.choose(key, [cfg, *options], run)


def attention_forward_split(q, k, v, out, lse, params: ScoreParams, seqs: PackedSeqs, num_splits: int) -> None:
    """:func:`attention_forward` with the keys of each sequence split across ``num_splits`` programs
    per query block (flash-decoding: a few long sequences with few queries fill the GPU), their
    partial results merged by the combine kernel. Packed batches, portable kernels."""
    if out.numel() == 0:
        return
    plan_key = _plan_key(params, seqs, q, k, v, out, lse)
    plan = _SPLIT_FORWARD_PLANS.get_or_make(None if plan_key is None else (num_splits, *plan_key),
                                            lambda: SplitForward(q, k, v, out, lse, params, seqs, num_splits))
    plan(q, k, v, out, lse, params, seqs)


class SplitForward:
    """attention_forward_split for one call signature (kernels/plans.py): the split forward writes
    float32 partial outputs and logsumexps (allocated per call), the combine kernel merges them.
    With one split left (too few keys), the plain portable forward."""

    def __init__(self, q, k, v, out, lse, params: ScoreParams, seqs: PackedSeqs, num_splits: int):
        _, _, max_seqlen_k = _grid_lengths(q, k, seqs)
        cfg = get_config(forward_kernel(q, k, seqs), arch_of(q.device), q.shape[-1], params.causal, max_seqlen_k,
                         q.dtype)
        split_keys = triton.cdiv(max(max_seqlen_k, 1), max(num_splits, 1))
        keys_per_split = triton.cdiv(split_keys, cfg.block_n) * cfg.block_n
        num_splits = triton.cdiv(max(max_seqlen_k, 1), keys_per_split)  # no split is left without keys
        self.combine = None
        if num_splits <= 1:
            self.forward = PortableForward(q, k, v, out, lse, params, cfg, seqs)
            return
        self.parts_shapes = ((num_splits,) + tuple(out.shape), (num_splits,) + tuple(lse.shape))
        # The layouts of the partial buffers each call allocates, without memory.
        out_parts, lse_parts = (torch.empty(shape, dtype=torch.float32, device="meta") for shape in self.parts_shapes)
        self.forward = PortableForward(q, k, v, out_parts[0], lse_parts[0], params, cfg, seqs,
                                       splits=(num_splits, keys_per_split, out_parts.stride(0), lse_parts.stride(0)))
        batch, rows, nheads, head_dim = out.shape
        block_r = 16
        self.combine = CompiledCall(
            attn_combine_kernel, (triton.cdiv(rows, block_r), nheads, batch),
            (None, None, None, None, *out_parts.stride()[:4], *lse_parts.stride()[:3], out.stride(0), out.stride(1),
             out.stride(2), lse.stride(0), lse.stride(1), rows, num_splits),
            dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_R=block_r),
            slots=("OutPartial", "LsePartial", "Out", "Lse"))

    def __call__(self, q, k, v, out, lse, params: ScoreParams, seqs: PackedSeqs):
        if self.combine is None:
            self.forward(q, k, v, out, lse, params, seqs)
            return
        out_parts, lse_parts = (torch.empty(shape, dtype=torch.float32, device=out.device)
                                for shape in self.parts_shapes)
        self.forward(q, k, v, out_parts[0], lse_parts[0], params, seqs)
        self.combine(out_parts, lse_parts, out, lse)


def launch_forward(q, k, v, out, lse, params: ScoreParams, cfg, seqs: Optional[PackedSeqs] = None,
                   splits: Optional[tuple] = None) -> None:
    """The portable forward with an explicit config (the autotuner times several). ``splits``:
    (num_splits, keys_per_split, split stride of out, of lse) for attention_forward_split."""
    PortableForward(q, k, v, out, lse, params, cfg, seqs, splits)(q, k, v, out, lse, params, seqs)


class PortableForward:
    """The portable forward kernel for one call signature (kernels/plans.py): grid, configs and
    scalar arguments worked out once; a call passes its tensors (TMA descriptors of them on the
    dense TMA path). Later calls must match the first one's shapes, strides, dtypes, 16-byte
    alignment and scalar options (the plan key's job)."""

    def __init__(self, q, k, v, out, lse, params: ScoreParams, cfg, seqs: Optional[PackedSeqs] = None,
                 splits: Optional[tuple] = None):
        batch, max_seqlen_q, _ = _grid_lengths(q, k, seqs)
        nheads, head_dim = q.shape[2], q.shape[3]
        block_d = padded_head_dim(head_dim)
        # Descriptors address (batch, row) tiles: dense only (a packed sequence's last tile would
        # be stored over the next sequence's rows).
        use_tma = cfg.use_tma and seqs is None and splits is None and all(tma_aligned(t) for t in (q, k, v, out))
        self.tiles = None
        if use_tma:
            rows = (cfg.block_m, cfg.block_n, cfg.block_n, cfg.block_m)
            self.tiles = tuple(TileDescriptorTemplate(t, r, block_d) for t, r in zip((q, k, v, out), rows))
        num_splits, keys_per_split, split_stride_o, split_stride_lse = splits or (1, 0, 0, 0)
        grid = (triton.cdiv(max_seqlen_q, cfg.block_m) * num_splits, nheads, batch)
        pages = _page_args(k, seqs)
        self.call = CompiledCall(
            attn_fwd_kernel, grid,
            (q, k, v, out, lse,
             *_bsh_strides(q), *_bsh_strides(k), *_bsh_strides(v), *_bsh_strides(out), *_bh_strides(lse)),
            dict(**_seq_args(seqs), **pages, **_shape_args(q, k, seqs), **params.kernel_args(q.dtype),
                 KeyShift=None, num_splits=num_splits, keys_per_split=keys_per_split, split_stride_o=split_stride_o,
                 split_stride_lse=split_stride_lse, SPLIT_KV=splits is not None,
                 SCALE_IN_EXP2=params.scaled_dot_products, USE_TMA=use_tma,
                 WARP_SPECIALIZE=use_tma and cfg.warp_specialize, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 **cfg.launch_kwargs()),
            slots=("Q", "K", "V", "Out", "Lse", "AlibiSlopes", "DropoutSeed", "CuSeqlensQ", "CuSeqlensK", "SeqUsedQ",
                   "SeqUsedK", "BlockTable", "KeyShift"))

    def __call__(self, q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs] = None):
        tiles = (q, k, v, out) if self.tiles is None else tuple(t(x) for t, x in zip(self.tiles, (q, k, v, out)))
        if seqs is None:
            self.call(*tiles, lse, params.alibi_slopes, params.dropout_seed, None, None, None, None, None, None)
        else:
            self.call(*tiles, lse, params.alibi_slopes, params.dropout_seed, seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                      seqs.seqused_q, seqs.seqused_k, seqs.block_table, seqs.key_shift)


def row_stats_buffers(lse: torch.Tensor, device=None) -> tuple:
    """Two float32 buffers shaped like lse (b, h, sq) for the backward's delta and lse_log2, rows
    padded to a multiple of 4 values (the Hopper backward streams them in 16-byte aligned boxes).
    On lse's device, or ``device`` ("meta": their layout for a plan, without memory)."""
    batch, nheads, seqlen_q = lse.shape
    padded = (seqlen_q + 3) // 4 * 4
    buf = torch.empty((2, batch, nheads, padded), device=device or lse.device, dtype=torch.float32)
    return buf[0, :, :, :seqlen_q], buf[1, :, :, :seqlen_q]


# Above this many bytes of float32 dQ accumulator, the Gluon backward runs head chunk by head chunk,
# each with an accumulator of at most GLUON_DQ_CHUNK_BYTES (the sweep's shapes stay in one launch).
GLUON_DQ_ACCUMULATOR_LIMIT = 256 * 2**20
GLUON_DQ_CHUNK_BYTES = 64 * 2**20


def gluon_head_chunks(batch: int, seqlen_q: int, nheads: int, nheads_k: int, head_dim: int) -> list:
    """[(h0, h1, hk0, hk1)]: query heads h0:h1 over KV heads hk0:hk1 per Gluon backward launch.
    Chunks are whole KV-head groups (dK / dV of a KV head are summed over its query heads inside
    one program), so MQA (one KV head) always runs in one launch."""
    group = nheads // nheads_k
    group_bytes = batch * seqlen_q * group * head_dim * 4
    if group_bytes * nheads_k <= GLUON_DQ_ACCUMULATOR_LIMIT:
        return [(0, nheads, 0, nheads_k)]
    kv_per_chunk = max(1, GLUON_DQ_CHUNK_BYTES // max(group_bytes, 1))
    return [(hk0 * group, min(hk0 + kv_per_chunk, nheads_k) * group, hk0, min(hk0 + kv_per_chunk, nheads_k))
            for hk0 in range(0, nheads_k, kv_per_chunk)]


def launch_preprocess(out, dout, lse, delta, lse_log2, seqs: Optional[PackedSeqs] = None,
                      block_m: int = 64, num_warps: int = 4, zero: Optional[torch.Tensor] = None,
                      zero_counts: Optional[torch.Tensor] = None) -> None:
    """delta <- rowsum(dout * out), lse_log2 <- lse * log2(e) (+inf for rows without keys).
    zero: None, or a float32 tensor shaped like out whose rows (each sequence's used rows, when
    packed) are zeroed in the same pass. zero_counts: None, or an int32 (batch, nheads_k) tensor
    zeroed too (nheads_k <= the heads of out)."""
    preprocess_call(out, dout, lse, delta, lse_log2, seqs, block_m, num_warps, zero, zero_counts)(
        out, dout, lse, delta, lse_log2, zero, zero_counts, *_preprocess_seq_tensors(seqs))


def _preprocess_seq_tensors(seqs: Optional[PackedSeqs]) -> tuple:
    args = _seq_args(seqs)
    return args["CuSeqlensQ"], args["SeqUsedQ"]


def preprocess_call(out, dout, lse, delta, lse_log2, seqs: Optional[PackedSeqs] = None, block_m: int = 64,
                    num_warps: int = 4, zero: Optional[torch.Tensor] = None,
                    zero_counts: Optional[torch.Tensor] = None) -> CompiledCall:
    """:func:`launch_preprocess` for these tensors' signature, as a CompiledCall taking (out, dout,
    lse, delta, lse_log2, zero, zero_counts, cu_seqlens_q, seqused_q)."""
    batch, max_seqlen_q, _ = _grid_lengths(out, out, seqs)
    nheads, head_dim = out.shape[2], out.shape[3]
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.shape == out.shape and zero.stride(-1) == 1
    if zero_counts is not None:
        assert zero_counts.dtype == torch.int32 and zero_counts.is_contiguous() and zero_counts.dim() == 2
        assert zero_counts.shape[0] == batch and zero_counts.shape[1] <= nheads
    return CompiledCall(
        attn_bwd_preprocess_kernel, (triton.cdiv(max_seqlen_q, block_m), nheads, batch),
        (out, dout, lse, delta, lse_log2, *_bsh_strides(out), *_bsh_strides(dout), *_bh_strides(lse),
         *_bh_strides(delta), *_preprocess_seq_tensors(seqs), zero,
         *(_bsh_strides(zero) if zero is not None else (0, 0, 0)), zero_counts,
         0 if zero_counts is None else zero_counts.shape[1], nheads, out.shape[1]),
        dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=block_m, IS_VARLEN=seqs is not None,
             num_warps=num_warps),
        slots=("Out", "DOut", "Lse", "Delta", "LseLog2", "ZeroRows", "ZeroCounts", "CuSeqlensQ", "SeqUsedQ"))


class GluonBackward:
    """The Hopper backward of one call signature (kernels/plans.py): the preprocess (delta,
    lse_log2, and the float32 dQ accumulator zeroed in the same pass), then the Gluon kernel and
    the dQ convert (gluon_backward.BackwardPlan). dout, dk, dv must be TMA-aligned; the
    accumulator covers every row the backward adds into (gluon_config keeps packed batches with
    seqused_q, whose unused rows the preprocess would skip, off this kernel)."""

    def __init__(self, q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, cfg, pre_cfg,
                 seqs: Optional[PackedSeqs] = None):
        from .gluon_backward import BackwardPlan, dq_accumulator

        assert seqs is None or seqs.seqused_q is None
        # The plan needs the layouts of the buffers each call allocates, not memory.
        delta, lse_log2 = row_stats_buffers(lse, device="meta")
        dq_acc = dq_accumulator(q, device="meta")
        self.kernels = BackwardPlan(q, k, v, dout, lse_log2, delta, dq, dk, dv, dq_acc, params.softmax_scale,
                                    params.causal, cfg, max_seqlen_k=_grid_lengths(q, k, seqs)[2],
                                    **_gluon_seq_tensors(seqs))
        done_counts = self._done_counts(q, k, device="meta")
        self.preprocess = preprocess_call(out, dout, lse, delta, lse_log2, seqs, pre_cfg.block_m, pre_cfg.num_warps,
                                          zero=dq_acc, zero_counts=done_counts)

    def _done_counts(self, q, k, device=None) -> Optional[torch.Tensor]:
        from .gluon_backward import done_counts_buffer

        return done_counts_buffer(q, k, device) if self.kernels.needs_counts else None

    def __call__(self, q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, seqs: Optional[PackedSeqs] = None):
        from .gluon_backward import dq_accumulator

        # The host work (buffers, TMA descriptors) comes before the preprocess kernel, so that the
        # preprocess, backward and dQ-convert kernels go out back to back: done between them, it left
        # the GPU idle after the short preprocess. The preprocess zeroes the accumulator (and the
        # done counts) as it goes (a memset of its own cost 29 us per 16k tokens at hidden 2048).
        delta, lse_log2 = row_stats_buffers(lse)
        dq_acc = dq_accumulator(q)
        done_counts = self._done_counts(q, k)
        descriptors = self.kernels.descriptors(q, dout, k, v, dk, dv, dq_acc, lse_log2, delta)
        self.preprocess(out, dout, lse, delta, lse_log2, dq_acc, done_counts, *_preprocess_seq_tensors(seqs))
        self.kernels.launch(descriptors, dq, dk, dv, dq_acc, lse_log2, delta, done_counts=done_counts,
                            **_gluon_seq_tensors(seqs))


def _gluon_seq_tensors(seqs: Optional[PackedSeqs]) -> dict:
    """The packed-batch keyword arguments of gluon_backward.BackwardPlan."""
    if seqs is None:
        return {}
    return dict(cu_seqlens_q=seqs.cu_seqlens_q, cu_seqlens_k=seqs.cu_seqlens_k, seqused_q=seqs.seqused_q)


# The tensor arguments of the portable dK/dV and dQ kernels that change from call to call.
_PORTABLE_BWD_SLOTS = ("Q", "K", "V", "DOut", "LseLog2", "Delta", "CuSeqlensQ", "CuSeqlensK", "SeqUsedQ", "SeqUsedK",
                       "AlibiSlopes", "DropoutSeed")


def _portable_bwd_call(kernel: str, q, k, v, dout, delta, grads: tuple, params: ScoreParams, cfg,
                       seqs: Optional[PackedSeqs]) -> CompiledCall:
    """The portable dK/dV (kernel BWD_DKDV, grads (dk, dv)) or dQ (BWD_DQ, grads (dq,)) launch,
    taking _portable_bwd_tensors(...) + grads."""
    batch, max_seqlen_q, max_seqlen_k = _grid_lengths(q, k, seqs)
    if kernel == BWD_DKDV:
        fn, grid, names = attn_bwd_dkdv_kernel, (triton.cdiv(max_seqlen_k, cfg.block_n), k.shape[2], batch), ("DK", "DV")
    else:
        fn, grid, names = attn_bwd_dq_kernel, (triton.cdiv(max_seqlen_q, cfg.block_m), q.shape[2], batch), ("DQ",)
    grad_strides = [s for g in grads for s in _bsh_strides(g)]
    return CompiledCall(
        fn, grid,
        (q, k, v, dout, None, delta, *grads, *_bsh_strides(q), *_bsh_strides(k), *_bsh_strides(v),
         *_bsh_strides(dout), *grad_strides, *_bh_strides(delta)),
        dict(**_seq_args(seqs), softmax_scale=params.softmax_scale, **_shape_args(q, k), **params.kernel_args(q.dtype),
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **cfg.launch_kwargs()),
        slots=_PORTABLE_BWD_SLOTS + names)


def _portable_bwd_tensors(q, k, v, dout, lse_log2, delta, alibi_slopes, dropout_seed,
                          seqs: Optional[PackedSeqs]) -> tuple:
    """The values of _PORTABLE_BWD_SLOTS for one call."""
    seq = _seq_args(seqs)
    return (q, k, v, dout, lse_log2, delta, seq["CuSeqlensQ"], seq["CuSeqlensK"], seq["SeqUsedQ"], seq["SeqUsedK"],
            alibi_slopes, dropout_seed)


class PortableBackward:
    """The portable backward of one call signature (kernels/plans.py): the preprocess (delta,
    lse_log2), the dK/dV kernel (one program per key block, summing over its query blocks) and
    the dQ kernel (one per query block): every gradient summed in a fixed order, so the result is
    deterministic. Serves every backward the Hopper one does not (other GPUs, deterministic=True,
    softcap, ALiBi, windows, dropout)."""

    def __init__(self, q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, pre_cfg, dkdv_cfg, dq_cfg,
                 seqs: Optional[PackedSeqs] = None):
        delta, lse_log2 = row_stats_buffers(lse, device="meta")
        self.preprocess = preprocess_call(out, dout, lse, delta, lse_log2, seqs, pre_cfg.block_m, pre_cfg.num_warps)
        # No key: no dK / dV to compute (dq still gets its zeros from the dQ kernel).
        self.dkdv = None if k.shape[1] == 0 else _portable_bwd_call(BWD_DKDV, q, k, v, dout, delta, (dk, dv), params,
                                                                     dkdv_cfg, seqs)
        self.dq = _portable_bwd_call(BWD_DQ, q, k, v, dout, delta, (dq,), params, dq_cfg, seqs)

    def __call__(self, q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, seqs: Optional[PackedSeqs] = None):
        delta, lse_log2 = row_stats_buffers(lse)
        self.preprocess(out, dout, lse, delta, lse_log2, None, None, *_preprocess_seq_tensors(seqs))
        tensors = _portable_bwd_tensors(q, k, v, dout, lse_log2, delta, params.alibi_slopes, params.dropout_seed,
                                        seqs)
        if self.dkdv is not None:
            self.dkdv(*tensors, dk, dv)
        self.dq(*tensors, dq)


def attention_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams,
                       deterministic: bool = False, seqs: Optional[PackedSeqs] = None) -> None:
    """dq, dk, dv <- gradients of the attention whose forward gave ``out`` and ``lse``.

    On sm90 the Gluon backward serves plain (full or causal) attention unless
    ``deterministic``: it adds dQ up across key blocks with float32 reductions. Packed batches
    take it too, except with seqused_q / seqused_k (see gluon_config). The portable path
    (preprocess, dK/dV, dQ kernels) sums every gradient in a fixed order.
    Packed batches: as :func:`attention_forward`; dk / dv rows of tokens past seqused_k
    are not written (the caller zero-fills them).
    """
    if dq.numel() == 0 and dk.numel() == 0:
        return
    if dq.numel() == 0 or q.shape[1] == 0:
        # No query attends: the keys and values got no gradient.
        dk.zero_()
        dv.zero_()
        return
    plan_key = _plan_key(params, seqs, q, k, v, out, dout, lse, dq, dk, dv)
    if plan_key is not None:
        plan_key = (deterministic, *plan_key)
        plan = _BACKWARD_PLANS.get(plan_key)
        if plan is not None:
            plan(q, k, v, out, dout, lse, dq, dk, dv, params, seqs)
            return
    arch = arch_of(q.device)
    head_dim = q.shape[3]
    max_seqlen_k = _grid_lengths(q, k, seqs)[2]
    pre_cfg = get_config(BWD_PREPROCESS, arch, head_dim, params.causal, max_seqlen_k, q.dtype)
    gluon_cfg = gluon_config(BWD_GLUON, q, k, v, params, seqs, deterministic=deterministic)
    if gluon_cfg is not None:
        plan = _gluon_backward(q, k, v, out, dout, lse, dq, dk, dv, params, gluon_cfg, pre_cfg, seqs)
    else:
        plan = _portable_backward(q, k, v, out, dout, lse, dq, dk, dv, params, pre_cfg, seqs)
    if plan_key is not None and plan is not None:
        _BACKWARD_PLANS.put(plan_key, plan)


def _gluon_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, gluon_cfg, pre_cfg,
                    seqs: Optional[PackedSeqs]) -> Optional[GluonBackward]:
    """attention_backward on the Hopper kernels; returns the plan when one launch on the given
    tensors did it all (no head chunks, no copies: a plan later calls may replay)."""
    from .gluon_backward import CANDIDATES, tma_addressable

    dout_given = dout
    dout, dk, dv, copy_back = tma_addressable(dout, dk, dv)
    # The Gluon backward adds dQ up in a float32 (b, sq, h, d) buffer: at long context, run it
    # a few heads at a time so that buffer stays small next to the inputs and gradients.
    nheads, nheads_k, head_dim = q.shape[2], k.shape[2], q.shape[3]
    chunks = gluon_head_chunks(q.shape[0], q.shape[1], nheads, nheads_k, head_dim)
    max_seqlen_k = _grid_lengths(q, k, seqs)[2]
    for h0, h1, hk0, hk1 in chunks:
        if len(chunks) == 1:
            chunk = (q, k, v, out, dout, lse, dq, dk, dv)
        else:
            chunk = (q[:, :, h0:h1], k[:, :, hk0:hk1], v[:, :, hk0:hk1], out[:, :, h0:h1], dout[:, :, h0:h1],
                     lse[:, h0:h1], dq[:, :, h0:h1], dk[:, :, hk0:hk1], dv[:, :, hk0:hk1])

        def run_gluon(cfg, chunk=chunk):
            GluonBackward(*chunk, params, cfg, pre_cfg, seqs)(*chunk, params, seqs)
        cfg = _tuned(BWD_GLUON, q, params, max_seqlen_k, gluon_cfg, CANDIDATES, run_gluon)
        plan = GluonBackward(*chunk, params, cfg, pre_cfg, seqs)
        plan(*chunk, params, seqs)
    if copy_back is not None:
        copy_back()
    return plan if len(chunks) == 1 and dout is dout_given and copy_back is None else None


def _portable_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, pre_cfg,
                       seqs: Optional[PackedSeqs]) -> PortableBackward:
    """attention_backward on the portable kernels; returns the plan."""
    arch, head_dim = arch_of(q.device), q.shape[3]
    max_seqlen_k = _grid_lengths(q, k, seqs)[2]
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
                prepared.append((delta, _portable_bwd_tensors(q, k, v, dout, lse_log2, delta, params.alibi_slopes,
                                                              params.dropout_seed, seqs)))
            return prepared[0]

        def time_config(kernel, cfg):
            delta, tensors = prepared_tensors()
            grads = (dk, dv) if kernel == BWD_DKDV else (dq,)
            _portable_bwd_call(kernel, q, k, v, dout, delta, grads, params, cfg, seqs)(*tensors, *grads)
        if k.shape[1] > 0:
            dkdv_cfg = _tuned(BWD_DKDV, q, params, max_seqlen_k, dkdv_cfg, PORTABLE_CANDIDATES[BWD_DKDV],
                              lambda c: time_config(BWD_DKDV, c))
        dq_cfg = _tuned(BWD_DQ, q, params, max_seqlen_k, dq_cfg, PORTABLE_CANDIDATES[BWD_DQ],
                        lambda c: time_config(BWD_DQ, c))
    plan = PortableBackward(q, k, v, out, dout, lse, dq, dk, dv, params, pre_cfg, dkdv_cfg, dq_cfg, seqs)
    plan(q, k, v, out, dout, lse, dq, dk, dv, params, seqs)
    return plan


def attention_probs(q, k, lse, params: ScoreParams, dtype: torch.dtype,
                    seqs: Optional[PackedSeqs] = None) -> torch.Tensor:
    """The full (b, h, sq, sk) probability matrix, dropped entries negated. N^2 memory.
    Packed batches: (batch, h, max_seqlen_q, max_seqlen_k), zero outside each sequence."""
    batch, max_seqlen_q, max_seqlen_k = _grid_lengths(q, k, seqs)
    nheads, head_dim = q.shape[2], q.shape[3]
    shape = (batch, nheads, max_seqlen_q, max_seqlen_k)
    # The kernel writes every element of a dense batch (masked ones as 0), so no memset is needed.
    probs = empty(shape, dtype, q.device) if seqs is None else torch.zeros(shape, dtype=dtype, device=q.device)
    if probs.numel() == 0:
        return probs
    cfg = get_config(FWD, arch_of(q.device), head_dim, params.causal, max_seqlen_k, q.dtype)
    attn_probs_kernel[(triton.cdiv(max_seqlen_q, cfg.block_m), nheads, batch)](
        q, k, lse, probs,
        *_bsh_strides(q), *_bsh_strides(k), *_bh_strides(lse),
        probs.stride(0), probs.stride(1), probs.stride(2), **_seq_args(seqs), **_page_args(k, seqs),
        **_shape_args(q, k, seqs), **params.kernel_args(q.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, **triton_compat.LAUNCH_OPTIONS,
    )
    return probs


def launch_kvcache_update(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table,
                          interleaved: bool, query_per_step: bool) -> torch.Tensor:
    """Rotary on q and the new k, and the new k, v written into the paged cache (k_cache: (pages,
    page_size, hk, d); a contiguous cache is a pool of one page per sequence) at positions
    cache_seqlens[b] + t, in one launch. Returns q rotated (a new tensor), or q itself without
    rotary tables."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_new = 0 if k is None else k.shape[1]
    rotary_half = 0 if rotary_cos is None else rotary_cos.shape[1]
    rows = max(seqlen_new, seqlen_q if rotary_half else 0)
    if rows == 0 or batch == 0:
        return q
    q_out = q if rotary_half == 0 else torch.empty_like(q)
    if rotary_half:
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    if k is None:  # rotary on the queries alone: the key side of the kernel does nothing
        k = v = torch.empty((batch, 0, k_cache.shape[2], head_dim), dtype=q.dtype, device=q.device)
    tensors = (q, q_out, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table)
    key = None
    if q.is_cuda and plans_enabled():
        key = (q.device, bool(interleaved), bool(query_per_step), *(tensor_signature(t) for t in tensors))

    def make() -> CompiledCall:
        return CompiledCall(
            kvcache_update_kernel, (rows, max(nheads, k_cache.shape[2]), batch),
            (*tensors, q.stride(0), q.stride(1), q.stride(2), q_out.stride(0), q_out.stride(1), q_out.stride(2),
             k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
             v_cache.stride(2), 0 if rotary_cos is None else rotary_cos.stride(0), block_table.stride(0),
             seqlen_q, seqlen_new, nheads, k_cache.shape[2], k_cache.shape[1], k_cache.shape[0]),
            dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), ROTARY_HALF=rotary_half,
                 BLOCK_HALF=max(triton.next_power_of_2(max(rotary_half, 1)), 1), INTERLEAVED=bool(interleaved),
                 QUERY_PER_STEP=bool(query_per_step)),
            slots=("Q", "QOut", "K", "V", "KCache", "VCache", "Cos", "Sin", "CacheSeqlens", "BlockTable"))
    _KVCACHE_UPDATE_PLANS.get_or_make(key, make)(*tensors)
    return q_out
