"""Compile the Gluon Hopper backward for sm90 on any machine (no GPU needed) and report shared
memory, registers, spills and a hash of the SASS, for the dense and varlen variants.

    PYTHONPATH=<repo> python bench/gluon_bwd_compile_check.py [--candidates] [--json out.json]

The kernel arguments are captured from gluon_backward.make_launcher (run on CPU tensors, nothing
is launched), specialized for a CUDA sm90 target and compiled with triton.compile; registers and
spills come from ptxas -v on the PTX. Equal SASS hashes mean identical machine code (the dense
path must not change when the varlen code changes). ptxas is not deterministic on the d256 kernel
(its SASS differs from run to run), so the PTX hash (debug info stripped) is the one to compare.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_fwd_compile_check import Capture, compile_sm90  # noqa: E402

from flashtile.configs import BWD_GLUON, table_config  # noqa: E402
from flashtile.kernels import gluon_backward as gb  # noqa: E402
from flashtile.kernels.launch import row_stats_buffers  # noqa: E402

_KERNELS = ("gluon_attn_bwd_kernel", "gluon_attn_bwd_d256_kernel", "gluon_attn_bwd_persistent_kernel")


def captured_call(build):
    """(kernel, args, kwargs) of the Gluon kernel make_launcher's launch would start."""
    saved = {n: getattr(gb, n) for n in _KERNELS + ("gluon_bwd_dq_convert_kernel",)}
    caps = {n: Capture(saved[n]) for n in saved}
    for n, c in caps.items():
        setattr(gb, n, c)
    try:
        build()()
    finally:
        for n, k in saved.items():
            setattr(gb, n, k)
    name = next(n for n in _KERNELS if hasattr(caps[n], "args"))
    return saved[name], caps[name].args, caps[name].kwargs


def variants(d, cfg, causal, dtype):
    """(name, launcher builder) per variant, on CPU tensors (only shapes, strides, dtypes matter)."""
    h, hk = 2048 // d, 2048 // d // 2
    q = torch.empty(2, 1024, h, d, dtype=dtype)
    k = torch.empty(2, 1024, hk, d, dtype=dtype)
    lse_log2, delta = row_stats_buffers(torch.empty(2, h, 1024))
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    yield "dense", lambda: gb.make_launcher(q, k, k, q, lse_log2, delta, dq, dk, torch.empty_like(k), 0.1,
                                            causal, cfg)
    qv = torch.empty(1, 3000, h, d, dtype=dtype)
    kv = torch.empty(1, 3000, hk, d, dtype=dtype)
    lv, dv = row_stats_buffers(torch.empty(1, h, 3000))
    dqv, dkv = torch.empty_like(qv), torch.empty_like(kv)
    cu = torch.tensor([0, 1000, 3000], dtype=torch.int32)
    used = torch.tensor([1000, 1500], dtype=torch.int32)
    for name, used_q in (("varlen", None), ("varlen+seqused_q", used)):
        yield name, (lambda uq=used_q: gb.make_launcher(
            qv, kv, kv, qv, lv, dv, dqv, dkv, torch.empty_like(kv), 0.1, causal, cfg, cu_seqlens_q=cu,
            cu_seqlens_k=cu, seqused_q=uq, max_seqlen_k=2000))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--candidates", action="store_true", help="also every config in gluon_backward.CANDIDATES")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--dense-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    print(f"{'d':>4} {'config':12s} {'causal':>6} {'variant':17s} {'shared':>7} {'regs':>4} {'spill st/ld':>11} "
          f"{'sass':>6} sha1         ptx sha1")
    for d in (int(x) for x in args.head_dims.split(",")):
        configs = {"default": table_config(BWD_GLUON, "sm90", d, causal=False, seqlen_k=16384)}
        if args.candidates:
            configs.update({n: c for n, c in gb.CANDIDATES.get(d, {}).items() if c != configs["default"]})
        for cname, cfg in configs.items():
            for causal in (False, True):
                for vname, build in variants(d, cfg, causal, dtype):
                    if args.dense_only and vname != "dense":
                        continue
                    kernel, kargs, kwargs = captured_call(build)
                    r = compile_sm90(kargs, kwargs, kernel)
                    r.update(head_dim=d, config=cname, causal=causal, variant=vname)
                    rows.append(r)
                    print(f"{d:>4} {cname:12s} {int(causal):>6} {vname:17s} {r['shared']:>7} {r['regs']:>4} "
                          f"{r['spill_stores']:>5}/{r['spill_loads']:<5} {r['sass_lines']:>6} {r['sass_sha1']} "
                          f"{r['ptx_sha1']}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
