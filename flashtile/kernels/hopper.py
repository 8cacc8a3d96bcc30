"""Host-side facts about the sm90 copy engine (TMA) that the kernels share: which tensors
tensor descriptors can address, and which the Hopper Gluon kernels take."""

import torch

from ..runtime import device_capability

FLOAT16_TYPES = (torch.bfloat16, torch.float16)


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can cover ``t``: no empty dim, a 16-byte aligned base,
    16-byte strides and a unit last stride."""
    size = t.element_size()
    return (t.numel() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((stride * size) % 16 == 0 for stride in t.stride()[:-1]))


def qkv_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims: tuple) -> bool:
    """(b, s, h, d) fp16/bf16 CUDA tensors on an sm90 device, with a head dim in ``head_dims``,
    consistent GQA shapes and TMA-aligned layouts."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False
    if device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) != (9, 0):
        return False
    if q.dtype not in FLOAT16_TYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    head_dim = q.shape[-1]
    if head_dim not in head_dims or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return False
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        return False
    return tma_aligned(q) and tma_aligned(k) and tma_aligned(v)
