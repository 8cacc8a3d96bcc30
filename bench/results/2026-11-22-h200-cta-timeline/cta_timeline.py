"""Per-CTA timeline of the Gluon backward (see README.md, section 1).

Needs cta-timestamps.patch applied (`git apply`, on 4833216): it instruments
flashtile/kernels/gluon_backward.py in place (revert it afterwards). Then, on the GPU, from the
repository root:
    PYTHONPATH=$PWD:$PWD/bench python bench/results/2026-11-22-h200-cta-timeline/cta_timeline.py
It writes trace_*.pt and trace_summary.json under $OUT, and prints the table.
"""
import json, math, os, sys, time
import torch
import gluon_bwd_probe
from gluon_bwd_probe import forward_and_preprocess, timing_inputs
from triton.testing import do_bench
from flashtile.configs import BWD_GLUON, table_config
from flashtile.kernels import gluon_backward as T
gluon_bwd_probe._imports()
out = os.environ.get("OUT", ".")
points = [(64, 1024, True), (64, 1024, False), (64, 16384, True), (256, 1024, False), (256, 1024, True), (256, 16384, False), (128, 1024, True)]
summary = []
for d, s, causal in points:
    b, h, q, k, v, dout = timing_inputs(d, s, causal)
    scale = 1.0 / math.sqrt(d)
    _, _, lse_log2, delta, preprocess = forward_and_preprocess(q, k, v, dout, scale, causal)
    cfg = table_config(BWD_GLUON, "sm90", d, causal=causal, seqlen_k=s)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    bn = 64 if d == 256 else 128
    n_ctas = (s // bn) * k.shape[2] * b
    T.TRACE = None
    plain = T.make_launcher(q, k, v, dout, lse_log2, delta, *grads, scale, causal, cfg)
    T.TRACE = torch.zeros((n_ctas, 8), dtype=torch.int64, device="cuda")
    traced = T.make_launcher(q, k, v, dout, lse_log2, delta, *grads, scale, causal, cfg)
    for _ in range(3):
        plain(); traced()
    torch.cuda.synchronize()
    ms_plain = do_bench(lambda: (preprocess(), plain()))
    ms_traced = do_bench(lambda: (preprocess(), traced()))
    preprocess(); traced(); torch.cuda.synchronize()
    tr = T.TRACE.cpu().double()
    t0 = tr[:, 0].min()
    ts = (tr[:, :6] - t0) / 1000.0  # us
    sm = tr[:, 7].long()
    pro = (ts[:, 1] - ts[:, 0]); loop = ts[:, 2] - ts[:, 1]; last = ts[:, 3] - ts[:, 2]; donew = ts[:, 4] - ts[:, 3]
    store = ts[:, 5] - ts[:, 4]; total = ts[:, 5] - ts[:, 0]
    gaps = []
    busy = torch.zeros(int(sm.max()) + 1, dtype=torch.float64)
    last_end = torch.zeros_like(busy)
    for smi in sm.unique().tolist():
        idx = (sm == smi).nonzero().flatten()
        order = idx[ts[idx, 0].argsort()]
        st, en = ts[order, 0], ts[order, 5]
        gaps += (st[1:] - en[:-1]).tolist()
        busy[smi] = (en - st).sum()
        last_end[smi] = en.max()
    span = float(ts[:, 5].max())
    g = torch.tensor(gaps) if gaps else torch.zeros(1)
    row = dict(d=d, s=s, causal=causal, n_ctas=n_ctas, ms_plain=ms_plain, ms_traced=ms_traced, span_us=span,
               first_start_spread=float(ts[:, 0].min()), pro=float(pro.mean()), pro_p90=float(pro.quantile(0.9)),
               loop=float(loop.mean()), lastdq=float(last.mean()), donewait=float(donew.mean()), store=float(store.mean()),
               cta=float(total.mean()), gap=float(g.mean()), gap_p90=float(g.quantile(0.9)),
               busy_frac=float(busy.sum() / (len(sm.unique()) * span)),
               idle_tail=float(span - last_end[sm.unique()].min()), sms=len(sm.unique()),
               first_wave_pro=float(pro[ts[:, 0] < 2].mean()))
    summary.append(row)
    torch.save(T.TRACE.cpu(), f"{out}/trace_d{d}_s{s}_c{int(causal)}.pt")
    print(json.dumps({k2: (round(v2, 2) if isinstance(v2, float) else v2) for k2, v2 in row.items()}), flush=True)
json.dump(summary, open(f"{out}/trace_summary.json", "w"), indent=1)
print(f"{'point':>16} {'ms':>6} {'ms_tr':>6} {'span':>7} {'cta':>6} {'pro':>5} {'pro1':>5} {'loop':>6} {'lastdq':>6} {'done':>5} {'store':>5} {'gap':>5} {'busy':>5} {'tail':>6}")
for r in summary:
    print(f"d{r['d']} s{r['s']} c{int(r['causal'])}".rjust(16) + f" {r['ms_plain']*1000:6.0f} {r['ms_traced']*1000:6.0f} {r['span_us']:7.0f} {r['cta']:6.1f} {r['pro']:5.2f} {r['first_wave_pro']:5.2f} {r['loop']:6.1f} {r['lastdq']:6.2f} {r['donewait']:5.2f} {r['store']:5.2f} {r['gap']:5.2f} {r['busy_frac']:5.3f} {r['idle_tail']:6.1f}")
