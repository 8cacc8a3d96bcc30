"""flashtile as a C library: the Hopper kernels compiled ahead of time and embedded in
libflashtile.so / libflashtile_static.a with a C API (csrc/flashtile.h), for engines without Python.

``export(out, head_dims, dtypes, features)`` (``python -m flashtile export``) writes::

    out/include/flashtile.h
    out/lib/libflashtile.so, out/lib/libflashtile_static.a
    out/lib/cmake/flashtile/flashtileConfig.cmake (+ ConfigVersion): find_package(flashtile)
    out/src/                 the library's C sources (generated kernel table + runtime), to rebuild
    out/share/flashtile/manifest.json   what was exported, with the compile and build times
    out/share/flashtile/examples/       the C examples (examples/c), to build against the export

The pieces: entries.py (what an export holds, from the config tables and the captured plans),
bindings.py (each kernel argument as an expression checked against the Python plans), aot.py
(compiling for sm90 without a GPU), codegen.py (the generated C), csrc/ (the hand-written C).
"""

import functools
import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Optional, Sequence

CSRC = os.path.join(os.path.dirname(__file__), "csrc")


def examples_dir() -> str:
    """The C examples: in the wheel beside this package, in a checkout at examples/c."""
    packaged = os.path.join(os.path.dirname(__file__), "examples")
    if os.path.isdir(packaged):
        return packaged
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "c")
SOURCES = ("runtime.c", "checks.c", "attention.c", "kvcache.c", "flashtile_kernels.c")


