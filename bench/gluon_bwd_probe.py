"""GPU check + timing of the Gluon Hopper backward (flashtile/kernels/gluon_backward.py).

    PYTHONPATH=<repo> python bench/gluon_bwd_probe.py --out $OUT [--quick] [--variants 128:m64_s2,...]
                                                     [--head-dims 256]

Every piece of GPU work runs in a child process with a timeout (a deadlocked kernel only costs
its timeout): first the correctness of each candidate config (fresh randn inputs, NaN-poisoned
gradients, float32 autograd reference, flashtile's Triton backward alongside), then timings
(bf16, 16384 tokens per batch, hidden 2048) of cuDNN (torch SDPA), flashtile's Triton backward
and each candidate that passed. Writes $OUT/gluon_bwd_probe.json (+ one JSON per child) and
prints a short table last.
"""

import argparse
import json
import math
import os
import sys
import time
import traceback
import zlib

from probe_pieces import load_json, run_script

TIME_BUDGET_S = 7 * 60 + 20  # the whole run must stay under 8 minutes
T0 = time.time()


def elapsed():
    return time.time() - T0


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# Shared helpers (children)
# ----------------------------------------------------------------------------------------------

def _imports():
    global torch, triton, gb
    import torch  # noqa: F401
    import triton  # noqa: F401
    from flashtile.kernels import gluon_backward as gb  # noqa: F401


