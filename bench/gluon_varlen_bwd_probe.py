"""GPU check + timing of the varlen (packed) mode of the Gluon Hopper backward
(flashtile/kernels/gluon_backward.py, IS_VARLEN).

    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; python bench/gluon_varlen_bwd_probe.py --out $OUT

Every piece runs in its own child process with a timeout (a deadlocked kernel costs only that
piece); the whole run stays under 8 minutes:
  check_d128 / check_d64 / check_d256: varlen dq, dk, dv against a per-sequence float32 autograd
      reference. Lengths include 0, 1, 63, 64, 65, 127, 129, 1000 (queries and keys, with
      seqlen_q != seqlen_k per sequence, sequences with no query or no key), GQA, causal and not,
      bf16 and fp16, seqused_q (called on the kernel directly: the library routes it to the portable
      backward). dq, dk, dv are NaN-poisoned and carry guard rows past the packed totals (inside the
      TMA descriptors' bounds): they must still be NaN afterwards. Exact zeros are checked where the
      gradient is 0 by construction (keys of a sequence without queries, queries of one without keys,
      rows past seqused_q). One case goes through flash_attn_varlen_func and must reach the Gluon
      backward (counted) and agree with the portable one.
  dense: bench/gluon_bwd_probe.py's check (quick case set, bf16) on the default config of each head dim.
  timing: d128, hidden 2048, 16k tokens from lengths drawn in [64, 4096] (fixed seed, the last one
      trimmed to make 16384), causal and not: the varlen Gluon backward vs the dense Gluon backward on
      the zero-padded batch and vs the portable varlen backward (override(bwd_gluon=None)); each
      through attention_backward (preprocess included), TFLOP/s on real tokens (2.5 x the forward's
      sum over sequences of 4 h sq sk d, halved for causal); plus the Gluon kernels alone (make_launcher:
      accumulator zeroing, kernel, dQ convert) and equal lengths 4 x 4096 (the cost of varlen itself).
Writes $OUT/gluon_varlen_bwd_probe.json (and one JSON per piece); prints a short table last.
"""

import json
import math
import os
import random
import time

import traceback

from probe_pieces import log, main_with_pieces

TOTAL_BUDGET_S = 7 * 60 + 30
PIECES = [  # (name, timeout seconds); the budget skips what no longer fits
    ("check_d128", 110),
    ("timing", 100),
    ("check_d256", 90),
    ("check_d64", 90),
    ("dense", 90),
]
DEFAULT_SPECS = {64: "64:m128_s2", 128: "128:m64_s2", 256: "256:m64_s2"}
TOL = {"bf16": 1.5e-2, "fp16": 3e-3}
GUARD_ROWS = 50  # rows past the packed totals in q, k, v, dout, dq, dk, dv




def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

# (name, lens_q, lens_k, h, hk, used_q, via_api, dtypes)
A_Q = [0, 1, 63, 64, 65, 127, 129, 1000, 7, 200, 64]
A_K = [5, 1, 64, 63, 200, 129, 127, 1000, 0, 33, 65]
B_QK = [1000, 65, 0, 64, 1, 63, 129, 127, 300]
CASES = [
    ("mixed_gqa", A_Q, A_K, 8, 2, None, False, ("bf16", "fp16")),
    ("self_mha", B_QK, B_QK, 4, 4, None, False, ("bf16", "fp16")),
    ("seqused_q", [70, 200, 64, 0, 130, 65, 129], [100, 64, 300, 10, 129, 65, 127], 4, 2,
     [65, 0, 64, 0, 1, 64, 128], False, ("bf16",)),
    ("api_gqa", [129, 1, 1000, 0, 65], [127, 64, 1000, 3, 0], 4, 2, None, True, ("bf16",)),
]


def forward_and_stats(q, k, v, dout, lens_q, lens_k, used_q, scale, causal):
    """out, lse (1, h, rows) from flashtile's forward over the packed rows; lse_log2, delta from its
    preprocess (row_stats_buffers over all rows, so the buffers match q's row count)."""
    import torch
    from flashtile.kernels.launch import (PackedSeqs, ScoreParams, attention_forward, launch_preprocess,
                                          row_stats_buffers)

    rows_q, h, d = q.shape
    nq, nk = sum(lens_q), sum(lens_k)
    dev = q.device
    t = lambda xs: torch.tensor(xs, device=dev, dtype=torch.int32)  # noqa: E731
    seqs = PackedSeqs(t(_cu(lens_q)), t(_cu(lens_k)), max(lens_q), max(lens_k),
                      None if used_q is None else t(used_q))
    out = torch.zeros(1, rows_q, h, d, device=dev, dtype=q.dtype)
    lse = torch.full((1, h, rows_q), float("-inf"), device=dev, dtype=torch.float32)
    params = ScoreParams(softmax_scale=scale, window_right=0 if causal else -1)
    attention_forward(q[None, :nq], k[None, :nk], v[None, :nk], out[:, :nq], lse[:, :, :nq], params, seqs)
    delta, lse_log2 = row_stats_buffers(lse)
    launch_preprocess(out, dout[None], lse, delta, lse_log2, seqs, 64)
    return out, lse, lse_log2, delta, seqs, params


