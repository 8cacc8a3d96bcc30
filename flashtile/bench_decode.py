"""Decoding against a kv cache: flash_attn_with_kvcache's bandwidth next to the GPU's copy bandwidth
and torch SDPA.

    python -m flashtile.bench --decode [--out DIR]

One new query per sequence (seqlen_q 1), 32 query heads over 8 KV heads, head dim 128, bf16, for
batch 1..128 and cache lengths 1k..128k, contiguous and paged (page size 256) caches. The figure of
merit is bandwidth: bytes of K and V read (2 * batch * cache length * 8 * 128 * 2) per second,
against a device-to-device copy measured in the same run (bytes read + written per second: the
bandwidth a streaming kernel gets) and against torch SDPA on the same (contiguous) cache, with its
default backend choice and forced to its cuDNN and FlashAttention-2 backends. Each point is checked
against the math backend first.

Two timings per point: "graph" replays the calls from a CUDA graph (as serving engines run
decoding), so it is the GPU's time alone; "eager" is triton.testing.do_bench on plain calls, which
adds the Python and launch overhead where that is longer than the GPU's time (small caches).
"""

from __future__ import annotations

import json
from pathlib import Path

BATCHES = (1, 8, 32, 64, 128)
CACHE_LENGTHS = (1024, 8192, 32768, 131072)
NHEADS, NHEADS_K, HEAD_DIM, PAGE = 32, 8, 128, 256
MAX_CACHE_BYTES = 24 * 2**30  # skip points whose K + V would not fit comfortably
SYSTEMS = ("flashtile", "flashtile paged", "sdpa", "sdpa cudnn", "sdpa fa2")


