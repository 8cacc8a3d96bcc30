"""``bench varlen``: packed batches through flash_attn_varlen_func, against the alternatives.

A training batch of --tokens tokens (16k) made of sequences whose lengths are drawn uniformly from
[--min-len, --max-len] ([64, 4k], fixed seed), hidden 2048, bf16. flashtile runs the packed tokens;
the anchors, on the same tokens in the same run:
  padded   flashtile's flash_attn_func on the batch padded to its longest sequence (it attends to
           the padding too: it shows what padding costs, its output is not checked);
  sdpa     torch SDPA on the padded batch with a boolean mask, backend of SDPA's choice;
  cudnn    the same, pinned to SDPA's cuDNN backend;
  fa2      torch.nn.attention.varlen.varlen_attn (FlashAttention-2 on packed tokens, torch >= 2.9);
  flex     compiled FlexAttention on the packed tokens with a document mask;
  fa4      FlashAttention-4's flash_attn_varlen_func, where it imports.
TFLOP/s count the real tokens only: sum over sequences of 4 * h * L^2 * d (halved when causal),
times 3.5 for forward + backward. Every system's output (flashtile's gradients too) is checked
against a float32 reference run on each sequence alone before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import contextlib
import random

from . import anchors
from .common import (CAUSAL_CHOICES, add_common_arguments, check_heads, check_out_dir, check_smoke_sizes, choice_list,
                     collect_meta, default_out_dir, failure_reason, fill_defaults, free_device_memory, mode_records,
                     parse_size, Progress, relative_error, require_torch, run_device, size_list, timed_call,
                     warm_up_gpu, write_json)
from .report import Table, geomean, grouped_bars, render_text, save_plot, skipped_notes, write_markdown

PROG = "python -m flashtile bench varlen"
MODES = ("fwd", "fwd_bwd")
ANCHORS = {
    "padded": "flashtile flash_attn_func on the padded batch (cost of padding; not checked)",
    "sdpa": "torch SDPA on the padded batch with a boolean mask (SDPA picks the backend)",
    "cudnn": "torch SDPA on the padded batch with a boolean mask, CUDNN_ATTENTION backend",
    "fa2": "torch.nn.attention.varlen.varlen_attn (FlashAttention-2, packed)",
    "flex": "torch.compile'd FlexAttention with a document mask (packed)",
    "fa4": "FlashAttention-4 flash_attn_varlen_func (flash_attn.cute)",
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}
SMOKE_DEFAULTS = {"headdims": [32], "tokens": 160, "min_len": 8, "max_len": 64, "heads": 2, "dtype": "fp16"}
# ... and a GPU run's.
GPU_DEFAULTS = {
    "headdims": [64, 128],
    "tokens": 16384,
    "min_len": 64,
    "max_len": 4096,
    "heads": None,
    "dtype": "bf16",
}


def draw_lengths(tokens: int, min_len: int, max_len: int, seed: int = 0) -> list[int]:
    """Lengths in [min_len, max_len] until ``tokens`` are used; the last is cut to fit."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(min_len, max_len), tokens - sum(lengths)))
    return lengths


def real_flops(lengths: list[int], nheads: int, headdim: int, causal: bool, mode: str) -> float:
    fwd = sum(4.0 * nheads * n * n * headdim for n in lengths) * (0.5 if causal else 1.0)
    return fwd * (3.5 if mode == "fwd_bwd" else 1.0)


class Batch:
    """One packed batch and its padded twin, shared by every system of a (head dim, causal) point."""

    def __init__(self, lengths, nheads, nheads_k, headdim, causal, dtype, device):
        import torch

        self.lengths, self.causal, self.nheads, self.nheads_k = lengths, causal, nheads, nheads_k
        total, self.batch, self.max_len = sum(lengths), len(lengths), max(lengths)
        self.q = torch.randn(total, nheads, headdim, device=device, dtype=dtype)
        self.k, self.v = (torch.randn(total, nheads_k, headdim, device=device, dtype=dtype) for _ in range(2))
        self.dout = torch.randn_like(self.q)
        self.cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        valid = torch.arange(self.max_len, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        self.index = valid.flatten().nonzero().flatten()  # packed row -> padded row
        self.keep = valid[:, None, None, :]  # (b, 1, 1, sk): padding keys are masked
        if causal:
            self.keep = self.keep & torch.ones(self.max_len, self.max_len, dtype=torch.bool, device=device).tril()
        self.doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                           torch.tensor(lengths, device=device))

    def pad(self, x):
        out = x.new_zeros((self.batch * self.max_len, *x.shape[1:]))
        out[self.index] = x
        return out.view(self.batch, self.max_len, *x.shape[1:])

    def unpad(self, x):
        return x.reshape(self.batch * self.max_len, *x.shape[2:])[self.index]


