#!/usr/bin/env python3
"""Benchmark flashtile's ``flash_attn_func`` against PyTorch SDPA backends.

For every (system, head dim, causal, seqlen, mode) of the sweep this script
first checks the system's output (and gradients) against a float32 reference
computed with plain PyTorch math, then times it with
``triton.testing.do_bench`` and reports TFLOP/s. Results go to
``results.json`` (raw records + environment), ``results.md`` (the table, ready
to commit) and ``tflops.png`` under ``--out``.

Conventions (they match the committed anchor numbers, see bench/README.md):
16384 tokens per batch (batch = tokens // seqlen), hidden 2048
(nheads = hidden // headdim), bf16, layout (batch, seqlen, nheads, headdim);
forward FLOPs = 4 * b * h * s * s * d (halved when causal), backward = 2.5x
forward, forward+backward = 3.5x forward.

torch, triton and flashtile are imported inside functions rather than at the
top of the module: ``--help`` must work without them, and ``--interpret-smoke``
has to set TRITON_INTERPRET=1 before triton is imported for the first time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "latest"
SMOKE_OUT = Path(tempfile.gettempdir()) / "flashtile-bench-smoke"

MODES = ("fwd", "bwd", "fwd_bwd")
# FLOPs of a mode as a multiple of the forward FLOPs.
FLOPS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
# Largest accepted relative error ||out - ref|| / ||ref|| (and the same for dq, dk, dv).
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}
# Correctness is checked on the first CHECK_BATCH batch elements to bound memory.
CHECK_BATCH = 1
# The float32 reference is chunked over batch*heads so one chunk's scores stay below this.
REFERENCE_CHUNK_BYTES = 2 * 1024**3
# --interpret-smoke runs this one tiny shape on the CPU through Triton's interpreter.
SMOKE_SHAPE = {"batch": 1, "seqlen": 64, "nheads": 2, "headdim": 32}


# --------------------------------------------------------------------------- #
# Problem description and records
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """One attention problem; tensors are laid out (batch, seqlen, nheads, headdim)."""

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    causal: bool

    def label(self) -> str:
        kind = "causal" if self.causal else "full"
        return f"d={self.headdim} {kind} s={self.seqlen} (b={self.batch} h={self.nheads})"


@dataclasses.dataclass
class Record:
    """The outcome of one (system, config, mode, repeat); one entry of results.json."""

    system: str
    headdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int
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


def sweep_configs(headdims, seqlens, causals, tokens: int, hidden: int) -> list[AttnConfig]:
    """All configs of the sweep, ordered head dim, causal, seqlen."""
    return [
        AttnConfig(batch=tokens // seqlen, seqlen=seqlen, nheads=hidden // headdim, headdim=headdim, causal=causal)
        for headdim in headdims
        for causal in causals
        for seqlen in seqlens
    ]


def flops(config: AttnConfig, mode: str) -> float:
    """FLOPs of one call in ``mode`` by the anchor convention (causal = half of full)."""
    forward = 4.0 * config.batch * config.nheads * config.seqlen * config.seqlen * config.headdim
    if config.causal:
        forward /= 2
    return forward * FLOPS_FACTOR[mode]


# --------------------------------------------------------------------------- #
# Inputs and the float32 reference
# --------------------------------------------------------------------------- #


def make_inputs(config: AttnConfig, dtype: str, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random q, k, v and the output gradient dout, each (batch, seqlen, nheads, headdim)."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (config.batch, config.seqlen, config.nheads, config.headdim)
    torch_dtype = getattr(torch, DTYPE_NAMES[dtype])
    return {
        name: torch.randn(shape, generator=generator, device=device, dtype=torch_dtype)
        for name in ("q", "k", "v", "dout")
    }


def leaf_inputs(inputs: dict, requires_grad: bool) -> tuple:
    """Fresh autograd leaves (sharing storage) for q, k, v."""
    return tuple(inputs[name].detach().requires_grad_(requires_grad) for name in ("q", "k", "v"))


def reference(q, k, v, causal: bool, dout=None, softmax_scale: float | None = None,
              chunk_bytes: int = REFERENCE_CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """Float32 attention in plain PyTorch math: the yardstick for correctness.

    Computes softmax(q k^T * scale [+ causal mask, bottom-right aligned]) v on
    (batch, seqlen, nheads, headdim) inputs of any float dtype, chunked over
    batch*heads so one chunk's score matrix stays below ``chunk_bytes``.
    Returns float32 tensors in the same layout: "out" and, when ``dout`` is
    given, the gradients "dq", "dk", "dv" of sum(out * dout).
    """
    import torch

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = headdim**-0.5 if softmax_scale is None else softmax_scale
    want_grads = dout is not None

    def to_rows(x):  # (b, s, h, d) -> (b*h, s, d) float32
        return x.detach().float().transpose(1, 2).reshape(batch * nheads, x.shape[1], headdim)

    def from_rows(x):  # (b*h, s, d) -> (b, s, h, d)
        return x.reshape(batch, nheads, x.shape[1], headdim).transpose(1, 2)

    q_rows, k_rows, v_rows = to_rows(q), to_rows(k), to_rows(v)
    dout_rows = to_rows(dout) if want_grads else None
    # Bottom-right aligned: query i sees keys j <= i + (seqlen_k - seqlen_q).
    masked = None
    if causal:
        masked = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).triu(seqlen_k - seqlen_q + 1)

    names = ("out", "dq", "dk", "dv") if want_grads else ("out",)
    pieces: dict[str, list] = {name: [] for name in names}
    rows_per_chunk = max(1, chunk_bytes // (seqlen_q * seqlen_k * 4))
    for start in range(0, batch * nheads, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        qc, kc, vc = (x[rows].detach().requires_grad_(want_grads) for x in (q_rows, k_rows, v_rows))
        with torch.enable_grad():
            scores = torch.matmul(qc, kc.transpose(1, 2)) * scale
            if masked is not None:
                scores = scores.masked_fill(masked, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), vc)
        pieces["out"].append(out.detach())
        if want_grads:
            for name, grad in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (qc, kc, vc), dout_rows[rows])):
                pieces[name].append(grad)
        del scores, out
    return {name: from_rows(torch.cat(parts)) for name, parts in pieces.items()}


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float32 (inf on a shape mismatch)."""
    import torch

    if tuple(actual.shape) != tuple(expected.shape):
        return math.inf
    diff = torch.linalg.vector_norm(actual.detach().float() - expected)
    return (diff / torch.linalg.vector_norm(expected)).item()


