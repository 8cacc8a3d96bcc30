"""flashtile as PyTorch's SDPA flash backend (torch >= 2.10's flash-attention registry).

    import torch, flashtile
    flashtile.register_sdpa()                                   # once; registers, activates nothing
    torch.nn.attention.activate_flash_attention_impl("flashtile")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # flash path: flashtile's kernels
    torch.nn.attention.restore_flash_attention_impl()            # back to PyTorch's FA2

While active, flashtile serves the CUDA kernels of ``aten::_scaled_dot_product_flash_attention``
(and its backward), ``aten::_flash_attention_forward`` / ``_backward`` (dense, and packed with
cum_seq_q / cum_seq_k: ``torch.nn.attention.varlen``, nested tensors) and
``_flash_attention_forward_no_dropout_inplace`` where this torch has it, with the values torch
expects of them: out in the query's layout, logsumexp float32 (b, h, sq) dense or (h, total_q)
packed, uint64 rng_state (2,) and a uint64 scalar, cum_seq / max_seqlen as the FA2 kernels return.

- Dropout: flashtile's counter-based dropout takes an int64 seed drawn from torch's generator on the
  device (reproducible under torch.manual_seed); rng_state holds ``[seed, 0]`` and the backward
  regenerates the mask from it. Masks differ from PyTorch's FA2 (another RNG), not their statistics.
- Causal: these ops' is_causal is FA2's, bottom-right aligned when sq != sk, as flashtile's. SDPA
  never routes its top-left is_causal with sq != sk to them (torch's own flash check), and
  ``causal_lower_right`` reaches them on purpose; both therefore come out right.
- What flashtile does not take (see ``_forward_problem``) runs on PyTorch's own kernel, with a
  RuntimeWarning once per reason; :data:`fallbacks` counts them by reason.
- Only SDPA's flash backend is replaced: where SDPA picks another (cuDNN comes first on some sm90+
  setups), force flash with ``torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)``.
- :data:`calls` counts flashtile-served calls: "forward", "backward", "varlen_forward", "varlen_backward".
"""

import collections
import math
import warnings
from typing import Optional

import torch

from .. import checks
from ..runtime import empty, empty_like, validate_enabled

NAME = "flashtile"

calls: collections.Counter = collections.Counter()
fallbacks: collections.Counter = collections.Counter()

# The ops served, each with its argument names in schema order (positional and keyword-only): the
# kernels receive them boxed (positional ones as args, keyword-only ones as kwargs); the fallback
# hands PyTorch's kernel exactly what came in.
_SDPA_FWD = "_scaled_dot_product_flash_attention"
_SDPA_BWD = "_scaled_dot_product_flash_attention_backward"
_FLASH_FWD = "_flash_attention_forward"
_FLASH_FWD_INPLACE = "_flash_attention_forward_no_dropout_inplace"
_FLASH_BWD = "_flash_attention_backward"
_ARGS = {
    _SDPA_FWD: ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"),
    _SDPA_BWD: ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                "max_k", "dropout_p", "is_causal", "rng_state", "unused", "scale"),
    _FLASH_FWD: ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                 "return_debug_mask", "scale", "window_size_left", "window_size_right", "seqused_k",
                 "alibi_slopes", "block_table", "num_splits"),
    _FLASH_FWD_INPLACE: ("out", "query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                         "is_causal", "return_debug_mask", "scale", "window_size_left", "window_size_right",
                         "seqused_k", "alibi_slopes", "block_table", "num_splits"),
    _FLASH_BWD: ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                 "max_k", "dropout_p", "is_causal", "rng_state", "unused", "scale", "window_size_left",
                 "window_size_right"),
}
_DEFAULTS = {"dropout_p": 0.0, "is_causal": False, "return_debug_mask": False}

# PyTorch's kernels for the ops, taken when activated (before ours replace them): the fallback.
_native: dict = {}
_warned: set = set()
# rng_state tensors of forwards with dropout that PyTorch's kernel ran (by data pointer, holding the
# tensor so the pointer stays unique): their backward must run there too, or the masks would differ.
_native_rng: "collections.OrderedDict[int, torch.Tensor]" = collections.OrderedDict()
_NATIVE_RNG_KEPT = 4096


