"""Host-side facts about the sm90 copy engine (TMA) that the kernels share: which tensors
tensor descriptors can address, and which the Hopper Gluon kernels take."""

import functools

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


@functools.lru_cache(maxsize=None)
def _swizzled_layout(block: tuple, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


@functools.lru_cache(maxsize=None)
def _flat_layout(element_bits: int):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element_bits, rank=1)


def _host_descriptor(base: torch.Tensor, shape: list, strides: list, block: list, layout):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # TensorDescriptor's constructor re-validates what tma_aligned() already checked and
    # costs several microseconds of host time per descriptor; set the fields directly.
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout = base, shape, strides, block, layout
    desc.padding = "zero"
    return desc


def gluon_descriptor(t: torch.Tensor, rows: int, cols: int = 0):
    """Host TMA descriptor over a TMA-aligned (b, s, h, d) view (see tma_aligned) for Gluon
    kernels: (1, rows, 1, cols or d) boxes, swizzled the way wgmma reads them."""
    block = (1, rows, 1, cols or t.shape[-1])
    return _host_descriptor(t, list(t.shape), list(t.stride()), list(block), _swizzled_layout(block, t.dtype))


def gluon_row_descriptor(t: torch.Tensor, rows: int):
    """1-D host TMA descriptor over the whole buffer under a (b, h, s) float32 view with unit
    row stride: unswizzled boxes of ``rows`` values, addressed by flat offset."""
    flat = t.as_strided((t.shape[0] * t.stride(0),), (1,))
    return _host_descriptor(flat, [flat.numel()], [1], [rows], _flat_layout(32))
