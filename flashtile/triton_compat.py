"""Everything flashtile takes from Triton that moves between releases, in one place.

flashtile supports Triton 3.6 through 3.9 (SUPPORTED). Triton's public language is stable across
them; what moves is Gluon (the low-level dialect of the Hopper kernels) and the internals that
launch plans and the compile checks reach into. Kernel and host modules import those names from
here, never from Triton directly, so that a new Triton release is a change in this file.

Device-side names (used inside @gluon.jit kernels; each is a Gluon builtin, so calling it through
this module emits exactly the IR the direct call would):

- ``barrier()``: a CTA-wide barrier (``gl.thread_barrier`` up to 3.6, ``gl.barrier`` from 3.7);
- ``tma_load`` / ``tma_store``: TMA copies global -> shared / shared -> global
  (``async_copy_global_to_shared`` / ``async_copy_shared_to_global`` up to 3.7, ``async_load`` /
  ``async_store`` from 3.8; 3.9 removed the old names);
- ``tma_reduce_add``: shared += into global by TMA (``tma.async_atomic_add`` from 3.8; built here
  from the same IR operation before);
- ``reinterpret(buf, dtype, shape, layout)``: a shared-memory view of another type and shape
  (``buf._reinterpret`` up to 3.8, ``buf.reinterpret`` from 3.9).

Host-side: the Triton version, whether Gluon imports (``gluon_import_error``), what a jit function
is (``is_jit_function``: the user's score and mask mods), host tensor
descriptors, the compiled-kernel launch that plans replay, and compiling a kernel for a target
without a GPU (the compile checks).
"""

import contextlib
import functools
import io
import re
from typing import Optional

import triton
from triton import knobs
from triton.runtime.driver import driver

SUPPORTED = ((3, 6), (3, 9))  # oldest and newest (major, minor) tested; pyproject says the same


def parse_version(text: str) -> tuple:
    numbers = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(n) for n in numbers) + (0,) * (3 - len(numbers))


VERSION = parse_version(triton.__version__)


# Options every kernel launch passes. FP fusion (multiply-adds contracted into FMAs) stays on, as the
# kernels were tuned and checked with it: Triton 3.9 warns that its default turns off in 3.10.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def version_supported(version: tuple = VERSION) -> bool:
    return SUPPORTED[0] <= tuple(version[:2]) <= SUPPORTED[1]


# ------------------------------------------------------------------------------------------------
# Gluon names, resolved once per process. Gluon imports without a GPU (the compile checks run on
# CPU); if a future Triton drops a name, the kernels' modules fail to import and
# kernels/hopper/status.py's gluon_status() says why, and dispatch keeps to the portable kernels.
# ------------------------------------------------------------------------------------------------

try:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton.experimental.gluon.language.nvidia.hopper import tma as _tma
    _GLUON_IMPORT_ERROR: Optional[str] = None
except Exception as exc:  # pragma: no cover - depends on the Triton build
    _gl = _tma = _builtin = _ir = None
    _GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if _gl is not None:
    barrier = getattr(_gl, "barrier", None) or _gl.thread_barrier
    # 3.9 keeps the old TMA names only to raise; prefer the new ones wherever they exist.
    tma_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared
    tma_store = getattr(_tma, "async_store", None) or _tma.async_copy_shared_to_global

    if hasattr(_tma, "async_atomic_add"):
        tma_reduce_add = _tma.async_atomic_add
    else:
        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """global[box at coord] += shared src, by TMA (cp.reduce.async.bulk.tensor); part of the
            bulk async group, so tma.store_wait covers it."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

    _SMEM = _gl.shared_memory_descriptor
    _REINTERPRET = "reinterpret" if "reinterpret" in vars(_SMEM) else "_reinterpret"

    @_builtin
    def reinterpret(buf, dtype, shape, layout, _semantic=None):
        """``buf`` viewed as another dtype, shape and layout (no data moves)."""
        return getattr(buf, _REINTERPRET)(dtype, shape, layout, _semantic=_semantic)


def gluon_import_error() -> Optional[str]:
    """Why Gluon itself does not import on this Triton, or None (kernels/hopper/status.py asks)."""
    return _GLUON_IMPORT_ERROR


# ------------------------------------------------------------------------------------------------
# Host side.
# ------------------------------------------------------------------------------------------------

# The host descriptor classes, imported once (a launch builds several descriptors per call).
@functools.lru_cache(maxsize=None)
def _gluon_descriptor_class():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor


@functools.lru_cache(maxsize=None)
def _descriptor_class():
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor


def gluon_tensor_descriptor(base, shape: list, strides: list, block: list, layout):
    """A Gluon host TMA descriptor. The constructor re-validates what hopper.tma_aligned() already
    checked and costs microseconds per descriptor, so the fields are set directly; fields added by
    later Triton releases keep their class defaults."""
    desc = object.__new__(_gluon_descriptor_class())
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout = base, shape, strides, block, layout
    desc.padding = "zero"
    return desc


def tensor_descriptor(base, shape: list, strides: list, block: list):
    """A host tensor descriptor of triton.tools (what portable Triton kernels take), fields set
    directly as in gluon_tensor_descriptor."""
    desc = object.__new__(_descriptor_class())
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = base, shape, strides, block, "zero"
    return desc


def is_jit_function(fn) -> bool:
    """Whether ``fn`` is a ``@triton.jit`` function (compiled, or the interpreter's stand-in under
    TRITON_INTERPRET=1), the kind of function a kernel can call."""
    from triton.runtime.jit import JITFunction

    return isinstance(fn, JITFunction) or type(fn).__name__ == "InterpretedFunction"


def current_stream() -> int:
    """The current CUDA stream of the current device, as Triton's JIT launches on it."""
    return driver.active.get_current_stream(driver.active.get_current_device())


def launch_compiled(kernel, grid: tuple, args: list) -> None:
    """Launch an already compiled kernel (what ``jit_fn[grid](...)`` returned) with its arguments in
    signature order, skipping the JIT binder: the launch plans' replay. Launch hooks (profilers) get
    the metadata the JIT path would give them."""
    stream = current_stream()
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    metadata = kernel.launch_metadata(grid, stream, *args) if enter.calls or leave.calls else None
    kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *args)


def compile_for_target(kernel, args: tuple, kwargs: dict, target, ptxas_log: bool = False):
    """Compile a @triton.jit or @gluon.jit ``kernel`` as a launch with these arguments would, for
    ``target`` (a triton.backends.compiler.GPUTarget), without a GPU: the compile checks and
    ``flashtile`` tools use it to read registers, spills, PTX and SASS on any machine.

    ``ptxas_log``: compile afresh (not from Triton's cache) and also return ptxas' ``-v`` report of
    this very build, made with the flags this Triton passes (3.7 on add ``--regAllocOptLevel=2``):
    ``(compiled, log)``."""
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source_type = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    source = source_type(kernel, signature, constexprs, attrs)
    if not ptxas_log:
        return triton.compile(source, target=target, options=options.__dict__)
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas' report to stdout
        knobs.compilation.always_compile = True
        compiled = triton.compile(source, target=target, options=options.__dict__)
    return compiled, log.getvalue()


def ptxas_path(arch: int = 90) -> str:
    """The ptxas this Triton assembles sm<arch> code with: one of its bundled two (3.9 takes its CUDA
    13 one from sm90 up, earlier releases from sm100 up) unless TRITON_PTXAS_PATH /
    TRITON_PTXAS_BLACKWELL_PATH name another."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path
