"""Host side of the portable Triton kernels: kernel arguments, grids and launch plans.

Tensors arrive as (batch, seqlen, heads, head_dim) views with a unit-stride last dim; outputs are
preallocated by the caller, so packed layouts (qkv, kv) and their gradients are written in place
without copies. A packed (varlen) batch arrives as (1, total, heads, head_dim) views, lse as
(1, heads, total), plus a :class:`~flashtile.options.PackedSeqs` saying where each sequence lives;
the same kernels serve both (see seqlens.py). Which kernels and configs a call gets is decided in
flashtile/dispatch.py; the classes here are the launch plans it keeps per call signature.
"""

import dataclasses
from typing import Optional

import torch
import triton

from ... import triton_compat
from ...configs import BWD_DKDV, BWD_DQ, DECODE_MAX_ROWS, FWD, FWD_DECODE, get_config, padded_head_dim, tile_head_dim
from ...options import PackedSeqs, ScoreParams, grid_lengths
from ...runtime import arch_of, empty, programmatic_launch
from ..hopper.tma import TileDescriptorTemplate, tma_aligned
from ..plans import CompiledCall, PlanCache, tensor_signature
from ..plans import enabled as plans_enabled
from .backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .combine import attn_combine_kernel
from .forward import attn_fwd_kernel
from .kvcache_update import kvcache_update_kernel
from .mods import block_mask_classes_kernel
from .probs import attn_probs_kernel


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


def _row_stride(lse: torch.Tensor) -> dict:
    """The forward's and the combine's stride_lse_r where lse rows are not contiguous (else the
    kernels' default 1, which the C export's bindings assume)."""
    return {} if lse.stride(2) == 1 else {"stride_lse_r": lse.stride(2)}