def varlen_reference(q, k, v, dout, lens_q, lens_k, used_q, scale, causal):
    """float32 dq (rows_q, h, d), dk, dv (rows_k, hk, d) per sequence; 0 elsewhere."""
    import torch
    import gluon_bwd_probe
    gluon_bwd_probe._imports()  # its helpers read torch from module globals
    reference_grads = gluon_bwd_probe.reference_grads

    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=q.device, dtype=torch.float32)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    for b in range(len(lens_q)):
        uq = lens_q[b] if used_q is None else used_q[b]
        nk = lens_k[b]
        if uq == 0 or nk == 0:
            continue
        qs, ks = slice(cu_q[b], cu_q[b] + uq), slice(cu_k[b], cu_k[b] + nk)
        gq, gk, gv = reference_grads(q[qs][None], k[ks][None], v[ks][None], dout[qs][None], scale, causal)
        dq[qs], dk[ks], dv[ks] = gq[0], gk[0], gv[0]
    return dq, dk, dv


def compare(name, got, ref, cu, tol):
    """Global relative error, and the worst sequence's error relative to the larger of its own
    reference norm and its share (by rows) of the whole one, so near-zero references (a 1-key
    sequence's dq) pass while a wrong sequence does not."""
    import torch

    g = got.float()
    finite = bool(torch.isfinite(g).all())
    total = ref.norm().item()
    rel = (g - ref).norm().item() / max(total, 1e-6) if finite else float("inf")
    worst, worst_b = 0.0, None
    n = cu[-1]
    for b in range(len(cu) - 1):
        rows = slice(cu[b], cu[b + 1])
        if cu[b + 1] == cu[b]:
            continue
        share = total * math.sqrt((cu[b + 1] - cu[b]) / max(n, 1))
        err = (g[rows] - ref[rows]).norm().item() / max(ref[rows].norm().item(), share, 1e-6)
        if not math.isfinite(err) or err > worst:
            worst, worst_b = err, b
    ok = finite and rel < tol and worst < 2 * tol
    return ok, {f"{name}_rel": rel, f"{name}_worst_seq_rel": worst, f"{name}_worst_seq": worst_b,
                f"{name}_finite": finite}


