"""Facts about where the kernels run: the CUDA device or Triton's CPU interpreter."""

import functools
import os
from typing import Callable

import torch


def interpreter_enabled() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1).

    The variable is read by Triton at import time, so it must be set before
    ``import triton``; we read the same variable so both agree.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def environment_reader(names: tuple):
    """A function that returns the values of the environment variables ``names`` (None where unset),
    cheap enough to run on every call. ``os.environ.get`` costs about 1.5 us per name on a slow host
    CPU (it encodes the key and decodes the value each time); on POSIX the reader looks the
    encoded names up in the dict behind ``os.environ`` instead, which sees every change made
    through ``os.environ`` (as ``os.environ.get`` does, and nothing else)."""
    raw = getattr(os.environ, "_data", None)
    if os.name == "posix" and type(raw) is dict:
        keys = tuple(os.fsencode(name) for name in names)
        return lambda: tuple(map(raw.get, keys))
    get = os.environ.get
    return lambda: tuple(map(get, names))


def check_device_supported(device: torch.device, arg_name: str = "q", dtype=None) -> None:
    """Raise unless the kernels can run on ``device`` (with inputs of ``dtype``, where given)."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreter_enabled():
        problem = interpreter_problem()
        if problem is not None:
            raise RuntimeError(problem)
        if dtype == torch.bfloat16:
            # Triton's interpreter (3.6 to 3.9) multiplies bfloat16 tiles as raw bits: the results
            # would be garbage, not an error.
            raise ValueError(f"{arg_name} is bfloat16 on the CPU: Triton's interpreter (TRITON_INTERPRET=1) "
                             "computes bfloat16 products wrongly; use float16 or float32 there, or a CUDA device")
        return
    if device.type == "cpu":
        raise ValueError(
            f"{arg_name} is on the CPU: flashtile's kernels need a CUDA device, or Triton's "
            "interpreter (set TRITON_INTERPRET=1 before importing triton) to run on the CPU"
        )
    raise ValueError(f"{arg_name} is on device {device}: flashtile supports CUDA tensors (or CPU via TRITON_INTERPRET=1)")


@functools.lru_cache(maxsize=None)
def interpreter_problem():
    """Why Triton's interpreter would compute wrong results here, or None. Triton 3.6's interpreter
    breaks on loop bounds with numpy >= 2.3 (fixed in 3.7); GPU runs are not affected."""
    import numpy
    import triton

    from .triton_compat import VERSION, parse_version

    if VERSION[:2] <= (3, 6) and parse_version(numpy.__version__)[:2] >= (2, 3):
        return (f"Triton {triton.__version__}'s CPU interpreter (TRITON_INTERPRET=1) does not work with numpy "
                f"{numpy.__version__}: install numpy<2.3, or Triton >= 3.7")
    return None


def portable_only() -> bool:
    """FLASHTILE_PORTABLE=1 keeps every call on the portable Triton kernels (no Hopper
    Gluon kernels): for comparisons, and to run the test suite on both paths."""
    return os.environ.get("FLASHTILE_PORTABLE", "0") not in ("", "0")


def validate_enabled() -> bool:
    """FLASHTILE_VALIDATE=1 also checks what only the device's memory holds (cu_seqlens
    contents, max_seqlen): one host synchronisation per call, for debugging."""
    return os.environ.get("FLASHTILE_VALIDATE", "0") not in ("", "0")


def poison_outputs_enabled() -> bool:
    """FLASHTILE_POISON_OUTPUTS=1 fills output buffers with NaN before the kernels run,
    so that any element a kernel fails to write shows up in a test (the tests set it)."""
    return os.environ.get("FLASHTILE_POISON_OUTPUTS", "0") not in ("", "0")


def empty(shape, dtype, device) -> torch.Tensor:
    """torch.empty, or a NaN-filled buffer when poisoning is on."""
    if poison_outputs_enabled():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _plain_empty(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def empty_allocator() -> Callable:
    """:func:`empty` under the poisoning setting of now, for an object that allocates on every call
    and lives no longer than the setting (a plan whose key holds it): no setting read per call."""
    return empty if poison_outputs_enabled() else _plain_empty


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like (keeps t's strides), or NaN-filled when poisoning is on."""
    out = torch.empty_like(t)
    if poison_outputs_enabled():
        out.fill_(float("nan"))
    return out


@functools.lru_cache(maxsize=None)
def device_capability(device_index: int) -> tuple:
    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def capability_of(device: torch.device) -> tuple:
    """(major, minor) of a CUDA device (an index-less one: the current device)."""
    return device_capability(device.index if device.index is not None else torch.cuda.current_device())


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependent launches (sm90 on: a
    kernel may start while the one before it in the stream finishes, and waits for its results)."""
    return device.type == "cuda" and capability_of(device)[0] >= 9


def arch_of(device: torch.device) -> str:
    """A short name for the kernel-config table: 'sm90', 'sm80', ..., or 'interpreter'."""
    if device.type != "cuda":
        return "interpreter"
    major, minor = capability_of(device)
    return f"sm{major}{minor}"
