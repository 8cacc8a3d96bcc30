"""Calls with programmable attention (options.Mods: score / mask mods, a block mask, an attn_bias),
eager and under ``torch.compile``.

Eager calls run the bodies of ops.py with the mods as one more argument (ops.dense_attention and
friends). Under torch.compile the call has to be an operator whose schema takes tensors, ints,
floats and strings, while a call's mods hold ``@triton.jit`` functions, a block mask and tensors.
:func:`split` takes them apart while dynamo traces:

- their tensors (aux tensors, the attn_bias, a relative-bias table) become op inputs, so the
  graph sees them and autograd can reach the bias;
- their ints (an attn_bias's strides and shape, which may be symbolic) become op inputs too;
- the rest, the functions, a block mask and the structure, is a spec, registered once per distinct
  spec while dynamo traces and passed to the op as a string key (``_register`` runs with the real
  values through torch.compiler.assume_constant_result, and dynamo guards on the identity of the
  functions and the block mask: another one recompiles rather than reusing this key).

Inside the op, :func:`rebuild` makes the Mods again and the same bodies run as in eager mode.

    torch.ops.flashtile.mods_fwd / mods_bwd     dense (layout []) or packed (layout = cu_seqlens_q,
                                                cu_seqlens_k, seqused_q, seqused_k, block_table)
    torch.ops.flashtile.mods_attn_probs         return_attn_probs
    torch.ops.flashtile.mods_kvcache_fwd        flash_attn_with_kvcache (writes k_cache, v_cache)

A block mask is part of the spec: build it outside the compiled function (once, as it is meant to be
reused); its tensors then live as long as the registry entry (one per compiled variant).

Splitting needs a dynamo that can look at a ``@triton.jit`` function passed as a value (isinstance,
``is``, attributes): torch 2.13's can, torch 2.11's cannot (it only calls them, "isinstance() cannot
determine type of argument TritonKernelVariable"). Before 2.13 the public functions run a call with
mods eagerly under torch.compile (:func:`compiles_as_op`: a graph break, an error with fullgraph=True
that says why), as they did before these ops.
"""

import dataclasses
import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.torch_version import TorchVersion

from . import dispatch, ops
from .options import AttnBias, Mods

TRACEABLE = TorchVersion(torch.__version__) >= (2, 13)
MOD_ARGUMENTS = ("score_mod", "score_mod_bwd", "mask_mod", "aux_tensors", "block_mask", "attn_bias")
_UNTRACEABLE = (f"flashtile: calls with {', '.join(MOD_ARGUMENTS)} compile as one op from torch 2.13 on; torch "
                f"{torch.__version__}'s dynamo cannot look at @triton.jit functions passed as values, so the call "
                f"runs eagerly (a graph break)")


def compiles_as_op(public):
    """A public entry point as it is (torch >= 2.13), or one that runs calls with mod arguments
    eagerly while dynamo traces (older torch: see the module docstring). The mod arguments are
    keyword-only, so calls without keywords pay one test."""
    if TRACEABLE:
        return public
    eager = torch.compiler.disable(public, reason=_UNTRACEABLE)

    @functools.wraps(public)
    def entry(*args, **kwargs):
        if kwargs and torch.compiler.is_compiling() and any(kwargs.get(name) is not None for name in MOD_ARGUMENTS):
            return eager(*args, **kwargs)
        return public(*args, **kwargs)

    return entry


_TENSOR, _INT, _TUPLE, _BIAS, _CONST, _NONE = range(6)
_MODS_FIELDS = tuple(f.name for f in dataclasses.fields(Mods))
_BIAS_FIELDS = tuple(f.name for f in dataclasses.fields(AttnBias))
_SPECS: Dict[str, tuple] = {}
_KEYS: Dict[tuple, str] = {}


