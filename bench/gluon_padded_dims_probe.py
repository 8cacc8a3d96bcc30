"""GPU check + timing of head dims 96 and 192 on the Hopper Gluon kernels (they run the d128 / d256
kernels with TMA boxes of the padded width over the true-width tensors).

    PYTHONPATH=<repo> python bench/gluon_padded_dims_probe.py --out $OUT --head-dims 96
    PYTHONPATH=<repo> python bench/gluon_padded_dims_probe.py --out $OUT --head-dims 192

(one head dim per run keeps each run under 8 minutes on a cold Triton cache: the check piece
compiles a dozen kernel variants; --skip-checks / --skip-timing run one half.)

Every piece of GPU work runs in a child process with a timeout (a deadlocked kernel only costs its
timeout); the whole run stays under 8 minutes. Pieces:
  * check d<D> (one per head dim): forward and backward through flashtile's launchers
    (launch.attention_forward / attention_backward, the same dispatch as the public API), dense and
    packed (varlen) batches: causal and not, odd lengths (113, 1000 x 777, ...), GQA, sequences with
    ragged last tiles. Every input is the first d columns of a wider buffer whose other columns
    hold NaN (a kernel reading past the head dim poisons its result); every output (out, dq, dk,
    dv) is the first d columns of a wider buffer whose other columns hold a sentinel that must
    survive (a store past the head dim is caught). Also records that the Gluon kernels were the
    ones chosen (gluon_config). Reference: float32 autograd.
  * time: bf16, hidden 1536 (d96: 16 heads, d192: 8), 16k tokens per batch, seqlen 1k/4k/16k,
    causal and not: forward and backward of cuDNN (torch SDPA), flashtile's portable Triton kernels
    and flashtile on the Gluon kernels (public API; the backward timed alone, graph retained).
Writes $OUT/gluon_padded_dims_probe_d<D>.json (+ one JSON per piece) and prints a short table last.
"""

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
import zlib

from probe_pieces import load_json, run_script

TIME_BUDGET_S = 7 * 60 + 20
T0 = time.time()
GUARD = 32          # extra columns of every buffer (a multiple of 8: 16-byte strides)
SENTINEL = 7.0      # guard value of the output buffers
TOL = {"bfloat16": 1.5e-2, "float16": 4e-3, "float32": 1e-4}
DEVICE = "cuda"     # (a CPU smoke test of this script sets "cpu" under TRITON_INTERPRET=1)


def elapsed():
    return time.time() - T0


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# Check piece
# ----------------------------------------------------------------------------------------------

# Dense: (name, batch, seqlen_q, seqlen_k, heads, kv heads, causal)
DENSE_CASES = [
    ("s1", 1, 1, 1, 2, 2, False),
    ("s113", 2, 113, 113, 4, 4, False),
    ("s113_causal", 2, 113, 113, 4, 4, True),
    ("q113_k203_causal", 2, 113, 203, 4, 4, True),
    ("q300_k100_causal", 2, 300, 100, 4, 4, True),
    ("q1000_k777", 2, 1000, 777, 4, 4, False),
    ("q1000_k777_causal", 2, 1000, 777, 4, 4, True),
    ("gqa_h8_hk2_q257_k333_causal", 2, 257, 333, 8, 2, True),
    ("gqa_h6_hk1_q512", 3, 512, 512, 6, 1, False),
    ("s2048_causal", 1, 2048, 2048, 2, 2, True),
]
# Varlen: (name, query lengths, key lengths, heads, kv heads, causal)
VARLEN_CASES = [
    ("ragged", [1, 113, 64, 200, 1000, 7, 129], [1, 113, 64, 200, 1000, 7, 129], 4, 4, False),
    ("ragged_causal", [1, 113, 64, 200, 1000, 7, 129], [1, 113, 64, 200, 1000, 7, 129], 4, 4, True),
    ("ragged_qk_gqa_causal", [77, 300, 5, 640], [100, 250, 64, 700], 8, 2, True),
    ("ragged_qk_gqa", [77, 300, 5, 640], [100, 250, 64, 700], 8, 2, False),
    ("empty_seq", [0, 150, 33], [10, 150, 0], 4, 4, False),
]
FP16_CASES = {"q1000_k777_causal", "ragged_causal"}


