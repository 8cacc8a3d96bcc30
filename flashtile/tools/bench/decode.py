"""``bench decode``: decoding's bandwidth through flashtile's three entry points (flash_attn_with_kvcache
on a contiguous and a paged cache, flash_attn_func on the contiguous cache, flash_attn_varlen_func on
it and on the paged cache) next to the copy bandwidth and the anchors.

A few new queries per sequence (--seqlen-q, a list, default 1; more is speculative decoding, causal
and bottom-right aligned unless --causal says otherwise), 32 query heads over 8 KV heads, head dim
128, bf16, for batch 1..128 and cache lengths 1k..128k, contiguous and paged (page 256) caches. The
figure of merit is bandwidth: bytes of K and V read (2 * batch * cache * heads_k * headdim * 2) per second, against a
device-to-device copy measured in the same run (bytes read + written per second: what a streaming
kernel gets) and against the anchors on the same contiguous cache: torch SDPA with its own backend
choice, pinned to cuDNN and to FlashAttention-2, and FlashAttention-4 where it imports. Each point
is checked against SDPA's math backend in float32 first.

Two timings per point: "graph" replays the calls from a CUDA graph (as serving engines decode), so
it is the GPU's time alone; "eager" is do_bench on plain calls, which adds the Python and launch
overhead where that is longer than the GPU's time (small caches). The ratios take flashtile's slowest
entry point among flash_attn_with_kvcache (contiguous), flash_attn_func and flash_attn_varlen_func
against each anchor, and against the best anchor of the point, in both timings.
"""

from __future__ import annotations

import argparse

from . import anchors
from .common import (fill_defaults, CAUSAL_CHOICES, add_common_arguments, check_out_dir, check_smoke_sizes,
                     choice_list, collect_meta, default_out_dir, do_bench_ms, failure_reason, free_device_memory,
                     parse_size, Progress, relative_error, require_torch, run_device, size_list, warm_up_gpu,
                     write_json)
from .report import Table, geomean, render_text, save_plot, skipped_notes, write_markdown

PROG = "python -m flashtile bench decode"
# flashtile's entry points: flash_attn_with_kvcache on a contiguous and on a paged cache, and the
# dense and packed calls (flash_attn_func, flash_attn_varlen_func) that much serving code decodes with,
# the packed call also over the paged cache (block_table).
LAYOUTS = ("contiguous", "paged", "func", "varlen", "varlen-paged")
OWN_SYSTEMS = {"contiguous": "flashtile", "paged": "flashtile-paged", "func": "flashtile-func",
               "varlen": "flashtile-varlen", "varlen-paged": "flashtile-varlen-paged"}
PAGED_SYSTEMS = ("flashtile-paged", "flashtile-varlen-paged")
# The entry points the ratios compare (the anchors read the contiguous cache, so the paged layouts are shown alone).
ENTRY_POINTS = ("flashtile", "flashtile-func", "flashtile-varlen")
ANCHORS = {
    "sdpa": "torch SDPA, its own backend choice",
    "cudnn": "torch SDPA, CUDNN_ATTENTION backend",
    "fa2": "torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)",
    "fa4": "FlashAttention-4 flash_attn_func on the contiguous cache (flash_attn.cute)",
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}
CHECKED_SEQUENCES = 4  # the float32 reference runs on this many sequences (all of them would not fit)
SMOKE_DEFAULTS = {"batches": [2], "cache_lens": [64], "heads": 4, "heads_k": 2, "headdim": 32, "page": 16,
                  "dtype": "fp16"}
# ... and a GPU run's.
GPU_DEFAULTS = {
    "batches": [1, 8, 32, 64, 128],
    "cache_lens": [1024, 8192, 32768, 131072],
    "heads": 32,
    "heads_k": 8,
    "headdim": 128,
    "page": 256,
    "dtype": "bf16",
}


