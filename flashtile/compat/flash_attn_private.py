"""flash_attn 2.8's private entry points over flashtile's kernels: ``_flash_attn_forward``,
``_flash_attn_backward``, ``_flash_attn_varlen_forward``, ``_flash_attn_varlen_backward``, with
flash_attn's parameter names, order, defaults and return values. Code that builds its own
autograd Function on them (ring / context-parallel attention, custom recomputation) runs unchanged.

The forwards return ``(out, softmax_lse, S_dmask, rng_state)``; the backwards write the gradients
into the ``dq``, ``dk``, ``dv`` they are given and return ``softmax_d``. Where flashtile differs:

- ``rng_state``: flash_attn returns the (seed, offset) of the CUDA generator's Philox stream.
  flashtile's dropout is its own counter-based Philox (kernels/dropout.py), seeded by an int64
  drawn from torch's generator: rng_state is the int64 (2,) tensor ``[that seed, 0]`` on q's device.
  Handing it back to the backward regenerates the forward's mask. States of one library mean
  nothing to the other.
- ``S_dmask`` (``return_softmax=True``): flashtile's return_attn_probs, the probabilities
  (batch, nheads, seqlen_q, seqlen_k) normalised by the final lse, dropped entries negated; not
  flash_attn's per-tile unnormalised values in a buffer rounded up to multiples of 128. Given with
  or without dropout (flash_attn refuses it without). Otherwise an empty tensor, as in flash_attn.
- The forwards are not differentiable (flash_attn's ops register no autograd either): they run
  under torch.no_grad(). Head dims need no padding to a multiple of 8 (padded ones work too).
- ``softmax_d`` is rowsum(dout * out) in float32, in flash_attn's layout: (batch, nheads,
  round128(seqlen_q)) dense; (nheads, total_q + 128 * batch) varlen, sequence b's rows starting at
  cu_seqlens_q[b] + 128 * b; zeros in between.
- ``_flash_attn_varlen_forward``: ``leftpad_k`` is not supported (NotImplementedError);
  ``zero_tensors`` is accepted and changes nothing (every row of out and softmax_lse is written).
"""

from typing import List, Optional

import torch
from torch import Tensor

from .. import checks, ops
from ..options import ScoreParams, packed_seqs, resolve_options
from ..dispatch import attention_backward
from ..varlen import _check_inputs as _check_varlen_inputs


def _rng_state(dropout_seed: Optional[Tensor], device) -> Tensor:
    """flash_attn's (2,) int64 shape, holding flashtile's seed (0 without dropout)."""
    if dropout_seed is None:
        return torch.zeros(2, dtype=torch.int64, device=device)
    return torch.cat([dropout_seed, dropout_seed.new_zeros(1)])


def _seed_from(rng_state, dropout_p: float, device) -> Optional[Tensor]:
    if dropout_p == 0:
        return None
    if rng_state is None:
        raise ValueError("dropout_p > 0 needs the rng_state the forward returned: the backward regenerates the "
                         "forward's dropout mask from it")
    if (not isinstance(rng_state, Tensor) or rng_state.dtype != torch.int64 or rng_state.numel() < 1
            or rng_state.device != device):
        got = (f"{rng_state.dtype} {tuple(rng_state.shape)} on {rng_state.device}" if isinstance(rng_state, Tensor)
               else type(rng_state).__name__)
        raise ValueError(f"rng_state must be the int64 (2,) tensor on {device} that flashtile's forward returned, "
                         f"got {got}")
    return rng_state.reshape(-1)[:1]  # the seed; the kernels read its first element


def _check_like(t, name: str, like: Tensor, like_name: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(like.shape) or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} is {checks._dtype_name(t.dtype)} {tuple(t.shape)} on {t.device}; expected "
                         f"{like_name}'s {checks._dtype_name(like.dtype)} {tuple(like.shape)} on {like.device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last (head_dim) dimension, got strides {t.stride()}")


def _grad_buffers(dq, dk, dv, q: Tensor, k: Tensor, v: Tensor) -> List[Tensor]:
    """The given gradient tensors (checked), or new ones where None is given (flash_attn allocates those)."""
    grads = []
    for name, g, t, t_name in (("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")):
        if g is None:
            g = torch.empty_like(t)
        else:
            _check_like(g, name, t, t_name)
        grads.append(g)
    return grads