def _wide(shape, d, dtype, fill_guard, body=None):
    """A (..., d) view of a (..., d + GUARD) buffer: body randn (or the value body), guard fill_guard."""
    import torch
    buf = torch.empty(*shape, d + GUARD, device=DEVICE, dtype=dtype)
    if body is None:
        buf[..., :d].normal_()
    else:
        buf[..., :d].fill_(body)
    buf[..., d:].fill_(fill_guard)
    return buf, buf[..., :d]


def _reference(q, k, v, dout, lens_q, lens_k, scale, causal):
    """float32 out, lse and grads of packed (total, h, d) q / (total, hk, d) k, v: sequence by
    sequence, causal bottom-right; rows that see no key output 0."""
    import torch
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    h, hk = q.shape[1], k.shape[1]
    outs, lses = [], []
    oq = ok = 0
    for lq, lk in zip(lens_q, lens_k):
        qs = qf[oq:oq + lq].transpose(0, 1)
        ks = kf[ok:ok + lk].transpose(0, 1).repeat_interleave(h // hk, dim=0)
        vs = vf[ok:ok + lk].transpose(0, 1).repeat_interleave(h // hk, dim=0)
        s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        lse = torch.logsumexp(s, dim=-1) if lk > 0 else torch.full((h, lq), float("-inf"), device=q.device)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(torch.matmul(p, vs).transpose(0, 1))
        lses.append(lse)
        oq += lq
        ok += lk
    out = torch.cat(outs, 0)
    lse = torch.cat(lses, 1)
    dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), dout.float(), allow_unused=True)
    zero = lambda g, t: g if g is not None else torch.zeros_like(t, dtype=torch.float32)  # noqa: E731
    return out.detach(), lse.detach(), zero(dq, q), zero(dk, k), zero(dv, v)


def _rel(x, ref):
    import torch
    x = x.float()
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    rn = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff / rn if rn > 1e-6 else diff


