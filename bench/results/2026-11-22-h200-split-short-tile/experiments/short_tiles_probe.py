"""Probe: cost of short tiles alone and of full tiles alone, with and without split_short_tile.patch applied."""
import dataclasses, math
import torch
from triton.testing import do_bench
from flashtile.configs import GluonFwdConfig
from flashtile.kernels import gluon_forward as gf
from gluon_fwd_probe import warm_up_gpu
C3P = GluonFwdConfig(128, 2, num_consumers=3, consumer_regs=160, loader_regs=24, persistent=True, row_sum_mma=True)
CFGS = {"c3p": C3P, "c3p_split": dataclasses.replace(C3P, split_short_tile=True),
        "c3p_s4_split": dataclasses.replace(C3P, split_short_tile=True, num_stages=4),
        "c3_split": dataclasses.replace(C3P, split_short_tile=True, persistent=False)}
warm_up_gpu(1.0)
d, h = 64, 32
for b, sq, sk in ((16, 64, 1024), (16, 192, 1024), (48, 64, 1024), (16, 960, 1024), (16, 1024, 1024), (8, 2048, 2048)):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    res = {}
    for n, cfg in CFGS.items():
        out = torch.empty_like(q); lse = torch.empty(b, h, sq, device="cuda")
        fn = gf.make_launcher(q, k, v, out, lse, 0.125, False, cfg)
        fn()
        res[n] = sorted(do_bench(fn) for _ in range(5))[2] * 1000
    print(f"b{b} sq{sq} sk{sk}: " + "  ".join(f"{n} {t:.1f}us" for n, t in res.items()), flush=True)