@torch.compiler.assume_constant_result
def _register(structure: tuple, *objects) -> str:
    """The key of a spec (split's ``structure`` of plain tuples and ints, and the ``objects`` it refers
    to: functions, a block mask), registered on first sight. Runs at trace time on the real values
    (each object a separate argument: dynamo converts those one by one, not inside a tuple)."""
    spec = (structure, objects)
    key = _KEYS.get(spec)
    if key is None:
        key = _KEYS[spec] = f"mods{len(_KEYS)}"
        _SPECS[key] = spec
    return key


def split(mods: Mods) -> Tuple[str, List[Tensor], List[int]]:
    """(spec key, tensors, ints) of ``mods``: what the mods ops take (see the module docstring)."""
    tensors: List[Tensor] = []
    ints: List[int] = []
    objects = []

    def node(x):
        if x is None:
            return (_NONE, None)
        if isinstance(x, Tensor):
            tensors.append(x)
            return (_TENSOR, len(tensors) - 1)
        if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool):
            ints.append(x)
            return (_INT, len(ints) - 1)
        if isinstance(x, tuple):
            return (_TUPLE, tuple(node(y) for y in x))
        if isinstance(x, AttnBias):
            return (_BIAS, tuple(node(getattr(x, name)) for name in _BIAS_FIELDS))
        objects.append(x)
        return (_CONST, len(objects) - 1)

    structure = tuple(node(getattr(mods, name)) for name in _MODS_FIELDS)
    return _register(structure, *objects), tensors, ints


def rebuild(key: str, tensors: List[Tensor], ints: List[int]) -> Mods:
    """The Mods that :func:`split` took apart into ``key``, ``tensors`` and ``ints``."""
    structure, objects = _spec(key)

    def value(node):
        kind, x = node
        if kind == _TENSOR:
            return tensors[x]
        if kind == _INT:
            return ints[x]
        if kind == _TUPLE:
            return tuple(value(y) for y in x)
        if kind == _BIAS:
            return AttnBias(*(value(y) for y in x))
        return objects[x] if kind == _CONST else None

    return Mods(*(value(node) for node in structure))


def _spec(key: str) -> tuple:
    spec = _SPECS.get(key)
    if spec is None:
        raise RuntimeError(f"flashtile: no mods are registered as {key!r} in this process; the key comes from "
                           f"tracing a call with mods under torch.compile (mod_ops.split), in the same process")
    return spec


def _bias_slot(key: str) -> Optional[int]:
    """Where the attn_bias (AttnBias.tensor) is among the op's mod tensors, or None without one."""
    kind, fields = _spec(key)[0][_MODS_FIELDS.index("attn_bias")]
    if kind != _BIAS:
        return None
    return fields[_BIAS_FIELDS.index("tensor")][1]


# ---------------------------------------------------------------------------------------------
# The ops (torch.compile)
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("flashtile::mods_fwd", mutates_args=())
def mods_fwd(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layout: List[Optional[Tensor]],
             alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor], learnable_sink: Optional[Tensor],
             floats: List[float], ints: List[int], mod_tensors: List[Tensor], mod_ints: List[int],
             mods_key: str) -> Tuple[Tensor, Tensor]:
    """ops.fwd (``layout`` empty) or ops.varlen_fwd (``layout`` given) with the mods registered as
    ``mods_key``, made of ``mod_tensors`` and ``mod_ints``."""
    mods = rebuild(mods_key, mod_tensors, mod_ints)
    if layout:
        return ops._varlen_fwd_body(q, k, v, *layout, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods)
    return ops._fwd_body(q, k, v, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods)


@mods_fwd.register_fake
def _(q, k, v, layout, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mod_tensors, mod_ints, mods_key):
    q, _, v = ops._unpack(q, k, v)
    rows = q.shape[:-2]  # (batch, seqlen_q) or (total_q,)
    lse_shape = (q.shape[-2], q.shape[0]) if layout else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty((*rows, q.shape[-2], v.shape[-1])), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("flashtile::mods_bwd", mutates_args=())