# --------------------------------------------------------------------------- #
# Systems under test
# --------------------------------------------------------------------------- #
#
# SYSTEMS maps a name to a context-manager factory: ``with SYSTEMS[name](config,
# device) as attn:`` builds ``attn(q, k, v) -> out`` for that config, with q, k,
# v and out in (batch, seqlen, nheads, headdim) layout. The context is held for
# the correctness check and the timing, so a system can pin global state (e.g.
# the SDPA backend) outside the timed region. To add a system, add an entry.

AttentionFn = Callable[..., "torch.Tensor"]


@contextlib.contextmanager
def flashtile_system(config: AttnConfig, device: str) -> Iterator[AttentionFn]:
    """flashtile.flash_attn_func, called exactly as flash_attn 2.x would be."""
    from flashtile import flash_attn_func

    def attn(q, k, v):
        return flash_attn_func(q, k, v, causal=config.causal)

    yield attn


def sdpa_system(backend_name: str):
    """A system for torch SDPA pinned to one SDPBackend (e.g. "FLASH_ATTENTION").

    SDPA takes (b, h, s, d): it gets transpose(1, 2) views of the same
    (b, s, h, d) tensors, the way the anchor numbers were measured.
    """

    @contextlib.contextmanager
    def system(config: AttnConfig, device: str) -> Iterator[AttentionFn]:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attn(q, k, v):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=config.causal
            )
            return out.transpose(1, 2)

        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            yield attn

    return system


