"""A/B timing of a Gluon Hopper kernel: a baseline copy of the kernel module against the working
one, and config variants of the working one, side by side in one process (same GPU state, same
inputs), each checked first (forward: against a float32 reference; backward: against the portable
Triton backward's gradients).

    git show REV:flashtile/kernels/gluon_forward.py > flashtile/kernels/_baseline_gluon_forward.py
    git show REV:flashtile/kernels/gluon_backward.py > flashtile/kernels/_baseline_gluon_backward.py
    PYTHONPATH=<repo>:<repo>/bench python bench/gluon_ab.py --mode fwd --head-dims 64 --out $OUT

Variants: ``base:<config>`` runs the baseline module, ``new:<config>`` the working one, ``X:<config>``
a scratch copy flashtile/kernels/_X_gluon_{forward,backward}.py (several experiments in one run); <config> is
``table`` (the committed table entry for the point) or a name in VARIANTS or gluon_forward.CANDIDATES
(forward) or in gluon_backward.CANDIDATES (backward), with optional suffixes (see resolve): ``+oc``, ``+ps``, ``+hf``, ``+g8``, ``+f1``. Forward
``lib``: flash_attn_func through the library's own dispatch and launch plans (whichever kernel the
tables pick, the portable Triton kernels included); ``lib-portable``: the same with FLASHTILE_PORTABLE=1
(the portable kernels only). Also timed:
torch SDPA's cuDNN backend (the ratios' anchor; its backward through autograd). Prints a table of
TFLOP/s, writes gluon_ab_<mode>.json. The baseline copies are scratch files: do not commit them.
"""

import argparse
import dataclasses
import importlib
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flashtile.configs import BWD_GLUON, FWD_GLUON, GluonFwdConfig, table_config
from flashtile.kernels import gluon_backward as new_bwd_module
from flashtile.kernels import gluon_forward as new_module

from gluon_fwd_probe import FULL_CASES, QUICK_CASES, compare, make_case, reference, tflops, warm_up_gpu

