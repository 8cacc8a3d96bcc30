"""``python -m flashtile bench dense|varlen|decode|options|host``: flashtile against its anchors, correctness first.

Layout (imports only go down this list, so there is no cycle):
  __init__.py   the command line: one argparse subparser per mode, each with only the flags it reads
  dense.py      flash_attn_func sweeps (GQA, seqlen_q != seqlen_k) vs cuDNN, FA2, Flex, FA4
  varlen.py     packed batches vs padding, SDPA, torch's varlen FA2, Flex document masks, FA4
  decode.py     flash_attn_with_kvcache bandwidth vs the device copy, SDPA backends, FA4
  options.py    sliding windows, softcap, ALiBi vs plain attention and FlexAttention
  host.py       host time per eager call of each entry point vs cuDNN's
  report.py     tables, Markdown pages, optional plots
  anchors.py    optional anchors (FlashAttention-4) probed without ever raising
  common.py     argument types (1k, 16k), the output folder and its guard, progress, metadata, JSON
"""

from __future__ import annotations

import argparse
import sys

from . import decode, dense, host, options, varlen
from .common import OUT_ROOT_NAME, check_out_dir, reexec_with_interpreter_if_needed

PROG = "python -m flashtile bench"
MODES = {
    "dense": (dense, "flash_attn_func over head dims, sequence lengths, causal, GQA; TFLOP/s"),
    "varlen": (varlen, "a packed batch through flash_attn_varlen_func vs padded and packed anchors; TFLOP/s"),
    "decode": (decode, "flash_attn_with_kvcache, contiguous and paged caches; GB/s vs the copy bandwidth"),
    "options": (options, "sliding windows, softcap, ALiBi vs plain attention and FlexAttention; TFLOP/s"),
    "host": (host, "host time per eager call of each entry point vs cuDNN's, tiny shapes; us"),
}
EXAMPLES = f"""\
examples:
  {PROG} dense --headdims 64,128 --seqlens 1k,4k,16k --modes fwd,bwd
  {PROG} dense --heads 32 --heads-k 8 --seqlen-q 1k --seqlens 16k --causal true
  {PROG} dense --interpret-smoke           (no GPU: tiny shapes through the CPU interpreter)
  {PROG} varlen --headdims 128 --anchors sdpa,fa2,fa4
  {PROG} decode --batches 1,64 --cache-lens 8k,128k --seqlen-q 4
  {PROG} options --headdims 128 --window 4k --sets window-causal,softcap-causal
  taskset -c 3 {PROG} host                 (host time per call; pinned to one core)

Results go to ./{OUT_ROOT_NAME}/<date>-<mode>-<gpu>/ in the working directory (--out to choose):
JSON with every point and the environment, a Markdown table with flashtile's ratio to each anchor
measured in the same run, and a PNG when matplotlib is installed. Progress goes to stderr.
Anchors that cannot import here (FlashAttention-4) are reported as "not available: <reason>".
{PROG} <mode> --help lists a mode's options; a flag a mode does not use is an error."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Benchmark flashtile against the same-run anchors "
                                     "(cuDNN, FlashAttention-2, Flex, FlashAttention-4): every point is checked "
                                     "against a float32 reference before it is timed.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", metavar="{" + ",".join(MODES) + "}", required=True)
    for name, (module, line) in MODES.items():
        sub = modes.add_parser(name, help=line, description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(module=module, parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # name the mode: a flag of another mode must not be silently ignored
        flags = [item for item in unknown if item.startswith("-")] or unknown
        args.parser.error(f"{args.mode} does not take {' '.join(flags)} (a flag it would ignore); "
                          f"{PROG} {args.mode} --help lists its options")
    args = args.module.resolve_arguments(args, args.parser)
    if args.out is not None:
        try:
            args.out = check_out_dir(args.out)
        except SystemExit as exc:  # before anything heavy is imported, with the mode's usage line
            args.parser.error(str(exc).removeprefix("flashtile bench: "))
    if args.interpret_smoke:
        reexec_with_interpreter_if_needed()
    # Recorded in results.json/.md as the command that reproduces the run.
    return args.module.run(args, ["-m", "flashtile", "bench", *argv]) or 0