def decode_inputs(torch, batch: int, length: int, seqlen_q: int, nheads: int, nheads_k: int, headdim: int,
                  page: int, dtype, device: str = "cuda") -> tuple:
    """(q, k_cache, v_cache, cache_seqlens, block_table) of one point: a full contiguous cache and a
    block table that scatters each sequence over shuffled pages (see paged_copy)."""
    q = torch.randn(batch, seqlen_q, nheads, headdim, device=device, dtype=dtype)
    k_cache = torch.randn(batch, length, nheads_k, headdim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    pages = length // page
    table = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
    return q, k_cache, v_cache, seqlens, table


def paged_copy(torch, k_cache, v_cache, table) -> tuple:
    """The contiguous caches' contents in paged pools (pages, page, heads_k, headdim), laid out as ``table`` says."""
    batch, pages = table.shape
    page = k_cache.shape[1] // pages
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.empty(batch * pages, page, *cache.shape[2:], device=cache.device, dtype=cache.dtype)
        pool[table.long()] = cache.view(batch, pages, page, *cache.shape[2:])
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


def copy_bandwidth(torch) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of 2 GiB."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src), 25, 200)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def sdpa(q, k, v, backend=None, causal: bool = False):
    """SDPA on (b, s, h, d) tensors, GQA, bottom-right causal; ``backend`` pins one SDPBackend."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kwargs = {"enable_gqa": qt.shape[1] != kt.shape[1]}
    if causal and qt.shape[2] > 1:
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(qt.shape[2], kt.shape[2])
    if backend is None:
        return F.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)


def point_systems(names: list[str], q, k_cache, v_cache, seqlens, table, k_paged, v_paged, causal: bool) -> dict:
    """{system: zero-argument call} for one point; the anchors read the contiguous cache."""
    from torch.nn.attention import SDPBackend

    from flashtile import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    calls = {
        "flashtile": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal),
        "flashtile-paged": lambda: flash_attn_with_kvcache(q, k_paged, v_paged, cache_seqlens=seqlens,
                                                           block_table=table, causal=causal),
        "flashtile-func": lambda: flash_attn_func(q, k_cache, v_cache, causal=causal),
    }
    if "flashtile-varlen" in names or "flashtile-varlen-paged" in names:  # packed views and prefix sums, once
        import torch

        batch, seqlen_q, length = q.shape[0], q.shape[1], k_cache.shape[1]
        cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
        cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device=q.device) * length
        q_packed, k_packed, v_packed = (t.flatten(0, 1) for t in (q, k_cache, v_cache))
        calls["flashtile-varlen"] = lambda: flash_attn_varlen_func(
            q_packed, k_packed, v_packed, cu_q, cu_k, seqlen_q, length, causal=causal).view(q.shape)
        calls["flashtile-varlen-paged"] = lambda: flash_attn_varlen_func(
            q_packed, k_paged, v_paged, cu_q, cu_k, seqlen_q, length, causal=causal,
            block_table=table).view(q.shape)
    calls.update({
        "sdpa": lambda: sdpa(q, k_cache, v_cache, causal=causal),
        "cudnn": lambda: sdpa(q, k_cache, v_cache, SDPBackend.CUDNN_ATTENTION, causal),
        "fa2": lambda: sdpa(q, k_cache, v_cache, SDPBackend.FLASH_ATTENTION, causal),
    })
    found = anchors.fa4()
    if found.available:
        calls["fa4"] = lambda: anchors.fa4_output(found.module.flash_attn_func(q, k_cache, v_cache, causal=causal))
    return {name: calls[name] for name in names}


def system_names(layouts: list[str], anchor_names: list[str]) -> list[str]:
    own = [OWN_SYSTEMS[layout] for layout in layouts]
    return own + [name for name in anchor_names if name != "fa4" or anchors.fa4().available]


def anchor_status(names: list[str]) -> dict[str, str]:
    return {name: (anchors.fa4().status if name == "fa4" else f"run ({ANCHORS[name]})") for name in names}


def point_key(record: dict) -> tuple:
    return record["batch"], record["cache"], record["seqlen_q"], record["causal"]


def slowest_entry(cells: dict, systems: list[str], field: str) -> float | None:
    """The lowest GB/s (``field``) among flashtile's entry points in ``cells``; None if one has none."""
    values = [cells.get(s, {}).get(field) for s in systems if s in ENTRY_POINTS]
    return min(values) if values and all(values) else None


def build_table(records: list[dict], systems: list[str], timing: bool) -> Table:
    """GB/s from CUDA-graph replay (% of copy) / eager, per system; flashtile's slowest entry point
    against each anchor (graph) and against the point's best anchor (graph and eager)."""
    others = [s for s in systems if not s.startswith("flashtile")]
    header = ["batch", "cache", "sq", "causal", *systems, *(f"ft/{s}" for s in others)]
    if others:
        header += ["ft/best", "ft/best eager"]
    header.append("ok")
    ratios: dict = {}
    rows = []
    for key in sorted({point_key(r) for r in records}):
        cells = {r["system"]: r for r in records if point_key(r) == key}
        row = [str(k) for k in key[:3]] + ["yes" if key[3] else "no"]
        for system in systems:
            r = cells.get(system)
            if r is None:
                row.append("-")
            elif r.get("graph_gbps") is not None:
                row.append(f"{r['graph_gbps']:.0f} ({100 * r['graph_of_copy']:.0f}%) / {r['gbps']:.0f}")
            elif r.get("rel_err") is not None and not timing:
                row.append(f"{r['rel_err']:.1e}")
            else:
                row.append("skip")
        ft = slowest_entry(cells, systems, "graph_gbps")
        for other in others:
            ref = cells.get(other, {}).get("graph_gbps")
            if ft and ref:
                ratios.setdefault(other, []).append(ft / ref)
            row.append(f"{ft / ref:.2f}" if ft and ref else "-")
        for field, label in (("graph_gbps", "best"), ("gbps", "best eager")):
            if not others:
                break
            mine = slowest_entry(cells, systems, field)
            best = max((cells.get(o, {}).get(field) or 0 for o in others), default=0)
            if mine and best:
                ratios.setdefault(label, []).append(mine / best)
            row.append(f"{mine / best:.2f}" if mine and best else "-")
        failing = [s for s in systems if cells.get(s, {}).get("ok") is False]
        row.append("FAIL:" + ",".join(failing) if failing else "ok")
        rows.append(row)
    notes = []
    entries = [s for s in systems if s in ENTRY_POINTS]
    if timing:
        notes.append("cells: GB/s of K and V read, CUDA-graph replay (% of copy bandwidth) / eager calls; ft/x: the "
                     f"slowest of {', '.join(entries)} against x (graph timings); ft/best: against the point's "
                     "fastest anchor (graph / eager timings)")
    parts = [f"{o} {geomean(v):.2f} (min {min(v):.2f})" for o, v in ratios.items()]
    if parts:
        notes.append("geomean flashtile/x: " + ", ".join(parts))
    notes += skipped_notes((r["system"], r.get("skipped")) for r in records)
    return Table(header=header, rows=rows, notes=notes)


def draw_plot(records: list[dict], systems: list[str], copy_gbps: float, title: str):
    """GB/s (graph timing) against cache length: a row of panels per (query rows, causal), one panel
    per batch, the copy bandwidth dashed."""

    def draw(plt):
        batches = sorted({r["batch"] for r in records})
        variants = sorted({(r["seqlen_q"], r["causal"]) for r in records})
        fig, axes = plt.subplots(len(variants), len(batches), figsize=(3.2 * len(batches), 3.0 * len(variants)),
                                 sharey=True, squeeze=False)
        for axes_row, (seqlen_q, causal) in zip(axes, variants):
            for ax, batch in zip(axes_row, batches):
                for name in systems:
                    points = sorted((r["cache"], r["graph_gbps"]) for r in records
                                    if (r["batch"], r["seqlen_q"], r["causal"], r["system"]) ==
                                    (batch, seqlen_q, causal, name) and r.get("graph_gbps"))
                    if points:
                        ax.plot(*zip(*points), marker="o", label=name)
                ax.axhline(copy_gbps, color="gray", linestyle="--", linewidth=1, label="copy")
                ax.set_xscale("log", base=2)
                ax.set_title(f"batch {batch}, {seqlen_q} q{', causal' if causal else ''}", fontsize=8)
            axes_row[0].set_ylabel("GB/s of K and V read")
        for ax in axes[-1]:
            ax.set_xlabel("cache length")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        return fig

    return draw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--batches", type=size_list, default=None, help="batch sizes (default: 1,8,32,64,128)")
    add("--cache-lens", type=size_list, default=None, help="cache lengths (default: 1k,8k,32k,128k)")
    add("--seqlen-q", type=size_list, default=[1], help="new queries per sequence, a list (default: 1)")
    add("--causal", choices=tuple(CAUSAL_CHOICES), default="true",
        help="above one query per sequence: causal (bottom-right aligned), not, or both (default: %(default)s)")
    add("--heads", type=int, default=None, help="query heads (default: 32)")
    add("--heads-k", type=int, default=None, help="key/value heads, dividing --heads (default: 8)")
    add("--headdim", type=int, default=None, help="head dim (default: 128)")
    add("--page", type=parse_size, default=None, help="page size of the paged cache (default: 256)")
    add("--layouts", type=choice_list(LAYOUTS), default=list(LAYOUTS),
        help="flashtile's entry points: contiguous and paged (flash_attn_with_kvcache), func "
             "(flash_attn_func on the contiguous cache), varlen (flash_attn_varlen_func on it, packed), "
             "varlen-paged (flash_attn_varlen_func on the paged cache, block_table) (default: all)")
    add("--dtype", choices=tuple(DTYPES), default=None, help="input dtype (default: bf16; fp16 when smoke)")
    add("--anchors", type=lambda t: [] if t.strip() == "none" else choice_list(ANCHORS, allow_empty=True)(t),
        default=None, help="anchors timed in the same run: " + ", ".join(f"{k} ({v})" for k, v in ANCHORS.items())
                           + "; 'none' for flashtile alone (default: all; none with --interpret-smoke)")
    add("--rounds", type=int, default=2,
        help="timing rounds: the systems of a point take turns in each; the fastest round is kept "
             "(default: %(default)s)")
    add("--max-cache-gib", type=float, default=24.0,
        help="skip points whose K + V exceed this many GiB (default: %(default)s)")
    add_common_arguments(parser)


def resolve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    fill_defaults(args, SMOKE_DEFAULTS, GPU_DEFAULTS, ANCHORS)
    if args.heads < 1 or args.heads_k < 1 or args.heads % args.heads_k:
        parser.error(f"--heads-k {args.heads_k} does not divide --heads {args.heads}")
    for length in args.cache_lens:
        if length % args.page:
            parser.error(f"cache length {length} is not a multiple of --page {args.page}")
        if length < max(args.seqlen_q):
            parser.error(f"cache length {length} is shorter than --seqlen-q {max(args.seqlen_q)}")
    # One query row sees every key either way: it runs once, not causal.
    args.variants = [(rows, causal) for rows in args.seqlen_q
                     for causal in ([False] if rows == 1 else CAUSAL_CHOICES[args.causal])]
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    check_smoke_sizes(parser, args, (*args.batches, *args.cache_lens, args.headdim, *args.seqlen_q))
    return args


def run(args: argparse.Namespace, command: list[str]) -> int:
    torch = require_torch(PROG)
    from torch.nn.attention import SDPBackend

    smoke = args.interpret_smoke
    device = run_device(args, PROG)
    dtype = getattr(torch, DTYPES[args.dtype])
    tolerance = TOLERANCE[args.dtype]
    systems = system_names(args.layouts, args.anchors)
    element = torch.finfo(dtype).bits // 8
    points = [(b, n) for b in args.batches for n in args.cache_lens
              if 2 * b * n * args.heads_k * args.headdim * element <= args.max_cache_gib * 2**30]
    meta = collect_meta(command, device, {
        "bench": "decode", "interpret_smoke": smoke, "anchors": anchor_status(args.anchors), "systems": systems,
        "dtype": args.dtype, "timing": not smoke, "tolerance": tolerance, "seqlen_q": args.seqlen_q,
        "causal": sorted({causal for _, causal in args.variants}), "nheads": args.heads, "nheads_k": args.heads_k,
        "headdim": args.headdim, "page": args.page, "max_cache_gib": args.max_cache_gib, "rounds": args.rounds})
    out_dir = check_out_dir(args.out or default_out_dir("decode", meta["gpu"]))
    where = meta["gpu"] or "CPU, TRITON_INTERPRET=1"
    progress = Progress(len(points) * len(args.variants) * len(systems) * (1 if smoke else args.rounds))
    for name, status in meta["anchors"].items():
        progress.note(f"anchor {name}: {status}")
    copy_bw = None
    if not smoke:
        warm_up_gpu(args.gpu_warmup_s)
        copy_bw = copy_bandwidth(torch)
        meta["copy_gbps"] = copy_bw / 1e9
        progress.note(f"{where} | copy: {copy_bw / 1e9:.0f} GB/s (read + write) -> {out_dir}")

    records: list[dict] = []
    for batch, length in points:
        kv_bytes = 2 * batch * length * args.heads_k * args.headdim * element
        for seqlen_q, causal in args.variants:
            q, k_cache, v_cache, seqlens, table = decode_inputs(torch, batch, length, seqlen_q, args.heads,
                                                                args.heads_k, args.headdim, args.page, dtype, device)
            k_paged, v_paged = (paged_copy(torch, k_cache, v_cache, table)
                                if any(s in systems for s in PAGED_SYSTEMS) else (None, None))
            calls = point_systems(systems, q, k_cache, v_cache, seqlens, table, k_paged, v_paged, causal)
            checked = min(batch, CHECKED_SEQUENCES)
            with torch.no_grad():
                expected = sdpa(q[:checked].float(), k_cache[:checked].float(), v_cache[:checked].float(),
                                SDPBackend.MATH, causal)
                point = []
                for name in systems:
                    record = dict(system=name, batch=batch, cache=length, seqlen_q=seqlen_q, causal=causal,
                                  kv_bytes=kv_bytes, rel_err=None, ok=None, skipped=None)
                    check_point(record, calls[name], expected, checked, tolerance)
                    point.append(record)
                # The systems take turns, round after round: a slow spell of the GPU does not land on one.
                for _ in range(1 if smoke else args.rounds):
                    for record in point:
                        if not smoke and record["skipped"] is None:
                            time_point(torch, record, calls[record["system"]], copy_bw)
                        shape = f"b={batch:<4} cache={length:<7} sq={seqlen_q:<3}{' causal' if causal else ''}"
                        progress.step(f"{shape:<36} {record['system']:<22} {describe(record)}")
                records += point
            write_json(out_dir / "decode.json", meta, records, complete=False)
            q = k_cache = v_cache = k_paged = v_paged = calls = expected = None  # free before the next point
            free_device_memory(device)

    table = build_table(records, systems, timing=not smoke)
    write_json(out_dir / "decode.json", meta, records, complete=True)
    rows = ", ".join(f"{rows}{' causal' if causal else ''}" for rows, causal in args.variants)
    details = [f"- query rows per sequence: {rows}; {args.heads} query heads over {args.heads_k} KV heads, head dim "
               f"{args.headdim}, {args.dtype}, page {args.page}"
               + (f"; copy bandwidth {copy_bw / 1e9:.0f} GB/s (bytes read + written per second)" if copy_bw else "")]
    write_markdown(out_dir / "decode.md", "flashtile decode benchmark", meta, details, table)
    if copy_bw:
        save_plot(draw_plot(records, systems, copy_bw / 1e9,
                            f"decode, {args.heads}/{args.heads_k} heads, d{args.headdim}, {args.dtype}, "
                            f"{meta['gpu']} (CUDA-graph timing)"), out_dir / "decode.png")
    print(f"\n== decode | {where} | results in {out_dir}", flush=True)
    print(render_text(table), flush=True)
    return 1 if any(r["system"].startswith("flashtile") and (r["ok"] is False or r["skipped"]) for r in records) else 0


def check_point(record: dict, fn, expected, checked: int, tolerance: float) -> None:
    """``fn``'s relative error against ``expected`` on the first ``checked`` sequences, into ``record``."""
    try:
        record["rel_err"] = relative_error(fn()[:checked], expected)
        record["ok"] = record["rel_err"] < tolerance
    except Exception as exc:  # a backend without a kernel for this shape: reported, not fatal
        record["skipped"] = failure_reason(exc)


def time_point(torch, record: dict, fn, copy_bw: float) -> None:
    """Time ``fn`` eagerly and from a CUDA graph, into ``record``: the fastest of the rounds so far
    (each round's graph time is kept in graph_ms_rounds)."""
    kv_bytes = record["kv_bytes"]
    try:
        ms, graph_ms = do_bench_ms(fn, 10, 50), graph_time_ms(torch, fn)
    except Exception as exc:
        record["skipped"] = failure_reason(exc)
        return
    record.setdefault("graph_ms_rounds", []).append(graph_ms)
    ms, graph_ms = min(ms, record.get("ms", ms)), min(graph_ms, record.get("graph_ms", graph_ms))
    record.update(ms=ms, gbps=kv_bytes / (ms * 1e-3) / 1e9, of_copy=kv_bytes / (ms * 1e-3) / copy_bw,
                  graph_ms=graph_ms, graph_gbps=kv_bytes / (graph_ms * 1e-3) / 1e9,
                  graph_of_copy=kv_bytes / (graph_ms * 1e-3) / copy_bw)


def describe(record: dict) -> str:
    if record.get("graph_gbps"):
        return (f"graph {record['graph_gbps']:5.0f} GB/s ({100 * record['graph_of_copy']:5.1f}% of copy), "
                f"eager {record['gbps']:5.0f}, rel err {record['rel_err']:.1e}")
    if record["skipped"]:
        return f"skipped: {record['skipped'][:120]}"
    return f"rel err {record['rel_err']:.1e} {'ok' if record['ok'] else 'FAIL'}"
