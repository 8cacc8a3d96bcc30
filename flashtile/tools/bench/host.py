"""``bench host``: the host (CPU) time of one eager call of each entry point at a tiny shape, next to
cuDNN's through SDPA in the same process.

At a tiny shape the GPU finishes each kernel in microseconds, so calls issued back to back without
a synchronisation measure what the host spends per call: argument checks, option resolution,
autograd, allocations, launches. Each row times --calls calls per round, flashtile's rounds and the
anchor's interleaved, for --rounds rounds; a row's number is the median round. Host time depends on
the CPU and on where the scheduler puts the autograd engine's worker thread: pin the process to one
core for stable numbers (``taskset -c 3 python -m flashtile bench host``) and compare ratios only
within one run.

Rows (bf16, head dim --headdim; training rows: batch 1, 128 tokens, 2 heads, causal; decoding rows:
one query per sequence, 32 query heads over 8 kv heads, 1024 keys):
  dense fwd / dense fwd+bwd     flash_attn_func (fwd+bwd: with torch.autograd.grad)
  varlen fwd / varlen fwd+bwd   flash_attn_varlen_func on the same tokens as one packed sequence
  kvcache decode                flash_attn_with_kvcache, cache_seqlens a tensor
  kvcache append                the same, appending one new key and value per sequence
  func decode                   flash_attn_func, the query against the cache's keys
The anchor of each row is SDPA's cuDNN backend on the same tensors (dense; decoding with
enable_gqa), forward or forward+backward as the row. Every row's output is first checked against
the anchor's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from .common import (add_common_arguments, check_out_dir, collect_meta, default_out_dir, failure_reason,
                     relative_error, require_torch, run_device, write_json)
from .report import Table, render_text, save_plot, write_markdown

PROG = "python -m flashtile bench host"
ROWS = ("dense fwd", "dense fwd+bwd", "varlen fwd", "varlen fwd+bwd", "kvcache decode", "kvcache append",
        "func decode")
TOLERANCE = {"cuda": 2e-2, "cpu": 1e-2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--headdim", type=int, default=None, help="head dim (default: 128; 32 with --interpret-smoke)")
    add("--calls", type=int, default=200, help="calls per round (default: %(default)s)")
    add("--rounds", type=int, default=9, help="rounds; the median round is reported (default: %(default)s)")
    add_common_arguments(parser)


def resolve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    if args.headdim is None:
        args.headdim = 32 if args.interpret_smoke else 128
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    return args


class Calls:
    """The tensors of every row, and each row's (flashtile, anchor) pair of argument-free calls."""

    def __init__(self, torch, device: str, headdim: int):
        import flashtile

        dtype = torch.bfloat16 if device == "cuda" else torch.float16
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(*shape, grad=False):
            return torch.randn(*shape, device=device, dtype=dtype, generator=gen).requires_grad_(grad)
        self.torch = torch
        q, k, v = (randn(1, 128, 2, headdim, grad=True) for _ in range(3))
        dout = randn(1, 128, 2, headdim)
        packed = [t[0].detach().clone().requires_grad_() for t in (q, k, v)]
        cu = torch.tensor([0, 128], dtype=torch.int32, device=device)
        q_step = randn(1, 1, 32, headdim)
        k_cache, v_cache = randn(1, 1024, 8, headdim), randn(1, 1024, 8, headdim)
        k_new, v_new = randn(1, 1, 8, headdim), randn(1, 1, 8, headdim)
        full = torch.full((1,), 1024, dtype=torch.int32, device=device)
        room = torch.full((1,), 1023, dtype=torch.int32, device=device)
        detached = [t.detach() for t in (q, k, v)]

        def grads(out, inputs, grad_out):
            return (out, *torch.autograd.grad(out, inputs, grad_out))

        def anchor(q, k, v, causal, gqa=False):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backends = [SDPBackend.CUDNN_ATTENTION] if device == "cuda" else [SDPBackend.MATH]
            with sdpa_kernel(backends):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=gqa)
            return out.transpose(1, 2)

        f = flashtile
        self.rows = {
            "dense fwd": (lambda: (f.flash_attn_func(*detached, causal=True),),
                          lambda: (anchor(*detached, True),)),
            "dense fwd+bwd": (lambda: grads(f.flash_attn_func(q, k, v, causal=True), (q, k, v), dout),
                              lambda: grads(anchor(q, k, v, True), (q, k, v), dout)),
            "varlen fwd": (lambda: (f.flash_attn_varlen_func(*(t[0] for t in detached), cu, cu, 128, 128,
                                                             causal=True)[None],),
                           lambda: (anchor(*detached, True),)),
            "varlen fwd+bwd": (lambda: tuple(t[None] for t in grads(
                                   f.flash_attn_varlen_func(*packed, cu, cu, 128, 128, causal=True), packed, dout[0])),
                               lambda: grads(anchor(q, k, v, True), (q, k, v), dout)),
            "kvcache decode": (lambda: (f.flash_attn_with_kvcache(q_step, k_cache, v_cache, cache_seqlens=full),),
                               lambda: (anchor(q_step, k_cache, v_cache, False, True),)),
            "kvcache append": (lambda: (f.flash_attn_with_kvcache(q_step, k_cache, v_cache, k_new, v_new,
                                                                  cache_seqlens=room),),
                               lambda: (anchor(q_step, k_cache, v_cache, False, True),)),
            "func decode": (lambda: (f.flash_attn_func(q_step, k_cache, v_cache),),
                            lambda: (anchor(q_step, k_cache, v_cache, False, True),)),
        }

    def check(self, name: str) -> float:
        """The largest relative error of the row's outputs (and gradients) against the anchor's."""
        ours, theirs = (fn() for fn in self.rows[name])
        return max(relative_error(a.float(), b.float()) for a, b in zip(ours, theirs))


