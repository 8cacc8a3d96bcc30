"""``python -m flashtile tune``: autotune one shape class on this GPU, with progress, into the on-disk cache.

It runs the call with FLASHTILE_AUTOTUNE=1 (flashtile/autotune.py): each kernel the call launches
times its table config and every candidate (``python -m flashtile configs --candidates``) on the
call's own tensors, keeps the fastest and records it in the cache file, which later calls and
processes read when FLASHTILE_AUTOTUNE=1 is set. A progress bar runs per candidate; at the end each
kernel's winner is set against the table's choice. A shape class already in the cache is not
timed again unless --retune is given.

    python -m flashtile tune --shape 2,4096,16,128 --causal
    python -m flashtile tune --shape 8,1024,32,64 --direction bwd --retune
    python -m flashtile tune --show          # the cache file and its entries (any machine)
    python -m flashtile tune --clear         # empty it
"""

import argparse
import json
import os
import sys
from typing import List, Optional

from .common import command_parser, int_list

PROG = "python -m flashtile tune"
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _config_text(entry_config: dict) -> str:
    """A cache entry's config ({"type": ..., fields}) in keyword form."""
    from .. import configs
    from .catalog import config_kwargs

    fields = dict(entry_config)
    cls = getattr(configs, fields.pop("type", ""), None)
    try:
        return config_kwargs(cls(**fields))
    except TypeError:  # another flashtile's fields: show them as they are
        return f"{entry_config.get('type')}({', '.join(f'{k}={v}' for k, v in fields.items())})"


def _entries() -> dict:
    from .. import autotune

    path = autotune.cache_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{path} cannot be read as JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def show() -> List[str]:
    from .. import autotune

    path = autotune.cache_path()
    lines = [f"cache: {path}" + ("" if path.exists() else " (no file yet)")]
    try:
        entries = _entries()
    except RuntimeError as exc:
        return lines + [f"  {exc}"]
    if not entries:
        return lines + ["  no entries"]
    for key, entry in sorted(entries.items()):
        try:
            timed, skipped = entry.get("timed", []), entry.get("skipped", [])
            table = timed[0] if timed else None
            vs = (f", table's {table['ms']:.3f} ms ({table['ms'] / entry['ms']:.2f}x)"
                  if table and entry.get("ms") else "")
            lines.append(f"  {key}")
            lines.append(f"    {_config_text(entry['config'])}: {entry.get('ms', float('nan')):.3f} ms{vs}; "
                         f"{len(timed)} timed, {len(skipped)} skipped")
        except (KeyError, TypeError, AttributeError):
            lines.append(f"  {key}: unreadable entry (ignored by the autotuner)")
    return lines


class Progress:
    """One bar per kernel, one step per candidate: redrawn in place on a terminal, a line per
    candidate otherwise (logs)."""

    def __init__(self, kernel: str, count: int, stream=None):
        self.kernel, self.count, self.stream = kernel, count, stream or sys.stderr
        self.done, self.best = 0, None
        self.tty = self.stream.isatty()

    def step(self, name: str, ms: Optional[float], error: Optional[str] = None) -> None:
        self.done += 1
        if ms is not None and (self.best is None or ms < self.best[0]):
            self.best = (ms, name)
        width = 24
        filled = width * self.done // max(self.count, 1)
        result = f"{ms:.3f} ms" if ms is not None else f"skipped ({error})"
        best = f", best {self.best[1]} {self.best[0]:.3f} ms" if self.best else ""
        text = (f"{self.kernel:10s} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.count} "
                f"{name}: {result}{best}")
        if self.tty:
            end = "\n" if self.done == self.count else ""
            self.stream.write("\r\033[K" + text[:200] + end)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _progress_bars(head_dim: int, timed: set, stream=None):
    """An autotune.reporting callback drawing one Progress bar per kernel; adds each timed key to
    ``timed`` (keys not in it came from the cache)."""
    from .catalog import candidates

    bars = {}

    def report(key, index, count, config, ms, error):
        kernel = key.split("|")[2]
        if key not in bars:
            named = {cfg: name for name, cfg in candidates(kernel, head_dim).items()}
            bars[key] = (Progress(kernel, count, stream), named)
        bar, named = bars[key]
        bar.step("table" if index == 0 else named.get(config, f"#{index}"), ms, error and error.split(":")[0])
        timed.add(key)
    return report


def _kernels(explanation, direction: str, q, k) -> List[str]:
    from ..configs import BWD_DKDV, BWD_DQ, BWD_GLUON, FWD_GLUON
    from ..dispatch import forward_kernel

    kernels = []
    if direction in ("fwd", "both"):
        kernels.append(FWD_GLUON if explanation.forward.path == "hopper" else forward_kernel(q, k, None))
    if direction in ("bwd", "both") and explanation.backward.path != "none":
        kernels += [BWD_GLUON] if explanation.backward.path == "hopper" else [BWD_DKDV, BWD_DQ]
    return kernels


