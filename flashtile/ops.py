"""The kernels as PyTorch custom operators (namespace ``flashtile``), so that ``torch.compile``
traces the public functions without graph breaks and AOT autograd sees their backward.

    torch.ops.flashtile.fwd / bwd                  dense (b, s, h, d)
    torch.ops.flashtile.varlen_fwd / varlen_bwd    packed (total, h, d) with cu_seqlens (or paged K/V)
    torch.ops.flashtile.attn_probs                 the O(N^2) probabilities (return_attn_probs)
    torch.ops.flashtile.kvcache_fwd                append to a kv cache in place, then attend
    torch.ops.flashtile.paged_no_backward          the backward of a paged varlen forward: raises

Each op is functional except kvcache_fwd (it writes k_cache and v_cache), has a fake
implementation (shapes and dtypes only) and, for fwd and varlen_fwd, an autograd formula that
calls the matching backward op. The public functions reach fwd and varlen_fwd through
dense_attention / varlen_attention: the ops while torch.compile traces, and in eager mode the same
bodies and formula in a plain torch.autograd.Function, which skips the custom-op layers' host time;
flash_attn_with_kvcache reaches kvcache_fwd the same way (kvcache_attention_call). A learnable sink
(sinks.py) is an input of the ops like the ALiBi slopes: the forward kernels take it in, and the
backward ops return its gradient after q, k, v's. An attn_bias wraps fwd / varlen_fwd and their
backward ops in one more autograd.Function (dense_attention_with_bias, varlen_attention_with_bias). Calls
with mods reach these bodies through mod_ops.py, whose own ops carry the mods under torch.compile.
The ops take what the kernels take: options already checked and folded by the public functions
(softmax_scale resolved, causal folded into window_right = 0), and dropout's seed as an int64
tensor drawn outside the op, so an op is a function of its inputs and the backward regenerates the
forward's mask from the saved seed.

The scalar options travel as two lists, ``floats`` and ``ints`` (layouts below): torch's custom-op
layers re-read an op's schema once per argument on each eager call (setup_context, version bumps),
a cost that grows with the square of the argument count, so the ops keep few arguments.

Packed layouts without copies: ``k=None`` means q is qkv (.., 3, h, d), ``v=None`` means k is
kv (.., 2, hk, d), unbound along dim -3 inside the op. The backward op then returns one gradient
per given tensor (dqkv; or dq, dkv; or dq, dk, dv), written by the kernels in place.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import checks
from .sinks import sink_grad_buffer, sink_grad_for, unused_rows_lse
from .dispatch import attention_backward, attention_forward, attention_probs, kvcache_attention
from .options import Mods, ScoreParams, packed_seqs
from .runtime import empty, empty_like, validate_enabled


def _unpack(q: Tensor, k: Optional[Tensor], v: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v views of the packed layouts (see the module docstring)."""
    if k is None:
        return q.unbind(dim=-3)
    if v is None:
        return (q, *k.unbind(dim=-3))
    return q, k, v


def _given(q: Tensor, k: Optional[Tensor], v: Optional[Tensor]) -> List[Tensor]:
    return [t for t in (q, k, v) if t is not None]


# floats = [softmax_scale, softcap, dropout_p] (every attention op); ints = [window_left, window_right,
# deterministic] for the dense ops and [max_seqlen_q, max_seqlen_k, window_left, window_right,
# deterministic] for the varlen ones. Causal is window_right = 0.


def _unit_last_stride(t: Tensor) -> Tensor:
    # Incoming gradients can be expanded views (stride 0), e.g. from out.sum().backward().
    return t if t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------
# Dense
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("flashtile::fwd", mutates_args=())
def fwd(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], alibi_slopes: Optional[Tensor],
        dropout_seed: Optional[Tensor], learnable_sink: Optional[Tensor], floats: List[float],
        ints: List[int]) -> Tuple[Tensor, Tensor]:
    """out (b, sq, h, dv) (v's head dim), lse (b, h, sq) float32 (both with the learnable sink, if
    any). ints[2] (deterministic) is for the backward (the autograd formula reads it from here)."""
    return _fwd_body(q, k, v, alibi_slopes, dropout_seed, learnable_sink, floats, ints)


