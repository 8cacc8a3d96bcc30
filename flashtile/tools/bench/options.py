"""``bench options``: flash_attn_func with sliding windows, softcap and ALiBi, against plain attention
and FlexAttention running the same masks and score mods.

One dense batch per head dim (--tokens tokens, batch = tokens // seqlen, hidden 2048, bf16) and each
option set of --sets:
  plain-causal, plain-full   no option: the yardstick (the same kernels' plain speed);
  window-causal              causal with window_size (--window, -1): Mistral, Gemma 2 / 3 local layers;
  window-both                window_size (--window / 2, --window / 2), not causal;
  softcap-causal / -full     softcap --softcap (Gemma 2);
  alibi-causal / -full       ALiBi slopes of shape (nheads,) (BLOOM, MPT);
  window-softcap             causal, window (--window, -1) and softcap together;
  sink-causal / -full        a learnable sink per head (gpt-oss), its gradient too (FlexAttention has none);
  mod-alibi-causal           causal, ALiBi as a score_mod (flashtile.mods.alibi; Flex: the same mod);
  mod-relbias-causal         causal, a relative-position bias table as a score_mod (flashtile.mods.relative_bias,
                             128 distances each way);
  mask-window                the causal sliding window (--window) as a block mask (flashtile: the built-in
                             mods.sliding_window, which runs as window_size=);
  mask-document              causal attention within packed documents (lengths 1/2, 1/4, 1/8, ... of a
                             sequence) as a mask_mod with a block mask;
  bias-full / bias-causal    an attn_bias of shape (1, nheads, seqlen, seqlen) shared by the batch, its
                             gradient too (causal: -inf above the diagonal in the bias, which SDPA's
                             efficient backend reads as its mask);
  bias-keys                  an attn_bias of shape (1, nheads, 1, seqlen), one row for every query (a learned
                             key bias), its gradient summed along the queries and the batch.
--headdim-v gives V (and the output) a head dim of its own (DeepSeek-style 192 / 128 with --headdims 192).
TFLOP/s count the (query, key) pairs the options leave visible: 2 * b * h * (d + dv) per pair (4 * b * h * d
when dv = d), 3.5x that for forward + backward. "ft/plain" is flashtile's TFLOP/s over its own plain
TFLOP/s of the same mask class (causal-shaped sets against plain-causal, the others against plain-full),
all in the same run; "ft/flex" over compiled FlexAttention with the same block mask and score_mod (the
bias read from its tensor), "ft/sdpa-efficient" over SDPA's memory-efficient backend (bias sets),
"ft/sdpa" over SDPA with its own backend choice (plain sets), "ft/fa4" over FlashAttention-4 where a set
is one of its arguments (causal, window_size, softcap, learnable_sink), "ft/flex-fa4" over FlexAttention's
FLASH backend, FA4's kernels compiled with Flex's score_mod and block mask. Every system's output
(flashtile's gradients too) is checked on the first batch element against a float32 reference.
"""

from __future__ import annotations

import argparse
import functools

from . import anchors
from .common import (add_common_arguments, check_heads, check_out_dir, check_smoke_sizes, choice_list, collect_meta,
                     default_out_dir, failure_reason, fill_defaults, free_device_memory, mode_records, parse_size,
                     Progress, relative_error, require_torch, run_device, size_list, timed_call, warm_up_gpu,
                     write_json)
from .report import Table, geomean, grouped_bars, render_text, save_plot, skipped_notes, write_markdown

PROG = "python -m flashtile bench options"
MODES = ("fwd", "fwd_bwd")
SETS = ("plain-causal", "plain-full", "window-causal", "window-both", "softcap-causal", "softcap-full",
        "alibi-causal", "alibi-full", "window-softcap", "sink-causal", "sink-full", "mod-alibi-causal",
        "mod-relbias-causal", "mask-window", "mask-document", "bias-full", "bias-causal", "bias-keys")
ANCHORS = {"flex": "torch.compile'd FlexAttention with the same block mask and score_mod",
           "sdpa-efficient": "SDPA's memory-efficient backend with the bias as attn_mask (the bias sets only)",
           "sdpa": "SDPA with PyTorch's own backend choice (cuDNN on Hopper; the plain sets only)",
           "fa4": "FlashAttention-4 (flash_attn.cute) where a set is one of its arguments: causal, window_size, "
                  "softcap, learnable_sink; where importable",
           "flex-fa4": "FlexAttention's FLASH backend: FA4's CuTe kernels running Flex's score_mod and block mask "
                       "(experimental in torch); where FA4 imports"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}