def _check_lse(softmax_lse, shape: tuple, device) -> None:
    if (not isinstance(softmax_lse, Tensor) or softmax_lse.dtype != torch.float32
            or tuple(softmax_lse.shape) != shape or softmax_lse.device != device):
        got = (f"{checks._dtype_name(softmax_lse.dtype)} {tuple(softmax_lse.shape)}" if isinstance(softmax_lse, Tensor)
               else type(softmax_lse).__name__)
        raise ValueError(f"softmax_lse must be the float32 {shape} tensor the forward returned, got {got}")


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------
# The backward writes into the caller's dq, dk, dv: an op that declares it, so torch.compile
# traces it (in eager mode its body runs directly, without the custom-op layers' host time).
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("flashtile::flash_attn_compat_bwd", mutates_args=("dq", "dk", "dv"))
def _backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dq: Tensor, dk: Tensor,
                 dv: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                 alibi_slopes: Optional[Tensor], dropout_seed: Optional[Tensor], floats: List[float],
                 ints: List[int]) -> None:
    """dq, dk, dv <- the gradients; floats and ints as ops.bwd (dense) or ops.varlen_bwd (with cu_seqlens)."""
    _backward_body(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed,
                   floats, ints)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, floats, ints):
    return None


def _backward_body(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed,
                   floats, ints) -> None:
    if cu_seqlens_q is None:
        window_left, window_right, deterministic = ints
        attention_backward(q, k, v, out, dout, lse, dq, dk, dv,
                           ScoreParams.from_op_args(alibi_slopes, dropout_seed, floats, window_left, window_right),
                           bool(deterministic))
        return
    max_seqlen_q, max_seqlen_k, window_left, window_right, deterministic = ints
    seqs = packed_seqs(cu_seqlens_q, cu_seqlens_k, None, None, None, max_seqlen_q, max_seqlen_k)
    # The kernels see a packed batch as (1, total, h, d) views, as in ops.varlen_bwd.
    attention_backward(*(t.unsqueeze(0) for t in (q, k, v, out, dout, lse, dq, dk, dv)),
                       ScoreParams.from_op_args(alibi_slopes, dropout_seed, floats, window_left, window_right),
                       bool(deterministic), seqs)


def _run_backward(*args) -> None:
    if torch.compiler.is_compiling():
        _backward_op(*args)
    else:
        _backward_body(*args)


