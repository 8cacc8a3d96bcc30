"""Record of a 2026-11-22 experiment (results README, section 2), run as bench/_dbg_bars.py against
567abdd: drop chosen bar.syncs from the d256 backward's PTX in copies of the kernel module, then run
gluon_ab. Copies: flashtile/kernels/_{X}_gluon_backward.py with the d256 kernel renamed
gluon_attn_bwd_d256_kernel_{x} (a cache key and a name of its own); FT_DROP="X=849,880;Y=839" names
the source lines whose bar.syncs go. Not part of the library."""
import os, re, sys
import triton
from triton import knobs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DROP = {}
for part in filter(None, os.environ.get("FT_DROP", "").split(";")):
    tag, lines = part.split("=")
    DROP[tag] = {int(x) for x in lines.split(",")}


def make_copies():
    src = open(os.path.join(ROOT, "flashtile/kernels/gluon_backward.py")).read()
    for tag in DROP:
        s = src.replace("gluon_attn_bwd_d256_kernel", f"gluon_attn_bwd_d256_kernel_{tag.lower()}")
        open(os.path.join(ROOT, f"flashtile/kernels/_{tag}_gluon_backward.py"), "w").write(s)


def edit(ptx):
    m = re.search(r"\.entry (\w+)\(", ptx)
    name = m.group(1) if m else ""
    tag = next((t for t in DROP if name.startswith(f"gluon_attn_bwd_d256_kernel_{t.lower()}")), None)
    if tag is None:
        return ptx
    out, loc, removed = [], None, 0
    for line in ptx.split("\n"):
        lm = re.match(r"\s*\.loc\s+\d+\s+(\d+)\s+\d+", line)
        if lm:
            loc = int(lm.group(1))
        if re.match(r"\s*bar\.sync\s", line) and loc in DROP[tag]:
            removed += 1
            continue
        out.append(line)
    print(f"[dbg_bars] {name}: removed {removed} bar.sync", flush=True)
    return "\n".join(out)


def hook(backend, stages, options, language, capability):
    orig = stages["ptx"]
    stages["ptx"] = lambda src, metadata: edit(orig(src, metadata))


knobs.runtime.add_stages_inspection_hook = hook
make_copies()
if __name__ == "__main__":
    sys.path.insert(0, HERE)
    import gluon_ab
    gluon_ab.main()
