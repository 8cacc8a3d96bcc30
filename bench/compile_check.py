"""Compile every kernel the sm90 tables can launch, for sm90 (no GPU needed), and report shared memory,
registers and spills; or compare such reports across Triton versions. The catalog and the compiling
now live in the package (flashtile/tools/catalog.py, inspect.py); this keeps the old command lines:

    PYTHONPATH=<repo> python bench/compile_check.py [--head-dims 64,128,256] --json out.json
        = python -m flashtile inspect --all [--head-dims ...] --json out.json
    python bench/compile_check.py --compare 3.6.json 3.9.json [...]
        = python -m flashtile inspect --compare-reports 3.6.json 3.9.json [...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashtile.tools.inspect import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(["--compare-reports", *argv[1:]] if argv[:1] == ["--compare"] else ["--all", *argv]))
