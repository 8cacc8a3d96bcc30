"""Argument checks for the public API: every bad input gets an exception that names
the argument and says what was expected, before any kernel is launched."""

import numbers

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
    check_device_supported(first.device, names[0])


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names=("q", "k", "v")) -> None:
    """Dense layout: q (b, sq, h, d), k and v (b, sk, hk, d)."""
    qn, kn, vn = names
    batch, _, nheads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"{kn} has batch size {k.shape[0]} but {qn} has {batch}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{vn} has shape {tuple(v.shape)}; expected the shape of {kn}, {tuple(k.shape)}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"{kn} has head dim {k.shape[-1]} but {qn} has {head_dim}: they must match")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} of {qn} is not supported: expected 1 <= head_dim <= {MAX_HEAD_DIM}")
    nheads_k = k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"{qn} has {nheads} heads and {kn} has {nheads_k}: the number of query heads "
                         "must be a multiple of the number of key/value heads (MQA/GQA)")
    if nheads > MAX_GRID_DIM or batch > MAX_GRID_DIM:
        raise ValueError(f"{qn} has batch {batch} and {nheads} heads; each must be at most {MAX_GRID_DIM}")


def check_options(*, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  batch: int, nheads: int, device: torch.device) -> None:
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if softmax_scale is not None and (not isinstance(softmax_scale, numbers.Real)
                                      or isinstance(softmax_scale, bool)):
        raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    if not isinstance(causal, (bool, int)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if any(w < -1 for w in window_size):
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {tuple(window_size)}")
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
