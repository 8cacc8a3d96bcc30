"""Host side of the Hopper backward (backward.py): which tensors it takes, the TMA descriptor
layouts, the float32 dQ accumulator and the launch plan of one call signature (main kernel, then
the dQ convert)."""

from dataclasses import replace

import torch
import triton

from ...configs import GluonBwdConfig, padded_head_dim
from ..plans import CompiledCall
from .backward import (_DQ_N, BLOCK_N, KEYS_PER_CONSUMER, NUM_CONSUMERS, gluon_attn_bwd_d256_kernel,
                       gluon_attn_bwd_kernel, gluon_attn_bwd_persistent_kernel, gluon_bwd_dq_convert_kernel)
from .forward_plan import band_sides, option_arguments
from .tma import (BiasDescriptorTemplate, DescriptorTemplate, RowDescriptorTemplate, attn_bias_arguments,
                  multiprocessors, qkv_supported, tma_aligned, values_supported)

LOG2E = 1.4426950408889634


def supported(q, k, v, causal) -> bool:
    """Whether this kernel takes these tensors (see hopper.qkv_supported)."""
    return qkv_supported(q, k, v)


def padded_row_stride(seqlen_q: int) -> int:
    """Row stride (in floats) of the lse_log2 / delta buffers this kernel reads: seqlen_q padded
    to a multiple of 4. Unpadded rows (seqlen_q % 4 != 0) made the H200 stop with an illegal
    instruction: a TMA box must start 16-byte aligned."""
    return (seqlen_q + 3) // 4 * 4


def grads_supported(dout, dq, dk, dv) -> bool:
    """Whether dout, dk, dv are TMA-addressable (16-byte strides and bases); dq is written by a
    plain kernel and may be any view. The launcher copies through a contiguous buffer otherwise."""
    return all(tma_aligned(t) for t in (dout, dk, dv))


def tma_addressable(dout, dk, dv) -> tuple:
    """(dout, dk, dv, copy_back): the gradients as the kernel addresses them with TMA
    (grads_supported). Views TMA cannot address (rare) are swapped for contiguous tensors: dout
    copied, dk / dv fresh buffers that copy_back() copies into the given views once the backward
    has run. copy_back is None when no buffer was needed."""
    if not tma_aligned(dout):
        dout = dout.contiguous()
    dk_buf, dv_buf = (t if tma_aligned(t) else torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (dk, dv))
    if dk_buf is dk and dv_buf is dv:
        return dout, dk, dv, None

    def copy_back():
        for view, buf in ((dk, dk_buf), (dv, dv_buf)):
            if buf is not view:
                view.copy_(buf)
    return dout, dk_buf, dv_buf, copy_back


def gluon_attention_backward(q, k, v, dout, lse_log2, delta, dq, dk, dv, softmax_scale: float, causal: bool,
                             config: GluonBwdConfig, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                             max_seqlen_k=None) -> None:
    """dq, dk, dv <- gradients of softmax(q k^T * softmax_scale) v, softmax_scale > 0 (written in
    place; they may be strided views). q, dout, dq: (b, sq, h, d); k, v, dk, dv: (b, sk, hk, d);
    lse_log2, delta: float32 (b, h, sq) from attn_bwd_preprocess_kernel, rows padded to a multiple of 4 values
    (padded_row_stride(); the TMA boxes that stream them must start 16-byte aligned). See supported().

    Varlen (cu_seqlens_q given): the packed tensors as batch-1 views, q, dout, dq (1, total_q, h, d),
    k, v, dk, dv (1, total_k, hk, d), lse_log2 / delta (1, h, total_q) laid out as above;
    cu_seqlens_q / cu_seqlens_k int32 (batch + 1,) prefix sums; seqused_q optional int32 (batch,):
    sequence b uses only its first seqused_q[b] query rows (the others get dq 0 and give nothing).
    max_seqlen_k (host int, at least the longest cu_seqlens_k span) sizes the grid; None reads it
    from cu_seqlens_k (a device sync). Causal is bottom-right aligned per sequence. Rows of a
    sequence's last tiles run into the next sequence's (or unused) q, dout, k, v rows: they are
    read and masked, and must hold finite values (0 * NaN is NaN), which rules out garbage in rows
    past seqused_q. Rows past the packed totals are not written."""
    make_launcher(q, k, v, dout, lse_log2, delta, dq, dk, dv, softmax_scale, causal, config,
                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                  max_seqlen_k=max_seqlen_k)()


