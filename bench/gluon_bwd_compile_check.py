"""Compile the Gluon Hopper backward for sm90 (no GPU needed): every config the sm90 table picks, dense
and packed, and with --candidates every configs.GLUON_CANDIDATES entry too. Now a view of
`python -m flashtile inspect --all --families gluon-bwd` (flashtile/tools/inspect.py):

    PYTHONPATH=<repo> python bench/gluon_bwd_compile_check.py [--candidates] [--head-dims 64] [--json out.json]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashtile.tools.inspect import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--all", "--families", "gluon-bwd", *sys.argv[1:]]))
