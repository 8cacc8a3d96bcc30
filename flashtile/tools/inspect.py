"""``python -m flashtile inspect``: what the kernel a call launches compiles to on sm90, without a GPU.

flashtile.explain says which path and config a call gets on an H100/H200; the host plan of that
path is then built on meta tensors of the call's shape and its kernel launch captured
(tools/catalog.py), compiled for sm90 here (Triton's own ptxas flags) and read back: registers,
spills, shared memory, threads, PTX and SASS with their hashes, an instruction histogram (SASS
opcodes in families: HGMMA, MUFU, FP32, LDS/STS, TMA, barriers, ...; PTX instructions), and for a
chosen PTX instruction the SASS generated from the same source lines.

    python -m flashtile inspect --shape 2,4096,16,128 --causal
    python -m flashtile inspect --shape 1,1024,8,64 --direction bwd --kernel dq --map ex2
    python -m flashtile inspect --shape 1,2048,16,64 --compare c2_n128_s3 c3_n128_s2   # two configs
    python -m flashtile inspect --shape 1,2048,16,64 --triton-path /tmp/triton-3.9   # two Tritons
    python -m flashtile inspect --all --json compile-3.6.json    # every kernel the sm90 tables launch
    python -m flashtile inspect --compare-reports compile-3.6.json compile-3.9.json
"""

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from .common import DTYPES, add_call_arguments, call_spec, command_parser

PROG = "python -m flashtile inspect"

# ----------------------------------------------------------------------------------------------
# Compiling and reading back


