"""Time the portable kernels' candidate configs per head dim on this GPU (what filled the sm90 table's
portable rules), through `python -m flashtile tune` (flashtile/tools/tune.py): for each head dim,
16k tokens of hidden 2048 in bf16 at --seqlen keys, causal and not, the forward, dK/dV and dQ
kernels time every configs.PORTABLE_CANDIDATES entry against the table's (FLASHTILE_PORTABLE=1
keeps the calls off the Hopper kernels; --gluon times the Gluon candidates instead). The winners
land in the autotune cache (`python -m flashtile tune --show` prints them, and the timings of every
candidate are in the file); copying them into flashtile/configs.py stays a hand edit.

    python bench/tune_configs.py --headdims 64,128,256 [--seqlen 4096] [--gluon]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashtile.tools import tune  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--gluon", action="store_true", help="the Hopper kernels' candidates, not the portable ones")
    args = parser.parse_args()
    if not args.gluon:
        os.environ["FLASHTILE_PORTABLE"] = "1"
    status = 0
    for head_dim in map(int, args.headdims.split(",")):
        shape = f"{max(1, 16384 // args.seqlen)},{args.seqlen},{2048 // head_dim},{head_dim}"
        for causal in (False, True):
            status |= tune.main(["--shape", shape, "--retune"] + ["--causal"] * causal)
    print("\n".join(tune.show()))
    return status


if __name__ == "__main__":
    sys.exit(main())