@functools.cache
def compiled_flex_attention():
    """torch.compile'd FlexAttention, built once and shared by every config."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    # Each (shape, mask, grad mode) compiles its own graph; raise dynamo's
    # recompile limit so it never silently falls back to the (slow) eager path.
    dynamo_config = torch._dynamo.config
    for limit_name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, limit_name):
            setattr(dynamo_config, limit_name, max(getattr(dynamo_config, limit_name), 256))
            break
    # The "bwd" mode times autograd.grad(..., retain_graph=True) on one forward, which a compiled
    # backward with donated buffers refuses: turn donation off so Flex's backward is timed too.
    functorch_config = torch._functorch.config
    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def _causal_mask_mod(batch, head, q_idx, kv_idx):
    """FlexAttention mask_mod for causal attention (seqlen_q == seqlen_k)."""
    return q_idx >= kv_idx


@contextlib.contextmanager
def flex_system(config: AttnConfig, device: str) -> Iterator[AttentionFn]:
    """torch FlexAttention (compiled), with a causal block mask when causal."""
    from torch.nn.attention.flex_attention import create_block_mask

    flex_attention = compiled_flex_attention()
    block_mask = None
    if config.causal:
        block_mask = create_block_mask(
            _causal_mask_mod, B=None, H=None, Q_LEN=config.seqlen, KV_LEN=config.seqlen, device=device
        )

    def attn(q, k, v):
        out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        return out.transpose(1, 2)

    yield attn


SYSTEMS = {
    "flashtile": flashtile_system,
    "sdpa-fa2": sdpa_system("FLASH_ATTENTION"),
    "sdpa-cudnn": sdpa_system("CUDNN_ATTENTION"),
    "flex": flex_system,
}
DEFAULT_SYSTEMS = ("flashtile", "sdpa-fa2", "sdpa-cudnn", "flex")


def short_name(system: str) -> str:
    """Compact system name for ratio columns: 'sdpa-cudnn' -> 'cudnn'."""
    return system.removeprefix("sdpa-")


# --------------------------------------------------------------------------- #
# Checking and timing one system
# --------------------------------------------------------------------------- #


def check_system(attn: AttentionFn, inputs: dict, mode: str, ref: dict) -> dict[str, float]:
    """Run ``attn`` once on the full batch; relative errors vs ``ref`` on the checked batch.

    For "fwd" only the output is compared (inputs do not require grad); for
    "bwd" and "fwd_bwd" the gradients dq, dk, dv of sum(out * dout) too.
    """
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
    """The zero-argument function do_bench calls for ``mode``.

    fwd: a plain forward on inputs that do not require grad.
    bwd: the forward runs once here; only autograd.grad(..., retain_graph=True) is timed.
    fwd_bwd: forward and backward together.
    """
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


def time_system(attn: AttentionFn, inputs: dict, mode: str, settings: Settings) -> float:
    """Median milliseconds per call of ``mode`` (do_bench flushes L2 between calls)."""
    from triton.testing import do_bench

    fn = timed_callable(attn, inputs, mode)
    return float(do_bench(fn, warmup=settings.warmup_ms, rep=settings.rep_ms, return_mode="median"))


def call_capturing_warnings(fn: Callable[[], object], sink: list):
    """Call ``fn``; every warning it raises is appended to ``sink`` instead of printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn()
        finally:
            sink.extend(caught)


def warning_texts(caught: list, limit: int = 3) -> list[str]:
    """First lines of the distinct warnings in ``caught`` (torch's C++ location suffix dropped)."""
    texts: list[str] = []
    for entry in caught:
        text = str(entry.message).split(" (Triggered internally at")[0].strip()
        text = text.splitlines()[0] if text else ""
        if text and text not in texts:
            texts.append(text)
    return texts[:limit]


def failure_reason(exc: BaseException, caught: list) -> str:
    """One-line reason for a skipped record, with the warnings that explain it (SDPA emits those)."""
    message = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {message[0] if message else ''}"[:300]
    hints = warning_texts(caught)
    if hints:
        reason += " [warnings: " + "; ".join(hints)[:500] + "]"
    return reason


_NOTES_SHOWN: set = set()


def run_record(system: str, config: AttnConfig, mode: str, inputs: dict, ref: dict,
               settings: Settings, repeat: int) -> Record:
    """Check, then (if settings.timing) time one system on one config and mode.

    Never raises for a system failure: an exception becomes ``skipped``.
    """
    record = Record(system=system, headdim=config.headdim, causal=config.causal, seqlen=config.seqlen,
                    batch=config.batch, nheads=config.nheads, mode=mode, dtype=settings.dtype, repeat=repeat)
    caught: list = []
    phase = "check"
    try:
        with SYSTEMS[system](config, settings.device) as attn:
            errors = call_capturing_warnings(lambda: check_system(attn, inputs, mode, ref), caught)
            for text in warning_texts(caught):
                if (system, text) not in _NOTES_SHOWN:
                    _NOTES_SHOWN.add((system, text))
                    print(f"    note ({system}): {text}", flush=True)
            worst = max(errors, key=lambda name: (not math.isfinite(errors[name]), errors[name]))
            record.rel_errs = errors
            record.rel_err = errors[worst]
            record.ok = errors[worst] < settings.tolerance  # False for NaN/inf too
            if not record.ok:
                print(f"WARNING: {system} {config.label()} {mode}: rel_err({worst}) = "
                      f"{errors[worst]:.3e} >= {settings.tolerance:g}", flush=True)
            if settings.timing:
                phase = "timing"
                record.ms = time_system(attn, inputs, mode, settings)
                record.tflops = flops(config, mode) / (record.ms * 1e-3) / 1e12
    except Exception as exc:  # a backend refusing a shape must not stop the sweep
        prefix = "" if phase == "check" else "timing failed: "
        record.skipped = prefix + failure_reason(exc, caught)
    return record