def _fwd_body(q, k, v, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods=None):
    q, k, v = _unpack(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    out = empty((batch, seqlen_q, nheads, v.shape[-1]), q.dtype, q.device)
    lse = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    params = ScoreParams.from_op_args(alibi_slopes, dropout_seed, floats, ints[0], ints[1],
                                      learnable_sink).with_mods(mods)
    attention_forward(q, k, v, out, lse, params)
    return out, lse


@fwd.register_fake
def _(q, k, v, alibi_slopes, dropout_seed, learnable_sink, floats, ints):
    q, _, v = _unpack(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((batch, seqlen_q, nheads, v.shape[-1])), q.new_empty((batch, nheads, seqlen_q),
                                                                            dtype=torch.float32)


@torch.library.custom_op("flashtile::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], out: Tensor, lse: Tensor,
        alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor], learnable_sink: Optional[Tensor],
        floats: List[float], ints: List[int]) -> List[Tensor]:
    """The gradients of the given ones of q, k, v (a packed input gets one packed gradient), then the
    learnable sink's if there is one."""
    return _bwd_body(dout, q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink, floats, ints)


def _with_sink_grad(grads: List[Tensor], dsink: Optional[Tensor], learnable_sink: Optional[Tensor]) -> List[Tensor]:
    return grads if dsink is None else grads + [sink_grad_for(learnable_sink, dsink)]


def _fake_grads(q, k, v, learnable_sink) -> List[Tensor]:
    return [torch.empty_like(t) for t in _given(q, k, v)] + ([] if learnable_sink is None else
                                                              [torch.empty_like(learnable_sink)])


def _bwd_body(dout, q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods=None):
    grads = [empty_like(t) for t in _given(q, k, v)]
    grad_views = _unpack(*grads, *(None,) * (3 - len(grads)))
    dsink = sink_grad_buffer(learnable_sink)
    attention_backward(*_unpack(q, k, v), out, _unit_last_stride(dout), lse, *grad_views,
                       ScoreParams.from_op_args(alibi_slopes, dropout_seed, floats, ints[0], ints[1],
                                                learnable_sink).with_mods(mods),
                       bool(ints[2]), dsink=dsink)
    return _with_sink_grad(grads, dsink, learnable_sink)


@bwd.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink, floats, ints):
    return _fake_grads(q, k, v, learnable_sink)


def _setup_fwd(ctx, inputs, output):
    # An eager call with mods (the ops take none) has them as one more input.
    q, k, v, alibi_slopes, dropout_seed, learnable_sink, floats, ints, *mods = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink)
    ctx.options = (floats, ints, *mods)
    ctx.mark_non_differentiable(lse)


def _gradients(grads, q, k, v, learnable_sink, n_between: int, n_after: int) -> tuple:
    """An autograd formula's result from a backward op's list: q, k, v's gradients (None for a packed
    layout's missing ones), None for n_between inputs, the sink's, None for n_after inputs."""
    grads = iter(grads)
    qkv = tuple(None if t is None else next(grads) for t in (q, k, v))
    return qkv + (None,) * n_between + (None if learnable_sink is None else next(grads),) + (None,) * n_after


def _fwd_backward(ctx, dout, _dlse, backward=bwd):
    q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink = ctx.saved_tensors
    grads = backward(dout, q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink, *ctx.options)
    return _gradients(grads, q, k, v, learnable_sink, 2, len(ctx.options))


fwd.register_autograd(_fwd_backward, setup_context=_setup_fwd)


def _eager_function(name, forward_body, setup_context, formula, backward_body):
    """An autograd.Function that runs an op's body and its registered autograd formula without the
    custom-op layers, whose host time is longer than the kernels' at small shapes. For eager calls
    only."""

    def forward(ctx, *inputs):
        output = forward_body(*inputs)
        setup_context(ctx, inputs, output)
        return output

    def backward(ctx, dout, dlse):
        return formula(ctx, dout, dlse, backward=backward_body)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


