"""Call plans: the whole host path of an eager call, done once per call signature.

Launch plans (kernels/plans.py) spare a call the dispatcher's work. In front of them a call still
ran the public checks, the option resolution, an autograd Function, the op's body (allocations,
views, the options rebuilt) and the plan keys: at short sequences several times the host time of
the kernels' launches. A call plan replaces all of it. The public function first builds a key from
its arguments as they come (every tensor's shape, strides, dtype, device and 16-byte alignment,
each option's value, and the settings that steer the long way); a call whose key is known runs
its plan: allocate the outputs, run the launch plans the first call of the key left, and, when a
gradient is wanted, do so inside an autograd Function whose backward replays the backward's plan.

The first call of a key goes the long way, through every check, and leaves the plan. Every check
is a function of what the key holds, so a call with a known key passed them too. Calls that the
key cannot describe cheaply go the long way every time: under torch.compile, with options of
unusual types (numpy scalars, tensors as windows), return_attn_probs, on CPU tensors, inside a
configs.override block, and while FLASHTILE_LAUNCH_PLANS=0, FLASHTILE_AUTOTUNE, FLASHTILE_VALIDATE
or FLASHTILE_POISON_OUTPUTS is on.
"""

from typing import Optional

import torch

from . import dispatch
from .configs import any_overridden
from .kernels.plans import PlanCache
from .kernels.plans import enabled as launch_plans_enabled
from .options import PackedSeqs, ScoreParams, draw_dropout_seed, packed_seqs
from .sinks import sink_grad_buffer, sink_grad_for, unused_rows_lse
from .runtime import environment_reader, poison_outputs_enabled, validate_enabled

# The settings read on the long way; their values are part of every key.
_SETTINGS = ("FLASHTILE_LAUNCH_PLANS", "FLASHTILE_AUTOTUNE", "FLASHTILE_PORTABLE", "FLASHTILE_VALIDATE",
             "FLASHTILE_POISON_OUTPUTS")

_PLAIN_TYPES = (bool, int, float, type(None))

# Devices whose calls keep plans: CUDA (the interpreter's calls are long anyway; tests add "cpu").
PLANNED_DEVICES = ("cuda",)


# Their values as a key part: raw (encoded) values, equal when the values are.
_settings = environment_reader(_SETTINGS)


def tensor_key(t: torch.Tensor) -> tuple:
    """What the long way reads of a tensor argument (not its address or contents)."""
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def optional_key(t) -> Optional[tuple]:
    """tensor_key of an optional tensor argument: () for None, None (no key) for anything else."""
    if t is None:
        return ()
    return tensor_key(t) if type(t) is torch.Tensor else None


def optional_keys(tensors: tuple) -> tuple:
    """optional_key of each of ``tensors``, in one pass (a per-call cost: no call per tensor)."""
    return tuple([() if t is None else tensor_key(t) if type(t) is torch.Tensor else None for t in tensors])


def plain(*values) -> bool:
    """Whether the options are Python bools, ints, floats or None (exact types: their values key a plan)."""
    return all(type(value) in _PLAIN_TYPES for value in values)


def window_key(window_size) -> Optional[tuple]:
    """window_size as a key: a tuple of two Python ints, else None."""
    if type(window_size) is tuple and len(window_size) == 2 and plain(*window_size):
        return window_size
    return None


def replay_possible() -> bool:
    """What a lookup checks besides the key: no configs.override block, which changes the long way's
    choices, is open."""
    return not any_overridden()


def may_keep(device: torch.device) -> bool:
    """Whether a call of this device, under the current settings, may leave a plan."""
    return (device.type in PLANNED_DEVICES and launch_plans_enabled() and not validate_enabled()
            and not poison_outputs_enabled())


def dense_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_attn_probs, learnable_sink=None) -> Optional[tuple]:
    """The call key of flash_attn_func, or None when no plan may serve the call."""
    if torch.compiler.is_compiling():  # the ops trace; the key would be traced too
        return None
    if return_attn_probs is not False or not plain(dropout_p, softmax_scale, causal, softcap, deterministic):
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    window, alibi, sink = window_key(window_size), optional_key(alibi_slopes), optional_key(learnable_sink)
    if window is None or alibi is None or sink is None:
        return None
    return (tensor_key(q), tensor_key(k), tensor_key(v), dropout_p, softmax_scale, causal, window, softcap, alibi,
            sink, deterministic, _settings())


