"""Host time of a backward at a tiny shape, layer by layer: autograd.grad, forward + backward through
the public function (eager autograd.Function) and through the custom op, the backward op called
directly, its Python implementation, and launch.attention_backward (Gluon and portable), then
cProfile of attention_backward.

    PYTHONPATH=<repo> python bench/backward_host_time.py

At (1, 128, 2, 128) the GPU finishes each kernel in a few microseconds, so back-to-back calls
without synchronisation measure host time. H200 host, 2026-11-21: autograd.grad 490 us, the op
236 us, its implementation 198 us, attention_backward 185 us (portable: 113 us).
"""

import cProfile, io, pstats, time, torch
from flashtile import flash_attn_func
from flashtile import ops
from flashtile.kernels import launch

def per_call_us(fn, calls=200):
    for _ in range(20): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(calls): fn()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6

q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
out = flash_attn_func(q, k, v, causal=True)
rows = {}
rows["autograd.grad (bwd alone)"] = per_call_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
# Forward + backward: the public function (eager: ops.dense_attention's autograd.Function) against
# the custom op it runs under torch.compile (torch.ops.flashtile.fwd and its registered backward).
opts = ([128 ** -0.5, 0.0, 0.0], [-1, 0, 0])
rows["flash_attn_func (fwd)"] = per_call_us(lambda: flash_attn_func(q, k, v, causal=True))
rows["flash_attn_func + autograd.grad"] = per_call_us(
    lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout))
rows["torch.ops.flashtile.fwd + autograd.grad"] = per_call_us(
    lambda: torch.autograd.grad(torch.ops.flashtile.fwd(q, k, v, None, None, *opts)[0], (q, k, v), dout))
out2, lse = torch.ops.flashtile.fwd(q.detach(), k.detach(), v.detach(), None, None, [128 ** -0.5, 0.0, 0.0], [-1, 0, 0])
args = (dout, q.detach(), k.detach(), v.detach(), out2, lse, None, None, [128 ** -0.5, 0.0, 0.0], [-1, 0, 0])
rows["torch.ops.flashtile.bwd"] = per_call_us(lambda: torch.ops.flashtile.bwd(*args))
rows["ops.bwd python impl"] = per_call_us(lambda: ops.bwd._init_fn(*args))
dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
params = launch.ScoreParams(softmax_scale=128 ** -0.5, window_right=0)
rows["attention_backward"] = per_call_us(lambda: launch.attention_backward(q.detach(), k.detach(), v.detach(), out2, dout, lse, dq, dk, dv, params))
rows["attention_backward deterministic (portable)"] = per_call_us(lambda: launch.attention_backward(q.detach(), k.detach(), v.detach(), out2, dout, lse, dq, dk, dv, params, True))
for name, us in rows.items():
    print(f"{name:<45} {us:8.1f} us")
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    launch.attention_backward(q.detach(), k.detach(), v.detach(), out2, dout, lse, dq, dk, dv, params)
prof.disable(); torch.cuda.synchronize()
buf = io.StringIO(); pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25); print(buf.getvalue())