_EagerDense = _eager_function("_EagerDense", _fwd_body, _setup_fwd, _fwd_backward, _bwd_body)


def dense_attention(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], alibi_slopes: Optional[Tensor],
                    dropout_seed: Optional[Tensor], learnable_sink: Optional[Tensor], floats: List[float],
                    ints: List[int], mods: Optional[Mods] = None) -> Tuple[Tensor, Tensor]:
    """The fwd op, differentiable (in the sink too): torch.ops.flashtile.fwd while torch.compile
    traces (one opaque node, AOT autograd sees its backward op), the same bodies through _EagerDense
    otherwise. ``mods`` (score / mask mods): eager calls only, the bodies take them (under torch.compile,
    mod_ops.py's ops take them apart)."""
    args = (q, k, v, alibi_slopes, dropout_seed, learnable_sink, floats, ints)
    if mods is not None:
        return _EagerDense.apply(*args, mods)
    if torch.compiler.is_compiling():
        return fwd(*args)
    return _EagerDense.apply(*args)


# ---------------------------------------------------------------------------------------------
# Varlen (packed sequences; paged K/V for inference)
# ---------------------------------------------------------------------------------------------

def _zero_or_empty(shape, dtype, device, zero: bool) -> Tensor:
    if zero:
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty(shape, dtype, device)


@torch.library.custom_op("flashtile::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               seqused_q: Optional[Tensor], seqused_k: Optional[Tensor], block_table: Optional[Tensor],
               alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor], learnable_sink: Optional[Tensor],
               floats: List[float], ints: List[int]) -> Tuple[Tensor, Tensor]:
    """out (total_q, h, d) like q, lse (h, total_q) float32. With block_table, k and v are paged
    caches (forward only). The layout's contents are checked here (they need the device's
    values) on CPU tensors and with FLASHTILE_VALIDATE=1."""
    return _varlen_fwd_body(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes,
                            dropout_seed, learnable_sink, floats, ints)


def _varlen_fwd_body(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes,
                     dropout_seed, learnable_sink, floats, ints, mods=None):
    q, k, v = _unpack(q, k, v)
    max_seqlen_q, max_seqlen_k, window_left, window_right = ints[:4]
    if validate_enabled() or q.device.type == "cpu":
        checks.validate_varlen_contents(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                        seqused_k, block_table)
    seqs = packed_seqs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
    total_q, nheads, _ = q.shape
    # Rows past seqused_q see no key: out 0 and lse -inf (the sink's logit), like any row without keys.
    out = _zero_or_empty((total_q, nheads, v.shape[-1]), q.dtype, q.device, seqused_q is not None)
    lse = (empty((nheads, total_q), torch.float32, q.device) if seqused_q is None
           else unused_rows_lse((nheads, total_q), learnable_sink, q.device))
    # The kernels see a packed batch as (1, total, h, d) views.
    k4, v4 = (k, v) if block_table is not None else (k.unsqueeze(0), v.unsqueeze(0))
    attention_forward(q.unsqueeze(0), k4, v4, out.unsqueeze(0), lse.unsqueeze(0),
                      ScoreParams.from_op_args(alibi_slopes, dropout_seed, floats, window_left, window_right,
                                               learnable_sink).with_mods(mods), seqs)
    return out, lse


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes, dropout_seed,
      learnable_sink, floats, ints):
    q, _, v = _unpack(q, k, v)
    total_q, nheads, _ = q.shape
    return q.new_empty((total_q, nheads, v.shape[-1])), q.new_empty((nheads, total_q), dtype=torch.float32)


@torch.library.custom_op("flashtile::varlen_bwd", mutates_args=())
def varlen_bwd(dout: Tensor, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], out: Tensor, lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
               alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor], learnable_sink: Optional[Tensor],
               floats: List[float], ints: List[int]) -> List[Tensor]:
    """Gradients as :func:`bwd`; tokens past seqused get a zero gradient (the kernels skip them)."""
    return _varlen_bwd_body(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                            alibi_slopes, dropout_seed, learnable_sink, floats, ints)


