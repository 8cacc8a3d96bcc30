"""flashtile: exact FlashAttention in Triton, behind the flash_attn API."""

from . import mods
from .block_mask import BlockMask, create_block_mask
from .compat import install_as_flash_attn, register_sdpa, uninstall_as_flash_attn
from .explanation import Explanation, PathChoice, explain
from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .kvcache import flash_attn_with_kvcache
from .padding import index_first_axis, pad_input, unpad_input
from .varlen import flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func

from ._version import __version__

__all__ = [
    "BlockMask",
    "Explanation",
    "PathChoice",
    "create_block_mask",
    "explain",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "index_first_axis",
    "install_as_flash_attn",
    "mods",
    "pad_input",
    "register_sdpa",
    "uninstall_as_flash_attn",
    "unpad_input",
]
