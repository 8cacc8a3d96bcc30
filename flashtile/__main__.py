"""``python -m flashtile <command>``: the commands are listed in flashtile/tools/cli.py
(``python -m flashtile --help``)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
