"""Pieces every bench subcommand shares: argument types, the output folder, progress, metadata, JSON.

Nothing here imports torch, triton or flashtile at module level: ``--help`` and argument errors
must work without them, and ``--interpret-smoke`` has to set TRITON_INTERPRET=1 before triton is
first imported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import site
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # flashtile/
REPO_ROOT = PACKAGE_DIR.parent
# Where runs go unless --out says otherwise: a folder of the working directory, never the package.
OUT_ROOT_NAME = "flashtile-bench"
# The interpreter runs one small tile in seconds; bigger smoke shapes would take minutes.
SMOKE_MAX_SIZE = 512

_SIZE = re.compile(r"(\d+)([kKmM]?)")
_SCALE = {"": 1, "k": 1024, "m": 1024 * 1024}


# --------------------------------------------------------------------------- #
# Argument types (argparse prefixes their messages with the flag's name)
# --------------------------------------------------------------------------- #


def parse_size(text: str) -> int:
    """'1024' -> 1024, '1k' -> 1024, '16K' -> 16384, '1m' -> 1048576: sizes as people write them."""
    match = _SIZE.fullmatch(text.strip())
    value = int(match.group(1)) * _SCALE[match.group(2).lower()] if match else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 1024, 1k or 16k, got {text!r}")
    return value


def size_list(text: str) -> list[int]:
    """'1k,4k,16384' -> [1024, 4096, 16384]."""
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes such as 1k,4k,16k, got {text!r}")
    return [parse_size(part) for part in parts]


def choice_list(choices: Iterable[str], allow_empty: bool = False) -> Callable[[str], list[str]]:
    """argparse type: comma-separated names, each one of ``choices``; duplicates dropped."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or (not names and not allow_empty):
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or repr(text)}; "
                                             f"choose from {', '.join(choices)}")
        return list(dict.fromkeys(names))

    return parse


CAUSAL_CHOICES = {"both": [False, True], "true": [True], "false": [False]}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every subcommand takes: where results go, smoke test, GPU warm-up."""
    add = parser.add_argument
    add("--out", type=Path, default=None,
        help=f"output folder (default: ./{OUT_ROOT_NAME}/<date>-<mode>-<gpu> in the working directory); "
             "refused inside the flashtile package or site-packages")
    add("--interpret-smoke", action="store_true",
        help="no GPU needed: flashtile on the CPU through TRITON_INTERPRET=1 at tiny sizes, checked "
             "against the reference, outputs written; no timing")
    add("--warmup-ms", type=float, default=50.0, help="do_bench warmup per measurement (default: %(default)s)")
    add("--rep-ms", type=float, default=200.0, help="do_bench measuring time per measurement (default: %(default)s)")
    add("--gpu-warmup-s", type=float, default=3.0,
        help="seconds of matmuls before the first timing; the SM clock idles low (default: %(default)s)")


# --------------------------------------------------------------------------- #
# The output folder
# --------------------------------------------------------------------------- #


def _forbidden_roots() -> list[Path]:
    """Folders results must never land in: the package itself and every site-packages."""
    roots = {PACKAGE_DIR}
    for key in ("purelib", "platlib"):
        with contextlib.suppress(Exception):
            roots.add(Path(sysconfig.get_paths()[key]))
    with contextlib.suppress(Exception):
        roots.update(Path(p) for p in site.getsitepackages())
    with contextlib.suppress(Exception):
        roots.add(Path(site.getusersitepackages()))
    return [root.resolve() for root in roots]


def check_out_dir(path: Path) -> Path:
    """``path`` made absolute; SystemExit if it is inside the package or a site-packages folder.

    A benchmark run from an installed flashtile used to write next to its own module, i.e. into
    site-packages, where results are lost on the next upgrade and may not even be writable.
    """
    resolved = Path(path).expanduser().resolve()
    for root in _forbidden_roots():
        if resolved == root or root in resolved.parents:
            raise SystemExit(f"flashtile bench: refusing to write results to {resolved}: it is inside {root} "
                             "(flashtile's own folder or a site-packages); pass --out with a folder of your own")
    return resolved


def default_out_dir(mode: str, device_name: str | None) -> Path:
    """./flashtile-bench/<UTC date and time>-<mode>-<device>, in the working directory."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    slug = re.sub(r"[^a-z0-9]+", "-", (device_name or "cpu").lower()).strip("-") or "gpu"
    return Path.cwd() / OUT_ROOT_NAME / f"{stamp}-{mode}-{slug}"


