"""Packed (varlen) batches: flashtile's flash_attn_varlen_func against the padded alternatives.

    python -m flashtile.bench --varlen [--out DIR] [--headdims 128] [--causal both]

A realistic training batch: 16384 tokens made of sequences whose lengths are drawn uniformly
from [64, 4096] (fixed seed), hidden 2048, bf16. Systems, all timed on the same batch:
  flashtile varlen   flash_attn_varlen_func on the packed tokens;
  flashtile padded   flash_attn_func on the batch padded to its longest sequence (it also attends
                     to the padding: it shows what padding costs, not a usable result);
  sdpa padded        torch SDPA on the padded batch with a boolean mask (key padding, and causal),
                     the way a model without varlen support runs it (SDPA picks its backend).
Modes: forward, and forward + backward. TFLOP/s count the real tokens only:
sum over sequences of 4 * h * L^2 * d (halved when causal), times 3.5 for forward + backward.
Before timing, the varlen output and gradients are checked against a float32 reference run
on each sequence alone.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

SYSTEMS = ("flashtile varlen", "flashtile padded", "sdpa padded")
MODES = ("fwd", "fwd_bwd")
MIN_LEN, MAX_LEN, SEED = 64, 4096, 0


def draw_lengths(tokens: int, seed: int = SEED) -> list[int]:
    """Lengths in [MIN_LEN, MAX_LEN] until ``tokens`` are used; the last is cut to fit."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(MIN_LEN, MAX_LEN), tokens - sum(lengths)))
    return lengths


def real_flops(lengths: list[int], nheads: int, headdim: int, causal: bool, mode: str) -> float:
    fwd = sum(4.0 * nheads * n * n * headdim for n in lengths) * (0.5 if causal else 1.0)
    return fwd * (3.5 if mode == "fwd_bwd" else 1.0)


def _systems(lengths, nheads, headdim, causal, dtype):
    """{name: (inputs needing grad, forward callable)} on one shared set of packed tokens."""
    import torch
    import torch.nn.functional as F

    from flashtile import flash_attn_func, flash_attn_varlen_func

    total, batch, max_len = sum(lengths), len(lengths), max(lengths)
    q, k, v = (torch.randn(total, nheads, headdim, device="cuda", dtype=dtype) for _ in range(3))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    valid = torch.arange(max_len, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
    index = valid.flatten().nonzero().flatten()

    def padded(x):
        out = x.new_zeros((batch * max_len, nheads, headdim))
        out[index] = x
        return out.view(batch, max_len, nheads, headdim)

    qp, kp, vp = padded(q), padded(k), padded(v)
    keep = valid[:, None, None, :]  # (b, 1, 1, sk): padding keys are masked
    if causal:
        keep = keep & torch.ones(max_len, max_len, dtype=torch.bool, device="cuda").tril()
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (qp, kp, vp))
    return {
        "flashtile varlen": ((q, k, v), lambda a, b, c: flash_attn_varlen_func(
            a, b, c, cu, cu, max_len, max_len, causal=causal)),
        "flashtile padded": ((qp, kp, vp), lambda a, b, c: flash_attn_func(a, b, c, causal=causal)),
        "sdpa padded": ((qs, ks, vs), lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=keep)),
    }, (q, k, v, cu)


def _check_varlen(q, k, v, cu, causal) -> float:
    """Largest relative error of out, dq, dk, dv against float32 per sequence."""
    import torch

    from flashtile import flash_attn_varlen_func
    from flashtile.reference import attention_varlen_naive

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lengths = (cu[1:] - cu[:-1]).tolist()
    out = flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_varlen_naive(*ref_leaves, cu, cu, causal=causal, dtype=torch.float32)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
    worst = 0.0
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        worst = max(worst, ((got.float() - want).norm() / want.norm()).item())
    return worst


