"""Opt-in autotuning of the kernel configs, remembered on disk.

The committed tables (flashtile/configs.py) serve every call by default: no search, no
first-call delay. With ``FLASHTILE_AUTOTUNE=1`` the first call of a shape class on a GPU times
every candidate config of each kernel it launches, on that call's own tensors, keeps the
fastest and records it in a JSON file; later calls, and later processes, read the choice from
there. Use it on GPUs or shapes the tables were not tuned for.

A shape class is (GPU name, arch, kernel, head dim, causal, dtype, seqlen_k rounded up to a
power of two). The file is ``$FLASHTILE_CACHE_DIR/autotune.json`` (default
``~/.cache/flashtile``). Configs given with :func:`flashtile.configs.override` are never
replaced. Every candidate computes the same function (the test suite runs them); one that does
not fit the GPU (shared memory, registers) or does not compile is skipped and noted in the file.
"""

import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .configs import Config, GluonBwdConfig, GluonFwdConfig, KernelConfig

_CONFIG_TYPES = {cls.__name__: cls for cls in (KernelConfig, GluonFwdConfig, GluonBwdConfig)}
_lock = threading.Lock()
_memory: Optional[dict] = None  # the file's contents, read once per process


def enabled() -> bool:
    return os.environ.get("FLASHTILE_AUTOTUNE", "0") not in ("", "0")


def cache_path() -> Path:
    root = os.environ.get("FLASHTILE_CACHE_DIR") or Path.home() / ".cache" / "flashtile"
    return Path(root) / "autotune.json"


def shape_key(kernel: str, device: torch.device, arch: str, head_dim: int, causal: bool, seqlen_k: int,
              dtype: torch.dtype) -> str:
    bucket = 1 << max(int(seqlen_k) - 1, 127).bit_length()  # 128, 256, ..., the next power of two
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|{arch}|{kernel}|d{head_dim}|{'causal' if causal else 'full'}|{str(dtype)[6:]}|sk{bucket}"


def _to_json(cfg: Config) -> dict:
    return {"type": type(cfg).__name__, **dataclasses.asdict(cfg)}


def _from_json(entry: dict) -> Config:
    fields = dict(entry["config"])
    return _CONFIG_TYPES[fields.pop("type")](**fields)


def _load() -> dict:
    global _memory
    if _memory is None:
        try:
            _memory = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _memory = {}
    return _memory


def _store(key: str, entry: dict) -> None:
    """Add one entry to the file, keeping what other processes wrote meanwhile."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        on_disk = json.loads(path.read_text())
    except (OSError, ValueError):
        on_disk = {}
    on_disk[key] = entry
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(on_disk, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    _load().update(on_disk)


def forget() -> None:
    """Drop what this process read from the file (the next lookup reads it again)."""
    global _memory
    _memory = None


def choose(key: str, candidates: Sequence[Config], run: Callable[[Config], object],
           timer: Optional[Callable[[Callable[[], object]], float]] = None) -> Config:
    """The recorded choice for ``key``, or the fastest of ``candidates`` (the first is the
    table's): each is launched through ``run(config)`` and timed, and the winner recorded."""
    with _lock:
        entry = _load().get(key)
    if entry is not None:
        return _from_json(entry)
    if timer is None:
        import triton.testing

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
    timings, skipped = [], []
    table, *alternatives = list(dict.fromkeys(candidates))
    timings.append((timer(lambda: run(table)), table))  # the table's config must work
    for cfg in alternatives:
        try:
            timings.append((timer(lambda cfg=cfg: run(cfg)), cfg))
        except Exception as exc:  # does not fit this GPU, or this compiler cannot build it
            skipped.append({"config": _to_json(cfg), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    ms, best = min(timings, key=lambda t: t[0])
    with _lock:
        _store(key, {"config": _to_json(best), "ms": ms, "skipped": skipped,
                     "timed": [{"config": _to_json(c), "ms": t} for t, c in timings]})
    return best