C2_PP_PERSIST = GluonFwdConfig(128, 3, pingpong=True, persistent=True)
C3 = GluonFwdConfig(128, 2, num_consumers=3, consumer_regs=160, loader_regs=24)
C3_PERSIST = GluonFwdConfig(128, 2, num_consumers=3, consumer_regs=160, loader_regs=24, persistent=True)
VARIANTS = {
    "c2pp_persist": C2_PP_PERSIST,
    "c2pp": GluonFwdConfig(128, 3, pingpong=True),
    "c3": C3,
    "c3_persist": C3_PERSIST,
    # Row sums on the tensor cores (GluonFwdConfig.row_sum_mma).
    "c2pp_persist_rs": dataclasses.replace(C2_PP_PERSIST, row_sum_mma=True),
    "c2_persist_rs": dataclasses.replace(C2_PP_PERSIST, pingpong=False, row_sum_mma=True),
    "c3_rs": dataclasses.replace(C3, row_sum_mma=True),
    "c3_persist_rs": dataclasses.replace(C3_PERSIST, row_sum_mma=True),
    "c3pp_rs": dataclasses.replace(C3, pingpong=True, row_sum_mma=True),
    "c2n64pp_persist_rs": GluonFwdConfig(64, 4, pingpong=True, persistent=True, row_sum_mma=True),
    "c2pp_persist_rs_trim": dataclasses.replace(C2_PP_PERSIST, row_sum_mma=True, trim_diagonal=True),
    "c3_persist_rs_trim": dataclasses.replace(C3_PERSIST, row_sum_mma=True, trim_diagonal=True),
    # Four consumer warpgroups of 64 rows (256-row tiles), 64-key blocks to fit 112 registers.
    "c4n64_rs": GluonFwdConfig(64, 4, num_consumers=4, consumer_regs=112, loader_regs=24, row_sum_mma=True),
    "c4n64_persist_rs": GluonFwdConfig(64, 4, num_consumers=4, consumer_regs=112, loader_regs=24, persistent=True,
                                       row_sum_mma=True),
    "c4n64s6_persist_rs": GluonFwdConfig(64, 6, num_consumers=4, consumer_regs=112, loader_regs=24,
                                         persistent=True, row_sum_mma=True),
    "c4n64pp_persist_rs": GluonFwdConfig(64, 4, num_consumers=4, consumer_regs=112, loader_regs=24,
                                         pingpong=True, persistent=True, row_sum_mma=True),
    "c4n64_persist": GluonFwdConfig(64, 4, num_consumers=4, consumer_regs=112, loader_regs=24, persistent=True),
    "c4n64s8_persist_rs": GluonFwdConfig(64, 8, num_consumers=4, consumer_regs=112, loader_regs=24,
                                         persistent=True, row_sum_mma=True),
    # Causal: each warpgroup's own key range (GluonFwdConfig.own_key_range).
    "c4n64_rs_own": GluonFwdConfig(64, 4, num_consumers=4, consumer_regs=112, loader_regs=24, row_sum_mma=True,
                                   own_key_range=True),
    "c4n64_persist_rs_own": GluonFwdConfig(64, 4, num_consumers=4, consumer_regs=112, loader_regs=24,
                                           persistent=True, row_sum_mma=True, own_key_range=True),
    "c4n64s6_persist_rs_own": GluonFwdConfig(64, 6, num_consumers=4, consumer_regs=112, loader_regs=24,
                                             persistent=True, row_sum_mma=True, own_key_range=True),
    "c4n64s6_rs_own": GluonFwdConfig(64, 6, num_consumers=4, consumer_regs=112, loader_regs=24, row_sum_mma=True,
                                     own_key_range=True),
    "c4n64s8_rs_own": GluonFwdConfig(64, 8, num_consumers=4, consumer_regs=112, loader_regs=24, row_sum_mma=True,
                                     own_key_range=True),
    "c4n64s3_rs_own": GluonFwdConfig(64, 3, num_consumers=4, consumer_regs=112, loader_regs=24, row_sum_mma=True,
                                     own_key_range=True),
    "c4n64s8_persist_rs_own": GluonFwdConfig(64, 8, num_consumers=4, consumer_regs=112, loader_regs=24,
                                             persistent=True, row_sum_mma=True, own_key_range=True),
    "c4n64s10_persist_rs_own": GluonFwdConfig(64, 10, num_consumers=4, consumer_regs=112, loader_regs=24,
                                              persistent=True, row_sum_mma=True, own_key_range=True),
    "c2n64_rs_own": GluonFwdConfig(64, 4, row_sum_mma=True, own_key_range=True),
    "c2n64s8_persist_rs_own": GluonFwdConfig(64, 8, persistent=True, row_sum_mma=True, own_key_range=True),
    "c3n64s8_persist_rs_own": GluonFwdConfig(64, 8, num_consumers=3, consumer_regs=160, loader_regs=24,
                                             persistent=True, row_sum_mma=True, own_key_range=True),
    "c3_persist_rs_own": dataclasses.replace(C3_PERSIST, row_sum_mma=True, own_key_range=True),
    "c3_rs_own": dataclasses.replace(C3, row_sum_mma=True, own_key_range=True),
    "d128_plain": GluonFwdConfig(128, 2),
    "d128_persist": GluonFwdConfig(128, 2, persistent=True),
    "d128_pp": GluonFwdConfig(128, 2, pingpong=True),
    "d128_pp_persist": GluonFwdConfig(128, 2, pingpong=True, persistent=True),
}


def log(*a):
    print(*a, flush=True)


def variant_module(side, mode):
    """The kernel module a variant's side names: new = the working tree, base = the baseline copy,
    any other X = a scratch copy flashtile/kernels/_X_gluon_{forward,backward}.py."""
    if side == "new":
        return new_bwd_module if mode == "bwd" else new_module
    prefix = "baseline" if side == "base" else side
    return importlib.import_module(f"flashtile.kernels._{prefix}_gluon_{'backward' if mode == 'bwd' else 'forward'}")


