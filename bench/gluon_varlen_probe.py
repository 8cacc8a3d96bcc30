"""GPU check + timing of the varlen (packed) mode of the Gluon Hopper forward
(flashtile/kernels/gluon_forward.py, IS_VARLEN).

    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; python bench/gluon_varlen_probe.py --out $OUT

Every piece runs in its own child process with a timeout (a deadlocked kernel costs only that
piece), the whole run stays under 8 minutes:
  check_d128 / check_d64 / check_d256: varlen against a per-sequence float32 reference. Lengths
      include 0, 1, 63, 64, 65, 1000, seqlen_q != seqlen_k per sequence, GQA, causal and not,
      bf16 and fp16, seqused_q / seqused_k (rows past seqused_q: out 0, lse -inf; their queries
      are NaN to prove it is a select), a grid larger than needed. out / lse are NaN-poisoned and
      the tensors carry guard rows past the last sequence (inside the TMA descriptors' bounds): a
      store past a sequence's end would write them, so they must still be NaN afterwards.
  dense: the dense path (unchanged code) on bench/gluon_fwd_probe.py's full case list.
  candidates: one varlen case on every candidate config of gluon_forward.CANDIDATES.
  timing: d128, hidden 2048, 16k tokens from lengths drawn in [64, 4096] (fixed seed, the last
      one trimmed to make 16384), causal and not: varlen vs the dense kernel on the zero-padded
      batch, TFLOP/s counted on real tokens (sum over sequences of 4 h sq sk d, halved for causal);
      plus equal lengths (varlen vs dense on the same work: the cost of varlen itself).
Writes $OUT/gluon_varlen_probe.json (and one JSON per piece); prints a short table last.
"""

import math
import random
import time

import traceback

from probe_pieces import log, main_with_pieces

TOTAL_BUDGET_S = 7 * 60 + 30
DEVICE = "cuda"
PIECES = [  # (name, timeout seconds)
    ("check_d128", 110),
    ("check_d64", 80),
    ("check_d256", 80),
    ("dense", 90),
    ("timing", 100),
    ("candidates", 60),
]




# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

GUARD_ROWS = 50  # rows past the last sequence in q/k/v/out (and lse columns)


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def make_varlen(lens_q, lens_k, h, hk, d, dtype, used_q=None, used_k=None, seed=0):
    """Packed tensors as the kernel takes them (batch-1 views) plus what the check needs."""
    import torch

    torch.manual_seed(seed)
    dev = DEVICE
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    rows_q, rows_k = cu_q[-1] + GUARD_ROWS, cu_k[-1] + GUARD_ROWS
    q = torch.randn(rows_q, h, d, device=dev, dtype=dtype)
    k = torch.randn(rows_k, hk, d, device=dev, dtype=dtype)
    v = torch.randn(rows_k, hk, d, device=dev, dtype=dtype)
    if used_q is not None:
        for b, (n, u) in enumerate(zip(lens_q, used_q)):
            q[cu_q[b] + u:cu_q[b] + n] = float("nan")  # unused rows: must not leak into anything
    if used_k is not None:
        for b, (n, u) in enumerate(zip(lens_k, used_k)):
            k[cu_k[b] + u:cu_k[b] + n] = 30.0  # unused keys: would dominate if not masked
    out = torch.full((rows_q, h, d), float("nan"), device=dev, dtype=dtype)
    # lse (h, rows_q) inside a wider buffer: a row stride that is not rows_q.
    lse_buf = torch.full((h, rows_q + 24), float("nan"), device=dev, dtype=torch.float32)
    lse = lse_buf[:, :rows_q]
    t = lambda xs: torch.tensor(xs, device=dev, dtype=torch.int32)
    args = dict(cu_seqlens_q=t(cu_q), cu_seqlens_k=t(cu_k),
                seqused_q=None if used_q is None else t(used_q),
                seqused_k=None if used_k is None else t(used_k),
                max_seqlen_q=max(lens_q) if lens_q else 0)
    return q, k, v, out, lse, lse_buf, args


