"""An exported C library called from Python through ctypes, on torch tensors: what the tests and
``python -m flashtile.export.compare`` use to check the C library against the Python API on the
same inputs (and what a user can use to check an export of their own)."""

import ctypes
import os
from typing import Optional

import torch

STATUS = {0: "success", 1: "invalid argument", 2: "not exported", 3: "unsupported", 4: "workspace", 5: "cuda"}
DTYPES = {torch.float16: 0, torch.bfloat16: 1}


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("batch_stride", ctypes.c_int64), ("row_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64)]


class Args(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_int), ("dtype", ctypes.c_int), ("batch", ctypes.c_int),
                ("seqlen_q", ctypes.c_int), ("seqlen_k", ctypes.c_int), ("nheads", ctypes.c_int),
                ("nheads_k", ctypes.c_int), ("head_dim", ctypes.c_int), ("q", Tensor), ("k", Tensor),
                ("v", Tensor), ("out", Tensor), ("softmax_lse", ctypes.c_void_p), ("softmax_scale", ctypes.c_float),
                ("causal", ctypes.c_int), ("window_left", ctypes.c_int), ("window_right", ctypes.c_int),
                ("softcap", ctypes.c_float), ("alibi_slopes", ctypes.c_void_p), ("alibi_batch_stride", ctypes.c_int64),
                ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p), ("max_seqlen_q", ctypes.c_int),
                ("max_seqlen_k", ctypes.c_int)]


class KVCacheArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_int), ("dtype", ctypes.c_int), ("batch", ctypes.c_int),
                ("seqlen_q", ctypes.c_int), ("nheads", ctypes.c_int), ("nheads_k", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("q", Tensor), ("out", Tensor), ("k_cache", Tensor), ("v_cache", Tensor),
                ("num_pages", ctypes.c_int), ("page_size", ctypes.c_int), ("block_table", ctypes.c_void_p),
                ("max_pages_per_seq", ctypes.c_int), ("block_table_stride", ctypes.c_int64),
                ("cache_seqlens", ctypes.c_void_p), ("k_new", Tensor), ("v_new", Tensor), ("seqlen_new", ctypes.c_int),
                ("softmax_lse", ctypes.c_void_p), ("softmax_scale", ctypes.c_float), ("causal", ctypes.c_int),
                ("window_left", ctypes.c_int), ("window_right", ctypes.c_int), ("softcap", ctypes.c_float),
                ("alibi_slopes", ctypes.c_void_p), ("alibi_batch_stride", ctypes.c_int64), ("num_splits", ctypes.c_int)]


class Grads(ctypes.Structure):
    _fields_ = [("dout", Tensor), ("dq", Tensor), ("dk", Tensor), ("dv", Tensor)]


class CError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{STATUS.get(status, status)}: {message}")
        self.status = status


