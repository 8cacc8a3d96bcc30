"""Check an exported C library against flashtile's Python API on the same inputs, on the GPU, and time
both: ``python -m flashtile.export.compare --lib DIR [--json out.json]``.

Each case runs the forward (and the backward) through the Python API and through the C library
(ctypes, capi.py) on the same tensors. Where both run the same kernel with the same config the
results must be bitwise equal; elsewhere (the Python dispatcher sent the call to the portable
kernels) the C result must be as close to the float64 reference as FlashAttention's rule asks
(at most twice the Python path's error, plus a small epsilon). Then forward and backward are timed
through both paths in the same process (CUDA events, median of rounds)."""

import argparse
import ctypes
import json
import statistics
import sys

import torch

from .capi import Library


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    return (r(batch, seqlen_q, nheads, head_dim), r(batch, seqlen_k, nheads_k, head_dim),
            r(batch, seqlen_k, nheads_k, head_dim), r(batch, seqlen_q, nheads, head_dim))


def _python(q, k, v, dout, causal, varlen=None, options=None):
    import flashtile

    options = options or {}
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if varlen is None:
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **options)
    else:
        cu, max_len = varlen
        out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal,
                                                       return_attn_probs=True, **options)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), dq, dk, dv


def _c(lib, q, k, v, dout, causal, varlen=None, options=None):
    out, dq = (torch.full_like(q, float("nan")) for _ in range(2))
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if varlen is None else (q.shape[1], q.shape[0])
    lse = torch.full(lse_shape, float("nan"), device="cuda", dtype=torch.float32)
    extra = {} if varlen is None else dict(cu_seqlens_q=varlen[0], cu_seqlens_k=varlen[0], max_seqlen_q=varlen[1],
                                           max_seqlen_k=varlen[1])
    a = lib.args(q, k, v, out, lse, causal=causal, **extra)
    options = options or {}
    a.window_left, a.window_right = options.get("window_size", (-1, -1))
    a.softcap = options.get("softcap", 0.0)
    slopes = options.get("alibi_slopes")
    if slopes is not None:
        a.alibi_slopes = slopes.data_ptr()
        a.alibi_batch_stride = slopes.stride(0) if slopes.dim() == 2 else 0
    lib.forward(a)
    lib.backward(a, dout, dq, dk, dv)
    return out, lse, dq, dk, dv


def _reference(q, k, v, dout, causal, options=None):
    from ..reference import attention_naive

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out, _ = attention_naive(q64, k64, v64, causal=causal, **(options or {}))
    return (out.detach(), *torch.autograd.grad(out, (q64, k64, v64), dout.double()))


def check_case(lib, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, causal, lengths=None,
               window=(-1, -1), softcap=0.0, alibi=False) -> dict:
    q, k, v, dout = _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    varlen = None
    if lengths is not None:  # packed: the sequences of `lengths`, q / k / v (total, h, d)
        total = sum(lengths)
        q, k, v, dout = (t.reshape(-1, *t.shape[2:])[:total].contiguous() for t in (q, k, v, dout))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        varlen = (cu, max(lengths))
    options = {}
    if window != (-1, -1):
        options["window_size"] = window
    if softcap:
        options["softcap"] = softcap
    if alibi:
        g = torch.Generator(device="cuda").manual_seed(1)
        shape = (nheads,) if lengths is not None else (batch, nheads)
        options["alibi_slopes"] = torch.rand(shape, generator=g, device="cuda") * 0.3
    py = _python(q, k, v, dout, causal, varlen, options)
    c = _c(lib, q, k, v, dout, causal, varlen, options)
    names = ("out", "lse", "dq", "dk", "dv")
    bitwise = {n: bool(torch.equal(a, b)) for n, a, b in zip(names, py, c)}
    result = {"batch": batch, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "nheads": nheads, "nheads_k": nheads_k,
              "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "causal": causal, "lengths": lengths,
              "window": list(window), "softcap": softcap, "alibi": alibi,
              "bitwise": bitwise, "finite": all(bool(t.isfinite().all()) for t in c)}
    if not all(bitwise.values()):
        result["errors"] = rule_errors(py, c, q, k, v, dout, causal, varlen, options=options)
    result["ok"] = result["finite"] and (all(bitwise.values()) or all(e["ok"] for e in result["errors"].values()))
    return result


