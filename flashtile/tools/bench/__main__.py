"""``python -m flashtile.tools.bench``: the same as ``python -m flashtile bench``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
