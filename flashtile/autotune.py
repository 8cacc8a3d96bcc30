"""Opt-in autotuning of the kernel configs, remembered on disk.

The committed tables (flashtile/configs.py) serve every call by default: no search, no
first-call delay. With ``FLASHTILE_AUTOTUNE=1`` the first call of a shape class on a GPU times
every candidate config of each kernel it launches, on that call's own tensors, keeps the
fastest and records it in a JSON file; later calls, and later processes, read the choice from
there. Use it on GPUs or shapes the tables were not tuned for.

A shape class is (GPU name, arch, kernel, head dim, causal, dtype, seqlen_k rounded up to a
power of two, Triton version: another compiler may favour another config). The file is
``$FLASHTILE_CACHE_DIR/autotune.json`` (default ``~/.cache/flashtile``). Configs given with
:func:`flashtile.configs.override` are never replaced. Every candidate computes the same
function (the test suite runs them); one that does not fit the GPU (shared memory, registers) or
does not compile is skipped and noted in the file.

The file is shared by every process on the machine (one per GPU, typically): writes take an
advisory lock on ``autotune.json.lock`` and replace the file atomically. A file or entry that
cannot be read back (corrupt, or written by another flashtile version) is ignored with a
RuntimeWarning: its shape classes are tuned again and the next write replaces it.
"""

import contextlib
import dataclasses
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import triton

from .configs import Config, GluonBwdConfig, GluonFwdConfig, KernelConfig

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (Triton itself only runs on Linux)
    fcntl = None

_CONFIG_TYPES = {cls.__name__: cls for cls in (KernelConfig, GluonFwdConfig, GluonBwdConfig)}
_lock = threading.Lock()  # guards _memory and _warned, and orders this process's own writes
_memory: Optional[dict] = None  # the file's valid entries, read once per process
_warned: set = set()  # problems already reported: each is warned about once


def enabled() -> bool:
    return os.environ.get("FLASHTILE_AUTOTUNE", "0") not in ("", "0")


def cache_path() -> Path:
    root = os.environ.get("FLASHTILE_CACHE_DIR") or Path.home() / ".cache" / "flashtile"
    return Path(root) / "autotune.json"


def shape_key(kernel: str, device: torch.device, arch: str, head_dim: int, causal: bool, seqlen_k: int,
              dtype: torch.dtype) -> str:
    bucket = 1 << max(int(seqlen_k) - 1, 127).bit_length()  # 128, 256, ..., the next power of two
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    # The Triton version goes last, so the fields before it keep their positions.
    return (f"{name}|{arch}|{kernel}|d{head_dim}|{'causal' if causal else 'full'}|{str(dtype)[6:]}|sk{bucket}"
            f"|triton{triton.__version__}")


def _to_json(cfg: Config) -> dict:
    return {"type": type(cfg).__name__, **dataclasses.asdict(cfg)}


def _from_json(entry: dict) -> Config:
    fields = dict(entry["config"])
    return _CONFIG_TYPES[fields.pop("type")](**fields)


def _entry_problem(entry) -> Optional[str]:
    """Why ``entry`` cannot serve as a recorded choice (None: it can)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        return "is not an object with a 'config' object"
    fields = dict(entry["config"])
    cls = _CONFIG_TYPES.get(fields.pop("type", None))
    if cls is None:
        return f"has an unknown config type {entry['config'].get('type')!r}"
    # Exactly the dataclass's fields: an entry from a flashtile whose config had other fields
    # described another search space, even where the defaults would fill the gaps.
    expected = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != expected:
        return f"does not match {cls.__name__}'s fields {sorted(expected)}: {sorted(fields)}"
    if not all(isinstance(value, (bool, int, float, str, type(None))) for value in fields.values()):
        return f"has a {cls.__name__} field that is not a number, string or null"
    try:
        cls(**fields)
    except (TypeError, ValueError) as exc:
        return f"is not a valid {cls.__name__} ({exc})"
    return None


def _warn(message: str) -> None:
    # Called with _lock held. Once per problem: the file is read again at every store.
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning)


def _read(path: Path) -> dict:
    """The valid entries of the file at ``path``; the rest is reported and left out."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except OSError as exc:
        _warn(f"flashtile autotune cache {path} cannot be read ({exc}); ignored, configs are tuned again")
        return {}
    except ValueError as exc:  # not JSON, or not UTF-8
        _warn(f"flashtile autotune cache {path} is not valid JSON ({exc}); ignored, configs are tuned again "
              f"and the file is rewritten at the next store")
        return {}
    if not isinstance(data, dict):
        _warn(f"flashtile autotune cache {path} holds a JSON {type(data).__name__}, not an object; ignored, "
              f"configs are tuned again and the file is rewritten at the next store")
        return {}
    valid = {}
    for key, entry in data.items():
        problem = _entry_problem(entry)
        if problem is None:
            valid[key] = entry
        else:
            _warn(f"flashtile autotune cache {path}: entry {key!r} {problem}; ignored, that shape class is "
                  f"tuned again and the entry replaced")
    return valid


