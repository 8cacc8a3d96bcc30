"""Which kernels a call runs, and why: :func:`explain`.

A call on sm90 runs the Hopper Gluon kernels when they serve its shape and options, else the
portable Triton kernels; flashtile/dispatch.py's gluon_decision holds the rules and the reasons, and
:func:`explain` asks it exactly as the launch path does, without launching anything.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from . import autotune, checks, runtime, sinks
from .configs import BWD_DKDV, BWD_DQ, BWD_GLUON, FWD_GLUON, get_config, tile_head_dim
from .dispatch import decode_kernel, decode_route, forward_kernel, gluon_decision, packed_gqa_on_hopper
from .kernels.portable.launch import forward_config
from .mods import call_mods
from .mods import given as mods_given
from .mods import native_documents
from .options import PackedSeqs, grid_lengths, packed_seqs, resolve_options
from .runtime import arch_of, interpreter_enabled
from .varlen import _check_layout

HOPPER, PORTABLE, NONE = "hopper", "portable", "none"

_FORWARD_KERNELS = {HOPPER: "gluon_attn_fwd_kernel", PORTABLE: "attn_fwd_kernel"}
_BACKWARD_KERNELS = {
    HOPPER: "attn_bwd_preprocess_kernel + gluon_attn_bwd_kernel + gluon_bwd_dq_convert_kernel",
    PORTABLE: "attn_bwd_preprocess_kernel + attn_bwd_dkdv_kernel + attn_bwd_dq_kernel",
}


@dataclass(frozen=True)
class PathChoice:
    """One direction of a call: ``path`` "hopper" (Gluon kernels), "portable" (Triton kernels) or
    "none" (no backward: paged KV); ``kernel`` the kernels it launches; ``config`` what the config
    tables pick (a Gluon config, the portable forward's KernelConfig, the portable backward's
    (dK/dV, dQ) pair); ``reason`` why this path, in the user's terms."""

    path: str
    kernel: str
    config: Any
    reason: str

    def __str__(self) -> str:
        lines = [f"{self.path}" + (f" ({self.kernel})" if self.kernel else "")]
        if self.config is not None:
            lines.append(f"  config: {self.config}")
        lines.append(f"  reason: {self.reason}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found: the device it decided for, and the forward's and backward's paths."""

    device: str
    forward: PathChoice
    backward: PathChoice
    autotune: bool = False

    def __str__(self) -> str:
        lines = [f"device: {self.device}", f"forward: {self.forward}", f"backward: {self.backward}"]
        if self.autotune:
            lines.append("note: FLASHTILE_AUTOTUNE=1 may time other configs of the same kernels on a GPU")
        return "\n".join(lines)


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
            alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
            softmax_scale: Optional[float] = None, deterministic: bool = False,
            cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
            max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
            seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None,
            block_table: Optional[torch.Tensor] = None,
            device_capability: Optional[Tuple[int, int]] = None, score_mod=None, score_mod_bwd=None,
            mask_mod=None, aux_tensors=None, block_mask=None, attn_bias=None,
            learnable_sink: Optional[torch.Tensor] = None) -> Explanation:
    """Which kernels ``flash_attn_func`` (dense q, k, v of (b, s, h, d)) or ``flash_attn_varlen_func``
    (packed (total, h, d) with cu_seqlens_q / cu_seqlens_k / max_seqlen_q / max_seqlen_k, optionally
    seqused and a paged block_table) would run for these tensors and options, and why. Checks the
    arguments as the call would (the same exceptions) and launches nothing.

    ``device_capability``: (major, minor) of a CUDA device to decide for in place of the tensors'
    own, e.g. (9, 0) to see what an H100 would run from CPU or meta tensors. The mod arguments
    (score_mod, ..., block_mask, attn_bias) and learnable_sink as the calls take them
    (docs/programmable.md).
    """
    packed = cu_seqlens_q is not None
    if not packed and any(t is not None for t in (cu_seqlens_k, seqused_q, seqused_k, block_table)):
        raise ValueError("cu_seqlens_k, seqused_q, seqused_k and block_table describe a packed batch: pass "
                         "cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k with (total, heads, head_dim) "
                         "tensors")
    if device_capability is not None:
        device_capability = tuple(int(x) for x in device_capability)
        if len(device_capability) != 2:
            raise ValueError(f"device_capability must be (major, minor), got {device_capability!r}")
    _check_tensors(q, k, v, packed, block_table, device_capability)
    if packed:
        _check_layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                      block_table)
    batch = cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    # The public API's own checks and folding (scale, causal as window_right = 0). Dropout goes in as
    # 0 there, so that no seed is drawn: explaining must not advance the caller's random state.
    checks.check_options(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                         softcap=softcap, alibi_slopes=alibi_slopes, batch=batch, nheads=q.shape[-2],
                         device=q.device, deterministic=deterministic)
    deterministic = bool(deterministic)  # checked there, as the call checks it (bools, numpy bools, 0 / 1)
    documents = None
    if not packed and (alibi_slopes is None or (isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 1)):
        documents = native_documents(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias,
                                     q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device)
    if documents is not None:  # as flash_attn_func runs it: the batch's rows end to end, one sequence a document
        cu_seqlens, longest = documents
        packed_call = explain(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), causal=causal,
                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                              softmax_scale=softmax_scale, deterministic=deterministic, cu_seqlens_q=cu_seqlens,
                              cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest,
                              device_capability=device_capability, learnable_sink=learnable_sink)
        why = "the document mask as packed sequences (one per document); "
        return dataclasses.replace(packed_call, forward=dataclasses.replace(packed_call.forward,
                                                                            reason=why + packed_call.forward.reason),
                                   backward=dataclasses.replace(packed_call.backward,
                                                                reason=why + packed_call.backward.reason))
    mods = None
    if mods_given(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, attn_bias):  # as the calls do
        aligned = (cu_seqlens_q is cu_seqlens_k and seqused_q is None and seqused_k is None and block_table is None
                   if packed else q.shape[1] == k.shape[1])
        lengths = (int(max_seqlen_q), int(max_seqlen_k)) if packed else (q.shape[1], k.shape[1])
        mods, softcap, alibi_slopes, causal, window_size = call_mods(
            score_mod, score_mod_bwd, mask_mod, aux_tensors, block_mask, softcap, alibi_slopes, batch, q.shape[-2],
            *lengths, aligned, q.device, attn_bias=attn_bias, deterministic=deterministic, causal=causal,
            window_size=window_size)
    params = resolve_options(q, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, batch=batch)
    if learnable_sink is not None:
        sinks.check_learnable_sink(learnable_sink, q.shape[-2], q.device)
    params = dataclasses.replace(params, dropout_p=float(dropout_p), mods=mods).with_sink(learnable_sink)

    seqs: Optional[PackedSeqs] = None
    if packed:
        seqs = packed_seqs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
        # The kernels see a packed batch as (1, total, h, d) views (a paged cache keeps its 4 dims).
        q = q.unsqueeze(0)
        if block_table is None:
            k, v = k.unsqueeze(0), v.unsqueeze(0)

    arch = _arch(q, device_capability)
    forward = _forward_choice(q, k, v, params, seqs, arch, device_capability)
    if block_table is not None:
        backward = PathChoice(NONE, "", None, "paged KV (block_table) serves inference: there is no backward")
    else:
        backward = _backward_choice(q, k, v, params, seqs, deterministic, arch, device_capability)
    return Explanation(_device_name(q, device_capability), forward, backward, autotune.enabled())


