"""Attention modules built on flashtile's public functions (flash_attn.modules.mha's interface)."""

from .mha import MHA, FlashCrossAttention, FlashSelfAttention, InferenceParams, get_alibi_slopes
from .rotary import RotaryEmbedding, apply_rotary_emb, packed_token_index, rotary_positions

__all__ = [
    "MHA",
    "FlashCrossAttention",
    "FlashSelfAttention",
    "InferenceParams",
    "RotaryEmbedding",
    "apply_rotary_emb",
    "get_alibi_slopes",
    "packed_token_index",
    "rotary_positions",
]