def _load() -> dict:
    global _memory
    if _memory is None:
        _memory = _read(cache_path())
    return _memory


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive access to ``path`` among processes that take this lock too (every flashtile)."""
    if fcntl is None:
        yield
        return
    # A sibling file, never replaced or deleted: the lock must outlive every version of the cache.
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: readers see the old file or the new one, never a part."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # ours alone
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _store(key: str, entry: dict) -> None:
    """Add one entry to the file, keeping what other processes wrote meanwhile (and dropping what
    cannot be read back). Called with _lock held."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            on_disk = _read(path)
            on_disk[key] = entry
            _write_atomically(path, json.dumps(on_disk, indent=1, sort_keys=True) + "\n")
    except OSError as exc:  # read-only or full disk: the choice still serves this process
        _warn(f"flashtile autotune cache {path} cannot be written ({exc}); the choice for {key!r} is kept "
              f"for this process only")
        on_disk = {key: entry}
    _load().update(on_disk)


def lookup(key: str) -> Optional[dict]:
    """The recorded entry for ``key`` (config, ms, timed, skipped), or None."""
    with _lock:
        return _load().get(key)


def remove(keep: Callable[[str], bool]) -> int:
    """Rewrite the cache file with only the entries whose key ``keep`` accepts (under the lock every
    flashtile takes); returns how many were removed. ``python -m flashtile tune --clear`` uses it."""
    path = cache_path()
    if not path.exists():
        return 0
    with _locked(path):
        try:  # every key counts, unreadable entries too (_read drops those)
            keys = list(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            keys = []
        kept = {key: entry for key, entry in _read(path).items() if keep(key)}
        _write_atomically(path, json.dumps(kept, indent=1, sort_keys=True) + "\n")
    forget()
    return max(len(keys) - len(kept), 0)


# Called after each candidate is timed, while set by reporting(): (key, index, count, config, ms or
# None, error or None). The tune command draws its progress bar from it.
_progress: Optional[Callable] = None


@contextlib.contextmanager
def reporting(callback: Callable):
    """Within the block, ``callback(key, index, count, config, ms, error)`` hears of every candidate
    choose() times (ms None and error set where one failed)."""
    global _progress
    saved, _progress = _progress, callback
    try:
        yield
    finally:
        _progress = saved


def forget() -> None:
    """Drop what this process read from the file (the next lookup reads it again)."""
    global _memory
    with _lock:
        _memory = None
        _warned.clear()


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
    unique = list(dict.fromkeys(candidates))
    report = _progress or (lambda *args: None)
    table, *alternatives = unique
    timings.append((timer(lambda: run(table)), table))  # the table's config must work
    report(key, 0, len(unique), table, timings[-1][0], None)
    for index, cfg in enumerate(alternatives, 1):
        try:
            timings.append((timer(lambda cfg=cfg: run(cfg)), cfg))
            report(key, index, len(unique), cfg, timings[-1][0], None)
        except Exception as exc:  # does not fit this GPU, or this compiler cannot build it
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
            skipped.append({"config": _to_json(cfg), "error": error})
            report(key, index, len(unique), cfg, None, error)
    ms, best = min(timings, key=lambda t: t[0])
    with _lock:
        _store(key, {"config": _to_json(best), "ms": ms, "skipped": skipped,
                     "timed": [{"config": _to_json(c), "ms": t} for t, c in timings]})
    return best
