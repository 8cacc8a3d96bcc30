"""The varlen (packed) head-dim-256 Gluon backward kernel: a baseline copy of the module against the
working one, in one process (kernel, accumulator zeroing and dQ convert; no preprocess).

    git show 18ed9fb:flashtile/kernels/gluon_backward.py > flashtile/kernels/_baseline_gluon_backward.py
    PYTHONPATH=$PWD:$PWD/bench python bench/results/2026-11-22-h200-d256-bwd-opaque-kv/varlen_d256_ab.py

16k tokens of 8 heads: lengths drawn in [64, 4096] (bench/gluon_varlen_bwd_probe.py's draw), and 16 x 1024.
TFLOP/s on real tokens, median of 3; rel: the new gradients against the baseline's."""
import math, time, importlib
import torch
from triton.testing import do_bench
from flashtile.configs import BWD_GLUON, table_config
from flashtile.kernels import gluon_backward as new
from flashtile.kernels.launch import PackedSeqs, ScoreParams, attention_forward, row_stats_buffers, launch_preprocess
from gluon_varlen_bwd_probe import _draw_lengths, _cu, _bwd_flops
base = importlib.import_module("flashtile.kernels._baseline_gluon_backward")
dtype = torch.bfloat16
d, h = 256, 8
scale = 1 / math.sqrt(d)
a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
t0 = time.time()
while time.time() - t0 < 1.0:
    a @ a
torch.cuda.synchronize()
for label, lens in (("random[64,4096]", _draw_lengths(16384, 64, 4096, seed=0)), ("equal 16x1024", [1024] * 16)):
    total, smax = sum(lens), max(lens)
    cu = torch.tensor(_cu(lens), device="cuda", dtype=torch.int32)
    seqs = PackedSeqs(cu, cu, smax, smax)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, total, h, d, device="cuda", dtype=dtype) for _ in range(4))
    for causal in (False, True):
        params = ScoreParams(softmax_scale=scale, window_right=0 if causal else -1)
        cfg = table_config(BWD_GLUON, "sm90", d, causal=causal, seqlen_k=smax, dtype=dtype, varlen=True)
        out = torch.empty_like(q)
        lse = torch.empty(1, h, total, device="cuda", dtype=torch.float32)
        attention_forward(q, k, v, out, lse, params, seqs)
        delta, lse_log2 = row_stats_buffers(lse)
        launch_preprocess(out, dout, lse, delta, lse_log2, seqs, 64)
        grads, ms = {}, {}
        launches = {}
        for name, mod in (("base", base), ("new", new)):
            g = [torch.full_like(x, float("nan")) for x in (q, k, v)]
            launches[name] = mod.make_launcher(q, k, v, dout, lse_log2, delta, *g, scale, causal, cfg,
                                               cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=smax)
            launches[name]()
            grads[name] = g
        torch.cuda.synchronize()
        rel = max(((x.float() - r.float()).norm() / r.float().norm()).item() for x, r in zip(grads["new"], grads["base"]))
        times = {n: [] for n in launches}
        for _ in range(3):
            for n, f in launches.items():
                times[n].append(do_bench(f))
        flops = _bwd_flops(lens, h, d, causal)
        tf = {n: flops / (sorted(t)[1] * 1e-3) / 1e12 for n, t in times.items()}
        print(f"{label} causal={int(causal)} cfg={cfg} rel(new vs base)={rel:.2e} "
              + " ".join(f"{n}={v:.0f}" for n, v in tf.items()) + f" ratio={tf['new'] / tf['base']:.3f}", flush=True)