def _descriptor_templates(q, dout, k, v, dk, dv, dq_acc, lse_log2, delta, cfg):
    """(TMA descriptor templates, kernel, keys per CTA, extra constexprs) for one head dim; the
    templates are for q, dout, k, v, dk, dv, dq_acc, lse_log2, delta (kernel order).
    The loader's Q/dO/K/V boxes are whole rows of the head dim at every head dim. A head dim that is
    not a power of two (96, 192) runs the kernel of the next one with boxes of that width: TMA
    zero-fills the missing columns on loads (every product stays exact, the padded columns of dK,
    dV, dQ come out zero) and clips them on stores and reduce-adds. V, dO, dV may have a head dim of
    their own (see values_supported), whose padded width their boxes take."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    loads = (DescriptorTemplate(q, cfg.block_m, block_d), DescriptorTemplate(dout, cfg.block_m, block_dv),
             DescriptorTemplate(k, KEYS_PER_CONSUMER, block_d), DescriptorTemplate(v, KEYS_PER_CONSUMER, block_dv))
    # lse / delta: 1-D boxes over the flat arrays (no 16-byte row-stride condition on seqlen_q).
    rows = (RowDescriptorTemplate(lse_log2, cfg.block_m), RowDescriptorTemplate(delta, cfg.block_m))
    extra = {"HEAD_DIM_TRUE": head_dim}
    if head_dim_v != head_dim:
        assert values_supported(head_dim, head_dim_v)
        extra["HEAD_DIM_V_TRUE"] = head_dim_v
    if block_d == 256:
        # Each warpgroup stores its half of the head dim of dK, dV (staged in its half of the K,
        # V tiles) and reduce-adds dQ in (block_m, 64) float32 tiles.
        stores = (DescriptorTemplate(dk, KEYS_PER_CONSUMER, block_d // NUM_CONSUMERS),
                  DescriptorTemplate(dv, KEYS_PER_CONSUMER, block_dv // NUM_CONSUMERS),
                  DescriptorTemplate(dq_acc, cfg.block_m, _DQ_N.value))
        return loads + stores + rows, gluon_attn_bwd_d256_kernel, KEYS_PER_CONSUMER, {"DQ_OVERLAP": cfg.dq_overlap,
                                                                                      **extra}
    dq_cols = block_d if cfg.dq_split_m else block_d // NUM_CONSUMERS
    stores = (DescriptorTemplate(dk, KEYS_PER_CONSUMER, block_d), DescriptorTemplate(dv, KEYS_PER_CONSUMER, block_dv),
              DescriptorTemplate(dq_acc, KEYS_PER_CONSUMER, dq_cols))
    # K/V staging doubles as the dK/dV store source: same box, same layout.
    assert loads[2].layout == stores[0].layout and loads[3].layout == stores[1].layout
    return loads + stores + rows, gluon_attn_bwd_kernel, BLOCK_N, {"DQ_SPLIT_M": cfg.dq_split_m, **extra}


def dq_accumulator(q, device=None) -> torch.Tensor:
    """An (uninitialized) float32 dQ accumulator for make_launcher's dq_acc: shaped like q, contiguous,
    on q's device (or ``device``: "meta" gives a plan its layout without memory)."""
    return torch.empty(q.shape, device=device or q.device, dtype=torch.float32)