def _varlen_bwd_body(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                     dropout_seed, learnable_sink, floats, ints, mods=None):
    max_seqlen_q, max_seqlen_k, window_left, window_right, deterministic = ints
    seqs = packed_seqs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, None, max_seqlen_q, max_seqlen_k)
    # A packed qkv has one cu_seqlens (no seqused); a packed kv follows the keys.
    zero = [seqused_q is not None, seqused_k is not None, seqused_k is not None]
    grads = [torch.zeros_like(t) if z else empty_like(t) for t, z in zip(_given(q, k, v), zero)]
    grad_views = _unpack(*grads, *(None,) * (3 - len(grads)))
    dsink = sink_grad_buffer(learnable_sink)
    attention_backward(*(t.unsqueeze(0) for t in _unpack(q, k, v)), out.unsqueeze(0),
                       _unit_last_stride(dout).unsqueeze(0), lse.unsqueeze(0), *(g.unsqueeze(0) for g in grad_views),
                       ScoreParams.from_op_args(alibi_slopes, dropout_seed, floats, window_left, window_right,
                                                learnable_sink).with_mods(mods), bool(deterministic), seqs, dsink)
    return _with_sink_grad(grads, dsink, learnable_sink)


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, dropout_seed,
      learnable_sink, floats, ints):
    return _fake_grads(q, k, v, learnable_sink)


def _setup_varlen_fwd(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes, dropout_seed,
     learnable_sink, floats, ints, *mods) = inputs  # mods: as _setup_fwd's
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                          dropout_seed, learnable_sink)
    ctx.paged = block_table is not None
    ctx.options = (floats, ints, *mods)
    ctx.mark_non_differentiable(lse)


PAGED_NO_BACKWARD = ("block_table (paged K/V) serves inference: there is no backward through a paged cache; "
                     "run the forward under torch.no_grad(), or detach its output")


@torch.library.custom_op("flashtile::paged_no_backward", mutates_args=())
def paged_no_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor) -> List[Tensor]:
    """The backward of a paged varlen forward: raises when it runs. An op rather than a raise in the
    formula, so that AOT autograd can trace the backward of a compiled paged forward (the forward
    then runs as in eager mode; only an actual backward fails)."""
    raise RuntimeError(PAGED_NO_BACKWARD)


@paged_no_backward.register_fake
def _(dout, q, k, v):
    return [torch.empty_like(t) for t in (q, k, v)]


def _varlen_fwd_backward(ctx, dout, _dlse, backward=varlen_bwd):
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k, alibi_slopes, dropout_seed, learnable_sink = ctx.saved_tensors
    if ctx.paged:
        # Gradients for all three, so the op stays in a compiled backward whichever input needs one.
        return (*paged_no_backward(dout, q, k, v),) + (None,) * (8 + len(ctx.options))
    grads = backward(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, alibi_slopes, dropout_seed,
                     learnable_sink, *ctx.options)
    return _gradients(grads, q, k, v, learnable_sink, 7, len(ctx.options))


varlen_fwd.register_autograd(_varlen_fwd_backward, setup_context=_setup_varlen_fwd)


_EagerVarlen = _eager_function("_EagerVarlen", _varlen_fwd_body, _setup_varlen_fwd, _varlen_fwd_backward,
                               _varlen_bwd_body)


def varlen_attention(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
                     block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor],
                     learnable_sink: Optional[Tensor], floats: List[float], ints: List[int],
                     mods: Optional[Mods] = None) -> Tuple[Tensor, Tensor]:
    """The varlen_fwd op, differentiable (see dense_attention)."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes, dropout_seed,
            learnable_sink, floats, ints)
    if mods is not None:
        return _EagerVarlen.apply(*args, mods)
    if torch.compiler.is_compiling():
        return varlen_fwd(*args)
    return _EagerVarlen.apply(*args)


# ---------------------------------------------------------------------------------------------
# attn_bias (options.AttnBias), on the op bodies above
# ---------------------------------------------------------------------------------------------

class _BiasedOp:
    """How _BiasAttention runs one op's bodies: ``forward(*inputs)`` -> (out, lse), ``backward(dout, out,
    lse, *inputs)`` -> the op's backward list; ``sink_at``: where the learnable sink is among the inputs."""

    def __init__(self, forward, backward, sink_at: int):
        self.forward, self.backward, self.sink_at = forward, backward, sink_at


