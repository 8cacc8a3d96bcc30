"""Compile every kernel the sm90 tables can launch, for sm90, with the Triton in use (no GPU
needed), and report shared memory, registers and spills; or compare such reports across Triton
versions side by side.

    PYTHONPATH=<repo> python bench/compile_check.py [--head-dims 64,128,256] --json out.json
    python bench/compile_check.py --compare 3.6.json 3.9.json [...]

"Every kernel" is each distinct config the tables pick for head dims 64/128/256, full and causal,
dense and packed batches, 1k to 16k keys: the Gluon forward and backward, the portable forward
(dense, packed, paged, split-KV, decoding), its combine and kv-cache update kernels, and the
portable backward (preprocess, dK/dV, dQ). A version whose kernels do not compile fails the run; a
version that costs registers or spills shows in the comparison table.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_bwd_compile_check import captured_call as captured_bwd  # noqa: E402
from gluon_bwd_compile_check import variants as bwd_variants  # noqa: E402
from gluon_fwd_compile_check import captured_call as captured_fwd  # noqa: E402
from gluon_fwd_compile_check import compile_sm90  # noqa: E402
from gluon_fwd_compile_check import variants as fwd_variants  # noqa: E402
from gluon_fwd_compile_check import Capture, gf  # noqa: E402

import triton  # noqa: E402

from flashtile.configs import (BWD_DKDV, BWD_DQ, BWD_GLUON, BWD_PREPROCESS, FWD, FWD_DECODE,  # noqa: E402
                               FWD_GLUON, table_config)
from flashtile.kernels import launch  # noqa: E402
from flashtile.triton_compat import ptxas_path  # noqa: E402

SEQLENS = (1024, 2048, 4096, 8192, 16384)


def table_configs(kernel, d, causal):
    """{config: {"dense" / "varlen": "1k-4k" (the key lengths it serves)}} the sm90 table picks
    for (kernel, d, causal) over SEQLENS."""
    found = {}
    for varlen in (False, True):
        for sk in SEQLENS:
            cfg = table_config(kernel, "sm90", d, causal, sk, torch.bfloat16, varlen)
            if cfg is not None:
                found.setdefault(cfg, {}).setdefault("varlen" if varlen else "dense", []).append(f"{sk // 1024}k")
    return {cfg: {v: f"{ks[0]}-{ks[-1]}" if len(ks) > 1 else ks[0] for v, ks in where.items()}
            for cfg, where in found.items()}


def portable_backward_rows(d, causal, dtype):
    """(name, kernel, kwargs) of the portable backward's three launches, dense and packed."""
    h = 1024 // d
    params = launch.ScoreParams(softmax_scale=0.1, window_right=0 if causal else -1)
    pre = table_config(BWD_PREPROCESS, "sm90", d, causal, 4096, dtype)
    dkdv = table_config(BWD_DKDV, "sm90", d, causal, 4096, dtype)
    dq = table_config(BWD_DQ, "sm90", d, causal, 4096, dtype)
    dense = [torch.empty(2, 512, h, d, dtype=dtype) for _ in range(9)]
    dense[5] = torch.empty(2, h, 512)
    packed = [torch.empty(1, 1000, h, d, dtype=dtype) for _ in range(9)]
    packed[5] = torch.empty(1, h, 1000)
    cu = torch.tensor([0, 400, 1000], dtype=torch.int32)
    for name, tensors, seqs in (("dense", dense, None), ("varlen", packed, launch.PackedSeqs(cu, cu, 600, 600))):
        q, k, v, out, dout, lse, dq_, dk, dv = tensors
        plan = launch.PortableBackward(q, k, v, out, dout, lse, dq_, dk, dv, params, pre, dkdv, dq, seqs)
        delta, lse_log2 = launch.row_stats_buffers(lse)
        slot_values = {"Out": out, "DOut": dout, "Lse": lse, "Delta": delta, "LseLog2": lse_log2, "Q": q, "K": k,
                       "V": v, "DQ": dq_, "DK": dk, "DV": dv, "CuSeqlensQ": None if seqs is None else cu,
                       "CuSeqlensK": None if seqs is None else cu}
        for part in ("preprocess", "dkdv", "dq"):
            call = getattr(plan, part)
            values = list(call.template)
            for index in call.slot_index:
                values[index] = slot_values.get(call.names[index])
            yield f"{name}/{part}", call.fn, dict(zip(call.names, values), **call.options)