def _softmax_d(dout: Tensor, out: Tensor, cu_seqlens_q: Optional[Tensor] = None) -> Tensor:
    """rowsum(dout * out) in float32, in flash_attn's padded layout (module docstring). Computed
    here with torch: the kernels keep their own copy internal."""
    delta = torch.einsum("...hd,...hd->...h", dout.float(), out.float())  # (b, sq, h) or (total, h)
    if cu_seqlens_q is None:
        batch, seqlen_q, nheads = delta.shape
        padded = delta.new_zeros((batch, nheads, -(-seqlen_q // 128) * 128))
        padded[:, :, :seqlen_q] = delta.transpose(1, 2)
        return padded
    total_q, nheads = delta.shape
    batch = cu_seqlens_q.shape[0] - 1
    rows = torch.arange(total_q, device=delta.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True)
    padded = delta.new_zeros((nheads, total_q + 128 * batch))
    padded[:, rows + 128 * seq] = delta.t()
    return padded


# ---------------------------------------------------------------------------------------------
# Dense
# ---------------------------------------------------------------------------------------------

def _flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
                        window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: Optional[Tensor], return_softmax: bool):
    """flash_attn's private dense forward: (out, softmax_lse (b, h, sq) float32, S_dmask, rng_state).
    q (b, sq, h, d), k and v (b, sk, hk, d). See the module docstring for S_dmask and rng_state."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(t, name, 4)
    checks.check_same_dtype_and_device({"q": q, "k": k, "v": v})
    checks.check_qkv_shapes(q, k, v)
    alibi_slopes, dropout_seed, floats, window_left, window_right = resolve_options(
        q, dropout_p, softmax_scale, causal, (window_size_left, window_size_right), softcap, alibi_slopes,
        return_attn_probs=return_softmax).op_args()
    ints = [window_left, window_right, 0]
    with torch.no_grad():
        out, lse = ops.dense_attention(q, k, v, alibi_slopes, dropout_seed, None, floats, ints)
        s_dmask = (ops.attention_probabilities(q, k, v, lse, None, None, None, None, None,
                                               (alibi_slopes, dropout_seed), floats, ints)
                   if return_softmax else q.new_empty((0,)))
    return out, lse, s_dmask, _rng_state(dropout_seed, q.device)


def _flash_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                         dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor], dropout_p: float,
                         softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                         softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
                         rng_state: Optional[Tensor] = None) -> Tensor:
    """flash_attn's private dense backward: writes dq, dk, dv (new ones where None), returns softmax_d
    (b, h, round128(sq)). rng_state: the forward's, needed with dropout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(t, name, 4)
    checks.check_same_dtype_and_device({"q": q, "k": k, "v": v})
    checks.check_qkv_shapes(q, k, v)
    _check_like(out, "out", q, "q")
    _check_like(_unit_last_stride(dout), "dout", q, "q")
    _check_lse(softmax_lse, (q.shape[0], q.shape[2], q.shape[1]), q.device)
    checks.check_dropout_p(dropout_p)
    # Dropout 0 here draws no seed; the forward's comes from rng_state.
    alibi_slopes, _, floats, window_left, window_right = resolve_options(
        q, 0.0, softmax_scale, causal, (window_size_left, window_size_right), softcap, alibi_slopes,
        deterministic=deterministic).op_args()
    floats[2] = float(dropout_p)
    dq, dk, dv = _grad_buffers(dq, dk, dv, q, k, v)
    dout = _unit_last_stride(dout)
    seed = _seed_from(rng_state, dropout_p, q.device)
    _run_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, None, None, alibi_slopes, seed, floats,
                  [window_left, window_right, int(bool(deterministic))])
    return _softmax_d(dout, out)


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------

def _flash_attn_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
                               causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                               softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                               return_softmax: bool = False, block_table: Optional[Tensor] = None,
                               leftpad_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                               zero_tensors: bool = False):
    """flash_attn's private varlen forward: (out, softmax_lse (h, total_q) float32, S_dmask, rng_state).
    Paged K/V (block_table) and seqused_k as flashtile.flash_attn_varlen_func; leftpad_k raises."""
    if leftpad_k is not None:
        raise NotImplementedError("leftpad_k is not supported by flashtile's varlen forward (flash_attn_with_kvcache "
                                  "takes cache_leftpad)")
    checks.check_flag(zero_tensors, "zero_tensors")  # nothing to zero: every output row is written
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, seqused_k,
                         block_table)
    alibi_slopes, dropout_seed, floats, window_left, window_right = resolve_options(
        q, dropout_p, softmax_scale, causal, (window_size_left, window_size_right), softcap, alibi_slopes,
        batch=cu_seqlens_q.shape[0] - 1, return_attn_probs=return_softmax).op_args()
    ints = [int(max_seqlen_q), int(max_seqlen_k), window_left, window_right, 0]
    with torch.no_grad():
        out, lse = ops.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, None, seqused_k, block_table,
                                        alibi_slopes, dropout_seed, None, floats, ints)
        s_dmask = (ops.attention_probabilities(q, k, v, lse, cu_seqlens_q, cu_seqlens_k, None, seqused_k,
                                               block_table, (alibi_slopes, dropout_seed), floats, ints)
                   if return_softmax else q.new_empty((0,)))
    return out, lse, s_dmask, _rng_state(dropout_seed, q.device)


def _flash_attn_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                                dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor],
                                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
                                window_size_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                                deterministic: bool, rng_state: Optional[Tensor] = None,
                                zero_tensors: bool = False) -> Tensor:
    """flash_attn's private varlen backward: writes dq, dk, dv (new ones where None), returns softmax_d
    (h, total_q + 128 * batch). zero_tensors changes nothing (every gradient row is written)."""
    checks.check_flag(zero_tensors, "zero_tensors")
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, None, None)
    _check_like(out, "out", q, "q")
    _check_like(_unit_last_stride(dout), "dout", q, "q")
    _check_lse(softmax_lse, (q.shape[1], q.shape[0]), q.device)
    checks.check_dropout_p(dropout_p)
    alibi_slopes, _, floats, window_left, window_right = resolve_options(  # dropout 0: no seed drawn
        q, 0.0, softmax_scale, causal, (window_size_left, window_size_right), softcap, alibi_slopes,
        batch=cu_seqlens_q.shape[0] - 1, deterministic=deterministic).op_args()
    floats[2] = float(dropout_p)
    dq, dk, dv = _grad_buffers(dq, dk, dv, q, k, v)
    dout = _unit_last_stride(dout)
    ints = [int(max_seqlen_q), int(max_seqlen_k), window_left, window_right, int(bool(deterministic))]
    seed = _seed_from(rng_state, dropout_p, q.device)
    _run_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed, floats,
                  ints)
    return _softmax_d(dout, out, cu_seqlens_q)