def _needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors (None stands for an absent optional one)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Replay(torch.autograd.Function):
    """A planned call with a gradient: the forward's plan, then the backward's (the call plan's
    ``forward`` and ``backward``). ``seqs``: a packed batch's PackedSeqs, or None; its tensors are
    saved too, so that changing one in place before the backward raises, as on the long way."""

    @staticmethod
    def forward(ctx, call, params, seqs, q, k, v, learnable_sink):
        out, lse = call.forward(params, seqs, q, k, v)
        ctx.call, ctx.params, ctx.seqs = call, params, seqs
        if seqs is None:
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            ctx.save_for_backward(q, k, v, out, lse, seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_q,
                                  seqs.seqused_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors[:5]
        dq, dk, dv, dsink = ctx.call.backward(ctx.params, ctx.seqs, dout, q, k, v, out, lse)
        return None, None, None, dq, dk, dv, dsink


class DenseCall:
    """flash_attn_func of one call signature: ``call(q, k, v, call.call_params(alibi_slopes, learnable_sink),
    learnable_sink)`` -> out.

    The options resolved once (``params``; the ALiBi slopes, the dropout seed and the learnable sink
    are the call's), the forward's launch plan, and the backward's launch plans by the incoming
    gradient's layout."""

    def __init__(self, q, v, params: ScoreParams, deterministic: bool):
        batch, seqlen_q, nheads, _ = q.shape
        self.out_shape, self.lse_shape = (batch, seqlen_q, nheads, v.shape[-1]), (batch, nheads, seqlen_q)
        self.dtype, self.device = q.dtype, q.device
        self.params = params.with_tensors(None)
        self.deterministic = deterministic
        self.launch = None
        self.backward_plans = {}

    def call_params(self, alibi_slopes, learnable_sink=None, dropout_seed=None) -> ScoreParams:
        """This call's options: the resolved ones, with its ALiBi slopes, learnable sink and dropout
        seed (drawn when not given)."""
        return _with_tensors(self.params, alibi_slopes, dropout_seed, self.device).with_sink(learnable_sink)

    def __call__(self, q, k, v, params: ScoreParams, learnable_sink=None):
        if _needs_grad(q, k, v, learnable_sink):
            return _Replay.apply(self, params, None, q, k, v, learnable_sink)
        return self.forward(params, None, q, k, v)[0]

    def forward(self, params: ScoreParams, seqs: None, q, k, v) -> tuple:
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        if self.launch is not None:
            self.launch(q, k, v, out, lse, params, None)
        else:
            self.launch = dispatch.attention_forward(q, k, v, out, lse, params)
        return out, lse

    def backward(self, params: ScoreParams, seqs: None, dout, q, k, v, out, lse) -> tuple:
        if dout.stride(-1) != 1:
            dout = dout.contiguous()  # e.g. the expanded gradient of out.sum()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsink = sink_grad_buffer(params.learnable_sink)
        layout = (dout.stride(), dout.data_ptr() % 16 == 0)
        plan = self.backward_plans.get(layout)
        if plan is not None:
            plan(q, k, v, out, dout, lse, dq, dk, dv, params, None, dsink=dsink)
        else:
            plan = dispatch.attention_backward(q, k, v, out, dout, lse, dq, dk, dv, params, self.deterministic,
                                               dsink=dsink)
            if plan is not None:
                self.backward_plans[layout] = plan
        return dq, dk, dv, sink_grad_for(params.learnable_sink, dsink)


def _with_tensors(params: ScoreParams, alibi_slopes, dropout_seed, device) -> ScoreParams:
    """``params`` (resolved, without tensors) with a call's ALiBi slopes and dropout seed (a fresh
    one when dropout is on and none is given)."""
    if params.dropout_p > 0.0 and dropout_seed is None:
        dropout_seed = draw_dropout_seed(device)
    return params.with_tensors(alibi_slopes, dropout_seed)


DENSE_CALLS = PlanCache()


def kvcache_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                num_splits, learnable_sink=None) -> Optional[tuple]:
    """The call key of flash_attn_with_kvcache (its step: dispatch.KVCacheStep), or None when no
    plan may serve the call. An int cache_seqlens keys by type: each call passes its value."""
    if torch.compiler.is_compiling():  # the ops trace; the key would be traced too
        return None
    if not plain(softmax_scale, causal, softcap, rotary_interleaved, num_splits):
        return None
    if type(q) is not torch.Tensor or type(k_cache) is not torch.Tensor or type(v_cache) is not torch.Tensor:
        return None
    if type(cache_seqlens) is int:
        seqlens = int if cache_seqlens >= 0 else None
    else:
        seqlens = optional_key(cache_seqlens)
    optional = optional_keys((k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                              learnable_sink))
    window = window_key(window_size)
    if seqlens is None or window is None or None in optional:
        return None
    if _needs_grad(q, k_cache, v_cache, k, v):
        return None  # the long way raises
    return (tensor_key(q), tensor_key(k_cache), tensor_key(v_cache), seqlens, optional, softmax_scale, causal, window,
            softcap, rotary_interleaved, num_splits, _settings())


KVCACHE_STEPS = PlanCache()


def varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_q,
               seqused_k, learnable_sink=None) -> Optional[tuple]:
    """The call key of flash_attn_varlen_func, or None when no plan may serve the call. The host
    maxima key by value; the sequence tensors by layout (a plan serves any lengths under the maxima)."""
    if torch.compiler.is_compiling():  # the ops trace; the key would be traced too
        return None
    if return_attn_probs is not False or not plain(dropout_p, softmax_scale, causal, softcap, deterministic):
        return None
    if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    optional = optional_keys((cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, alibi_slopes,
                              learnable_sink))
    window = window_key(window_size)
    if window is None or None in optional or () in optional[:2]:
        return None
    if block_table is not None and _needs_grad(q, k, v, learnable_sink):
        return None  # the long way: no backward through a paged cache
    return (tensor_key(q), tensor_key(k), tensor_key(v), max_seqlen_q, max_seqlen_k, optional, dropout_p,
            softmax_scale, causal, window, softcap, deterministic, _settings())


class VarlenCall:
    """flash_attn_varlen_func of one call signature: ``call(q, k, v, cu_seqlens_q, cu_seqlens_k,
    seqused_q, seqused_k, block_table, params, learnable_sink)`` -> out. As DenseCall, on (total, h, d) tensors; the
    forward plan gets them as they are (a plan reads only its tensors' data pointers, and the
    (1, total, h, d) views of the long way start where they do), the backward gets those views."""

    def __init__(self, q, v, params: ScoreParams, max_seqlen_q: int, max_seqlen_k: int, deterministic: bool):
        self.out_shape, self.lse_shape = (*q.shape[:2], v.shape[-1]), (q.shape[1], q.shape[0])
        self.dtype, self.device = q.dtype, q.device
        self.params = params.with_tensors(None)
        self.maxima = max_seqlen_q, max_seqlen_k
        self.deterministic = deterministic
        self.launch = None
        self.backward_plans = {}
        self.last_seqs = None  # (the sequence tensors, their PackedSeqs): see _seqs

    def call_params(self, alibi_slopes, learnable_sink=None, dropout_seed=None) -> ScoreParams:
        return _with_tensors(self.params, alibi_slopes, dropout_seed, self.device).with_sink(learnable_sink)

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                 params: ScoreParams, learnable_sink=None):
        seqs = self._seqs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table)
        if _needs_grad(q, k, v, learnable_sink):
            return _Replay.apply(self, params, seqs, q, k, v, learnable_sink)
        return self.forward(params, seqs, q, k, v)[0]

    def _seqs(self, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table) -> PackedSeqs:
        # A model passes the same sequence tensors to every layer: the last PackedSeqs serves while
        # they are the same objects, if it holds them themselves (no contiguous copies, whose
        # contents would not follow the tensors').
        given = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table)
        last = self.last_seqs
        if last is not None and all(a is b for a, b in zip(given, last[0])):
            return last[1]
        seqs = packed_seqs(*given, *self.maxima)
        held = (seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_q, seqs.seqused_k, seqs.block_table)
        if all(a is b for a, b in zip(given, held)):
            self.last_seqs = given, seqs
        return seqs

    def forward(self, params: ScoreParams, seqs: PackedSeqs, q, k, v) -> tuple:
        # Rows past seqused_q see no key: out 0 and lse -inf (the sink's), like any row without keys.
        if seqs.seqused_q is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        else:
            out = torch.zeros(self.out_shape, dtype=self.dtype, device=self.device)
            lse = unused_rows_lse(self.lse_shape, params.learnable_sink, self.device)
        if self.launch is not None:
            self.launch(q, k, v, out, lse, params, seqs)
        else:
            k4, v4 = (k, v) if seqs.paged else (k.unsqueeze(0), v.unsqueeze(0))
            self.launch = dispatch.attention_forward(q.unsqueeze(0), k4, v4, out.unsqueeze(0), lse.unsqueeze(0),
                                                     params, seqs)
        return out, lse

    def backward(self, params: ScoreParams, seqs: PackedSeqs, dout, q, k, v, out, lse) -> tuple:
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        # Tokens past seqused get a zero gradient (the kernels skip them).
        dq = torch.empty_like(q) if seqs.seqused_q is None else torch.zeros_like(q)
        dk, dv = (torch.empty_like(t) if seqs.seqused_k is None else torch.zeros_like(t) for t in (k, v))
        tensors = (q, k, v, out, dout, lse, dq, dk, dv)
        dsink = sink_grad_buffer(params.learnable_sink)
        layout = (dout.stride(), dout.data_ptr() % 16 == 0)
        plan = self.backward_plans.get(layout)
        if plan is not None:
            plan(*tensors, params, seqs, dsink=dsink)  # the (1, total, h, d) views start where the tensors do
        else:
            plan = dispatch.attention_backward(*(t.unsqueeze(0) for t in tensors), params, self.deterministic, seqs,
                                               dsink)
            if plan is not None:
                self.backward_plans[layout] = plan
        return dq, dk, dv, sink_grad_for(params.learnable_sink, dsink)


VARLEN_CALLS = PlanCache()