def run(args, argv, meta_fn) -> int:
    import torch
    import triton

    from flashtile.bench import warm_up_gpu

    dtype = torch.bfloat16
    lengths = draw_lengths(args.tokens)
    out_dir = Path(args.out) if args.out else Path(__file__).resolve().parent.parent / "bench" / "results" / "latest"
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = meta_fn({"tokens": args.tokens, "hidden": args.hidden, "lengths": lengths,
                    "length_range": [MIN_LEN, MAX_LEN], "seed": SEED, "varlen": True})
    print(f"{meta['gpu']} | torch {meta['torch']} triton {meta['triton']} | {len(lengths)} sequences, "
          f"{sum(lengths)} tokens, longest {max(lengths)}", flush=True)
    warm_up_gpu(args.gpu_warmup_s)
    records = []
    for headdim in args.headdims:
        nheads = args.hidden // headdim
        for causal in args.causals:
            systems, (q, k, v, cu) = _systems(lengths, nheads, headdim, causal, dtype)
            error = _check_varlen(q, k, v, cu, causal)
            ok = error < 2e-2
            print(f"d{headdim} causal={causal}: varlen check, max rel error {error:.2e} {'ok' if ok else 'FAIL'}",
                  flush=True)
            for name, (inputs, fn) in systems.items():
                for mode in args.varlen_modes:
                    leaves = [t.detach().requires_grad_(mode == "fwd_bwd") for t in inputs]
                    if mode == "fwd":
                        call = lambda: fn(*leaves)  # noqa: E731
                    else:
                        dout = torch.randn_like(fn(*leaves))

                        def call():
                            torch.autograd.grad(fn(*leaves), leaves, dout)
                    try:
                        ms = triton.testing.do_bench(call, warmup=args.warmup_ms, rep=args.rep_ms)
                        tflops = real_flops(lengths, nheads, headdim, causal, mode) / (ms * 1e-3) / 1e12
                        skipped = None
                    except Exception as exc:  # a system that cannot run this shape is reported, not fatal
                        ms = tflops = None
                        skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    records.append(dict(system=name, headdim=headdim, causal=causal, mode=mode, ms=ms,
                                        tflops=tflops, skipped=skipped,
                                        check_error=error if name == "flashtile varlen" else None))
                    shown = f"{tflops:7.1f} TFLOP/s ({ms:.3f} ms)" if tflops else f"skipped: {skipped}"
                    print(f"  {name:<17} {mode:<8} {shown}", flush=True)
            del systems, q, k, v
            torch.cuda.empty_cache()

    lines = _table(records, args)
    (out_dir / "varlen.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    (out_dir / "varlen.md").write_text("\n".join(_header(meta) + [""] + lines) + "\n")
    _plot(records, out_dir / "varlen.png", meta)
    print("\n" + "\n".join(lines), flush=True)
    return 0 if all(r["check_error"] is None or r["check_error"] < 2e-2 for r in records) else 1


def _header(meta) -> list[str]:
    return [
        "# flashtile varlen benchmark",
        "",
        f"- GPU: {meta['gpu']}; date (UTC): {meta['date_utc']}; flashtile commit {meta['flashtile_commit']}",
        f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}",
        f"- command: `python {' '.join(meta['command'])}`",
        f"- {len(meta['lengths'])} sequences, lengths drawn from [{MIN_LEN}, {MAX_LEN}] (seed {SEED}), "
        f"{sum(meta['lengths'])} tokens, hidden {meta['hidden']}, bf16; TFLOP/s on the real tokens only",
        f"- lengths: {meta['lengths']}",
    ]


def _table(records, args) -> list[str]:
    lines = ["| head dim | causal | mode | " + " | ".join(SYSTEMS) + " | varlen / padded | varlen / sdpa |",
             "|---|---|---|" + "---|" * (len(SYSTEMS) + 2)]
    for headdim in args.headdims:
        for causal in args.causals:
            for mode in args.varlen_modes:
                cells = {r["system"]: r["tflops"] for r in records
                         if (r["headdim"], r["causal"], r["mode"]) == (headdim, causal, mode)}
                def ratio(other):
                    a, b = cells.get("flashtile varlen"), cells.get(other)
                    return f"{a / b:.2f}x" if a and b else "-"
                shown = [f"{cells[s]:.0f}" if cells.get(s) else "-" for s in SYSTEMS]
                lines.append(f"| {headdim} | {causal} | {mode} | " + " | ".join(shown)
                             + f" | {ratio('flashtile padded')} | {ratio('sdpa padded')} |")
    return lines


def _plot(records, path: Path, meta) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({(r["headdim"], r["causal"], r["mode"]) for r in records})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / len(SYSTEMS)
    for i, system in enumerate(SYSTEMS):
        values = [next((r["tflops"] or 0 for r in records if r["system"] == system
                        and (r["headdim"], r["causal"], r["mode"]) == g), 0) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=system)
    ax.set_xticks([x + width for x in range(len(groups))])
    ax.set_xticklabels([f"d{d} {'causal' if c else 'full'}\n{m}" for d, c, m in groups], fontsize=8)
    ax.set_ylabel("TFLOP/s on real tokens")
    ax.set_title(f"packed batch of {len(meta['lengths'])} sequences, {sum(meta['lengths'])} tokens, {meta['gpu']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