def check_case(d, dtype, name, lens_q, lens_k, h, hk, causal, varlen, batch=1):
    """One case through launch.attention_forward / attention_backward. Dense cases pass equal lengths
    per batch entry (lens_q / lens_k: one entry, repeated batch times)."""
    import torch
    from flashtile.configs import BWD_GLUON, FWD_GLUON
    from flashtile.kernels.launch import PackedSeqs, ScoreParams, attention_backward, attention_forward, gluon_config

    scale = 1.0 / math.sqrt(d)
    params = ScoreParams(softmax_scale=scale, window_right=0 if causal else -1)
    torch.manual_seed(zlib.crc32(f"{name}{d}".encode()) % 10000)
    nan = float("nan")
    if varlen:
        tq, tk = sum(lens_q), sum(lens_k)
        lead_q, lead_k = (1, tq), (1, tk)
        cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], device=DEVICE, dtype=torch.int32)  # noqa: E731
        seqs = PackedSeqs(cu(lens_q), cu(lens_k), max(lens_q), max(lens_k))
        lse = torch.full((1, h, tq), nan, device=DEVICE, dtype=torch.float32)
    else:
        lead_q, lead_k = (batch, lens_q[0]), (batch, lens_k[0])
        seqs = None
        lse = torch.full((batch, h, lens_q[0]), nan, device=DEVICE, dtype=torch.float32)
    _, q = _wide((*lead_q, h), d, dtype, nan)
    _, k = _wide((*lead_k, hk), d, dtype, nan)
    _, v = _wide((*lead_k, hk), d, dtype, nan)
    _, dout = _wide((*lead_q, h), d, dtype, nan)
    ob, out = _wide((*lead_q, h), d, dtype, SENTINEL, body=nan)
    dqb, dq = _wide((*lead_q, h), d, dtype, SENTINEL, body=nan)
    dkb, dk = _wide((*lead_k, hk), d, dtype, SENTINEL, body=nan)
    dvb, dv = _wide((*lead_k, hk), d, dtype, SENTINEL, body=nan)

    rec = {"head_dim": d, "dtype": str(dtype).split(".")[-1], "case": name, "varlen": varlen, "causal": causal,
           "gluon_fwd": gluon_config(FWD_GLUON, q, k, v, params, seqs) is not None,
           "gluon_bwd": gluon_config(BWD_GLUON, q, k, v, params, seqs) is not None}
    attention_forward(q, k, v, out, lse, params, seqs)
    attention_backward(q, k, v, out, dout, lse, dq, dk, dv, params, seqs=seqs)
    if DEVICE == "cuda":
        torch.cuda.synchronize()

    # Reference on the packed (total, h, d) form (dense: batch entries as sequences).
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    if varlen:
        rl_q, rl_k = lens_q, lens_k
    else:
        rl_q, rl_k = lens_q * batch, lens_k * batch
    r_out, r_lse, r_dq, r_dk, r_dv = _reference(flat(q), flat(k), flat(v), flat(dout), rl_q, rl_k, scale, causal)
    got_lse = lse[0] if varlen else lse.permute(1, 0, 2).reshape(h, -1)
    fin = torch.isfinite(r_lse)
    lse_err = (got_lse[fin] - r_lse[fin]).abs().max().item() if fin.any() else 0.0
    if bool(torch.isnan(got_lse).any()) or not torch.equal(torch.isinf(got_lse), torch.isinf(r_lse)):
        lse_err = float("inf")
    errs = {"out": _rel(flat(out), r_out), "dq": _rel(flat(dq), r_dq), "dk": _rel(flat(dk), r_dk),
            "dv": _rel(flat(dv), r_dv)}
    guards = {n: bool((b[..., d:] == SENTINEL).all()) for n, b in (("out", ob), ("dq", dqb), ("dk", dkb),
                                                                    ("dv", dvb))}
    tol = TOL[rec["dtype"]]
    ok = (all(e < tol for e in errs.values()) and lse_err < 1e-3 and all(guards.values())
          and rec["gluon_fwd"] and rec["gluon_bwd"])
    rec.update(status="PASS" if ok else "FAIL", rel_err=errs, lse_max_abs_err=lse_err, guards_intact=guards)
    return rec


def piece_check(d):
    import torch
    results = []
    for dtype in (torch.bfloat16, torch.float16):
        dname = str(dtype).split(".")[-1]
        todo = [(c[0], [c[2]], [c[3]], c[4], c[5], c[6], False, c[1]) for c in DENSE_CASES]
        todo += [(c[0], c[1], c[2], c[3], c[4], c[5], True, 1) for c in VARLEN_CASES]
        for name, lq, lk, h, hk, causal, varlen, batch in todo:
            if dtype == torch.float16 and name not in FP16_CASES:
                continue
            tag = f"d{d} {dname} {'varlen' if varlen else 'dense '} {name}"
            try:
                rec = check_case(d, dtype, name, lq, lk, h, hk, causal, varlen, batch)
                e = rec["rel_err"]
                log(f"[check] {tag}: {rec['status']} out={e['out']:.1e} dq={e['dq']:.1e} dk={e['dk']:.1e} "
                    f"dv={e['dv']:.1e} lse={rec['lse_max_abs_err']:.1e} guards={all(rec['guards_intact'].values())} "
                    f"gluon={rec['gluon_fwd']}/{rec['gluon_bwd']}")
            except Exception as e:
                rec = {"head_dim": d, "dtype": dname, "case": name, "varlen": varlen, "status": "ERROR",
                       "error": traceback.format_exc()[-1500:]}
                log(f"[check] {tag}: ERROR {type(e).__name__}: {str(e)[:300]}")
                torch.cuda.synchronize()
            results.append(rec)
    return {"ok": all(r["status"] == "PASS" for r in results), "results": results}