def rule_errors(py, c, q, k, v, dout, causal, varlen=None, names=("out", "dq", "dk", "dv"), options=None) -> dict:
    """Each result's largest error against the float64 reference, through Python and through C, and
    whether C's is within FlashAttention's rule (at most twice Python's, plus 1e-5). ``py`` / ``c``:
    (out, lse, dq, dk, dv), the gradients optional."""
    index = {"out": 0, "dq": 2, "dk": 3, "dv": 4}
    spans = [(0, q.shape[1])] if varlen is None else list(zip(varlen[0][:-1].tolist(), varlen[0][1:].tolist()))
    errors = {}
    refs = []
    for s, e in spans:
        pieces = (q, k, v, dout) if varlen is None else tuple(t[s:e][None] for t in (q, k, v, dout))
        opts = dict(options or {})
        if varlen is not None and "alibi_slopes" in opts and opts["alibi_slopes"].dim() == 2:
            opts["alibi_slopes"] = opts["alibi_slopes"][len(refs)]
        refs.append(_reference(*pieces, causal, opts) if e > s else None)
    for n in names:
        i = index[n]
        if len(py) <= i:
            continue
        err_py = err_c = 0.0
        for (s, e), ref in zip(spans, refs):
            if ref is None:
                continue
            a, b = (py[i], c[i]) if varlen is None else (py[i][s:e][None], c[i][s:e][None])
            r = ref[{0: 0, 2: 1, 3: 2, 4: 3}[i]]
            err_py = max(err_py, (a.double() - r).abs().max().item())
            err_c = max(err_c, (b.double() - r).abs().max().item())
        errors[n] = {"python": err_py, "c": err_c, "ok": err_c <= 2 * err_py + 1e-5}
    return errors


def _median_ms(fn, rounds=5, iters=10) -> float:
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def time_case(lib, batch, seqlen, nheads, head_dim, dtype, causal) -> dict:
    import flashtile

    q, k, v, dout = _qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, dtype)
    out, dq, dk, dv = torch.empty_like(q), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lse = torch.empty(batch, nheads, seqlen, device="cuda", dtype=torch.float32)
    a = lib.args(q, k, v, out, lse, causal=causal)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    py_out = flashtile.flash_attn_func(qg, kg, vg, causal=causal)
    flops = 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
    def py_bwd():
        torch.autograd.grad(py_out, (qg, kg, vg), dout, retain_graph=True)
    paths = {"c_fwd": (lambda: lib.forward(a), flops),
             "python_fwd": (lambda: flashtile.flash_attn_func(q, k, v, causal=causal), flops),
             "c_bwd": (lambda: lib.backward(a, dout, dq, dk, dv), 2.5 * flops),
             "python_bwd": (py_bwd, 2.5 * flops)}
    for fn, _ in paths.values():
        fn()  # warm up (the C library loads its modules on first use)
    row = {"batch": batch, "seqlen": seqlen, "nheads": nheads, "head_dim": head_dim, "causal": causal,
           "dtype": str(dtype).replace("torch.", "")}
    # Rounds alternate between the paths, so clocks and temperature treat them alike.
    samples = {name: [] for name in paths}
    for _ in range(7):
        for name, (fn, _) in paths.items():
            samples[name].append(_median_ms(fn, rounds=1, iters=10))
    for name, (_, work) in paths.items():
        ms = statistics.median(samples[name])
        row[name + "_ms"] = round(ms, 4)
        row[name + "_tflops"] = round(work / ms / 1e9, 1)
    return row


CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, lengths
    (2, 1024, 1024, 8, 8, 128, False, None), (2, 1024, 1024, 8, 8, 128, True, None),
    (2, 1023, 1023, 8, 2, 128, True, None), (1, 113, 1023, 4, 1, 64, True, None),
    (2, 1, 1023, 8, 8, 64, False, None), (2, 4096, 4096, 4, 4, 64, True, None), (3, 777, 777, 6, 3, 64, False, None),
    (2, 2048, 2048, 4, 4, 64, False, None), (1, 1024, 4096, 4, 4, 128, True, None),
    (8, 1024, 1024, 8, 2, 128, True, [1, 113, 1023, 517, 64, 2000]),
    (8, 1024, 1024, 8, 2, 64, True, [1, 113, 1023, 517, 64, 2000]),
    (8, 1024, 1024, 8, 8, 64, False, [700, 33, 1024]),
]