class BackwardPlan:
    """The Gluon backward and its dQ convert for one call signature (kernels/plans.py): grids,
    kernel arguments and descriptor layouts worked out once; each call builds the descriptors for
    its tensors and launches both compiled kernels. Takes what make_launcher's launch runs on: dout,
    dk, dv TMA-aligned (grads_supported), both sequence lengths > 0, dq_acc zeroed by the caller.
    Later calls must match the first one's shapes, strides, dtypes and 16-byte alignment (the plan
    key's job)."""

    def __init__(self, q, k, v, dout, lse_log2, delta, dq, dk, dv, dq_acc, softmax_scale, causal, config, *,
                 cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, max_seqlen_k, softcap: float = 0.0,
                 window_left: int = -1, window_right: int = -1, alibi_slopes=None, rel_bias_table=None,
                 attn_bias=None, attn_bias_strides=(0, 0, 0), bias_grad=None, bias_grad_strides=(0, 0, 0),
                 bias_grad_mode: int = 0):
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        cfg = config
        local, window_left, window_right = band_sides(causal, window_left, window_right)
        options = (local or softcap > 0 or alibi_slopes is not None or rel_bias_table is not None
                   or attn_bias is not None)
        if options:
            # The score options live in the two-warpgroup kernel (head dims up to 128), not persistent.
            assert padded_head_dim(head_dim) <= 128, "the d256 backward takes no score options"
            cfg = replace(cfg, persistent=False)
            causal = causal and not local
        self.alibi = alibi_slopes is not None
        assert grads_supported(dout, dq, dk, dv)
        self.varlen = varlen = cu_seqlens_q is not None
        n_seqs = cu_seqlens_q.numel() - 1 if varlen else batch
        self.templates, kernel_fn, block_n, extra = _descriptor_templates(q, dout, k, v, dk, dv, dq_acc, lse_log2,
                                                                          delta, cfg)
        # Varlen: lse / delta are read with plain loads (a sequence's rows start at any offset); dK / dV of
        # a sequence's ragged last key tile are stored from registers.
        row_strides = (dk.stride(1), dk.stride(2), dv.stride(1), dv.stride(2)) if varlen else (None,) * 4
        # Key blocks of one head are adjacent in launch order: concurrent CTAs stream the same query
        # blocks (shared in L2) and reduce into the same dQ rows (L2-resident). Varlen: the third axis
        # is the sequence, the first covers the longest one (programs past a sequence's keys exit).
        # heads_first (dense batches): the KV heads are the first axis (see GluonBwdConfig).
        key_blocks = triton.cdiv(max_seqlen_k, block_n)
        heads_first = cfg.heads_first and not varlen
        grid = (nheads_k, key_blocks, n_seqs) if heads_first else (key_blocks, nheads_k, n_seqs)
        # Persistent (dense batches; its dK, dV staging needs the 64 x 64 float32 dQ tiles of head
        # dim 64 with block_m 128, and dV as wide as dK): as many CTAs as SMs, at most one per key block.
        self.persistent = (cfg.persistent and not varlen and key_blocks > 0 and padded_head_dim(head_dim) == 64
                           and cfg.dq_split_m and v.shape[-1] == head_dim)
        if key_blocks == 0:
            self.main = None
        elif self.persistent:
            n_units = key_blocks * nheads_k * n_seqs
            self.main = CompiledCall(
                gluon_attn_bwd_persistent_kernel, (min(n_units, multiprocessors(q.device)),),
                (*(None,) * len(self.templates), seqlen_q, seqlen_k, nheads, nheads // nheads_k,
                 padded_row_stride(seqlen_q), softmax_scale * LOG2E, softmax_scale, None, key_blocks, nheads_k,
                 n_units),
                dict(BLOCK_M=cfg.block_m, NUM_STAGES=cfg.num_stages, CONSUMER_REGS=cfg.consumer_regs,
                     LOADER_REGS=cfg.loader_regs, CAUSAL=bool(causal), num_warps=4, **extra),
                slots=("q_desc", "do_desc", "k_desc", "v_desc", "dk_desc", "dv_desc", "dq_desc", "lse_desc",
                       "delta_desc", "counter_ptr"))
        else:
            # The two-warpgroup kernel takes the score options; the head-dim-256 one takes none.
            options_arguments = {}
            self.option_slots = kernel_fn is gluon_attn_bwd_kernel
            self.bias_template = None
            if self.option_slots:
                options_arguments = option_arguments(softmax_scale, local, window_left, window_right, softcap,
                                                      alibi_slopes, rel_bias_table)
                # attn_bias's tiles come through the Q / dO ring when TMA can address it, unless softcap's
                # gradient needs the scratch shared memory the ring would take.
                if attn_bias is not None:
                    template = BiasDescriptorTemplate(attn_bias, attn_bias_strides, cfg.block_m, block_n)
                    if template.supported and not (softcap > 0 and bias_grad_mode):
                        self.bias_template = template
                options_arguments.update(_attn_bias_arguments(attn_bias, attn_bias_strides, bias_grad,
                                                              bias_grad_strides, bias_grad_mode, self.bias_template))
            self.main = CompiledCall(
                kernel_fn, grid,
                (*(None,) * len(self.templates), seqlen_q, seqlen_k, nheads, nheads // nheads_k,
                 padded_row_stride(seqlen_q), softmax_scale * LOG2E, softmax_scale, None, None, None, None, None),
                dict(done_counts=None, dk_ptr=None, stride_dk_s=row_strides[0], stride_dk_h=row_strides[1],
                     dv_ptr=None, stride_dv_s=row_strides[2], stride_dv_h=row_strides[3], BLOCK_M=cfg.block_m,
                     NUM_STAGES=cfg.num_stages, CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
                     CAUSAL=bool(causal), IS_VARLEN=varlen, HEADS_FIRST=heads_first, num_warps=4,
                     **options_arguments, **extra),
                slots=("q_desc", "do_desc", "k_desc", "v_desc", "dk_desc", "dv_desc", "dq_desc", "lse_desc",
                       "delta_desc", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "lse_ptr", "delta_ptr", "dk_ptr",
                       "dv_ptr", "done_counts") + (("alibi_slopes", "rel_bias_table", "attn_bias", "bias_grad",
                                                    "bias_desc") if self.option_slots else ()))
        # Dense batches may overlap the convert with the kernel's last CTAs (see "The dQ convert
        # overlapped with the kernel's last CTAs"): each CTA counts itself in once.
        self.overlap_convert = cfg.overlap_convert and not varlen and self.main is not None and not self.persistent
        # The int32 (b, nheads_k) counts the caller zeroes: done counts, or (persistent) the unit counter.
        self.needs_counts = self.overlap_convert or self.persistent
        convert_block = 32
        self.convert = CompiledCall(
            gluon_bwd_dq_convert_kernel, (triton.cdiv(seqlen_q, convert_block), nheads, batch),
            (dq_acc, dq, dq.stride(0), dq.stride(1), dq.stride(2), seqlen_q, nheads, softmax_scale,
             cu_seqlens_q[n_seqs:] if varlen else None, None, nheads_k, key_blocks),
            dict(HEAD_DIM=head_dim, BLOCK_S=convert_block, BLOCK_D=padded_head_dim(head_dim), num_warps=4,
                 launch_pdl=self.overlap_convert),
            slots=("Acc", "DQ", "RowsEnd", "DoneCounts"))
        self.n_seqs = n_seqs

    def descriptors(self, *tensors) -> tuple:
        """The kernel's TMA descriptors of q, dout, k, v, dk, dv, dq_acc, lse_log2, delta."""
        return tuple(template(t) for template, t in zip(self.templates, tensors))

    def launch(self, descriptors, dq, dk, dv, dq_acc, lse_log2, delta, cu_seqlens_q=None, cu_seqlens_k=None,
               seqused_q=None, done_counts=None, alibi_slopes=None, rel_bias_table=None, attn_bias=None,
               bias_grad=None):
        """Runs the backward into dq_acc (zeroed by the caller), dk, dv, then dq <- dq_acc * scale, with
        descriptors from :meth:`descriptors`. done_counts: if needs_counts, the int32 (b, nheads_k)
        counts from done_counts_buffer, zeroed by the caller (a persistent plan draws its units from
        the first). attn_bias, bias_grad: the bias and its gradient's buffer of a plan made with them.
        Returns the compiled Gluon kernel (the probes read its registers), None for an
        empty grid."""
        assert (done_counts is not None) == self.needs_counts
        kernel = None
        if self.main is not None:
            if self.persistent:
                kernel = self.main(*descriptors, done_counts)
                done_counts = None  # not done counts: the convert runs after the kernel
            else:
                option_tensors = ()
                if self.option_slots:
                    ring = self.bias_template is not None
                    option_tensors = (alibi_slopes, rel_bias_table, None if ring else attn_bias, bias_grad,
                                      self.bias_template(attn_bias) if ring else None)
                if self.varlen:
                    kernel = self.main(*descriptors, cu_seqlens_q, cu_seqlens_k, seqused_q, lse_log2, delta, dk, dv,
                                       None, *option_tensors)
                else:
                    kernel = self.main(*descriptors, None, None, None, None, None, None, None, done_counts,
                                       *option_tensors)
        self.convert(dq_acc, dq, cu_seqlens_q[self.n_seqs:] if self.varlen else None, done_counts)
        return kernel

    def __call__(self, q, k, v, dout, lse_log2, delta, dq, dk, dv, dq_acc, done_counts=None, **varlen):
        descriptors = self.descriptors(q, dout, k, v, dk, dv, dq_acc, lse_log2, delta)
        return self.launch(descriptors, dq, dk, dv, dq_acc, lse_log2, delta, done_counts=done_counts, **varlen)


