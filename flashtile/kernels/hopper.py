"""Host-side facts about the sm90 copy engine (TMA) that the kernels share: which tensors
tensor descriptors can address, and which the Hopper Gluon kernels take."""

import functools

import torch

from ..runtime import device_capability, multiprocessor_count

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


class DescriptorTemplate:
    """Host TMA descriptors over TMA-aligned (b, s, h, d) views (see tma_aligned) of one shape,
    strides and dtype, for Gluon kernels: (1, rows, 1, cols or d) boxes, swizzled the way wgmma
    reads them. Calling it with a tensor of that shape, strides and dtype gives its descriptor:
    only the base changes (launch plans build descriptors on every call)."""

    def __init__(self, t: torch.Tensor, rows: int, cols: int = 0):
        block = (1, rows, 1, cols or t.shape[-1])
        self.shape, self.strides, self.block = list(t.shape), list(t.stride()), list(block)
        self.layout = _swizzled_layout(block, t.dtype)

    def __call__(self, t: torch.Tensor):
        return _host_descriptor(t, self.shape, self.strides, self.block, self.layout)


class TileDescriptorTemplate:
    """Host tensor descriptors of triton.tools (what the portable Triton kernels take) over
    TMA-aligned (b, s, h, d) views of one shape and strides: (1, rows, 1, cols) tiles of one
    (batch, head). Calling it with such a tensor gives its descriptor."""

    def __init__(self, t: torch.Tensor, rows: int, cols: int):
        self.shape, self.strides, self.block = list(t.shape), list(t.stride()), [1, rows, 1, cols]

    def __call__(self, t: torch.Tensor):
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = object.__new__(TensorDescriptor)  # fields set directly, as _host_descriptor does
        desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = (t, self.shape, self.strides,
                                                                               self.block, "zero")
        return desc


class RowDescriptorTemplate:
    """1-D host TMA descriptors over the whole buffer under (b, h, s) float32 views with unit row
    stride, of one shape and strides: unswizzled boxes of ``rows`` values, addressed by flat offset.
    Calling it with such a view gives its descriptor (the view itself is the base: its address is
    the flat buffer's)."""

    def __init__(self, t: torch.Tensor, rows: int):
        self.shape, self.strides, self.block = [t.shape[0] * t.stride(0)], [1], [rows]
        self.layout = _flat_layout(t.element_size() * 8)

    def __call__(self, t: torch.Tensor):
        return _host_descriptor(t, self.shape, self.strides, self.block, self.layout)


def multiprocessors(device: torch.device) -> int:
    """SMs of the device (one Hopper CTA fills one); 132 (an H100 SXM / H200) for CPU tensors, which
    the compile checks pass."""
    if device.type != "cuda":
        return 132
    return multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