# --------------------------------------------------------------------------- #
# The sweep
# --------------------------------------------------------------------------- #


def warm_up_gpu(seconds: float) -> None:
    """Run bf16 matmuls for ``seconds`` so the SM clock leaves its idle 345 MHz."""
    import torch

    if seconds <= 0:
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            torch.matmul(a, b)
        torch.cuda.synchronize()
    del a, b
    torch.cuda.empty_cache()


def free_device_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def format_progress(index: int, total: int, record: Record) -> str:
    kind = "causal" if record.causal else "full"
    head = (f"[{index:>{len(str(total))}}/{total}] {record.system:<10} d={record.headdim:<3} {kind:<6} "
            f"s={record.seqlen:<5} {record.mode:<7}")
    if record.skipped and record.rel_err is None:
        return f"{head} skipped: {record.skipped}"
    err = f"err {record.rel_err:.1e} {'ok' if record.ok else 'FAIL'}"
    if record.skipped:
        return f"{head} {err}; {record.skipped}"
    if record.ms is None:
        return f"{head} {err}"
    return f"{head} {record.ms:8.3f} ms {record.tflops:7.1f} TFLOP/s  {err}"


def run_sweep(configs: list[AttnConfig], systems: list[str], modes: list[str], settings: Settings,
              checkpoint: Callable[[list[Record]], None] | None = None) -> list[Record]:
    """Check and time every system x config x mode, the whole sweep ``settings.repeats`` times.

    Inputs and the float32 reference are built once per config and shared by
    all systems and modes. ``checkpoint(records)`` is called after each
    config, so a crash (e.g. a CUDA fault) still leaves partial results.
    """
    records: list[Record] = []
    total = settings.repeats * len(configs) * len(modes) * len(systems)
    need_grads = any(mode != "fwd" for mode in modes)
    for repeat in range(settings.repeats):
        for config_index, config in enumerate(configs):
            inputs = make_inputs(config, settings.dtype, settings.device, seed=config_index)
            checked = {name: tensor[:CHECK_BATCH] for name, tensor in inputs.items()}
            ref = reference(checked["q"], checked["k"], checked["v"], config.causal,
                            dout=checked["dout"] if need_grads else None)
            for mode in modes:
                for system in systems:
                    record = run_record(system, config, mode, inputs, ref, settings, repeat)
                    records.append(record)
                    print(format_progress(len(records), total, record), flush=True)
            del inputs, checked, ref
            free_device_memory(settings.device)
            if checkpoint is not None:
                checkpoint(records)
    return records


# --------------------------------------------------------------------------- #
# Reporting: table, JSON, Markdown, plot
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Table:
    """The summary table: one row per (headdim, causal, mode, seqlen), plus notes below it."""

    header: list[str]
    rows: list[list[str]]
    notes: list[str]


LEFT_ALIGNED_COLUMNS = {"causal", "mode", "ok"}


def _group_records(records: list[Record]) -> dict:
    """{(headdim, causal, mode, seqlen): {system: [records over repeats]}}."""
    groups: dict = {}
    for record in records:
        key = (record.headdim, record.causal, record.mode, record.seqlen)
        groups.setdefault(key, {}).setdefault(record.system, []).append(record)
    return groups


def _median_tflops(records: list[Record]) -> float | None:
    values = [r.tflops for r in records if r.tflops is not None]
    return statistics.median(values) if values else None


