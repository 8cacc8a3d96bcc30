"""``bench dense``: flash_attn_func against cuDNN, FlashAttention-2, Flex and FlashAttention-4.

For every (system, head dim, heads, causal, seqlen_q, seqlen_k, mode) point the system's output
(and gradients) are first checked against a float32 reference in plain PyTorch math, then timed
with ``triton.testing.do_bench``; the anchors run in the same process on the same inputs, so the
ratios compare like with like. Results: ``results.json`` (every record and the environment),
``results.md`` (the table) and ``tflops.png``.

Conventions (those of the committed numbers under bench/results/): 16384 tokens per batch
(batch = tokens // seqlen_k), hidden 2048 (nheads = hidden // headdim unless --heads), bf16,
layout (batch, seqlen, nheads, headdim); forward FLOPs = 4 * b * h * d * (query, key) pairs
attended, where causal counts half of seqlen² when seqlen_q == seqlen_k (and the exact bottom-right
count otherwise); backward = 2.5x forward, forward+backward = 3.5x forward.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import statistics
from typing import TYPE_CHECKING, Callable, Iterator

from . import anchors
from .common import (fill_defaults, CAUSAL_CHOICES, add_common_arguments, call_capturing_warnings, check_out_dir, check_smoke_sizes,
                     choice_list, collect_meta, default_out_dir, do_bench_ms, failure_reason, free_device_memory,
                     parse_size, Progress, relative_error, require_torch, run_device, size_list, warm_up_gpu,
                     warning_texts, write_json)
from .report import Table, geomean, render_text, save_plot, skipped_notes, write_markdown

if TYPE_CHECKING:
    import torch

PROG = "python -m flashtile bench dense"
MODES = ("fwd", "bwd", "fwd_bwd")
MODE_ALIASES = {"fwd+bwd": "fwd_bwd", "fwd-bwd": "fwd_bwd"}
# FLOPs of a mode as a multiple of the forward FLOPs.
FLOPS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
# Largest accepted relative error ||out - ref|| / ||ref|| (and the same for dq, dk, dv).
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}
# Correctness is checked on the first CHECK_BATCH batch elements to bound memory.
CHECK_BATCH = 1
# The float32 reference is chunked over batch*heads so one chunk's scores stay below this.
REFERENCE_CHUNK_BYTES = 2 * 1024**3
ANCHORS = {
    "cudnn": "torch SDPA, CUDNN_ATTENTION backend",
    "fa2": "torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)",
    "flex": "torch.compile'd FlexAttention",
    "fa4": "FlashAttention-4 (flash_attn.cute)",
}
# --interpret-smoke's defaults: one tiny fp16 shape the interpreter runs in seconds.
SMOKE_DEFAULTS = {"headdims": [32], "seqlens": [64], "heads": 2, "batch": 1, "dtype": "fp16"}
# ... and a GPU run's.
GPU_DEFAULTS = {
    "headdims": [64, 128],
    "seqlens": [1024, 2048, 4096, 8192, 16384],
    "heads": None,
    "batch": None,
    "dtype": "bf16",
}


# --------------------------------------------------------------------------- #
# Problem description and records
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """One attention problem: q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen, nheads_k, headdim).

    ``seqlen`` is the keys' length; seqlen_q and nheads_k default to seqlen and nheads (square MHA).
    """

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    causal: bool
    seqlen_q: int | None = None
    nheads_k: int | None = None

    @property
    def sq(self) -> int:
        return self.seqlen if self.seqlen_q is None else self.seqlen_q

    @property
    def hk(self) -> int:
        return self.nheads if self.nheads_k is None else self.nheads_k

    def label(self) -> str:
        kind = "causal" if self.causal else "full"
        seq = f"s={self.seqlen}" if self.sq == self.seqlen else f"sq={self.sq} sk={self.seqlen}"
        heads = f"h={self.nheads}" if self.hk == self.nheads else f"h={self.nheads}/{self.hk}"
        return f"d={self.headdim} {kind} {seq} (b={self.batch} {heads})"


@dataclasses.dataclass
class Record:
    """The outcome of one (system, config, mode, repeat); one entry of results.json."""

    system: str
    headdim: int
    causal: bool
    seqlen: int  # keys
    seqlen_q: int
    batch: int
    nheads: int
    nheads_k: int
    mode: str
    dtype: str
    repeat: int
    ms: float | None = None
    tflops: float | None = None
    rel_err: float | None = None  # worst of rel_errs
    rel_errs: dict | None = None  # {"out": ..., "dq": ..., "dk": ..., "dv": ...}
    ok: bool | None = None  # None when the correctness check did not run
    skipped: str | None = None  # why the system could not run (or be timed), else None


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a sweep runs: precision, device, timing parameters."""

    dtype: str  # "bf16" or "fp16"
    device: str  # "cuda" or "cpu" (interpreter smoke test)
    timing: bool  # False: correctness checks only
    repeats: int = 1
    warmup_ms: float = 50.0
    rep_ms: float = 200.0

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> float:
    """(query, key) pairs attended; causal is bottom-right aligned (query i sees keys j <= i + sk - sq).

    Square causal counts sq * sk / 2, the convention of the committed numbers (and of
    FlashAttention's own benchmarks); other causal shapes count exactly.
    """
    if not causal:
        return float(seqlen_q * seqlen_k)
    if seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2
    if seqlen_k >= seqlen_q:  # every query sees sk - sq + 1 + i keys
        return float(seqlen_q * (seqlen_k - seqlen_q + 1) + seqlen_q * (seqlen_q - 1) // 2)
    return float(seqlen_k * (seqlen_k + 1) // 2)  # the first sq - sk queries see nothing


def flops(config: AttnConfig, mode: str) -> float:
    """FLOPs of one call in ``mode``: 4 * b * h * d per attended pair, times the mode's factor."""
    forward = 4.0 * config.batch * config.nheads * config.headdim * visible_pairs(config.sq, config.seqlen,
                                                                                 config.causal)
    return forward * FLOPS_FACTOR[mode]


def sweep_configs(headdims, seqlens, causals, tokens: int, hidden: int, seqlens_q=None, nheads: int | None = None,
                  nheads_k: int | None = None, batch: int | None = None) -> list[AttnConfig]:
    """All configs of the sweep, ordered head dim, causal, seqlen_k, seqlen_q."""
    configs = []
    for headdim in headdims:
        heads = nheads or hidden // headdim
        for causal in causals:
            for seqlen in seqlens:
                for seqlen_q in (seqlens_q or [seqlen]):
                    configs.append(AttnConfig(batch=batch or tokens // seqlen, seqlen=seqlen, nheads=heads,
                                              headdim=headdim, causal=causal, seqlen_q=seqlen_q,
                                              nheads_k=nheads_k or heads))
    return configs


# --------------------------------------------------------------------------- #
# Inputs and the float32 reference
# --------------------------------------------------------------------------- #


def make_inputs(config: AttnConfig, dtype: str, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random q, dout (batch, seqlen_q, nheads, headdim) and k, v (batch, seqlen, nheads_k, headdim)."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = getattr(torch, DTYPE_NAMES[dtype])
    shapes = {"q": (config.batch, config.sq, config.nheads, config.headdim),
              "k": (config.batch, config.seqlen, config.hk, config.headdim),
              "v": (config.batch, config.seqlen, config.hk, config.headdim),
              "dout": (config.batch, config.sq, config.nheads, config.headdim)}
    return {name: torch.randn(shape, generator=generator, device=device, dtype=torch_dtype)
            for name, shape in shapes.items()}


def leaf_inputs(inputs: dict, requires_grad: bool) -> tuple:
    """Fresh autograd leaves (sharing storage) for q, k, v."""
    return tuple(inputs[name].detach().requires_grad_(requires_grad) for name in ("q", "k", "v"))


def reference(q, k, v, causal: bool, dout=None, softmax_scale: float | None = None,
              chunk_bytes: int = REFERENCE_CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """Float32 attention in plain PyTorch math: the yardstick for correctness.

    softmax(q k^T * scale [+ causal mask, bottom-right aligned]) v on (batch, seqlen, heads, headdim)
    inputs; k and v may have fewer heads (GQA: query head i uses kv head i // group). Chunked over
    batch*heads so one chunk's scores stay below ``chunk_bytes``. Returns float32 "out" and, with
    ``dout``, the gradients "dq", "dk", "dv" of sum(out * dout) (dk, dv summed over each group).
    """
    import torch

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    scale = headdim**-0.5 if softmax_scale is None else softmax_scale
    want_grads = dout is not None

    def to_rows(x):  # (b, s, h, d) -> (b*h, s, d) float32, kv heads repeated to the query heads
        x = x.detach().float()
        if x.shape[2] != nheads:
            x = x.repeat_interleave(nheads // x.shape[2], dim=2)
        return x.transpose(1, 2).reshape(batch * nheads, x.shape[1], headdim)

    def from_rows(x, heads):  # (b*h, s, d) -> (b, s, heads, d), summing groups of query heads
        x = x.reshape(batch, nheads, x.shape[1], headdim)
        if heads != nheads:
            x = x.reshape(batch, heads, nheads // heads, x.shape[2], headdim).sum(2)
        return x.transpose(1, 2)

    q_rows, k_rows, v_rows = to_rows(q), to_rows(k), to_rows(v)
    dout_rows = to_rows(dout) if want_grads else None
    masked = alive = None
    if causal:
        masked = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).triu(seqlen_k - seqlen_q + 1)
        # Queries that see no key (sq > sk) give 0, as flash attention does: mask nothing on their
        # rows (no NaN from an all -inf softmax, which would poison dk and dv) and zero them after.
        dead = masked.all(dim=-1, keepdim=True)
        masked, alive = masked & ~dead, (~dead).float()

    names = ("out", "dq", "dk", "dv") if want_grads else ("out",)
    pieces: dict[str, list] = {name: [] for name in names}
    rows_per_chunk = max(1, chunk_bytes // (seqlen_q * seqlen_k * 4))
    if group > 1:  # whole batch elements per chunk, so a group's heads land in one chunk
        rows_per_chunk = max(nheads, rows_per_chunk // nheads * nheads)
    for start in range(0, batch * nheads, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        qc, kc, vc = (x[rows].detach().requires_grad_(want_grads) for x in (q_rows, k_rows, v_rows))
        with torch.enable_grad():
            scores = torch.matmul(qc, kc.transpose(1, 2)) * scale
            if masked is not None:
                scores = scores.masked_fill(masked, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if alive is not None:
                probs = probs * alive
            out = torch.matmul(probs, vc)
        pieces["out"].append(out.detach())
        if want_grads:
            for name, grad in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (qc, kc, vc), dout_rows[rows])):
                pieces[name].append(grad)
        del scores, out
    heads_of = {"out": nheads, "dq": nheads, "dk": nheads_k, "dv": nheads_k}
    return {name: from_rows(torch.cat(parts), heads_of[name]) for name, parts in pieces.items()}


# --------------------------------------------------------------------------- #
# Systems: ``with SYSTEMS[name](config, device) as attn`` builds attn(q, k, v) -> out, all in
# (batch, seqlen, nheads, headdim). The context is held for the check and the timing, so a system
# can pin global state (the SDPA backend) outside the timed region. To add an anchor, add an entry.
# --------------------------------------------------------------------------- #

AttentionFn = Callable[..., "torch.Tensor"]


@contextlib.contextmanager
def flashtile_system(config: AttnConfig, device: str) -> Iterator[AttentionFn]:
    """flashtile.flash_attn_func, called exactly as flash_attn 2.x would be."""
    from flashtile import flash_attn_func

    def attn(q, k, v):
        return flash_attn_func(q, k, v, causal=config.causal)

    yield attn


def sdpa_system(backend_name: str):
    """torch SDPA pinned to one SDPBackend, on transpose(1, 2) views of the same tensors.

    Causal with seqlen_q != seqlen_k passes a bottom-right causal bias (is_causal is top-left);
    GQA passes enable_gqa. A backend that refuses the shape raises, and the point is skipped.
    """

    @contextlib.contextmanager
    def system(config: AttnConfig, device: str) -> Iterator[AttentionFn]:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kwargs = {"enable_gqa": True} if config.hk != config.nheads else {}
        if config.causal and config.sq != config.seqlen:
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(config.sq, config.seqlen)
        else:
            kwargs["is_causal"] = config.causal

        def attn(q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  **kwargs).transpose(1, 2)

        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            yield attn

    return system


@functools.cache
def compiled_flex_attention():
    """torch.compile'd FlexAttention, built once and shared by every config."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    # Each (shape, mask, grad mode) compiles its own graph; raise dynamo's recompile limit so it
    # never silently falls back to the (slow) eager path.
    dynamo_config = torch._dynamo.config
    for limit_name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, limit_name):
            setattr(dynamo_config, limit_name, max(getattr(dynamo_config, limit_name), 256))
            break
    # "bwd" times autograd.grad(..., retain_graph=True) on one forward, which a compiled backward
    # with donated buffers refuses: turn donation off so Flex's backward is timed too.
    functorch_config = torch._functorch.config
    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


@contextlib.contextmanager
def flex_system(config: AttnConfig, device: str) -> Iterator[AttentionFn]:
    """FlexAttention (compiled) with a bottom-right causal block mask when causal."""
    from torch.nn.attention.flex_attention import create_block_mask

    flex_attention = compiled_flex_attention()
    offset = config.seqlen - config.sq
    block_mask = None
    if config.causal:
        def causal_mask(batch, head, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        block_mask = create_block_mask(causal_mask, B=None, H=None, Q_LEN=config.sq, KV_LEN=config.seqlen,
                                       device=device)
    kwargs = {"enable_gqa": True} if config.hk != config.nheads else {}

    def attn(q, k, v):
        out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                             **kwargs)
        return out.transpose(1, 2)

    yield attn


@contextlib.contextmanager
def fa4_system(config: AttnConfig, device: str) -> Iterator[AttentionFn]:
    """FlashAttention-4's flash_attn_func (same layout and causal alignment as flashtile)."""
    found = anchors.fa4()
    if not found.available:
        raise RuntimeError(found.status)

    def attn(q, k, v):
        return anchors.fa4_output(found.module.flash_attn_func(q, k, v, causal=config.causal))

    yield attn


SYSTEMS = {
    "flashtile": flashtile_system,
    "cudnn": sdpa_system("CUDNN_ATTENTION"),
    "fa2": sdpa_system("FLASH_ATTENTION"),
    "flex": flex_system,
    "fa4": fa4_system,
}


def anchor_status(names: list[str]) -> dict[str, str]:
    """What the report says about each requested anchor; FA4 is probed (it may not import)."""
    return {name: (anchors.fa4().status if name == "fa4" else f"run ({ANCHORS[name]})") for name in names}


def runnable_systems(names: list[str]) -> list[str]:
    """flashtile first, then the requested anchors that can run here (an absent FA4 is left out)."""
    return ["flashtile", *(name for name in names if name != "fa4" or anchors.fa4().available)]


# --------------------------------------------------------------------------- #
# Checking and timing one point
# --------------------------------------------------------------------------- #


def check_system(attn: AttentionFn, inputs: dict, mode: str, ref: dict) -> dict[str, float]:
    """Run ``attn`` once on the full batch; relative errors vs ``ref`` on the checked batch."""
    import torch

    needs_grad = mode != "fwd"
    q, k, v = leaf_inputs(inputs, requires_grad=needs_grad)
    out = attn(q, k, v)
    errors = {"out": relative_error(out[:CHECK_BATCH], ref["out"])}
    if needs_grad:
        grads = torch.autograd.grad(out, (q, k, v), inputs["dout"])
        for name, grad in zip(("dq", "dk", "dv"), grads):
            errors[name] = relative_error(grad[:CHECK_BATCH], ref[name])
    return errors


def timed_callable(attn: AttentionFn, inputs: dict, mode: str) -> Callable[[], object]:
    """The zero-argument function do_bench calls: fwd a forward without grad; bwd only
    autograd.grad(..., retain_graph=True) on one forward; fwd_bwd both together."""
    import torch

    dout = inputs["dout"]
    q, k, v = leaf_inputs(inputs, requires_grad=mode != "fwd")
    if mode == "fwd":
        return lambda: attn(q, k, v)
    if mode == "bwd":
        out = attn(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    if mode == "fwd_bwd":
        return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
    raise ValueError(f"unknown mode {mode!r}")


def run_record(system: str, config: AttnConfig, mode: str, inputs: dict, ref: dict, settings: Settings,
               repeat: int, notes: Progress, shown: set) -> Record:
    """Check, then (if timing) time one system on one config and mode; failures become ``skipped``."""
    record = Record(system=system, headdim=config.headdim, causal=config.causal, seqlen=config.seqlen,
                    seqlen_q=config.sq, batch=config.batch, nheads=config.nheads, nheads_k=config.hk, mode=mode,
                    dtype=settings.dtype, repeat=repeat)
    caught: list = []
    phase = "check"
    try:
        with SYSTEMS[system](config, settings.device) as attn:
            errors = call_capturing_warnings(lambda: check_system(attn, inputs, mode, ref), caught)
            for text in warning_texts(caught):
                if (system, text) not in shown:
                    shown.add((system, text))
                    notes.note(f"    note ({system}): {text}")
            worst = max(errors, key=lambda name: (not math.isfinite(errors[name]), errors[name]))
            record.rel_errs, record.rel_err = errors, errors[worst]
            record.ok = errors[worst] < settings.tolerance  # False for NaN/inf too
            if not record.ok:
                notes.note(f"WARNING: {system} {config.label()} {mode}: rel_err({worst}) = "
                           f"{errors[worst]:.3e} >= {settings.tolerance:g}")
            if settings.timing:
                phase = "timing"
                record.ms = do_bench_ms(timed_callable(attn, inputs, mode), settings.warmup_ms, settings.rep_ms)
                record.tflops = flops(config, mode) / (record.ms * 1e-3) / 1e12
    except Exception as exc:  # a backend refusing a shape must not stop the sweep
        record.skipped = ("" if phase == "check" else "timing failed: ") + failure_reason(exc, caught)
    return record


def format_point(record: Record) -> str:
    kind = "causal" if record.causal else "full"
    seq = (f"s={record.seqlen}" if record.seqlen_q == record.seqlen
           else f"sq={record.seqlen_q} sk={record.seqlen}")
    heads = f"h={record.nheads}" if record.nheads == record.nheads_k else f"h={record.nheads}/{record.nheads_k}"
    head = f"{record.system:<9} d={record.headdim:<3} {heads:<8} {kind:<6} {seq:<12} {record.mode:<7}"
    if record.skipped and record.rel_err is None:
        return f"{head} skipped: {record.skipped}"
    err = f"err {record.rel_err:.1e} {'ok' if record.ok else 'FAIL'}"
    if record.skipped:
        return f"{head} {err}; {record.skipped}"
    if record.ms is None:
        return f"{head} {err}"
    return f"{head} {record.ms:8.3f} ms {record.tflops:7.1f} TFLOP/s  {err}"


def run_sweep(configs: list[AttnConfig], systems: list[str], modes: list[str], settings: Settings,
              checkpoint: Callable[[list[Record]], None] | None = None,
              progress: Progress | None = None) -> list[Record]:
    """Check and time every system x config x mode, the whole sweep ``settings.repeats`` times.

    Inputs and the reference are built once per config and shared by every system and mode (the
    anchors see the very tensors flashtile sees). ``checkpoint(records)`` runs after each config.
    """
    records: list[Record] = []
    progress = progress or Progress(settings.repeats * len(configs) * len(modes) * len(systems))
    need_grads = any(mode != "fwd" for mode in modes)
    shown: set = set()
    for repeat in range(settings.repeats):
        for config_index, config in enumerate(configs):
            inputs = make_inputs(config, settings.dtype, settings.device, seed=config_index)
            checked = {name: tensor[:CHECK_BATCH] for name, tensor in inputs.items()}
            ref = reference(checked["q"], checked["k"], checked["v"], config.causal,
                            dout=checked["dout"] if need_grads else None)
            for mode in modes:
                for system in systems:
                    record = run_record(system, config, mode, inputs, ref, settings, repeat, progress, shown)
                    records.append(record)
                    progress.step(format_point(record))
            del inputs, checked, ref
            free_device_memory(settings.device)
            if checkpoint is not None:
                checkpoint(records)
    return records


# --------------------------------------------------------------------------- #
# The table and the plot
# --------------------------------------------------------------------------- #


def _key(record: Record) -> tuple:
    return (record.headdim, record.nheads, record.nheads_k, record.causal, record.mode, record.seqlen,
            record.seqlen_q)


def _group(records: list[Record]) -> dict:
    """{point key: {system: [records over repeats]}}."""
    groups: dict = {}
    for record in records:
        groups.setdefault(_key(record), {}).setdefault(record.system, []).append(record)
    return groups


def _median_tflops(records: list[Record]) -> float | None:
    values = [r.tflops for r in records if r.tflops is not None]
    return statistics.median(values) if values else None


def _spread(records: list[Record]) -> float | None:
    """(max - min) / median of TFLOP/s over repeats."""
    values = [r.tflops for r in records if r.tflops is not None]
    return (max(values) - min(values)) / statistics.median(values) if len(values) >= 2 else None


def build_table(records: list[Record], systems: list[str], timing: bool) -> Table:
    """TFLOP/s per system (max rel_err when not timing), flashtile's ratio to each anchor, ok."""
    repeats = len({r.repeat for r in records})
    others = [s for s in systems if s != "flashtile"]
    header = ["hdim", "heads", "causal", "mode", "seqlen", *systems, *(f"ft/{s}" for s in others)]
    if timing and repeats > 1:
        header.append("spread")
    header.append("ok")
    groups = _group(records)
    mode_order = {mode: i for i, mode in enumerate(MODES)}
    ratios: dict = {}  # (mode, other) -> [flashtile / other]
    rows = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2], k[3], mode_order[k[4]], k[5], k[6])):
        headdim, nheads, nheads_k, causal, mode, seqlen, seqlen_q = key
        by_system = groups[key]
        row = [str(headdim), str(nheads) if nheads == nheads_k else f"{nheads}/{nheads_k}",
               "yes" if causal else "no", mode, str(seqlen) if seqlen == seqlen_q else f"{seqlen_q}/{seqlen}"]
        medians = {}
        for system in systems:
            runs = by_system.get(system, [])
            if not runs or all(r.skipped for r in runs):
                row.append("skip" if runs else "-")
            elif timing:
                medians[system] = _median_tflops(runs)
                row.append("-" if medians[system] is None else f"{medians[system]:.1f}")
            else:
                errs = [r.rel_err for r in runs if r.rel_err is not None]
                row.append(f"{max(errs):.1e}" if errs else "-")
        for other in others:
            ft, ref = medians.get("flashtile"), medians.get(other)
            if ft and ref:
                ratios.setdefault((mode, other), []).append(ft / ref)
                row.append(f"{ft / ref:.2f}")
            else:
                row.append("-")
        if timing and repeats > 1:
            spreads = [s for s in (_spread(by_system.get(system, [])) for system in systems) if s is not None]
            row.append(f"{100 * max(spreads):.1f}%" if spreads else "-")
        failing = [s for s in systems if any(r.ok is False for r in by_system.get(s, []))]
        checked = any(r.ok is not None for runs in by_system.values() for r in runs)
        row.append("FAIL:" + ",".join(failing) if failing else ("ok" if checked else "-"))
        rows.append(row)

    notes = []
    if any(r[4].count("/") for r in rows) or any(r[1].count("/") for r in rows):
        notes.append("seqlen q/k where they differ; heads q/kv where they differ (GQA)")
    if timing and repeats > 1:
        notes.append(f"TFLOP/s: median of {repeats} repeats; spread = (max-min)/median, worst system of the row")
    for mode in MODES:
        parts = [f"{o} {geomean(ratios[(mode, o)]):.2f}" for o in others if (mode, o) in ratios]
        if parts:
            notes.append(f"geomean flashtile/x, {mode}: " + ", ".join(parts))
    failures = [r for r in records if r.ok is False]
    for r in failures[:12]:
        worst = ", ".join(f"{name} {err:.1e}" for name, err in (r.rel_errs or {}).items())
        notes.append(f"FAIL {r.system} d={r.headdim} {'causal' if r.causal else 'full'} sq={r.seqlen_q} "
                     f"sk={r.seqlen} {r.mode} (repeat {r.repeat}): {worst}")
    if len(failures) > 12:
        notes.append(f"... and {len(failures) - 12} more failures (see results.json)")
    notes += skipped_notes((r.system, r.skipped) for r in records)
    return Table(header=header, rows=rows, notes=notes)


def draw_plot(records: list[Record], systems: list[str], title: str):
    """TFLOP/s vs seqlen_k: one panel per (head dim, heads, causal) row x mode column."""

    def draw(plt):
        import matplotlib.ticker

        groups = _group(records)
        panel_rows = sorted({(k[0], k[1], k[2], k[3]) for k in groups})
        modes = [mode for mode in MODES if any(k[4] == mode for k in groups)]
        seqlens = sorted({k[5] for k in groups})
        queries = sorted({k[6] for k in groups})
        fig, axes = plt.subplots(len(panel_rows), len(modes), figsize=(4.2 * len(modes), 3.0 * len(panel_rows)),
                                 squeeze=False, sharex=True)
        for row_index, (headdim, nheads, nheads_k, causal) in enumerate(panel_rows):
            for col_index, mode in enumerate(modes):
                ax = axes[row_index][col_index]
                for color_index, system in enumerate(systems):  # fixed colour per system across panels
                    for style_index, seqlen_q in enumerate(queries):
                        points = [(s, _median_tflops(groups.get((headdim, nheads, nheads_k, causal, mode, s,
                                                                 seqlen_q), {}).get(system, [])))
                                  for s in seqlens]
                        points = [(s, y) for s, y in points if y is not None]
                        label = system if len(queries) == 1 else f"{system} sq={seqlen_q}"
                        if points:
                            ax.plot(*zip(*points), marker="o", markersize=3, label=label,
                                    color=f"C{color_index}", linestyle=("-", "--", ":", "-.")[style_index % 4])
                ax.set_xscale("log", base=2)
                ax.set_xticks(seqlens)
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
                ax.set_ylim(bottom=0)
                ax.grid(alpha=0.3)
                heads = f"h{nheads}" if nheads == nheads_k else f"h{nheads}/{nheads_k}"
                ax.set_title(f"d={headdim} {heads} {'causal' if causal else 'non-causal'} {mode}", fontsize=9)
                if col_index == 0:
                    ax.set_ylabel("TFLOP/s")
                if row_index == len(panel_rows) - 1:
                    ax.set_xlabel("seqlen (keys)")
        handles: dict = {}
        for ax in axes.flat:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, handle)
        fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=max(1, len(handles)))
        fig.suptitle(title, fontsize=10)
        return fig

    return draw


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def _modes(text: str) -> list[str]:
    """--modes: fwd, bwd, fwd_bwd (fwd+bwd also accepted)."""
    return choice_list(MODES)(",".join(MODE_ALIASES.get(p.strip(), p.strip()) for p in text.split(",")))


def _anchor_list(text: str) -> list[str]:
    """--anchors: names from ANCHORS, or 'none'."""
    return [] if text.strip() == "none" else choice_list(ANCHORS, allow_empty=True)(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--headdims", type=size_list, default=None, help="head dims to sweep (default: 64,128)")
    add("--seqlens", type=size_list, default=None,
        help="key (and query) lengths, e.g. 1k,4k,16k (default: 1k,2k,4k,8k,16k)")
    add("--seqlen-q", type=size_list, default=None,
        help="query lengths, each run against every --seqlens (e.g. 1 or 1k for chunked prefill; "
             "default: equal to the key length); causal is bottom-right aligned")
    add("--heads", type=int, default=None, help="query heads (default: hidden // headdim)")
    add("--heads-k", type=int, default=None, help="key/value heads, dividing --heads: GQA/MQA (default: --heads)")
    add("--batch", type=int, default=None, help="batch size (default: tokens // seqlen)")
    add("--tokens", type=parse_size, default=16384, help="tokens per batch, batch = tokens // seqlen (default: 16k)")
    add("--hidden", type=int, default=2048, help="hidden size, nheads = hidden // headdim (default: %(default)s)")
    add("--causal", choices=tuple(CAUSAL_CHOICES), default="both", help="causal masking (default: %(default)s)")
    add("--modes", type=_modes, default=list(MODES),
        help="fwd, bwd (backward alone), fwd_bwd (or fwd+bwd) (default: all three)")
    add("--dtype", choices=tuple(DTYPE_NAMES), default=None, help="input dtype (default: bf16; fp16 when smoke)")
    add("--anchors", type=_anchor_list, default=None,
        help="anchors timed in the same run: " + ", ".join(f"{k} ({v})" for k, v in ANCHORS.items())
             + "; 'none' for flashtile alone (default: all; fa4 where importable; none with --interpret-smoke)")
    add("--repeats", type=int, default=1, help="run the whole sweep N times; median and spread (default: 1)")
    add("--quick", action="store_true", help="tiny sweep to smoke-test a GPU: headdim 64, seqlen 1k")
    add("--check-only", action="store_true",
        help="correctness checks only, no timing (exit status 1 if any check fails)")
    add_common_arguments(parser)


def resolve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill the defaults that depend on the mode (smoke or GPU) and reject what cannot run."""
    smoke = args.interpret_smoke
    if smoke and args.quick:
        parser.error("--quick and --interpret-smoke are different runs; pick one")
    if args.quick:
        args.headdims, args.seqlens = args.headdims or [64], args.seqlens or [1024]
    fill_defaults(args, SMOKE_DEFAULTS, GPU_DEFAULTS, ANCHORS)
    args.causals = CAUSAL_CHOICES[args.causal]
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    for flag in ("heads", "heads_k", "batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    for headdim in args.headdims:
        heads = args.heads or args.hidden // headdim
        if args.heads is None and args.hidden % headdim:
            parser.error(f"--hidden {args.hidden} is not a multiple of head dim {headdim} (or pass --heads)")
        if args.heads_k is not None and heads % args.heads_k:
            parser.error(f"--heads-k {args.heads_k} does not divide {heads} query heads (head dim {headdim})")
    if args.batch is None:
        for seqlen in args.seqlens:
            if args.tokens < seqlen:
                parser.error(f"--tokens {args.tokens} is smaller than seqlen {seqlen} (batch would be 0)")
    check_smoke_sizes(parser, args, [*args.seqlens, *(args.seqlen_q or []), *args.headdims])
    return args


def run(args: argparse.Namespace, command: list[str]) -> int:
    """The sweep: check, time, report. Returns the exit status (1 if a flashtile check failed)."""
    torch = require_torch(PROG)
    smoke = args.interpret_smoke
    device = run_device(args, PROG)
    torch.set_float32_matmul_precision("highest")  # the float32 reference must not use TF32
    settings = Settings(dtype=args.dtype, device=device, timing=not (smoke or args.check_only),
                        repeats=args.repeats, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    configs = sweep_configs(args.headdims, args.seqlens, args.causals, args.tokens, args.hidden,
                            seqlens_q=args.seqlen_q, nheads=args.heads, nheads_k=args.heads_k, batch=args.batch)
    systems = runnable_systems(args.anchors)
    meta = collect_meta(command, device, {
        "bench": "dense", "interpret_smoke": smoke, "anchors": anchor_status(args.anchors), "systems": systems,
        "dtype": settings.dtype, "timing": settings.timing, "repeats": settings.repeats,
        "warmup_ms": settings.warmup_ms, "rep_ms": settings.rep_ms, "tolerance": settings.tolerance,
        "check_batch": CHECK_BATCH, "tokens": args.tokens, "hidden": args.hidden, "heads": args.heads,
        "heads_k": args.heads_k, "batch": args.batch, "seqlen_q": args.seqlen_q,
        "flops": "4*b*h*d*pairs; pairs = sq*sk, causal sq*sk/2 when sq == sk else exact bottom-right; "
                 "bwd 2.5x, fwd_bwd 3.5x"})
    out_dir = check_out_dir(args.out or default_out_dir("dense", meta["gpu"]))
    progress = Progress(settings.repeats * len(configs) * len(args.modes) * len(systems))
    where = meta["gpu"] and f"{meta['gpu']} ({meta['sm_count']} SMs)" or "CPU, TRITON_INTERPRET=1"
    progress.note(f"{where} | torch {meta['torch']} triton {meta['triton']} CUDA {meta['cuda']} "
                  f"cuDNN {meta['cudnn']} | flashtile {meta['flashtile_commit']}")
    for name, status in meta["anchors"].items():
        progress.note(f"anchor {name}: {status}")
    progress.note(f"{len(configs)} configs x {len(args.modes)} modes x {len(systems)} systems x "
                  f"{args.repeats} repeats -> {out_dir}")

    if settings.timing:
        warm_up_gpu(args.gpu_warmup_s)
    records = run_sweep(configs, systems, args.modes, settings, progress=progress,
                        checkpoint=lambda recs: write_json(out_dir / "results.json", meta, recs, complete=False))
    table = build_table(records, systems, settings.timing)
    write_json(out_dir / "results.json", meta, records, complete=True)
    title = "flashtile attention benchmark" if settings.timing else "flashtile attention correctness check"
    unit = "TFLOP/s" if settings.timing else "max rel. error vs float32 reference"
    shapes = sorted({(c.headdim, c.batch, c.nheads, c.hk) for c in configs})
    details = [f"- {settings.dtype}, layout (b, s, h, d); "
               + ", ".join(f"d{d}: b={b} h={h}" + (f"/{hk}" if hk != h else "") for d, b, h, hk in shapes)
               + f" (batch = {args.tokens} tokens // seqlen unless --batch, heads = {args.hidden} // d unless "
               f"--heads); cells: {unit}; ft/x = flashtile / x, same run; "
               f"ok = rel. error < {settings.tolerance:g} for out (and dq, dk, dv)",
               f"- FLOPs: {meta['flops']}"]
    write_markdown(out_dir / "results.md", title, meta, details, table)
    if settings.timing:
        plot_title = (f"{meta['gpu']}, {settings.dtype}, flashtile {(meta['flashtile_commit'] or 'unknown')[:10]}")
        save_plot(draw_plot(records, systems, plot_title), out_dir / "tflops.png", rect=(0, 0.05, 1, 0.97))
    print(f"\n== {where} {settings.dtype} | {unit} | {progress.done} points | results in {out_dir}", flush=True)
    print(render_text(table), flush=True)
    flashtile_failed = any(r.system == "flashtile" and (r.ok is False or (r.ok is None and r.skipped))
                           for r in records)
    if smoke or args.check_only:
        return 1 if flashtile_failed or any(r.ok is False for r in records) else 0
    return 0
