"""Ahead-of-time compilation of an entry's kernels for sm90, valid for every call of the entry.

The JIT specialises each launch on its argument values (an int equal to 1 becomes a constant, one
divisible by 16 gets a divisibility hint, a pointer a 16-byte alignment hint). A compiled-in-advance
kernel must serve every call, so integer arguments lose those assumptions here, except the strides
of caller tensors, which the C library checks to be multiples of 16 (the layouts the Hopper kernels
take always are), and pointers, which it checks to be 16-byte aligned (offset pointers excepted).

Each kernel then comes with its parameter list as the CUDA driver sees it (Triton's launcher
convention: host tensor descriptors expand into the CUtensorMap, then their shape as int32 and
strides as int64; then every other non-constexpr argument; then two scratch pointers), checked
against the .entry declaration of the kernel's PTX.
"""

import re
from dataclasses import dataclass
from typing import List, Tuple

from . import bindings

# The element types of cuTensorMapEncodeTiled (host enum), from the compiled kernels' device codes.
TMA_DEVICE_TO_HOST = {i: i for i in range(16)}
TMA_DEVICE_TO_HOST.update({8: 10, 9: 8, 10: 9})


@dataclass
class Param:
    """One kernel parameter as the driver sees it: kind "tma" (a CUtensorMap; ``meta`` its box,
    swizzle and element type), "i32", "i64", "f32" or "ptr"; ``source`` the binding (an expression,
    a bindings.Pointer / Descriptor, or None for the scratch pointers)."""

    kind: str
    source: object
    meta: dict = None


@dataclass
class Kernel:
    """A compiled kernel: its cubin and what launching it takes."""

    key: str          # Triton's hash of the compile: entries share kernels by it
    name: str
    cubin: bytes
    shared: int
    threads: int
    params: List[Param]


def _stride_hint(binding: bindings.Binding, name: str, expr: str) -> bool:
    inner = re.fullmatch(r"SEL\(\w+ > 1, (\w+), 0\)", expr)
    return (inner.group(1) if inner else expr) in bindings.CHECKED_STRIDE_FIELDS


def compile_kernel(launch, binding: bindings.Binding, hinted: bool = True, arch: int = 90) -> Kernel:
    """Compile ``launch`` (a captured tools.catalog.Launch) for sm<arch> with the assumptions the
    C library guarantees, and lay out its parameters from ``binding``. ``hinted``: stride arguments
    of caller tensors keep the divisibility hint (the library checks them; entries.Entry.hinted).
    An argument the binding fixes to a literal keeps the JIT's specialisation on that value."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = launch.compile_kwargs()
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    for index, p in enumerate(fn.params):
        if p.is_constexpr or p.name not in binding.params:
            continue
        source = binding.params[p.name]
        if isinstance(source, str) and re.fullmatch(r"-?\d+", source):
            continue  # the same value in every call: the JIT's specialisation holds
        if isinstance(source, str):  # an integer argument: i32, hinted only for checked strides
            signature[p.name] = "i32"
            constexprs.pop((index,), None)
            attrs[(index,)] = [["tt.divisibility", 16]] if hinted and _stride_hint(binding, p.name, source) else []
        elif isinstance(source, bindings.Pointer):
            attrs[(index,)] = [["tt.divisibility", 16]] if source.aligned else []
    source_type = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    compiled = triton.compile(source_type(fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    md = compiled.metadata
    if md.global_scratch_size or md.profile_scratch_size or getattr(md, "num_ctas", 1) != 1:
        raise NotImplementedError(f"{md.name}: global scratch or clusters, which the C launcher does not provide")
    params = _parameters(fn, signature, binding, getattr(md, "tensordesc_meta", None) or [])
    _check_ptx(compiled.asm["ptx"], md.name, params)
    return Kernel(md.hash, md.name, compiled.asm["cubin"], md.shared, 32 * md.num_warps, params)


def _parameters(fn, signature: dict, binding: bindings.Binding, tensordesc_meta: list) -> List[Param]:
    params: List[Param] = []
    descriptors = iter(tensordesc_meta)
    for p in fn.params:
        ty = signature[p.name]
        if ty == "constexpr":
            continue
        source = binding.params.get(p.name)
        if source is None:
            raise ValueError(f"{fn.__name__}.{p.name} ({ty}) has no binding")
        if ty.startswith("tensordesc"):
            meta = next(descriptors, None)
            if meta is None:
                raise NotImplementedError(f"{fn.__name__}.{p.name}: a tensor descriptor not lowered to TMA")
            params.append(Param("tma", source, meta))
            params += [Param("i32", e) for e in source.shape] + [Param("i64", e) for e in source.strides]
        elif ty.startswith("*"):
            params.append(Param("ptr", source, {"elem": _ELEMENT_BYTES.get(ty[1:], 1)}))
        elif ty in ("fp32", "f32"):
            params.append(Param("f32", source[1]))
        elif ty in ("i32", "i64"):
            params.append(Param(ty, source))
        else:
            raise NotImplementedError(f"{fn.__name__}.{p.name}: parameter type {ty}")
    return params + [Param("ptr", None), Param("ptr", None)]  # global and profile scratch


_ELEMENT_BYTES = {"i64": 8, "fp64": 8, "i32": 4, "fp32": 4, "bf16": 2, "fp16": 2, "i16": 2}
_PTX_SIZES = {"tma": ".b8", "i32": ".u32", "i64": ".u64", "f32": ".f32", "ptr": ".u64"}


def _check_ptx(ptx: str, name: str, params: List[Param]) -> None:
    """The parameter list must be the one the kernel's .entry declares (count and types)."""
    entry = re.search(r"\.entry\s+" + re.escape(name) + r"\((.*?)\)", ptx, re.S)
    declared = re.findall(r"\.param\s+(?:\.align\s+\d+\s+)?(\.\w+)", entry.group(1)) if entry else []
    expected = [_PTX_SIZES[p.kind] for p in params]
    if declared != expected:
        raise RuntimeError(f"{name}: the kernel declares parameters {declared}, the C launcher would pass "
                           f"{expected}: this Triton lays out kernel parameters differently")


def element_type(meta: dict) -> Tuple[int, int]:
    """(cuTensorMapEncodeTiled data type, element bytes) of a tensordesc's metadata."""
    return TMA_DEVICE_TO_HOST[meta["elem_type"]], meta["elem_size"]