def tune(args) -> int:
    import torch

    from .. import autotune
    from ..explanation import explain
    from ..interface import flash_attn_func
    from ..runtime import arch_of

    batch, seqlen_q, nheads, head_dim = args.shape
    dtype = getattr(torch, DTYPES[args.dtype])
    device = torch.device("cuda")
    nheads_k, seqlen_k = args.heads_k or nheads, args.seqlen_k or seqlen_q
    backward = args.direction in ("bwd", "both")
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device=device, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(batch, seqlen_k, nheads_k, head_dim, device=device, dtype=dtype, requires_grad=backward)
            for _ in range(2))
    explanation = explain(q, k, v, causal=args.causal)
    kernels = _kernels(explanation, args.direction, q, k)
    keys = {kernel: autotune.shape_key(kernel, device, arch_of(device), head_dim, args.causal, seqlen_k, dtype)
            for kernel in kernels}
    print(f"tuning {', '.join(kernels)} for q {tuple(q.shape)}, k/v {tuple(k.shape)}, {args.dtype}"
          f"{', causal' if args.causal else ''} on {torch.cuda.get_device_name(device)}")
    if args.retune:
        removed = autotune.remove(lambda key: key not in keys.values())
        if removed:
            print(f"--retune: dropped {removed} cached entr{'y' if removed == 1 else 'ies'}")
    timed: set = set()
    saved = os.environ.get("FLASHTILE_AUTOTUNE")
    try:
        with autotune.reporting(_progress_bars(head_dim, timed)):
            os.environ["FLASHTILE_AUTOTUNE"] = "1" if args.direction != "bwd" else "0"
            out = flash_attn_func(q, k, v, causal=args.causal)
            if backward:
                os.environ["FLASHTILE_AUTOTUNE"] = "1"
                out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
    finally:
        if saved is None:
            os.environ.pop("FLASHTILE_AUTOTUNE", None)
        else:
            os.environ["FLASHTILE_AUTOTUNE"] = saved
    print()
    tuned = []
    for kernel, key in keys.items():
        entry = autotune.lookup(key)
        if entry is None:
            continue
        tuned.append(kernel)
        timed_list = entry.get("timed", [])
        table = timed_list[0] if timed_list else None
        line = f"{kernel}: winner {_config_text(entry['config'])} {entry['ms']:.3f} ms"
        if table:
            line += (f"; table's {_config_text(table['config'])} {table['ms']:.3f} ms "
                     f"({table['ms'] / entry['ms']:.2f}x)")
        if entry.get("skipped"):
            line += f"; {len(entry['skipped'])} skipped (did not fit or compile)"
        print(line + ("" if key in timed else " [from the cache: --retune times it again]"))
    missed = [kernel for kernel in kernels if kernel not in tuned]
    if missed:
        print(f"not tuned: {', '.join(missed)} (a config given with override(), or the call skipped the kernel)")
    print(f"cache: {autotune.cache_path()} (read by calls with FLASHTILE_AUTOTUNE=1)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(PROG, __doc__)
    call = parser.add_argument_group("the shape class to tune (on this GPU)")
    call.add_argument("--shape", type=int_list(4, "--shape"), metavar="B,S,H,D",
                      help="q's shape (batch, seqlen_q, nheads, head_dim)")
    call.add_argument("--heads-k", type=int, help="KV heads (MQA/GQA); default nheads")
    call.add_argument("--seqlen-k", type=int, help="keys per sequence; default seqlen_q")
    call.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    call.add_argument("--causal", action="store_true")
    call.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both")
    call.add_argument("--retune", action="store_true", help="time again what the cache already holds for it")
    cache = parser.add_argument_group("the cache ($FLASHTILE_CACHE_DIR/autotune.json, default ~/.cache/flashtile)")
    cache.add_argument("--show", action="store_true", help="print the cache file's path and entries")
    cache.add_argument("--clear", action="store_true", help="empty it")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if sum(bool(x) for x in (args.shape, args.show, args.clear)) != 1:
        print(f"{PROG}: give one of --shape B,S,H,D, --show or --clear", file=sys.stderr)
        return 2
    if args.show:
        print("\n".join(show()))
        return 0
    if args.clear:
        from .. import autotune

        removed = autotune.remove(lambda key: False)
        print(f"cleared {autotune.cache_path()} ({removed} entr{'y' if removed == 1 else 'ies'} removed)")
        return 0
    import torch

    from ..runtime import interpreter_enabled

    if not torch.cuda.is_available() or interpreter_enabled():
        why = ("TRITON_INTERPRET=1 is set" if torch.cuda.is_available() else "no CUDA GPU is available here")
        print(f"{PROG}: tuning times kernels on a GPU and {why}. --show and --clear work anywhere; "
              f"`python -m flashtile inspect` compiles a call's kernel for sm90 without one.", file=sys.stderr)
        return 2
    if min(args.shape) < 1 or (args.heads_k or 1) < 1 or (args.seqlen_k or 1) < 1:
        print(f"{PROG}: --shape, --heads-k and --seqlen-k take positive sizes", file=sys.stderr)
        return 2
    return tune(args)


if __name__ == "__main__":
    sys.exit(main())