def mods_bwd(dout: Tensor, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], out: Tensor, lse: Tensor,
             layout: List[Optional[Tensor]], alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor],
             learnable_sink: Optional[Tensor], floats: List[float], ints: List[int], mod_tensors: List[Tensor],
             mod_ints: List[int], mods_key: str, bias_grad: bool) -> List[Tensor]:
    """ops.bwd / ops.varlen_bwd's gradients with these mods, then the attn_bias's (``bias_grad``: in
    its shape and dtype, summed over its broadcast dimensions)."""
    mods = rebuild(mods_key, mod_tensors, mod_ints)
    accumulated = None
    if bias_grad:
        mods, accumulated = mods.attn_bias.backward_mods(mods)
    if layout:
        if layout[4] is not None:
            raise RuntimeError(ops.PAGED_NO_BACKWARD)
        grads = ops._varlen_bwd_body(dout, q, k, v, out, lse, *layout[:4], alibi_slopes, dropout_seed,
                                     learnable_sink, floats, ints, mods)
    else:
        grads = ops._bwd_body(dout, q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink, floats, ints,
                              mods)
    if accumulated is not None:
        grads.append(mods.attn_bias.grad(accumulated))
    return grads


@mods_bwd.register_fake
def _(dout, q, k, v, out, lse, layout, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mod_tensors,
      mod_ints, mods_key, bias_grad):
    grads = ops._fake_grads(q, k, v, learnable_sink)
    if bias_grad:
        grads.append(torch.empty_like(mod_tensors[_bias_slot(mods_key)]))
    return grads


def _setup_mods_fwd(ctx, inputs, output):
    (q, k, v, layout, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mod_tensors, mod_ints,
     mods_key) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink, *layout, *mod_tensors)
    ctx.layout_size = len(layout)
    ctx.options = (floats, ints)
    ctx.mods = (mod_ints, mods_key)
    ctx.mark_non_differentiable(lse)


def _mods_fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes, dropout_seed, learnable_sink, *rest = ctx.saved_tensors
    layout, mod_tensors = rest[:ctx.layout_size], rest[ctx.layout_size:]
    mod_ints, mods_key = ctx.mods
    bias_at = _bias_slot(mods_key)
    bias_grad = bias_at is not None and ctx.needs_input_grad[9][bias_at]
    grads = mods_bwd(ops._unit_last_stride(dout), q, k, v, out, lse, layout, alibi_slopes, dropout_seed,
                     learnable_sink, *ctx.options, mod_tensors, mod_ints, mods_key, bias_grad)
    mod_grads = [None] * len(mod_tensors)
    if bias_grad:
        mod_grads[bias_at] = grads.pop()
    qkv_sink = ops._gradients(grads, q, k, v, learnable_sink, 2, 0)
    return (*qkv_sink[:3], _no_grads(layout), *qkv_sink[3:], *map(_no_grads, ctx.options), mod_grads,
            _no_grads(mod_ints), None)


def _no_grads(inputs: list) -> Optional[list]:
    """The gradient of a list input that needs none: a list of Nones where the list holds only tensors
    (an empty one too: torch.library's autograd treats it as a list of tensors), else None."""
    return [None] * len(inputs) if all(isinstance(t, Tensor) for t in inputs) else None


mods_fwd.register_autograd(_mods_fwd_backward, setup_context=_setup_mods_fwd)


@torch.library.custom_op("flashtile::mods_attn_probs", mutates_args=())
def mods_attn_probs(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], lse: Tensor, layout: List[Optional[Tensor]],
                    alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor], floats: List[float],
                    ints: List[int], mod_tensors: List[Tensor], mod_ints: List[int], mods_key: str) -> Tensor:
    """ops.attn_probs with these mods."""
    return ops.attn_probs_body(q, k, v, lse, *(layout or [None] * 5), alibi_slopes, dropout_seed, floats, ints,
                               rebuild(mods_key, mod_tensors, mod_ints))