def _dense_biased_backward(dout, out, lse, q, k, v, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods):
    return _bwd_body(dout, q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods)


def _varlen_biased_backward(dout, out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                            alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods):
    if block_table is not None:
        return paged_no_backward(dout, *_unpack(q, k, v))
    return _varlen_bwd_body(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                            dropout_seed, learnable_sink, floats, ints, mods)


_DENSE_BIASED = _BiasedOp(_fwd_body, _dense_biased_backward, 5)
_VARLEN_BIASED = _BiasedOp(_varlen_fwd_body, _varlen_biased_backward, 10)


class _BiasAttention(torch.autograd.Function):
    """An op's bodies with an attn_bias (the score mod of the op's mods), whose gradient the op's own
    backward does not give: the bias tensor comes after the op's inputs (mods last among them), for
    autograd. Eager calls only (under torch.compile, mod_ops.mods_fwd gives the bias's gradient).

    Forward: the op's. Backward: the op's own, its dQ kernel adding up the bias's gradient
    (AttnBias.backward_mods), and the learnable sink's gradient from the op's list. Returns (out, lse)."""

    @staticmethod
    def forward(ctx, op: _BiasedOp, *inputs):
        inputs = inputs[:-1]
        out, lse = op.forward(*inputs)
        ctx.op = op
        ctx.tensor_at = [i for i, x in enumerate(inputs) if isinstance(x, Tensor)]
        ctx.others = [None if isinstance(x, Tensor) else x for x in inputs]
        ctx.save_for_backward(out, lse, *(inputs[i] for i in ctx.tensor_at))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        out, lse, *tensors = ctx.saved_tensors
        inputs = list(ctx.others)
        for i, t in zip(ctx.tensor_at, tensors):
            inputs[i] = t
        mods, accumulated = inputs[-1], None
        if ctx.needs_input_grad[-1]:
            inputs[-1], accumulated = mods.attn_bias.backward_mods(mods)
        grads = ctx.op.backward(_unit_last_stride(dout), out, lse, *inputs)
        sink_at = ctx.op.sink_at
        result = _gradients(grads, *inputs[:3], inputs[sink_at], sink_at - 3, len(inputs) - sink_at - 1)
        bias_grad = None if accumulated is None else mods.attn_bias.grad(accumulated)
        return (None, *result, bias_grad)


def dense_attention_with_bias(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], attn_bias: Tensor,
                              alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor],
                              learnable_sink: Optional[Tensor], floats: List[float], ints: List[int],
                              mods: Mods) -> Tuple[Tensor, Tensor]:
    """dense_attention with an attn_bias (``mods.attn_bias`` resolved from it), differentiable in q, k, v,
    the sink and the bias. Eager calls only (mod_ops.attention)."""
    return _BiasAttention.apply(_DENSE_BIASED, q, k, v, alibi_slopes, dropout_seed, learnable_sink, floats, ints,
                                mods, attn_bias)


def varlen_attention_with_bias(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], attn_bias: Tensor,
                               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q: Optional[Tensor],
                               seqused_k: Optional[Tensor], block_table: Optional[Tensor],
                               alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor],
                               learnable_sink: Optional[Tensor], floats: List[float], ints: List[int],
                               mods: Mods) -> Tuple[Tensor, Tensor]:
    """varlen_attention with an attn_bias (dense_attention_with_bias)."""
    return _BiasAttention.apply(_VARLEN_BIASED, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                block_table, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods, attn_bias)


# ---------------------------------------------------------------------------------------------
# return_attn_probs (testing: O(N^2) memory, no gradient)
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("flashtile::attn_probs", mutates_args=())
def attn_probs(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], lse: Tensor, cu_seqlens_q: Optional[Tensor],
               cu_seqlens_k: Optional[Tensor], seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
               block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor],
               floats: List[float], ints: List[int]) -> Tensor:
    """The probabilities (b, h, max_seqlen_q, max_seqlen_k) of the attention whose forward gave
    ``lse``, dropped entries negated; ``floats``, ``ints`` as that forward's. Dense without cu_seqlens."""
    return attn_probs_body(q, k, v, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes,
                           dropout_seed, floats, ints)


