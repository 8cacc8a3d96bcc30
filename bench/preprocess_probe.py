"""Time the backward preprocess kernel (delta = rowsum(out * dout), lse in log2 units) at the sweep's
shapes (bf16, 16k tokens, hidden 2048) for several (block_m, num_warps), each checked against torch.

    PYTHONPATH=<repo> python bench/preprocess_probe.py

Per head dim and seqlen, two flows in front of the Gluon backward: the preprocess followed by a memset
of the float32 dQ accumulator (``split``), and the preprocess zeroing the accumulator itself
(``fused``, launch_preprocess's zero=). Prints each flow's three fastest configs (microseconds,
block_m, num_warps, check) and the fused flow's time at every block_m with 4 warps.
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
            acc = torch.empty(out.shape, device="cuda", dtype=torch.float32)
            delta, lse_log2 = row_stats_buffers(lse)
            ref = (out.float() * dout.float()).sum(-1).transpose(1, 2)
            timed = {"split": [], "fused": []}
            for block_m in (16, 32, 64, 128):
                for warps in (2, 4, 8):
                    if block_m * d > 128 * 256 and warps < 4:
                        continue

                    def split(block_m=block_m, warps=warps):
                        launch_preprocess(out, dout, lse, delta, lse_log2, block_m=block_m, num_warps=warps)
                        acc.zero_()

                    def fused(block_m=block_m, warps=warps):
                        launch_preprocess(out, dout, lse, delta, lse_log2, block_m=block_m, num_warps=warps, zero=acc)

                    for name, run in (("split", split), ("fused", fused)):
                        delta.fill_(float("nan"))
                        acc.fill_(float("nan"))
                        run()
                        ok = torch.allclose(delta, ref, atol=1e-2, rtol=1e-3) and not acc.any().item()
                        timed[name].append((do_bench(run, warmup=25, rep=100) * 1e3, block_m, warps, ok))
            for name in timed:
                timed[name].sort()
            tops = {n: [(round(us, 1), bm, w, ok) for us, bm, w, ok in t[:3]] for n, t in timed.items()}
            fused_w4 = [(round(us, 1), bm) for us, bm, w, _ in sorted(timed["fused"], key=lambda r: r[1]) if w == 4]
            moved = 2 * out.numel() * out.element_size() + acc.numel() * 4
            print(f"d{d} s{s}: split top {tops['split']}  fused top {tops['fused']}  fused w4 {fused_w4}  "
                  f"fused best GB/s {moved / timed['fused'][0][0] / 1e3:.0f}", flush=True)


if __name__ == "__main__":
    main()
