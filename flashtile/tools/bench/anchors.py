"""Optional anchors: libraries a run compares against only where they import.

FlashAttention-4 (the ``flash-attn-4`` wheel, CuTe DSL) is not a dependency: on the GPU machine
``../shared/tools/fa4/stage.sh`` unzips it and puts it on PYTHONPATH, after which
``from flash_attn.cute import flash_attn_func, flash_attn_varlen_func`` works. Everywhere else the
anchor is reported as "not available: <reason>" and the run goes on without it.
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple


class Availability(NamedTuple):
    """Whether an optional anchor can run here, and what the report should say about it."""

    module: object | None
    status: str  # "available (...)" or "not available: <reason>"

    @property
    def available(self) -> bool:
        return self.module is not None


@functools.cache
def fa4() -> Availability:
    """flash_attn.cute, FlashAttention-4's Python entry points (never raises)."""
    try:
        module = importlib.import_module("flash_attn.cute")
        for name in ("flash_attn_func", "flash_attn_varlen_func"):
            if not callable(getattr(module, name, None)):
                return Availability(None, f"not available: flash_attn.cute has no {name}")
    except BaseException as exc:  # noqa: BLE001 - CuTe DSL can fail in many ways (even SystemExit)
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = str(exc).strip().splitlines()
        return Availability(None, f"not available: {type(exc).__name__}: {text[0] if text else ''}"[:300])
    return Availability(module, f"available (flash-attn-4 {_fa4_version(module)})")


def _fa4_version(module) -> str:
    from importlib import metadata

    for dist in ("flash-attn-4", "flash_attn_4", "flash-attn-cute"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return str(getattr(module, "__version__", "unknown version"))


def fa4_output(result):
    """FA4's functions return (out, lse); some builds return out alone."""
    return result[0] if isinstance(result, (tuple, list)) else result


@functools.cache
def torch_varlen() -> Availability:
    """torch.nn.attention.varlen.varlen_attn (PyTorch's FlashAttention-2 on packed tokens, torch >= 2.9)."""
    try:
        module = importlib.import_module("torch.nn.attention.varlen")
        if not callable(getattr(module, "varlen_attn", None)):
            return Availability(None, "not available: torch.nn.attention.varlen has no varlen_attn")
    except Exception as exc:  # noqa: BLE001
        return Availability(None, f"not available: {type(exc).__name__}: {exc}"[:300])
    return Availability(module, "available (torch.nn.attention.varlen.varlen_attn)")
