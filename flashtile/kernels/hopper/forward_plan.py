"""Host side of the Hopper forward (forward.py): the launch plan of one call signature (grid,
TMA descriptor layouts, kernel arguments), the register cap for several CTAs per SM, and the group
size of causal grids."""

from dataclasses import replace

import torch
import triton

from ...configs import GluonFwdConfig, padded_head_dim
from ..plans import CompiledCall
from .forward import ROWS_PER_CONSUMER, gluon_attn_fwd_kernel
from .scores import UNBOUNDED_WINDOW
from .tma import BiasDescriptorTemplate, DescriptorTemplate, attn_bias_arguments, multiprocessors, qkv_supported

LOG2E = 1.4426950408889634


def supported(q, k, v, causal) -> bool:
    """Whether this kernel takes these tensors (see hopper.qkv_supported)."""
    return qkv_supported(q, k, v)


def gluon_attention_forward(q, k, v, out, lse, softmax_scale: float, causal: bool,
                            config: GluonFwdConfig, *, cu_seqlens_q=None, cu_seqlens_k=None,
                            seqused_q=None, seqused_k=None, max_seqlen_q=None, **options) -> None:
    """out = softmax(q k^T * softmax_scale) v, lse = its natural-log logsumexp per query row.
    ``options`` (ForwardPlan's): softcap, window_left / window_right, alibi_slopes, as flash_attn's,
    learnable_sink ((h,) sink logits, taken into out and lse: kernels/portable/sink.py), and
    rel_bias_table (a float32 (h, 2 * D + 1) relative-position bias table: flashtile.mods.relative_bias),
    attn_bias (a floating-point bias with unit key stride, added to the scores) and attn_bias_strides (its
    batch, head and query strides as a (b, h, sq, sk) tensor: 0 along broadcast dimensions).

    Dense: q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv), out (b, sq, h, dv); lse (b, h, sq) float32.
    Varlen (cu_seqlens_q given): the packed tensors as batch-1 views, q, out (1, total_q, h, d),
    k, v (1, total_k, hk, d), lse (h, total_q) float32; cu_seqlens_q / cu_seqlens_k int32 (batch + 1,)
    prefix sums; seqused_q / seqused_k optional int32 (batch,): sequence b uses only the first
    seqused[b] of its rows / keys; its rows past seqused_q[b] get out 0 and lse -inf (like rows that
    see no key). max_seqlen_q (host int, at least the longest cu_seqlens_q span) sizes the grid;
    None reads it from cu_seqlens_q (a device sync). Causal is bottom-right aligned per sequence.
    Dense with seqused_k (a kv cache: k, v (b, capacity, hk, d)): batch b uses its first seqused_k[b] keys.
    Keys past a sequence's end are read and masked out; the values past seqused_k are zeroed in shared
    memory first (they may hold anything: NaN times probability 0 is still NaN). A kv cache's pages
    (``block_table``, ``key_shift``): see ForwardPlan. See supported()."""
    _launch(q, k, v, out, lse, softmax_scale, causal, config, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, **options)


def _launch(q, k, v, out, lse, softmax_scale, causal, config, **varlen):
    """Launches and returns the compiled kernel (the probe reads its register/spill counts)."""
    return make_launcher(q, k, v, out, lse, softmax_scale, causal, config, **varlen)()


def make_launcher(q, k, v, out, lse, softmax_scale, causal, config, *, cu_seqlens_q=None, cu_seqlens_k=None,
                  seqused_q=None, seqused_k=None, max_seqlen_q=None, **options):
    """A zero-argument launch with the TMA descriptors built once (timing without host overhead).
    Arguments as gluon_attention_forward's."""
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k)
    plan = ForwardPlan(q, k, v, out, lse, softmax_scale, causal, config, max_seqlen_q=max_seqlen_q, **varlen,
                       **options)
    descriptors = plan.descriptors(q, k, v, out)
    tensors = {name: options.get(name) for name in ("alibi_slopes", "learnable_sink", "rel_bias_table", "attn_bias",
                                                    "block_table", "key_shift")}
    return lambda: plan.launch(descriptors, out, lse, **tensors, **varlen)


