"""Launching an already-compiled kernel without the JIT's per-call dispatch.

``kernel[grid](...)`` binds and specialises every argument in Python, looks the compiled kernel
up and builds launch metadata on each call: 15-40 us of host time per launch, measured on the
H200 (bench/host_overhead.py). A short attention call runs for less than that on the GPU, so
the host became the bottleneck. :class:`DirectLaunch` keeps, per specialisation key, the kernel
the JIT compiled on the first call and then calls its launcher straight away.

The key follows the JIT's own specialisation rules, erring on the side of more keys: tensors by
dtype and 16-byte alignment, integers by int32 range, == 1 and % 16 == 0 (unless the kernel
lists them in ``do_not_specialize``), TMA descriptors by dtype, block shape and layout,
constexprs, None and bools by value, floats as fp32, plus the device and the launch options.
Anything else, or an installed launch hook (profilers), takes the JIT path.
"""

import torch
from triton import knobs
from triton.runtime.driver import driver

from ..runtime import interpreter_enabled

_NO_FAST_PATH = object()


def _launch_hooks_installed() -> bool:
    """Whether a profiler hooked kernel launches (the JIT path calls the hooks)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    # triton 3.6 keeps hook chains (empty when nothing is installed); older ones None or a callable.
    return any(getattr(hook, "calls", hook) for hook in hooks)


class DirectLaunch:
    """``DirectLaunch(fn)[grid](*args, **kwargs)`` does what ``fn[grid](*args, **kwargs)`` does.
    Fastest with the kernel's parameters passed positionally and only launch options
    (num_warps, ...) as keywords."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names = tuple(fn.arg_names)
        self.param_names = frozenset(self.arg_names)
        constexprs = sorted(fn.constexprs)
        # Runtime parameters first, constexprs last (true of flashtile's kernels; otherwise
        # every parameter is keyed as a runtime one).
        trailing = constexprs == list(range(len(self.arg_names) - len(constexprs), len(self.arg_names)))
        self.num_runtime = len(self.arg_names) - len(constexprs) if trailing else len(self.arg_names)
        self.constexpr_positions = frozenset(constexprs)
        self.specialized = tuple(not p.do_not_specialize for p in fn.params[:self.num_runtime])
        self.compiled = {}

    def _key(self, device, values, options):
        kinds = []
        for i, (a, specialize) in enumerate(zip(values, self.specialized)):
            if isinstance(a, torch.Tensor):
                kinds.append((a.dtype, a.data_ptr() & 15 == 0))
            elif a is None or isinstance(a, bool) or i in self.constexpr_positions:
                kinds.append(a)
            elif isinstance(a, int):
                small = -2**31 <= a < 2**31
                kinds.append((small, a == 1, a & 15 == 0) if specialize else small)
            elif isinstance(a, float):
                kinds.append(float)
            elif hasattr(a, "block_shape"):  # a host TMA descriptor
                kinds.append((a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding))
            else:
                return _NO_FAST_PATH
        return device, tuple(options.items()), values[self.num_runtime:], tuple(kinds)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        values, options = args, kwargs
        if len(args) != len(self.arg_names):
            options = {name: value for name, value in kwargs.items() if name not in self.param_names}
            try:
                values = args + tuple(kwargs[name] for name in self.arg_names[len(args):])
            except KeyError:  # a parameter left to its default
                return self.fn[grid](*args, **kwargs)
        if _launch_hooks_installed():
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = self._key(device, values, options)
        kernel = self.compiled.get(key) if key is not _NO_FAST_PATH else None
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            if key is not _NO_FAST_PATH:
                self.compiled[key] = kernel
            return kernel
        grid = tuple(grid) + (1, 1)
        kernel.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *values)
        return kernel


def direct_launch(fn):
    """``DirectLaunch(fn)`` for compiled kernels; ``fn`` itself under Triton's CPU interpreter,
    which compiles nothing."""
    return fn if interpreter_enabled() else DirectLaunch(fn)