# ----------------------------------------------------------------------------------------------
# Timing piece
# ----------------------------------------------------------------------------------------------

SEQLENS = (1024, 4096, 16384)
HIDDEN = 1536


def _fwd_flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def piece_time(head_dims):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from flashtile import flash_attn_func
    from flashtile.configs import BWD_GLUON, FWD_GLUON, override
    from flashtile.kernels.launch import ScoreParams, gluon_config

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < 1.0:  # clocks up
        a @ a
        torch.cuda.synchronize()
    del a
    rows = []
    for d in head_dims:
        h = HIDDEN // d
        for s in SEQLENS:
            b = max(16384 // s, 1)
            for causal in (False, True):
                if elapsed() > TIME_BUDGET_S - 40:
                    log(f"[time] budget reached; skipping d{d} s{s} causal={causal}")
                    continue
                torch.manual_seed(0)
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                scale = 1.0 / math.sqrt(d)
                params = ScoreParams(softmax_scale=scale, window_right=0 if causal else -1)
                fl = _fwd_flops(b, h, s, d, causal)
                row = {"head_dim": d, "seqlen": s, "batch": b, "nheads": h, "causal": causal,
                       "gluon_fwd_chosen": gluon_config(FWD_GLUON, q, k, v, params) is not None,
                       "gluon_bwd_chosen": gluon_config(BWD_GLUON, q, k, v, params) is not None,
                       "fwd_ms": {}, "bwd_ms": {}, "fwd_tflops": {}, "bwd_tflops": {}}

                def record(kind, name, fn):
                    try:
                        ms = do_bench(fn, warmup=25, rep=100)
                        row[f"{kind}_ms"][name] = ms
                        row[f"{kind}_tflops"][name] = (fl if kind == "fwd" else 2.5 * fl) / (ms * 1e-3) / 1e12
                    except Exception as e:
                        row[f"{kind}_ms"][name] = None
                        row.setdefault("errors", {})[f"{kind} {name}"] = f"{type(e).__name__}: {str(e)[:300]}"

                qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    with torch.no_grad():
                        record("fwd", "cudnn", lambda: F.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=causal, scale=scale))
                    try:
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                        ref = o.detach().transpose(1, 2).float()
                        dot = dout.transpose(1, 2)
                        record("bwd", "cudnn", lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True))
                        del o
                    except Exception as e:
                        ref = None
                        row.setdefault("errors", {})["cudnn"] = str(e)[:300]
                with torch.no_grad():
                    with override(fwd_gluon=None):
                        record("fwd", "portable", lambda: flash_attn_func(q, k, v, causal=causal, softmax_scale=scale))
                    record("fwd", "gluon", lambda: flash_attn_func(q, k, v, causal=causal, softmax_scale=scale))
                    if ref is not None:
                        o = flash_attn_func(q, k, v, causal=causal, softmax_scale=scale).float()
                        row["gluon_fwd_rel_err_vs_cudnn"] = ((o - ref).norm() / ref.norm()).item()
                        del o
                qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
                o = flash_attn_func(qq, kk, vv, causal=causal, softmax_scale=scale)
                with override(bwd_gluon=None):
                    record("bwd", "portable", lambda: torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True))
                record("bwd", "gluon", lambda: torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True))
                del o
                tf = lambda kind: " ".join(f"{n}={v_:.0f}" for n, v_ in row[f"{kind}_tflops"].items())  # noqa: E731
                log(f"[time] d{d} s{s} b{b} h{h} causal={int(causal)}  fwd: {tf('fwd')}  bwd: {tf('bwd')}"
                    f"  (gluon chosen {row['gluon_fwd_chosen']}/{row['gluon_bwd_chosen']})")
                rows.append(row)
                del q, k, v, dout, qt, kt, vt, qq, kk, vv, ref
                torch.cuda.empty_cache()
    return {"rows": rows}