# Each system: (batch) -> attn(q, k, v) -> out on packed (total, heads, headdim) tensors, padding and
# unpadding inside, so checking and timing treat every system alike (padding is part of their cost).


def flashtile_system(b: Batch):
    from flashtile import flash_attn_varlen_func

    return lambda q, k, v: flash_attn_varlen_func(q, k, v, b.cu, b.cu, b.max_len, b.max_len, causal=b.causal)


def padded_system(b: Batch):
    from flashtile import flash_attn_func

    return lambda q, k, v: b.unpad(flash_attn_func(b.pad(q), b.pad(k), b.pad(v), causal=b.causal))


def sdpa_system(backend_name: str | None):
    def build(b: Batch):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kwargs = {"enable_gqa": True} if b.nheads_k != b.nheads else {}

        def attn(q, k, v):
            qs, ks, vs = (b.pad(t).transpose(1, 2) for t in (q, k, v))
            context = sdpa_kernel(getattr(SDPBackend, backend_name)) if backend_name else contextlib.nullcontext()
            with context:
                out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=b.keep, **kwargs)
            return b.unpad(out.transpose(1, 2))

        return attn

    return build


def fa2_system(b: Batch):
    found = anchors.torch_varlen()
    if not found.available:
        raise RuntimeError(found.status)
    kwargs = {"enable_gqa": True} if b.nheads_k != b.nheads else {}
    window = (-1, 0) if b.causal else (-1, -1)
    return lambda q, k, v: found.module.varlen_attn(q, k, v, b.cu, b.cu, b.max_len, b.max_len, window_size=window,
                                                    **kwargs)


def flex_system(b: Batch):
    from torch.nn.attention.flex_attention import create_block_mask

    from .dense import compiled_flex_attention

    doc, causal = b.doc, b.causal

    def document_mask(batch, head, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    total = int(b.cu[-1])
    block_mask = create_block_mask(document_mask, B=None, H=None, Q_LEN=total, KV_LEN=total, device=str(b.q.device))
    flex = compiled_flex_attention()
    kwargs = {"enable_gqa": True} if b.nheads_k != b.nheads else {}

    def attn(q, k, v):
        out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask,
                   **kwargs)
        return out[0].transpose(0, 1)

    return attn


def fa4_system(b: Batch):
    found = anchors.fa4()
    if not found.available:
        raise RuntimeError(found.status)
    return lambda q, k, v: anchors.fa4_output(found.module.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=b.cu, cu_seqlens_k=b.cu, max_seqlen_q=b.max_len, max_seqlen_k=b.max_len,
        causal=b.causal))


SYSTEMS = {"flashtile": flashtile_system, "padded": padded_system, "sdpa": sdpa_system(None),
           "cudnn": sdpa_system("CUDNN_ATTENTION"), "fa2": fa2_system, "flex": flex_system, "fa4": fa4_system}
UNCHECKED = {"padded"}  # its output includes the padding keys by design


def anchor_status(names: list[str]) -> dict[str, str]:
    status = {}
    for name in names:
        if name == "fa4":
            status[name] = anchors.fa4().status
        elif name == "fa2":
            found = anchors.torch_varlen()
            status[name] = f"run ({ANCHORS[name]})" if found.available else found.status
        else:
            status[name] = f"run ({ANCHORS[name]})"
    return status


def runnable_systems(names: list[str]) -> list[str]:
    absent = {"fa4": not anchors.fa4().available, "fa2": not anchors.torch_varlen().available}
    return ["flashtile", *(name for name in names if not absent.get(name, False))]


def reference(b: Batch) -> dict:
    """float32 out and dq, dk, dv of sum(out * dout), each sequence alone."""
    import torch

    from flashtile.reference import attention_varlen_naive

    leaves = [t.detach().float().requires_grad_() for t in (b.q, b.k, b.v)]
    with torch.enable_grad():
        out, _ = attention_varlen_naive(*leaves, b.cu, b.cu, causal=b.causal, dtype=torch.float32)
        grads = torch.autograd.grad(out, leaves, b.dout.float())
    return {"out": out.detach(), **dict(zip(("dq", "dk", "dv"), grads))}


