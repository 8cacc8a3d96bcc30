"""Export flashtile's Hopper kernels as a C library (no Python, PyTorch or Triton at run time).

Compiles the kernels for sm90 ahead of time (no GPU needed) for the head dims, dtypes and features
given, and writes OUT/include/flashtile.h, OUT/lib/libflashtile.so and libflashtile_static.a, and
OUT/lib/cmake/flashtile (find_package(flashtile) -> flashtile::flashtile). At run time the library
needs only the CUDA driver. See docs/c-library.md.

example:
  python -m flashtile export --head-dims 64,128 --dtypes bf16,fp16 --features forward,backward,varlen --out ft
  cmake -S ft/share/flashtile/examples -B build -Dflashtile_DIR=$PWD/ft/lib/cmake/flashtile && cmake --build build
"""

import sys
from typing import List, Optional

from .common import command_parser

PROG = "python -m flashtile export"


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: Optional[List[str]] = None) -> int:
    parser = command_parser(PROG, __doc__)
    parser.add_argument("--arch", default="sm90", help="target architecture (sm90: H100 / H200)")
    parser.add_argument("--head-dims", type=_ints, default=[64, 128],
                        help="comma list of head dims, 1 to 256 (default 64,128); 64, 96, 128, 192 and 256 get "
                             "the Hopper kernels, others the portable ones")
    parser.add_argument("--dtypes", type=_names, default=["bf16", "fp16"], help="bf16 and/or fp16 (default both)")
    parser.add_argument("--features", type=_names, default=["forward", "backward", "varlen"],
                        help="comma list of forward, backward, varlen (packed batches), kvcache (the kv-cache "
                             "call), window, softcap, alibi (default forward,backward,varlen)")
    parser.add_argument("--page-sizes", type=_ints, default=None,
                        help="with kvcache: comma list of the paged cache's page sizes, in rows (default 256)")
    parser.add_argument("--out", required=True, help="the directory to write the library to")
    parser.add_argument("--jobs", type=int, default=0, help="parallel compiles (default: one per CPU)")
    parser.add_argument("--cc", default=None, help="C compiler (default $CC or cc)")
    parser.add_argument("--no-build", action="store_true", help="write the C sources only")
    args = parser.parse_args(argv)
    from ..export import export

    try:
        export(args.out, args.head_dims, args.dtypes, args.features, arch=args.arch, jobs=args.jobs,
               build=not args.no_build, cc=args.cc, page_sizes=args.page_sizes)
    except (ValueError, NotImplementedError, FileNotFoundError, RuntimeError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