def _registry():
    """torch.nn.attention's registry functions, or a RuntimeError naming this torch."""
    import torch.nn.attention as attention

    missing = [name for name in ("register_flash_attention_impl", "activate_flash_attention_impl")
               if not hasattr(attention, name)]
    if not hasattr(torch.library, "get_kernel"):
        missing.append("torch.library.get_kernel")
    if missing:
        raise RuntimeError(f"flashtile.register_sdpa needs PyTorch's flash-attention registry (torch >= 2.10: "
                           f"torch.nn.attention.register_flash_attention_impl); torch {torch.__version__} lacks "
                           f"{', '.join(missing)}. Call flashtile.flash_attn_func directly instead.")
    return attention


def register_sdpa() -> str:
    """Register flashtile in torch's flash-attention registry under the name "flashtile" (idempotent;
    activates nothing). Then ``torch.nn.attention.activate_flash_attention_impl("flashtile")`` routes
    SDPA's flash path to flashtile and ``restore_flash_attention_impl()`` undoes it. Returns the name."""
    attention = _registry()
    try:
        attention.register_flash_attention_impl(NAME, register_fn=_activate)
    except TypeError:  # a registry that takes the function positionally
        attention.register_flash_attention_impl(NAME, _activate)
    return NAME


class _Handle:
    """What activation registered; the registry calls remove() on restore (or another activation)."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        library, self.library = self.library, None
        if library is not None:
            library._destroy()  # PyTorch's kernels are back in the dispatch table at once
            _native.clear()


def _activate(*_args, **_kwargs) -> _Handle:
    """The registry's register_fn: our kernels for the CUDA dispatch key."""
    return _register_kernels("CUDA")


def _op_exists(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"aten::{name}", "")
        return True
    except RuntimeError:
        return False


def _register_kernels(dispatch_key: str) -> _Handle:
    """Register the kernels for ``dispatch_key`` (CUDA; the CPU tests use CPU to reach them through
    the dispatcher and autograd), keeping PyTorch's current kernels for the fallback."""
    kernels = {_SDPA_FWD: _sdpa_forward_kernel, _SDPA_BWD: _sdpa_backward_kernel, _FLASH_FWD: _flash_forward_kernel,
               _FLASH_FWD_INPLACE: _flash_forward_inplace_kernel, _FLASH_BWD: _flash_backward_kernel}
    kernels = {name: fn for name, fn in kernels.items() if _op_exists(name)}
    _native.clear()
    for name in kernels:
        try:
            _native[name] = torch.library.get_kernel(f"aten::{name}", dispatch_key)
        except RuntimeError:  # no kernel for this key (e.g. a CPU-only build): nothing to fall back to
            _native[name] = None
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    with warnings.catch_warnings():
        # Replacing aten's kernel is the point; torch warns about it on every override.
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*previously registered kernel.*")
        for name, fn in kernels.items():
            library.impl(name, fn, dispatch_key, with_keyset=True)
    return _Handle(library)


# ---------------------------------------------------------------------------------------------
# Arguments and fallback
# ---------------------------------------------------------------------------------------------

def _bind(op: str, args: tuple, kwargs: dict) -> dict:
    names = _ARGS[op]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    for name in names:
        bound.setdefault(name, _DEFAULTS.get(name))
    return bound


def _fallback(op: str, reason: str, keyset, args: tuple, kwargs: dict):
    """PyTorch's kernel for ``op``, with a warning the first time this reason shows."""
    fallbacks[reason] += 1
    message = f"flashtile SDPA backend: aten::{op} runs on PyTorch's kernel instead: {reason}"
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    native = _native.get(op)
    if native is None:
        raise RuntimeError(f"{message}; but this torch has no kernel of its own for it to fall back to")
    return native.call_boxed(keyset, *args, **kwargs)


def _remember_native_rng(rng_state, dropout_p) -> None:
    if dropout_p and isinstance(rng_state, torch.Tensor):
        _native_rng[rng_state.data_ptr()] = rng_state
        while len(_native_rng) > _NATIVE_RNG_KEPT:
            _native_rng.popitem(last=False)


def _ran_natively(rng_state, dropout_p) -> bool:
    return bool(dropout_p) and isinstance(rng_state, torch.Tensor) and rng_state.data_ptr() in _native_rng