def attn_probs_body(q, k, v, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes,
                    dropout_seed, floats, ints, mods: Optional[Mods] = None) -> Tensor:
    """attn_probs' body; eager calls with mods run it directly."""
    q, k, _ = _unpack(q, k, v)
    if cu_seqlens_q is None:
        params = ScoreParams.from_op_args(alibi_slopes, dropout_seed, floats, ints[0], ints[1]).with_mods(mods)
        return attention_probs(q, k, lse, params, q.dtype)
    max_seqlen_q, max_seqlen_k, window_left, window_right = ints[:4]
    params = ScoreParams.from_op_args(alibi_slopes, dropout_seed, floats, window_left, window_right).with_mods(mods)
    seqs = packed_seqs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
    return attention_probs(q.unsqueeze(0), k if block_table is not None else k.unsqueeze(0), lse.unsqueeze(0),
                           params, q.dtype, seqs)


@attn_probs.register_fake
def _(q, k, v, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes, dropout_seed, floats,
      ints):
    q, k, _ = _unpack(q, k, v)
    if cu_seqlens_q is None:
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    return q.new_empty((cu_seqlens_q.shape[0] - 1, q.shape[1], ints[0], ints[1]))


def attention_probabilities(q, k, v, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, tensors,
                            floats, ints, mods: Optional[Mods] = None) -> Tensor:
    """return_attn_probs for the public functions: the probabilities from attn_probs (its body, for
    eager calls with mods), which has no gradient (testing only). ``tensors``: (alibi_slopes,
    dropout_seed)."""
    detached = (None if t is None else t.detach() for t in (q, k, v))
    if mods is not None:
        return attn_probs_body(*detached, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                               *tensors, floats, ints, mods)
    return attn_probs(*detached, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, *tensors,
                      floats, ints)


# ---------------------------------------------------------------------------------------------
# kv cache (inference)
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("flashtile::kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def kvcache_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                cache_seqlens: Tensor, extras: List[Optional[Tensor]], floats: List[float],
                ints: List[int]) -> Tuple[Tensor, Tensor]:
    """out (b, sq, h, d) like q and lse (b, h, sq) float32 of q against the cache after the new k,
    v (if given) are written into k_cache, v_cache in place; see flash_attn_with_kvcache.
    extras = [rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
    learnable_sink] (one list argument: this op runs per layer per decoded token, and its version-counter
    bump re-reads the schema per argument); floats = [softmax_scale, softcap]; ints = [causal, window_left,
    window_right, rotary_interleaved, num_splits] (the user's window: causal is not folded in)."""

    return kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens, *extras, *floats, *ints)


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, extras, floats, ints):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((batch, seqlen_q, nheads, v_cache.shape[-1])), q.new_empty((batch, nheads, seqlen_q),
                                                                                  dtype=torch.float32)


def kvcache_attention_call(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                           cache_seqlens: Tensor, extras: List[Optional[Tensor]], floats: List[float],
                           ints: List[int]) -> Tuple[Tensor, Tensor]:
    """The kvcache_fwd op while torch.compile traces; in eager mode its body, called directly (the
    custom-op layers cost more host time per call than a short cache's kernels take), with the
    version-counter bump of k_cache and v_cache that the op's mutates_args would give."""
    if torch.compiler.is_compiling():
        return kvcache_fwd(q, k_cache, v_cache, k, v, cache_seqlens, extras, floats, ints)
    result = kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens, *extras, *floats, *ints)
    mark_caches_written(k_cache, v_cache)
    return result


def mark_caches_written(k_cache: Tensor, v_cache: Tensor) -> None:
    """The version-counter bump of k_cache and v_cache that kvcache_fwd's mutates_args gives, for
    eager calls that run its body without the op."""
    for cache in (k_cache, v_cache):
        torch.autograd.graph.increment_version(cache)  # a no-op on inference-mode tensors
