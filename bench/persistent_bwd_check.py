"""Gradients of a persistent Gluon backward config against float64 at many shapes, by the test
suite's rule (flashtile.testing: at most 2x PyTorch's same-dtype error plus a small epsilon).

    PYTHONPATH=<repo> python bench/persistent_bwd_check.py --head-dim 256 --config m64_s2_ps

--config: a name in gluon_backward.CANDIDATES[head dim]. Shapes: every (seqlen_q, seqlen_k) below,
causal and not, fp16 and bf16, MHA (4 heads) and GQA (8 query heads on 2 KV heads); bf16 GQA also
with the grid forced to 1 and 3 CTAs (many key blocks per CTA). Prints a progress line every 10
cases, each failure, and a count. A crash (illegal address) ends the process: rerun the failing
shape alone (--shapes SQxSK,...) to see the others.
"""
import argparse
import itertools
import time

import torch

from flashtile import flash_attn_func
from flashtile.configs import override
from flashtile.kernels import gluon_backward
from flashtile.testing import allowed_error, reference_errors

SHAPES = "1x1,1x239,1x64,1x128,1x129,64x239,113x203,128x217,239x1,239x64,239x65,1023x1023,128x128,256x1,1x256," \
         "300x700,700x300,2x1000,1000x2"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--config", default="m128_s2_ps")
    ap.add_argument("--shapes", default=SHAPES)
    args = ap.parse_args()
    config = gluon_backward.CANDIDATES[args.head_dim][args.config]
    assert config.persistent, config
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    sm_count = gluon_backward.multiprocessors
    failed = checked = 0
    start = time.time()
    d = args.head_dim
    for (sq, sk), causal, dtype, ctas, (h, hk) in itertools.product(
            shapes, (False, True), (torch.float16, torch.bfloat16), (None, 1, 3), ((4, 4), (8, 2))):
        if ctas is not None and (dtype == torch.float16 or h == hk):
            continue
        # Launch plans are off under override(), so the grid is built with this SM count.
        gluon_backward.multiprocessors = (lambda device, n=ctas: n) if ctas else sm_count
        q = torch.randn(2, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        with override(bwd_gluon=config):
            out = flash_attn_func(q, k, v, causal=causal)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        errors, _ = reference_errors(q, k, v, out, dout, grads, causal=causal)
        checked += 1
        bad = [(name, err, base) for name, err, base in errors if not err <= allowed_error(base, dtype)]
        if bad:
            failed += 1
            print(f"FAIL {sq}x{sk} causal {int(causal)} {dtype} ctas {ctas} heads {h}/{hk}: "
                  + " ".join(f"{name} {err:.2e} (torch {base:.2e})" for name, err, base in bad), flush=True)
        if checked % 10 == 0:
            worst = max(err / allowed_error(base, dtype) for _, err, base in errors)
            print(f"{checked} cases, {time.time() - start:.0f}s, last {sq}x{sk}: worst error / bound {worst:.2f}",
                  flush=True)
    gluon_backward.multiprocessors = sm_count
    print(f"d{d} {args.config}: checked {checked} cases, {failed} failed")


if __name__ == "__main__":
    main()