# --------------------------------------------------------------------------- #
# Progress (stderr, so stdout stays the results)
# --------------------------------------------------------------------------- #


class Progress:
    """Prints '[i/N] elapsed, eta | line' to stderr for each finished point of a long run."""

    def __init__(self, total: int, stream=None):
        self.total = max(total, 1)
        self.done = 0
        self.started = time.perf_counter()
        self.stream = stream

    def step(self, line: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.done * (self.total - self.done)
        width = len(str(self.total))
        print(f"[{self.done:>{width}}/{self.total}] {_duration(elapsed)} elapsed, ~{_duration(eta)} left | {line}",
              file=self.stream or sys.stderr, flush=True)

    def note(self, line: str) -> None:
        print(line, file=self.stream or sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# --------------------------------------------------------------------------- #
# Running the GPU side
# --------------------------------------------------------------------------- #


def reexec_with_interpreter_if_needed() -> None:
    """Start this command again with TRITON_INTERPRET=1 unless it is set.

    Triton decides at import time whether kernels run in its interpreter, and by now flashtile may
    already have imported triton (python -m flashtile.bench imports flashtile first).
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.execve(sys.executable, list(sys.orig_argv), dict(os.environ, TRITON_INTERPRET="1"))


def fill_defaults(args: argparse.Namespace, smoke_defaults: dict, gpu_defaults: dict, anchors) -> None:
    """Set the options left unset to the mode's defaults (--interpret-smoke's tiny ones, or the GPU
    sweep's), and the anchors to every one of ``anchors`` (none in a smoke run)."""
    for name, value in (smoke_defaults if args.interpret_smoke else gpu_defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.anchors is None:
        args.anchors = [] if args.interpret_smoke else list(anchors)


def check_smoke_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, sizes: Iterable[int]) -> None:
    """--interpret-smoke runs on the CPU interpreter: refuse sizes it would take far too long on, and
    bf16 (the interpreter has no bf16 dot), before any work starts."""
    if not args.interpret_smoke:
        return
    big = [s for s in sizes if s > SMOKE_MAX_SIZE]
    if big:
        parser.error(f"--interpret-smoke runs on the CPU interpreter: sizes above {SMOKE_MAX_SIZE} "
                     f"({', '.join(map(str, big))}) would take far too long")
    if args.dtype == "bf16":
        parser.error("--interpret-smoke runs fp16 (the CPU interpreter has no bf16 dot)")


def run_device(args: argparse.Namespace, prog: str) -> str:
    """"cpu" for --interpret-smoke, else "cuda" (and a clear exit without CUDA)."""
    if args.interpret_smoke:
        return "cpu"
    require_cuda(prog)
    return "cuda"


def require_torch(prog: str):
    try:
        import torch
    except ImportError as exc:
        raise SystemExit(f"{prog}: cannot import torch ({exc})") from None
    return torch


def require_cuda(prog: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: CUDA is not available (torch {torch.__version__}); the benchmark needs a GPU. "
                         "Use --interpret-smoke for a CPU-only plumbing test.")


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


def do_bench_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds per call (do_bench flushes L2 between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


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


def failure_reason(exc: BaseException, caught: list = ()) -> str:
    """One-line reason for a skipped point, with the warnings that explain it (SDPA emits those)."""
    message = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {message[0] if message else ''}"[:300]
    hints = warning_texts(list(caught))
    if hints:
        reason += " [warnings: " + "; ".join(hints)[:500] + "]"
    return reason


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float32 (inf on a shape mismatch)."""
    import torch

    if tuple(actual.shape) != tuple(expected.shape):
        return math.inf
    diff = torch.linalg.vector_norm(actual.detach().float() - expected.float())
    return (diff / torch.linalg.vector_norm(expected.float())).item()


# --------------------------------------------------------------------------- #
# Metadata and JSON
# --------------------------------------------------------------------------- #


def git_output(*args: str) -> str | None:
    """stdout of ``git args`` in the checkout flashtile runs from, or None (an installed copy)."""
    try:
        result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def collect_meta(command: list[str], device: str, extra: dict) -> dict:
    """Environment of the run: date, GPU, versions, command line, flashtile commit."""
    import torch
    import triton

    gpu_name = sm_count = None
    if device == "cuda":
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
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "command": list(command),
        "cwd": os.getcwd(),
        "flashtile_commit": commit,
        "flashtile_dirty": bool(status) if status is not None else None,
        "flashtile_version": flashtile_version,
        "flashtile_path": flashtile_path,
        **extra,
    }


def json_safe(value):
    """Replace NaN/inf (not valid JSON) with None, recursively; dataclasses become dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def write_json(path: Path, meta: dict, records: list, complete: bool) -> None:
    """Write {"meta": ..., "records": [...]} atomically; meta.complete says if the run finished.

    Called after each point too, so a crash (a CUDA fault) still leaves the points measured so far.
    """
    payload = json_safe({"meta": {**meta, "complete": complete}, "records": list(records)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def check_heads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--heads / --hidden / --heads-k fit every head dim of --headdims (an error naming the flag if not)."""
    for headdim in args.headdims:
        heads = args.heads or args.hidden // headdim
        if args.heads is None and args.hidden % headdim:
            parser.error(f"--hidden {args.hidden} is not a multiple of head dim {headdim} (or pass --heads)")
        if args.heads_k is not None and (args.heads_k < 1 or heads % args.heads_k):
            parser.error(f"--heads-k {args.heads_k} does not divide {heads} query heads (head dim {headdim})")


def mode_records(base: dict, modes, attn, errors, failure: str | None, tolerance: float, timing: bool,
                 bench: Callable[[str], Callable[[], object]], flops_of: Callable[[str], float],
                 warmup_ms: float, rep_ms: float) -> list[dict]:
    """One record per mode of a checked system: ``base`` plus its errors (None when not checked),
    and when ``timing`` its median time of ``bench(mode)`` and TFLOP/s of ``flops_of(mode)``.
    ``attn`` None: the system could not run, ``failure`` says why."""
    records = []
    for mode in modes:
        record = dict(base, mode=mode, ms=None, tflops=None, rel_errs=errors,
                      rel_err=max(errors.values()) if errors else None, ok=None, skipped=None)
        if errors:
            record["ok"] = record["rel_err"] < tolerance
        if attn is None:
            record["skipped"] = failure
        elif timing:
            try:
                record["ms"] = do_bench_ms(bench(mode), warmup_ms, rep_ms)
                record["tflops"] = flops_of(mode) / (record["ms"] * 1e-3) / 1e12
            except Exception as exc:
                record["skipped"] = "timing failed: " + failure_reason(exc)
        records.append(record)
    return records


def timed_call(attn, inputs, mode: str, extra_leaves: tuple = ()) -> Callable[[], object]:
    """What do_bench times for ``attn`` on inputs with q, k, v, dout attributes: the forward alone
    ("fwd"), or the forward and the gradients of q, k, v and of ``extra_leaves`` (tensors ``attn``
    reads itself, such as a bias: some systems compute a gradient only when it is asked for)."""
    import torch

    leaves = [t.detach().requires_grad_(mode == "fwd_bwd") for t in (inputs.q, inputs.k, inputs.v)]
    if mode == "fwd":
        return lambda: attn(*leaves)
    return lambda: torch.autograd.grad(attn(*leaves), [*leaves, *extra_leaves], inputs.dout)