@mods_attn_probs.register_fake
def _(q, k, v, lse, layout, alibi_slopes, dropout_seed, floats, ints, mod_tensors, mod_ints, mods_key):
    q, k, _ = ops._unpack(q, k, v)
    if not layout:
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    return q.new_empty((layout[0].shape[0] - 1, q.shape[1], ints[0], ints[1]))


@torch.library.custom_op("flashtile::mods_kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def mods_kvcache_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                     cache_seqlens: Tensor, extras: List[Optional[Tensor]], floats: List[float], ints: List[int],
                     mod_tensors: List[Tensor], mod_ints: List[int], mods_key: str) -> Tuple[Tensor, Tensor]:
    """ops.kvcache_fwd with these mods."""
    return dispatch.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens, *extras, *floats, *ints,
                                      mods=rebuild(mods_key, mod_tensors, mod_ints))


@mods_kvcache_fwd.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, extras, floats, ints, mod_tensors, mod_ints, mods_key):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((batch, seqlen_q, nheads, v_cache.shape[-1])), q.new_empty((batch, nheads, seqlen_q),
                                                                                  dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# What the public functions call
# ---------------------------------------------------------------------------------------------

def kvcache_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                      cache_seqlens: Tensor, extras: List[Optional[Tensor]], floats: List[float], ints: List[int],
                      mods: Mods) -> Tuple[Tensor, Tensor]:
    """ops.kvcache_attention_call for a call with ``mods``: the mods_kvcache_fwd op under torch.compile,
    else its body and the caches' version bump."""
    if torch.compiler.is_compiling():
        key, mod_tensors, mod_ints = split(mods)
        return mods_kvcache_fwd(q, k_cache, v_cache, k, v, cache_seqlens, extras, floats, ints, mod_tensors,
                                mod_ints, key)
    result = dispatch.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens, *extras, *floats, *ints, mods=mods)
    ops.mark_caches_written(k_cache, v_cache)
    return result


def attention(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layout: List[Optional[Tensor]],
              alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor], learnable_sink: Optional[Tensor],
              floats: List[float], ints: List[int], mods: Mods) -> Tuple[Tensor, Tensor]:
    """(out, lse) of a call with ``mods``, differentiable in q, k, v, the learnable sink and the
    attn_bias: dense with ``layout`` empty, packed with it given (mods_fwd's). Eagerly, the bodies
    of ops.py with the mods; under torch.compile, the mods_fwd op."""
    if torch.compiler.is_compiling():
        key, mod_tensors, mod_ints = split(mods)
        return mods_fwd(q, k, v, layout, alibi_slopes, dropout_seed, learnable_sink, floats, ints, mod_tensors,
                        mod_ints, key)
    tensors = (alibi_slopes, dropout_seed, learnable_sink, floats, ints, mods)
    if mods.attn_bias is not None:
        bias = mods.attn_bias.tensor
        if layout:
            return ops.varlen_attention_with_bias(q, k, v, bias, *layout, *tensors)
        return ops.dense_attention_with_bias(q, k, v, bias, *tensors)
    if layout:
        return ops.varlen_attention(q, k, v, *layout, *tensors)
    return ops.dense_attention(q, k, v, *tensors)


def attention_probabilities(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], lse: Tensor,
                            layout: List[Optional[Tensor]], tensors: tuple, floats: List[float], ints: List[int],
                            mods: Mods) -> Tensor:
    """ops.attention_probabilities for a call with ``mods`` (``tensors``: alibi_slopes, dropout_seed)."""
    if torch.compiler.is_compiling():
        key, mod_tensors, mod_ints = split(mods)
        detached = (None if t is None else t.detach() for t in (q, k, v))
        return mods_attn_probs(*detached, lse, layout, *tensors, floats, ints, mod_tensors, mod_ints, key)
    return ops.attention_probabilities(q, k, v, lse, *(layout or [None] * 5), tensors, floats, ints, mods)
