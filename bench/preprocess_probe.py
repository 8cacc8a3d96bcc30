"""Time the backward preprocess kernel (delta = rowsum(out * dout), lse in log2 units) at the sweep's
shapes (bf16, 16k tokens, hidden 2048) for several (block_m, num_warps), each checked against torch.

    PYTHONPATH=<repo> python bench/preprocess_probe.py

Prints, per head dim and seqlen, the three fastest configs (microseconds, block_m, num_warps, check) and
the 4-warp ones at block_m 64 / 128 (the backward takes its block_m from the forward's config today).
"""

import torch
from triton.testing import do_bench

from flashtile.kernels.launch import launch_preprocess, row_stats_buffers


def main():
    for d in (64, 128, 256):
        h = 2048 // d
        for s in (1024, 16384):
            b = 16384 // s
            out = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            dout = torch.randn_like(out)
            lse = torch.randn(b, h, s, device="cuda")
            delta, lse_log2 = row_stats_buffers(lse)
            ref = (out.float() * dout.float()).sum(-1).transpose(1, 2)
            timed = []
            for block_m in (16, 32, 64, 128):
                for warps in (2, 4, 8):
                    if block_m * d > 128 * 256 and warps < 4:
                        continue

                    def run():
                        launch_preprocess(out, dout, lse, delta, lse_log2, block_m=block_m, num_warps=warps)

                    delta.fill_(float("nan"))
                    run()
                    ok = torch.allclose(delta, ref, atol=1e-2, rtol=1e-3)
                    timed.append((do_bench(run, warmup=25, rep=100) * 1e3, block_m, warps, ok))
            timed.sort()
            top = [(round(us, 1), bm, w, ok) for us, bm, w, ok in timed[:3]]
            four_warps = [(round(us, 1), bm) for us, bm, w, _ in timed if bm in (64, 128) and w == 4]
            read_gbs = 2 * out.numel() * out.element_size() / timed[0][0] / 1e3
            print(f"d{d} s{s}: top {top} w4(bm64/128) {four_warps} best GB/s {read_gbs:.0f}", flush=True)


if __name__ == "__main__":
    main()
