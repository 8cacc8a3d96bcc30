"""Compile the portable Triton forward for sm90 on any machine (no GPU needed): dense, varlen,
paged-K/V and kv-cache (paged with left padding) variants of every tuned head dim, the split-KV
combine and the kv-cache update kernel, with their shared memory and PTX size.

    PYTHONPATH=<repo> python bench/portable_compile_check.py [--head-dims 64,128,256]

Catches kernels that the CPU interpreter runs but the GPU compiler rejects, before a GPU is at hand.
"""

import argparse

import torch
import triton
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from gluon_fwd_compile_check import TARGET, Capture

from flashtile.configs import FWD, table_config
from flashtile.kernels import launch


def compile_portable_forward(build, name="attn_fwd_kernel") -> dict:
    """Compile the kernel launch.<name> as ``build()`` would launch it (CPU tensors, nothing runs;
    the other kernels build() launches are captured and dropped)."""
    names = ("attn_fwd_kernel", "attn_combine_kernel", "kvcache_update_kernel")
    kernels = {n: getattr(launch, n) for n in names}
    captures = {n: Capture(kernels[n]) for n in names}
    for n in names:
        setattr(launch, n, captures[n])
    try:
        build()
    finally:
        for n in names:
            setattr(launch, n, kernels[n])
    kernel, cap = kernels[name], captures[name]
    kwargs = dict(cap.kwargs)
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*cap.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    return {"shared": compiled.metadata.shared, "ptx_lines": compiled.asm["ptx"].count("\n")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128,256")
    args = ap.parse_args()
    for d in (int(x) for x in args.head_dims.split(",")):
        h = 1024 // d
        for causal in (False, True):
            cfg = table_config(FWD, "sm90", d, causal, 4096, torch.bfloat16)
            params = launch.ScoreParams(softmax_scale=0.1, window_right=0 if causal else -1)
            q = torch.empty(2, 512, h, d, dtype=torch.bfloat16)
            out, lse = torch.empty_like(q), torch.empty(2, h, 512)
            qv = torch.empty(1, 1000, h, d, dtype=torch.bfloat16)
            outv, lsev = torch.empty_like(qv), torch.empty(1, h, 1000)
            cu = torch.tensor([0, 400, 1000], dtype=torch.int32)
            pages = torch.empty(20, 32, h, d, dtype=torch.bfloat16)
            table = torch.zeros(2, 10, dtype=torch.int32)
            builds = {
                "dense": lambda: launch.launch_forward(q, q, q, out, lse, params, cfg),
                "varlen": lambda: launch.launch_forward(qv, qv, qv, outv, lsev, params, cfg,
                                                        launch.PackedSeqs(cu, cu, 600, 600)),
                "paged": lambda: launch.launch_forward(qv, pages, pages, outv, lsev, params, cfg,
                                                       launch.PackedSeqs(cu, cu, 600, 600, block_table=table)),
                "kvcache": lambda: launch.launch_forward(qv, pages, pages, outv, lsev, params, cfg, launch.PackedSeqs(
                    cu, cu, 600, 600, block_table=table, key_shift=cu[:2].clone())),
                "split": lambda: launch.launch_forward(
                    qv, pages, pages, outv.float(), lsev, params, cfg,
                    launch.PackedSeqs(cu, cu, 600, 600, block_table=table), splits=(3, 256, outv.numel(), lsev.numel())),
            }
            for name, build in builds.items():
                r = compile_portable_forward(build)
                print(f"d{d:<4} causal={causal!s:<5} {name:<7} shared {r['shared']:>7}  ptx lines {r['ptx_lines']}")
            seqs = launch.PackedSeqs(cu, cu, 600, 600, block_table=table)
            r = compile_portable_forward(
                lambda: launch.attention_forward_split(qv, pages, pages, outv, lsev, params, seqs, 3),
                "attn_combine_kernel")
            print(f"d{d:<4} causal={causal!s:<5} combine shared {r['shared']:>7}  ptx lines {r['ptx_lines']}")
            q1, k1 = torch.empty(2, 1, h, d, dtype=torch.bfloat16), torch.empty(2, 1, max(h // 4, 1), d,
                                                                                dtype=torch.bfloat16)
            cache = torch.empty(20, 32, max(h // 4, 1), d, dtype=torch.bfloat16)
            cos = torch.empty(640, d // 4)
            for interleaved in (False, True):
                r = compile_portable_forward(lambda: launch.launch_kvcache_update(
                    q1, k1, k1, cache, cache, cos, cos, cu[:2], table, interleaved, causal), "kvcache_update_kernel")
                print(f"d{d:<4} causal={causal!s:<5} kv update (interleaved={interleaved}) ptx lines {r['ptx_lines']}")


if __name__ == "__main__":
    main()