def _attn_bias_arguments(attn_bias, strides, bias_grad, grad_strides, grad_mode: int, template) -> dict:
    """The two-warpgroup kernel's attn_bias arguments besides its slots (attn_bias or bias_desc, bias_grad):
    tma.attn_bias_arguments, and with grad_mode 1 (one score per element: stored), 2 (summed over broadcast
    dimensions: float32 atomics) or 3 (summed along the queries too: per-key sums, float32 atomics) the
    gradient buffer's strides."""
    if attn_bias is None:
        return {}
    assert attn_bias.stride(-1) == 1 and attn_bias.shape[-1] > 1
    arguments = attn_bias_arguments(strides, template)
    if grad_mode:
        assert bias_grad.stride(-1) == 1 and (grad_mode == 1 or bias_grad.dtype == torch.float32)
        arguments.update(BIAS_GRAD=grad_mode, **dict(zip(("stride_grad_b", "stride_grad_h", "stride_grad_m"),
                                                          grad_strides)))
    return arguments


def done_counts_buffer(q, k, device=None) -> torch.Tensor:
    """The (uninitialized) int32 (b, nheads_k) counts a BackwardPlan with needs_counts takes, on q's
    device (or ``device``, as dq_accumulator)."""
    return torch.empty((q.shape[0], k.shape[2]), device=device or q.device, dtype=torch.int32)


