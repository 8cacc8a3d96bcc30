"""Probe: short tiles split by key blocks (GluonFwdConfig.split_short_tile; needs split_short_tile.patch)."""
import dataclasses, json, math, os
import torch
from triton.testing import do_bench
from flashtile.configs import GluonFwdConfig
from flashtile.kernels import gluon_forward as gf
from gluon_fwd_probe import warm_up_gpu, reference, make_case, compare

C3P = GluonFwdConfig(128, 2, num_consumers=3, consumer_regs=160, loader_regs=24, persistent=True, row_sum_mma=True)
C2PP = GluonFwdConfig(128, 3, pingpong=True, persistent=True, row_sum_mma=True)
C2P = GluonFwdConfig(128, 3, persistent=True, row_sum_mma=True)
SPLIT = lambda c: dataclasses.replace(c, split_short_tile=True)
CFGS = {"c3p": C3P, "c3p_split": SPLIT(C3P), "c3p_s3_split": SPLIT(dataclasses.replace(C3P, num_stages=3)),
        "c3_split": SPLIT(dataclasses.replace(C3P, persistent=False)), "c2pp": C2PP, "c2p": C2P,
        "c2p_split": SPLIT(C2P), "c3p_norowsum_split": SPLIT(dataclasses.replace(C3P, row_sum_mma=False))}
CASES = [  # b, sq, sk, h, hk
    (2, 1000, 1000, 4, 4), (3, 64, 1024, 4, 2), (2, 65, 300, 4, 1), (1, 200, 1, 2, 2), (2, 1050, 777, 4, 4),
    (1, 130, 113, 4, 4), (2, 1024, 1024, 4, 4), (1, 40, 2048, 8, 2), (1, 5000, 3000, 2, 1), (3, 1, 1, 2, 2),
    (2, 17, 129, 4, 4),
]
ok_all = True
for name, cfg in CFGS.items():
    bad = []
    for dtype in (torch.bfloat16, torch.float16):
        for b, sq, sk, h, hk in CASES:
            torch.manual_seed(sq * 7 + sk)
            q, k, v, out, lse = make_case(b, sq, sk, h, hk, 64, dtype)
            out.fill_(float("nan")); lse.fill_(float("nan"))
            gf.gluon_attention_forward(q, k, v, out, lse, 0.125, False, config=cfg)
            ref_out, ref_lse = reference(q, k, v, 0.125, False)
            ok, rel, lse_err, _ = compare(out, lse, ref_out, ref_lse, dtype, cfg.row_sum_mma)
            if not ok:
                bad.append((str(dtype), b, sq, sk, h, hk, rel, lse_err))
    ok_all &= not bad
    print("check", name, "ok" if not bad else f"FAIL {bad}", flush=True)

d, h = 64, 32
warm_up_gpu(1.0)
rows = []
for s in (1024, 2048, 4096, 8192, 16384):
    b = 16384 // s
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * s * s * d
    row = {"seqlen": s, "tflops": {}, "spread": {}}
    launches = {}
    for name, cfg in CFGS.items():
        if name in ("c3_split", "c3p_norowsum_split", "c3p_s3_split") and s > 1024:
            continue
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda")
        launches[name] = gf.make_launcher(q, k, v, out, lse, 1 / math.sqrt(d), False, cfg)
        launches[name]()
    ms = {n: [] for n in launches}
    for _ in range(5):
        for n, fn in launches.items():
            ms[n].append(do_bench(fn))
    for n, v_ in ms.items():
        v_.sort()
        row["tflops"][n] = flops / v_[2] / 1e9
        row["spread"][n] = (v_[-1] - v_[0]) / v_[2]
    print(s, {n: round(t) for n, t in row["tflops"].items()}, flush=True)
    rows.append(row)
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump({"rows": rows, "checks_ok": ok_all}, open(os.path.join(os.environ.get("OUT", "."), "split.json"), "w"), indent=1)
names = list(CFGS)
print("\nseqlen " + " ".join(f"{n:>18s}" for n in names))
for r in rows:
    print(f"{r['seqlen']:>6} " + " ".join(f"{r['tflops'].get(n, 0):12.0f} ({r['spread'].get(n, 0):3.0%})" for n in names))
print("checks", "ok" if ok_all else "FAIL")