def varlen_reference(q, k, v, lens_q, lens_k, used_q, used_k, scale, causal):
    """float32 out (rows_q, h, d) and lse (h, rows_q) over the sequences' rows; rows past
    seqused_q: out 0, lse -inf. Guard rows are left 0 / -inf (not compared)."""
    import torch
    from gluon_fwd_probe import reference

    rows_q, h, d = q.shape
    ref_out = torch.zeros(rows_q, h, d, device=q.device, dtype=torch.float32)
    ref_lse = torch.full((h, rows_q), float("-inf"), device=q.device, dtype=torch.float32)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    for b in range(len(lens_q)):
        uq = lens_q[b] if used_q is None else used_q[b]
        uk = lens_k[b] if used_k is None else used_k[b]
        if uq == 0 or uk == 0:
            continue  # no row, or rows that see no key (out 0, lse -inf)
        qs = q[cu_q[b]:cu_q[b] + uq][None]
        ks = k[cu_k[b]:cu_k[b] + uk][None]
        vs = v[cu_k[b]:cu_k[b] + uk][None]
        o, l = reference(qs, ks, vs, scale, causal)
        ref_out[cu_q[b]:cu_q[b] + uq] = o[0]
        ref_lse[:, cu_q[b]:cu_q[b] + uq] = l[0]
    return ref_out, ref_lse


# (name, lens_q, lens_k, h, hk, used_q, used_k, extra grid rows, dtypes)
A_Q = [0, 1, 63, 64, 65, 1000, 130, 7, 33]
A_K = [5, 1, 64, 63, 200, 1000, 0, 129, 65]
B_QK = [1000, 65, 0, 64, 1, 63, 300, 129]
VARLEN_CASES = [
    ("mixed_gqa", A_Q, A_K, 8, 2, None, None, 0, ("bf16", "fp16")),
    ("self_mha", B_QK, B_QK, 4, 4, None, None, 0, ("bf16", "fp16")),
    ("seqused_qk", [70, 200, 64, 0, 130, 65], [100, 64, 300, 10, 129, 65],
     4, 2, [65, 0, 64, 0, 1, 64], [100, 30, 0, 10, 64, 65], 300, ("bf16",)),
    ("seqused_k", [64, 130, 1000, 3], [128, 300, 1000, 64], 4, 4, None, [100, 1, 999, 64], 0, ("bf16",)),
]


def check_varlen(d, cfg_name, cfg, cases, causals, results, dtypes_override=None):
    import torch
    from flashtile.kernels import gluon_forward as gf
    from gluon_fwd_probe import compare

    dts = {"bf16": torch.bfloat16, "fp16": torch.float16}
    all_ok = True
    for case_idx, (name, lens_q, lens_k, h, hk, used_q, used_k, extra, dtypes) in enumerate(cases):
        for causal in causals:
            for dt in (dtypes_override or dtypes):
                dtype = dts[dt]
                tag = f"d{d} {cfg_name:14s} {name:11s} causal={int(causal)} {dt}"
                rec = {"head_dim": d, "config": cfg_name, "case": name, "causal": causal, "dtype": dt}
                try:
                    q, k, v, out, lse, lse_buf, args = make_varlen(lens_q, lens_k, h, hk, d, dtype, used_q, used_k,
                                                                   seed=1000 * d + case_idx)
                    args["max_seqlen_q"] += extra
                    scale = 1.0 / math.sqrt(d)
                    q4, k4, v4, o4 = q[None], k[None], v[None], out[None]
                    if not gf.supported(q4, k4, v4, causal):
                        rec["status"] = "unsupported"
                        log(f"{tag} SKIP (supported() is False)")
                        all_ok = False
                        results.append(rec)
                        continue
                    gf.gluon_attention_forward(q4, k4, v4, o4, lse, scale, causal, cfg, **args)
                    torch.cuda.synchronize()
                    nq = sum(lens_q)
                    ref_out, ref_lse = varlen_reference(q, k, v, lens_q, lens_k, used_q, used_k, scale, causal)
                    ok, rel, lse_err, inf_match = compare(out[:nq], lse[:, :nq], ref_out[:nq], ref_lse[:, :nq],
                                                          dtype, cfg.row_sum_mma)
                    guard_ok = bool(torch.isnan(out[nq:]).all()) and bool(torch.isnan(lse_buf[:, nq:]).all())
                    zero_ok = True
                    if used_q is not None:  # rows past seqused_q: exactly 0 / -inf
                        cu_q = _cu(lens_q)
                        for b, (n, u) in enumerate(zip(lens_q, used_q)):
                            rows = slice(cu_q[b] + u, cu_q[b] + n)
                            zero_ok &= bool((out[rows] == 0).all()) and bool(torch.isneginf(lse[:, rows]).all())
                    ok = ok and guard_ok and zero_ok
                    rec.update(status="PASS" if ok else "FAIL", rel_err=rel, lse_max_abs_err=lse_err,
                               lse_inf_match=inf_match, guard_rows_untouched=guard_ok, unused_rows_zero=zero_ok)
                    log(f"{tag} rel={rel:.2e} lse_err={lse_err:.2e} inf={inf_match} guard={guard_ok} "
                        f"zero={zero_ok} {'PASS' if ok else 'FAIL'}")
                    all_ok &= ok
                except Exception as e:
                    rec.update(status="ERROR", error=f"{type(e).__name__}: {e}"[:2000])
                    log(f"{tag} ERROR {type(e).__name__}: {str(e)[:400]}")
                    traceback.print_exc(limit=4)
                    all_ok = False
                    torch.cuda.synchronize()
                results.append(rec)
    return all_ok