def portable_forward_builds(d, causal, dtype):
    """(name, kernel name, build) of the portable forward's launches: dense, packed, paged, a kv cache
    (paged, left-padded), split-KV decoding and its combine, and the kv-cache update."""
    h = 1024 // d
    params = launch.ScoreParams(softmax_scale=0.1, window_right=0 if causal else -1)
    q = torch.empty(2, 512, h, d, dtype=dtype)
    out, lse = torch.empty_like(q), torch.empty(2, h, 512)
    qv = torch.empty(1, 1000, h, d, dtype=dtype)
    outv, lsev = torch.empty_like(qv), torch.empty(1, h, 1000)
    cu = torch.tensor([0, 400, 1000], dtype=torch.int32)
    pages = torch.empty(20, 32, h, d, dtype=dtype)
    table = torch.zeros(2, 10, dtype=torch.int32)
    cfg = table_config(FWD, "sm90", d, causal, 4096, dtype)
    dec = table_config(FWD_DECODE, "sm90", d, causal, 4096, dtype)
    q1 = torch.empty(1, 2, h, d, dtype=dtype)
    out1, lse1 = torch.empty_like(q1), torch.empty(1, h, 2)
    cu1 = torch.tensor([0, 1, 2], dtype=torch.int32)
    yield "fwd/dense", "attn_fwd_kernel", lambda: launch.launch_forward(q, q, q, out, lse, params, cfg)
    yield "fwd/varlen", "attn_fwd_kernel", lambda: launch.launch_forward(
        qv, qv, qv, outv, lsev, params, cfg, launch.PackedSeqs(cu, cu, 600, 600))
    yield "fwd/paged", "attn_fwd_kernel", lambda: launch.launch_forward(
        qv, pages, pages, outv, lsev, params, cfg, launch.PackedSeqs(cu, cu, 600, 600, block_table=table))
    yield "fwd/decode-split", "attn_fwd_kernel", lambda: launch.launch_forward(
        q1, pages, pages, out1.float(), lse1, params, dec,
        launch.PackedSeqs(cu1, cu, 1, 600, block_table=table), splits=(3, 256, out1.numel(), lse1.numel()))
    yield "fwd/kvcache", "attn_fwd_kernel", lambda: launch.launch_forward(
        qv, pages, pages, outv, lsev, params, cfg,
        launch.PackedSeqs(cu, cu, 600, 600, block_table=table, key_shift=cu[:2].clone()))
    seqs = launch.PackedSeqs(cu, cu, 600, 600, block_table=table)
    yield "fwd/combine", "attn_combine_kernel", lambda: launch.attention_forward_split(
        qv, pages, pages, outv, lsev, params, seqs, 3)
    k1 = torch.empty(2, 1, max(h // 4, 1), d, dtype=dtype)
    cache = torch.empty(20, 32, max(h // 4, 1), d, dtype=dtype)
    cos = torch.empty(640, d // 4)
    for interleaved in (False, True):
        yield (f"kvcache-update{'-interleaved' if interleaved else ''}", "kvcache_update_kernel",
               lambda i=interleaved: launch.launch_kvcache_update(torch.empty(2, 1, h, d, dtype=dtype), k1, k1, cache,
                                                                  cache, cos, cos, cu[:2], table, i, causal))


def capture_portable(build, name):
    """(kernel, args, kwargs) of the launch.<name> kernel that build() launches (nothing runs)."""
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
    return kernels[name], captures[name].args, captures[name].kwargs


def run(head_dims, dtype):
    rows = []

    def record(family, d, causal, variant, config, kernel, args, kwargs):
        r = compile_sm90(args, kwargs, kernel)
        r.update(family=family, head_dim=d, causal=causal, variant=variant, config=config)
        rows.append(r)
        print(f"{family:13s} d{d:<4} {'causal' if causal else 'full':6s} {variant:26s} {r['shared']:>7} "
              f"{r['regs']:>4} {r['spill_stores']:>5}/{r['spill_loads']:<5} {r['ptx_sha1']}", flush=True)

    for d in head_dims:
        for causal in (False, True):
            for cfg, where in table_configs(FWD_GLUON, d, causal).items():
                for vname, build in fwd_variants(d, cfg, causal, dtype):
                    if vname in where:
                        args, kwargs = captured_fwd(build)
                        record("gluon-fwd", d, causal, f"{vname} {where[vname]}", repr(cfg), gf.gluon_attn_fwd_kernel,
                               args, kwargs)
            for cfg, where in table_configs(BWD_GLUON, d, causal).items():
                for vname, build in bwd_variants(d, cfg, causal, dtype):
                    if vname in where:
                        kernel, args, kwargs = captured_bwd(build)
                        record("gluon-bwd", d, causal, f"{vname} {where[vname]}", repr(cfg), kernel, args, kwargs)
            for vname, kname, build in portable_forward_builds(d, causal, dtype):
                kernel, args, kwargs = capture_portable(build, kname)
                record("portable-fwd", d, causal, vname, "table", kernel, args, kwargs)
            for vname, kernel, kwargs in portable_backward_rows(d, causal, dtype):
                record("portable-bwd", d, causal, vname, "table", kernel, (), kwargs)
    return rows


def compare(paths):
    """A side-by-side table of registers and spills per kernel variant across reports."""
    reports = []
    for p in paths:
        with open(p) as f:
            reports.append(json.load(f))
    labels = [r["triton"] for r in reports]
    keyed = [{(row["family"], row["head_dim"], row["causal"], row["variant"]): row for row in r["kernels"]}
             for r in reports]
    keys = list(dict.fromkeys(k for table in keyed for k in table))
    head = " | ".join(f"{label} regs spill st/ld" for label in labels)
    print(f"| kernel | d | mask | variant | {head} |")
    print("|---|---|---|---|" + "---|" * len(labels))
    for key in keys:
        cells = []
        for table in keyed:
            row = table.get(key)
            cells.append("-" if row is None else f"{row['regs']} {row['spill_stores']}/{row['spill_loads']}")
        family, d, causal, variant = key
        print(f"| {family} | {d} | {'causal' if causal else 'full'} | {variant} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--compare", nargs="+", metavar="REPORT", help="compare reports written with --json")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
        return
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"triton {triton.__version__}, ptxas {ptxas_path(90)}")
    rows = run([int(x) for x in args.head_dims.split(",")], dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "ptxas": ptxas_path(90), "kernels": rows}, f, indent=1)
    print(f"{len(rows)} kernels compiled for sm90 with triton {triton.__version__}")


if __name__ == "__main__":
    main()
