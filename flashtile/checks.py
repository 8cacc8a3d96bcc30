"""Argument checks for the public API: every bad input gets an exception that names
the argument and says what was expected, before any kernel is launched."""

import numbers
import operator
from typing import Tuple

import torch

from .runtime import check_device_supported

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_GRID_DIM = 65535  # CUDA's limit on grid dims y and z (heads, batch)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(t, name: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)}; expected float16, bfloat16 or float32")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last (head_dim) dimension, got strides {t.stride()}")


def check_same_dtype_and_device(tensors: dict) -> None:
    names = list(tensors)
    first = tensors[names[0]]
    for name in names[1:]:
        t = tensors[name]
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)} but {names[0]} has "
                            f"{_dtype_name(first.dtype)}: {', '.join(names)} must share one dtype")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {names[0]} is on {first.device}: "
                             f"{', '.join(names)} must be on one device")
    check_device_supported(first.device, names[0], first.dtype)


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names=("q", "k", "v")) -> None:
    """Dense layout: q (b, sq, h, d), k (b, sk, hk, d) and v (b, sk, hk, dv); packed (varlen):
    q (total_q, h, d), k (total_k, hk, d) and v (total_k, hk, dv). v's head dim may differ from q's
    and k's (the output takes it), each at most MAX_HEAD_DIM."""
    qn, kn, vn = names
    nheads, head_dim = q.shape[-2], q.shape[-1]
    batch = q.shape[0] if q.dim() == 4 else 1
    if q.dim() == 4 and k.shape[0] != batch:
        raise ValueError(f"{kn} has batch size {k.shape[0]} but {qn} has {batch}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"{vn} has shape {tuple(v.shape)}; expected the shape of {kn}, {tuple(k.shape)}, in every "
                         "dim but the last (v's head dim may differ)")
    if k.shape[-1] != head_dim:
        raise ValueError(f"{kn} has head dim {k.shape[-1]} but {qn} has {head_dim}: they must match")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} of {qn} is not supported: expected 1 <= head_dim <= {MAX_HEAD_DIM}")
    if not 1 <= v.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {v.shape[-1]} of {vn} is not supported: expected 1 <= head_dim_v <= "
                         f"{MAX_HEAD_DIM}")
    nheads_k = k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"{qn} has {nheads} heads and {kn} has {nheads_k}: the number of query heads "
                         "must be a multiple of the number of key/value heads (MQA/GQA)")
    if nheads > MAX_GRID_DIM or batch > MAX_GRID_DIM:
        raise ValueError(f"{qn} has batch {batch} and {nheads} heads; each must be at most {MAX_GRID_DIM}")


def check_flag(value, name: str) -> bool:
    """A boolean option as a Python bool: True / False, numpy bools, or the ints 0 and 1 (what
    flash_attn's bool parameters take). Anything else would be read by truthiness, so it raises."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)  # flashtile never imports numpy; its bool type is recognised by name
    if isinstance(value, numbers.Integral):
        if value in (0, 1):
            return bool(value)
        raise ValueError(f"{name} must be a bool (True / False, or 0 / 1), got {value!r}")
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def window_pair(window_size) -> Tuple[int, int]:
    """window_size as two Python ints (left, right), from any pair of int-likes: a tuple, list or
    numpy array of Python or numpy ints or single-element integer tensors, or a 2-element integer tensor.
    A tensor on the GPU costs one host synchronisation (the kernels take the window as ints)."""
    expected = ("window_size must be a pair of ints (left, right): Python or numpy ints, integer tensors of "
                "one element, or an integer tensor of two")
    if isinstance(window_size, torch.Tensor):
        if window_size.is_floating_point() or window_size.is_complex() or window_size.dtype == torch.bool \
                or window_size.numel() != 2:
            raise ValueError(f"{expected}; got a {_dtype_name(window_size.dtype)} tensor of shape "
                             f"{tuple(window_size.shape)}")
        items = window_size.reshape(2).tolist()
    elif (not isinstance(window_size, (str, bytes)) and hasattr(window_size, "__len__")
          and hasattr(window_size, "__iter__") and len(window_size) == 2):
        items = list(window_size)  # a tuple, a list, a numpy array of two ints, ...
    else:
        raise ValueError(f"{expected}; got {window_size!r}")
    pair = []
    for w in items:
        # bool is an int (and a bool tensor has __index__): a window of True is a mistake
        if isinstance(w, bool) or (isinstance(w, torch.Tensor) and w.dtype == torch.bool):
            raise ValueError(f"{expected}; got {window_size!r}")
        try:
            pair.append(operator.index(w))  # ints, numpy ints, one-element integer tensors; never floats
        except TypeError:
            raise ValueError(f"{expected}; got {window_size!r}") from None
    if any(w < -1 for w in pair):
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {tuple(pair)}")
    return pair[0], pair[1]


def check_dropout_p(dropout_p) -> None:
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")


def check_options(*, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  batch: int, nheads: int, device: torch.device, deterministic=False,
                  return_attn_probs=False) -> Tuple[int, int]:
    """Check the score options and the boolean flags; returns the window as (left, right) ints."""
    check_dropout_p(dropout_p)
    if softmax_scale is not None and (not isinstance(softmax_scale, numbers.Real)
                                      or isinstance(softmax_scale, bool)):
        raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    check_flag(causal, "causal")
    check_flag(deterministic, "deterministic")
    check_flag(return_attn_probs, "return_attn_probs")
    window = window_pair(window_size)
    if not isinstance(softcap, numbers.Real) or float(softcap) < 0.0:
        raise ValueError(f"softcap must be a number >= 0 (0 disables it), got {softcap!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes has dtype {_dtype_name(alibi_slopes.dtype)}; expected float32")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({nheads},) "
                             f"or ({batch}, {nheads}) (nheads,) or (batch, nheads)")
        if alibi_slopes.device != device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    return window


def _check_index_tensor(t, name: str, length: int, device: torch.device, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}), got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)}; expected int32 ({what})")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({length},) ({what})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    check_unit_stride(t, name)


def check_unit_stride(t: torch.Tensor, name: str) -> None:
    """Raise unless the 1-D index tensor ``t`` is contiguous: the kernels read entry b at pointer + b."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (the kernels read entry b at offset b), got stride "
                         f"{t.stride(0)}; pass {name}.contiguous()")


