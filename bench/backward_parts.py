"""GPU time of each launch of the Hopper backward as the library runs it (launch.attention_backward),
per kernel: the preprocess (delta, lse_log2; it also zeroes the dQ accumulator), the Gluon kernel and
the dQ convert. Shows what share of a short
backward is spent outside the main kernel (the three small launches move whole tensors at memory
speed, so their time does not shrink with the sequence length as the main kernel's does).

    PYTHONPATH=<repo>:<repo>/bench python bench/backward_parts.py [--points 128:1024:1,...] [--out DIR]

A point is head_dim:seqlen:causal at the sweep's shapes (16k tokens per batch, hidden 2048,
bf16). Times are means over 20 profiled calls (torch.profiler, CUDA activity); TFLOP/s counts
the whole backward (2.5x the forward's 4 b h sq sk d, halved when causal). Writes
backward_parts.json under --out.
"""

import argparse
import json
import math
import os

import torch
from torch.profiler import ProfilerActivity, profile

import gluon_bwd_probe
from gluon_bwd_probe import forward_and_preprocess, timing_inputs

DEFAULT_POINTS = "128:1024:1,128:1024:0,64:1024:1,256:1024:0,256:1024:1,128:4096:0"
CALLS = 20


def kernel_times(step, calls=CALLS):
    """{kernel name: mean GPU microseconds per call of step()}."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            name = event.name.split("(")[0][:48]
            times[name] = times.get(name, 0.0) + event.device_time / calls
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default=DEFAULT_POINTS, help="head_dim:seqlen:causal,...")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    gluon_bwd_probe._imports()
    from flashtile.kernels.launch import ScoreParams, attention_backward

    rows = []
    for point in args.points.split(","):
        d, s, causal = (int(x) for x in point.split(":"))
        causal = bool(causal)
        b, h, q, k, v, dout = timing_inputs(d, s, causal)
        scale = 1.0 / math.sqrt(d)
        out, lse, _, _, _ = forward_and_preprocess(q, k, v, dout, scale, causal)
        params = ScoreParams(softmax_scale=scale, window_right=0 if causal else -1)
        grads = [torch.empty_like(t) for t in (q, k, v)]

        def step():
            attention_backward(q, k, v, out, dout, lse, *grads, params)
        for _ in range(5):  # compile, warm up
            step()
        torch.cuda.synchronize()
        times = kernel_times(step)
        total = sum(times.values())
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        rows.append({"head_dim": d, "seqlen": s, "causal": causal, "us": times, "total_us": total,
                     "tflops": flops / total / 1e6})
        print(f"d{d} s{s} causal={int(causal)}: {total:.0f} us ({flops / total / 1e6:.0f} TFLOP/s); " + ", ".join(
            f"{name} {us:.0f} ({us / total:.0%})" for name, us in sorted(times.items(), key=lambda x: -x[1])),
            flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "backward_parts.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
