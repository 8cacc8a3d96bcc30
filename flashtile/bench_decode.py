"""Decoding against a kv cache: flash_attn_with_kvcache's bandwidth next to the GPU's copy bandwidth
and torch SDPA.

    python -m flashtile.bench --decode [--out DIR]

One new query per sequence (seqlen_q 1), 32 query heads over 8 KV heads, head dim 128, bf16, for
batch 1..128 and cache lengths 1k..128k, contiguous and paged (page size 256) caches. The figure of
merit is bandwidth: bytes of K and V read (2 * batch * cache length * 8 * 128 * 2) per second,
against a device-to-device copy measured in the same run (bytes read + written per second: the
bandwidth a streaming kernel gets) and against torch SDPA on the same cache (GQA, contiguous only). Each point is checked
against SDPA's output first.
"""

from __future__ import annotations

import json
from pathlib import Path

BATCHES = (1, 8, 32, 64, 128)
CACHE_LENGTHS = (1024, 8192, 32768, 131072)
NHEADS, NHEADS_K, HEAD_DIM, PAGE = 32, 8, 128, 256
MAX_CACHE_BYTES = 24 * 2**30  # skip points whose K + V would not fit comfortably


def copy_bandwidth(torch, triton) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of 2 GiB: the memory
    bandwidth a streaming kernel can get, the yardstick for decode, which only reads."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def run(args, argv, meta_fn) -> int:
    import torch
    import torch.nn.functional as F
    import triton

    from flashtile import flash_attn_with_kvcache
    from flashtile.bench import warm_up_gpu

    out_dir = Path(args.out) if args.out else Path(__file__).resolve().parent.parent / "bench" / "results" / "latest"
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = meta_fn({"decode": True, "nheads": NHEADS, "nheads_k": NHEADS_K, "headdim": HEAD_DIM, "page": PAGE})
    warm_up_gpu(args.gpu_warmup_s)
    copy_bw = copy_bandwidth(torch, triton)
    print(f"{meta['gpu']} | copy: {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    records, ok = [], True
    for batch in BATCHES:
        for length in CACHE_LENGTHS:
            kv_bytes = 2 * batch * length * NHEADS_K * HEAD_DIM * 2
            if kv_bytes > MAX_CACHE_BYTES:
                continue
            q = torch.randn(batch, 1, NHEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            k_cache = torch.randn(batch, length, NHEADS_K, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            pages = length // PAGE
            table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32)
            k_paged = torch.empty(batch * pages, PAGE, NHEADS_K, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            v_paged = torch.empty_like(k_paged)
            k_paged[table.long()] = k_cache.view(batch, pages, PAGE, NHEADS_K, HEAD_DIM)
            v_paged[table.long()] = v_cache.view(batch, pages, PAGE, NHEADS_K, HEAD_DIM)
            qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
            systems = {
                "flashtile": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
                "flashtile paged": lambda: flash_attn_with_kvcache(q, k_paged, v_paged, cache_seqlens=seqlens,
                                                                   block_table=table),
                "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2),
            }
            with torch.no_grad():
                expected = systems["sdpa"]().float()
                for name, fn in systems.items():
                    record = dict(system=name, batch=batch, cache=length, kv_bytes=kv_bytes)
                    try:
                        got = fn().float()
                        record["rel_err"] = ((got - expected).norm() / expected.norm()).item()
                        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
                        record.update(ms=ms, gbps=kv_bytes / (ms * 1e-3) / 1e9,
                                      of_copy=kv_bytes / (ms * 1e-3) / copy_bw)
                        ok &= record["rel_err"] < 2e-2
                    except Exception as exc:  # reported, not fatal
                        record["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    records.append(record)
                    shown = (f"{record['gbps']:7.0f} GB/s ({100 * record['of_copy']:5.1f}% of copy), "
                             f"rel err {record['rel_err']:.1e}" if "gbps" in record else record["skipped"])
                    print(f"  b={batch:<4} cache={length:<7} {name:<16} {shown}", flush=True)
            del q, k_cache, v_cache, k_paged, v_paged
            torch.cuda.empty_cache()
    meta["copy_gbps"] = copy_bw / 1e9
    (out_dir / "decode.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    lines = ["| batch | cache | flashtile GB/s (% copy) | paged | SDPA |", "|---|---|---|---|---|"]
    for batch in BATCHES:
        for length in CACHE_LENGTHS:
            cell = {r["system"]: r for r in records if (r["batch"], r["cache"]) == (batch, length)}
            if not cell:
                continue
            show = lambda r: f"{r['gbps']:.0f} ({100 * r['of_copy']:.0f}%)" if r and "gbps" in r else "-"  # noqa: E731
            lines.append(f"| {batch} | {length} | {show(cell.get('flashtile'))} | {show(cell.get('flashtile paged'))} "
                         f"| {show(cell.get('sdpa'))} |")
    header = ["# flashtile decode benchmark", "", f"- GPU: {meta['gpu']}; date (UTC): {meta['date_utc']}; "
              f"flashtile {meta['flashtile_commit']}; torch {meta['torch']}, triton {meta['triton']}",
              f"- command: `python {' '.join(meta['command'])}`",
              f"- seqlen_q 1, {NHEADS} query heads over {NHEADS_K} KV heads, head dim {HEAD_DIM}, bf16, page {PAGE}; "
              f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (bytes read + written per second)", ""]
    (out_dir / "decode.md").write_text("\n".join(header + lines) + "\n")
    print("\n" + "\n".join(lines), flush=True)
    return 0 if ok else 1
