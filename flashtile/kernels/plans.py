"""Launch plans: a call's host work done once per call signature.

At short sequences an attention kernel runs for a few hundred microseconds, and the host work in
front of it (picking the path and config, building grids and descriptors, Triton binding and
specialising every argument) took about as long: the GPU waited for the host. Everything in that work but the
tensors' addresses is fixed by the call's *signature*: shapes, strides, dtypes, device, options
and which pointers are 16-byte aligned (what Triton specialises on), and for packed batches and kv
caches the host maxima (max_seqlen_q / max_seqlen_k), never the lengths the device tensors hold.
So the first call of a signature goes the long way and leaves a plan; later calls replay it: new
TMA descriptors for the new addresses, then each kernel's compiled launcher, called directly.

A plan's call reads only the data pointers of the tensors it is given (the buffers it allocates
come from shapes it keeps), so a tensor may stand in for a view that starts where it does: the call
plans of flashtile/call_plans.py pass q for the rows-of-heads view of q, and (total, h, d) tensors
for their (1, total, h, d) views.

Plans are used for CUDA tensors only, and never while anything could change what the long way
decides: config overrides (configs.override), autotuning (FLASHTILE_AUTOTUNE=1), or
FLASHTILE_LAUNCH_PLANS=0 (to compare against, or to rule plans out when debugging).
"""

import functools
import inspect
import os
import threading
from typing import Callable, Optional, Sequence

import torch

from .. import autotune
from ..configs import any_overridden
from ..triton_compat import LAUNCH_OPTIONS, launch_compiled


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
    sequence lengths) drops its oldest plans instead of growing without end.

    Shared by every thread that calls into flashtile: a lock guards the dict (evicting while
    another thread looks up or inserts would break both), but is never held while a plan is made."""

    def __init__(self, capacity: int = 512):
        self.capacity = capacity
        self.plans: dict = {}
        self._lock = threading.Lock()

    def get(self, key) -> Optional[Callable]:
        with self._lock:
            return self.plans.get(key)

    def put(self, key, plan: Callable) -> Callable:
        """Keep ``plan`` under ``key``; returns it."""
        with self._lock:
            self._insert(key, plan)
        return plan

    def _insert(self, key, plan: Callable) -> None:
        """Keep ``plan`` under ``key``, evicting the oldest plans to stay within capacity (with
        the lock held)."""
        if key not in self.plans:
            while self.plans and len(self.plans) >= self.capacity:
                del self.plans[next(iter(self.plans))]
        self.plans[key] = plan

    def get_or_make(self, key, make: Callable[[], Callable]) -> Callable:
        """The plan kept under ``key``, or a new one from ``make()``, kept unless ``key`` is None
        (a call no plan may serve: made, used once, dropped)."""
        if key is None:
            return make()
        with self._lock:
            plan = self.plans.get(key)
        if plan is not None:
            return plan
        # Made outside the lock: making compiles kernels (seconds), and may use other caches.
        plan = make()
        with self._lock:
            kept = self.plans.get(key)
            if kept is not None:
                return kept  # another thread made one meanwhile: every caller shares the first
            self._insert(key, plan)
        return plan

    def clear(self) -> None:
        with self._lock:
            self.plans.clear()


_REQUIRED = object()  # a parameter without a default, in _Signature.defaults


class _Signature:
    """The parameters of a Python function (a @triton.jit / @gluon.jit kernel's), in order: names,
    index by name, and defaults (_REQUIRED where there is none)."""

    def __init__(self, python_fn):
        params = tuple(inspect.signature(python_fn).parameters.values())
        self.names = tuple(p.name for p in params)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.defaults = tuple(_REQUIRED if p.default is p.empty else p.default for p in params)


@functools.lru_cache(maxsize=None)
def _python_signature(python_fn) -> _Signature:
    return _Signature(python_fn)


def _signature(fn) -> _Signature:
    """The kernel's (compiled or interpreted) parameters, cached by its Python function: hashing the
    kernel itself would hash its source and every function it calls (and under the interpreter a
    Gluon kernel's @triton.jit helpers cannot be hashed)."""
    return _python_signature(fn.fn)


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
        signature = _signature(fn)
        self.names = signature.names
        template = list(signature.defaults)
        template[:len(args)] = args
        self.options = dict(LAUNCH_OPTIONS)
        for name, value in kwargs.items():
            index = signature.index.get(name)
            if index is None:
                self.options[name] = value  # a launch option (num_warps, ...)
            else:
                template[index] = value
        self.slot_index = [signature.index[name] for name in slots]
        for index in self.slot_index:
            # Every call passes its own slot values (the values given here only hold the place): a
            # cached plan must not keep the first call's tensors (activations, gradients, the float32
            # dQ accumulator) alive.
            template[index] = None
        missing = [name for name, value in zip(self.names, template) if value is _REQUIRED]
        assert not missing, f"{fn}: no value for {missing}"
        self.template = template
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
        launch_compiled(kernel, self.grid, args)
        return kernel
