"""Host (CPU) cost per call of flashtile's entry points, next to torch SDPA's, on the GPU.

    PYTHONPATH=<repo> python bench/host_overhead.py [--out DIR] [--head-dim 128] [--profile]

At a tiny shape the GPU finishes each kernel in a few microseconds, so back-to-back calls
without synchronisation measure what the host spends per call (Python, argument checks,
descriptor set-up, launch). Short attention calls (seqlen ~1k, causal) are bound by it: a
forward that takes 40 us on the GPU cannot run faster than its host cost. Also times the
pieces of the Hopper forward's dispatch and, with --profile, prints cProfile's top entries.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CALLS = 300


def per_call_us(fn, calls=CALLS):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def print_profile(fn, sort: str, lines: int, calls: int = 200):
    """cProfile of ``calls`` calls of fn: the top ``lines`` entries by ``sort``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(lines)
    print(buf.getvalue())


def dissect_jit_launch(fn, launch):
    """Where a JIT launch's host time goes: binding/specialising the arguments, then the
    compiled kernel's launcher (which also encodes the TMA descriptors)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg
    from triton.runtime.driver import driver

    captured = {}
    real_run = fn.run

    def capture(*args, **kwargs):
        captured.update(args=args, kwargs=kwargs)
        return real_run(*args, **kwargs)
    fn.run = capture
    try:
        compiled = launch()
    finally:
        fn.run = real_run
    args, kwargs = captured["args"], dict(captured["kwargs"])
    grid = kwargs.pop("grid")
    kwargs.pop("warmup")
    kwargs["debug"] = False
    kwargs["instrumentation_mode"] = ""
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    binder = fn.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs)
    values = list(bound.values())

    def direct():
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None,
                     None, *values)
    descs = [a for a in values if hasattr(a, "block_shape")]
    meta = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descs)
    return {
        "  jit: bind + specialise args": per_call_us(lambda: binder(*args, **kwargs)),
        "  compiled.run (bound args)": per_call_us(direct),
        f"  encode {len(descs)} TMA descriptors": per_call_us(
            lambda: [make_tensordesc_arg(a, m) for a, m in zip(descs, meta)]),
    }


def packed_and_decode_rows(d: int, rounds: int = 5) -> dict:
    """Host time of packed (varlen) training calls and of decoding against a kv cache, with launch
    plans on and off (FLASHTILE_LAUNCH_PLANS; kernels/plans.py), interleaved, the minimum of
    ``rounds`` rounds (a host draw's jitter is +-30% between single runs); and the layers of a
    decoding call: the public function (argument checks; in eager mode it calls the kvcache_fwd op's
    body directly), the custom op, the op's body, the split forward's launches."""
    from flashtile import flash_attn_varlen_func, flash_attn_with_kvcache, ops
    from flashtile.kernels import launch
    from flashtile.kvcache import kvcache_attention

    lengths = [128, 96, 128, 64]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lengths), 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def varlen_fwd():
        return flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    def varlen_fwd_no_grad():
        with torch.no_grad():
            varlen_fwd()

    # Decoding: one token, 32 query heads over 8 KV heads; a 1k contiguous cache (split in 2) and an
    # 8k paged one for a batch of 8.
    qd = torch.randn(1, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 1024, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(1, 1, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
    q8 = torch.randn(8, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    pages_k, pages_v = (torch.randn(8 * 32, 256, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(8 * 32, device="cuda", dtype=torch.int32).view(8, 32)
    seqlens8 = torch.randint(4000, 8000, (8,), device="cuda", dtype=torch.int32)
    extras, floats, ints = [None] * 6, [d ** -0.5, 0.0], [0, -1, -1, 1, 0]
    q_rows = qd[:, 0].unflatten(1, (8, 4)).transpose(1, 2)
    out, lse = torch.empty_like(q_rows), torch.empty(1, 8, 4, device="cuda")
    seqs = launch.PackedSeqs(None, None, 4, 1024, seqused_k=seqlens,
                             block_table=torch.zeros(1, 1, dtype=torch.int32, device="cuda"))
    params = launch.ScoreParams(softmax_scale=d ** -0.5)
    calls = {
        "varlen fwd, 4 seqs": (varlen_fwd_no_grad, CALLS),
        "varlen fwd+bwd": (lambda: torch.autograd.grad(varlen_fwd(), (q, k, v), dout), 100),
        "decode, 1k cache": (lambda: flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=seqlens), CALLS),
        "decode + append": (lambda: flash_attn_with_kvcache(qd, k_cache, v_cache, k_new, v_new,
                                                            cache_seqlens=seqlens), CALLS),
        "decode, paged 8k x 8": (lambda: flash_attn_with_kvcache(q8, pages_k, pages_v, cache_seqlens=seqlens8,
                                                                 block_table=table), CALLS),
        "  ops.kvcache_fwd (the custom op)": (lambda: ops.kvcache_fwd(qd, k_cache, v_cache, None, None, seqlens, extras,
                                                                       floats, ints), CALLS),
        "  kvcache_attention (op body)": (lambda: kvcache_attention(qd, k_cache, v_cache, None, None, seqlens, *extras,
                                                                    *floats, *ints), CALLS),
        "  attention_forward_split": (lambda: launch.attention_forward_split(q_rows, k_cache, v_cache, out, lse,
                                                                             params, seqs, 2), CALLS),
    }
    best = {(name, plans): float("inf") for name in calls for plans in ("on", "off")}
    with torch.no_grad():
        torch.cuda.synchronize()
    for _ in range(rounds):
        for name, (fn, n) in calls.items():
            for plans in ("on", "off"):
                os.environ["FLASHTILE_LAUNCH_PLANS"] = "1" if plans == "on" else "0"
                grad = torch.enable_grad() if name == "varlen fwd+bwd" else torch.no_grad()
                with grad:
                    best[name, plans] = min(best[name, plans], per_call_us(fn, n))
    del os.environ["FLASHTILE_LAUNCH_PLANS"]
    return {f"{name} (plans {plans})": us for (name, plans), us in best.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    from flashtile import flash_attn_func
    from flashtile.configs import FWD_GLUON
    from flashtile.kernels import launch

    d, s = args.head_dim, args.seqlen
    # The SM clock idles low: a second of matmuls first, so the GPU side is at full speed.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        a @ a
    torch.cuda.synchronize()
    q, k, v = (torch.randn(1, s, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    rows = {}
    rows["flashtile fwd"] = per_call_us(lambda: flash_attn_func(q, k, v))
    rows["flashtile fwd causal"] = per_call_us(lambda: flash_attn_func(q, k, v, causal=True))
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa fa2", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            rows[f"{name} fwd causal"] = per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))

    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def fwd_bwd():
        out = flash_attn_func(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)
    rows["flashtile fwd+bwd causal"] = per_call_us(fwd_bwd, 100)
    qtg, ktg, vtg = (t.detach().clone().requires_grad_() for t in (qt, kt, vt))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        def sdpa_fwd_bwd():
            out = F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True)
            torch.autograd.grad(out, (qtg, ktg, vtg), dout.transpose(1, 2))
        rows["sdpa cudnn fwd+bwd causal"] = per_call_us(sdpa_fwd_bwd, 100)

    # Pieces of the forward's Hopper dispatch.
    params = launch.ScoreParams(softmax_scale=d ** -0.5, window_right=0)
    out = torch.empty_like(q)
    lse = torch.empty((1, 2, s), device="cuda", dtype=torch.float32)
    rows["  option checks (interface)"] = per_call_us(
        lambda: flash_attn_func.__globals__["_score_options"](q, 0.0, None, True, (-1, -1), 0.0, None))
    rows["  torch.empty x2"] = per_call_us(lambda: (torch.empty_like(q), torch.empty((1, 2, s), device="cuda")))
    rows["  gluon_config"] = per_call_us(lambda: launch.gluon_config(FWD_GLUON, q, k, v, params))
    cfg = launch.gluon_config(FWD_GLUON, q, k, v, params)
    if cfg is not None:
        from flashtile.kernels import gluon_forward as gf
        rows["  make_launcher (descriptors)"] = per_call_us(
            lambda: gf.make_launcher(q, k, v, out, lse, params.softmax_scale, True, cfg))
        launcher = gf.make_launcher(q, k, v, out, lse, params.softmax_scale, True, cfg)
        rows["  gluon launch, descriptors built"] = per_call_us(launcher)
        rows["  attention_forward"] = per_call_us(lambda: launch.attention_forward(q, k, v, out, lse, params))

        def launch_and_sync():
            launcher()
            torch.cuda.synchronize()
        rows["  gluon launch + synchronize"] = per_call_us(launch_and_sync)
        rows["  gluon kernel GPU time (do_bench)"] = triton.testing.do_bench(launcher, warmup=50, rep=200) * 1e3
        # A fresh launcher: its first call binds through the JIT function (later ones replay the compiled
        # kernel, kernels/plans.py), which is what the dissection captures.
        rows.update(dissect_jit_launch(gf.gluon_attn_fwd_kernel,
                                       gf.make_launcher(q, k, v, out, lse, params.softmax_scale, True, cfg)))
    from flashtile.configs import override
    with override(fwd_gluon=None):
        rows["portable fwd causal"] = per_call_us(lambda: flash_attn_func(q, k, v, causal=True))

    # Decoding: one token, 32 query heads over 8 KV heads, a 1k cache; with and without appending.
    from flashtile import flash_attn_with_kvcache

    qd = torch.randn(1, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 1024, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(1, 1, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        def decode():
            flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=lengths)
        rows["flashtile decode (kv cache 1k)"] = per_call_us(decode)
        rows["flashtile decode + append"] = per_call_us(
            lambda: flash_attn_with_kvcache(qd, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths))
        with torch.inference_mode():  # skips the version-counter bump of the mutating custom op
            k_cache_inf, v_cache_inf, lengths_inf = (t.clone() for t in (k_cache, v_cache, lengths))
            rows["flashtile decode + append (inference_mode)"] = per_call_us(
                lambda: flash_attn_with_kvcache(qd, k_cache_inf, v_cache_inf, k_new, v_new, cache_seqlens=lengths_inf))
        qdt, kct, vct = qd.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        rows["sdpa decode"] = per_call_us(lambda: F.scaled_dot_product_attention(qdt, kct, vct, enable_gqa=True))

    rows.update(packed_and_decode_rows(d))

    if args.profile:
        with torch.no_grad():
            print_profile(decode, "tottime", 25)
        print_profile(fwd_bwd, "cumulative", 45)

    os.makedirs(args.out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, head_dim=d, seqlen=s,
                calls=CALLS, unit="microseconds of host time per call")
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"host time per call, (1, {s}, 2, {d}) bf16, {meta['gpu']}")
    for name, us in rows.items():
        print(f"  {name:<36} {us:8.1f} us")


if __name__ == "__main__":
    main()
