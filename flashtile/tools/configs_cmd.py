"""``python -m flashtile configs``: which config a shape gets and why; the config tables; the candidates.

With ``--shape`` it asks flashtile.explain (meta tensors, for --device-capability or this machine's
GPU, else sm90) which path each direction takes and shows the config in keyword form, the reason,
and the table rule that matched (its keys: head dim bound, causal, key-length range, dtypes, dense
or packed). ``--tables`` prints the rules of flashtile/configs.py, ``--candidates`` what
FLASHTILE_AUTOTUNE=1 (and ``python -m flashtile tune``) searches, by kernel and head dim.

    python -m flashtile configs --shape 2,4096,16,128 --causal
    python -m flashtile configs --shape 1,1024,8,64 --device-capability 8.0
    python -m flashtile configs --tables --kernel fwd_gluon
    python -m flashtile configs --candidates --kernel bwd_gluon --head-dim 128
"""

import argparse
import sys
from typing import List, Optional, Tuple

from . import common
from .common import add_call_arguments, call_spec, command_parser

PROG = "python -m flashtile configs"


def matched_rule(kernel: str, arch: str, head_dim: int, causal: bool, seqlen_k: int, dtype,
                 varlen: bool = False) -> Optional[Tuple[str, int, object]]:
    """(table name, index, Rule) of the first rule configs.table_config takes for these keys, or
    None (the interpreter's table has no rules, and a kernel may not serve the shape)."""
    from .. import configs

    tables = ((f'_TUNED["{arch}"]["{kernel}"]', configs._TUNED.get(arch, {}).get(kernel)),
              (f'_DEFAULT_GPU["{kernel}"]', configs._DEFAULT_GPU.get(kernel)))
    for name, rules in tables:
        for index, rule in enumerate(rules or ()):
            if rule.matches(head_dim, causal, seqlen_k, dtype, varlen):
                return name, index, rule
    return None


def rule_keys(rule) -> str:
    """A Rule's conditions in words: ``head dim <= 128, causal, seqlen_k in [2048, 16384), dense``."""
    parts = [f"head dim <= {rule.max_head_dim}"]
    if rule.causal is not None:
        parts.append("causal" if rule.causal else "not causal")
    if rule.min_seqlen_k or rule.max_seqlen_k < 2**62:
        high = "inf" if rule.max_seqlen_k >= 2**62 else rule.max_seqlen_k
        parts.append(f"seqlen_k in [{rule.min_seqlen_k}, {high})")
    if rule.dtypes:
        parts.append("dtype " + "/".join(str(d).replace("torch.", "") for d in rule.dtypes))
    if rule.varlen is not None:
        parts.append("packed" if rule.varlen else "dense")
    if rule.paged is not None:
        parts.append("paged" if rule.paged else "not paged")
    return ", ".join(parts)


def _choice_lines(title: str, choice, kernels: List[str], arch: str, spec) -> List[str]:
    from .catalog import config_kwargs

    lines = [f"{title}: {choice.path}" + (f" ({choice.kernel})" if choice.kernel else "")]
    if choice.config is not None:
        lines.append(f"  config: {config_kwargs(choice.config)}")
    lines.append(f"  reason: {choice.reason}")
    seqlen_k = spec.k_shape[1]
    for kernel in kernels:
        found = matched_rule(kernel, arch, spec.head_dim, spec.causal, seqlen_k, spec.dtype)
        if found is None:
            lines.append(f"  rule ({kernel}): none in the {arch} tables")
            continue
        table, index, rule = found
        lines.append(f"  rule ({kernel}): configs.{table}[{index}]: {rule_keys(rule)}")
    return lines


def explain_shape(spec, capability: Tuple[int, int]) -> List[str]:
    """The text of ``configs --shape``."""
    from ..configs import BWD_DKDV, BWD_DQ, BWD_GLUON, BWD_PREPROCESS, FWD, FWD_GLUON
    from ..explanation import explain

    q, k, v = spec.qkv()
    explanation = explain(q, k, v, **spec.options(), deterministic=spec.deterministic, device_capability=capability)
    arch = f"sm{capability[0]}{capability[1]}"
    fwd = explanation.forward
    bwd = explanation.backward
    lines = [f"call: {spec.describe()}", f"decided for {arch} (device_capability={capability})"]
    lines += _choice_lines("forward", fwd, [FWD_GLUON if fwd.path == "hopper" else FWD], arch, spec)
    kernels = [BWD_GLUON, BWD_PREPROCESS] if bwd.path == "hopper" else [BWD_DKDV, BWD_DQ, BWD_PREPROCESS]
    lines += _choice_lines("backward", bwd, kernels if bwd.path != "none" else [], arch, spec)
    if explanation.autotune:
        lines.append("autotune: FLASHTILE_AUTOTUNE=1 is set: on a GPU the first call of this shape class times the "
                     "candidates and may use another config (python -m flashtile tune --show lists the choices)")
    return lines