# ----------------------------------------------------------------------------------------------
# Pieces (each runs in a child process)
# ----------------------------------------------------------------------------------------------

def _defaults():
    from flashtile.configs import FWD_GLUON, table_config
    from flashtile.kernels import gluon_forward as gf

    # The committed config per head dim at long keys (d64 only serves those).
    return {d: table_config(FWD_GLUON, "sm90", d, causal=False, seqlen_k=16384) for d in gf.HEAD_DIMS}


def piece_check(d):
    results = []
    cfg = _defaults()[d]
    ok = check_varlen(d, "default", cfg, VARLEN_CASES, (False, True), results)
    return {"ok": ok, "results": results}


def piece_candidates():
    from flashtile.kernels import gluon_forward as gf

    results = []
    ok = True
    for d, cands in gf.CANDIDATES.items():
        for name, cfg in cands.items():
            if cfg == _defaults()[d]:
                continue
            ok &= check_varlen(d, name, cfg, VARLEN_CASES[:1], (True,), results, dtypes_override=("bf16",))
    return {"ok": ok, "results": results}


def piece_dense():
    import torch
    from gluon_fwd_probe import FULL_CASES, check_config

    results = []
    ok = True
    for d, cfg in _defaults().items():
        ok &= check_config(d, "default", cfg, FULL_CASES, (torch.bfloat16, torch.float16), results)
    return {"ok": ok, "results": results}


def _draw_lengths(total, lo, hi, seed):
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(min(rng.randint(lo, hi), total - sum(lens)))
    return lens


def _real_flops(lens_q, lens_k, h, d, causal):
    # Causal halves the work (the usual convention, also for sq != sk).
    return sum(4 * h * sq * sk * d for sq, sk in zip(lens_q, lens_k)) / (2 if causal else 1)