def group_for_factor(cfg, d, seqlen, factor):
    """The forward's heads_per_group at a sweep point (16k tokens, hidden 2048) for a factor of
    resident CTAs (one per SM)."""
    from flashtile.kernels.hopper import multiprocessors
    from flashtile.kernels.tile_order import heads_per_group

    sms = multiprocessors(torch.device("cuda"))
    return heads_per_group(-(-seqlen // cfg.block_m), max(16384 // seqlen, 1) * (2048 // d), sms, factor)


def resolve(spec, d, causal, seqlen, mode="fwd"):
    """(module, config) of a variant spec. Suffixes: backward: +oc the dQ convert overlapped
    (GluonBwdConfig.overlap_convert), +hf / +kf heads_first on / off; forward: +gN heads_per_group = N
    (kernels/tile_order.py), +fN the group size tile_order.heads_per_group gives with factor N."""
    side, name = spec.split(":")
    module = variant_module(side, mode)
    name, *suffixes = name.split("+")
    if mode == "bwd":
        if name == "table":
            cfg = table_config(BWD_GLUON, "sm90", d, causal=causal, seqlen_k=seqlen)
        else:
            cfg = module.CANDIDATES[d][name]
    else:
        if name == "table":
            cfg = table_config(FWD_GLUON, "sm90", d, causal=causal, seqlen_k=seqlen)
        else:  # this script's VARIANTS, else the module's CANDIDATES for the head dim
            cfg = VARIANTS[name] if name in VARIANTS else module.CANDIDATES[d][name]
    for suffix in suffixes:
        if cfg is None:
            break
        if suffix == "oc":
            cfg = dataclasses.replace(cfg, overlap_convert=True)
        elif suffix == "ps":  # backward: persistent (head dim 64)
            cfg = dataclasses.replace(cfg, persistent=True)
        elif suffix in ("hf", "kf"):  # backward: KV heads (or key blocks) the grid's first axis
            cfg = dataclasses.replace(cfg, heads_first=suffix == "hf")
        elif suffix.startswith("f"):  # the group size tile_order.heads_per_group gives with this factor
            cfg = dataclasses.replace(cfg, heads_per_group=group_for_factor(cfg, d, seqlen, int(suffix[1:])))
        else:
            assert suffix.startswith("g"), spec
            cfg = dataclasses.replace(cfg, heads_per_group=int(suffix[1:]))
    return module, cfg


def check(spec, d, module, cfg):
    """Quick cases in bf16 and fp16 against float32; True when all pass."""
    ok_all = True
    for case in FULL_CASES:
        cname, b, sq, sk, h, hk, causal, layout, _ = case
        if cname not in QUICK_CASES:
            continue
        for dtype in (torch.bfloat16, torch.float16):
            torch.manual_seed(hash((d, cname)) % 2**31)
            q, k, v, out, lse = make_case(b, sq, sk, h, hk, d, dtype, layout)
            scale = 1.0 / math.sqrt(d)
            module.gluon_attention_forward(q, k, v, out, lse, scale, causal, config=cfg)
            ref_out, ref_lse = reference(q, k, v, scale, causal)
            ok, rel, lse_err, _ = compare(out, lse, ref_out, ref_lse, dtype, cfg.row_sum_mma)
            if not ok:
                log(f"FAIL {spec} d{d} {cname} {dtype}: rel {rel:.2e} lse {lse_err:.2e}")
            ok_all &= ok
    return ok_all


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--head-dims", default="64")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--variants", default="base:table,new:table")
    ap.add_argument("--repeats", type=int, default=2, help="timing rounds over all variants (median kept)")
    args = ap.parse_args()
    specs = args.variants.split(",")
    os.makedirs(args.out, exist_ok=True)
    warm_up_gpu(1.0)
    if args.mode == "bwd":
        rows, checked = backward_rows(args, specs)
    else:
        rows, checked = forward_rows(args, specs)
    with open(os.path.join(args.out, f"gluon_ab_{args.mode}.json"), "w") as f:
        json.dump({"rows": rows, "checked": {str(k): v for k, v in checked.items()}}, f, indent=1)
    cols = ["cudnn"] + specs
    log("\nTFLOP/s (ratio to cuDNN)")
    log(f"{'d':>4} {'seqlen':>6} {'causal':>6} " + " ".join(f"{c:>24s}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            tf = r["tflops"].get(c)
            cells.append(f"{'-':>24s}" if tf is None else f"{tf:>15.0f} ({tf / r['tflops']['cudnn']:.3f})")
        log(f"{r['head_dim']:>4} {r['seqlen']:>6} {int(r['causal']):>6} " + " ".join(cells))
    worst = max((v, k) for r in rows for k, v in r["spread"].items())
    log(f"spread between repeats ((max - min) / median): worst {worst[0]:.1%} ({worst[1]})")
    log("checks: " + ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in checked.items()))


def time_rows(row, timed, repeats):
    """Median ms of each callable in timed ({name: fn}) over repeats rounds, interleaved."""
    ms = {name: [] for name in timed}
    for _ in range(repeats):
        for name, fn in timed.items():
            ms[name].append(do_bench(fn))
    row["ms"] = {name: sorted(v)[len(v) // 2] for name, v in ms.items()}
    row["spread"] = {name: (max(v) - min(v)) / row["ms"][name] for name, v in ms.items()}


def backward_rows(args, specs):
    import gluon_bwd_probe
    from gluon_bwd_probe import bwd_tflops, flashtile_grads, forward_and_preprocess, rel_err, timing_inputs
    gluon_bwd_probe._imports()
    rows, checked = [], {}
    started = time.time()
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                b, h, q, k, v, dout = timing_inputs(d, s, causal)
                scale = 1.0 / math.sqrt(d)
                _, _, lse_log2, delta, preprocess = forward_and_preprocess(q, k, v, dout, scale, causal)
                ref = flashtile_grads(q, k, v, dout, scale, causal)
                row = {"head_dim": d, "seqlen": s, "causal": causal, "errs": {}}
                timed = {}
                qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                do_t = dout.transpose(1, 2)
                timed["cudnn"] = lambda: torch.autograd.grad(o, (qt, kt, vt), do_t, retain_graph=True)
                for spec in specs:
                    module, cfg = resolve(spec, d, causal, s, "bwd")
                    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                    launch = module.make_launcher(q, k, v, dout, lse_log2, delta, *grads, scale, causal, cfg)
                    launch()
                    torch.cuda.synchronize()
                    errs = [rel_err(g, r.float()) for g, r in zip(grads, ref)]
                    row["errs"][spec] = errs
                    checked[(spec, d, causal, s)] = ok = all(e < 2e-2 for e in errs)
                    if ok:
                        timed[spec] = (lambda launch=launch: (preprocess(), launch()))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    time_rows(row, timed, args.repeats)
                row["tflops"] = {n: bwd_tflops(b, h, s, d, causal, ms) for n, ms in row["ms"].items()}
                log(f"d{d} s{s:5d} causal={int(causal)} " + "  ".join(
                    f"{n}={tf:.0f}" for n, tf in row["tflops"].items()) + f"  ({time.time() - started:.0f}s)")
                rows.append(row)
                del q, k, v, dout, lse_log2, delta, ref, timed, o, qt, kt, vt
                torch.cuda.empty_cache()
    return rows, checked


def library_forward(q, k, v, causal, ref, row, portable=False):
    """flash_attn_func through the library's dispatch, checked against ref; None if it fails.
    portable: with FLASHTILE_PORTABLE=1 (the portable Triton kernels only; launch plans keep
    the two apart)."""
    import flashtile

    def run():
        # Set and restore this one variable only: mock.patch.dict rewrites the whole environment on
        # exit, host time that swamped the kernel (90 against 330 TFLOP/s at d64 causal 1k).
        saved = os.environ.get("FLASHTILE_PORTABLE")
        os.environ["FLASHTILE_PORTABLE"] = "1" if portable else "0"
        try:
            with torch.no_grad():
                return flashtile.flash_attn_func(q, k, v, causal=causal)
        finally:
            if saved is None:
                del os.environ["FLASHTILE_PORTABLE"]
            else:
                os.environ["FLASHTILE_PORTABLE"] = saved
    err = ((run().float() - ref).norm() / ref.norm()).item()
    row["err_vs_cudnn"]["lib-portable" if portable else "lib"] = err
    return run if err < 2e-2 else None


def forward_rows(args, specs):
    rows, checked = [], {}
    started = time.time()
    for d in (int(x) for x in args.head_dims.split(",")):
        h = 2048 // d
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                b = max(16384 // s, 1)
                torch.manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                scale = 1.0 / math.sqrt(d)
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                    ref = cudnn().transpose(1, 2).float()
                row = {"head_dim": d, "seqlen": s, "causal": causal, "err_vs_cudnn": {}}
                launchers = {}
                for spec in specs:
                    if spec in ("lib", "lib-portable"):
                        run = library_forward(q, k, v, causal, ref, row, portable=spec == "lib-portable")
                        if run is not None:
                            launchers[spec] = run
                        continue
                    module, cfg = resolve(spec, d, causal, s)
                    if cfg is None:
                        continue  # the table sends this point to the portable kernel
                    key = (spec, d, cfg)
                    if key not in checked:
                        checked[key] = check(spec, d, module, cfg)
                    if not checked[key]:
                        continue
                    out = torch.full_like(q, float("nan"))
                    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
                    launch = module.make_launcher(q, k, v, out, lse, scale, causal, cfg)
                    launch()
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    row["err_vs_cudnn"][spec] = err
                    if err < 2e-2:
                        launchers[spec] = launch
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    time_rows(row, {"cudnn": cudnn, **launchers}, args.repeats)
                row["tflops"] = {spec: tflops(b, h, s, d, causal, ms) for spec, ms in row["ms"].items()}
                log(f"d{d} s{s:5d} causal={int(causal)} " + "  ".join(
                    f"{spec}={tf:.0f}" for spec, tf in row["tflops"].items()) + f"  ({time.time() - started:.0f}s)")
                rows.append(row)
                del q, k, v, qt, kt, vt, ref, launchers
                torch.cuda.empty_cache()
    return rows, checked


if __name__ == "__main__":
    main()