def tool_path(name: str) -> Optional[str]:
    """A CUDA binary (cuobjdump, nvdisasm): next to the ptxas Triton uses, else in Triton's bundled
    bin directory, else on PATH."""
    import shutil

    from ..triton_compat import ptxas_path

    places = []
    try:
        places.append(os.path.dirname(ptxas_path(90)))
    except Exception:  # no NVIDIA backend
        pass
    try:
        import triton.backends.nvidia as nvidia

        places.append(os.path.join(os.path.dirname(nvidia.__file__), "bin"))
    except ImportError:
        pass
    for place in places:
        path = os.path.join(place, name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which(name)


@dataclasses.dataclass
class Build:
    """One kernel compiled for sm90: the captured launch, Triton's compiled kernel and ptxas' report."""

    launch: object  # catalog.Launch
    compiled: object
    log: str

    @property
    def ptx(self) -> str:
        return self.compiled.asm["ptx"]

    @functools.cached_property
    def sass(self) -> str:
        """cuobjdump -sass of the cubin (what compile checks have always hashed)."""
        return _disassemble(self.compiled.asm["cubin"], "cuobjdump", ["-sass"])

    @functools.cached_property
    def sass_with_lines(self) -> Optional[str]:
        """nvdisasm -g: the SASS with the source line of each instruction; None without nvdisasm."""
        if tool_path("nvdisasm") is None:
            return None
        return _disassemble(self.compiled.asm["cubin"], "nvdisasm", ["-g", "-c"])

    @property
    def threads(self) -> int:
        found = re.search(r"^\.(?:reqntid|maxntid)\s+(\d+)", self.ptx, re.M)
        return int(found.group(1)) if found else 32 * self.compiled.metadata.num_warps


def _disassemble(cubin: bytes, tool: str, flags: List[str]) -> str:
    path = tool_path(tool)
    if path is None:
        raise RuntimeError(f"{tool} not found next to ptxas, in Triton's nvidia/bin, or on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        name = os.path.join(tmp, "kernel.cubin")
        with open(name, "wb") as f:
            f.write(cubin)
        return subprocess.run([path, *flags, name], capture_output=True, text=True, check=True).stdout


def compile_launch(launch) -> Build:
    """Compile a captured launch for sm90 (compile afresh, with ptxas' -v report of this build)."""
    from triton.backends.compiler import GPUTarget

    from ..triton_compat import compile_for_target

    compiled, log = compile_for_target(launch.fn, (), launch.compile_kwargs(), GPUTarget("cuda", 90, 32),
                                       ptxas_log=True)
    return Build(launch, compiled, log)


def stripped_ptx(ptx: str) -> str:
    """The PTX without debug info (.loc / .file lines, scope labels, DWARF sections): ptxas is not
    always deterministic (the d256 backward's SASS differs run to run), so equal code is best
    judged here."""
    code = ptx.split(".section\t.debug")[0]
    return "\n".join(line for line in code.splitlines()
                     if not re.match(r"\s*(\.loc|\.file)\b", line) and not re.match(r"\$L__tmp\d+:$", line))


def summary(build: Build) -> dict:
    """The report fields of one kernel (the compile check's JSON row, before its labels)."""
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", build.log)
    regs = re.search(r"Used (\d+) registers", build.log)
    code = stripped_ptx(build.ptx)
    body = "\n".join(line for line in build.sass.splitlines() if "Function" not in line and "code for" not in line)
    return {"kernel": build.launch.name, "grid": list(build.launch.grid), "threads": build.threads,
            "shared": build.compiled.metadata.shared, "regs": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else 0, "spill_loads": int(spills.group(2)) if spills else 0,
            "ptx_lines": len(ptx_instructions(build.ptx)), "ptx_sha1": hashlib.sha1(code.encode()).hexdigest()[:12],
            "sass_lines": body.count("\n"), "sass_sha1": hashlib.sha1(body.encode()).hexdigest()[:12]}


# ----------------------------------------------------------------------------------------------
# Histograms

# SASS opcodes (the part before the first dot) by family; the first family that lists one wins.
SASS_FAMILIES = (
    ("HGMMA (wgmma)", {"HGMMA"}),
    ("HMMA/IMMA (mma.sync)", {"HMMA", "IMMA"}),
    ("MUFU (ex2, rcp, ...)", {"MUFU"}),
    ("FP32 (FFMA/FMUL/FADD/FMNMX)", {"FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD",
                                     "FFMA2", "FMUL2", "FADD2"}),
    ("FP16x2 (HFMA2/HADD2/...)", {"HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2"}),
    ("convert (F2FP/F2F/I2F)", {"F2FP", "F2F", "I2F", "F2I", "I2FP", "F2IP", "FRND"}),
    ("LDS/STS (shared)", {"LDS", "STS"}),
    ("LDSM/STSM (shared matrix)", {"LDSM", "STSM"}),
    ("LDG/STG (global)", {"LDG", "STG"}),
    ("LDGSTS (cp.async)", {"LDGSTS", "LDGDEPBAR"}),
    ("TMA (UTMALDG/UTMASTG/UBLKCP)", {"UTMALDG", "UTMASTG", "UTMAREDG", "UTMAPF", "UTMACCTL", "UTMACMDFLUSH",
                                      "UBLKCP", "UBLKRED", "UBLKPF"}),
    ("LDL/STL (local: spills)", {"LDL", "STL"}),
    ("atomics (RED/ATOM)", {"RED", "REDG", "ATOM", "ATOMG", "ATOMS", "REDAS"}),
    ("BAR/SYNCS (barriers, mbarrier, fences)", {"BAR", "SYNCS", "WARPGROUP", "MEMBAR", "DEPBAR", "ERRBAR", "FENCE",
                                                "CCTL", "ARRIVES", "USETMAXREG"}),
    ("shuffle (SHFL)", {"SHFL"}),
    ("branch (BRA/EXIT/BSSY/...)", {"BRA", "BRX", "BRXU", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC",
                                    "WARPSYNC", "BREAK", "YIELD", "KILL", "NANOSLEEP", "BPT"}),
    ("integer/address (IMAD/IADD3/LOP3/...)", {"IMAD", "IADD3", "IADD", "VIADD", "LEA", "LOP3", "SHF", "ISETP",
                                               "IMNMX", "VIMNMX", "VIADDMNMX", "SEL", "PRMT", "IABS", "POPC", "FLO",
                                               "BREV", "SGXT",
                                               "BMSK", "IDP", "PLOP3", "P2R", "R2P"}),
    ("move (MOV/S2R/LDC/R2UR/...)", {"MOV", "S2R", "CS2R", "S2UR", "R2UR", "LDC", "VOTE", "VOTEU", "ELECT"}),
    ("NOP (padding)", {"NOP"}),
)
_FAMILY_OF = {opcode: name for name, opcodes in SASS_FAMILIES for opcode in opcodes}
OTHER = "other"

_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.+?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def sass_instructions(sass: str) -> List[str]:
    """The instructions of a cuobjdump / nvdisasm listing, predicates dropped ("HGMMA.64x128x16.F32 ...")."""
    found = []
    for line in sass.splitlines():
        match = _SASS_LINE.match(line)
        if match:
            found.append(_PREDICATE.sub("", match.group(2)))
    return found


def sass_family(opcode: str) -> str:
    """The family of one SASS opcode; uniform-datapath twins (UIADD3, ULOP3, ULDC, UMOV) count
    with their vector ones."""
    base = opcode.split(".")[0]
    if base in _FAMILY_OF:
        return _FAMILY_OF[base]
    if base.startswith("U") and base[1:] in _FAMILY_OF:
        return _FAMILY_OF[base[1:]]
    return OTHER


def sass_histogram(sass: str) -> Dict[str, int]:
    """{family: instructions}, in SASS_FAMILIES order (families with none left out)."""
    counts = collections.Counter(sass_family(instruction.split()[0]) for instruction in sass_instructions(sass))
    order = [name for name, _ in SASS_FAMILIES] + [OTHER]
    return {name: counts[name] for name in order if counts[name]}


_PTX_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s*[^:]*;")
_PTX_TYPE = re.compile(r"^(?:[bsuf]|bf|e4m3|e5m2)\d+(?:x\d+)?$|^pred$")
# PTX families named by two components (ld.shared, wgmma.mma_async, mbarrier.try_wait) or three (cp.async.bulk).
_PTX_TWO = {"ld", "st", "wgmma", "mbarrier", "fence", "bar", "barrier", "red", "atom", "ex2", "fma", "cvt", "elect",
            "setmaxnreg", "tcgen05", "ldmatrix", "stmatrix", "mma", "shfl", "cp", "griddepcontrol"}


def ptx_instructions(ptx: str) -> List[str]:
    """The opcode of every PTX instruction (directives, labels and debug lines left out)."""
    found = []
    for line in ptx.split(".section\t.debug")[0].splitlines():
        if line.lstrip().startswith((".", "//", "$", "{", "}")):
            continue
        match = _PTX_INSTRUCTION.match(line)
        if match:
            found.append(match.group(1))
    return found


def ptx_key(opcode: str) -> str:
    """A PTX opcode without its types and modifiers: ld.shared.v4.b32 -> ld.shared, cp.async.bulk.tensor.2d... ->
    cp.async.bulk, ex2.approx.ftz.f32 -> ex2.approx, add.s32 -> add."""
    parts = [part for part in opcode.split(".") if not _PTX_TYPE.match(part)]
    if parts[0] not in _PTX_TWO:
        return parts[0]
    return ".".join(parts[:3 if parts[0] == "cp" else 2])


def ptx_histogram(ptx: str) -> Dict[str, int]:
    return dict(collections.Counter(ptx_key(opcode) for opcode in ptx_instructions(ptx)).most_common())


# ----------------------------------------------------------------------------------------------
# PTX -> SASS by source line

_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"(?:,\s*"([^"]+)")?')
_SASS_FILE = re.compile(r'//## File "([^"]+)", line (\d+)')


def ptx_locations(ptx: str) -> List[tuple]:
    """[(file, line, opcode)] of every PTX instruction, by the .loc before it."""
    files = {}
    for line in ptx.splitlines():
        match = _FILE.match(line)
        if match:
            index, first, second = match.groups()
            files[index] = os.path.join(first, second) if second else first
    found, where = [], None
    for line in ptx.split(".section\t.debug")[0].splitlines():
        match = _LOC.match(line)
        if match:
            where = match.groups()
            continue
        if line.lstrip().startswith((".", "//", "$", "{", "}")):
            continue
        instruction = _PTX_INSTRUCTION.match(line)
        if instruction and where is not None:
            found.append((files.get(where[0], f"file{where[0]}"), int(where[1]), instruction.group(1)))
    return found


def sass_locations(sass_with_lines: str) -> List[tuple]:
    """[(file, line, instruction)] of every SASS instruction of an nvdisasm -g listing."""
    found, where = [], None
    for line in sass_with_lines.splitlines():
        match = _SASS_FILE.search(line)
        if match:
            where = (match.group(1), int(match.group(2)))
            continue
        instruction = _SASS_LINE.match(line)
        if instruction and where is not None:
            found.append((*where, _PREDICATE.sub("", instruction.group(2))))
    return found


def line_map(build: Build, pattern: str, limit: int = 12) -> List[str]:
    """For PTX instructions whose opcode matches ``pattern`` (a regex, e.g. "wgmma" or "ex2"): per
    source line, those PTX instructions and the SASS instructions generated from that line. Lines
    of text; a clear message where line info or nvdisasm is missing."""
    ptx = ptx_locations(build.ptx)
    if not ptx:
        return ["line info unavailable: the PTX has no .loc lines (TRITON_DISABLE_LINE_INFO=1?)"]
    regex = re.compile(pattern)
    matched = [(f, n, op) for f, n, op in ptx if regex.search(op)]
    if not matched:
        opcodes = ", ".join(list(ptx_histogram(build.ptx))[:25])
        return [f"no PTX instruction matches {pattern!r} (opcodes here: {opcodes})"]
    listing = build.sass_with_lines
    if listing is None:
        return ["line info unavailable: nvdisasm not found next to ptxas or in Triton's nvidia/bin; "
                f"{len(matched)} PTX instructions match {pattern!r}"]
    sass = sass_locations(listing)
    if not sass:
        return ["line info unavailable: the cubin has no line info (nvdisasm -g printed none)"]
    by_line: Dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for f, n, instruction in sass:
        by_line[(f, n)][instruction.split()[0]] += 1
    ptx_by_line: Dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for f, n, op in matched:
        ptx_by_line[(f, n)][op] += 1
    lines = [f"{pattern!r}: {len(matched)} PTX instructions on {len(ptx_by_line)} source lines; per line, the PTX "
             f"that matches -> every SASS instruction generated from that line (ptxas' line info is approximate: "
             f"it may credit an instruction to a neighbouring line)"]
    ranked = sorted(ptx_by_line.items(), key=lambda item: -sum(item[1].values()))
    for (f, n), ops in ranked[:limit]:
        here = by_line.get((f, n), collections.Counter())
        ptx_text = ", ".join(f"{count} {op}" for op, count in ops.most_common())
        sass_text = ", ".join(f"{count} {op}" for op, count in here.most_common(8)) or "none (folded elsewhere)"
        more = f" (+{len(here) - 8} more opcodes)" if len(here) > 8 else ""
        lines.append(f"  {_short(f)}:{n}")
        lines.append(f"    PTX  {ptx_text}")
        lines.append(f"    SASS {sum(here.values())}: {sass_text}{more}")
    if len(ranked) > limit:
        lines.append(f"  ... {len(ranked) - limit} more source lines")
    return lines


def _short(path: str) -> str:
    """A source path from the package root (flashtile/kernels/...), else its last two parts."""
    parts = path.replace("\\", "/").split("/")
    if "flashtile" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("flashtile"):])
    return "/".join(parts[-2:])


# ----------------------------------------------------------------------------------------------
# Tables


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> List[str]:
    """Aligned columns under a rule: numbers to the right, text to the left."""
    cells = [[str(c) for c in header]] + [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [i > 0 and all(re.fullmatch(r"[-+=]?[\d.]*%?|-|=|differs", row[i]) for row in cells[1:])
               for i in range(len(header))]
    out = []
    for index, row in enumerate(cells):
        out.append("  ".join(c.rjust(w) if numeric[i] else c.ljust(w)
                             for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


_SUMMARY_FIELDS = ("kernel", "grid", "threads", "shared", "regs", "spill_stores", "spill_loads", "ptx_lines",
                   "ptx_sha1", "sass_lines", "sass_sha1")


def diff_lines(labels: Sequence[str], reports: Sequence[dict]) -> List[str]:
    """A side-by-side table of two inspections (summary fields, SASS families, the PTX instructions
    whose counts differ), with B - A for numbers."""
    a, b = reports

    def delta(x, y):
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
            return f"{y - x:+d}" if y != x else "="
        return "=" if x == y else "differs"
    rows = [(name, a["summary"].get(name), b["summary"].get(name), delta(a["summary"].get(name),
                                                                        b["summary"].get(name)))
            for name in _SUMMARY_FIELDS]
    lines = ["summary:", *("  " + line for line in _table(("", *labels, "B - A"), rows))]
    families = [name for name in [*(name for name, _ in SASS_FAMILIES), OTHER]
                if name in a["sass_histogram"] or name in b["sass_histogram"]]
    rows = [(name, a["sass_histogram"].get(name, 0), b["sass_histogram"].get(name, 0),
             delta(a["sass_histogram"].get(name, 0), b["sass_histogram"].get(name, 0))) for name in families]
    lines += ["SASS instructions by family:", *("  " + line for line in _table(("", *labels, "B - A"), rows))]
    ptx = list(dict.fromkeys([*a["ptx_histogram"], *b["ptx_histogram"]]))
    changed = [(name, a["ptx_histogram"].get(name, 0), b["ptx_histogram"].get(name, 0)) for name in ptx
               if a["ptx_histogram"].get(name, 0) != b["ptx_histogram"].get(name, 0)]
    changed.sort(key=lambda row: -abs(row[2] - row[1]))
    if changed:
        rows = [(name, x, y, delta(x, y)) for name, x, y in changed[:20]]
        lines += ["PTX instructions that differ:", *("  " + line for line in _table(("", *labels, "B - A"), rows))]
    else:
        lines.append("PTX instruction counts: the same")
    return lines


# ----------------------------------------------------------------------------------------------
# One call


def _pick(launches, kernel: Optional[str], direction: str, path: str):
    """The launch ``--kernel`` names (a part: fwd, preprocess, bwd, convert, dkdv, dq; or a kernel
    function's name), by default the main one."""
    if kernel is None:
        kernel = "fwd" if direction == "fwd" else ("bwd" if path == "hopper" else "dkdv")
    for launch in launches:
        if kernel in (launch.part, launch.name):
            return launch
    names = ", ".join(f"{launch.part} ({launch.name})" for launch in launches)
    raise ValueError(f"--kernel {kernel}: this call launches {names}")


def inspect_call(args, config: Optional[str]) -> dict:
    """Everything about one kernel of one call, as JSON-ready values; ``build`` kept aside for
    --ptx / --sass / --map."""
    from .catalog import PARTS, call_launches, config_kwargs

    spec = call_spec(args)
    part = PARTS.get(args.kernel, args.kernel)
    part = part if part in ("dq", "dkdv") else None
    found = call_launches(spec, args.direction, config, part=part)
    launch = _pick(found.launches, args.kernel, args.direction, found.path)
    started = time.perf_counter()
    build = compile_launch(launch)
    import triton

    return {"call": spec.describe(), "direction": args.direction, "path": found.path, "table_kernel": found.kernel,
            "config_name": config or "table", "config": config_kwargs(found.config), "reason": found.reason,
            "notes": found.notes, "launches": [f"{x.part} ({x.name})" for x in found.launches],
            "triton": triton.__version__, "compile_s": round(time.perf_counter() - started, 1),
            "summary": summary(build), "sass_histogram": sass_histogram(build.sass),
            "ptx_histogram": ptx_histogram(build.ptx), "build": build}


def _print_call(report: dict) -> None:
    print(f"call: {report['call']}")
    print(f"{report['direction']}: {report['path']} path, launches {', '.join(report['launches'])}")
    print(f"  reason: {report['reason']}")
    for note in report["notes"]:
        print(f"  note: {note}")


def _print_report(report: dict, top: int) -> None:
    s = report["summary"]
    _print_call(report)
    print(f"kernel: {s['kernel']}  (Triton {report['triton']}, compiled for sm90 in {report['compile_s']} s)")
    print(f"  config ({report['config_name']}): {report['config']}")
    print(f"  grid {tuple(s['grid'])}, {s['threads']} threads, {s['shared']} B shared memory, {s['regs']} registers, "
          f"spills {s['spill_stores']} B stored / {s['spill_loads']} B loaded")
    print(f"  PTX {s['ptx_lines']} instructions (sha1 {s['ptx_sha1']}, debug info stripped), "
          f"SASS {s['sass_lines']} lines (sha1 {s['sass_sha1']})")
    print("SASS instructions by family:")
    total = sum(report["sass_histogram"].values()) or 1
    for line in _table(("family", "count", "share"),
                       [(name, count, f"{100 * count / total:.1f}%")
                        for name, count in report["sass_histogram"].items()]):
        print("  " + line)
    ptx = list(report["ptx_histogram"].items())
    print(f"PTX instructions (top {min(top, len(ptx))} of {len(ptx)}):")
    for line in _table(("instruction", "count"), ptx[:top]):
        print("  " + line)


def _second_triton(argv: List[str], directory: str) -> dict:
    """This inspection run by another Triton (a ``pip install --target DIR triton==X`` directory) in a
    child process, its JSON report."""
    import flashtile

    root = os.path.dirname(os.path.dirname(os.path.abspath(flashtile.__file__)))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    paths = [os.path.abspath(directory), root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    done = subprocess.run([sys.executable, "-m", "flashtile", "inspect", *argv, "--json", "-"], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the inspection with {directory} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _child_argv(argv: List[str]) -> List[str]:
    """argv without the options a --triton-path child must not see."""
    out, skip = [], 0
    for item in argv:
        if skip:
            skip -= 1
            continue
        name = item.split("=")[0]
        if name in ("--triton-path", "--json", "--ptx", "--sass", "--map"):
            skip = 0 if "=" in item else 1
            continue
        out.append(item)
    return out


# ----------------------------------------------------------------------------------------------
# Every kernel the tables launch (the CI's compile check)


def label(variant) -> str:
    """A catalog row as the tables print it (and --match matches it): family, head dim, mask, variant."""
    return (f"{variant.family:13s} d{variant.head_dim:<4} {'causal' if variant.causal else 'full':6s} "
            f"{variant.variant:30s}")


def selected(args, dtype) -> list:
    """The catalog rows --head-dims, --families, --candidates and --match select."""
    from .catalog import catalog

    variants = catalog([int(x) for x in args.head_dims.split(",")], dtype, args.candidates, args.families.split(","))
    if args.match:
        regex = re.compile(args.match)
        variants = [v for v in variants if regex.search(" ".join(label(v).split()))]
    return variants


def compile_all(variants) -> tuple:
    """Compile every given catalog row; (rows, failures). A row that fails to compile is recorded
    with its error (and counts as a failure), the rest go on."""
    import triton

    rows, failures = [], 0
    print(f"{'family':13s} {'d':5s} {'mask':6s} {'variant':30s} {'shared':>7} {'regs':>4} {'spill st/ld':>11} "
          f"{'sass':>6} ptx sha1", flush=True)
    for variant in variants:
        row = {"family": variant.family, "head_dim": variant.head_dim, "causal": variant.causal,
               "variant": variant.variant, "config": variant.config}
        try:
            found = summary(compile_launch(variant.launch()))
        except Exception as exc:  # a kernel this Triton cannot build: the run fails, the others still report
            failures += 1
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"{label(variant)} FAILED {row['error'][:200]}", flush=True)
            rows.append(row)
            continue
        found.pop("grid")
        row = {**found, **row}
        rows.append(row)
        print(f"{label(variant)} {row['shared']:>7} {row['regs']:>4} {row['spill_stores']:>5}/"
              f"{row['spill_loads']:<5} {row['sass_lines']:>6} {row['ptx_sha1']}", flush=True)
    print(f"{len(rows) - failures} kernels compiled for sm90 with triton {triton.__version__}"
          + (f", {failures} FAILED" if failures else ""), flush=True)
    return rows, failures


def compare_reports(paths: Sequence[str]) -> List[str]:
    """A markdown table of registers and spills per kernel variant across --all reports (one column
    per report, labelled by its Triton version)."""
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    labels = [report.get("triton", os.path.basename(path)) for report, path in zip(reports, paths)]
    keyed = [{(row["family"], row["head_dim"], row["causal"], row["variant"]): row for row in report["kernels"]}
             for report in reports]
    keys = list(dict.fromkeys(key for table in keyed for key in table))
    lines = ["| kernel | d | mask | variant | " + " | ".join(f"{label} regs spill st/ld" for label in labels) + " |",
             "|---|---|---|---|" + "---|" * len(labels)]
    for key in keys:
        cells = []
        for table in keyed:
            row = table.get(key)
            if row is None:
                cells.append("-")
            elif "error" in row:
                cells.append("FAILED")
            else:
                cells.append(f"{row['regs']} {row['spill_stores']}/{row['spill_loads']}")
        family, d, causal, variant = key
        lines.append(f"| {family} | {d} | {'causal' if causal else 'full'} | {variant} | " + " | ".join(cells) + " |")
    return lines


# ----------------------------------------------------------------------------------------------
# The command


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(PROG, __doc__)
    call = parser.add_argument_group("the call (as python -m flashtile.env --shape describes one)")
    add_call_arguments(call, dtypes=("bf16", "fp16"))
    call.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    call.add_argument("--kernel", metavar="PART",
                      help="which launch: fwd; bwd, preprocess, convert (Hopper backward); dkdv, dq, preprocess "
                           "(portable backward); default the main one")
    call.add_argument("--config", metavar="NAME",
                      help="a candidate name (python -m flashtile configs --candidates), 'table', or "
                           "field=value,... changing the table's config")
    out = parser.add_argument_group("output")
    out.add_argument("--map", metavar="OPCODE", help="PTX instructions matching this regex (wgmma, ex2, ...) and the "
                                                     "SASS generated from their source lines")
    out.add_argument("--ptx", metavar="FILE", help="write the PTX here")
    out.add_argument("--sass", metavar="FILE", help="write the SASS here (with source lines where nvdisasm is found)")
    out.add_argument("--top", type=int, default=15, help="PTX instructions to list (default: %(default)s)")
    out.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': stdout, nothing else printed)")
    cmp = parser.add_argument_group("comparisons")
    cmp.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two configs (as --config) for the same call")
    cmp.add_argument("--triton-path", metavar="DIR",
                     help="also inspect with the Triton installed in DIR (pip install --target DIR triton==X), "
                          "side by side")
    every = parser.add_argument_group("every kernel the sm90 tables launch (the CI's compile check)")
    every.add_argument("--all", action="store_true", help="compile them all; with --json, write the report")
    every.add_argument("--list", action="store_true", help="list them without compiling")
    every.add_argument("--head-dims", default="64,128,256")
    every.add_argument("--families", default=",".join(("gluon-fwd", "gluon-bwd", "portable-fwd", "portable-bwd")))
    every.add_argument("--candidates", action="store_true", help="also every Gluon candidate config")
    every.add_argument("--match", metavar="REGEX", help="only the rows whose 'family dD mask variant' matches, "
                                                        "e.g. 'gluon-bwd d128' or 'preprocess'")
    every.add_argument("--compare-reports", nargs="+", metavar="REPORT",
                       help="registers and spills side by side across --all --json reports")
    return parser


def _problem(args) -> Optional[str]:
    from .catalog import FAMILIES

    modes = sum(bool(x) for x in (args.all or args.list, args.compare_reports, args.shape))
    if modes == 0:
        return "give --shape B,S,H,D (one call), --all / --list (every kernel), or --compare-reports"
    if modes > 1:
        return "--shape, --all / --list and --compare-reports are separate modes: give one"
    if args.compare and args.triton_path:
        return "--compare and --triton-path: one comparison at a time"
    if args.compare and args.config:
        return "--compare A B names both configs: leave out --config"
    if args.shape is not None:
        if min(args.shape) < 1 or (args.heads_k is not None and args.heads_k < 1) or (args.seqlen_k or 1) < 1:
            return "--shape, --heads-k and --seqlen-k take positive sizes"
    try:
        [int(x) for x in args.head_dims.split(",")]
    except ValueError:
        return f"--head-dims: comma-separated ints, got {args.head_dims!r}"
    unknown = set(args.families.split(",")) - set(FAMILIES)
    if unknown:
        return f"--families: unknown {', '.join(sorted(unknown))} (known: {', '.join(FAMILIES)})"
    return None


def _needs_compiler(args) -> bool:
    return bool(args.shape or (args.all and not args.list))


def main(argv: Optional[List[str]] = None) -> int:
    given = argv
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    problem = _problem(args)
    if problem:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    from ..runtime import interpreter_enabled

    if _needs_compiler(args) and interpreter_enabled():
        # The kernels were defined for Triton's interpreter (TRITON_INTERPRET=1, read at import):
        # they cannot be compiled. Start this command line again without it.
        if given is None:
            env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
            os.execve(sys.executable, list(sys.orig_argv), env)
        print(f"{PROG}: TRITON_INTERPRET=1 is set: the kernels cannot be compiled; unset it", file=sys.stderr)
        return 2

    if args.compare_reports:
        print("\n".join(compare_reports(args.compare_reports)))
        return 0
    dtype = DTYPES[args.dtype]
    if args.list:
        variants = selected(args, dtype)
        for v in variants:
            print(f"{label(v)} {v.config}")
        print(f"{len(variants)} kernel variants")
        return 0
    if args.all:
        import triton

        from ..triton_compat import ptxas_path

        print(f"triton {triton.__version__}, ptxas {ptxas_path(90)}", flush=True)
        rows, failures = compile_all(selected(args, dtype))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"triton": triton.__version__, "ptxas": ptxas_path(90), "kernels": rows}, f, indent=1)
        return 1 if failures else 0
    return _inspect(args, argv)


def _inspect(args, argv: List[str]) -> int:
    quiet = args.json == "-"
    try:
        if args.compare:
            reports = [inspect_call(args, name) for name in args.compare]
            labels = list(args.compare)
        else:
            reports = [inspect_call(args, args.config)]
            labels = [f"triton {reports[0]['triton']}"]
            if args.triton_path:
                reports.append(_second_triton(_child_argv(argv), args.triton_path))
                labels.append(f"triton {reports[1]['triton']} ({args.triton_path})")
    except (ValueError, TypeError) as exc:  # the call would be refused, or a --config / --kernel that does not fit
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the compile itself failed: that is a finding, not a usage error
        print(f"{PROG}: compiling failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    build = reports[0].pop("build")
    for report in reports[1:]:
        report.pop("build", None)
    if args.json:
        text = json.dumps(reports[0] if len(reports) == 1 else {"labels": labels, "reports": reports}, indent=1)
        if quiet:
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if not quiet:
        if len(reports) == 1:
            _print_report(reports[0], args.top)
        else:
            _print_call(reports[0])
            for name, report in zip("AB", reports):
                print(f"{name}: {labels['AB'.index(name)]}: {report['summary']['kernel']}, config {report['config']}")
            print("\n".join(diff_lines(labels, reports)))
        if args.map:
            print()
            print("\n".join(line_map(build, args.map)))
    for path, text, what in ((args.ptx, build.ptx, "PTX"), (args.sass, None, "SASS")):
        if path:
            if text is None:
                text = build.sass_with_lines or build.sass
            with open(path, "w") as f:
                f.write(text)
            if not quiet:
                print(f"{what} written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