def check_case(d, cfg, case, causal, dt, seed, calls):
    import torch
    from flashtile.kernels import gluon_backward as gb

    name, lens_q, lens_k, h, hk, used_q, via_api, _ = case
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    scale = 1.0 / math.sqrt(d)
    torch.manual_seed(seed)
    nq, nk = sum(lens_q), sum(lens_k)
    rows_q, rows_k = nq + GUARD_ROWS, nk + GUARD_ROWS
    q = torch.randn(rows_q, h, d, device="cuda", dtype=dtype)
    k = torch.randn(rows_k, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(rows_k, hk, d, device="cuda", dtype=dtype)
    dout = torch.randn(rows_q, h, d, device="cuda", dtype=dtype)
    rec = {}
    if via_api:
        from flashtile import flash_attn_varlen_func
        from flashtile.configs import override

        t = lambda xs: torch.tensor(xs, device="cuda", dtype=torch.int32)  # noqa: E731
        qa, ka, va = (x.detach().clone().requires_grad_() for x in (q[:nq], k[:nk], v[:nk]))
        args = (t(_cu(lens_q)), t(_cu(lens_k)), max(lens_q), max(lens_k))
        before = calls[0]
        out = flash_attn_varlen_func(qa, ka, va, *args, softmax_scale=scale, causal=causal)
        dq, dk, dv = torch.autograd.grad(out, (qa, ka, va), dout[:nq])
        rec["gluon_calls"] = calls[0] - before
        with override(bwd_gluon=None):
            out = flash_attn_varlen_func(qa, ka, va, *args, softmax_scale=scale, causal=causal)
            pq, pk, pv = torch.autograd.grad(out, (qa, ka, va), dout[:nq])
        for nm, g, p in (("dq", dq, pq), ("dk", dk, pk), ("dv", dv, pv)):
            rec[f"{nm}_vs_portable_rel"] = ((g.float() - p.float()).norm() / p.float().norm().clamp_min(1e-6)).item()
        guard_ok = True
    else:
        out, lse, lse_log2, delta, seqs, _ = forward_and_stats(q, k, v, dout, lens_q, lens_k, used_q, scale, causal)
        dq = torch.full((rows_q, h, d), float("nan"), device="cuda", dtype=dtype)
        dk = torch.full((rows_k, hk, d), float("nan"), device="cuda", dtype=dtype)
        dv = torch.full((rows_k, hk, d), float("nan"), device="cuda", dtype=dtype)
        gb.gluon_attention_backward(q[None], k[None], v[None], dout[None], lse_log2, delta, dq[None], dk[None],
                                    dv[None], scale, causal, cfg, cu_seqlens_q=seqs.cu_seqlens_q,
                                    cu_seqlens_k=seqs.cu_seqlens_k, seqused_q=seqs.seqused_q,
                                    max_seqlen_k=seqs.max_seqlen_k)
        torch.cuda.synchronize()
        guard_ok = all(bool(torch.isnan(x[n:]).all()) for x, n in ((dq, nq), (dk, nk), (dv, nk)))
        dq, dk, dv = dq[:nq], dk[:nk], dv[:nk]
    rq, rk, rv = varlen_reference(q[:nq], k[:nk], v[:nk], dout[:nq], lens_q, lens_k, used_q, scale, causal)
    ok = guard_ok
    for nm, g, r, cu in (("dq", dq, rq, _cu(lens_q)), ("dk", dk, rk, _cu(lens_k)), ("dv", dv, rv, _cu(lens_k))):
        good, info = compare(nm, g, r, cu, TOL[dt])
        ok &= good
        rec.update(info)
    # Exact zeros: keys of sequences without (used) queries, queries of sequences without keys,
    # rows past seqused_q.
    zero_ok = True
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    for b in range(len(lens_q)):
        uq = lens_q[b] if used_q is None else used_q[b]
        if uq == 0:
            zero_ok &= bool((dk[cu_k[b]:cu_k[b + 1]] == 0).all()) and bool((dv[cu_k[b]:cu_k[b + 1]] == 0).all())
        if lens_k[b] == 0:
            zero_ok &= bool((dq[cu_q[b]:cu_q[b + 1]] == 0).all())
        zero_ok &= bool((dq[cu_q[b] + uq:cu_q[b + 1]] == 0).all())
    ok &= zero_ok
    if via_api:
        ok &= rec["gluon_calls"] == 1 and all(rec[f"{n}_vs_portable_rel"] < TOL[dt] for n in ("dq", "dk", "dv"))
    rec.update(guard_rows_untouched=guard_ok, exact_zeros=zero_ok, status="PASS" if ok else "FAIL")
    return ok, rec


def piece_check(d):
    import torch
    from flashtile.configs import BWD_GLUON, table_config
    from flashtile.kernels import gluon_backward as gb

    # Count the library's calls into the Gluon backward (the API case must reach it; varlen calls
    # set up their BackwardPlan on every call).
    calls = [0]

    class Counting(gb.BackwardPlan):
        def __init__(self, *a, **kw):
            calls[0] += 1
            super().__init__(*a, **kw)
    gb.BackwardPlan = Counting

    cfg = table_config(BWD_GLUON, "sm90", d, causal=False, seqlen_k=16384)
    results = []
    all_ok = True
    for case_idx, case in enumerate(CASES):
        for causal in (False, True):
            for dt in case[7]:
                tag = f"d{d} {case[0]:10s} causal={int(causal)} {dt}"
                rec = {"head_dim": d, "config": str(cfg), "case": case[0], "causal": causal, "dtype": dt}
                try:
                    ok, info = check_case(d, cfg, case, causal, dt, 1000 * d + 10 * case_idx + causal, calls)
                    rec.update(info)
                    log(f"{tag} " + " ".join(f"{k}={v:.2e}" for k, v in info.items()
                                               if isinstance(v, float) and ("rel" in k))
                        + f" guard={info['guard_rows_untouched']} zeros={info['exact_zeros']}"
                        + (f" gluon_calls={info['gluon_calls']}" if "gluon_calls" in info else "")
                        + f" {info['status']}")
                except Exception as e:
                    ok = False
                    rec.update(status="ERROR", error=traceback.format_exc()[-1500:])
                    log(f"{tag} ERROR {type(e).__name__}: {str(e)[:400]}")
                    torch.cuda.synchronize()
                all_ok &= ok
                results.append(rec)
    return {"ok": all_ok, "results": results}


def piece_dense(out_dir):
    import gluon_bwd_probe as bp

    bp._imports()
    results = []
    ok = True
    for d, spec in DEFAULT_SPECS.items():
        # bf16 only, without the portable backward alongside: the dense kernels compile to the same
        # code as before (bench/gluon_bwd_compile_check.py); this checks the host side around them.
        bp.child_check(spec, True, out_dir, dtypes=(bp.torch.bfloat16,), compare_flashtile=False)
        with open(os.path.join(out_dir, f"check_{spec.replace(':', '_')}.json")) as f:
            res = json.load(f)
        ok &= res["all_ok"]
        for c in res["cases"]:
            results.append(dict(c, head_dim=d))
    return {"ok": ok, "results": results}


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def _draw_lengths(total, lo, hi, seed):
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(min(rng.randint(lo, hi), total - sum(lens)))
    return lens


def _bwd_flops(lens, h, d, causal):
    return 2.5 * sum(4 * h * s * s * d for s in lens) / (2 if causal else 1)


def piece_timing():
    import torch
    from triton.testing import do_bench
    from flashtile.configs import BWD_GLUON, override, table_config
    from flashtile.kernels import gluon_backward as gb
    from flashtile.kernels.launch import PackedSeqs, ScoreParams, attention_backward, attention_forward
    from flashtile.kernels.launch import row_stats_buffers, launch_preprocess

    dtype = torch.bfloat16
    d, h = 128, 2048 // 128
    scale = 1.0 / math.sqrt(d)
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)  # warm the clocks up
    t0 = time.time()
    while time.time() - t0 < 1.0:
        a @ a
        torch.cuda.synchronize()
    del a

    rows = []
    setups = [("random[64,4096]", _draw_lengths(16384, 64, 4096, seed=0)), ("equal 4x4096", [4096] * 4)]
    for label, lens in setups:
        n, total, smax = len(lens), sum(lens), max(lens)
        cu_list = _cu(lens)
        cu = torch.tensor(cu_list, device="cuda", dtype=torch.int32)
        seqs = PackedSeqs(cu, cu, smax, smax)
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(1, total, h, d, device="cuda", dtype=dtype) for _ in range(4))
        # The same tokens, zero-padded to (n, smax).
        pad = lambda x: torch.zeros(n, smax, h, d, device="cuda", dtype=dtype)  # noqa: E731
        qp, kp, vp, doutp = pad(q), pad(k), pad(v), pad(dout)
        for b, (s0, s1) in enumerate(zip(cu_list[:-1], cu_list[1:])):
            for xp, x in ((qp, q), (kp, k), (vp, v), (doutp, dout)):
                xp[b, :s1 - s0] = x[0, s0:s1]
        for causal in (False, True):
            params = ScoreParams(softmax_scale=scale, window_right=0 if causal else -1)
            cfg = table_config(BWD_GLUON, "sm90", d, causal=causal, seqlen_k=smax, dtype=dtype)
            row = {"setup": label, "lengths": lens, "causal": causal, "config": str(cfg)}
            flops = _bwd_flops(lens, h, d, causal)
            try:
                out = torch.empty_like(q)
                lse = torch.empty(1, h, total, device="cuda", dtype=torch.float32)
                attention_forward(q, k, v, out, lse, params, seqs)
                outp = torch.empty_like(qp)
                lsep = torch.empty(n, h, smax, device="cuda", dtype=torch.float32)
                attention_forward(qp, kp, vp, outp, lsep, params)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                dqp, dkp, dvp = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)

                def varlen_gluon():
                    attention_backward(q, k, v, out, dout, lse, dq, dk, dv, params, seqs=seqs)

                def dense_gluon():
                    attention_backward(qp, kp, vp, outp, doutp, lsep, dqp, dkp, dvp, params)

                def varlen_portable():
                    with override(bwd_gluon=None):
                        attention_backward(q, k, v, out, dout, lse, dq, dk, dv, params, seqs=seqs)

                varlen_portable()
                ref = [x.float().clone() for x in (dq, dk, dv)]
                varlen_gluon()
                torch.cuda.synchronize()
                row["gluon_vs_portable_rel"] = max(((x.float() - r).norm() / r.norm()).item()
                                                   for x, r in zip((dq, dk, dv), ref))
                del ref
                ms = {"varlen_gluon": do_bench(varlen_gluon), "dense_gluon_padded": do_bench(dense_gluon),
                      "varlen_portable": do_bench(varlen_portable)}
                # The Gluon kernels alone (accumulator zeroing, kernel, convert), no preprocess.
                delta, lse_log2 = row_stats_buffers(lse)
                launch_preprocess(out, dout, lse, delta, lse_log2, seqs, 64)
                deltap, lse_log2p = row_stats_buffers(lsep)
                launch_preprocess(outp, doutp, lsep, deltap, lse_log2p, None, 64)
                ms["varlen_kernel"] = do_bench(gb.make_launcher(
                    q, k, v, dout, lse_log2, delta, dq, dk, dv, scale, causal, cfg, cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_k=smax))
                ms["dense_kernel_padded"] = do_bench(gb.make_launcher(
                    qp, kp, vp, doutp, lse_log2p, deltap, dqp, dkp, dvp, scale, causal, cfg))
                row["ms"] = ms
                row["tflops"] = {k_: flops / (t * 1e-3) / 1e12 for k_, t in ms.items()}
                tf = row["tflops"]
                log(f"{label:16s} causal={int(causal)} TF/s: varlen gluon {tf['varlen_gluon']:.0f}  dense padded "
                    f"{tf['dense_gluon_padded']:.0f}  portable varlen {tf['varlen_portable']:.0f}  | kernels: varlen "
                    f"{tf['varlen_kernel']:.0f} dense padded {tf['dense_kernel_padded']:.0f}  "
                    f"(gluon vs portable rel {row['gluon_vs_portable_rel']:.1e})")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:1000]
                log(f"{label} causal={int(causal)} ERROR {row['error'][:300]}")
                traceback.print_exc(limit=4)
            rows.append(row)
            torch.cuda.empty_cache()
    return {"ok": all("error" not in r for r in rows), "rows": rows}