def table_lines(arch: str, kernels: List[str]) -> List[str]:
    """The rules of each kernel's table for ``arch`` (first match wins), then the portable defaults."""
    from .. import configs
    from .catalog import config_kwargs
    from .inspect import _table

    lines = []
    for kernel in kernels:
        if arch == "interpreter":
            lines += [f"interpreter {kernel}: {config_kwargs(configs._INTERPRETER[kernel])}"]
            continue
        sections = [(f'{arch} {kernel} (configs._TUNED["{arch}"]["{kernel}"])',
                     configs._TUNED.get(arch, {}).get(kernel)),
                    (f'defaults {kernel} (configs._DEFAULT_GPU["{kernel}"])', configs._DEFAULT_GPU.get(kernel))]
        for title, rules in sections:
            if not rules:
                continue
            lines.append(f"{title}, first match wins:")
            rows = [(index, rule_keys(rule), config_kwargs(rule.config)) for index, rule in enumerate(rules)]
            lines += ["  " + line for line in _table(("#", "when", "config"), rows)]
        lines.append("")
    return lines[:-1] if lines and lines[-1] == "" else lines


def candidate_lines(kernels: List[str], head_dim: Optional[int]) -> List[str]:
    """Each kernel's autotune candidates per head dim, by the name --config takes; ``*`` marks the
    ones a sm90 table rule uses."""
    from .. import configs
    from .catalog import candidates, config_kwargs

    lines = []
    for kernel in kernels:
        pool = configs.GLUON_CANDIDATES.get(kernel) or configs.PORTABLE_CANDIDATES.get(kernel) or {}
        in_table = {rule.config for rule in configs._TUNED.get("sm90", {}).get(kernel, ()) if rule.config is not None}
        for d in sorted(pool):
            if head_dim is not None and d != head_dim:
                continue
            named = candidates(kernel, d)
            lines.append(f"{kernel} d{d}: {len(named)} candidates (* = in the sm90 table)")
            width = max(len(name) for name in named) if named else 0
            lines += [f"  {'*' if cfg in in_table else ' '} {name:<{width}}  {config_kwargs(cfg)}"
                      for name, cfg in named.items()]
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(PROG, __doc__)
    call = parser.add_argument_group("one shape")
    add_call_arguments(call)
    call.add_argument("--device-capability", type=common.capability, metavar="MAJOR.MINOR",
                      help="decide for this GPU (default: this machine's GPU, else 9.0)")
    tables = parser.add_argument_group("the tables")
    tables.add_argument("--tables", action="store_true", help="print the config tables' rules")
    tables.add_argument("--arch", default="sm90", help="sm90, sm80, ..., interpreter (default: %(default)s)")
    tables.add_argument("--candidates", action="store_true", help="list the autotune candidates")
    tables.add_argument("--kernel", help="only this kernel (fwd, fwd_decode, fwd_decode_packed, fwd_gluon, bwd_dkdv, "
                                         "bwd_dq, bwd_gluon, bwd_preprocess)")
    tables.add_argument("--head-dim", type=int, help="--candidates: only this (padded) head dim")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from ..configs import GLUON_CANDIDATES, KERNELS, PORTABLE_CANDIDATES

    args = _parser().parse_args(argv)
    modes = sum(bool(x) for x in (args.shape, args.tables, args.candidates))
    if modes != 1:
        print(f"{PROG}: give one of --shape B,S,H,D, --tables or --candidates", file=sys.stderr)
        return 2
    if args.kernel is not None and args.kernel not in KERNELS:
        print(f"{PROG}: --kernel {args.kernel!r}: one of {', '.join(KERNELS)}", file=sys.stderr)
        return 2
    if args.tables:
        print("\n".join(table_lines(args.arch, [args.kernel] if args.kernel else list(KERNELS))))
        return 0
    if args.candidates:
        searched = [k for k in KERNELS if k in GLUON_CANDIDATES or k in PORTABLE_CANDIDATES]
        if args.kernel is not None and args.kernel not in searched:
            print(f"{PROG}: {args.kernel} has no candidates (it keeps its table config)", file=sys.stderr)
            return 2
        print("\n".join(candidate_lines([args.kernel] if args.kernel else searched, args.head_dim)))
        return 0

    import torch

    if min(args.shape) < 1:
        print(f"{PROG}: --shape takes positive sizes", file=sys.stderr)
        return 2
    capability = args.device_capability
    if capability is None:
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    spec = call_spec(args)
    try:
        print("\n".join(explain_shape(spec, tuple(capability))))
    except (TypeError, ValueError, RuntimeError) as exc:  # what the call itself would raise
        print(f"{PROG}: the call would be refused: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