def check(name: str, attn, b: Batch, ref: dict) -> dict[str, float]:
    """Relative errors of out (and, for flashtile, of its gradients) against ``ref``."""
    import torch

    leaves = [t.detach().requires_grad_(name == "flashtile") for t in (b.q, b.k, b.v)]
    out = attn(*leaves)
    errors = {"out": relative_error(out, ref["out"])}
    if name == "flashtile":
        for key, grad in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, b.dout)):
            errors[key] = relative_error(grad, ref[key])
    return errors


def build_table(records: list[dict], systems: list[str], timing: bool) -> Table:
    others = [s for s in systems if s != "flashtile"]
    header = ["hdim", "heads", "causal", "mode", *systems, *(f"ft/{s}" for s in others), "ok"]
    keys = sorted({(r["headdim"], r["nheads"], r["nheads_k"], r["causal"], r["mode"]) for r in records},
                  key=lambda k: (k[0], k[1], k[2], k[3], MODES.index(k[4])))
    ratios: dict = {}
    rows = []
    for key in keys:
        cells = {r["system"]: r for r in records
                 if (r["headdim"], r["nheads"], r["nheads_k"], r["causal"], r["mode"]) == key}
        headdim, nheads, nheads_k, causal, mode = key
        row = [str(headdim), str(nheads) if nheads == nheads_k else f"{nheads}/{nheads_k}",
               "yes" if causal else "no", mode]
        for system in systems:
            r = cells.get(system)
            if r is None:
                row.append("-")
            elif r.get("skipped") and r.get("tflops") is None and r.get("rel_err") is None:
                row.append("skip")
            elif timing:
                row.append(f"{r['tflops']:.1f}" if r.get("tflops") else "-")
            else:
                row.append(f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-")
        for other in others:
            ft, ref = (cells.get(s, {}).get("tflops") for s in ("flashtile", other))
            if ft and ref:
                ratios.setdefault((mode, other), []).append(ft / ref)
            row.append(f"{ft / ref:.2f}" if ft and ref else "-")
        failing = [s for s in systems if cells.get(s, {}).get("ok") is False]
        row.append("FAIL:" + ",".join(failing) if failing else "ok")
        rows.append(row)
    notes = []
    for mode in MODES:
        parts = [f"{o} {geomean(ratios[(mode, o)]):.2f}" for o in others if (mode, o) in ratios]
        if parts:
            notes.append(f"geomean flashtile/x, {mode}: " + ", ".join(parts))
    notes += skipped_notes((r["system"], r.get("skipped")) for r in records)
    return Table(header=header, rows=rows, notes=notes)


def draw_plot(records: list[dict], systems: list[str], title: str):
    """Bars of TFLOP/s on real tokens, one group per (head dim, heads, causal, mode)."""
    return grouped_bars(records, systems, lambda r: (r["headdim"], r["nheads"], r["nheads_k"], r["causal"], r["mode"]),
                        lambda g: f"d{g[0]} h{g[1]}/{g[2]}\n{'causal' if g[3] else 'full'} {g[4]}",
                        "TFLOP/s on real tokens", title)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--headdims", type=size_list, default=None, help="head dims (default: 64,128)")
    add("--tokens", type=parse_size, default=None, help="tokens in the packed batch (default: 16k)")
    add("--min-len", type=parse_size, default=None, help="shortest drawn sequence (default: 64)")
    add("--max-len", type=parse_size, default=None, help="longest drawn sequence (default: 4k)")
    add("--seed", type=int, default=0, help="seed of the drawn lengths (default: %(default)s)")
    add("--heads", type=int, default=None, help="query heads (default: hidden // headdim)")
    add("--heads-k", type=int, default=None, help="key/value heads, dividing --heads: GQA/MQA (default: --heads)")
    add("--hidden", type=int, default=2048, help="hidden size, nheads = hidden // headdim (default: %(default)s)")
    add("--causal", choices=tuple(CAUSAL_CHOICES), default="both", help="causal masking (default: %(default)s)")
    add("--modes", type=choice_list(MODES), default=list(MODES), help="fwd, fwd_bwd (default: both)")
    add("--dtype", choices=tuple(DTYPES), default=None, help="input dtype (default: bf16; fp16 when smoke)")
    add("--anchors", type=lambda t: [] if t.strip() == "none" else choice_list(ANCHORS, allow_empty=True)(t),
        default=None, help="anchors timed in the same run: " + ", ".join(ANCHORS)
                           + "; 'none' for flashtile alone (default: all that import; none with --interpret-smoke)")
    add_common_arguments(parser)


def resolve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    fill_defaults(args, SMOKE_DEFAULTS, GPU_DEFAULTS, ANCHORS)
    args.causals = CAUSAL_CHOICES[args.causal]
    if args.min_len > args.max_len:
        parser.error(f"--min-len {args.min_len} is larger than --max-len {args.max_len}")
    check_heads(parser, args)
    check_smoke_sizes(parser, args, (args.tokens, args.max_len, *args.headdims))
    return args


def run(args: argparse.Namespace, command: list[str]) -> int:
    torch = require_torch(PROG)
    smoke = args.interpret_smoke
    device = run_device(args, PROG)
    torch.set_float32_matmul_precision("highest")
    dtype = getattr(torch, DTYPES[args.dtype])
    tolerance = TOLERANCE[args.dtype]
    lengths = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    systems = runnable_systems(args.anchors)
    meta = collect_meta(command, device, {
        "bench": "varlen", "interpret_smoke": smoke, "anchors": anchor_status(args.anchors), "systems": systems,
        "dtype": args.dtype, "timing": not smoke, "tolerance": tolerance, "tokens": args.tokens,
        "hidden": args.hidden, "heads": args.heads, "heads_k": args.heads_k, "lengths": lengths,
        "length_range": [args.min_len, args.max_len], "seed": args.seed,
        "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms})
    out_dir = check_out_dir(args.out or default_out_dir("varlen", meta["gpu"]))
    progress = Progress(len(args.headdims) * len(args.causals) * len(systems) * len(args.modes))
    where = meta["gpu"] or "CPU, TRITON_INTERPRET=1"
    progress.note(f"{where} | torch {meta['torch']} triton {meta['triton']} | {len(lengths)} sequences, "
                  f"{sum(lengths)} tokens, longest {max(lengths)} -> {out_dir}")
    for name, status in meta["anchors"].items():
        progress.note(f"anchor {name}: {status}")
    if not smoke:
        warm_up_gpu(args.gpu_warmup_s)
    records: list[dict] = []
    for headdim in args.headdims:
        nheads = args.heads or args.hidden // headdim
        nheads_k = args.heads_k or nheads
        for causal in args.causals:
            batch = Batch(lengths, nheads, nheads_k, headdim, causal, dtype, device)
            ref = reference(batch)
            for name in systems:
                base = dict(system=name, headdim=headdim, nheads=nheads, nheads_k=nheads_k, causal=causal)
                reason = None
                try:
                    attn = SYSTEMS[name](batch)
                    errors = None if name in UNCHECKED else check(name, attn, batch, ref)
                except Exception as exc:  # a system that cannot build or run this batch: reported, not fatal
                    attn, errors, reason = None, None, failure_reason(exc)
                for record in mode_records(base, args.modes, attn, errors, reason, tolerance, not smoke,
                                           functools.partial(timed_call, attn, batch),
                                           lambda mode: real_flops(lengths, nheads, headdim, causal, mode),
                                           args.warmup_ms, args.rep_ms):
                    records.append(record)
                    mode = record["mode"]
                    shown = (f"{record['tflops']:7.1f} TFLOP/s ({record['ms']:.3f} ms)" if record["tflops"]
                             else f"skipped: {record['skipped']}" if record["skipped"]
                             else "not checked (by design)" if name in UNCHECKED else "checked")
                    err = f", err {record['rel_err']:.1e} {'ok' if record['ok'] else 'FAIL'}" if errors else ""
                    progress.step(f"{name:<9} d={headdim} h={nheads}/{nheads_k} "
                                  f"{'causal' if causal else 'full'} {mode:<7} {shown}{err}")
            write_json(out_dir / "varlen.json", meta, records, complete=False)
            del batch, ref
            free_device_memory(device)

    table = build_table(records, systems, timing=not smoke)
    write_json(out_dir / "varlen.json", meta, records, complete=True)
    details = [f"- {len(lengths)} sequences, lengths drawn from [{args.min_len}, {args.max_len}] (seed {args.seed}), "
               f"{sum(lengths)} tokens, {args.dtype}; cells: "
               + ("TFLOP/s on the real tokens only" if not smoke else "max rel. error vs float32 reference")
               + "; ft/x = flashtile / x, same run",
               f"- lengths: {lengths}"]
    write_markdown(out_dir / "varlen.md", "flashtile varlen benchmark", meta, details, table)
    if not smoke:
        save_plot(draw_plot(records, systems, f"packed batch of {len(lengths)} sequences, {sum(lengths)} tokens, "
                                              f"{meta['gpu']}"), out_dir / "varlen.png")
    print(f"\n== varlen | {where} | results in {out_dir}", flush=True)
    print(render_text(table), flush=True)
    flashtile_bad = any(r["system"] == "flashtile" and (r["ok"] is False or r["skipped"]) for r in records)
    return 1 if flashtile_bad else 0