def _spread(records: list[Record]) -> float | None:
    """(max - min) / median of TFLOP/s over repeats."""
    values = [r.tflops for r in records if r.tflops is not None]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def build_table(records: list[Record], systems: list[str], timing: bool) -> Table:
    """Summarize records: TFLOP/s per system (max rel_err when not timing), flashtile ratios, ok."""
    repeats = len({r.repeat for r in records})
    others = [s for s in systems if s != "flashtile"] if "flashtile" in systems else []
    header = ["hdim", "causal", "mode", "seqlen", *systems, *(f"ft/{short_name(s)}" for s in others)]
    if timing and repeats > 1:
        header.append("spread")
    header.append("ok")

    groups = _group_records(records)
    mode_order = {mode: i for i, mode in enumerate(MODES)}
    ratios: dict = {}  # (mode, other) -> [flashtile / other]
    rows = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], mode_order[k[2]], k[3])):
        headdim, causal, mode, seqlen = key
        by_system = groups[key]
        row = [str(headdim), "yes" if causal else "no", mode, str(seqlen)]
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
        failing = [short_name(s) for s in systems if any(r.ok is False for r in by_system.get(s, []))]
        checked = any(r.ok is not None for runs in by_system.values() for r in runs)
        row.append("FAIL:" + ",".join(failing) if failing else ("ok" if checked else "-"))
        rows.append(row)

    notes = []
    if timing and repeats > 1:
        notes.append(f"TFLOP/s: median of {repeats} repeats; spread = (max-min)/median, worst system of the row")
    for mode in MODES:
        parts = [f"{short_name(o)} {_geomean(ratios[(mode, o)]):.2f}" for o in others if (mode, o) in ratios]
        if parts:
            notes.append(f"geomean flashtile/x, {mode}: " + ", ".join(parts))
    notes.extend(_failure_notes(records))
    notes.extend(_skip_notes(records))
    return Table(header=header, rows=rows, notes=notes)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _failure_notes(records: list[Record], limit: int = 12) -> list[str]:
    failures = [r for r in records if r.ok is False]
    notes = []
    for r in failures[:limit]:
        worst = ", ".join(f"{name} {err:.1e}" for name, err in (r.rel_errs or {}).items())
        notes.append(f"FAIL {r.system} d={r.headdim} {'causal' if r.causal else 'full'} s={r.seqlen} "
                     f"{r.mode} (repeat {r.repeat}): {worst}")
    if len(failures) > limit:
        notes.append(f"... and {len(failures) - limit} more failures (see results.json)")
    return notes


def _skip_notes(records: list[Record]) -> list[str]:
    """Distinct skip reasons per system, with how many records each covers."""
    counts: dict = {}
    for r in records:
        if r.skipped:
            counts[(r.system, r.skipped)] = counts.get((r.system, r.skipped), 0) + 1
    return [f"skipped {system} x{count}: {reason}" for (system, reason), count in counts.items()]


def render_text(table: Table) -> str:
    """The table as aligned plain text (for the log), followed by its notes."""
    widths = [max([len(name)] + [len(row[i]) for row in table.rows]) for i, name in enumerate(table.header)]

    def line(cells):
        return "  ".join(cell.ljust(width) if name in LEFT_ALIGNED_COLUMNS else cell.rjust(width)
                         for cell, width, name in zip(cells, widths, table.header)).rstrip()

    return "\n".join([line(table.header), *(line(row) for row in table.rows), *table.notes])