def _check_tensors(q, k, v, packed: bool, block_table, hypothetical_capability) -> None:
    """The public entry point's tensor checks (flash_attn_func's, or flash_attn_varlen_func's)."""
    paged = block_table is not None
    checks.check_tensor(q, "q", 3 if packed else 4)
    for name, t in (("k", k), ("v", v)):
        checks.check_tensor(t, name, 4 if paged or not packed else 3)
    try:
        checks.check_same_dtype_and_device({"q": q, "k": k, "v": v})
    except ValueError:
        # With a hypothetical device the tensors stand in for it (CPU or meta tensors): only a
        # device mismatch between them is an error then, not a device the kernels cannot run on.
        if hypothetical_capability is None or k.device != q.device or v.device != q.device:
            raise
    if paged:
        checks.check_qkv_shapes(q, k[0], v[0])  # heads and head dims; a page stands for the keys
    else:
        checks.check_qkv_shapes(q, k, v)


def _arch(q, hypothetical_capability) -> str:
    if hypothetical_capability is not None:
        return "sm{}{}".format(*hypothetical_capability)
    return arch_of(q.device)


def _device_name(q, hypothetical_capability) -> str:
    if hypothetical_capability is not None:
        major, minor = hypothetical_capability
        return f"hypothetical sm{major}{minor} (device_capability=({major}, {minor})), tensors on {q.device}"
    if q.device.type == "cuda":
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        major, minor = runtime.device_capability(index)
        return f"{q.device} ({torch.cuda.get_device_name(index)}, sm{major}{minor})"
    if interpreter_enabled():
        return f"{q.device} (Triton interpreter)"
    return str(q.device)


