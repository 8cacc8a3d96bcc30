"""Every kernel config must compute the same function: asymmetric tiles, several warps
and pipeline depths, run through the override hook against the reference (the GPU also
runs the tuned table's configs)."""

import pytest
import torch

from flashtile import flash_attn_func
from flashtile.configs import _TUNED, BWD_DKDV, BWD_DQ, FWD, KernelConfig, override

from _cases import DTYPES, ON_GPU, check_against_reference, make_qkv

C = KernelConfig
ASYMMETRIC = [C(16, 32, 4, 1), C(32, 16, 4, 2), C(16, 64, 4, 3), C(64, 16, 2, 2)]
if ON_GPU:
    ASYMMETRIC += [C(32, 64, 4, 3), C(32, 128, 8, 3), C(16, 64, 4, 3), C(128, 32, 8, 3), C(64, 32, 4, 3),
                   C(128, 128, 8, 2)]
    for tables in _TUNED.values():
        for kernel_table in tables.values():
            ASYMMETRIC += [cfg for _, cfg in kernel_table if cfg not in ASYMMETRIC]


@pytest.mark.parametrize("kernel", [FWD, BWD_DKDV, BWD_DQ])
@pytest.mark.parametrize("config", ASYMMETRIC, ids=lambda c: f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}")
@pytest.mark.parametrize("causal", [False, True])
def test_config_computes_the_same_function(kernel, config, causal):
    head_dim = 128 if ON_GPU else 32
    seqlen_q, seqlen_k = (700, 1000) if ON_GPU else (70, 100)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, DTYPES[0])
    with override(**{kernel: config}):
        try:
            check_against_reference(flash_attn_func, q, k, v, causal=causal, window_size=(300 if ON_GPU else 30, -1),
                                    dropout_p=0.1)
        except Exception as exc:
            if "OutOfResources" in type(exc).__name__:
                pytest.skip(f"{config} does not fit this GPU: {exc}")
            raise
