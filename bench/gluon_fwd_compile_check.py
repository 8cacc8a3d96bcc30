"""Compile the Gluon Hopper forward for sm90 on any machine (no GPU needed) and report shared
memory, registers, spills and a hash of the SASS, for the dense and varlen variants.

    PYTHONPATH=<repo> python bench/gluon_fwd_compile_check.py [--candidates] [--json out.json]

The kernel arguments are captured from gluon_forward.make_launcher (run on CPU tensors, nothing is
launched), specialized for a CUDA sm90 target and compiled with triton.compile; registers and
spills come from ptxas -v on the PTX. Equal SASS hashes mean identical machine code (the dense
path must not change when the varlen code changes).
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import tempfile

import torch
from triton.backends.compiler import GPUTarget

from flashtile.configs import FWD_GLUON, table_config
from flashtile.kernels import gluon_forward as gf
from flashtile.triton_compat import compile_for_target, ptxas_path

TARGET = GPUTarget("cuda", 90, 32)


class Capture:
    """Stands in for a kernel: kernel[grid](*args, **kwargs) records the call."""

    def __init__(self, kernel):
        self.fn = kernel.fn  # the Python function, whose signature CompiledCall reads

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.args, self.kwargs = args, kwargs
        return call


def captured_call(build):
    """(args, kwargs) that make_launcher's launch would pass to the kernel."""
    kernel = gf.gluon_attn_fwd_kernel
    cap = Capture(kernel)
    gf.gluon_attn_fwd_kernel = cap
    try:
        build()()
    finally:
        gf.gluon_attn_fwd_kernel = kernel
    return cap.args, cap.kwargs


def compile_sm90(args, kwargs, kernel=None) -> dict:
    """Compile kernel (default: the Gluon forward) for sm90 with these call arguments: registers and
    spills from ptxas' report of Triton's own build (its flags), SASS from its cubin."""
    kernel = kernel or gf.gluon_attn_fwd_kernel
    compiled, log = compile_for_target(kernel, args, kwargs, TARGET, ptxas_log=True)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas_path(90)), "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    # The PTX without debug info (.loc lines, scope labels, DWARF sections): ptxas is not always
    # deterministic (the d256 backward's SASS differs run to run), so equal code is best judged here.
    code = compiled.asm["ptx"].split(".section\t.debug")[0]
    code = "\n".join(line for line in code.splitlines()
                     if not re.match(r"\s*(\.loc|\.file)\b", line) and not re.match(r"\$L__tmp\d+:$", line))
    body = "\n".join(line for line in sass.splitlines() if "Function" not in line and "code for" not in line)
    return {"shared": compiled.metadata.shared, "regs": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "sass_lines": body.count("\n"), "sass_sha1": hashlib.sha1(body.encode()).hexdigest()[:12],
            "ptx_sha1": hashlib.sha1(code.encode()).hexdigest()[:12]}


def variants(d, cfg, causal, dtype):
    """(name, launcher builder) per variant, on CPU tensors (only shapes, strides, dtypes matter)."""
    h = 2048 // d
    q = torch.empty(2, 1024, h, d, dtype=dtype)
    out, lse = torch.empty_like(q), torch.empty(2, h, 1024)
    yield "dense", lambda: gf.make_launcher(q, q, q, out, lse, 0.1, causal, cfg)
    qv = torch.empty(1, 3000, h, d, dtype=dtype)
    outv, lsev = torch.empty_like(qv), torch.empty(h, 3000)
    cu = torch.tensor([0, 1000, 3000], dtype=torch.int32)
    used = torch.tensor([1000, 1500], dtype=torch.int32)
    for name, used_q, used_k in (("varlen", None, None), ("varlen+seqused_qk", used, used),
                                 ("varlen+seqused_k", None, used)):
        yield name, (lambda uq=used_q, uk=used_k: gf.make_launcher(
            qv, qv, qv, outv, lsev, 0.1, causal, cfg, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=uq,
            seqused_k=uk, max_seqlen_q=2000))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--candidates", action="store_true", help="also every config in gluon_forward.CANDIDATES")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    print(f"{'d':>4} {'config':16s} {'causal':>6} {'variant':18s} {'shared':>7} {'regs':>4} {'spill st/ld':>11} "
          f"{'sass':>6} sha1         ptx sha1")
    for d in (int(x) for x in args.head_dims.split(",")):
        configs = {"default": table_config(FWD_GLUON, "sm90", d, causal=False, seqlen_k=16384)}
        if args.candidates:
            configs.update(gf.CANDIDATES.get(d, {}))
        for cname, cfg in configs.items():
            for causal in (False, True):
                for vname, build in variants(d, cfg, causal, dtype):
                    r = compile_sm90(*captured_call(build))
                    r.update(head_dim=d, config=cname, causal=causal, variant=vname)
                    rows.append(r)
                    print(f"{d:>4} {cname:16s} {int(causal):>6} {vname:18s} {r['shared']:>7} {r['regs']:>4} "
                          f"{r['spill_stores']:>5}/{r['spill_loads']:<5} {r['sass_lines']:>6} {r['sass_sha1']} "
                          f"{r['ptx_sha1']}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
