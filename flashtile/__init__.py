"""flashtile: exact FlashAttention in Triton, behind the flash_attn API."""

from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .kvcache import flash_attn_with_kvcache
from .padding import index_first_axis, pad_input, unpad_input
from .varlen import flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "index_first_axis",
    "pad_input",
    "unpad_input",
]