# Score options (the portable entries; export with --features window,softcap,alibi):
# batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, lengths, window, softcap, alibi
OPTION_CASES = [
    (2, 1024, 1024, 8, 2, 128, False, None, (256, 0), 0.0, False),
    (2, 777, 777, 8, 8, 128, True, None, (128, -1), 0.0, False),
    (2, 1024, 1024, 4, 4, 128, False, None, (-1, -1), 30.0, False),
    (2, 1023, 1023, 4, 2, 128, True, None, (-1, -1), 0.0, True),
    (2, 512, 512, 4, 4, 128, False, None, (64, 32), 20.0, True),
    (8, 1024, 1024, 8, 2, 128, True, [1, 113, 1023, 517], (-1, -1), 30.0, True),
    (8, 1024, 1024, 8, 2, 128, False, [1, 1, 1, 1], (64, 0), 0.0, False),
    (2, 333, 333, 4, 4, 40, True, None, (-1, -1), 0.0, False),
    (2, 333, 333, 4, 2, 40, False, None, (64, 16), 10.0, True),
]


def check_kvcache_case(lib, batch, seqlen_q, seqlen_new, nheads, nheads_k, head_dim, dtype, causal, page_size=256,
                       pages_per_seq=16, num_splits=0, window=(-1, -1), softcap=0.0, alibi=False, seed=0) -> dict:
    """flash_attn_with_kvcache through Python and the C library's kv-cache call on the same paged
    cache (pages shuffled), appending ``seqlen_new`` tokens: the caches after the update must be
    bitwise equal, out and lse bitwise or within FlashAttention's rule of the float64 reference."""
    import flashtile
    from ..reference import attention_naive

    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    num_pages = batch * pages_per_seq + 3
    capacity = pages_per_seq * page_size
    k_cache, v_cache = r(num_pages, page_size, nheads_k, head_dim), r(num_pages, page_size, nheads_k, head_dim)
    table = torch.randperm(num_pages, generator=g, device="cuda")[:batch * pages_per_seq].view(batch, -1)
    table = table.to(torch.int32).contiguous()
    lens = torch.randint(0, capacity - seqlen_new + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)
    q = r(batch, seqlen_q, nheads, head_dim)
    k_new, v_new = (r(batch, seqlen_new, nheads_k, head_dim) if seqlen_new else None for _ in range(2))
    options = {"window_size": window, "softcap": softcap}
    if alibi:
        options["alibi_slopes"] = torch.rand((batch, nheads), generator=g, device="cuda") * 0.3
    kc_py, vc_py = k_cache.clone(), v_cache.clone()
    out_py, lse_py = flashtile.flash_attn_with_kvcache(q, kc_py, vc_py, k_new, v_new, cache_seqlens=lens,
                                                       block_table=table, causal=causal, num_splits=num_splits,
                                                       return_softmax_lse=True, **options)
    kc_c, vc_c = k_cache.clone(), v_cache.clone()
    out_c = torch.full_like(q, float("nan"))
    lse_c = torch.full((batch, nheads, seqlen_q), float("nan"), device="cuda")
    a = lib.kvcache_args(q, kc_c, vc_c, out_c, lens, table, k_new, v_new, lse_c, causal=causal,
                         num_splits=num_splits, **options)
    lib.kvcache_forward(a)
    torch.cuda.synchronize()
    bitwise = {"k_cache": bool(torch.equal(kc_py, kc_c)), "v_cache": bool(torch.equal(vc_py, vc_c)),
               "out": bool(torch.equal(out_py, out_c)), "lse": bool(torch.equal(lse_py, lse_c))}
    result = {"batch": batch, "seqlen_q": seqlen_q, "seqlen_new": seqlen_new, "nheads": nheads, "nheads_k": nheads_k,
              "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "causal": causal,
              "page_size": page_size, "capacity": capacity, "num_splits": num_splits, "window": list(window),
              "softcap": softcap, "alibi": alibi, "bitwise": bitwise, "finite": bool(out_c.isfinite().all())}
    if not (bitwise["out"] and bitwise["lse"]):
        err_py = err_c = 0.0
        for b in range(batch):
            n = int(lens[b]) + seqlen_new
            rows = torch.arange(n, device="cuda")
            pages, offsets = table[b][rows // page_size].long(), rows % page_size
            keys, values = kc_py[pages, offsets][None], vc_py[pages, offsets][None]
            opts = dict(options)
            if alibi:
                opts["alibi_slopes"] = options["alibi_slopes"][b]
            ref, _ = attention_naive(q[b:b + 1], keys, values, causal=causal, **opts)
            err_py = max(err_py, (out_py[b:b + 1].double() - ref).abs().max().item())
            err_c = max(err_c, (out_c[b:b + 1].double() - ref).abs().max().item())
        result["errors"] = {"out": {"python": err_py, "c": err_c, "ok": err_c <= 2 * err_py + 1e-5}}
    result["ok"] = (result["finite"] and bitwise["k_cache"] and bitwise["v_cache"]
                    and (bitwise["out"] and bitwise["lse"] or result["errors"]["out"]["ok"]))
    return result


def time_kvcache(lib, batch, cache_len, nheads, nheads_k, head_dim, dtype, page_size=256) -> dict:
    """One decoding step (1 query and 1 new token per sequence, causal, automatic splits) through
    both paths: the time per call with its host work (back-to-back calls), median of rounds."""
    import flashtile

    pages_per_seq = -(-(cache_len + 1) // page_size)
    num_pages = batch * pages_per_seq
    k_cache = torch.randn(num_pages, page_size, nheads_k, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(num_pages, dtype=torch.int32, device="cuda").view(batch, -1)
    lens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, nheads, head_dim, device="cuda", dtype=dtype)
    k_new, v_new = (torch.randn(batch, 1, nheads_k, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    out = torch.empty_like(q)
    a = lib.kvcache_args(q, k_cache, v_cache, out, lens, table, k_new, v_new, causal=True)
    size = ctypes.c_size_t()
    lib.lib.flashtile_kvcache_forward_workspace_size(ctypes.byref(a), ctypes.byref(size))
    ws = torch.empty(max(size.value, 1), dtype=torch.uint8, device="cuda")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream or None)

    def c_step():
        lib.lib.flashtile_kvcache_forward(ctypes.byref(a), ctypes.c_void_p(ws.data_ptr()), ctypes.c_size_t(size.value),
                                          stream)
    paths = {"c": c_step, "python": lambda: flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table, causal=True)}
    for fn in paths.values():
        fn()
    samples = {name: [] for name in paths}
    for _ in range(7):
        for name, fn in paths.items():
            samples[name].append(_median_ms(fn, rounds=1, iters=20))
    kv_bytes = 2 * batch * (cache_len + 1) * nheads_k * head_dim * k_cache.element_size()
    row = {"batch": batch, "cache_len": cache_len, "nheads": nheads, "nheads_k": nheads_k, "head_dim": head_dim,
           "dtype": str(dtype).replace("torch.", ""), "page_size": page_size}
    for name in paths:
        ms = statistics.median(samples[name])
        row[f"{name}_us"] = round(ms * 1000, 1)
        row[f"{name}_gbps"] = round(kv_bytes / ms / 1e6, 0)
    return row


# batch, seqlen_q, seqlen_new, nheads, nheads_k, head_dim, causal, num_splits (export with kvcache)
KVCACHE_CASES = [
    (2, 1, 1, 8, 2, 128, True, 0),    # decoding, GQA heads as rows, automatic splits
    (4, 1, 1, 8, 8, 64, False, 0),
    (3, 1, 2, 8, 1, 128, True, 1),    # MQA as rows, no split
    (2, 4, 4, 8, 2, 128, True, 0),    # speculative rows
    (2, 40, 40, 4, 1, 64, True, 1),   # a chunk of prefill against the cache
    (2, 100, 0, 4, 4, 128, False, 3),  # no new tokens, 3 splits
]
# ... with score options (export with kvcache and window, softcap, alibi):
# batch, seqlen_q, seqlen_new, nheads, nheads_k, head_dim, causal, num_splits, window, softcap, alibi
KVCACHE_OPTION_CASES = [
    (2, 1, 1, 8, 2, 128, True, 0, (256, 0), 0.0, False),
    (2, 3, 3, 8, 2, 128, False, 0, (-1, -1), 30.0, True),
    (2, 20, 20, 4, 4, 128, True, 1, (64, -1), 0.0, True),
]


def check_dump(directory: str) -> dict:
    """The files an example wrote with --dump (examples/c): its inputs through the Python API, compared
    with its outputs (bitwise, else FlashAttention's rule against the float64 reference)."""
    import os

    import numpy as np

    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    dtype = torch.bfloat16 if meta["dtype"] == "bf16" else torch.float16

    def load(name, shape, dt=dtype):
        raw = np.fromfile(os.path.join(directory, name), dtype=np.int16 if dt != torch.float32 else np.float32)
        return torch.from_numpy(raw).view(dt).reshape(shape).cuda()
    h, hk, d = meta["heads"], meta["heads_k"], meta["head_dim"]
    lengths = meta.get("lengths")
    if lengths:
        total = sum(lengths)
        q, k, v = load("q.bin", (total, h, d)), load("k.bin", (total, hk, d)), load("v.bin", (total, hk, d))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        import flashtile

        out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                       causal=meta["causal"], return_attn_probs=True)
        theirs = {"out": load("out.bin", (total, h, d)), "lse": load("lse.bin", (h, total), torch.float32)}
        ours = {"out": out, "lse": lse}
    else:
        b, sq, sk = meta["batch"], meta["seqlen_q"], meta["seqlen_k"]
        q, dout = load("q.bin", (b, sq, h, d)), load("dout.bin", (b, sq, h, d))
        k, v = load("k.bin", (b, sk, hk, d)), load("v.bin", (b, sk, hk, d))
        py = _python(q, k, v, dout, meta["causal"])
        ours = dict(zip(("out", "lse", "dq", "dk", "dv"), py))
        theirs = {"out": load("out.bin", q.shape), "lse": load("lse.bin", (b, h, sq), torch.float32),
                  "dq": load("dq.bin", q.shape), "dk": load("dk.bin", k.shape), "dv": load("dv.bin", v.shape)}
    result = {"dump": directory, "bitwise": {n: bool(torch.equal(ours[n], theirs[n])) for n in ours},
              "max_abs_diff": {n: (ours[n].float() - theirs[n].float()).abs().max().item() for n in ours}}
    if not all(result["bitwise"].values()):
        names = ("out", "lse", "dq", "dk", "dv")
        varlen = (cu, max(lengths)) if lengths else None
        dout_ = torch.zeros_like(q) if lengths else dout
        result["errors"] = rule_errors(tuple(ours[n] for n in names if n in ours),
                                       tuple(theirs[n] for n in names if n in theirs), q, k, v, dout_,
                                       meta["causal"], varlen, names=[n for n in ("out", "dq", "dk", "dv") if n in ours])
    result["ok"] = all(result["bitwise"].values()) or all(e["ok"] for e in result["errors"].values())
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtile.export.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", help="an export directory (or libflashtile.so)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--dump", nargs="*", default=[], help="example --dump directories to check instead")
    parser.add_argument("--varlen-only", action="store_true", help="only the packed-batch cases")
    args = parser.parse_args(argv)
    if args.dump:
        results = [check_dump(d) for d in args.dump]
        for r in results:
            print(f"{'ok  ' if r['ok'] else 'DIFF'} {r['dump']}: bitwise {r['bitwise']} max diff {r['max_abs_diff']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0 if all(r["ok"] for r in results) else 1
    if not args.lib:
        parser.error("--lib is required (or --dump)")
    lib = Library(args.lib)
    exported = lib.build_info()
    cases, timings = [], []
    features = exported.split("features:")[1].split("\n")[0]
    dense = "forward" in features and "backward" in features
    for dtype in (torch.bfloat16, torch.float16) if dense else ():
        if ("bf16" if dtype == torch.bfloat16 else "fp16") not in exported.split("dtypes:")[1].split(";")[0]:
            continue
        for b, sq, sk, h, hk, d, causal, lengths in CASES:
            if args.varlen_only and not lengths:
                continue
            if f" {d}," not in f" {exported.split('head dims:')[1].split(';')[0].strip()},":
                continue
            r = check_case(lib, b, sq, sk, h, hk, d, dtype, causal, lengths)
            cases.append(r)
            same = "bitwise" if all(r["bitwise"].values()) else "rule" if r["ok"] else "FAIL"
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['dtype']} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} "
                  f"{'causal' if causal else 'full'}{' varlen' if lengths else ''}: {same}", flush=True)
    for dtype in (torch.bfloat16,) if dense else ():
        for b, sq, sk, h, hk, d, causal, lengths, window, softcap, alibi in OPTION_CASES:
            if args.varlen_only and not lengths:
                continue
            heads = exported.split("head dims:")[1].split(";")[0]
            if f" {d}," not in f" {heads}," or (window != (-1, -1) and "window" not in features) or \
                    (softcap and "softcap" not in features) or (alibi and "alibi" not in features) or \
                    (lengths and "varlen" not in features):
                continue
            r = check_case(lib, b, sq, sk, h, hk, d, dtype, causal, lengths, window, softcap, alibi)
            cases.append(r)
            same = "bitwise" if all(r["bitwise"].values()) else "rule" if r["ok"] else "FAIL"
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['dtype']} b{b} sq{sq} h{h}/{hk} d{d} {'causal' if causal else ''} "
                  f"window {window} softcap {softcap} alibi {alibi}{' varlen' if lengths else ''}: {same}", flush=True)
    if "kvcache" in features:
        heads = exported.split("head dims:")[1].split(";")[0]
        pages = exported.split("page sizes:")[1].split("\n")[0] if "page sizes:" in exported else " 256"
        page_size = int(pages.split(",")[0])
        for b, sq, new, h, hk, d, causal, splits, *opts in ([c + ((-1, -1), 0.0, False) for c in KVCACHE_CASES]
                                                          + KVCACHE_OPTION_CASES):
            window, softcap, alibi = opts
            if f" {d}," not in f" {heads}," or (window != (-1, -1) and "window" not in features) or \
                    (softcap and "softcap" not in features) or (alibi and "alibi" not in features) or args.varlen_only:
                continue
            for dtype in (torch.bfloat16, torch.float16):
                if ("bf16" if dtype == torch.bfloat16 else "fp16") not in exported.split("dtypes:")[1].split(";")[0]:
                    continue
                r = check_kvcache_case(lib, b, sq, new, h, hk, d, dtype, causal, page_size, num_splits=splits,
                                       window=window, softcap=softcap, alibi=alibi)
                cases.append(r)
                same = "bitwise" if all(r["bitwise"].values()) else "rule" if r["ok"] else "FAIL"
                print(f"{'ok  ' if r['ok'] else 'FAIL'} kvcache {r['dtype']} b{b} sq{sq} new{new} h{h}/{hk} d{d} "
                      f"{'causal' if causal else 'full'} splits {splits} window {window} softcap {softcap} alibi "
                      f"{alibi}: {same}", flush=True)
        if not args.no_timing and " 128," in f" {heads},":
            for batch, cache_len in ((1, 8192), (8, 8192), (64, 8192), (8, 32768)):
                t = time_kvcache(lib, batch, cache_len, 32, 8, 128, torch.bfloat16, page_size)
                timings.append(t)
                print(f"kvcache decode step d128 32/8 heads, batch {batch}, {cache_len} keys: C {t['c_us']} us "
                      f"({t['c_gbps']} GB/s) vs Python {t['python_us']} us ({t['python_gbps']} GB/s)", flush=True)
    if not args.no_timing and dense:
        for seqlen, batch in ((4096, 4), (16384, 1)):
            timings.append(time_case(lib, batch, seqlen, 16, 128, torch.bfloat16, True))
            t = timings[-1]
            print(f"d128 causal bf16 {batch}x{seqlen}, 16 heads: fwd C {t['c_fwd_ms']:.3f} ms "
                  f"({t['c_fwd_tflops']}) vs Python {t['python_fwd_ms']:.3f} ({t['python_fwd_tflops']}); bwd C "
                  f"{t['c_bwd_ms']:.3f} ({t['c_bwd_tflops']}) vs Python {t['python_bwd_ms']:.3f} "
                  f"({t['python_bwd_tflops']}) TFLOP/s", flush=True)
    failed = sum(not r["ok"] for r in cases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"build_info": exported, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cases": cases, "timings": timings}, f, indent=1)
    print(f"compare: {len(cases) - failed} of {len(cases)} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