def decode_inputs(torch, batch: int, length: int, device: str = "cuda") -> tuple:
    """(q, k_cache, v_cache, cache_seqlens, block_table) of one point: random bf16 q (batch, 1,
    NHEADS, HEAD_DIM) and a full contiguous cache (batch, length, NHEADS_K, HEAD_DIM), and a block
    table that scatters each sequence over shuffled pages of PAGE keys (see paged_copy)."""
    q = torch.randn(batch, 1, NHEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k_cache = torch.randn(batch, length, NHEADS_K, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    pages = length // PAGE
    table = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
    return q, k_cache, v_cache, seqlens, table


def paged_copy(torch, k_cache, v_cache, table) -> tuple:
    """The contiguous caches' contents in paged pools (pages, PAGE, NHEADS_K, HEAD_DIM), laid out
    as ``table`` says."""
    batch, pages = table.shape
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.empty(batch * pages, PAGE, NHEADS_K, HEAD_DIM, device=cache.device, dtype=cache.dtype)
        pool[table.long()] = cache.view(batch, pages, PAGE, NHEADS_K, HEAD_DIM)
        pools.append(pool)
    return tuple(pools)


def graph_time_ms(torch, fn, calls: int = 5, replays: int = 10) -> float:
    """Milliseconds per call of ``fn``, replayed from a CUDA graph of ``calls`` calls (median of 3)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays * calls))
    return sorted(times)[1]


def copy_bandwidth(torch, triton) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of 2 GiB: the memory
    bandwidth a streaming kernel can get, the yardstick for decode, which only reads."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def plot(records: list, copy_gbps: float, path: Path, title: str) -> None:
    """GB/s (CUDA-graph timing) against cache length, one panel per batch, one line per system,
    the copy bandwidth dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in records})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.2 * len(batches), 3.4), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for name in SYSTEMS:
            points = sorted((r["cache"], r["graph_gbps"]) for r in records
                            if r["batch"] == batch and r["system"] == name and "graph_gbps" in r)
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.axhline(copy_gbps, color="gray", linestyle="--", linewidth=1, label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("cache length")
    axes[0][0].set_ylabel("GB/s of K and V read")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args, argv, meta_fn) -> int:
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtile import flash_attn_with_kvcache
    from flashtile.bench import warm_up_gpu

    out_dir = Path(args.out) if args.out else Path(__file__).resolve().parent.parent / "bench" / "results" / "latest"
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = meta_fn({"decode": True, "nheads": NHEADS, "nheads_k": NHEADS_K, "headdim": HEAD_DIM, "page": PAGE})
    warm_up_gpu(args.gpu_warmup_s)
    copy_bw = copy_bandwidth(torch, triton)
    print(f"{meta['gpu']} | copy: {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)

    def sdpa(q, k, v, backend=None):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if backend is None:
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

    records, ok = [], True
    for batch in BATCHES:
        for length in CACHE_LENGTHS:
            kv_bytes = 2 * batch * length * NHEADS_K * HEAD_DIM * 2
            if kv_bytes > MAX_CACHE_BYTES:
                continue
            q, k_cache, v_cache, seqlens, table = decode_inputs(torch, batch, length)
            k_paged, v_paged = paged_copy(torch, k_cache, v_cache, table)
            systems = {
                "flashtile": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
                "flashtile paged": lambda: flash_attn_with_kvcache(q, k_paged, v_paged, cache_seqlens=seqlens,
                                                                   block_table=table),
                "sdpa": lambda: sdpa(q, k_cache, v_cache),
                "sdpa cudnn": lambda: sdpa(q, k_cache, v_cache, SDPBackend.CUDNN_ATTENTION),
                "sdpa fa2": lambda: sdpa(q, k_cache, v_cache, SDPBackend.FLASH_ATTENTION),
            }
            with torch.no_grad():
                # The math backend in float32 on a few sequences (all of them would not fit).
                checked = min(batch, 4)
                expected = sdpa(q[:checked].float(), k_cache[:checked].float(), v_cache[:checked].float(),
                                SDPBackend.MATH)
                for name in SYSTEMS:
                    fn = systems[name]
                    record = dict(system=name, batch=batch, cache=length, kv_bytes=kv_bytes)
                    try:
                        got = fn()[:checked].float()
                        record["rel_err"] = ((got - expected).norm() / expected.norm()).item()
                        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
                        graph_ms = graph_time_ms(torch, fn)
                        record.update(ms=ms, gbps=kv_bytes / (ms * 1e-3) / 1e9, of_copy=kv_bytes / (ms * 1e-3) / copy_bw,
                                      graph_ms=graph_ms, graph_gbps=kv_bytes / (graph_ms * 1e-3) / 1e9,
                                      graph_of_copy=kv_bytes / (graph_ms * 1e-3) / copy_bw)
                        if name.startswith("flashtile"):
                            ok &= record["rel_err"] < 2e-2
                    except Exception as exc:  # reported, not fatal (a backend without a kernel for this)
                        record["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    records.append(record)
                    shown = (f"graph {record['graph_gbps']:5.0f} GB/s ({100 * record['graph_of_copy']:5.1f}% of copy),"
                             f" eager {record['gbps']:5.0f}, rel err {record['rel_err']:.1e}"
                             if "gbps" in record else record["skipped"][:100])
                    print(f"  b={batch:<4} cache={length:<7} {name:<16} {shown}", flush=True)
            q = k_cache = v_cache = k_paged = v_paged = None  # free the point before the next one
            torch.cuda.empty_cache()
    meta["copy_gbps"] = copy_bw / 1e9
    (out_dir / "decode.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    lines = ["| batch | cache | " + " | ".join(SYSTEMS) + " |", "|---|---|" + "---|" * len(SYSTEMS)]
    for batch in BATCHES:
        for length in CACHE_LENGTHS:
            cell = {r["system"]: r for r in records if (r["batch"], r["cache"]) == (batch, length)}
            if not cell:
                continue
            show = (lambda r: f"{r['graph_gbps']:.0f} ({100 * r['graph_of_copy']:.0f}%) / {r['gbps']:.0f}"  # noqa: E731
                    if r and "gbps" in r else "-")
            lines.append(f"| {batch} | {length} | " + " | ".join(show(cell.get(name)) for name in SYSTEMS) + " |")
    header = ["# flashtile decode benchmark", "", f"- GPU: {meta['gpu']}; date (UTC): {meta['date_utc']}; "
              f"flashtile {meta['flashtile_commit']}; torch {meta['torch']}, triton {meta['triton']}",
              f"- command: `python {' '.join(meta['command'])}`",
              f"- seqlen_q 1, {NHEADS} query heads over {NHEADS_K} KV heads, head dim {HEAD_DIM}, bf16, page {PAGE}; "
              f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (bytes read + written per second)",
              "- cells: GB/s of K and V read, from CUDA-graph replay (% of copy bandwidth) / eager calls", ""]
    (out_dir / "decode.md").write_text("\n".join(header + lines) + "\n")
    try:
        plot(records, copy_bw / 1e9, out_dir / "decode.png",
             f"decode, {NHEADS}/{NHEADS_K} heads, d{HEAD_DIM}, bf16, {meta['gpu']} (CUDA-graph timing)")
    except Exception as exc:  # e.g. matplotlib not installed: the numbers matter more than the plot
        print(f"no plot: {exc}")
    print("\n" + "\n".join(lines), flush=True)
    return 0 if ok else 1
