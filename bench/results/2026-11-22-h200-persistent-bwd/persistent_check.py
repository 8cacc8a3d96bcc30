"""Gradients of the persistent head-dim-64 backward (persistent-single-buffer.patch applied) against
float64, through flash_attn_func with the config forced (launch plans are off under override).

    PYTHONPATH=<repo> python persistent_check.py [sq,sk ...]      # default: the shapes below

Prints dq / dk / dv relative errors per shape, causal and not, fp16. Run it with
TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas (CUDA 13.0) and without (triton's bundled 12.8.93)."""
import itertools
import sys

import torch

from flashtile import flash_attn_func
from flashtile.configs import GluonBwdConfig, override

SHAPES = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or [
    (1, 239), (1, 1), (64, 239), (113, 203), (128, 217), (239, 1), (1023, 1023)]


def exact_grads(q, k, v, dout, causal, scale):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vd)
    out.backward(dout.double())
    return qd.grad, kd.grad, vd.grad


torch.manual_seed(0)
for (sq, sk), causal in itertools.product(SHAPES, (False, True)):
    q = torch.randn(2, sq, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(2, sk, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    with override(bwd_gluon=GluonBwdConfig(block_m=128, num_stages=2, persistent=True)):
        flash_attn_func(q, k, v, causal=causal).backward(dout)
    errors = [float((g.double() - e).norm() / e.norm().clamp_min(1e-30))
              for g, e in zip((q.grad, k.grad, v.grad), exact_grads(q, k, v, dout, causal, 64 ** -0.5))]
    print(f"seqlen_q {sq:5d} seqlen_k {sk:5d} causal {int(causal)}  dq {errors[0]:.2e}  dk {errors[1]:.2e}  "
          f"dv {errors[2]:.2e}", flush=True)