def per_call_us(torch, fn, calls: int) -> float:
    """Host microseconds per call of ``fn`` over ``calls`` calls not waited for (one round)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def run(args: argparse.Namespace, command: list[str]) -> int:
    torch = require_torch(PROG)
    smoke = args.interpret_smoke
    device = run_device(args, PROG)
    meta = collect_meta(command, device, {"bench": "host", "interpret_smoke": smoke, "timing": not smoke,
                                          "headdim": args.headdim, "calls": args.calls, "rounds": args.rounds,
                                          "anchors": {"cudnn": "SDPA's cuDNN backend, same tensors"}})
    out_dir = check_out_dir(args.out or default_out_dir("host", meta["gpu"]))
    calls = Calls(torch, device, args.headdim)
    records = []
    for name in ROWS:
        record = {"row": name, "flashtile_us": None, "cudnn_us": None, "ratio": None, "rel_err": None, "ok": None,
                  "skipped": None}
        try:
            record["rel_err"] = calls.check(name)
            record["ok"] = record["rel_err"] <= TOLERANCE[device]
        except Exception as exc:  # reported in the row, not fatal
            record["skipped"] = failure_reason(exc)
        records.append(record)
    if not smoke:
        ours, theirs = ({r["row"]: [] for r in records} for _ in range(2))
        for round_index in range(args.rounds):
            for record in records:
                if record["ok"]:
                    fn, anchor = calls.rows[record["row"]]
                    if round_index == 0:  # warm: the first call of a signature takes the long way
                        for _ in range(20):
                            fn(), anchor()
                    ours[record["row"]].append(per_call_us(torch, fn, args.calls))
                    theirs[record["row"]].append(per_call_us(torch, anchor, args.calls))
        for record in records:
            if record["ok"]:
                record["flashtile_us"] = statistics.median(ours[record["row"]])
                record["cudnn_us"] = statistics.median(theirs[record["row"]])
                record["ratio"] = record["flashtile_us"] / record["cudnn_us"]
    write_json(out_dir / "host.json", meta, records, complete=True)
    table = Table(["row", "flashtile us", "cuDNN us", "ft/cudnn", "check"],
                  [[r["row"], _us(r["flashtile_us"]), _us(r["cudnn_us"]),
                    "" if r["ratio"] is None else f"{r['ratio']:.2f}",
                    r["skipped"] or f"err {r['rel_err']:.1e} {'ok' if r['ok'] else 'FAIL'}"] for r in records],
                  notes=[], left=frozenset({"row", "check"}))
    details = [f"- head dim {args.headdim}; median of {args.rounds} rounds of {args.calls} calls, rounds interleaved "
               "with the anchor's; lower is better"]
    write_markdown(out_dir / "host.md", "flashtile host time per eager call", meta, details, table)
    if not smoke:
        save_plot(_draw(records, f"host time per eager call, {meta['gpu']}"), out_dir / "host.png")
    print(f"\n== host | {meta['gpu'] or 'CPU, TRITON_INTERPRET=1'} | results in {out_dir}", flush=True)
    print(render_text(table), flush=True)
    return 1 if any(r["ok"] is not True for r in records) else 0


def _us(value) -> str:
    return "" if value is None else f"{value:.1f}"


def _draw(records: list, title: str):
    def draw(plt):
        rows = [r for r in records if r["flashtile_us"] is not None]
        fig, ax = plt.subplots(figsize=(8, 4))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["flashtile_us"] for r in rows], 0.4, label="flashtile")
        ax.bar([x + 0.2 for x in xs], [r["cudnn_us"] for r in rows], 0.4, label="cuDNN (SDPA)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["row"] for r in rows], fontsize=8, rotation=20)
        ax.set_ylabel("host us per call")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        return fig
    return draw