def _inputs_problem(query, key, value, packed: bool, paged: bool = False) -> Optional[str]:
    """Why flashtile cannot take these q, k, v (flash layout), or None. A function of the tensors'
    metadata only, shared by forward and backward, so both ends of a call land on the same side."""
    tensors = {"query": query, "key": key, "value": value}
    try:
        for name, t in tensors.items():
            if t.dtype not in checks.SUPPORTED_DTYPES:
                return f"{name} has dtype {t.dtype} (flashtile takes float16, bfloat16, float32)"
            ndim = 4 if (not packed or (paged and name != "query")) else 3
            if t.dim() != ndim:
                return f"{name} has shape {tuple(t.shape)}, expected {ndim} dimensions"
        checks.check_same_dtype_and_device(tensors)
        if paged:
            checks.check_qkv_shapes(query, key[0], value[0], names=("query", "key", "value"))
        else:
            checks.check_qkv_shapes(query, key, value, names=("query", "key", "value"))
    except (TypeError, ValueError, RuntimeError) as error:
        return str(error)
    return None


def _forward_problem(a: dict) -> Optional[str]:
    """Why flashtile does not serve this forward, or None."""
    packed = a["cum_seq_q"] is not None
    paged = a["block_table"] is not None
    if a["return_debug_mask"]:
        return "return_debug_mask=True (flashtile does not build FA2's debug mask)"
    if a["alibi_slopes"] is not None:
        return "alibi_slopes (the backward op takes no slopes; PyTorch's kernel keeps its own behaviour)"
    if not 0.0 <= float(a["dropout_p"]) < 1.0:
        return f"dropout_p={a['dropout_p']}"
    if not packed and (a["cum_seq_k"] is not None or a["seqused_k"] is not None or paged):
        return "cum_seq_k, seqused_k or block_table on a dense call (flashtile takes them with cum_seq_q)"
    if packed and a["cum_seq_k"] is None:
        return "cum_seq_q without cum_seq_k"
    problem = _inputs_problem(a["query"], a["key"], a["value"], packed, paged)
    if problem is None and packed:
        try:
            checks.check_varlen_batch(a["query"], a["key"], a["cum_seq_q"], a["cum_seq_k"], int(a["max_q"]),
                                      int(a["max_k"]), None, a["seqused_k"], validate=False,
                                      block_table=a["block_table"])
        except (TypeError, ValueError) as error:
            return str(error)
    return problem


def _backward_problem(a: dict) -> Optional[str]:
    packed = a["cum_seq_q"] is not None
    if packed and a["cum_seq_k"] is None:
        return "cum_seq_q without cum_seq_k"
    problem = _inputs_problem(a["query"], a["key"], a["value"], packed)
    if problem is not None:
        return problem
    query, lse = a["query"], a["logsumexp"]
    expected = (query.shape[-2], query.shape[0]) if packed else (query.shape[0], query.shape[2], query.shape[1])
    if lse.dtype != torch.float32 or tuple(lse.shape) != expected:
        return f"logsumexp is {lse.dtype} {tuple(lse.shape)}, expected float32 {expected}"
    for name in ("grad_out", "out"):
        t = a[name]
        if t.dtype != query.dtype or t.shape != query.shape or t.device != query.device:
            return f"{name} is {t.dtype} {tuple(t.shape)} on {t.device}, unlike query"
    return None


# ---------------------------------------------------------------------------------------------
# flashtile's kernels on the ops' layouts
# ---------------------------------------------------------------------------------------------

def _unit_last(t: torch.Tensor) -> torch.Tensor:
    # The kernels need a unit stride along head_dim (any other strides are fine).
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _window(is_causal, left, right):
    left = -1 if left is None else int(left)
    right = -1 if right is None else int(right)
    return left, 0 if is_causal else right


def _rng_state(seed: Optional[torch.Tensor], device) -> torch.Tensor:
    """The (2,) uint64 rng_state torch's flash ops return: [flashtile's seed, 0]."""
    if seed is None:
        return torch.zeros(2, dtype=torch.uint64, device=device)
    return torch.cat([seed, seed.new_zeros(1)]).view(torch.uint64)