def _check_length(value, name: str) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{name} must be a Python int >= 0 (the longest sequence), got {value!r}")


def check_varlen_batch(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       seqused_q=None, seqused_k=None, validate: bool = False, block_table=None) -> None:
    """What can be checked without reading device memory: dtypes, shapes, devices, ints.

    With ``validate`` (FLASHTILE_VALIDATE=1, or CPU tensors where it costs nothing) also the
    contents: cu_seqlens start at 0, never decrease and end at the tensors' totals, every
    length fits max_seqlen, and seqused stays within the reserved lengths. On CUDA that costs a
    host synchronisation per call, so by default it is the caller's contract (as in flash_attn).
    """
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        shape = tuple(cu_seqlens_q.shape) if isinstance(cu_seqlens_q, torch.Tensor) else type(cu_seqlens_q).__name__
        raise ValueError(f"cu_seqlens_q must be a 1-D int32 tensor of batch + 1 prefix sums, got {shape}")
    batch = cu_seqlens_q.shape[0] - 1
    what = "cumulative sequence lengths, batch + 1 entries"
    _check_index_tensor(cu_seqlens_q, "cu_seqlens_q", batch + 1, q.device, what)
    _check_index_tensor(cu_seqlens_k, "cu_seqlens_k", batch + 1, q.device, what + ", like cu_seqlens_q")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _check_index_tensor(t, name, batch, q.device, "tokens used per sequence, batch entries")
    _check_length(max_seqlen_q, "max_seqlen_q")
    _check_length(max_seqlen_k, "max_seqlen_k")
    if batch > MAX_GRID_DIM:
        raise ValueError(f"cu_seqlens_q describes {batch} sequences; at most {MAX_GRID_DIM} are supported")
    if block_table is not None:
        check_block_table(block_table, k, batch, q.device)
    if validate:
        validate_varlen_contents(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                                  block_table)


def check_block_table(block_table, k, batch: int, device) -> None:
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table has dtype {_dtype_name(block_table.dtype)}; expected int32")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; expected ({batch}, pages per sequence)")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have a unit stride in its last dimension, got {block_table.stride()}")
    if k.dim() != 4 or k.shape[0] == 0 or k.shape[1] == 0:
        raise ValueError(f"with block_table, k and v must be paged caches (num_pages, page_size, nheads_k, headdim) "
                         f"with at least one page of at least one row, got {tuple(k.shape)}")