def reference_grads(q, k, v, dout, scale, causal):
    """float32 autograd of softmax(q k^T * scale) v with the bottom-right causal mask; rows that
    see no key output 0 (and get no gradient)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf = q.detach().float().requires_grad_()
    kf = k.detach().float().requires_grad_()
    vf = v.detach().float().requires_grad_()
    qh = qf.transpose(1, 2)
    kh = kf.transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vh = vf.transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(l == 0, torch.ones_like(l), l)
    out = torch.matmul(p, vh).transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), dout.float())
    return dq, dk, dv


def forward_and_preprocess(q, k, v, dout, scale, causal):
    """out, lse from flashtile's forward; lse_log2, delta from flashtile's preprocess kernel."""
    from flashtile.kernels.launch import ScoreParams, attention_forward, launch_preprocess, row_stats_buffers
    b, sq, h, d = q.shape
    out = torch.empty((b, sq, h, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, h, sq), device=q.device, dtype=torch.float32)
    params = ScoreParams(softmax_scale=scale, window_right=0 if causal else -1)
    attention_forward(q, k, v, out, lse, params)
    delta, lse_log2 = row_stats_buffers(lse)

    def preprocess():
        launch_preprocess(out, dout, lse, delta, lse_log2)
    preprocess()
    return out, lse, lse_log2, delta, preprocess


def rel_err(g, ref):
    g = g.float()
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    rn = ref.norm().item()
    diff = (g - ref).norm().item()
    return diff / rn if rn > 1e-6 else diff


def flashtile_grads(q, k, v, dout, scale, causal):
    """flashtile's portable Triton backward (the Gluon one turned off: the configs may route
    these shapes to the kernel under test)."""
    from flashtile import flash_attn_func
    from flashtile.configs import override
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(qq, kk, vv, softmax_scale=scale, causal=causal)
    with override(bwd_gluon=None):
        return torch.autograd.grad(out, (qq, kk, vv), dout)


def find_config(spec):
    d, name = spec.split(":")
    return int(d), name, gb.CANDIDATES[int(d)][name]


# ----------------------------------------------------------------------------------------------
# Correctness (child)
# ----------------------------------------------------------------------------------------------

# (name, b, sq, sk, h, hk, causal, layout, scale override)
CASES = [
    ("s128", 2, 128, 128, 4, 4, False, "plain", None),
    ("s128_causal", 2, 128, 128, 4, 4, True, "plain", None),
    ("s1", 1, 1, 1, 2, 2, False, "plain", None),
    ("s1_causal", 1, 1, 1, 2, 2, True, "plain", None),
    ("s113", 2, 113, 113, 4, 4, False, "plain", None),
    ("s113_causal", 2, 113, 113, 4, 4, True, "plain", None),
    ("s1023", 2, 1023, 1023, 4, 4, False, "plain", None),
    ("s1023_causal", 2, 1023, 1023, 4, 4, True, "plain", None),
    ("q113_k203", 2, 113, 203, 4, 4, False, "plain", None),
    ("q113_k203_causal", 2, 113, 203, 4, 4, True, "plain", None),
    ("q300_k100", 2, 300, 100, 4, 4, False, "plain", None),
    ("q300_k100_causal", 2, 300, 100, 4, 4, True, "plain", None),
    ("q1_k1000_causal", 2, 1, 1000, 4, 4, True, "plain", None),
    ("q1000_k1_causal", 2, 1000, 1, 4, 4, True, "plain", None),
    ("gqa_h8_hk2", 2, 257, 257, 8, 2, False, "plain", None),
    ("gqa_h8_hk2_causal", 2, 257, 333, 8, 2, True, "plain", None),
    ("packed_qkv", 2, 256, 256, 4, 4, False, "packed", None),
    ("packed_qkv_causal", 2, 200, 200, 4, 4, True, "packed", None),
    ("neg_scale", 2, 113, 203, 4, 4, False, "plain", -0.1),
    ("s2048_causal", 1, 2048, 2048, 2, 2, True, "plain", None),
    # Shapes supported() takes (seqlen_q % 4 == 0) with ragged blocks, GQA and batch > 1.
    ("q1000_k777", 2, 1000, 777, 4, 4, False, "plain", None),
    ("q1000_k777_causal", 2, 1000, 777, 4, 4, True, "plain", None),
    ("q776_k1001_causal", 2, 776, 1001, 4, 4, True, "plain", None),
    ("gqa_h8_hk2_q256_k320", 2, 256, 320, 8, 2, False, "plain", None),
    ("gqa_h8_hk2_q1000_k777_causal", 2, 1000, 777, 8, 2, True, "plain", None),
    ("gqa_h6_hk1_q512_causal", 3, 512, 512, 6, 1, True, "plain", None),
]
QUICK = {"s128", "s113_causal", "q113_k203_causal", "q300_k100_causal", "gqa_h8_hk2_causal",
         "packed_qkv_causal", "q1000_k777_causal", "gqa_h8_hk2_q1000_k777_causal"}
TOL = {"bfloat16": 1.5e-2, "float16": 3e-3}


def make_inputs(b, sq, sk, h, hk, d, dtype, layout):
    dev = "cuda"
    if layout == "packed":  # q, k, v and dq, dk, dv as views of (b, s, 3, h, d) tensors
        qkv = torch.randn(b, sq, 3, h, d, device=dev, dtype=dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        dqkv = torch.full((b, sq, 3, h, d), float("nan"), device=dev, dtype=dtype)
        dq, dk, dv = dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2]
    else:
        q = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
        v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
        dq = torch.full((b, sq, h, d), float("nan"), device=dev, dtype=dtype)
        dk = torch.full((b, sk, hk, d), float("nan"), device=dev, dtype=dtype)
        dv = torch.full((b, sk, hk, d), float("nan"), device=dev, dtype=dtype)
    dout = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
    return q, k, v, dout, dq, dk, dv


def child_check(spec, quick, out_dir, dtypes=None, compare_flashtile=True):
    """Check one candidate on CASES (QUICK only with quick), bf16 and fp16 unless dtypes says
    otherwise; compare_flashtile also reports flashtile's portable backward's errors."""
    _imports()
    d, name, cfg = find_config(spec)
    results = []
    all_ok = True
    for dtype in dtypes or (torch.bfloat16, torch.float16):
        dname = str(dtype).split(".")[-1]
        for case in CASES:
            cname, b, sq, sk, h, hk, causal, layout, scale = case
            if quick and cname not in QUICK:
                continue
            if os.environ.get("PROBE_CASE") and cname != os.environ["PROBE_CASE"]:
                continue
            scale = scale if scale is not None else 1.0 / math.sqrt(d)
            tag = f"d{d} {name} {dname} {cname}"
            log(f"[check] {tag} ...")
            rec = {"variant": spec, "dtype": dname, "case": cname}
            try:
                torch.manual_seed(zlib.crc32(cname.encode()) % 1000)
                q, k, v, dout, dq, dk, dv = make_inputs(b, sq, sk, h, hk, d, dtype, layout)
                if not gb.supported(q, k, v, causal) or not gb.grads_supported(dout, dq, dk, dv):
                    rec["status"] = "unsupported"
                    results.append(rec)
                    log(f"[check] {tag}: unsupported")
                    continue
                _, _, lse_log2, delta, _ = forward_and_preprocess(q, k, v, dout, scale, causal)
                gb.gluon_attention_backward(q, k, v, dout, lse_log2, delta, dq, dk, dv, scale, causal, config=cfg)
                torch.cuda.synchronize()
                rq, rk, rv = reference_grads(q, k, v, dout, scale, causal)
                errs = {"dq": rel_err(dq, rq), "dk": rel_err(dk, rk), "dv": rel_err(dv, rv)}
                ft = {}
                try:
                    if compare_flashtile:
                        fq, fk, fv = flashtile_grads(q, k, v, dout, scale, causal)
                        ft = {"dq": rel_err(fq, rq), "dk": rel_err(fk, rk), "dv": rel_err(fv, rv)}
                except Exception as e:  # the reference point only
                    ft = {"error": str(e)[:200]}
                ok = all(e < TOL[dname] for e in errs.values())
                all_ok &= ok
                rec.update(status="PASS" if ok else "FAIL", gluon=errs, flashtile=ft)
                fmt = lambda m: " ".join(f"{k}={v:.2e}" for k, v in m.items() if isinstance(v, float))  # noqa: E731
                log(f"[check] {tag}: {rec['status']}  gluon {fmt(errs)} | triton {fmt(ft)}")
            except Exception as e:
                all_ok = False
                rec.update(status="ERROR", error=traceback.format_exc()[-1500:])
                log(f"[check] {tag}: ERROR {str(e)[:300]}")
            results.append(rec)
    with open(os.path.join(out_dir, f"check_{spec.replace(':', '_')}.json"), "w") as f:
        json.dump({"variant": spec, "all_ok": all_ok, "cases": results}, f, indent=1)


# ----------------------------------------------------------------------------------------------
# Timing (children)
# ----------------------------------------------------------------------------------------------

SEQLENS = (1024, 4096, 16384)


def warm_up_gpu(seconds=1.0):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def bwd_tflops(b, h, s, d, causal, ms):
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    return flops / (ms * 1e-3) / 1e12


def timing_inputs(d, s, causal):
    dtype = torch.bfloat16
    h = 2048 // d
    b = max(16384 // s, 1)
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    return b, h, q, k, v, dout


def child_time_baselines(head_dims, out_dir):
    _imports()
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from flashtile import flash_attn_func
    from flashtile.configs import override
    warm_up_gpu()
    rows = []
    for d in head_dims:
        for s in SEQLENS:
            for causal in (False, True):
                b, h, q, k, v, dout = timing_inputs(d, s, causal)
                rec = {"d": d, "seqlen": s, "causal": causal, "batch": b, "nheads": h}
                scale = 1.0 / math.sqrt(d)
                try:
                    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                        dot = dout.transpose(1, 2)
                        ms = do_bench(lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True),
                                      warmup=25, rep=100)
                    rec["cudnn_ms"] = ms
                    rec["cudnn_tflops"] = bwd_tflops(b, h, s, d, causal, ms)
                    del out
                except Exception as e:
                    rec["cudnn_error"] = str(e)[:300]
                try:
                    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                    out = flash_attn_func(qq, kk, vv, softmax_scale=scale, causal=causal)
                    with override(bwd_gluon=None):  # the portable Triton backward
                        ms = do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True),
                                      warmup=25, rep=100)
                    rec["flashtile_ms"] = ms
                    rec["flashtile_tflops"] = bwd_tflops(b, h, s, d, causal, ms)
                    del out
                except Exception as e:
                    rec["flashtile_error"] = str(e)[:300]
                log(f"[base] d{d} s{s} causal={causal}: cudnn {rec.get('cudnn_tflops', float('nan')):.0f} "
                    f"flashtile {rec.get('flashtile_tflops', float('nan')):.0f} TFLOP/s")
                rows.append(rec)
                torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "time_baselines.json"), "w") as f:
        json.dump(rows, f, indent=1)


def child_time_variant(spec, out_dir):
    _imports()
    from triton.testing import do_bench
    d, name, cfg = find_config(spec)
    warm_up_gpu()
    rows = []
    facts = None
    for s in SEQLENS:
        for causal in (False, True):
            b, h, q, k, v, dout = timing_inputs(d, s, causal)
            scale = 1.0 / math.sqrt(d)
            rec = {"variant": spec, "d": d, "seqlen": s, "causal": causal, "batch": b, "nheads": h}
            log(f"[time] {spec} s{s} causal={causal} ...")
            try:
                _, _, lse_log2, delta, preprocess = forward_and_preprocess(q, k, v, dout, scale, causal)
                dq = torch.full_like(q, float("nan"))
                dk = torch.full_like(k, float("nan"))
                dv = torch.full_like(v, float("nan"))
                launch = gb.make_launcher(q, k, v, dout, lse_log2, delta, dq, dk, dv, scale, causal, cfg)
                ck = launch()
                torch.cuda.synchronize()
                if facts is None:
                    try:
                        facts = {"n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None),
                                 "shared": getattr(ck.metadata, "shared", None)}
                    except Exception as e:
                        facts = {"error": str(e)[:200]}
                fq, fk, fv = flashtile_grads(q, k, v, dout, scale, causal)
                errs = {"dq": rel_err(dq, fq.float()), "dk": rel_err(dk, fk.float()), "dv": rel_err(dv, fv.float())}
                rec["vs_flashtile"] = errs
                del fq, fk, fv
                if not all(e < 2e-2 for e in errs.values()):
                    rec["status"] = "MISMATCH"
                    log(f"[time] {spec} s{s} causal={causal}: grads differ from flashtile's {errs}")
                    rows.append(rec)
                    continue

                def run():
                    preprocess()
                    launch()
                ms = do_bench(run, warmup=25, rep=100)
                rec.update(status="ok", ms=ms, tflops=bwd_tflops(b, h, s, d, causal, ms))
                # The kernel alone (no preprocess, no accumulator zeroing / convert) for reference.
                log(f"[time] {spec} s{s} causal={causal}: {ms:.3f} ms  {rec['tflops']:.0f} TFLOP/s  "
                    f"(vs flashtile rel dq {errs['dq']:.1e} dk {errs['dk']:.1e} dv {errs['dv']:.1e})")
            except Exception as e:
                rec.update(status="ERROR", error=traceback.format_exc()[-1500:])
                log(f"[time] {spec} s{s} causal={causal}: ERROR {str(e)[:300]}")
            rows.append(rec)
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, f"time_{spec.replace(':', '_')}.json"), "w") as f:
        json.dump({"variant": spec, "facts": facts, "rows": rows}, f, indent=1)


# ----------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------

def run_child(args, out_dir, timeout):
    timeout = max(5, min(timeout, TIME_BUDGET_S - elapsed()))
    return run_script(__file__, ["--out", out_dir] + args, timeout, "child")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="fewer correctness cases")
    ap.add_argument("--variants", default="", help="comma list of d:name (default: all candidates)")
    ap.add_argument("--child", default="")
    ap.add_argument("--spec", default="")
    ap.add_argument("--head-dims", default="", help="comma list: only the candidates of these head dims")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.child == "check":
        return child_check(args.spec, args.quick, args.out)
    if args.child == "time":
        return child_time_variant(args.spec, args.out)
    if args.child == "base":
        return child_time_baselines([int(x) for x in args.head_dims.split(",")], args.out)

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from flashtile.kernels import gluon_backward as gbk
    specs = [f"{d}:{n}" for d, c in gbk.CANDIDATES.items() for n in c]
    if args.variants:
        specs = [s for s in args.variants.split(",") if s]
    if args.head_dims:
        wanted = {int(x) for x in args.head_dims.split(",") if x}
        specs = [s for s in specs if int(s.split(":")[0]) in wanted]
    head_dims = sorted({int(s.split(":")[0]) for s in specs})
    summary = {"variants": specs, "checks": {}, "timings": {}, "baselines": None, "child_status": {}}

    # Each variant is checked (its own process) and, when it passes, timed right away, so a
    # variant that deadlocks or fails late in the list costs only its own timeouts. The baselines
    # run once, before the first timing. The first variant of each head dim gets every
    # correctness case; later ones (small departures from it) the --quick set.
    passed = []
    first_of_dim = {}
    for spec in specs:
        d = int(spec.split(":")[0])
        quick = args.quick or first_of_dim.setdefault(d, spec) != spec
        rc = run_child(["--child", "check", "--spec", spec] + (["--quick"] if quick else []), args.out,
                       120 if quick else 200)
        res = load_json(os.path.join(args.out, f"check_{spec.replace(':', '_')}.json"))
        summary["checks"][spec] = res
        summary["child_status"][f"check {spec}"] = rc
        if res and res["all_ok"] and rc == 0:
            passed.append(spec)
        log(f"== {spec}: {'PASS' if spec in passed else 'FAIL'}")
        if spec not in passed:
            continue
        if summary["baselines"] is None and "baselines" not in summary["child_status"]:
            rc = run_child(["--child", "base", "--head-dims", ",".join(map(str, head_dims))], args.out, 120)
            summary["child_status"]["baselines"] = rc
            summary["baselines"] = load_json(os.path.join(args.out, "time_baselines.json"))
        if elapsed() > TIME_BUDGET_S - 20:
            log(f"time budget reached; not timing {spec}")
            continue
        rc = run_child(["--child", "time", "--spec", spec], args.out, 120)
        summary["child_status"][f"time {spec}"] = rc
        summary["timings"][spec] = load_json(os.path.join(args.out, f"time_{spec.replace(':', '_')}.json"))
    if "baselines" not in summary["child_status"] and elapsed() < TIME_BUDGET_S - 20:
        rc = run_child(["--child", "base", "--head-dims", ",".join(map(str, head_dims))], args.out, 120)
        summary["child_status"]["baselines"] = rc
        summary["baselines"] = load_json(os.path.join(args.out, "time_baselines.json"))

    with open(os.path.join(args.out, "gluon_bwd_probe.json"), "w") as f:
        json.dump(summary, f, indent=1)

    # 3. Table.
    log("\n== correctness")
    for spec in specs:
        res = summary["checks"].get(spec)
        if not res:
            log(f"  {spec}: no result")
            continue
        bad = [f"{c['dtype']}/{c['case']}:{c['status']}" for c in res["cases"] if c["status"] not in ("PASS",)]
        worst = max((max(c["gluon"].values()) for c in res["cases"] if "gluon" in c), default=float("nan"))
        log(f"  {spec}: {'PASS' if res['all_ok'] else 'FAIL'} worst rel {worst:.2e} {' '.join(bad[:8])}")
    base = {(r["d"], r["seqlen"], r["causal"]): r for r in (summary["baselines"] or [])}
    log("\n== backward TFLOP/s (bf16, 16k tokens, hidden 2048; gluon includes preprocess + dQ convert)")
    hdr = f"{'d':>4} {'seqlen':>6} {'causal':>6} {'cudnn':>6} {'triton':>6} " + " ".join(f"{s:>12}" for s in passed)
    log(hdr)
    for d in head_dims:
        for s in SEQLENS:
            for causal in (False, True):
                r = base.get((d, s, causal), {})
                cells = []
                for spec in passed:
                    if int(spec.split(":")[0]) != d:
                        cells.append(f"{'':>12}")
                        continue
                    t = summary["timings"].get(spec) or {"rows": []}
                    row = next((x for x in t["rows"] if x["seqlen"] == s and x["causal"] == causal), None)
                    cells.append(f"{row['tflops']:>12.0f}" if row and "tflops" in row else f"{'-':>12}")
                log(f"{d:>4} {s:>6} {str(causal):>6} {r.get('cudnn_tflops', float('nan')):>6.0f} "
                    f"{r.get('flashtile_tflops', float('nan')):>6.0f} " + " ".join(cells))
    for spec in passed:
        t = summary["timings"].get(spec)
        if t:
            log(f"  {spec} kernel facts: {t.get('facts')}")
    log(f"total {elapsed():.0f}s")


if __name__ == "__main__":
    main()
