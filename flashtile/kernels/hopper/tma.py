"""Host-side facts about the sm90 copy engine (TMA) that the kernels share: which tensors
tensor descriptors can address, and which the Hopper Gluon kernels take."""

import functools
from typing import Optional

import torch

from ...configs import padded_head_dim
from ...runtime import capability_of, multiprocessor_count
from ...triton_compat import gluon_tensor_descriptor, tensor_descriptor

FLOAT16_TYPES = (torch.bfloat16, torch.float16)


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can cover ``t``: no empty dim, a 16-byte aligned base,
    16-byte strides and a unit last stride."""
    size = t.element_size()
    return (t.numel() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((stride * size) % 16 == 0 for stride in t.stride()[:-1]))


# Head dims the Gluon kernels are built for (96 and 192 through zero-padded TMA boxes).
HEAD_DIMS = (64, 96, 128, 192, 256)


def values_supported(head_dim: int, head_dim_v: int) -> bool:
    """Whether the Hopper backward takes values of head dim ``head_dim_v`` with queries and keys of
    ``head_dim``: the same; with head dims up to 128 (the two-warpgroup kernel) a value tile no wider
    than the query's (a wider one overflows shared memory at head dim 64's block of 128 queries); above
    128 (the head-dim-256 kernel) one of 128 or 256 columns (each warpgroup owns half of it)."""
    if head_dim_v == head_dim:
        return True
    if padded_head_dim(head_dim) == 256:
        return padded_head_dim(head_dim_v) >= 128
    return padded_head_dim(head_dim_v) <= padded_head_dim(head_dim)


def tma_misalignment(name: str, t: torch.Tensor) -> Optional[str]:
    """Why a tensor descriptor cannot cover ``t`` (see tma_aligned), or None when it can."""
    size = t.element_size()
    if t.numel() == 0:
        return f"{name} is empty"
    if t.stride(-1) != 1:
        return f"{name} has last stride {t.stride(-1)}, not 1"
    if t.data_ptr() % 16:
        return f"{name}'s base address is not 16-byte aligned"
    bad = [s for s in t.stride()[:-1] if (s * size) % 16]
    if bad:
        return f"{name} has strides {tuple(t.stride())}: {bad[0] * size} bytes is not a multiple of 16"
    return None


def qkv_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool = False) -> Optional[str]:
    """Why the Gluon kernels cannot take these (b, s, h, d) tensors, the device aside, or None when
    they can: fp16 / bf16 of one dtype, head dims in HEAD_DIMS (v's may differ from q's and k's:
    the forward takes that, the dispatcher keeps the backward off), a GQA layout, TMA-aligned.
    paged: k and v are pages read through a table, (num_pages, page_size, hk, d)."""
    if q.dtype not in FLOAT16_TYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {str(q.dtype).replace('torch.', '')}: the Hopper kernels take float16 and bfloat16"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v are not (batch, seqlen, heads, head_dim) tensors"
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS or k.shape[-1] != head_dim or v.shape[-1] not in HEAD_DIMS:
        dims = str(head_dim) if v.shape[-1] == head_dim else f"{head_dim} (v: {v.shape[-1]})"
        return f"head dim {dims}: the Hopper kernels take head dims {', '.join(map(str, HEAD_DIMS))}"
    if (k.shape[:-1] != v.shape[:-1] or (k.shape[0] != q.shape[0] and not paged) or k.shape[2] == 0
            or q.shape[2] % k.shape[2] != 0):
        return (f"q {tuple(q.shape)} and k, v {tuple(k.shape)}, {tuple(v.shape)} are not a GQA layout the Hopper "
                "kernels take")
    for name, t in (("q", q), ("k", k), ("v", v)):
        why = tma_misalignment(name, t)
        if why is not None:
            return f"{why}: the Hopper kernels need TMA-aligned tensors (16-byte base and strides, unit last stride)"
    return None


def qkv_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """CUDA tensors on an sm90 device that the Gluon kernels take (see qkv_unsupported)."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False
    if capability_of(q.device) != (9, 0):
        return False
    return qkv_unsupported(q, k, v) is None


@functools.lru_cache(maxsize=None)
def _swizzled_layout(block: tuple, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


@functools.lru_cache(maxsize=None)
def _flat_layout(element_bits: int):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element_bits, rank=1)