SMOKE_DEFAULTS = {"headdims": [32], "seqlen": 64, "tokens": 64, "heads": 2, "window": 16, "dtype": "fp16"}
GPU_DEFAULTS = {"headdims": [64, 128], "seqlen": 8192, "tokens": 16384, "heads": None, "window": 1024,
                "dtype": "bf16"}


def option_set(name: str, window: int, softcap: float) -> dict:
    """flash_attn_func's keyword arguments of set ``name`` (alibi: True for (nheads,) slopes)."""
    sets = {
        "plain-causal": dict(causal=True),
        "plain-full": dict(),
        "window-causal": dict(causal=True, window_size=(window, -1)),
        "window-both": dict(window_size=(window // 2, window // 2)),
        "softcap-causal": dict(causal=True, softcap=softcap),
        "softcap-full": dict(softcap=softcap),
        "alibi-causal": dict(causal=True, alibi=True),
        "alibi-full": dict(alibi=True),
        "window-softcap": dict(causal=True, window_size=(window, -1), softcap=softcap),
        "sink-causal": dict(causal=True, sink=True),
        "sink-full": dict(sink=True),
        "mod-alibi-causal": dict(causal=True, alibi=True, mod="alibi"),
        "mod-relbias-causal": dict(causal=True, mod="relbias"),
        "mask-window": dict(mask="window", mask_window=window),
        "mask-document": dict(mask="document"),
        "bias-full": dict(bias=True),
        "bias-causal": dict(causal=True, bias=True),
        "bias-keys": dict(bias="keys"),
    }
    return {**dict(causal=False, window_size=(-1, -1), softcap=0.0, alibi=False, sink=False, mod=None, mask=None,
                   bias=False),
            **sets[name]}


def document_lengths(seqlen: int) -> list:
    """mask-document's documents: halves of what is left (1/2, 1/4, ...), the last one what remains."""
    lengths, left = [], seqlen
    while left > 64:
        lengths.append(left // 2)
        left -= left // 2
    return lengths + [left]


def causal_shaped(options: dict) -> bool:
    """Whether a set's band ends at the diagonal (its yardstick is plain causal attention)."""
    return options["causal"] or options["window_size"][1] == 0 or options["mask"] is not None


def visible_pairs(seqlen: int, options: dict) -> int:
    """(query, key) pairs the causal mask and window leave (square, so the diagonal is i = j)."""
    if options["mask"] == "document":
        return sum(n * (n + 1) // 2 for n in document_lengths(seqlen))
    left, right = options["window_size"]
    if options["causal"]:
        right = 0
    if options["mask"] == "window":
        left, right = options["mask_window"], 0
    total = 0
    for i in range(seqlen):
        lo = 0 if left < 0 else max(0, i - left)
        hi = seqlen - 1 if right < 0 else min(seqlen - 1, i + right)
        total += max(0, hi - lo + 1)
    return total


class Problem:
    """The inputs of one (head dim, option set) point, shared by every system."""

    def __init__(self, batch, seqlen, nheads, nheads_k, headdim, options, dtype, device, headdim_v=None):
        import torch

        generator = torch.Generator(device=device).manual_seed(0)
        self.options, self.nheads, self.nheads_k = options, nheads, nheads_k
        headdim_v = headdim_v or headdim
        self.q = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=generator)
        self.k = torch.randn(batch, seqlen, nheads_k, headdim, device=device, dtype=dtype, generator=generator)
        self.v = torch.randn(batch, seqlen, nheads_k, headdim_v, device=device, dtype=dtype, generator=generator)
        self.dout = torch.randn(batch, seqlen, nheads, headdim_v, device=device, dtype=dtype, generator=generator)
        # ALiBi slopes as ALiBi's paper sets them: 2^(-8 (h + 1) / nheads).
        self.slopes = (torch.exp2(-8.0 * (torch.arange(nheads, device=device) + 1) / nheads).float()
                       if options["alibi"] else None)
        # Sink logits near the rows' logsumexp (a few units), so each takes a fair share of its rows.
        self.sink = (torch.linspace(1.0, 6.0, nheads, device=device).requires_grad_()
                     if options["sink"] else None)
        # mod-relbias: a bias per head and distance, clipped at 128 each way.
        self.bias_table = (torch.randn(nheads, 257, device=device, generator=generator)
                           if options["mod"] == "relbias" else None)
        # bias-*: one bias per head and (query, key) pair, shared by the batch; -inf above the diagonal
        # when causal (SDPA's efficient backend takes the mask from it).
        self.bias = None
        if options["bias"]:
            rows = 1 if options["bias"] == "keys" else seqlen
            bias = torch.randn(1, nheads, rows, seqlen, device=device, dtype=dtype, generator=generator)
            if options["causal"]:
                bias.masked_fill_(torch.ones(seqlen, seqlen, dtype=torch.bool, device=device).triu(1), float("-inf"))
            self.bias = bias.requires_grad_()
        self.documents = None
        if options["mask"] == "document":
            lengths = document_lengths(seqlen)
            self.documents = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                                     torch.tensor(lengths, device=device)).int()

    def score_twin(self):
        """The set's score mod in PyTorch ((b, h, sq, sk) scores, broadcastable indices), or None."""
        if self.options["mod"] == "alibi":
            return lambda s, b, h, i, j: s - self.slopes.to(s.dtype)[h] * (i - j).abs()
        if self.options["mod"] == "relbias":
            return lambda s, b, h, i, j: s + self.bias_table.to(s.dtype)[h, (j - i).clamp(-128, 128) + 128]
        return None

    def mask_twin(self):
        """The set's mask mod in PyTorch, or None."""
        if self.options["mask"] == "window":
            window = self.options["mask_window"]
            return lambda b, h, i, j: (i - j <= window) & (j <= i)
        if self.options["mask"] == "document":
            return lambda b, h, i, j: (self.documents[i] == self.documents[j]) & (j <= i)
        return None

    def flash_kwargs(self) -> dict:
        o = self.options
        return dict(causal=o["causal"], window_size=o["window_size"], softcap=o["softcap"],
                    alibi_slopes=None if o["mod"] else self.slopes, learnable_sink=self.sink,
                    **({} if self.bias is None else {"attn_bias": self.bias}))


def flashtile_system(p: Problem):
    """flash_attn_func with the set's options; its mods as flashtile.mods' built-ins, a mask with its
    block mask (built here, once, as a model would per shape)."""
    import flashtile
    from flashtile import flash_attn_func, mods

    kwargs = p.flash_kwargs()
    if p.options["mod"] == "alibi":
        kwargs["score_mod"] = mods.alibi(p.slopes)
    elif p.options["mod"] == "relbias":
        kwargs["score_mod"] = mods.relative_bias(p.bias_table)
    if p.options["mask"] is not None:
        seqlen = p.q.shape[1]
        if p.options["mask"] == "window":
            mask = mods.sliding_window(p.options["mask_window"], 0, device=p.q.device)
        else:
            mask = mods.document_mask(p.documents)
            kwargs["causal"] = True
        kwargs["block_mask"] = flashtile.create_block_mask(mask, None, None, seqlen, seqlen, device=p.q.device)
    return lambda q, k, v: flash_attn_func(q, k, v, **kwargs)


def flex_fa4_system(p: Problem):
    """FlexAttention on its FLASH backend (FA4's kernels compiled with the same score_mod and block mask)."""
    found = anchors.fa4()
    if not found.available:
        raise ValueError(f"FA4 {found.status}")
    return flex_system(p, {"BACKEND": "FLASH"})


def flex_system(p: Problem, kernel_options=None):
    """FlexAttention with the options as a block mask (causal, window) and a score_mod (softcap, ALiBi);
    kernel_options: its backend's (flex_fa4_system's)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from .dense import compiled_flex_attention

    o, slopes = p.options, p.slopes
    if p.sink is not None:
        raise ValueError("FlexAttention has no learnable sink")
    bias = None if p.bias is None else p.bias[0]
    left, right = o["window_size"]
    if o["causal"]:
        right = 0
    if o["mask"] is not None:
        left, right = (o["mask_window"] if o["mask"] == "window" else -1), 0
    seqlen = p.q.shape[1]
    block_mask = None
    documents = p.documents
    if documents is not None:
        def document(batch, head, q_idx, kv_idx):
            return (documents[q_idx] == documents[kv_idx]) & (kv_idx <= q_idx)

        block_mask = create_block_mask(document, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=str(p.q.device))
    elif left >= 0 or right >= 0:
        def band(batch, head, q_idx, kv_idx):
            keep = kv_idx >= 0
            if right >= 0:
                keep = keep & (kv_idx <= q_idx + right)
            if left >= 0:
                keep = keep & (kv_idx >= q_idx - left)
            return keep

        block_mask = create_block_mask(band, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=str(p.q.device))
    cap, table = o["softcap"], p.bias_table

    def score_mod(score, batch, head, q_idx, kv_idx):
        if cap > 0:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[head] * (q_idx - kv_idx).abs()
        if table is not None:
            score = score + table[head, (kv_idx - q_idx).clamp(-128, 128) + 128]
        if bias is not None:
            score = score + bias[head, q_idx if bias.shape[1] > 1 else 0, kv_idx]
        return score

    flex = compiled_flex_attention()
    kwargs = {"enable_gqa": True} if p.nheads_k != p.nheads else {}
    if kernel_options:
        kwargs["kernel_options"] = kernel_options
    if cap > 0 or slopes is not None or table is not None or bias is not None:
        kwargs["score_mod"] = score_mod

    def attn(q, k, v):
        out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, **kwargs)
        return out.transpose(1, 2)

    return attn


def sdpa_efficient_system(p: Problem):
    """SDPA's memory-efficient backend, the one PyTorch backend with a gradient for attn_mask: the bias
    sets only."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if p.bias is None or p.nheads_k != p.nheads:
        raise ValueError("SDPA's efficient backend runs the bias sets, without GQA")

    def attn(q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                   v.transpose(1, 2), attn_mask=p.bias)
        return out.transpose(1, 2)

    return attn


def sdpa_system(p: Problem):
    """SDPA as PyTorch picks its backend: the plain sets only (its causal mask is top-left aligned, which
    is flash_attn's for these square problems)."""
    import torch

    o = p.options
    if (o["window_size"] != (-1, -1) or o["softcap"] or o["alibi"] or o["sink"] or o["mod"] or o["mask"]
            or o["bias"]):
        raise ValueError("SDPA runs the plain sets here")
    kwargs = {"enable_gqa": True} if p.nheads_k != p.nheads else {}

    def attn(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=o["causal"], **kwargs)
        return out.transpose(1, 2)

    return attn


def fa4_system(p: Problem):
    """FlashAttention-4's flash_attn_func with the sets it takes as arguments (its score and mask mods are
    CuTe DSL functions, which this benchmark does not write: ALiBi, the relative bias, the document mask
    and the bias sets are left to FlexAttention)."""
    o = p.options
    if o["alibi"] or o["mod"] or o["bias"] or o["mask"] == "document":
        raise ValueError("FA4 takes these sets only as CuTe DSL score / mask mods, not written here")
    found = anchors.fa4()
    if not found.available:
        raise ValueError(f"FA4 {found.status}")
    left, right = o["window_size"]
    if o["mask"] == "window":
        left, right = o["mask_window"], 0
    kwargs = dict(causal=o["causal"] or o["mask"] == "window", softcap=o["softcap"])
    if left >= 0 or right >= 0:
        kwargs["window_size"] = (None if left < 0 else left, None if right < 0 else right)
    if p.sink is not None:
        kwargs["learnable_sink"] = p.sink

    def attn(q, k, v):
        return anchors.fa4_output(found.module.flash_attn_func(q, k, v, **kwargs))

    return attn


SYSTEMS = {"flashtile": flashtile_system, "flex": flex_system, "sdpa-efficient": sdpa_efficient_system,
           "sdpa": sdpa_system, "fa4": fa4_system, "flex-fa4": flex_fa4_system}


def reference(p: Problem, with_grads: bool) -> dict:
    """float32 out (and dq, dk, dv of sum(out * dout)) of the first batch element, a KV head at a time;
    with a bias, its gradient too, summed over the whole batch (the bias is shared by it)."""
    import torch

    from flashtile.reference import attention_naive

    group = p.nheads // p.nheads_k
    pieces: dict = {name: [] for name in ("out", "dq", "dk", "dv", "dbias")}
    batches = range(p.q.shape[0] if p.bias is not None and with_grads else 1)
    for b, kv_head in ((b, h) for h in range(p.nheads_k) for b in batches):
        heads = slice(kv_head * group, (kv_head + 1) * group)
        q, k, v = (t[b:b + 1, :, hs].detach().float().requires_grad_(with_grads)
                   for t, hs in ((p.q, heads), (p.k, slice(kv_head, kv_head + 1)), (p.v, slice(kv_head, kv_head + 1))))
        bias = None if p.bias is None else p.bias[:, heads].detach().float().requires_grad_(with_grads)
        o = p.options
        with torch.enable_grad():
            score_twin, mask_twin = p.score_twin(), p.mask_twin()
            if score_twin is not None:  # the twins see this group's heads as heads 0 .. group - 1
                score_twin = functools.partial(lambda twin, s, b, h, i, j: twin(s, b, h + heads.start, i, j),
                                               score_twin)
            out, _ = attention_naive(q, k, v, causal=o["causal"], window_size=o["window_size"], softcap=o["softcap"],
                                     alibi_slopes=None if p.slopes is None or o["mod"] else p.slopes[heads],
                                     learnable_sink=None if p.sink is None else p.sink[heads].detach(),
                                     dtype=torch.float32, score_mod=score_twin, mask_mod=mask_twin, attn_bias=bias)
            leaves = (q, k, v) if bias is None else (q, k, v, bias)
            grads = torch.autograd.grad(out, leaves, p.dout[b:b + 1, :, heads].float()) if with_grads else ()
        if b == 0:
            pieces["out"].append(out.detach())
            for name, grad in zip(("dq", "dk", "dv"), grads):
                pieces[name].append(grad)
        if bias is not None and with_grads:
            if b == 0:
                pieces["dbias"].append(grads[3])
            else:
                pieces["dbias"][-1] += grads[3]
        del out, grads
    return {name: torch.cat(parts, dim=2 if name != "dbias" else 1) for name, parts in pieces.items() if parts}


def check(name: str, attn, p: Problem, ref: dict) -> dict[str, float]:
    import torch

    grads = "dq" in ref and name == "flashtile"
    leaves = [t.detach().requires_grad_(grads) for t in (p.q, p.k, p.v)]
    out = attn(*leaves)
    errors = {"out": relative_error(out[:1], ref["out"])}
    if grads:
        with_bias = leaves + ([p.bias] if p.bias is not None else [])
        for key, grad in zip(("dq", "dk", "dv", "dbias"), torch.autograd.grad(out, with_bias, p.dout)):
            errors[key] = relative_error(grad if key == "dbias" else grad[:1], ref[key])
    return errors


def build_table(records: list[dict], systems: list[str], timing: bool) -> Table:
    others = [s for s in systems if s != "flashtile"]
    header = ["hdim", "heads", "set", "mode", *systems, "ft/plain", *(f"ft/{s}" for s in others), "ok"]
    by_key: dict = {}
    for r in records:
        by_key.setdefault((r["headdim"], r.get("headdim_v", r["headdim"]), r["nheads"], r["nheads_k"], r["mode"]),
                          {}).setdefault(r["set"], {})[r["system"]] = r
    ratios: dict = {}
    rows = []
    for (headdim, headdim_v, nheads, nheads_k, mode), sets in by_key.items():
        for name in SETS:
            cells = sets.get(name)
            if cells is None:
                continue
            heads = str(nheads) if nheads == nheads_k else f"{nheads}/{nheads_k}"
            row = [str(headdim) if headdim_v == headdim else f"{headdim}/{headdim_v}", heads, name, mode]
            for system in systems:
                r = cells.get(system)
                if r is None or (r.get("skipped") and r.get("tflops") is None and r.get("rel_err") is None):
                    row.append("skip" if r else "-")
                elif timing:
                    row.append(f"{r['tflops']:.1f}" if r.get("tflops") else "-")
                else:
                    row.append(f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-")
            ft = cells.get("flashtile", {}).get("tflops")
            plain_name = "plain-causal" if cells.get("flashtile", {}).get("causal_shaped") else "plain-full"
            plain = sets.get(plain_name, {}).get("flashtile", {}).get("tflops")
            if ft and plain and not name.startswith("plain"):
                ratios.setdefault((mode, "plain"), []).append(ft / plain)
            row.append(f"{ft / plain:.2f}" if ft and plain and not name.startswith("plain") else "-")
            for other in others:
                ref = cells.get(other, {}).get("tflops")
                if ft and ref:
                    ratios.setdefault((mode, other), []).append(ft / ref)
                row.append(f"{ft / ref:.2f}" if ft and ref else "-")
            failing = [s for s in systems if cells.get(s, {}).get("ok") is False]
            row.append("FAIL:" + ",".join(failing) if failing else "ok")
            rows.append(row)
    notes = []
    for mode in MODES:
        parts = [f"{o} {geomean(ratios[(mode, o)]):.2f}" for o in ("plain", *others) if (mode, o) in ratios]
        if parts:
            notes.append(f"geomean flashtile/x, {mode}: " + ", ".join(parts))
    notes += skipped_notes((r["system"], r.get("skipped")) for r in records)
    return Table(header=header, rows=rows, notes=notes, left=frozenset({"set", "mode", "ok"}))


def draw_plot(records: list[dict], systems: list[str], title: str):
    """Bars of TFLOP/s on visible pairs, one group per (head dim, set, mode)."""
    return grouped_bars(records, systems, lambda r: (r["headdim"], SETS.index(r["set"]), r["mode"]),
                        lambda g: f"d{g[0]}\n{SETS[g[1]]}\n{g[2]}", "TFLOP/s on visible pairs", title,
                        group_width=0.9, label_size=6)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--headdims", type=size_list, default=None, help="head dims (default: 64,128)")
    add("--headdim-v", type=int, default=None,
        help="V's head dim, when it differs from q's and k's (default: the same)")
    add("--seqlen", type=parse_size, default=None, help="queries and keys per sequence (default: 8k)")
    add("--tokens", type=parse_size, default=None, help="tokens per batch: batch = tokens // seqlen (default: 16k)")
    add("--heads", type=int, default=None, help="query heads (default: hidden // headdim)")
    add("--heads-k", type=int, default=None, help="key/value heads, dividing --heads: GQA/MQA (default: --heads)")
    add("--hidden", type=int, default=2048, help="hidden size, nheads = hidden // headdim (default: %(default)s)")
    add("--sets", type=choice_list(SETS), default=list(SETS), help="option sets: " + ", ".join(SETS))
    add("--window", type=parse_size, default=None, help="sliding window's left side (default: 1k)")
    add("--softcap", type=float, default=50.0, help="softcap (default: %(default)s, Gemma 2's)")
    add("--modes", type=choice_list(MODES), default=["fwd"], help="fwd, fwd_bwd (default: fwd)")
    add("--dtype", choices=tuple(DTYPES), default=None, help="input dtype (default: bf16; fp16 when smoke)")
    add("--anchors", type=lambda t: [] if t.strip() == "none" else choice_list(ANCHORS, allow_empty=True)(t),
        default=None, help="anchors timed in the same run: flex, sdpa-efficient, sdpa, fa4, flex-fa4; 'none' for "
                           "flashtile alone (default: all, the FA4 ones where it imports; none with --interpret-smoke)")
    add_common_arguments(parser)


def resolve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    # FA4 by default only where it imports (it is not a dependency: anchors.py).
    fill_defaults(args, SMOKE_DEFAULTS, GPU_DEFAULTS,
                  [name for name in ANCHORS if "fa4" not in name or anchors.fa4().available])
    if args.tokens < args.seqlen:
        parser.error(f"--tokens {args.tokens} is less than one sequence of --seqlen {args.seqlen}")
    check_heads(parser, args)
    check_smoke_sizes(parser, args, (args.seqlen, args.tokens, *args.headdims))
    return args


def run(args: argparse.Namespace, command: list[str]) -> int:
    torch = require_torch(PROG)
    smoke = args.interpret_smoke
    device = run_device(args, PROG)
    torch.set_float32_matmul_precision("highest")
    dtype = getattr(torch, DTYPES[args.dtype])
    tolerance = TOLERANCE[args.dtype]
    systems = ["flashtile", *args.anchors]
    batch = args.tokens // args.seqlen
    meta = collect_meta(command, device, {
        "bench": "options", "interpret_smoke": smoke, "anchors": {n: f"run ({ANCHORS[n]})" for n in args.anchors},
        "systems": systems, "dtype": args.dtype, "timing": not smoke, "tolerance": tolerance, "seqlen": args.seqlen,
        "batch": batch, "hidden": args.hidden, "heads": args.heads, "heads_k": args.heads_k, "window": args.window,
        "softcap": args.softcap, "headdim_v": args.headdim_v, "sets": args.sets, "warmup_ms": args.warmup_ms,
        "rep_ms": args.rep_ms})
    out_dir = check_out_dir(args.out or default_out_dir("options", meta["gpu"]))
    progress = Progress(len(args.headdims) * len(args.sets) * len(systems) * len(args.modes))
    where = meta["gpu"] or "CPU, TRITON_INTERPRET=1"
    progress.note(f"{where} | torch {meta['torch']} triton {meta['triton']} | b={batch} s={args.seqlen} -> {out_dir}")
    if not smoke:
        warm_up_gpu(args.gpu_warmup_s)
    records: list[dict] = []
    for headdim in args.headdims:
        nheads = args.heads or args.hidden // headdim
        nheads_k = args.heads_k or nheads
        for name in args.sets:
            options = option_set(name, args.window, args.softcap)
            problem = Problem(batch, args.seqlen, nheads, nheads_k, headdim, options, dtype, device, args.headdim_v)
            ref = reference(problem, with_grads="fwd_bwd" in args.modes)
            pairs = visible_pairs(args.seqlen, options)
            for system in systems:
                base = dict(system=system, headdim=headdim, headdim_v=args.headdim_v or headdim, nheads=nheads,
                            nheads_k=nheads_k, set=name,
                            causal_shaped=causal_shaped(options), visible_pairs=pairs)
                reason = None
                try:
                    attn = SYSTEMS[system](problem)
                    errors = check(system, attn, problem, ref)
                except Exception as exc:  # a system that cannot run this set: reported, not fatal
                    attn, errors, reason = None, None, failure_reason(exc)
                work = 2.0 * batch * nheads * (headdim + (args.headdim_v or headdim)) * pairs
                # The bias's gradient is asked for too: SDPA computes it only then.
                bias = () if problem.bias is None else (problem.bias,)
                for record in mode_records(base, args.modes, attn, errors, reason, tolerance, not smoke,
                                           functools.partial(timed_call, attn, problem, extra_leaves=bias),
                                           lambda mode: work * (3.5 if mode == "fwd_bwd" else 1.0),
                                           args.warmup_ms, args.rep_ms):
                    records.append(record)
                    mode = record["mode"]
                    shown = (f"{record['tflops']:7.1f} TFLOP/s ({record['ms']:.3f} ms)" if record["tflops"]
                             else f"skipped: {record['skipped']}" if record["skipped"] else "checked")
                    err = f", err {record['rel_err']:.1e} {'ok' if record['ok'] else 'FAIL'}" if errors else ""
                    progress.step(f"{system:<9} d={headdim} h={nheads}/{nheads_k} {name:<14} {mode:<7} {shown}{err}")
            write_json(out_dir / "options.json", meta, records, complete=False)
            del problem, ref
            free_device_memory(device)

    table = build_table(records, systems, timing=not smoke)
    write_json(out_dir / "options.json", meta, records, complete=True)
    details = [f"- b={batch} x {args.seqlen} tokens, {args.dtype}, window {args.window}, softcap {args.softcap}; "
               + ("cells: TFLOP/s on the pairs the options leave visible" if not smoke
                  else "cells: max rel. error vs float32 reference")
               + "; ft/plain = flashtile / its plain attention of the same mask class, ft/x = flashtile / x, "
                 "same run"]
    write_markdown(out_dir / "options.md", "flashtile options benchmark", meta, details, table)
    if not smoke:
        save_plot(draw_plot(records, systems, f"options, b={batch} s={args.seqlen}, {meta['gpu']}"),
                  out_dir / "options.png")
    print(f"\n== options | {where} | results in {out_dir}", flush=True)
    print(render_text(table), flush=True)
    flashtile_bad = any(r["system"] == "flashtile" and (r["ok"] is False or r["skipped"]) for r in records)
    return 1 if flashtile_bad else 0