def band_sides(causal: bool, window_left: int, window_right: int):
    """(local, left, right): whether the call has a sliding window (not plain causal attention), and
    its sides as the kernel takes them (an unbounded side as UNBOUNDED_WINDOW; causal is right 0)."""
    if causal:
        window_right = 0
    local = window_left >= 0 or (window_right >= 0 and not causal)
    if not local:
        return False, 0, 0  # unread

    def side(w):
        return w if w >= 0 else UNBOUNDED_WINDOW
    return True, side(window_left), side(window_right)


def option_arguments(softmax_scale, local: bool, window_left: int, window_right: int, softcap: float,
                     alibi_slopes, rel_bias_table=None) -> dict:
    """The score-option arguments the Hopper forward and the two-warpgroup backward take alike
    (window sides as band_sides gives them; softcap 0 and no slopes or table for none)."""
    assert alibi_slopes is None or (alibi_slopes.dtype == torch.float32 and alibi_slopes.stride(-1) == 1)
    assert rel_bias_table is None or (rel_bias_table.dtype == torch.float32 and rel_bias_table.is_contiguous()
                                      and rel_bias_table.dim() == 2 and rel_bias_table.shape[1] % 2 == 1)
    return dict(LOCAL=local, SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None, window_left=window_left,
                window_right=window_right, softcap_scale=softmax_scale / softcap if softcap > 0 else 0.0,
                softcap_log2=softcap * LOG2E if softcap > 0 else 0.0, alibi_slopes=alibi_slopes,
                stride_alibi_b=alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
                rel_bias_table=rel_bias_table,
                rel_bias_distance=0 if rel_bias_table is None else rel_bias_table.shape[1] // 2)


def register_cap(cfg: GluonFwdConfig) -> dict:
    """Launch options for cfg.ctas_per_sm CTAs per SM: ptxas' maxnreg, the registers per thread that
    let that many CTAs share an SM's 64K. The loader warp's warpgroup is launched whole (setmaxnreg
    works on warpgroups), so a CTA has num_consumers + 1 warpgroups, and their setmaxnreg split
    (consumer_regs each, loader_regs for the loader's) must fit the cap."""
    if cfg.ctas_per_sm == 1:
        return {}
    threads = 128 * (cfg.num_consumers + 1)
    maxnreg = 65536 // (cfg.ctas_per_sm * threads) // 8 * 8  # setmaxnreg counts in steps of 8
    if 128 * (cfg.num_consumers * cfg.consumer_regs + cfg.loader_regs) > threads * maxnreg:
        raise ValueError(f"{cfg}: {cfg.ctas_per_sm} CTAs per SM leave {maxnreg} registers per thread, fewer than "
                         f"the consumer_regs / loader_regs split needs")
    return {"maxnreg": maxnreg}


class ForwardPlan:
    """The Gluon forward for one call signature (kernels/plans.py): grid, kernel arguments and
    descriptor layouts worked out once; each call builds the TMA descriptors for its tensors and
    launches the compiled kernel. Later calls must match the first one's shapes, strides, dtypes
    and 16-byte alignment (the plan key's job). Arguments as gluon_attention_forward's."""

    def __init__(self, q, k, v, out, lse, softmax_scale, causal, config, *, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, max_seqlen_q=None, softcap: float = 0.0, window_left: int = -1,
                 window_right: int = -1, alibi_slopes=None, learnable_sink=None, rel_bias_table=None,
                 attn_bias=None, attn_bias_strides=(0, 0, 0), query_group: int = 1, block_table=None,
                 key_shift=None):
        """block_table (int32 (batch, pages), unit stride along the pages): k and v are a kv cache's pages
        (num_pages, page_size, hk, d), key t of sequence b at row t % page_size of page block_table[b, t //
        page_size]; page_size a multiple of the config's block_n, or one page per sequence (a contiguous cache's
        rows picked by cache_batch_idx). With it a dense call needs seqused_k. key_shift (int32 (batch,), one
        page per sequence): where each sequence's keys start in its page (cache_leftpad).
        query_group: g > 1 runs each kv head's group of g query heads as the rows of its tiles (a
        decode-shaped GQA call, launch.GluonForward's query_group): the kernel sees hk heads of sq * g rows, row
        p * g + i being query head hk * g + i at position p, and reads q and writes out and lse (the
        call's own tensors) in place. A power of two dividing 64 and the call's h / hk; no per-head
        options, no seqused_q. Packed batches: the sequences' rows are their positions times g
        (max_seqlen_q counts positions)."""
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        if query_group > 1:
            assert nheads == nheads_k * query_group
            seqlen_q, nheads = seqlen_q * query_group, nheads_k
        local, window_left, window_right = band_sides(causal, window_left, window_right)
        if query_group > 1 and causal and not local:
            # Packed GQA rows span few positions: every tile has about the same key blocks, so the causal
            # schedules (pairs of tiles, longest first) would only idle CTAs. The diagonal as a band.
            local, window_left, window_right = True, UNBOUNDED_WINDOW, 0
        cfg = config
        if local:
            # A window's tiles all have about the same key blocks: tiles in order, none of the causal
            # schedules (pairs, own key ranges, a trimmed diagonal).
            causal = False
            cfg = replace(cfg, own_key_range=False, trim_diagonal=False)
        assert lse.stride(-1) == 1 and out.stride(-1) == 1
        if query_group > 1:
            assert 64 % query_group == 0 and query_group & (query_group - 1) == 0
            assert alibi_slopes is None and learnable_sink is None and rel_bias_table is None and attn_bias is None
            assert seqused_q is None and not causal
        assert not cfg.pingpong or cfg.num_consumers >= 2
        # Ping-pong counts every warpgroup's issue points per tile alike; trimming is the d64 pair's.
        assert not cfg.own_key_range or not (cfg.pingpong or cfg.trim_diagonal)
        assert softmax_scale > 0, "the row max is taken before scaling: other scales take the portable kernel"
        assert rel_bias_table is None or rel_bias_table.shape[0] == nheads
        assert attn_bias is None or (attn_bias.stride(-1) == 1 and attn_bias.shape[-1] > 1)
        # attn_bias's tiles come through the K ring when TMA can address the bias; the ring's shared memory
        # leaves no room for the persistent grid's O staging buffer.
        self.bias_template = None
        if attn_bias is not None:
            template = BiasDescriptorTemplate(attn_bias, attn_bias_strides, ROWS_PER_CONSUMER, cfg.block_n)
            if template.supported:
                self.bias_template = template
                cfg = replace(cfg, persistent=False)
        varlen = cu_seqlens_q is not None
        if varlen:
            assert cu_seqlens_k is not None and batch == 1 and (k.shape[0] == 1 or block_table is not None)
            assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
            assert cu_seqlens_k.numel() == cu_seqlens_q.numel() and lse.dim() == 2
            for t in (seqused_q, seqused_k):
                assert t is None or (t.dtype == torch.int32 and t.numel() == cu_seqlens_q.numel() - 1)
            n_seqs = cu_seqlens_q.numel() - 1
            if max_seqlen_q is None:
                max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if n_seqs > 0 else 0
            # (query block, head, sequence); lse is (h, total_q), the sequence offset is added in the kernel.
            grid = (triton.cdiv(max_seqlen_q * query_group, cfg.block_m), nheads, n_seqs)
            lse_strides = (0, lse.stride(0))
            out_strides = (out.stride(1), out.stride(2))
            persistent = False
        else:
            assert cu_seqlens_k is None and seqused_q is None
            assert seqused_k is None or (seqused_k.dtype == torch.int32 and seqused_k.numel() == batch)
            # Query blocks of one head are adjacent in launch order so they share K/V in L2.
            grid = (triton.cdiv(seqlen_q, cfg.block_m), nheads, batch)
            lse_strides = (lse.stride(0), lse.stride(1))
            out_strides = (None, None)
            # The persistent loop reads no seqused_k (the loader zeroes V past it once per CTA).
            persistent = cfg.persistent and seqused_k is None and block_table is None
        if block_table is not None:
            pages, page_size = block_table.shape[1], k.shape[1]
            assert block_table.dtype == torch.int32 and block_table.stride(1) == 1 and v.shape[1] == page_size
            assert page_size % cfg.block_n == 0 or pages == 1, "a key block must not span two pages"
            assert key_shift is None or pages == 1
            assert varlen or seqused_k is not None
            table_args = dict(stride_table=block_table.stride(0), page_size=page_size, table_keys=pages * page_size)
        else:
            assert key_shift is None
            table_args = {}
        # Causal per-tile grids (dense) take their tiles longest first, a group of heads at a time
        # (tile_order.py); None: one head after another (no remap compiled in).
        group = None
        if causal and not varlen and not persistent and cfg.heads_per_group != 1:
            group = cfg.heads_per_group or heads_per_group(grid[0], grid[1] * grid[2], multiprocessors(q.device))
        self.varlen = varlen
        self.call = None
        if min(grid) == 0:
            return
        if persistent:
            # ctas_per_sm CTAs per SM (one, unless the config caps registers to fit more), each taking
            # work units round robin: query tiles in the order above, or causal pairs of them (the
            # kernel's _dense_units).
            units = (triton.cdiv(grid[0], 2) if causal else grid[0]) * grid[1] * grid[2]
            grid = (min(units, cfg.ctas_per_sm * multiprocessors(q.device)), 1, 1)

        # Tiles are block_d wide: a head dim that is not a power of two (96, 192) gets boxes wider than
        # the tensors, whose missing columns TMA reads as zeros and never writes.
        block_d, head_dim_v = padded_head_dim(head_dim), v.shape[-1]
        self.q_tiles = DescriptorTemplate(q, ROWS_PER_CONSUMER, block_d, query_group)
        self.o_tiles = DescriptorTemplate(out, ROWS_PER_CONSUMER, padded_head_dim(head_dim_v), query_group)
        self.k_tiles = DescriptorTemplate(k, cfg.block_n, block_d)
        self.v_tiles = DescriptorTemplate(v, cfg.block_n, padded_head_dim(head_dim_v))
        self.call = CompiledCall(
            gluon_attn_fwd_kernel, grid,
            (None, None, None, None, lse, *lse_strides, seqlen_q, seqlen_k, nheads, nheads // nheads_k, batch, group,
             softmax_scale * LOG2E, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, out if varlen else None,
             *out_strides),
            dict(BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, NUM_CONSUMERS=cfg.num_consumers,
                 CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs, PINGPONG=cfg.pingpong,
                 CAUSAL=bool(causal), IS_VARLEN=varlen, HEAD_DIM_TRUE=head_dim, PERSISTENT=persistent,
                 ROW_SUM_MMA=cfg.row_sum_mma,
                 TRIM_DIAGONAL=bool(cfg.trim_diagonal and causal and block_d == 64 and head_dim_v == head_dim
                                    and cfg.block_n == 128),
                 OWN_KEY_RANGE=bool(cfg.own_key_range and causal),
                 **option_arguments(softmax_scale, local, window_left, window_right, softcap, alibi_slopes,
                                    rel_bias_table),
                 **({} if head_dim_v == head_dim else {"HEAD_DIM_V_TRUE": head_dim_v}), sink_ptr=learnable_sink,
                 **({} if attn_bias is None else attn_bias_arguments(attn_bias_strides, self.bias_template)),
                 **({} if query_group == 1 else {"QUERY_GROUP": query_group}), block_table=block_table,
                 key_shift=key_shift, **table_args, num_warps=4, **register_cap(cfg)),
            slots=("q_desc", "k_desc", "v_desc", "o_desc", "lse_ptr", "cu_seqlens_q", "cu_seqlens_k", "seqused_q",
                   "seqused_k", "o_ptr", "alibi_slopes", "sink_ptr", "rel_bias_table", "attn_bias", "bias_desc",
                   "block_table", "key_shift"))

    def descriptors(self, q, k, v, out) -> tuple:
        """The TMA descriptors of one call's tensors (q, k, v, o order)."""
        return self.q_tiles(q), self.k_tiles(k), self.v_tiles(v), self.o_tiles(out)

    def launch(self, descriptors, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
               seqused_k=None, alibi_slopes=None, learnable_sink=None, rel_bias_table=None, attn_bias=None,
               block_table=None, key_shift=None):
        """Launches with prebuilt descriptors; returns the compiled kernel (None for an empty grid)."""
        if self.call is None:
            return None
        ring = self.bias_template is not None
        return self.call(*descriptors, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         out if self.varlen else None, alibi_slopes, learnable_sink, rel_bias_table,
                         None if ring else attn_bias, self.bias_template(attn_bias) if ring else None, block_table,
                         key_shift)

    def __call__(self, q, k, v, out, lse, **varlen):
        if self.call is None:
            return None
        return self.launch(self.descriptors(q, k, v, out), out, lse, **varlen)


def heads_per_group(n_tiles: int, pairs: int, resident_ctas: int, factor: int = 1) -> int:
    """Group size for a causal grid of n_tiles tiles per (batch, head) pair: enough heads that a
    group holds about ``factor`` times the CTAs that run at once, so that the group's longest
    tiles start together and its shortest end the grid."""
    return max(1, min(pairs, -(-factor * resident_ctas // max(n_tiles, 1))))
