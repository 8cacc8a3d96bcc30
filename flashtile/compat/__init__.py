"""Compatibility layers for code written against other attention libraries.

:func:`install_as_flash_attn` registers flashtile under flash_attn's module names (flash_attn.py);
nothing is registered until it is called.
"""

from .flash_attn import FlashAttnAlias, install_as_flash_attn, uninstall_as_flash_attn
from .sdpa import register_sdpa

__all__ = ["FlashAttnAlias", "install_as_flash_attn", "register_sdpa", "uninstall_as_flash_attn"]