def _shape_args(q: torch.Tensor, k: torch.Tensor, seqs: Optional[PackedSeqs] = None) -> dict:
    """Sizes every kernel takes: seqlen_q / seqlen_k are the packed totals when varlen (for a
    paged cache no total bounds the keys: the block table does, in the kernel)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = 2**31 - 1 if seqs is not None and seqs.paged else k.shape[1]
    return dict(nheads=nheads, head_group=nheads // k.shape[2], seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim))


def _value_dim_args(q: torch.Tensor, v: torch.Tensor) -> dict:
    """HEAD_DIM_V / BLOCK_DV where V's head dim (and the output's) differs from Q's and K's; none
    otherwise (the kernels then use Q's, and compile as before)."""
    if v.shape[-1] == q.shape[-1]:
        return {}
    return dict(HEAD_DIM_V=v.shape[-1], BLOCK_DV=padded_head_dim(v.shape[-1]))


def fit_block_mask(cfg, params: ScoreParams):
    """``cfg`` with tiles that divide the blocks of the call's block mask (its tiles then lie inside
    one block each, whose class is theirs); unchanged without one. Both are powers of two."""
    block_mask = None if params.mods is None else params.mods.block_mask
    if block_mask is None:
        return cfg
    block_q, block_k = block_mask.block_size
    return dataclasses.replace(cfg, block_m=min(cfg.block_m, block_q), block_n=min(cfg.block_n, block_k))


def forward_kernel(q, k, seqs: Optional[PackedSeqs]) -> str:
    """Which portable forward config serves the call: FWD_DECODE for packed batches of a few
    query rows per sequence (kv-cache decoding), FWD otherwise."""
    _, max_seqlen_q, _ = grid_lengths(q, k, seqs)
    return FWD_DECODE if seqs is not None and max_seqlen_q <= DECODE_MAX_ROWS else FWD


def launch_forward(q, k, v, out, lse, params: ScoreParams, cfg, seqs: Optional[PackedSeqs] = None,
                   splits: Optional[tuple] = None, pack_gqa: bool = False, launch_dependents: int = 0) -> None:
    """The portable forward with an explicit config (the autotuner times several). ``splits``:
    (num_splits, keys_per_split, split stride of out, of lse) for attention_forward_split;
    ``pack_gqa``: a GQA group's query heads share each tile (decode-shaped calls); ``launch_dependents``:
    when the next launch (a split-KV combine) may start (dependents_launch_point)."""
    PortableForward(q, k, v, out, lse, params, cfg, seqs, splits, pack_gqa, launch_dependents)(
        q, k, v, out, lse, params, seqs)


class PortableForward:
    """The portable forward kernel for one call signature (kernels/plans.py): grid, configs and
    scalar arguments worked out once; a call passes its tensors (TMA descriptors of them on the
    dense TMA path). Later calls must match the first one's shapes, strides, dtypes, 16-byte
    alignment and scalar options (the plan key's job)."""

    def __init__(self, q, k, v, out, lse, params: ScoreParams, cfg, seqs: Optional[PackedSeqs] = None,
                 splits: Optional[tuple] = None, pack_gqa: bool = False, launch_dependents: int = 0):
        batch, max_seqlen_q, max_seqlen_k = grid_lengths(q, k, seqs)
        nheads, head_dim = q.shape[2], q.shape[3]
        cfg = fit_block_mask(cfg, params)
        if pack_gqa:  # tiles of (query row, head of the group) rows, one program column per kv head
            max_seqlen_q, nheads = max_seqlen_q * (nheads // k.shape[2]), k.shape[2]
        block_d = padded_head_dim(head_dim)
        # Descriptors address (batch, row) tiles: dense only (a packed sequence's last tile would
        # be stored over the next sequence's rows).
        use_tma = (cfg.use_tma and seqs is None and splits is None and not pack_gqa
                   and all(tma_aligned(t) for t in (q, k, v, out)))
        self.tiles = None
        if use_tma:
            rows = (cfg.block_m, cfg.block_n, cfg.block_n, cfg.block_m)
            widths = (block_d, block_d, padded_head_dim(v.shape[-1]), padded_head_dim(v.shape[-1]))
            self.tiles = tuple(TileDescriptorTemplate(t, r, w) for t, r, w in zip((q, k, v, out), rows, widths))
        num_splits, keys_per_split, split_stride_o, split_stride_lse = splits or (1, 0, 0, 0)
        grid = (triton.cdiv(max_seqlen_q, cfg.block_m) * num_splits, nheads, batch)
        pages = _page_args(k, seqs)
        self.call = CompiledCall(
            attn_fwd_kernel, grid,
            (q, k, v, out, lse,
             *_bsh_strides(q), *_bsh_strides(k), *_bsh_strides(v), *_bsh_strides(out), *_bh_strides(lse)),
            dict(**_seq_args(seqs), **pages, **_shape_args(q, k, seqs), **_value_dim_args(q, v),
                 **params.kernel_args(q.dtype), KeyShift=None, num_splits=num_splits, keys_per_split=keys_per_split,
                 split_stride_o=split_stride_o, split_stride_lse=split_stride_lse, SPLIT_KV=splits is not None,
                 SCALE_IN_EXP2=params.scaled_dot_products, USE_TMA=use_tma,
                 WARP_SPECIALIZE=use_tma and cfg.warp_specialize, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 **({"PACK_GQA": True} if pack_gqa else {}),
                 **({"LAUNCH_DEPENDENTS": launch_dependents} if launch_dependents else {}), **_row_stride(lse),
                 **params.mod_args("fwd", seqs is not None), **_loop_in_bounds(params, seqs, max_seqlen_k, cfg.block_n),
                 **cfg.launch_kwargs()),
            slots=("Q", "K", "V", "Out", "Lse", "AlibiSlopes", "DropoutSeed", "Sink", "CuSeqlensQ", "CuSeqlensK",
                   "SeqUsedQ", "SeqUsedK", "BlockTable", "KeyShift"))

    def __call__(self, q, k, v, out, lse, params: ScoreParams, seqs: Optional[PackedSeqs] = None):
        tiles = (q, k, v, out) if self.tiles is None else tuple(t(x) for t, x in zip(self.tiles, (q, k, v, out)))
        tensors = (lse, params.alibi_slopes, params.dropout_seed, params.learnable_sink)
        if seqs is None:
            self.call(*tiles, *tensors, None, None, None, None, None, None)
        else:
            self.call(*tiles, *tensors, seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_q, seqs.seqused_k,
                      seqs.block_table, seqs.key_shift)


COMBINE_ROWS = 1  # rows of the split-KV combine's programs


def dependents_launch_point(head_dim: int) -> int:
    """Where the split forward lets its combine launch (attn_fwd_kernel's LAUNCH_DEPENDENTS): once every
    program has started at head dims up to 64, once every program has folded its keys above, where the
    combine's programs starting beside one d128 program per multiprocessor slowed it (the H200 A/B:
    docs/experiments.md, 2026-12-02)."""
    return 1 if padded_head_dim(head_dim) <= 64 else 2


def forward_config(kernel: str, q, v, params: ScoreParams, max_seqlen_k: int, seqs: Optional[PackedSeqs],
                   arch: Optional[str] = None):
    """The config of a portable forward ``kernel`` for this call: the override, else the table row of
    its arch, tile head dim, mask, longest key length, dtype and whether keys are read through pages."""
    return get_config(kernel, arch or arch_of(q.device), tile_head_dim(q, v), params.causal, max_seqlen_k, q.dtype,
                      paged=seqs is not None and seqs.paged)


class SplitForward:
    """attention_forward_split for one call signature (kernels/plans.py): the split forward writes
    float32 partial outputs and logsumexps (allocated per call), the combine kernel merges them.
    With one split left (too few keys), the plain portable forward."""

    def __init__(self, q, k, v, out, lse, params: ScoreParams, seqs: PackedSeqs, num_splits: int, cfg=None,
                 pack_gqa: bool = False, overlap: Optional[bool] = None):
        _, _, max_seqlen_k = grid_lengths(q, k, seqs)
        if cfg is None:  # the dispatcher's choice (an explicit one: the C export's captures)
            cfg = forward_config(forward_kernel(q, k, seqs), q, v, params, max_seqlen_k, seqs)
        self.cfg = cfg
        split_keys = triton.cdiv(max(max_seqlen_k, 1), max(num_splits, 1))
        keys_per_split = triton.cdiv(split_keys, cfg.block_n) * cfg.block_n
        num_splits = triton.cdiv(max(max_seqlen_k, 1), keys_per_split)  # no split is left without keys
        self.combine = None
        if num_splits <= 1:
            self.forward = PortableForward(q, k, v, out, lse, params, cfg, seqs, pack_gqa=pack_gqa)
            return
        parts_shapes = ((num_splits,) + tuple(out.shape), (num_splits,) + tuple(lse.shape))
        # The layouts of the partial buffers, without memory. Each call allocates both as one float32 buffer
        # (one allocation: host time), the logsumexps from the first 16-byte boundary after the outputs.
        out_parts, lse_parts = (torch.empty(shape, dtype=torch.float32, device="meta") for shape in parts_shapes)
        self.lse_offset = (out_parts.numel() + 3) // 4 * 4
        self.parts_numel = self.lse_offset + lse_parts.numel()
        # On sm90 the combine is a programmatic dependent launch (``overlap``; None: where the device has
        # them): its launch overlaps the split forward's last programs instead of following the kernel's
        # end, a gap a decode step of a few microseconds would otherwise pay.
        if overlap is None:
            overlap = programmatic_launch(q.device)
        self.forward = PortableForward(q, k, v, out_parts[0], lse_parts[0], params, cfg, seqs,
                                       splits=(num_splits, keys_per_split, out_parts.stride(0), lse_parts.stride(0)),
                                       pack_gqa=pack_gqa,
                                       launch_dependents=dependents_launch_point(tile_head_dim(q, v)) if overlap else 0)
        batch, rows, nheads, head_dim = out.shape
        # One row per program (a decode step has few rows: programs come from rows and heads, and
        # the C export's binding assumes one), and all splits in one tile up to 8K floats.
        block_r, block_d = COMBINE_ROWS, padded_head_dim(head_dim)
        block_s = min(triton.next_power_of_2(num_splits), max(1, 8192 // (block_r * block_d)))
        self.combine = CompiledCall(
            attn_combine_kernel, (triton.cdiv(rows, block_r), nheads, batch),
            (None, None, None, None, *out_parts.stride()[:4], *lse_parts.stride()[:3], out.stride(0), out.stride(1),
             out.stride(2), lse.stride(0), lse.stride(1), rows, num_splits),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_S=block_s, **_row_stride(lse),
                 **({"WAIT_PRIOR": True, "launch_pdl": True} if overlap else {})),
            slots=("OutPartial", "LsePartial", "Out", "Lse", "Sink"))

    def __call__(self, q, k, v, out, lse, params: ScoreParams, seqs: PackedSeqs):
        if self.combine is None:
            self.forward(q, k, v, out, lse, params, seqs)
            return
        # The launches read only the buffers' addresses (the plans hold the layouts): flat views serve.
        parts = torch.empty(self.parts_numel, dtype=torch.float32, device=out.device)
        lse_parts = parts[self.lse_offset:]
        self.forward(q, k, v, parts, lse_parts, params, seqs)
        self.combine(parts, lse_parts, out, lse, params.learnable_sink)


def row_stats_buffers(lse: torch.Tensor, device=None) -> tuple:
    """Two float32 buffers shaped like lse (b, h, sq) for the backward's delta and lse_log2, rows
    padded to a multiple of 4 values (the Hopper backward streams them in 16-byte aligned boxes).
    On lse's device, or ``device`` ("meta": their layout for a plan, without memory)."""
    seqlen_q = lse.shape[2]
    buf = torch.empty(row_stats_shape(lse), device=device or lse.device, dtype=torch.float32)
    return buf[0, :, :, :seqlen_q], buf[1, :, :, :seqlen_q]


def row_stats_shape(lse: torch.Tensor) -> tuple:
    """The shape of the one buffer under row_stats_buffers' two: (2, b, h, sq padded to 4)."""
    batch, nheads, seqlen_q = lse.shape
    return 2, batch, nheads, (seqlen_q + 3) // 4 * 4


def row_stats_by_shape(shape: tuple, device: torch.device) -> tuple:
    """row_stats_buffers for a plan's call, from the plan's row_stats_shape: the same addresses, with
    the padded row ends (the plan holds the strides), and no shape read from the call's tensors."""
    return torch.empty(shape, device=device, dtype=torch.float32).unbind(0)


def launch_preprocess(out, dout, lse, delta, lse_log2, seqs: Optional[PackedSeqs] = None,
                      block_m: int = 64, num_warps: int = 4, zero: Optional[torch.Tensor] = None,
                      zero_counts: Optional[torch.Tensor] = None) -> None:
    """delta <- rowsum(dout * out), lse_log2 <- lse * log2(e) (+inf for rows without keys).
    zero: None, or a float32 tensor shaped like out (but for its head dim: q's) whose rows (each
    sequence's used rows, when packed) are zeroed in the same pass. zero_counts: None, or an int32
    (batch, nheads_k) tensor zeroed too (nheads_k <= the heads of out)."""
    preprocess_call(out, dout, lse, delta, lse_log2, seqs, block_m, num_warps, zero, zero_counts)(
        out, dout, lse, delta, lse_log2, zero, zero_counts, *preprocess_seq_tensors(seqs), None, None)


class SinkGrad:
    """The learnable sink's gradient in a backward (kernels/portable/sink.py): the preprocess writes
    one partial sum per program into a float32 buffer shaped (batch, nheads, programs along axis 0)
    (the call's ``parts()``), and ``finish`` sums them per head into dsink, in a fixed order."""

    def __init__(self, out, seqs: Optional[PackedSeqs], block_m: int):
        batch, max_seqlen_q, _ = grid_lengths(out, out, seqs)
        self.shape, self.device = (batch, out.shape[2], triton.cdiv(max_seqlen_q, block_m)), out.device

    def parts(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=torch.float32, device=self.device)

    @staticmethod
    def finish(parts: torch.Tensor, dsink: torch.Tensor) -> None:
        torch.sum(parts, dim=(0, 2), out=dsink)


def preprocess_seq_tensors(seqs: Optional[PackedSeqs]) -> tuple:
    args = _seq_args(seqs)
    return args["CuSeqlensQ"], args["SeqUsedQ"]


def preprocess_call(out, dout, lse, delta, lse_log2, seqs: Optional[PackedSeqs] = None, block_m: int = 64,
                    num_warps: int = 4, zero: Optional[torch.Tensor] = None,
                    zero_counts: Optional[torch.Tensor] = None) -> CompiledCall:
    """:func:`launch_preprocess` for these tensors' signature, as a CompiledCall taking (out, dout,
    lse, delta, lse_log2, zero, zero_counts, cu_seqlens_q, seqused_q, sink, sink_grad_parts) (the last
    two None, or a learnable sink and SinkGrad.parts())."""
    batch, max_seqlen_q, _ = grid_lengths(out, out, seqs)
    nheads, head_dim = out.shape[2], out.shape[3]
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.shape[:-1] == out.shape[:-1] and zero.stride(-1) == 1
    if zero_counts is not None:
        assert zero_counts.dtype == torch.int32 and zero_counts.is_contiguous() and zero_counts.dim() == 2
        assert zero_counts.shape[0] == batch and zero_counts.shape[1] <= nheads
    return CompiledCall(
        attn_bwd_preprocess_kernel, (triton.cdiv(max_seqlen_q, block_m), nheads, batch),
        (out, dout, lse, delta, lse_log2, *_bsh_strides(out), *_bsh_strides(dout), *_bh_strides(lse),
         *_bh_strides(delta), *preprocess_seq_tensors(seqs), zero,
         *(_bsh_strides(zero) if zero is not None else (0, 0, 0)), zero_counts,
         0 if zero_counts is None else zero_counts.shape[1], nheads, out.shape[1]),
        dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=block_m, IS_VARLEN=seqs is not None,
             num_warps=num_warps, **({} if zero is None or zero.shape[-1] == head_dim else
                                     dict(HEAD_DIM_ZERO=zero.shape[-1], BLOCK_D_ZERO=padded_head_dim(zero.shape[-1])))),
        slots=("Out", "DOut", "Lse", "Delta", "LseLog2", "ZeroRows", "ZeroCounts", "CuSeqlensQ", "SeqUsedQ", "Sink",
               "SinkGradParts"))


# The tensor arguments of the portable dK/dV and dQ kernels that change from call to call.
_PORTABLE_BWD_SLOTS = ("Q", "K", "V", "DOut", "LseLog2", "Delta", "CuSeqlensQ", "CuSeqlensK", "SeqUsedQ", "SeqUsedK",
                       "AlibiSlopes", "DropoutSeed")


def _loop_in_bounds(params: ScoreParams, seqs: Optional[PackedSeqs], loop_length: int, block: int) -> dict:
    """LOOP_IN_BOUNDS for a dense call with mods whose loop axis (keys; queries in the dK/dV kernel)
    ends on a tile edge: no tile passes the sequence's end, and the mods see those positions
    unclamped (scores.mod_positions), so that loads along them vectorize."""
    if params.mods is None or seqs is not None or loop_length % block:
        return {}
    return {"LOOP_IN_BOUNDS": True}


def portable_bwd_call(kernel: str, q, k, v, dout, delta, grads: tuple, params: ScoreParams, cfg,
                       seqs: Optional[PackedSeqs]) -> CompiledCall:
    """The portable dK/dV (kernel BWD_DKDV, grads (dk, dv)) or dQ (BWD_DQ, grads (dq,)) launch,
    taking portable_bwd_tensors(...) + grads."""
    batch, max_seqlen_q, max_seqlen_k = grid_lengths(q, k, seqs)
    cfg = fit_block_mask(cfg, params)
    if kernel == BWD_DKDV:
        fn, grid, names = attn_bwd_dkdv_kernel, (triton.cdiv(max_seqlen_k, cfg.block_n), k.shape[2], batch), ("DK", "DV")
    else:
        fn, grid, names = attn_bwd_dq_kernel, (triton.cdiv(max_seqlen_q, cfg.block_m), q.shape[2], batch), ("DQ",)
    grad_strides = [s for g in grads for s in _bsh_strides(g)]
    return CompiledCall(
        fn, grid,
        (q, k, v, dout, None, delta, *grads, *_bsh_strides(q), *_bsh_strides(k), *_bsh_strides(v),
         *_bsh_strides(dout), *grad_strides, *_bh_strides(delta)),
        dict(**_seq_args(seqs), softmax_scale=params.softmax_scale, **_shape_args(q, k), **_value_dim_args(q, v),
             **params.kernel_args(q.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
             **params.mod_args("dkdv" if kernel == BWD_DKDV else "dq", seqs is not None),
             **(_loop_in_bounds(params, seqs, max_seqlen_q, cfg.block_m) if kernel == BWD_DKDV else
                _loop_in_bounds(params, seqs, max_seqlen_k, cfg.block_n)), **cfg.launch_kwargs()),
        slots=_PORTABLE_BWD_SLOTS + names)


def portable_bwd_tensors(q, k, v, dout, lse_log2, delta, alibi_slopes, dropout_seed,
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
        self.stats_shape, self.device = row_stats_shape(lse), lse.device
        self.preprocess = preprocess_call(out, dout, lse, delta, lse_log2, seqs, pre_cfg.block_m, pre_cfg.num_warps)
        self.sink_grad = None if params.learnable_sink is None else SinkGrad(out, seqs, pre_cfg.block_m)
        # No key: no dK / dV to compute (dq still gets its zeros from the dQ kernel).
        self.dkdv = None if k.shape[1] == 0 else portable_bwd_call(BWD_DKDV, q, k, v, dout, delta, (dk, dv), params,
                                                                     dkdv_cfg, seqs)
        self.dq = portable_bwd_call(BWD_DQ, q, k, v, dout, delta, (dq,), params, dq_cfg, seqs)

    def __call__(self, q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, seqs: Optional[PackedSeqs] = None,
                 dsink: Optional[torch.Tensor] = None):
        """dsink: a float32 (nheads,) tensor for the learnable sink's gradient, with a sink."""
        delta, lse_log2 = row_stats_by_shape(self.stats_shape, self.device)
        sink_parts = None if self.sink_grad is None else self.sink_grad.parts()
        self.preprocess(out, dout, lse, delta, lse_log2, None, None, *preprocess_seq_tensors(seqs),
                        params.learnable_sink, sink_parts)
        tensors = portable_bwd_tensors(q, k, v, dout, lse_log2, delta, params.alibi_slopes, params.dropout_seed,
                                        seqs)
        if self.dkdv is not None:
            self.dkdv(*tensors, dk, dv)
        self.dq(*tensors, dq)
        if sink_parts is not None:
            SinkGrad.finish(sink_parts, dsink)


def attention_probs(q, k, lse, params: ScoreParams, dtype: torch.dtype, seqs: Optional[PackedSeqs] = None,
                    cfg=None) -> torch.Tensor:
    """The full (b, h, sq, sk) probability matrix, dropped entries negated. N^2 memory.
    Packed batches: (batch, h, max_seqlen_q, max_seqlen_k), zero outside each sequence. cfg: the
    forward's table config by default."""
    batch, max_seqlen_q, max_seqlen_k = grid_lengths(q, k, seqs)
    nheads, head_dim = q.shape[2], q.shape[3]
    shape = (batch, nheads, max_seqlen_q, max_seqlen_k)
    # The kernel writes every element of a dense batch (masked ones as 0), so no memset is needed.
    probs = empty(shape, dtype, q.device) if seqs is None else torch.zeros(shape, dtype=dtype, device=q.device)
    if probs.numel() == 0:
        return probs
    if cfg is None:
        cfg = get_config(FWD, arch_of(q.device), head_dim, params.causal, max_seqlen_k, q.dtype)
    attn_probs_kernel[(triton.cdiv(max_seqlen_q, cfg.block_m), nheads, batch)](
        q, k, lse, probs,
        *_bsh_strides(q), *_bsh_strides(k), *_bh_strides(lse),
        probs.stride(0), probs.stride(1), probs.stride(2), **_seq_args(seqs), **_page_args(k, seqs),
        **_shape_args(q, k, seqs), **params.kernel_args(q.dtype), **params.mod_args("probs", seqs is not None),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **triton_compat.LAUNCH_OPTIONS,
    )
    return probs


class KVCacheUpdate:
    """The kv-cache update of one call signature (kernels/plans.py): rotary on q and the new k, and
    the new k, v written into the paged cache (k_cache: (pages, page_size, hk, d); a contiguous cache
    is a pool of one page per sequence) at positions cache_seqlens[b] + t, in one launch. A call
    returns (q rotated (a new tensor), or q itself without rotary tables; the keys each sequence
    holds now, cache_seqlens + seqlen_new, an int32 (batch,) tensor: the launch writes it, or without
    a launch it is cache_seqlens itself)."""

    def __init__(self, q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table,
                 interleaved: bool, query_per_step: bool):
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_new = 0 if k is None else k.shape[1]
        self.rotary_half = 0 if rotary_cos is None else rotary_cos.shape[1]
        rows = max(seqlen_new, seqlen_q if self.rotary_half else 0)
        self.call = None
        if rows == 0 or batch == 0:
            return
        # Rotary on the queries alone: the key side of the kernel does nothing (an empty k, v).
        self.no_keys = (batch, 0, k_cache.shape[2], head_dim) if k is None else None
        k, v = self._keys(q, k, v)
        q_out = q if self.rotary_half == 0 else torch.empty_like(q, device="meta")  # its layout: made per call
        self.call = CompiledCall(
            kvcache_update_kernel, (rows, max(nheads, k_cache.shape[2]), batch),
            (q, q_out, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table, cache_seqlens,
             q.stride(0), q.stride(1), q.stride(2), q_out.stride(0), q_out.stride(1), q_out.stride(2),
             k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
             v_cache.stride(2), 0 if rotary_cos is None else rotary_cos.contiguous().stride(0), block_table.stride(0),
             seqlen_q, seqlen_new, nheads, k_cache.shape[2], k_cache.shape[1], k_cache.shape[0],
             block_table.shape[1]),
            dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), ROTARY_HALF=self.rotary_half,
                 BLOCK_HALF=max(triton.next_power_of_2(max(self.rotary_half, 1)), 1), INTERLEAVED=bool(interleaved),
                 QUERY_PER_STEP=bool(query_per_step), **_value_dim_args(k_cache, v_cache)),
            slots=("Q", "QOut", "K", "V", "KCache", "VCache", "Cos", "Sin", "CacheSeqlens", "BlockTable",
                   "SeqUsedK"))

    def _keys(self, q, k, v) -> tuple:
        if self.no_keys is None:
            return k, v
        empty_keys = torch.empty(self.no_keys, dtype=q.dtype, device=q.device)
        return empty_keys, empty_keys

    def __call__(self, q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table) -> tuple:
        if self.call is None:
            return q, cache_seqlens
        q_out = q if self.rotary_half == 0 else torch.empty_like(q)
        seqused_k = torch.empty_like(cache_seqlens)
        if self.rotary_half:
            rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
        k, v = self._keys(q, k, v)
        self.call(q, q_out, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table, seqused_k)
        return q_out, seqused_k


_KVCACHE_UPDATE_PLANS = PlanCache()


def kvcache_update_plan(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table,
                        interleaved: bool, query_per_step: bool) -> KVCacheUpdate:
    """The :class:`KVCacheUpdate` of this call's signature (kept per signature; a new one when no plan
    may serve the call). ``block_table``: the pages (a contiguous cache: its rows, one per page)."""
    key = None
    if q.is_cuda and plans_enabled():
        key = (q.device, bool(interleaved), bool(query_per_step),
               *(tensor_signature(t) for t in (q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens,
                                                block_table)))
    return _KVCACHE_UPDATE_PLANS.get_or_make(key, lambda: KVCacheUpdate(
        q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table, interleaved, query_per_step))


def launch_kvcache_update(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table,
                          interleaved: bool, query_per_step: bool) -> tuple:
    """Run :class:`KVCacheUpdate` for this call: (q rotated or q, the keys each sequence holds now)."""
    plan = kvcache_update_plan(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table,
                               interleaved, query_per_step)
    return plan(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, block_table)


def block_mask_classes(mask_mod, mask_aux: tuple, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                       block_q: int, block_k: int, device) -> torch.Tensor:
    """int8 (batch, nheads, query blocks, key blocks): 0 where ``mask_mod`` keeps nothing of a block,
    2 where it keeps all of it (inside the sequences), 1 otherwise (flashtile/block_mask.py)."""
    shape = (batch, nheads, triton.cdiv(seqlen_q, block_q), triton.cdiv(seqlen_k, block_k))
    classes = torch.empty(shape, dtype=torch.int8, device=device)
    if classes.numel() == 0:
        return classes
    block_mask_classes_kernel[(shape[2], shape[3], batch * nheads)](
        classes, classes.stride(0), classes.stride(1), classes.stride(2), nheads, seqlen_q, seqlen_k, mask_aux,
        MASK_MOD=mask_mod, BLOCK_Q=block_q, BLOCK_K=block_k, SUB_Q=min(block_q, max(1, 4096 // block_k)),
        **triton_compat.LAUNCH_OPTIONS)
    return classes