def make_launcher(q, k, v, dout, lse_log2, delta, dq, dk, dv, softmax_scale, causal, config, *,
                  cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, max_seqlen_k=None, dq_acc=None):
    """A zero-argument launch with the TMA descriptors and the dQ accumulator built once (timing
    without host overhead). Each launch zeroes the accumulator, runs the kernel and the convert;
    it returns the compiled Gluon kernel (the probe reads its register/spill counts). Arguments as
    gluon_attention_backward's. dq_acc (from dq_accumulator(q)): the caller zeroes it before each
    launch (the backward preprocess does, in the pass that reads out and dout: launch_preprocess's
    zero), and the launch does not; by default the launch allocates and zeroes its own."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    # The score accumulators start at -lse / scale (see the module docstring).
    assert softmax_scale > 0, softmax_scale
    row_stride = padded_row_stride(seqlen_q)
    for t in (lse_log2, delta):
        assert t.dtype == torch.float32 and t.stride() == (nheads * row_stride, row_stride, 1), t.stride()
    varlen = cu_seqlens_q is not None
    if varlen:
        assert cu_seqlens_k is not None and batch == 1 and k.shape[0] == 1
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert cu_seqlens_k.numel() == cu_seqlens_q.numel() and cu_seqlens_q.is_contiguous()
        n_seqs = cu_seqlens_q.numel() - 1
        assert seqused_q is None or (seqused_q.dtype == torch.int32 and seqused_q.numel() == n_seqs)
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item()) if n_seqs > 0 else 0
    else:
        assert cu_seqlens_k is None and seqused_q is None
        n_seqs, max_seqlen_k = batch, seqlen_k

    if n_seqs == 0 or nheads == 0:
        return lambda: None
    if seqlen_q == 0 or seqlen_k == 0:
        def trivial():
            # No query attends (keys get no gradient) or no key exists (queries get none).
            dk.zero_()
            dv.zero_()
            dq.zero_()
        return trivial

    # TMA coordinates are int32; lse / delta rows are addressed flat.
    assert batch * nheads * seqlen_q < 2**31 and batch * seqlen_k < 2**31
    dout, dk, dv, copy_back = tma_addressable(dout, dk, dv)
    zero_dq_acc = dq_acc is None
    if zero_dq_acc:
        dq_acc = dq_accumulator(q)
    else:
        assert dq_acc.shape == q.shape and dq_acc.dtype == torch.float32 and dq_acc.is_contiguous()
    varlen_args = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q)
    plan = BackwardPlan(q, k, v, dout, lse_log2, delta, dq, dk, dv, dq_acc, softmax_scale, causal, config,
                        max_seqlen_k=max_seqlen_k, **varlen_args)
    done_counts = done_counts_buffer(q, k) if plan.needs_counts else None

    def launch():
        if zero_dq_acc:
            dq_acc.zero_()
        if done_counts is not None:
            done_counts.zero_()
        kernel = plan(q, k, v, dout, lse_log2, delta, dq, dk, dv, dq_acc, done_counts, **varlen_args)
        if copy_back is not None:
            copy_back()
        return kernel
    return launch