def run_piece(name, out_dir):
    import torch
    import triton

    log(f"[{name}] torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    if name.startswith("check_d"):
        return piece_check(int(name[len("check_d"):]))
    if name == "dense":
        return piece_dense(out_dir)
    return piece_timing()


# ----------------------------------------------------------------------------------------------
# Parent: run the pieces, aggregate, print the table
# ----------------------------------------------------------------------------------------------

def summary_table(report):
    lines = ["piece          status    pass/total   seconds"]
    for name, _ in PIECES:
        p = report["pieces"].get(name, {})
        res = p.get("results") or []
        n_pass = sum(1 for r in res if r.get("status") == "PASS")
        counts = f"{n_pass}/{len(res)}" if res else "-"
        lines.append(f"{name:14s} {p.get('status', 'not run'):9s} {counts:>10s}   {p.get('seconds', 0):7.1f}")
        bad = [f"d{r.get('head_dim')} {r.get('case')} c{int(bool(r.get('causal')))} {r.get('dtype')}: "
               f"{r.get('status')}" for r in res if r.get("status") not in ("PASS", "unsupported")]
        lines += [f"    {b}" for b in bad[:6]]
    timing = report["pieces"].get("timing", {}).get("rows") or []
    if timing:
        lines.append("")
        lines.append("d128 h16 bf16 backward, TFLOP/s on real tokens (preprocess included; kernel = Gluon kernel + "
                     "dQ convert only)")
        lines.append(f"  {'setup':16s} {'causal':>6} {'varlen':>7} {'dense pad':>9} {'portable':>8} "
                     f"{'v/dense':>7} {'v/port':>6} {'kern v':>6} {'kern d':>6}")
        for r in timing:
            if "error" in r:
                lines.append(f"  {r['setup']:16s} {int(r['causal']):>6}  ERROR")
                continue
            tf = r["tflops"]
            lines.append(f"  {r['setup']:16s} {int(r['causal']):>6} {tf['varlen_gluon']:7.0f} "
                         f"{tf['dense_gluon_padded']:9.0f} {tf['varlen_portable']:8.0f} "
                         f"{tf['varlen_gluon'] / tf['dense_gluon_padded']:7.2f} "
                         f"{tf['varlen_gluon'] / tf['varlen_portable']:6.2f} {tf['varlen_kernel']:6.0f} "
                         f"{tf['dense_kernel_padded']:6.0f}")
    return "\n".join(lines)


def main():
    main_with_pieces(__file__, "varlen_bwd_probe", PIECES, TOTAL_BUDGET_S, run_piece, summary_table)


if __name__ == "__main__":
    main()
