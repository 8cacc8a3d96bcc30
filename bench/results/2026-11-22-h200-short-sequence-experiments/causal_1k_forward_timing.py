"""Causal head-dim-64 forward at seqlen 1024: eager (do_bench, L2 flushed) against CUDA-graph timing
(do_bench_cudagraph) for the library, cuDNN, FA2, portable configs and Gluon variants.

    PYTHONPATH=<repo>:<repo>/bench python bench/results/2026-11-22-h200-short-sequence-experiments/causal_1k_forward_timing.py
"""
import math

import torch
from triton.testing import do_bench, do_bench_cudagraph

from flashtile import flash_attn_func
from flashtile.configs import KernelConfig as C, override

import gluon_ab

d, s = 64, 1024
h, b = 2048 // d, 16384 // s
torch.manual_seed(0)
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flops = 4 * b * h * s * s * d / 2


def tf(ms):
    return flops / ms / 1e9


ref = flash_attn_func(q, k, v, causal=True)


def both(name, fn):
    fn()
    torch.cuda.synchronize()
    e = sorted(do_bench(fn, warmup=50, rep=200) for _ in range(3))[1]
    g = sorted(do_bench_cudagraph(fn, rep=200) for _ in range(3))[1]
    print(f"{name:40s} eager {tf(e):6.1f}  graph {tf(g):6.1f}", flush=True)


with torch.no_grad():
    both("lib (table, plans)", lambda: flash_attn_func(q, k, v, causal=True))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        both("cudnn", lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        both("fa2", lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    for cfg in [C(64, 64, 4, 3, True), C(64, 64, 4, 2, True), C(64, 64, 4, 4, True), C(64, 128, 4, 3, True),
                C(64, 128, 4, 2, True), C(64, 64, 4, 3, True, True), C(64, 32, 4, 4, True), C(128, 64, 4, 3, True),
                C(128, 64, 8, 3, True), C(128, 128, 8, 3, True, True), C(64, 64, 4, 3), C(32, 64, 4, 3, True)]:
        with override(fwd=cfg):
            out = flash_attn_func(q, k, v, causal=True)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            name = (f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} tma{int(cfg.use_tma)} "
                    f"ws{int(cfg.warp_specialize)} err{err:.0e}")
            both(name, lambda: flash_attn_func(q, k, v, causal=True))
    for spec in ["new:c4n64_rs_own+f2", "new:c4n64_rs_own", "new:c2n64s8_persist_rs_own"]:
        module, cfg = gluon_ab.resolve(spec, d, True, s)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda")
        launch = module.make_launcher(q, k, v, out, lse, 1 / math.sqrt(d), True, cfg)
        both(spec, launch)
