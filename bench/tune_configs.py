"""Time candidate kernel configs per head dim on this GPU and print the fastest.

    python bench/tune_configs.py --headdims 64,128,256 --out bench/results/tune

For each head dim (16k tokens, hidden 2048, bf16, non-causal and causal), every candidate
of one kernel is timed with the other kernels at their defaults: forward alone for the
forward kernel, the backward alone (autograd.grad on a kept graph) for dK/dV and dQ.
Each candidate's results are compared with the default config's (which the test suite
covers) before it is timed; a mismatch disqualifies it. The winners go into
flashtile/configs.py's tuned table by hand, with the run recorded in bench/results/.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtile import flash_attn_func  # noqa: E402
from flashtile.configs import BWD_DKDV, BWD_DQ, FWD, PORTABLE_CANDIDATES, override  # noqa: E402
from flashtile.testing import rel_error  # noqa: E402

# The candidates live with the tables (flashtile/configs.py), shared with the autotuner.
CANDIDATES = PORTABLE_CANDIDATES


def run_once(q, k, v, dout, causal, kernel):
    out = flash_attn_func(q, k, v, causal=causal)
    if kernel == FWD:
        return (out,)
    return torch.autograd.grad(out, (q, k, v), dout)


def time_kernel(q, k, v, dout, causal, kernel):
    if kernel == FWD:
        with torch.no_grad():
            return triton.testing.do_bench(lambda: flash_attn_func(q, k, v, causal=causal), return_mode="median")
    out = flash_attn_func(q, k, v, causal=causal)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                   return_mode="median")


def time_cudnn(q, k, v, dout, causal) -> dict:
    """cuDNN attention (torch SDPA) on the same inputs: forward and backward ms."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        def fwd():
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        with torch.no_grad():
            fwd_ms = triton.testing.do_bench(fwd, return_mode="median")
        out = fwd()
        bwd_ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (qt, kt, vt), dt, retain_graph=True),
                                         return_mode="median")
    return {"fwd": fwd_ms, "bwd": bwd_ms}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--kernels", default=f"{FWD},{BWD_DKDV},{BWD_DQ}")
    parser.add_argument("--out", default="bench/results/tune")
    parser.add_argument("--anchor", action="store_true", help="also time torch SDPA's cuDNN backend")
    args = parser.parse_args()
    results = []
    for head_dim in map(int, args.headdims.split(",")):
        nheads, batch = 2048 // head_dim, 16384 // args.seqlen
        q, k, v = (torch.randn(batch, args.seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for causal in (False, True):
            flops = 4 * batch * nheads * args.seqlen**2 * head_dim / (2 if causal else 1)
            baseline = {kern: run_once(q, k, v, dout, causal, kern) for kern in (FWD, BWD_DQ)}
            if args.anchor:
                for mode, ms in time_cudnn(q, k, v, dout, causal).items():
                    row = dict(head_dim=head_dim, causal=causal, kernel=f"cudnn_{mode}", ms=ms,
                               tflops=flops * (1 if mode == "fwd" else 2.5) / ms * 1e-9)
                    results.append(row)
                    print(json.dumps(row), flush=True)
            for kernel in args.kernels.split(","):
                for cfg in CANDIDATES[kernel][head_dim]:
                    row = dict(head_dim=head_dim, causal=causal, kernel=kernel, config=cfg.__dict__)
                    try:
                        with override(**{kernel: cfg}):
                            got = run_once(q, k, v, dout, causal, kernel)
                            err = max(rel_error(a, b) for a, b in zip(got, baseline[FWD if kernel == FWD else BWD_DQ]))
                            row["max_rel_diff_vs_default"] = err
                            if err > 1e-2:
                                row["error"] = "mismatch"
                            else:
                                ms = time_kernel(q, k, v, dout, causal, kernel)
                                row["ms"] = ms
                                row["tflops"] = flops * (1 if kernel == FWD else 2.5) / ms * 1e-9
                    except Exception as exc:  # out of shared memory / registers
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    results.append(row)
                    print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "argv": sys.argv, "results": results}, f, indent=1)
    print("\nbest per (head_dim, causal, kernel):  [bwd TFLOP/s count the whole backward]")
    best = {}
    for row in results:
        key = (row["head_dim"], row["causal"], row["kernel"])
        if "config" in row and "tflops" in row and (key not in best or row["tflops"] > best[key]["tflops"]):
            best[key] = row
    for (head_dim, causal, kernel), row in sorted(best.items()):
        default = next(r for r in results if (r["head_dim"], r["causal"], r["kernel"]) == (head_dim, causal, kernel))
        print(f"d={head_dim:<4} causal={causal!s:<5} {kernel:<9} best {row['config']} {row['tflops']:6.1f}"
              f"  (default {default.get('tflops', float('nan')):6.1f})")
    for row in results:
        if "config" not in row:
            print(f"d={row['head_dim']:<4} causal={row['causal']!s:<5} {row['kernel']:<9} {row['tflops']:6.1f}")


if __name__ == "__main__":
    main()