# ----------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------

def run_piece(args, out_dir, timeout):
    timeout = max(5, min(timeout, TIME_BUDGET_S - elapsed()))
    return run_script(__file__, ["--out", out_dir] + args, timeout, "piece")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--head-dims", default="96,192")
    ap.add_argument("--piece", default="")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    head_dims = [int(x) for x in args.head_dims.split(",") if x]

    if args.piece:
        if args.piece == "check":
            res = piece_check(head_dims[0])
            name = f"check_d{head_dims[0]}"
        else:
            res = piece_time(head_dims)
            name = "time_" + "_".join(f"d{d}" for d in head_dims)
        with open(os.path.join(args.out, f"padded_{name}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return 0

    import torch
    import triton
    log(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}")
    report = {"head_dims": head_dims, "status": {}, "checks": {}, "timing": None}
    for d in head_dims:
        if args.skip_checks:
            break
        rc = run_piece(["--piece", "check", "--head-dims", str(d)], args.out, 240)
        report["status"][f"check d{d}"] = rc
        report["checks"][d] = load_json(os.path.join(args.out, f"padded_check_d{d}.json"))
    if not args.skip_timing:
        rc = run_piece(["--piece", "time", "--head-dims", args.head_dims], args.out, 300)
        report["status"]["time"] = rc
        report["timing"] = load_json(os.path.join(args.out, "padded_time_" + "_".join(f"d{d}" for d in head_dims) + ".json"))
    tag = "_".join(f"d{d}" for d in head_dims)
    with open(os.path.join(args.out, f"gluon_padded_dims_probe_{tag}.json"), "w") as f:
        json.dump(report, f, indent=1)

    log("\n== correctness (dense + varlen, guards, gluon chosen)")
    for d in head_dims:
        res = report["checks"].get(d)
        if not res:
            log(f"  d{d}: no result ({report['status'].get(f'check d{d}')})")
            continue
        bad = [f"{r['dtype']}/{r['case']}{'(varlen)' if r.get('varlen') else ''}:{r['status']}"
               for r in res["results"] if r["status"] != "PASS"]
        worst = max((max(r["rel_err"].values()) for r in res["results"] if "rel_err" in r), default=float("nan"))
        log(f"  d{d}: {'ALL PASS' if res['ok'] else 'FAIL'} ({len(res['results'])} cases, worst rel {worst:.1e}) "
            f"{' '.join(bad[:10])}")
    rows = (report["timing"] or {}).get("rows", [])
    if rows:
        log(f"\n== TFLOP/s (bf16, 16k tokens, hidden {HIDDEN}; bwd = backward alone, 2.5x fwd flops)")
        log(f"{'d':>4} {'seqlen':>6} {'causal':>6} | {'fwd cudnn':>9} {'portable':>8} {'gluon':>6} {'/cudnn':>6} "
            f"{'/port':>6} | {'bwd cudnn':>9} {'portable':>8} {'gluon':>6} {'/cudnn':>6} {'/port':>6}")
        for r in rows:
            cells = []
            for kind in ("fwd", "bwd"):
                tf = r[f"{kind}_tflops"]
                c, p, g = tf.get("cudnn"), tf.get("portable"), tf.get("gluon")
                num = lambda x, w: f"{x:>{w}.0f}" if x else f"{'-':>{w}}"  # noqa: E731
                ratio = lambda a, b: f"{a / b:>6.2f}" if a and b else f"{'-':>6}"  # noqa: E731
                cells.append(f"{num(c, 9)} {num(p, 8)} {num(g, 6)} {ratio(g, c)} {ratio(g, p)}")
            log(f"{r['head_dim']:>4} {r['seqlen']:>6} {int(r['causal']):>6} | {cells[0]} | {cells[1]}")
    log(f"total {elapsed():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
