"""Gradients of the persistent head-dim-64 backward against float64 at many shapes, by the test
suite's rule (flashtile.testing: at most 2x PyTorch's same-dtype error plus a small epsilon).

    PYTHONPATH=<repo> python persistent_shapes_check.py

Shapes: every (seqlen_q, seqlen_k) below, causal and not, fp16 and bf16, MHA (4 heads) and GQA
(8 query heads on 2 KV heads); bf16 GQA also with the grid forced to 1 and 3 CTAs (many key blocks
per CTA). Prints a progress line every 10 cases, each failure, and a count. A crash (illegal
address) ends the process: rerun the failing shape alone to see the others.

The previous check (../2026-11-22-h200-persistent-bwd/persistent_check.py) divided by the norm of an
exact gradient that is zero at seqlen_k = 1, and its reference gave NaN rows where a causal query
sees no key (seqlen_q > seqlen_k); flashtile.testing handles both."""
import itertools
import time

import torch

from flashtile import flash_attn_func
from flashtile.configs import GluonBwdConfig, override
from flashtile.kernels import gluon_backward
from flashtile.testing import allowed_error, reference_errors

SHAPES = [(1, 1), (1, 239), (1, 64), (1, 128), (1, 129), (64, 239), (113, 203), (128, 217), (239, 1), (239, 64),
          (239, 65), (1023, 1023), (128, 128), (256, 1), (1, 256), (300, 700), (700, 300), (2, 1000), (1000, 2)]
CONFIG = GluonBwdConfig(block_m=128, num_stages=2, persistent=True)

torch.manual_seed(0)
sm_count = gluon_backward.multiprocessors
failed = checked = 0
start = time.time()
for (sq, sk), causal, dtype, ctas, (h, hk) in itertools.product(
        SHAPES, (False, True), (torch.float16, torch.bfloat16), (None, 1, 3), ((4, 4), (8, 2))):
    if ctas is not None and (dtype == torch.float16 or h == hk):
        continue
    # Launch plans are off under override(), so the grid is built with this SM count.
    gluon_backward.multiprocessors = (lambda device, n=ctas: n) if ctas else sm_count
    q = torch.randn(2, sq, h, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, sk, hk, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    with override(bwd_gluon=CONFIG):
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
print(f"checked {checked} cases, {failed} failed")