class Library:
    """libflashtile.so of an export directory (or a path to the .so)."""

    def __init__(self, path: str):
        if os.path.isdir(path):
            path = os.path.join(path, "lib", "libflashtile.so")
        self.lib = lib = ctypes.CDLL(path)
        lib.flashtile_last_error.restype = ctypes.c_char_p
        lib.flashtile_build_info.restype = ctypes.c_char_p
        lib.flashtile_status_string.restype = ctypes.c_char_p
        for name in ("flashtile_attention_forward", "flashtile_attention_backward",
                     "flashtile_attention_forward_workspace_size", "flashtile_attention_backward_workspace_size",
                     "flashtile_kvcache_forward", "flashtile_kvcache_forward_workspace_size"):
            getattr(lib, name).restype = ctypes.c_int

    def last_error(self) -> str:
        return self.lib.flashtile_last_error().decode()

    def build_info(self) -> str:
        return self.lib.flashtile_build_info().decode()

    def _check(self, status: int) -> None:
        if status != 0:
            raise CError(status, self.last_error())

    def args(self, q, k, v, out, lse=None, causal=False, softmax_scale=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=0, max_seqlen_k=0) -> Args:
        """The C call's arguments for flash_attn-shaped tensors: (b, s, h, d) dense, or (total, h, d)
        packed with cu_seqlens."""
        a = Args()
        self.lib.flashtile_attention_args_init(ctypes.byref(a))
        a.dtype = DTYPES.get(q.dtype, 7)
        if cu_seqlens_q is None:
            a.batch, a.seqlen_q, a.nheads, a.head_dim = q.shape
        else:
            a.batch = cu_seqlens_q.numel() - 1
            a.seqlen_q, a.nheads, a.head_dim = q.shape
            a.cu_seqlens_q, a.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
            a.max_seqlen_q, a.max_seqlen_k = max_seqlen_q, max_seqlen_k
        a.seqlen_k, a.nheads_k = k.shape[-3], k.shape[-2]
        a.q, a.k, a.v, a.out = (tensor(t) for t in (q, k, v, out))
        a.softmax_lse = lse.data_ptr() if lse is not None else None
        a.softmax_scale, a.causal = softmax_scale, int(causal)
        return a

    def forward(self, a: Args, stream: Optional[int] = None) -> None:
        size = ctypes.c_size_t()
        self._check(self.lib.flashtile_attention_forward_workspace_size(ctypes.byref(a), ctypes.byref(size)))
        ws = torch.empty(size.value, dtype=torch.uint8, device="cuda") if size.value else None
        self._check(self.lib.flashtile_attention_forward(
            ctypes.byref(a), ctypes.c_void_p(ws.data_ptr() if ws is not None else None), ctypes.c_size_t(size.value),
            ctypes.c_void_p(_stream(stream))))

    def backward(self, a: Args, dout, dq, dk, dv, stream: Optional[int] = None) -> None:
        g = Grads(tensor(dout), tensor(dq), tensor(dk), tensor(dv))
        size = ctypes.c_size_t()
        self._check(self.lib.flashtile_attention_backward_workspace_size(ctypes.byref(a), ctypes.byref(size)))
        ws = torch.empty(size.value, dtype=torch.uint8, device="cuda") if size.value else None
        self._check(self.lib.flashtile_attention_backward(
            ctypes.byref(a), ctypes.byref(g), ctypes.c_void_p(ws.data_ptr() if ws is not None else None),
            ctypes.c_size_t(size.value), ctypes.c_void_p(_stream(stream))))

    def kvcache_args(self, q, k_cache, v_cache, out, cache_seqlens, block_table, k=None, v=None, lse=None,
                     causal=False, softmax_scale=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     num_splits=0) -> KVCacheArgs:
        """The C kv-cache call's arguments for flash_attn_with_kvcache-shaped tensors (a paged cache)."""
        a = KVCacheArgs()
        self.lib.flashtile_kvcache_args_init(ctypes.byref(a))
        a.dtype = DTYPES.get(q.dtype, 7)
        a.batch, a.seqlen_q, a.nheads, a.head_dim = q.shape
        a.nheads_k = k_cache.shape[2]
        a.q, a.out, a.k_cache, a.v_cache = (tensor(t) for t in (q, out, k_cache, v_cache))
        a.num_pages, a.page_size = k_cache.shape[0], k_cache.shape[1]
        a.block_table, a.max_pages_per_seq = block_table.data_ptr(), block_table.shape[1]
        a.block_table_stride = block_table.stride(0)
        a.cache_seqlens = cache_seqlens.data_ptr()
        if k is not None:
            a.k_new, a.v_new, a.seqlen_new = tensor(k), tensor(v), k.shape[1]
        a.softmax_lse = lse.data_ptr() if lse is not None else None
        a.softmax_scale, a.causal, a.softcap, a.num_splits = softmax_scale, int(causal), softcap, num_splits
        a.window_left, a.window_right = window_size
        if alibi_slopes is not None:
            a.alibi_slopes = alibi_slopes.data_ptr()
            a.alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
        return a

    def kvcache_forward(self, a: KVCacheArgs, stream: Optional[int] = None) -> None:
        size = ctypes.c_size_t()
        self._check(self.lib.flashtile_kvcache_forward_workspace_size(ctypes.byref(a), ctypes.byref(size)))
        ws = torch.empty(size.value, dtype=torch.uint8, device="cuda") if size.value else None
        self._check(self.lib.flashtile_kvcache_forward(
            ctypes.byref(a), ctypes.c_void_p(ws.data_ptr() if ws is not None else None), ctypes.c_size_t(size.value),
            ctypes.c_void_p(_stream(stream))))

    def call(self, name: str, a: Args, *rest) -> int:
        """A raw call (the error tests): the status, without raising."""
        return getattr(self.lib, name)(ctypes.byref(a), *rest)


def tensor(t: torch.Tensor) -> Tensor:
    """A (b, s, h, d) or packed (total, h, d) tensor as the C struct (strides in elements)."""
    if t.dim() == 3:
        return Tensor(t.data_ptr(), 0, t.stride(0), t.stride(1))
    return Tensor(t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))


def _stream(stream: Optional[int]) -> Optional[int]:
    if stream is None:
        return torch.cuda.current_stream().cuda_stream or None
    return stream