def cuda_include_dir() -> str:
    """A directory with cuda.h: the one Triton ships (its launchers build against it)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    if os.path.exists(os.path.join(path, "cuda.h")):
        return path
    for candidate in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if candidate and os.path.exists(os.path.join(candidate, "include", "cuda.h")):
            return os.path.join(candidate, "include")
    raise FileNotFoundError("no cuda.h found (Triton's nvidia backend include dir, $CUDA_HOME or /usr/local/cuda)")


@functools.lru_cache(maxsize=1)
def _worker_entries(head_dims: tuple, dtypes: tuple, features: tuple, page_sizes: tuple) -> list:
    """The export's entries, captured once per worker process (captured launches hold kernel
    functions, which do not pickle, so workers capture their own)."""
    from . import entries

    return entries.entries(head_dims, dtypes, features, page_sizes)


def _compile_entry(args):
    """Worker: compile the kernels of entry ``index`` of this export."""
    index, head_dims, dtypes, features, page_sizes = args
    from . import aot

    entry = _worker_entries(head_dims, dtypes, features, page_sizes)[index]
    return index, [aot.compile_kernel(launch, binding, entry.hinted)
                   for binding, launch in zip(entry.bindings, entry.launches)]


def export(out: str, head_dims: Sequence[int], dtypes: Sequence[str], features: Sequence[str],
           arch: str = "sm90", jobs: int = 0, build: bool = True, cc: Optional[str] = None,
           page_sizes: Optional[Sequence[int]] = None, log=print) -> dict:
    """Write the C library for these head dims, dtypes and features (the kv cache's for these
    page sizes) to ``out``; returns the manifest."""
    from .._version import __version__
    from . import codegen, entries

    if arch != "sm90":
        raise ValueError(f"--arch {arch}: the C library embeds the Hopper kernels, sm90 only")
    for d in dtypes:
        if d not in entries.DTYPES:
            raise ValueError(f"--dtypes: {d!r}; expected fp16 and/or bf16")
    start = time.time()
    page_sizes = tuple(page_sizes or entries.PAGE_SIZES)
    found = entries.entries(head_dims, dtypes, features, page_sizes)
    if not found:
        raise ValueError("nothing to export: give --features forward and/or backward")
    log(f"flashtile export: {len(found)} entries ({', '.join(map(str, head_dims))}; {', '.join(dtypes)}; "
        f"{', '.join(features)})")
    jobs = jobs or max(1, min(len(found), os.cpu_count() or 1))
    compiled = {}
    work = [(i, tuple(head_dims), tuple(dtypes), tuple(features), page_sizes) for i in range(len(found))]
    if jobs == 1:
        results = map(_compile_entry, work)
    else:
        pool = ProcessPoolExecutor(jobs)
        results = pool.map(_compile_entry, work)
    for done, (index, kernels) in enumerate(results, 1):
        for l_index, kernel in enumerate(kernels):
            compiled[(index, l_index)] = kernel
        log(f"  [{done}/{len(found)}] {found[index].name}: {', '.join(k.name for k in kernels)}")
    if jobs != 1:
        pool.shutdown()
    compile_s = time.time() - start

    src, include, lib = (os.path.join(out, p) for p in ("src", "include", "lib"))
    for path in (src, include, lib, os.path.join(lib, "cmake", "flashtile"), os.path.join(out, "share", "flashtile")):
        os.makedirs(path, exist_ok=True)
    import triton

    command = (f"python -m flashtile export --arch {arch} --head-dims {','.join(map(str, head_dims))} "
               f"--dtypes {','.join(dtypes)} --features {','.join(features)}"
               + (f" --page-sizes {','.join(map(str, page_sizes))}" if "kvcache" in features else ""))
    info = (f"flashtile {__version__} C library (API {1}); kernels compiled by Triton {triton.__version__} for {arch}\n"
            f"head dims: {', '.join(map(str, head_dims))}; dtypes: {', '.join(dtypes)}; features: "
            f"{', '.join(features)}" + (f"; kv-cache page sizes: {', '.join(map(str, page_sizes))}"
                                         if "kvcache" in features else "") + f"\nexported with: {command}")
    unique = {k.key: k for k in compiled.values()}
    with open(os.path.join(src, "flashtile_kernels.c"), "w") as f:
        f.write(codegen.generate(found, compiled, info, sorted(set(head_dims))))
    for name in ("runtime.h", *SOURCES[:-1]):
        shutil.copy(os.path.join(CSRC, name), os.path.join(src, name))
    shutil.copy(os.path.join(CSRC, "flashtile.h"), os.path.join(include, "flashtile.h"))
    examples = os.path.join(out, "share", "flashtile", "examples")
    if os.path.isdir(examples_dir()):
        shutil.copytree(examples_dir(), examples, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("build*", "__pycache__"))
    manifest = {
        "flashtile": __version__, "triton": triton.__version__, "arch": arch, "command": command,
        "head_dims": list(head_dims), "dtypes": list(dtypes), "features": list(features),
        "page_sizes": list(page_sizes) if "kvcache" in features else [],
        "entries": [{"name": e.name, "config": repr(e.config)} for e in found],
        "kernels": len(unique), "cubin_bytes": sum(len(k.cubin) for k in unique.values()),
        "compile_s": round(compile_s, 1),
    }
    if build:
        start = time.time()
        build_library(out, cc=cc)
        manifest["build_s"] = round(time.time() - start, 1)
        manifest["library_bytes"] = os.path.getsize(os.path.join(lib, "libflashtile.so"))
    write_cmake_config(out, __version__)
    with open(os.path.join(out, "share", "flashtile", "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    log(f"flashtile export: {len(unique)} kernels ({manifest['cubin_bytes'] / 2**20:.1f} MiB of cubins) compiled in "
        f"{compile_s:.0f} s" + (f", library built in {manifest['build_s']:.0f} s" if build else "") + f" -> {out}")
    return manifest


def build_library(out: str, cc: Optional[str] = None) -> None:
    """Compile out/src into out/lib/libflashtile.so and libflashtile_static.a with a C compiler."""
    cc = cc or os.environ.get("CC") or "cc"
    src, lib, obj = os.path.join(out, "src"), os.path.join(out, "lib"), os.path.join(out, "build")
    os.makedirs(obj, exist_ok=True)
    flags = ["-O2", "-fPIC", "-std=gnu11", "-fvisibility=hidden", f"-I{os.path.join(out, 'include')}",
             f"-I{cuda_include_dir()}", "-DFLASHTILE_BUILDING"]
    objects = []
    procs = []
    for name in SOURCES:
        target = os.path.join(obj, name.replace(".c", ".o"))
        procs.append(subprocess.Popen([cc, *flags, "-c", os.path.join(src, name), "-o", target],
                                      stderr=subprocess.PIPE, text=True))
        objects.append(target)
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{cc} failed:\n{err}")
    subprocess.run([cc, "-shared", "-o", os.path.join(lib, "libflashtile.so"), *objects, "-ldl", "-lpthread", "-lm",
                    "-Wl,-soname,libflashtile.so"], check=True)
    archive = os.path.join(lib, "libflashtile_static.a")
    if os.path.exists(archive):
        os.remove(archive)
    subprocess.run(["ar", "rcs", archive, *objects], check=True)
    shutil.rmtree(obj)


def write_cmake_config(out: str, version: str) -> None:
    """lib/cmake/flashtile: find_package(flashtile) gives flashtile::flashtile (shared) and
    flashtile::flashtile_static, both relocatable (paths relative to the config file)."""
    path = os.path.join(out, "lib", "cmake", "flashtile")
    release = version.split("+")[0]
    with open(os.path.join(path, "flashtileConfig.cmake"), "w") as f:
        f.write(f"""# flashtile C library (written by `python -m flashtile export`).
get_filename_component(_flashtile_prefix "${{CMAKE_CURRENT_LIST_DIR}}/../../.." ABSOLUTE)
if(NOT TARGET flashtile::flashtile)
  add_library(flashtile::flashtile SHARED IMPORTED)
  set_target_properties(flashtile::flashtile PROPERTIES
    IMPORTED_LOCATION "${{_flashtile_prefix}}/lib/libflashtile.so"
    IMPORTED_SONAME "libflashtile.so"
    INTERFACE_INCLUDE_DIRECTORIES "${{_flashtile_prefix}}/include")
endif()
if(NOT TARGET flashtile::flashtile_static)
  add_library(flashtile::flashtile_static STATIC IMPORTED)
  set_target_properties(flashtile::flashtile_static PROPERTIES
    IMPORTED_LOCATION "${{_flashtile_prefix}}/lib/libflashtile_static.a"
    INTERFACE_INCLUDE_DIRECTORIES "${{_flashtile_prefix}}/include"
    INTERFACE_LINK_LIBRARIES "${{CMAKE_DL_LIBS}};pthread;m")
endif()
set(flashtile_VERSION "{release}")
unset(_flashtile_prefix)
""")
    with open(os.path.join(path, "flashtileConfigVersion.cmake"), "w") as f:
        f.write(f"""set(PACKAGE_VERSION "{release}")
if(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
""")
