"""The portable kernels: Triton, any GPU Triton supports (and the CPU through its interpreter).

Device code, one concern per file: scores.py (scale, softcap, ALiBi, masks, the band of key blocks
a query block sees), seqlens.py (where a sequence lives, dense or packed), dropout.py, tile_io.py
(masked tile loads and stores); the kernels: forward.py, backward.py (preprocess, dK/dV, dQ),
probs.py, combine.py (split-KV merge), kvcache_update.py. Host side: launch.py.
"""