def render_markdown(table: Table) -> str:
    """The table as GitHub Markdown, followed by its notes as a list."""
    align = [":---" if name in LEFT_ALIGNED_COLUMNS else "---:" for name in table.header]
    lines = ["| " + " | ".join(table.header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    if table.notes:
        lines.append("")
        lines += [f"- {note}" for note in table.notes]
    return "\n".join(lines)


def print_table(table: Table) -> None:
    print(render_text(table), flush=True)


def git_output(*args: str) -> str | None:
    """stdout of ``git args`` in the repository, or None if git fails."""
    try:
        result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def collect_meta(argv: list[str], settings: Settings, extra: dict) -> dict:
    """Environment of the run: date, GPU, versions, command line, flashtile commit."""
    import torch
    import triton

    gpu_name = sm_count = None
    if settings.device == "cuda":
        gpu_name = torch.cuda.get_device_name(0)
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        import flashtile

        flashtile_version = getattr(flashtile, "__version__", None)
        flashtile_path = str(Path(flashtile.__file__).parent)
    except Exception:  # the records will say why flashtile could not run
        flashtile_version = flashtile_path = None
    # FLASHTILE_COMMIT names the tree when the checkout's git metadata is not that of the files
    # (a copied working tree, as on the remote GPU machine).
    commit = os.environ.get("FLASHTILE_COMMIT") or git_output("rev-parse", "HEAD")
    status = git_output("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_name,
        "sm_count": sm_count,
        "device": settings.device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "command": list(argv),
        "flashtile_commit": commit,
        "flashtile_dirty": bool(status) if status is not None else None,
        "flashtile_version": flashtile_version,
        "flashtile_path": flashtile_path,
        "dtype": settings.dtype,
        "timing": settings.timing,
        "repeats": settings.repeats,
        "warmup_ms": settings.warmup_ms,
        "rep_ms": settings.rep_ms,
        "tolerance": settings.tolerance,
        "check_batch": CHECK_BATCH,
        **extra,
    }


def _json_safe(value):
    """Replace NaN/inf (not valid JSON) with None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def write_json(path: Path, meta: dict, records: list[Record], complete: bool) -> None:
    """Write {"meta": ..., "records": [...]} atomically; meta.complete says if the sweep finished."""
    payload = _json_safe({"meta": {**meta, "complete": complete},
                          "records": [dataclasses.asdict(r) for r in records]})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def write_markdown(path: Path, meta: dict, table: Table) -> None:
    """results.md: a header with the environment, then the table."""
    title = "flashtile attention benchmark" if meta["timing"] else "flashtile attention correctness check"
    unit = "TFLOP/s" if meta["timing"] else "max rel. error vs float32 reference"
    dirty = " (dirty)" if meta.get("flashtile_dirty") else ""
    header = [
        f"# {title}",
        "",
        f"- GPU: {meta['gpu']} ({meta['sm_count']} SMs)" if meta["gpu"] else f"- device: {meta['device']}",
        f"- date (UTC): {meta['date_utc']}",
        f"- flashtile commit: {meta['flashtile_commit'] or 'unknown'}{dirty}",
        f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, "
        f"Python {meta['python']}",
        f"- command: `{shlex.join(['python', *meta['command']])}`",
        f"- {meta['dtype']}, {meta.get('tokens')} tokens/batch, hidden {meta.get('hidden')}, layout (b, s, h, d); "
        f"cells: {unit}; ok = rel. error < {meta['tolerance']:g} for out (and dq, dk, dv)",
        "",
    ]
    path.write_text("\n".join(header) + "\n" + render_markdown(table) + "\n")


def plot(records: list[Record], systems: list[str], path: Path, title: str) -> None:
    """tflops.png: TFLOP/s vs seqlen, one panel per (headdim, causal) row x mode column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups = _group_records(records)
    panel_rows = sorted({(hd, causal) for hd, causal, _, _ in groups})
    modes = [mode for mode in MODES if any(key[2] == mode for key in groups)]
    seqlens = sorted({key[3] for key in groups})
    fig, axes = plt.subplots(len(panel_rows), len(modes), figsize=(4.2 * len(modes), 3.0 * len(panel_rows)),
                             squeeze=False, sharex=True)
    for row_index, (headdim, causal) in enumerate(panel_rows):
        for col_index, mode in enumerate(modes):
            ax = axes[row_index][col_index]
            for color_index, system in enumerate(systems):  # fixed colour per system across panels
                points = [(s, _median_tflops(groups.get((headdim, causal, mode, s), {}).get(system, [])))
                          for s in seqlens]
                points = [(s, y) for s, y in points if y is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", markersize=3, label=system, color=f"C{color_index}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"d={headdim} {'causal' if causal else 'non-causal'} {mode}", fontsize=9)
            if col_index == 0:
                ax.set_ylabel("TFLOP/s")
            if row_index == len(panel_rows) - 1:
                ax.set_xlabel("seqlen")
    handles, labels = {}, {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=len(handles))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out_dir: Path, meta: dict, records: list[Record], systems: list[str], timing: bool) -> Table:
    """Final results.json, results.md and (when timing) tflops.png; returns the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = build_table(records, systems, timing)
    write_json(out_dir / "results.json", meta, records, complete=True)
    write_markdown(out_dir / "results.md", meta, table)
    if timing:
        title = (f"{meta['gpu'] or meta['device']}, {meta['dtype']}, {meta.get('tokens')} tokens, "
                 f"hidden {meta.get('hidden')}, flashtile {(meta['flashtile_commit'] or 'unknown')[:10]}")
        try:
            plot(records, systems, out_dir / "tflops.png", title)
        except Exception as exc:  # e.g. matplotlib not installed: the numbers matter more than the plot
            print(f"WARNING: could not write tflops.png: {type(exc).__name__}: {exc}", flush=True)
    return table


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def int_list(text: str) -> list[int]:
    """argparse type: '64,128' -> [64, 128]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def choice_list(choices) -> Callable[[str], list[str]]:
    """argparse type: comma-separated names, each one of ``choices``."""

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(names))  # drop duplicates, keep order

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark flashtile.flash_attn_func against torch SDPA (FlashAttention-2 and cuDNN "
                    "backends): correctness vs a float32 reference, then TFLOP/s.",
        epilog="Conventions: batch = tokens // seqlen, nheads = hidden // headdim, layout (b, s, h, d); "
               "FLOPs fwd = 4*b*h*s*s*d (halved if causal), bwd = 2.5x fwd, fwd_bwd = 3.5x fwd. "
               "See bench/README.md.",
    )
    add = parser.add_argument
    add("--headdims", type=int_list, default="64,128", help="head dims to sweep (default: %(default)s)")
    add("--seqlens", type=int_list, default="1024,2048,4096,8192,16384",
        help="sequence lengths (default: %(default)s)")
    add("--causal", choices=("both", "true", "false"), default="both", help="causal masking (default: %(default)s)")
    add("--modes", type=choice_list(MODES), default=",".join(MODES),
        help="fwd: forward; bwd: backward alone; fwd_bwd: both (default: %(default)s)")
    add("--systems", type=choice_list(tuple(SYSTEMS)), default=",".join(DEFAULT_SYSTEMS),
        help=f"systems to run, from {', '.join(SYSTEMS)} (flex = torch.compile'd FlexAttention, "
             "off by default because compiling is slow; default: %(default)s)")
    add("--dtype", choices=tuple(DTYPE_NAMES), default="bf16", help="input dtype (default: %(default)s)")
    add("--tokens", type=int, default=16384,
        help="tokens per batch, batch = tokens // seqlen (default: %(default)s)")
    add("--hidden", type=int, default=2048, help="hidden size, nheads = hidden // headdim (default: %(default)s)")
    add("--repeats", type=int, default=1,
        help="run the whole sweep N times; report median and spread (default: %(default)s)")
    add("--out", type=Path, default=None,
        help=f"output directory (default: {DEFAULT_OUT.relative_to(REPO_ROOT)}; {SMOKE_OUT} with --interpret-smoke)")
    add("--quick", action="store_true", help="tiny sweep to smoke-test: headdim 64, seqlen 1024")
    add("--check-only", action="store_true",
        help="correctness checks only, no timing (exit status 1 if any check fails)")
    add("--interpret-smoke", action="store_true",
        help="no GPU needed: run flashtile only, through TRITON_INTERPRET=1 on the CPU, at "
             "b=1 s=64 h=2 d=32 fp16, and check it against the reference (no timing)")
    add("--varlen", action="store_true",
        help="instead of the sweep: a packed batch of --tokens tokens (lengths drawn from [64, 4096]) through "
             "flash_attn_varlen_func, against the padded dense path and padded SDPA (flashtile/bench_varlen.py)")
    add("--decode", action="store_true",
        help="instead of the sweep: decoding (seqlen_q 1) through flash_attn_with_kvcache, bandwidth against "
             "the device copy and torch SDPA (flashtile/bench_decode.py)")
    add("--varlen-modes", type=choice_list(("fwd", "fwd_bwd")), default="fwd,fwd_bwd",
        help="modes of the --varlen run (default: %(default)s)")
    add("--warmup-ms", type=float, default=50.0, help="do_bench warmup per measurement (default: %(default)s)")
    add("--rep-ms", type=float, default=200.0, help="do_bench measuring time per measurement (default: %(default)s)")
    add("--gpu-warmup-s", type=float, default=3.0,
        help="seconds of matmuls before the first timing; the SM clock idles low (default: %(default)s)")
    args = parser.parse_args(argv)

    if args.quick:
        args.headdims, args.seqlens = [64], [1024]
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    for headdim in args.headdims:
        if args.hidden % headdim:
            parser.error(f"--hidden {args.hidden} is not a multiple of head dim {headdim}")
    for seqlen in args.seqlens:
        if args.tokens < seqlen:
            parser.error(f"--tokens {args.tokens} is smaller than seqlen {seqlen} (batch would be 0)")
    return args


