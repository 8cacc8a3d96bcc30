"""Host time per call with launch plans on and off (flashtile/kernels/plans.py), layer by layer,
next to SDPA's cuDNN backend and a trivial autograd.Function, at a tiny shape.

    PYTHONPATH=<repo> python bench/plans_host_time.py [--out DIR]

At (1, 128, 2, 128) bf16 causal the GPU finishes each kernel in a few microseconds, so back-to-back
calls without synchronisation measure host time. Host times drift with the machine's load, so the
variants run interleaved, 7 rounds of 200 calls each; min and median over the rounds are printed,
the samples go to DIR/host_time.json. FLASHTILE_LAUNCH_PLANS is read on every call, so one process
measures both settings.
"""

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_func, ops
from flashtile.kernels import launch
from host_overhead import per_call_us


class _Identity(torch.autograd.Function):
    """The autograd engine's own cost for a one-node backward on a CUDA tensor."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    d = 128
    q, k, v = (torch.randn(1, 128, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    q0, k0, v0 = q.detach(), k.detach(), v.detach()
    options = ([d ** -0.5, 0.0, 0.0], [-1, 0, 0])
    out0, lse0 = ops._fwd_body(q0, k0, v0, None, None, *options)
    dq, dk, dv = (torch.empty_like(t) for t in (q0, k0, v0))
    params = launch.ScoreParams(softmax_scale=d ** -0.5, window_right=0)
    out = flash_attn_func(q, k, v, causal=True)
    flashtile = {
        "flash_attn_func fwd": lambda: flash_attn_func(q0, k0, v0, causal=True),
        "  ops body": lambda: ops._fwd_body(q0, k0, v0, None, None, *options),
        "  launch.attention_forward": lambda: launch.attention_forward(q0, k0, v0, out0, lse0, params),
        "autograd.grad (bwd alone)": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "  ops body ": lambda: ops._bwd_body(dout, q0, k0, v0, out0, lse0, None, None, *options),
        "  launch.attention_backward": lambda: launch.attention_backward(q0, k0, v0, out0, dout, lse0, dq, dk, dv,
                                                                         params),
        "  launch.attention_backward deterministic": lambda: launch.attention_backward(
            q0, k0, v0, out0, dout, lse0, dq, dk, dv, params, deterministic=True),
        "fwd + autograd.grad": lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout),
    }
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_cudnn = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt.detach(), kt.detach(), vt.detach(), is_causal=True)
    x = torch.randn(4, device="cuda", requires_grad=True)
    y = _Identity.apply(x)
    others = {
        "sdpa cudnn fwd (inside sdpa_kernel)": cudnn_fwd,
        "sdpa cudnn autograd.grad (bwd alone)": lambda: torch.autograd.grad(out_cudnn, (q, k, v), dout.transpose(1, 2),
                                                                          retain_graph=True),
        "trivial Function autograd.grad": lambda: torch.autograd.grad(y, (x,), torch.ones_like(x), retain_graph=True),
    }
    samples = {f"{name} [plans {state}]": [] for name in flashtile for state in ("on", "off")}
    samples.update({name: [] for name in others})
    for _ in range(7):
        for state in ("on", "off"):
            os.environ["FLASHTILE_LAUNCH_PLANS"] = "1" if state == "on" else "0"
            for name, fn in flashtile.items():
                samples[f"{name} [plans {state}]"].append(per_call_us(fn, 200))
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        for name, fn in others.items():
            samples[name].append(per_call_us(fn, 200))
    print(f"{'host us per call, (1, 128, 2, 128) bf16 causal':<52}{'min':>8}{'median':>8}")
    for name, values in samples.items():
        print(f"{name:<52}{min(values):8.1f}{statistics.median(values):8.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_time.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, samples_us=samples), f, indent=1)


if __name__ == "__main__":
    main()