class DescriptorTemplate:
    """Host TMA descriptors over TMA-aligned (b, s, h, d) views (see tma_aligned) of one shape,
    strides and dtype, for Gluon kernels: (1, rows, 1, cols or d) boxes, swizzled the way wgmma
    reads them. Calling it with a tensor of that shape, strides and dtype gives its descriptor:
    only the base changes (launch plans build descriptors on every call).
    group > 1 (a power of two dividing rows): the tensor as (b, s, h / group, group, d) and
    (1, rows / group, 1, group, cols) boxes, a kv head's group of query heads at rows / group
    positions. Their rows lie in shared memory as a (rows, cols) box's do (row p * group + i is
    position p, head i), since the swizzle follows the address."""

    def __init__(self, t: torch.Tensor, rows: int, cols: int = 0, group: int = 1):
        cols = cols or t.shape[-1]
        self.shape, self.strides = list(t.shape), list(t.stride())
        if group > 1:
            batch, seqlen, heads, dim = t.shape
            self.shape = [batch, seqlen, heads // group, group, dim]
            self.strides = [t.stride(0), t.stride(1), t.stride(2) * group, t.stride(2), t.stride(3)]
            block = (1, rows // group, 1, group, cols)
        else:
            block = (1, rows, 1, cols)
        self.block = list(block)
        self.layout = _swizzled_layout(block, t.dtype)

    def __call__(self, t: torch.Tensor):
        return gluon_tensor_descriptor(t, self.shape, self.strides, self.block, self.layout)


class BiasDescriptorTemplate:
    """Host TMA descriptors over an attn_bias (unit key stride) as a (batch, heads, queries, keys) view:
    its own dims, 1 along those it broadcasts (``strides``: its batch, head and query strides, 0 there);
    (1, 1, rows, cols) boxes, swizzled. ``supported`` says whether TMA can address it: a bias with a
    query dim of its own, whose base and strides are multiples of 16 bytes. Calling it with a bias of
    that shape, strides and dtype gives its descriptor."""

    def __init__(self, bias: torch.Tensor, strides: tuple, rows: int, cols: int):
        batches, heads, queries, keys = (1,) * (4 - bias.dim()) + tuple(bias.shape)
        stride_b, stride_h, stride_q = strides
        # A dim of one is never stepped along: any stride of 16-byte multiples serves.
        stride_h = stride_h if heads > 1 else queries * stride_q
        stride_b = stride_b if batches > 1 else heads * stride_h
        self.shape, self.strides = [batches, heads, queries, keys], [stride_b, stride_h, stride_q, 1]
        self.block = [1, 1, rows, cols]
        size = bias.element_size()
        self.supported = (queries > 1 and bias.stride(-1) == 1 and bias.data_ptr() % 16 == 0
                          and all(st * size % 16 == 0 for st in self.strides[:3]))
        self.layout = _swizzled_layout(tuple(self.block), bias.dtype) if self.supported else None

    def __call__(self, bias: torch.Tensor):
        return gluon_tensor_descriptor(bias, self.shape, self.strides, self.block, self.layout)


def attn_bias_arguments(strides: tuple, template) -> dict:
    """Both Hopper kernels' attn_bias arguments besides its slots: with a BiasDescriptorTemplate (tiles through
    the ring) the bias's batch and head dims; else its batch, head and query strides (0 along broadcast
    dimensions) and BIAS_ROW, whether it is one row (a query stride of 0: one row for every query)."""
    if template is not None:
        return dict(bias_batches=template.shape[0], bias_heads=template.shape[1])
    return dict(zip(("stride_bias_b", "stride_bias_h", "stride_bias_m"), strides), BIAS_ROW=strides[2] == 0)


class TileDescriptorTemplate:
    """Host tensor descriptors of triton.tools (what the portable Triton kernels take) over
    TMA-aligned (b, s, h, d) views of one shape and strides: (1, rows, 1, cols) tiles of one
    (batch, head). Calling it with such a tensor gives its descriptor."""

    def __init__(self, t: torch.Tensor, rows: int, cols: int):
        self.shape, self.strides, self.block = list(t.shape), list(t.stride()), [1, rows, 1, cols]

    def __call__(self, t: torch.Tensor):
        return tensor_descriptor(t, self.shape, self.strides, self.block)


class RowDescriptorTemplate:
    """1-D host TMA descriptors over the whole buffer under (b, h, s) float32 views with unit row
    stride, of one shape and strides: unswizzled boxes of ``rows`` values, addressed by flat offset.
    Calling it with such a view gives its descriptor (the view itself is the base: its address is
    the flat buffer's)."""

    def __init__(self, t: torch.Tensor, rows: int):
        self.shape, self.strides, self.block = [t.shape[0] * t.stride(0)], [1], [rows]
        self.layout = _flat_layout(t.element_size() * 8)

    def __call__(self, t: torch.Tensor):
        return gluon_tensor_descriptor(t, self.shape, self.strides, self.block, self.layout)


def multiprocessors(device: torch.device) -> int:
    """SMs of the device (one Hopper CTA fills one); 132 (an H100 SXM / H200) for CPU tensors, which
    the compile checks pass."""
    if device.type != "cuda":
        return 132
    return multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
