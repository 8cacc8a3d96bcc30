"""``python -m flashtile <command> [args]``: one entry point for flashtile's tools.

Each command is a module with a ``main()`` that parses ``sys.argv[1:]``; the dispatcher runs it
with ``sys.argv`` as ``python -m <module>`` would set it, so ``python -m flashtile bench ...`` and
``python -m flashtile.bench ...`` are the same run (the same help, the same recorded command).
"""

import difflib
import importlib
import sys
from typing import List, Optional

PROG = "python -m flashtile"

# name: (module, one line for --help). The modules are imported only when their command runs.
COMMANDS = {
    "sanity": ("flashtile.tools.sanity",
               "run every kernel path this machine can run against the float64 reference; PASS/FAIL table"),
    "env": ("flashtile.env",
            "versions, GPUs and settings for a bug report; --shape explains which kernels a call runs"),
    "bench": ("flashtile.tools.bench",
              "dense | varlen | decode | options | host against cuDNN, FA2, Flex, FA4 in the same run (checked, "
              "then timed)"),
    "debug": ("flashtile.tools.debug",
              "one small case key tile by key tile, reference beside kernel, to the first divergence"),
    "inspect": ("flashtile.tools.inspect",
                "a call's kernel compiled for sm90 without a GPU: registers, spills, PTX/SASS; --all: every one"),
    "configs": ("flashtile.tools.configs_cmd",
                "which config a shape gets and why; the config tables; the autotune candidates"),
    "export": ("flashtile.tools.export_cmd",
               "the Hopper kernels as a C library (libflashtile.so, flashtile.h, CMake package), no GPU needed"),
    "tune": ("flashtile.tools.tune",
             "autotune one shape class on this GPU with a progress bar; --show / --clear the on-disk cache"),
}


def usage() -> str:
    options = {"-h, --help": "this list", "--version": "flashtile's version"}
    width = max(len(name) for name in [*COMMANDS, *options])
    lines = [f"usage: {PROG} <command> [args]   ({PROG} <command> --help for a command's options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()]
    lines += ["", "options:"] + [f"  {name:<{width}}  {line}" for name, line in options.items()]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(usage())
        return 0
    if command == "--version":
        from .._version import __version__

        print(f"flashtile {__version__}")
        return 0
    if command == "help" and rest:  # python -m flashtile help sanity
        command, rest = rest[0], ["--help"]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"{PROG}: unknown command {command!r}{hint} (commands: {', '.join(COMMANDS)}; {PROG} --help)",
              file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    saved = sys.argv
    sys.argv = [module.__file__, *rest]  # what `python -m <module> ...` would see
    try:
        return module.main() or 0
    finally:
        sys.argv = saved