def _seed_of(rng_state, dropout_p) -> Optional[torch.Tensor]:
    if not dropout_p:
        return None
    seed = rng_state.reshape(-1)[:1]
    return seed if seed.dtype == torch.int64 else seed.view(torch.int64)


def _params(head_dim, scale, is_causal, window_left, window_right, dropout_p, seed):
    from ..options import ScoreParams

    left, right = _window(is_causal, window_left, window_right)
    softmax_scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
    return ScoreParams(softmax_scale=softmax_scale, window_left=left, window_right=right,
                       dropout_p=float(dropout_p), dropout_seed=seed)


def _seqs(a: dict, with_pages: bool):
    from ..options import PackedSeqs

    seqused_k = a.get("seqused_k")
    return PackedSeqs(a["cum_seq_q"].contiguous(), a["cum_seq_k"].contiguous(), int(a["max_q"]), int(a["max_k"]),
                      None, None if seqused_k is None else seqused_k.contiguous(),
                      a.get("block_table") if with_pages else None)


def _output_like(query: torch.Tensor) -> torch.Tensor:
    # torch's meta kernels promise empty_like(query) (compiled graphs check the strides).
    out = empty_like(query)
    return out if out.stride(-1) == 1 else empty(query.shape, query.dtype, query.device)


def _run_forward(a: dict, out: torch.Tensor) -> tuple:
    """Attention of a's flash-layout q, k, v into ``out``: (lse, rng_state)."""
    from ..dispatch import attention_forward

    q, k, v = (_unit_last(a[name]) for name in ("query", "key", "value"))
    dropout_p = float(a["dropout_p"])
    seed = None
    if dropout_p > 0:
        # From the device's default generator, as flashtile's own API draws it: reproducible under
        # torch.manual_seed, no host sync, capturable in CUDA graphs.
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    params = _params(q.shape[-1], a["scale"], a["is_causal"], a["window_size_left"], a["window_size_right"],
                     dropout_p, seed)
    if a["cum_seq_q"] is None:
        lse = empty((q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device)
        attention_forward(q, k, v, out, lse, params)
        calls["forward"] += 1
    else:
        paged = a["block_table"] is not None
        if validate_enabled() or q.device.type == "cpu":
            checks.validate_varlen_contents(q, k, a["cum_seq_q"], a["cum_seq_k"], int(a["max_q"]), int(a["max_k"]),
                                            None, a["seqused_k"], a["block_table"])
        lse = empty((q.shape[1], q.shape[0]), torch.float32, q.device)
        k4, v4 = (k, v) if paged else (k.unsqueeze(0), v.unsqueeze(0))
        attention_forward(q.unsqueeze(0), k4, v4, out.unsqueeze(0), lse.unsqueeze(0), params, _seqs(a, True))
        calls["varlen_forward"] += 1
    return lse, _rng_state(seed, q.device)


def _run_backward(a: dict) -> tuple:
    """dq, dk, dv (each like its input) for a's flash-layout tensors."""
    from ..dispatch import attention_backward

    q, k, v, out, dout = (_unit_last(a[name]) for name in ("query", "key", "value", "out", "grad_out"))
    lse = a["logsumexp"].contiguous()
    dropout_p = float(a["dropout_p"])
    params = _params(q.shape[-1], a["scale"], a["is_causal"], a.get("window_size_left"),
                     a.get("window_size_right"), dropout_p, _seed_of(a["rng_state"], dropout_p))
    dq, dk, dv = (_output_like(a[name]) for name in ("query", "key", "value"))
    deterministic = torch.are_deterministic_algorithms_enabled()
    if a["cum_seq_q"] is None:
        attention_backward(q, k, v, out, dout, lse, dq, dk, dv, params, deterministic)
        calls["backward"] += 1
    else:
        attention_backward(*(t.unsqueeze(0) for t in (q, k, v, out, dout, lse, dq, dk, dv)), params, deterministic,
                           _seqs(a, False))
        calls["varlen_backward"] += 1
    return dq, dk, dv


def _backward_or_fallback(op: str, keyset, args, kwargs, a: dict):
    if _ran_natively(a["rng_state"], a["dropout_p"]):
        fallbacks["backward of a forward PyTorch's kernel ran (same dropout mask)"] += 1
        return _native_call(op, keyset, args, kwargs)
    problem = _backward_problem(a)
    if problem is None:
        return None
    if a["dropout_p"]:
        # The forward was flashtile's (else its rng_state would be known): PyTorch's kernel would
        # draw another dropout mask, a silently wrong gradient.
        raise RuntimeError(f"flashtile SDPA backend: aten::{op} with dropout_p > 0 cannot run: {problem}; its forward "
                           "ran on flashtile, whose dropout mask only flashtile's backward regenerates")
    return _fallback(op, problem, keyset, args, kwargs)


def _native_call(op, keyset, args, kwargs):
    native = _native.get(op)
    if native is None:
        raise RuntimeError(f"flashtile SDPA backend: aten::{op}: this torch has no kernel of its own to run")
    return native.call_boxed(keyset, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# The kernels registered for the ops (keyset first: with_keyset=True)
# ---------------------------------------------------------------------------------------------

def _sdpa_forward_kernel(keyset, *args, **kwargs):
    """(out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask);
    q, k, v and out (b, h, s, d), logsumexp (b, h, sq)."""
    a = _bind(_SDPA_FWD, args, kwargs)
    query, key, value = a["query"], a["key"], a["value"]
    # flashtile's layout (b, s, h, d) as views: SDPA's tensors are usually such views already.
    flash = dict(a, query=query.transpose(1, 2), key=key.transpose(1, 2), value=value.transpose(1, 2),
                 cum_seq_q=None, cum_seq_k=None, max_q=query.shape[2], max_k=key.shape[2], window_size_left=None,
                 window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None)
    problem = _forward_problem(flash)
    if problem is not None:
        result = _fallback(_SDPA_FWD, problem, keyset, args, kwargs)
        _remember_native_rng(result[6], a["dropout_p"])
        return result
    out = _output_like(query)
    lse, rng_state = _run_forward(flash, out.transpose(1, 2))
    return (out, lse, None, None, query.shape[2], key.shape[2], rng_state,
            torch.zeros((), dtype=torch.uint64, device=query.device), torch.empty(0, dtype=query.dtype,
                                                                                  device=query.device))


def _sdpa_backward_kernel(keyset, *args, **kwargs):
    a = _bind(_SDPA_BWD, args, kwargs)
    flash = dict(a, cum_seq_q=None, cum_seq_k=None, window_size_left=None, window_size_right=None,
                 **{name: a[name].transpose(1, 2) for name in ("grad_out", "query", "key", "value", "out")})
    fallback = _backward_or_fallback(_SDPA_BWD, keyset, args, kwargs, flash)
    if fallback is not None:
        return fallback
    dq, dk, dv = _run_backward(flash)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _flash_forward_kernel(keyset, *args, **kwargs):
    """(out, softmax_logsumexp, rng_state, unused, debug_attn_mask) on (b, s, h, d) or packed (t, h, d)."""
    a = _bind(_FLASH_FWD, args, kwargs)
    problem = _forward_problem(a)
    if problem is not None:
        result = _fallback(_FLASH_FWD, problem, keyset, args, kwargs)
        _remember_native_rng(result[2], a["dropout_p"])
        return result
    query = a["query"]
    out = _output_like(query)
    lse, rng_state = _run_forward(a, out)
    return (out, lse, rng_state, torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _flash_forward_inplace_kernel(keyset, *args, **kwargs):
    """softmax_logsumexp; the attention goes into the given ``out``."""
    a = _bind(_FLASH_FWD_INPLACE, args, kwargs)
    out = a["out"]
    problem = _forward_problem(a)
    if problem is None and (out.shape != a["query"].shape or out.dtype != a["query"].dtype
                            or out.device != a["query"].device or (out.shape[-1] > 1 and out.stride(-1) != 1)):
        problem = "out is not a unit-stride tensor shaped like query"
    if problem is not None:
        return _fallback(_FLASH_FWD_INPLACE, problem, keyset, args, kwargs)
    lse, _ = _run_forward(a, out)
    return lse


def _flash_backward_kernel(keyset, *args, **kwargs):
    a = _bind(_FLASH_BWD, args, kwargs)
    fallback = _backward_or_fallback(_FLASH_BWD, keyset, args, kwargs, a)
    if fallback is not None:
        return fallback
    return _run_backward(a)