def run_benchmark(args: argparse.Namespace, argv: list[str]) -> int:
    """The GPU sweep: check, time, report. Returns the exit status."""
    import torch

    torch.set_float32_matmul_precision("highest")  # the float32 reference must not use TF32
    settings = Settings(dtype=args.dtype, device="cuda", timing=not args.check_only, repeats=args.repeats,
                        warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    configs = sweep_configs(args.headdims, args.seqlens, args.causals, args.tokens, args.hidden)
    out_dir = args.out or DEFAULT_OUT
    meta = collect_meta(argv, settings, {"tokens": args.tokens, "hidden": args.hidden})
    print(f"{meta['gpu']} ({meta['sm_count']} SMs) | torch {meta['torch']} triton {meta['triton']} "
          f"CUDA {meta['cuda']} cuDNN {meta['cudnn']} | flashtile {meta['flashtile_commit']}", flush=True)
    print(f"{len(configs)} configs x {len(args.modes)} modes x {len(args.systems)} systems x "
          f"{args.repeats} repeats -> {out_dir}", flush=True)

    if settings.timing:
        warm_up_gpu(args.gpu_warmup_s)
    started = time.perf_counter()
    records = run_sweep(configs, args.systems, args.modes, settings,
                        checkpoint=lambda recs: write_json(out_dir / "results.json", meta, recs, complete=False))
    table = write_outputs(out_dir, meta, records, args.systems, settings.timing)

    print(f"\n== {meta['gpu']} {args.dtype} | {'TFLOP/s' if settings.timing else 'max rel_err'} "
          f"| {time.perf_counter() - started:.0f} s | results in {out_dir}", flush=True)
    print_table(table)
    if args.check_only and any(r.ok is False for r in records):
        return 1
    return 0


def run_interpret_smoke(args: argparse.Namespace, argv: list[str]) -> int:
    """flashtile alone on the CPU via Triton's interpreter, at one tiny fp16 shape.

    Proves the plumbing (inputs, reference, checks, outputs) without a GPU.
    Returns 1 if flashtile failed a check or could not run.
    """
    settings = Settings(dtype="fp16", device="cpu", timing=False)
    configs = [AttnConfig(causal=causal, **SMOKE_SHAPE) for causal in args.causals]
    out_dir = args.out or SMOKE_OUT
    systems = ["flashtile"]
    meta = collect_meta(argv, settings, {"tokens": SMOKE_SHAPE["batch"] * SMOKE_SHAPE["seqlen"],
                                         "hidden": SMOKE_SHAPE["nheads"] * SMOKE_SHAPE["headdim"],
                                         "interpret_smoke": True})
    print(f"interpret smoke test: flashtile on CPU (TRITON_INTERPRET=1), {SMOKE_SHAPE}, fp16", flush=True)
    records = run_sweep(configs, systems, args.modes, settings)
    table = write_outputs(out_dir, meta, records, systems, timing=False)
    print(f"\n== interpret smoke | max rel_err | results in {out_dir}", flush=True)
    print_table(table)
    return 0 if all(r.ok for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = list(sys.argv) if argv is None else [sys.argv[0], *argv]
    # Benchmark the flashtile of this checkout (whose commit goes into meta), not
    # whatever may be installed elsewhere: run as a script, sys.path[0] is bench/.
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    if args.interpret_smoke and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton decides at import time whether kernels run in its interpreter, and importing this
        # module (python -m flashtile.bench) already imported flashtile and triton: start again
        # with the variable set.
        os.execve(sys.executable, list(sys.orig_argv), dict(os.environ, TRITON_INTERPRET="1"))
    try:
        import torch
    except ImportError as exc:
        raise SystemExit(f"flashtile.bench: cannot import torch ({exc})") from None
    if args.interpret_smoke:
        return run_interpret_smoke(args, command)
    if not torch.cuda.is_available():
        raise SystemExit("flashtile.bench: CUDA is not available (torch "
                         f"{torch.__version__}); the benchmark needs a GPU. "
                         "Use --interpret-smoke for a CPU-only plumbing test.")
    if args.decode:
        from flashtile.bench_decode import run

        settings = Settings(dtype="bf16", device="cuda", timing=True, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        return run(args, command, lambda extra: collect_meta(command, settings, extra))
    if args.varlen:
        from flashtile.bench_varlen import run

        settings = Settings(dtype="bf16", device="cuda", timing=True, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        return run(args, command, lambda extra: collect_meta(command, settings, extra))
    return run_benchmark(args, command)


if __name__ == "__main__":
    sys.exit(main())