def validate_varlen_contents(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                              block_table=None):
    # A paged cache bounds each sequence's keys by its pages, not by a packed total.
    k_total = None if block_table is not None else k.shape[0]
    for side, cu, total, max_len, used in (("q", cu_seqlens_q, q.shape[0], max_seqlen_q, seqused_q),
                                          ("k", cu_seqlens_k, k_total, max_seqlen_k, seqused_k)):
        name = f"cu_seqlens_{side}"
        cu = cu.cpu().long()
        lengths = cu[1:] - cu[:-1]
        if cu[0].item() != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0].item()}")
        if (lengths < 0).any():
            at = int((lengths < 0).nonzero()[0])
            raise ValueError(f"{name} must not decrease: entry {at + 1} ({cu[at + 1].item()}) < entry {at} "
                             f"({cu[at].item()})")
        if total is not None and cu[-1].item() != total:
            raise ValueError(f"{name} ends at {cu[-1].item()} but {'q' if side == 'q' else 'k/v'} holds {total} "
                             "tokens: the last entry must equal the packed total")
        if lengths.numel() and lengths.max().item() > max_len:
            raise ValueError(f"max_seqlen_{side} is {max_len} but a sequence in {name} has "
                             f"{lengths.max().item()} tokens: it must be at least the longest")
        if used is not None:
            used = used.cpu().long()
            if ((used < 0) | (used > lengths)).any():
                at = int(((used < 0) | (used > lengths)).nonzero()[0])
                raise ValueError(f"seqused_{side}[{at}] = {used[at].item()} is outside [0, {lengths[at].item()}], "
                                 f"the length {name} reserves for sequence {at}")
    if block_table is not None:
        table = block_table.cpu().long()
        capacity = table.shape[1] * k.shape[1]
        lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).cpu().long()
        if seqused_k is not None:
            lengths = torch.minimum(lengths, seqused_k.cpu().long())
        if lengths.numel() and lengths.max().item() > capacity:
            at = int(lengths.argmax())
            raise ValueError(f"sequence {at} has {lengths[at].item()} keys but block_table holds "
                             f"{table.shape[1]} pages of {k.shape[1]} rows ({capacity} keys) per sequence")
        validate_block_table_pages(table, lengths, k.shape[1], k.shape[0], "k / v")


def validate_block_table_pages(table: torch.Tensor, key_counts: torch.Tensor, page_size: int, num_pages: int,
                               pool: str) -> None:
    """Every page a sequence's first key_counts[b] keys use lies in the pool (CPU tensors)."""
    pages_used = (key_counts + page_size - 1) // page_size
    for b in range(table.shape[0]):
        used = table[b, :pages_used[b]]
        if ((used < 0) | (used >= num_pages)).any():
            bad = used[(used < 0) | (used >= num_pages)][0].item()
            raise ValueError(f"block_table[{b}] points at page {bad}, outside the {num_pages} pages of {pool}")


def check_kvcache_contents(cache_seqlens, seqlen_new, capacity, cache_batch_idx, rows, block_table, num_pages,
                           rotary_len, rotated_positions_end, cache_leftpad) -> None:
    """flash_attn_with_kvcache's checks that need the device's values (CPU tensors, or
    FLASHTILE_VALIDATE=1): run before the cache is written, so a bad call leaves it untouched."""
    lengths = cache_seqlens.cpu().long()
    if cache_leftpad is not None:
        pad = cache_leftpad.cpu().long()
        if ((pad < 0) | (pad > lengths)).any():
            at = int(((pad < 0) | (pad > lengths)).nonzero()[0])
            raise ValueError(f"cache_leftpad[{at}] = {pad[at].item()} is outside [0, cache_seqlens[{at}] = "
                             f"{lengths[at].item()}]")
    if (lengths < 0).any() or (lengths + seqlen_new > capacity).any():
        at = int(((lengths < 0) | (lengths + seqlen_new > capacity)).nonzero()[0])
        raise ValueError(f"cache_seqlens[{at}] = {lengths[at].item()} plus {seqlen_new} new tokens does not fit the "
                         f"cache's {capacity} positions per sequence")
    if cache_batch_idx is not None:
        idx = cache_batch_idx.cpu().long()
        if ((idx < 0) | (idx >= rows)).any():
            raise ValueError(f"cache_batch_idx holds {idx[(idx < 0) | (idx >= rows)][0].item()}, outside the "
                             f"{rows} rows of k_cache")
    if block_table is not None:
        validate_block_table_pages(block_table.cpu().long(), lengths + seqlen_new,
                                          capacity // block_table.shape[1], num_pages, "k_cache")
    if rotary_len is not None and (lengths + rotated_positions_end).max().item() > rotary_len:
        raise ValueError(f"rotary_cos has {rotary_len} positions but the call rotates up to position "
                         f"{(lengths + rotated_positions_end).max().item() - 1}: the tables are too short")


def check_aux_tensors(aux_tensors, device: torch.device, name: str = "aux_tensors") -> None:
    """Raise unless ``aux_tensors`` is a sequence of contiguous tensors on ``device`` (a score or mask
    mod reads them by pointer)."""
    if isinstance(aux_tensors, torch.Tensor) or not isinstance(aux_tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(aux_tensors).__name__}")
    for i, t in enumerate(aux_tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name}[{i}] is on {t.device} but q is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous (the mods index it by pointer), got strides "
                             f"{tuple(t.stride())} for shape {tuple(t.shape)}")
