"""``python -m flashtile.bench``: the old spelling of ``python -m flashtile bench`` (flashtile/tools/bench/).

Kept so the commands recorded under bench/results/ and in older docs still run: without a mode it
runs ``dense``; the old ``--varlen`` / ``--decode`` switches pick those modes, ``--varlen-modes``
becomes ``--modes`` and ``--systems flashtile,sdpa-cudnn`` becomes ``--anchors cudnn``. The dense
conventions (AttnConfig, flops, ...) are re-exported for the scripts under bench/ and the guide.
"""

from __future__ import annotations

import sys

from flashtile.tools.bench import MODES, main as _main
from flashtile.tools.bench.common import warm_up_gpu
from flashtile.tools.bench.dense import SYSTEMS as _SYSTEMS
from flashtile.tools.bench.dense import (AttnConfig, Record, Settings, flops, make_inputs,
                                         reference, sweep_configs, timed_callable)

__all__ = ["AttnConfig", "Record", "SYSTEMS", "Settings", "flops", "main", "make_inputs", "reference",
           "sweep_configs", "timed_callable", "translate", "warm_up_gpu"]

# The old system names, for scripts that still ask for them.
SYSTEMS = {**_SYSTEMS, "sdpa-fa2": _SYSTEMS["fa2"], "sdpa-cudnn": _SYSTEMS["cudnn"]}


def translate(argv: list[str]) -> list[str]:
    """Old flags -> ``<mode> [flags]`` of the new command line."""
    if argv and (argv[0] in MODES or argv[0] in ("-h", "--help")):
        return list(argv)
    mode, rest, items = "dense", [], iter(argv)
    for item in items:
        flag, eq, value = item.partition("=")
        if item in ("--varlen", "--decode"):
            mode = item[2:]
        elif flag == "--varlen-modes":
            rest += ["--modes", value if eq else next(items, "")]
        elif flag == "--systems":
            names = [n.removeprefix("sdpa-") for n in (value if eq else next(items, "")).split(",")]
            rest += ["--anchors", ",".join(n for n in names if n and n != "flashtile") or "none"]
        else:
            rest.append(item)
    return [mode, *rest]


def main(argv: list[str] | None = None) -> int:
    return _main(translate(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