def _not_cuda_reason(reason: str) -> str:
    # On the CPU the interpreter runs the portable kernels: say so where it applies.
    return f"{reason}; Triton's interpreter runs the portable kernels" if interpreter_enabled() else reason


def _forward_choice(q, k, v, params, seqs, arch: str, hypothetical_capability) -> PathChoice:
    """attention_forward's choice (kernels/launch.py, _forward_plan)."""
    max_seqlen_k = grid_lengths(q, k, seqs)[2]
    decode = decode_route(q, k, params, seqs)
    if decode is not None:
        packed_cfg = None if hypothetical_capability is not None else packed_gqa_on_hopper(q, k, v, None, None,
                                                                                          params, seqs)
        if packed_cfg is not None:
            rows = q.shape[1] if seqs is None else f"up to {seqs.max_seqlen_q}"
            return PathChoice(HOPPER, _FORWARD_KERNELS[HOPPER], packed_cfg,
                              f"{rows} query rows per sequence with GQA groups of {q.shape[2] // k.shape[2]}: "
                              "the Hopper forward, each group's query heads packed as rows (its tiles fill the GPU "
                              "without split-KV)")
        cfg = forward_config(decode_kernel(q, k, params, seqs)[0], q, v, params, max_seqlen_k, seqs, arch)
        return PathChoice(PORTABLE, _FORWARD_KERNELS[PORTABLE], cfg, decode)
    gluon_cfg, reason = gluon_decision(FWD_GLUON, q, k, v, params, seqs, device_capability=hypothetical_capability,
                                       warn=False)
    if gluon_cfg is not None:
        return PathChoice(HOPPER, _FORWARD_KERNELS[HOPPER], gluon_cfg, reason)
    cfg = forward_config(forward_kernel(q, k, seqs), q, v, params, max_seqlen_k, seqs, arch)
    if hypothetical_capability is None and q.device.type != "cuda":
        reason = _not_cuda_reason(reason)
    return PathChoice(PORTABLE, _FORWARD_KERNELS[PORTABLE], cfg, reason)


def _backward_choice(q, k, v, params, seqs, deterministic: bool, arch: str, hypothetical_capability) -> PathChoice:
    """attention_backward's choice (kernels/launch.py)."""
    bias = None if params.mods is None else params.mods.attn_bias
    if bias is not None and bias.tensor.requires_grad:
        # The backward's mods write the bias's gradient (AttnBias.backward_mods; its buffer is not needed here).
        params = dataclasses.replace(params, mods=dataclasses.replace(params.mods, dq_score_mod_bwd=bias.grad_fn))
    gluon_cfg, reason = gluon_decision(BWD_GLUON, q, k, v, params, seqs, deterministic=bool(deterministic),
                                       device_capability=hypothetical_capability, warn=False)
    if gluon_cfg is not None:
        return PathChoice(HOPPER, _BACKWARD_KERNELS[HOPPER], gluon_cfg, reason)
    max_seqlen_k = grid_lengths(q, k, seqs)[2]
    configs = tuple(get_config(kernel, arch, tile_head_dim(q, v), params.causal, max_seqlen_k, q.dtype)
                    for kernel in (BWD_DKDV, BWD_DQ))
    if hypothetical_capability is None and q.device.type != "cuda":
        reason = _not_cuda_reason(reason)
    return PathChoice(PORTABLE, _BACKWARD_KERNELS[PORTABLE], configs, reason)
