"""Same as ``python -m flashtile.bench`` (kept for the commands recorded in bench/results/)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtile.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
