"""GPU check + timing of the Gluon Hopper forward (flashtile/kernels/gluon_forward.py).

    PYTHONPATH=<repo> python bench/gluon_fwd_probe.py --out $OUT

1. Correctness of every candidate config against a float32 torch reference (fresh randn inputs,
   NaN-poisoned outputs); the default config of each head dim gets the full case list.
2. Timing (bf16, 16384 tokens per batch, hidden 2048) of every candidate that passed, next to
   torch SDPA's cuDNN backend and flashtile's Triton forward. Writes JSON under --out.
"""

import argparse
import json
import math
import os
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from flashtile.configs import FWD_GLUON, table_config
from flashtile.kernels import gluon_forward as gf

# The committed choice per head dim (long non-causal keys): it runs the full case list.
DEFAULTS = {d: table_config(FWD_GLUON, "sm90", d, causal=False, seqlen_k=16384) for d in gf.HEAD_DIMS}

TIME_BUDGET_S = 7 * 60  # stop starting new timings after this (one run must stay under 8 min)
T0 = time.time()


def elapsed():
    return time.time() - T0


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# Reference and checking
# ----------------------------------------------------------------------------------------------

def reference(q, k, v, scale, causal):
    """float32 (out (b, sq, h, d), lse (b, h, sq)); rows that see no key: out 0, lse -inf."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.matmul(p, vf).transpose(1, 2)
    return out, lse


def make_case(b, sq, sk, h, hk, d, dtype, layout="plain"):
    dev = "cuda"
    if layout == "packed":  # q, k, v as views of one (b, s, 3, h, d) tensor
        assert sq == sk and h == hk
        qkv = torch.randn(b, sq, 3, h, d, device=dev, dtype=dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
        v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    if layout == "strided_out":  # out a (b, h, s, d) buffer seen as (b, s, h, d); lse padded in sq
        out = torch.full((b, h, sq, d), float("nan"), device=dev, dtype=dtype).transpose(1, 2)
        lse = torch.full((b, h, sq + 24), float("nan"), device=dev, dtype=torch.float32)[:, :, :sq]
    else:
        out = torch.full((b, sq, h, d), float("nan"), device=dev, dtype=dtype)
        lse = torch.full((b, h, sq), float("nan"), device=dev, dtype=torch.float32)
    return q, k, v, out, lse


def lse_tolerance(dtype, row_sum_mma=False):
    """Largest lse error allowed. Row sums in float32 put lse within ~1e-6 (1e-3 is generous);
    on the tensor cores (GluonFwdConfig.row_sum_mma) l sums P rounded to the input dtype, up to
    2^-8 (bf16) / 2^-11 (fp16) relative, which lse carries as an absolute error."""
    if row_sum_mma and dtype == torch.bfloat16:
        return 4e-3
    return 1e-3


def compare(out, lse, ref_out, ref_lse, dtype, row_sum_mma=False):
    out_f = out.float()
    finite_out = bool(torch.isfinite(out_f).all())
    ref_norm = ref_out.norm().item()
    rel = (out_f - ref_out).norm().item() / max(ref_norm, 1e-6) if finite_out else float("inf")
    inf_match = bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse)))
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    if torch.isnan(lse).any():
        lse_err = float("inf")
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    ok = finite_out and rel < tol and inf_match and lse_err < lse_tolerance(dtype, row_sum_mma)
    return ok, rel, lse_err, inf_match


# (name, b, sq, sk, h, hk, causal, layout, scale override)
FULL_CASES = [
    ("s1", 1, 1, 1, 2, 2, False, "plain", None),
    ("s1_causal", 1, 1, 1, 2, 2, True, "plain", None),
    ("s113", 2, 113, 113, 4, 4, False, "plain", None),
    ("s113_causal", 2, 113, 113, 4, 4, True, "plain", None),
    ("s1023", 2, 1023, 1023, 4, 4, False, "plain", None),
    ("s1023_causal", 2, 1023, 1023, 4, 4, True, "plain", None),
    ("s512_causal", 1, 512, 512, 2, 2, True, "plain", None),
    ("q113_k203", 2, 113, 203, 4, 4, False, "plain", None),
    ("q113_k203_causal", 2, 113, 203, 4, 4, True, "plain", None),
    ("q300_k100_causal", 2, 300, 100, 4, 4, True, "plain", None),
    ("q300_k100", 2, 300, 100, 4, 4, False, "plain", None),
    ("q1_k1000_causal", 2, 1, 1000, 4, 4, True, "plain", None),
    ("q1000_k1_causal", 2, 1000, 1, 4, 4, True, "plain", None),
    ("gqa_h8_hk2", 2, 257, 257, 8, 2, False, "plain", None),
    ("gqa_h8_hk2_causal", 2, 257, 333, 8, 2, True, "plain", None),
    ("strided_out_causal", 2, 200, 200, 4, 4, True, "strided_out", None),
    ("packed_qkv", 2, 256, 256, 4, 4, False, "packed", None),
    ("s2000_causal", 1, 2000, 2000, 2, 2, True, "plain", None),
    # More tiles than SMs: a persistent CTA runs several (tile loop, ring and barrier phases
    # carried across tiles, tiles without keys in between).
    ("tiles_s1023", 4, 1023, 1023, 16, 16, False, "plain", None),
    ("tiles_s1023_gqa_causal", 4, 1023, 1023, 16, 4, True, "plain", None),
    ("tiles_q300_k100_causal", 8, 300, 100, 32, 32, True, "plain", None),
    ("tiles_s77_causal", 16, 77, 77, 16, 16, True, "plain", None),
]
QUICK_CASES = ["s113", "s1023_causal", "q113_k203_causal", "q300_k100_causal", "gqa_h8_hk2_causal",
               "strided_out_causal", "tiles_s1023", "tiles_s1023_gqa_causal", "tiles_q300_k100_causal",
               "tiles_s77_causal"]


def check_config(d, name, cfg, cases, dtypes, results):
    all_ok = True
    for case in cases:
        cname, b, sq, sk, h, hk, causal, layout, scale = case
        for dtype in dtypes:
            tag = f"d{d} {name:16s} {cname:20s} {str(dtype)[6:]:8s}"
            rec = {"head_dim": d, "variant": name, "case": cname, "dtype": str(dtype), "causal": causal}
            try:
                torch.manual_seed(hash((d, cname)) % 2**31)
                q, k, v, out, lse = make_case(b, sq, sk, h, hk, d, dtype, layout)
                sc = scale if scale is not None else 1.0 / math.sqrt(d)
                if not gf.supported(q, k, v, causal):
                    log(f"{tag} SKIP (supported() is False)")
                    rec["status"] = "unsupported"
                    all_ok = False
                    results.append(rec)
                    continue
                gf.gluon_attention_forward(q, k, v, out, lse, sc, causal, config=cfg)
                torch.cuda.synchronize()
                ref_out, ref_lse = reference(q, k, v, sc, causal)
                ok, rel, lse_err, inf_match = compare(out, lse, ref_out, ref_lse, dtype, cfg.row_sum_mma)
                rec.update(status="PASS" if ok else "FAIL", rel_err=rel, lse_max_abs_err=lse_err, lse_inf_match=inf_match)
                log(f"{tag} rel={rel:.2e} lse_err={lse_err:.2e} inf_match={inf_match} {'PASS' if ok else 'FAIL'}")
                all_ok &= ok
            except Exception as e:
                rec.update(status="ERROR", error=f"{type(e).__name__}: {e}"[:2000])
                log(f"{tag} ERROR {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc(limit=3)
                all_ok = False
                torch.cuda.synchronize()
            results.append(rec)
    return all_ok


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def warm_up_gpu(seconds=1.0):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def tflops(b, h, s, d, causal, ms):
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    return flops / (ms * 1e-3) / 1e12


def kernel_facts(cfg, q, k, v, out, lse, scale, causal):
    try:
        ck = gf._launch(q, k, v, out, lse, scale, causal, cfg)
        return {"n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None),
                "shared": getattr(ck.metadata, "shared", None)}
    except Exception as e:
        return {"error": str(e)[:300]}


def time_all(passed, timing, seqlens, head_dims):
    from flashtile import flash_attn_func
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16
    for d in head_dims:
        h = 2048 // d
        for s in seqlens:
            b = max(16384 // s, 1)
            for causal in (False, True):
                if elapsed() > TIME_BUDGET_S:
                    log(f"time budget reached; skipping d{d} s{s} causal={causal}")
                    continue
                torch.manual_seed(0)
                q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
                k = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
                v = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
                scale = 1.0 / math.sqrt(d)
                row = {"head_dim": d, "seqlen": s, "batch": b, "nheads": h, "causal": causal, "ms": {}, "tflops": {},
                       "max_rel_err_vs_cudnn": {}, "facts": {}, "ms_full_api": {}}
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

                ref = None
                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                        ref = fn().transpose(1, 2).float()
                        ms = do_bench(fn)
                    row["ms"]["cudnn"] = ms
                    row["tflops"]["cudnn"] = tflops(b, h, s, d, causal, ms)
                except Exception as e:
                    row["ms"]["cudnn"] = None
                    log(f"cudnn failed d{d} s{s} causal={causal}: {str(e)[:200]}")

                try:
                    with torch.no_grad():
                        fn = lambda: flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)
                        ms = do_bench(fn)
                    row["ms"]["flashtile_triton"] = ms
                    row["tflops"]["flashtile_triton"] = tflops(b, h, s, d, causal, ms)
                except Exception as e:
                    row["ms"]["flashtile_triton"] = None
                    log(f"flashtile failed d{d} s{s} causal={causal}: {str(e)[:200]}")

                out = torch.empty_like(q)
                lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
                for name, cfg in gf.CANDIDATES.get(d, {}).items():
                    if not passed.get((d, name)):
                        continue
                    try:
                        out.fill_(float("nan"))
                        gf.gluon_attention_forward(q, k, v, out, lse, scale, causal, config=cfg)
                        torch.cuda.synchronize()
                        if ref is not None:
                            err = ((out.float() - ref).norm() / ref.norm()).item()
                            row["max_rel_err_vs_cudnn"][name] = err
                            if not (err < 2e-2):
                                log(f"  d{d} s{s} causal={causal} {name}: rel err vs cudnn {err:.2e} -> not timed")
                                continue
                        if s == seqlens[0] and not causal:
                            row["facts"][name] = kernel_facts(cfg, q, k, v, out, lse, scale, causal)
                        # Descriptors prebuilt (cuDNN's timing has no per-call host setup either);
                        # the full-API time is recorded too.
                        ms = do_bench(gf.make_launcher(q, k, v, out, lse, scale, causal, cfg))
                        row["ms"][name] = ms
                        row["tflops"][name] = tflops(b, h, s, d, causal, ms)
                        row["ms_full_api"][name] = do_bench(
                            lambda: gf.gluon_attention_forward(q, k, v, out, lse, scale, causal, config=cfg))
                    except Exception as e:
                        row["ms"][name] = None
                        log(f"  d{d} s{s} causal={causal} {name} failed: {type(e).__name__}: {str(e)[:300]}")
                        torch.cuda.synchronize()
                msg = "  ".join(f"{k_}={v_:.0f}" for k_, v_ in row["tflops"].items() if v_)
                log(f"d{d} s{s:5d} b{b:2d} h{h:2d} causal={int(causal)} TFLOP/s: {msg}")
                timing.append(row)
                del q, k, v, qt, kt, vt, out, lse, ref
                torch.cuda.empty_cache()


def summary_table(timing):
    lines = []
    hdr = f"{'d':>4} {'seqlen':>6} {'causal':>6} {'cudnn':>6} {'triton':>6} {'best gluon':>22} {'TF/s':>6} {'/cudnn':>7} {'/triton':>7}"
    lines.append(hdr)
    for r in timing:
        tf = r["tflops"]
        gl_items = [(k, v) for k, v in tf.items() if k not in ("cudnn", "flashtile_triton") and v]
        best = max(gl_items, key=lambda kv: kv[1]) if gl_items else ("-", None)
        cud, tri = tf.get("cudnn"), tf.get("flashtile_triton")
        fmt = lambda x: f"{x:6.0f}" if x else "     -"
        ratio = lambda a, b_: f"{a / b_:7.2f}" if a and b_ else "      -"
        lines.append(f"{r['head_dim']:>4} {r['seqlen']:>6} {int(r['causal']):>6} {fmt(cud)} {fmt(tri)} "
                     f"{best[0]:>22} {fmt(best[1])} {ratio(best[1], cud)} {ratio(best[1], tri)}")
    lines.append("")
    lines.append("all gluon variants (TFLOP/s):")
    for r in timing:
        tf = r["tflops"]
        items = "  ".join(f"{k}={v:.0f}" for k, v in tf.items() if k not in ("cudnn", "flashtile_triton") and v)
        lines.append(f"  d{r['head_dim']} s{r['seqlen']} causal={int(r['causal'])}: {items}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--head-dims", default="128,64,256")  # d128 first: it matters most
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]

    log(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()} "
        f"cc {torch.cuda.get_device_capability()}")
    report = {"correctness": [], "timing": [], "passed_variants": []}
    passed = {}

    # Correctness: full list on each default config, a quick list (+fp16) on the alternatives.
    for d in head_dims:
        for name, cfg in gf.CANDIDATES.get(d, {}).items():
            is_default = cfg == DEFAULTS.get(d)
            cases = FULL_CASES if is_default else [c for c in FULL_CASES if c[0] in QUICK_CASES]
            dtypes = (torch.bfloat16, torch.float16) if is_default else (torch.bfloat16,)
            t = time.time()
            ok = check_config(d, name, cfg, cases, dtypes, report["correctness"])
            passed[(d, name)] = ok
            log(f"== d{d} {name}: {'ALL PASS' if ok else 'SOME FAILED'} ({time.time() - t:.1f}s, total {elapsed():.0f}s)")
    report["passed_variants"] = [f"d{d}:{n}" for (d, n), ok in passed.items() if ok]
    n_fail = sum(1 for r in report["correctness"] if r.get("status") != "PASS")
    log(f"correctness: {len(report['correctness']) - n_fail} ok, {n_fail} not ok")
    with open(os.path.join(args.out, "gluon_fwd_probe.json"), "w") as f:
        json.dump(report, f, indent=1)

    if not args.skip_timing:
        warm_up_gpu(1.0)
        try:
            time_all(passed, report["timing"], seqlens, head_dims)
        except Exception:
            traceback.print_exc()
        table = summary_table(report["timing"])
        report["summary"] = table
        with open(os.path.join(args.out, "gluon_fwd_probe.json"), "w") as f:
            json.dump(report, f, indent=1)
        log("\n" + table)
    log(f"done in {elapsed():.0f}s")


if __name__ == "__main__":
    main()