def piece_timing():
    import torch
    from triton.testing import do_bench
    from flashtile.configs import FWD_GLUON, table_config
    from flashtile.kernels import gluon_forward as gf

    dtype = torch.bfloat16
    d, h = 128, 2048 // 128
    scale = 1.0 / math.sqrt(d)
    rows = []
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)  # warm the clocks up
    t = time.time()
    while time.time() - t < 1.0:
        a @ a
        torch.cuda.synchronize()
    del a

    setups = [("random[64,4096]", _draw_lengths(16384, 64, 4096, seed=0)),
              ("equal 4x4096", [4096] * 4),
              ("equal 16x1000", [1000] * 16)]
    for label, lens in setups:
        n, total, smax = len(lens), sum(lens), max(lens)
        cu = torch.tensor(_cu(lens), device="cuda", dtype=torch.int32)
        torch.manual_seed(0)
        q = torch.randn(1, total, h, d, device="cuda", dtype=dtype)
        k = torch.randn(1, total, h, d, device="cuda", dtype=dtype)
        v = torch.randn(1, total, h, d, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        lse = torch.empty(h, total, device="cuda", dtype=torch.float32)
        # The same tokens, zero-padded to (n, smax).
        qp = torch.zeros(n, smax, h, d, device="cuda", dtype=dtype)
        kp, vp = torch.zeros_like(qp), torch.zeros_like(qp)
        for b, (s0, s1) in enumerate(zip(_cu(lens)[:-1], _cu(lens)[1:])):
            qp[b, :s1 - s0], kp[b, :s1 - s0], vp[b, :s1 - s0] = q[0, s0:s1], k[0, s0:s1], v[0, s0:s1]
        outp = torch.empty_like(qp)
        lsep = torch.empty(n, h, smax, device="cuda", dtype=torch.float32)
        for causal in (False, True):
            cfg = table_config(FWD_GLUON, "sm90", d, causal=causal, seqlen_k=smax, dtype=dtype)
            row = {"setup": label, "lengths": lens, "causal": causal, "config": str(cfg)}
            flops = _real_flops(lens, lens, h, d, causal)
            try:
                ms_v = do_bench(gf.make_launcher(q, k, v, out, lse, scale, causal, cfg, cu_seqlens_q=cu,
                                                 cu_seqlens_k=cu, max_seqlen_q=smax))
                ms_d = do_bench(gf.make_launcher(qp, kp, vp, outp, lsep, scale, causal, cfg))
                # Equal lengths (no padding): both runs compute the same thing. (With padding the dense
                # run attends to the zero keys too; it only stands for the time padding costs.)
                err = None
                if len(set(lens)) == 1:
                    err = max(((outp[b].float() - out[0, s0:s1].float()).abs().max().item())
                              for b, (s0, s1) in enumerate(zip(_cu(lens)[:-1], _cu(lens)[1:])))
                row.update(ms_varlen=ms_v, ms_dense_padded=ms_d,
                           tflops_varlen=flops / (ms_v * 1e-3) / 1e12,
                           tflops_dense_padded=flops / (ms_d * 1e-3) / 1e12,
                           max_abs_diff_vs_padded=err)
                log(f"{label:16s} causal={int(causal)} varlen {row['tflops_varlen']:.0f} TF/s ({ms_v:.3f} ms)  "
                    f"dense padded {row['tflops_dense_padded']:.0f} TF/s ({ms_d:.3f} ms)  max|diff| {err}")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:1000]
                log(f"{label} causal={int(causal)} ERROR {row['error'][:300]}")
                traceback.print_exc(limit=4)
            rows.append(row)
        del q, k, v, out, lse, qp, kp, vp, outp, lsep
        torch.cuda.empty_cache()
    return {"ok": all("error" not in r for r in rows), "rows": rows}


def run_piece(name, out_dir):
    import torch
    import triton

    log(f"[{name}] torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    if name.startswith("check_d"):
        return piece_check(int(name[len("check_d"):]))
    return {"dense": piece_dense, "timing": piece_timing, "candidates": piece_candidates}[name]()


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
    timing = report["pieces"].get("timing", {}).get("rows") or []
    if timing:
        lines.append("")
        lines.append("d128 h16 bf16, TFLOP/s on real tokens   varlen  dense(padded)  varlen/dense")
        for r in timing:
            if "error" in r:
                lines.append(f"  {r['setup']:18s} causal={int(r['causal'])}  ERROR")
                continue
            lines.append(f"  {r['setup']:18s} causal={int(r['causal'])}  {r['tflops_varlen']:7.0f}  "
                         f"{r['tflops_dense_padded']:13.0f}  {r['tflops_varlen'] / r['tflops_dense_padded']:12.2f}")
    return "\n".join(lines)


def main():
    main_with_pieces(__file__, "varlen_probe", PIECES, TOTAL_BUDGET_S, run_piece, summary_table)


if __name__ == "__main__":
    main()
