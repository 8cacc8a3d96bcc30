"""Launch plans: a call's host work done once per call signature.

At seqlen ~1k an attention kernel runs for 100-300 us, and the host work in front of it (picking
the path and config, building grids and descriptors, Triton binding and specialising every
argument) used to take 90 us for the Hopper forward and 270 us for the backward's three launches
on the H200 hosts: on a slower host draw the GPU waited for it. Everything in that work but the
tensors' addresses is fixed by the call's *signature*: shapes, strides, dtypes, device, options
and which pointers are 16-byte aligned (what Triton specialises on). So the first call of a
signature goes the long way and leaves a plan; later calls replay it: new TMA descriptors for the
new addresses, then each kernel's compiled launcher, called directly.

Plans are used for CUDA tensors only, and never while anything could change what the long way
decides: config overrides (configs.override), autotuning (FLASHTILE_AUTOTUNE=1), or
FLASHTILE_LAUNCH_PLANS=0 (to compare against, or to rule plans out when debugging).
"""

import functools
import inspect
import os
from typing import Callable, Optional, Sequence

import torch

from .. import autotune
from ..configs import any_overridden


def enabled() -> bool:
    """Whether calls may replay plans (see the module docstring)."""
    return (os.environ.get("FLASHTILE_LAUNCH_PLANS", "1") not in ("", "0") and not autotune.enabled()
            and not any_overridden())


def tensor_signature(t: Optional[torch.Tensor]) -> tuple:
    """What a compiled kernel and its launch geometry may depend on, of one tensor argument."""
    if t is None:
        return ()
    return (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)


class PlanCache:
    """Plans by signature. Bounded: a process that sees many shapes (varying batch sizes,
    sequence lengths) drops its oldest plans instead of growing without end."""

    def __init__(self, capacity: int = 512):
        self.capacity = capacity
        self.plans: dict = {}

    def get(self, key) -> Optional[Callable]:
        return self.plans.get(key)

    def put(self, key, plan: Callable) -> None:
        if len(self.plans) >= self.capacity:
            del self.plans[next(iter(self.plans))]
        self.plans[key] = plan

    def clear(self) -> None:
        self.plans.clear()


def _current_stream() -> int:
    """The current CUDA stream of the current device, as Triton's JIT launches on it."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(driver.active.get_current_device())


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> tuple:
    """The parameters of a @triton.jit / @gluon.jit function (compiled or interpreted), in order."""
    return tuple(inspect.signature(fn.fn).parameters.values())


class CompiledCall:
    """One Triton (or Gluon) kernel launch whose arguments change from call to call only in the
    named ``slots`` (tensors, TMA descriptors), under the same signature.

    The first call goes through the JIT function (binding, specialisation, compiling if needed)
    and keeps the compiled kernel it returns; later calls hand the arguments straight to that
    kernel's launcher, in signature order, skipping the binder. The caller's plan key guarantees
    that the new slot values specialise as the first ones did (same dtypes, same 16-byte
    alignment, descriptors with the same blocks and layouts)."""

    def __init__(self, fn, grid: Sequence[int], args: Sequence, kwargs: dict, slots: Sequence[str]):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        params = _parameters(fn)
        self.names = names = [p.name for p in params]
        values = dict(zip(names, args))
        values.update((name, kwargs[name]) for name in names if name in kwargs)
        missing = [p.name for p in params if p.name not in values and p.default is p.empty]
        assert not missing, f"{fn}: no value for {missing}"
        self.template = [values[p.name] if p.name in values else p.default for p in params]
        self.options = {name: value for name, value in kwargs.items() if name not in values}
        self.slot_index = [names.index(name) for name in slots]
        for index in self.slot_index:
            # Every call passes its own slot values: a cached plan must not keep the first call's
            # tensors (activations, gradients, the float32 dQ accumulator) alive.
            self.template[index] = None
        self.kernel = None

    def __call__(self, *slot_values):
        assert len(slot_values) == len(self.slot_index), (len(slot_values), len(self.slot_index))
        args = list(self.template)
        for index, value in zip(self.slot_index, slot_values):
            args[index] = value
        kernel = self.kernel
        if kernel is None:
            self.kernel = self.fn[self.grid](**dict(zip(self.names, args)), **self.options)
            return self.kernel
        from triton import knobs

        stream = _current_stream()
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        # Launch hooks (e.g. Triton's profiler) get the metadata the JIT path would give them.
        metadata = kernel.launch_metadata(self.grid, stream, *args) if enter.calls or leave.calls else None
        kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *args)
        return kernel
