"""``python -m flashtile sanity``: every kernel path this machine can run, against the float64 reference.

Each case calls a public entry point (flash_attn_func and its packed forms, flash_attn_varlen_func,
flash_attn_with_kvcache) on random inputs and holds its outputs (and gradients) to FlashAttention's
rule (flashtile.testing): the error against float64 may be at most twice PyTorch's own error in the
input dtype, plus a small epsilon. One row per tensor: the case, the path that computed it
(flashtile.explain: "hopper" Gluon kernels or "portable" Triton kernels), the dtype, the errors, the
bound and PASS/FAIL. The exit status is 1 if any row fails.

On a GPU the cases run compiled, in fp16 and bf16, up to head dim 256 and 1023 tokens (the Hopper
kernels on sm90); without one, tiny shapes run through Triton's CPU interpreter (fp16, fp32).

    python -m flashtile sanity                 # the full set
    python -m flashtile sanity --quick         # fewer, smaller cases (tiny on the CPU)
    python -m flashtile sanity --cases causal,varlen --json sanity.json
    python -m flashtile sanity --list          # the cases, without running them
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
import zlib
from typing import Callable, List, Optional, Sequence

import torch

from .common import choose_device, command_parser, device_problem, restart_under_interpreter

PROG = "python -m flashtile sanity"

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclasses.dataclass
class Row:
    """One tensor of one case. ``error``, ``pytorch_error`` and ``allowed`` are relative errors
    (flashtile.testing.rel_error); None where the check is exact or a yes/no (lse, the cache)."""

    tensor: str
    path: str
    error: Optional[float]
    pytorch_error: Optional[float]
    allowed: Optional[float]
    passed: bool
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Case:
    """``kind`` names what is checked (the --cases filter matches ``name``: kind and shape);
    ``check(device, dtype)`` runs it and returns (rows, flashtile.explain's answer or None)."""

    kind: str
    shape: str
    dtype: torch.dtype
    check: Callable

    @property
    def name(self) -> str:
        return f"{self.kind} {self.shape}"


# ----------------------------------------------------------------------------------------------
# Checks


def _randn(*shape, dtype, device, requires_grad=False) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)


def _error_rows(errors, dtype, forward_path: str, backward_path: str) -> List[Row]:
    """Rows from flashtile.testing.reference_errors' (name, error, pytorch_error) triples."""
    from flashtile.testing import allowed_error

    rows = []
    for name, error, base in errors:
        bound = allowed_error(base, dtype)
        rows.append(Row(name, forward_path if name == "out" else backward_path, error, base, bound, error <= bound))
    return rows


def _lse_row(lse, ref_lse, path: str) -> Row:
    """softmax_lse: fp32, -inf exactly where the reference's is, close elsewhere (check_lse)."""
    from flashtile.testing import check_lse

    try:
        check_lse(lse, ref_lse)
    except AssertionError as exc:
        return Row("lse", path, None, None, None, False, str(exc))
    return Row("lse", path, None, None, None, True)


def _explain(*args, **kwargs):
    from flashtile import explain

    return explain(*args, **kwargs)


def _explain_options(options: dict) -> dict:
    from flashtile.testing import REFERENCE_OPTIONS

    return {name: value for name, value in options.items() if name in REFERENCE_OPTIONS + ("deterministic",)}


def check_call(fn, q, k, v, *, backward: bool, reference=None, explanation=None, **options):
    """``fn(q, k, v, return_attn_probs=True, **options)`` against the float64 reference: rows for
    out, lse and, with ``backward``, dq, dk, dv (autograd through ``fn``, a random dout).

    With dropout the reference applies the kernel's own mask, read off the sign of the returned
    S_dmask (dropped entries are negated), as tests/_cases.py does."""
    from flashtile.reference import attention_naive
    from flashtile.testing import call_errors

    errors, lse, ref_lse = call_errors(fn, q, k, v, backward=backward, reference=reference or attention_naive,
                                       **options)
    forward, backward_path = (explanation.forward.path, explanation.backward.path) if explanation else ("?", "?")
    rows = _error_rows(errors, q.dtype, forward, backward_path)
    rows.insert(1, _lse_row(lse, ref_lse, forward))
    return rows


def _score_options(nheads: int, device, alibi: bool = False, **options) -> dict:
    if alibi:
        options["alibi_slopes"] = torch.rand(nheads, device=device, dtype=torch.float32) * 0.3
    return options


def check_dense(device, dtype, *, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, backward=True,
                packed=False, seed_check=False, **options):
    """flash_attn_func (``packed``: flash_attn_qkvpacked_func on the stacked q, k, v)."""
    from flashtile import flash_attn_func

    q = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device, requires_grad=backward)
    k, v = (_randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype, device=device, requires_grad=backward)
            for _ in range(2))
    options = _score_options(nheads, device, **options)
    explanation = _explain(q, k, v, **_explain_options(options))
    fn = _qkvpacked if packed else flash_attn_func
    rows = check_call(fn, q, k, v, backward=backward, explanation=explanation, **options)
    if seed_check:
        rows.append(_same_seed_row(fn, q, k, v, explanation.forward.path, **options))
    return rows, explanation


def _qkvpacked(q, k, v, **options):
    """flash_attn_qkvpacked_func on q, k, v stacked into one (b, s, 3, h, d) tensor: autograd
    splits its one dqkv into dq, dk, dv."""
    from flashtile import flash_attn_qkvpacked_func

    return flash_attn_qkvpacked_func(torch.stack((q, k, v), dim=2), **options)


def _same_seed_row(fn, q, k, v, path, **options) -> Row:
    """Dropout: the same torch.manual_seed gives the same output, bit for bit."""
    results = []
    for _ in range(2):
        torch.manual_seed(1234)
        with torch.no_grad():
            results.append(fn(q, k, v, **options))
    same = torch.equal(*results)
    return Row("reseeded", path, None, None, None, same, "" if same else "the same seed gave another output")


def _cu_seqlens(lengths, device) -> torch.Tensor:
    return torch.tensor([0] + list(lengths), device=device).cumsum(0).to(torch.int32)


def check_varlen(device, dtype, *, lengths_q, lengths_k, nheads, nheads_k, head_dim, backward=True, **options):
    """flash_attn_varlen_func on a packed batch (empty and one-token sequences included), each
    sequence against the reference run on it alone."""
    from flashtile import flash_attn_varlen_func
    from flashtile.reference import attention_varlen_naive

    cu_q, cu_k = _cu_seqlens(lengths_q, device), _cu_seqlens(lengths_k, device)
    layout = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    q = _randn(sum(lengths_q), nheads, head_dim, dtype=dtype, device=device, requires_grad=backward)
    k, v = (_randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, device=device, requires_grad=backward)
            for _ in range(2))
    options = _score_options(nheads, device, **options)
    explanation = _explain(q, k, v, **layout, **_explain_options(options))
    rows = check_call(functools.partial(flash_attn_varlen_func, **layout), q, k, v, backward=backward,
                      reference=functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
                      explanation=explanation, **options)
    return rows, explanation


def _write_expected(pool, table, page_size: int, cache_seqlens, new) -> torch.Tensor:
    """The cache pool after appending ``new`` (batch, seqlen_new, hk, d) at each sequence's
    cache_seqlens, through its pages (a contiguous cache: one page of the whole row per sequence)."""
    expected = pool.clone()
    for b, start in enumerate(cache_seqlens.tolist()):
        for t in range(new.shape[1]):
            position = start + t
            expected[int(table[b, position // page_size]), position % page_size] = new[b, t]
    return expected


def check_kvcache(device, dtype, *, cache_seqlens, seqlen_q, seqlen_new, capacity, nheads, nheads_k, head_dim,
                  page_size=None, **options):
    """flash_attn_with_kvcache: append seqlen_new tokens to a contiguous cache (page_size None) or
    a paged one (a shuffled pool of pages and a block_table), then attend. The cache must hold
    exactly the old tokens and the new ones; each sequence's output is checked against the
    reference over its keys in the cache."""
    from flashtile import flash_attn_with_kvcache
    from flashtile.reference import attention_varlen_naive
    from flashtile.testing import reference_errors

    batch = len(cache_seqlens)
    lengths = torch.tensor(cache_seqlens, dtype=torch.int32, device=device)
    if page_size is None:  # the cache rows of the sequences, in an order of their own
        page_size = capacity
        table = torch.randperm(batch + 1, device=device)[:batch, None].to(torch.int32)
    else:
        per_seq = capacity // page_size
        table = torch.randperm(batch * per_seq + 2, device=device)[:batch * per_seq].view(batch, per_seq)
        table = table.to(torch.int32)
    pages = int(table.max()) + 2  # a page no sequence uses, which must stay untouched
    k_cache, v_cache = (_randn(pages, page_size, nheads_k, head_dim, dtype=dtype, device=device) for _ in range(2))
    k_new, v_new = (_randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype, device=device) for _ in range(2))
    q = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device)
    expected = [_write_expected(cache, table, page_size, lengths, new) for cache, new in ((k_cache, k_new),
                                                                                          (v_cache, v_new))]
    options = _score_options(nheads, device, **options)
    where = dict(block_table=table) if page_size != capacity else dict(cache_batch_idx=table[:, 0].contiguous())
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                           return_softmax_lse=True, **where, **options)

    # The reference: queries and each sequence's keys (read back from the cache) as a packed batch.
    seqlens_k = [n + seqlen_new for n in cache_seqlens]
    cu_q = _cu_seqlens([seqlen_q] * batch, device)
    cu_k = _cu_seqlens(seqlens_k, device)
    k_seqs, v_seqs = (torch.cat([cache[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(seqlens_k)])
                      for cache in (k_cache, v_cache))
    # flash_attn_with_kvcache runs the cache update, then the paged packed forward: explained as
    # that forward (flash_attn_varlen_func with the block table).
    explanation = _explain(q.flatten(0, 1), k_cache, v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           max_seqlen_q=seqlen_q, max_seqlen_k=table.shape[1] * page_size, block_table=table,
                           **_explain_options(options))
    path = explanation.forward.path
    written = torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
    rows = [Row("cache", path, None, None, None, written,
                "" if written else "the cache does not hold exactly the old tokens and the appended ones")]
    errors, ref_lse = reference_errors(q.flatten(0, 1), k_seqs, v_seqs, out.flatten(0, 1),
                                       reference=functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q,
                                                                   cu_seqlens_k=cu_k), **options)
    rows += _error_rows(errors, dtype, path, path)
    rows.append(_lse_row(lse.permute(1, 0, 2).flatten(1), ref_lse, path))  # (b, h, sq) -> (h, b * sq)
    return rows, explanation


# ----------------------------------------------------------------------------------------------
# The cases


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of a run: tiny through the interpreter, larger on a GPU."""

    dtypes: tuple  # the plain and causal cases run in each; the others in the last (compiling costs)
    batch: int
    nheads: int
    head_dim: int
    seqlen: int
    seqlen_k: int  # the unequal key length of the causal and window cases
    dense_head_dims: tuple  # the plain and causal cases' head dims, at ``seqlen`` (the Hopper kernels' sizes)
    odd: tuple  # (seqlen_q, seqlen_k, head_dim)
    varlen: tuple  # (lengths_q, lengths_k)
    cache: tuple  # (cache_seqlens, capacity, page_size)


SIZES = {
    # (on a GPU, quick)
    (False, True): Sizes(dtypes=(torch.float16,), batch=1, nheads=2, head_dim=32, seqlen=37, seqlen_k=61,
                         dense_head_dims=(32,), odd=((1, 1, 40), (1, 45, 32)),
                         varlen=((0, 1, 37, 5), (3, 1, 37, 0)), cache=((5, 0, 31), 48, 16)),
    (False, False): Sizes(dtypes=(torch.float32, torch.float16), batch=2, nheads=2, head_dim=64, seqlen=113,
                          seqlen_k=203, dense_head_dims=(40, 64), odd=((1, 1, 40), (1, 113, 96), (113, 60, 40)),
                          varlen=((0, 1, 37, 64, 5), (3, 1, 37, 50, 0)), cache=((5, 0, 70), 96, 16)),
    (True, True): Sizes(dtypes=(torch.bfloat16,), batch=2, nheads=4, head_dim=128, seqlen=512, seqlen_k=700,
                        dense_head_dims=(128,), odd=((1, 1, 40), (113, 203, 96)),
                        varlen=((0, 1, 113, 512, 64), (5, 1, 113, 512, 0)), cache=((5, 0, 500), 1024, 256)),
    (True, False): Sizes(dtypes=(torch.float16, torch.bfloat16), batch=2, nheads=4, head_dim=128, seqlen=1023,
                         seqlen_k=1500, dense_head_dims=(64, 128, 256),
                         odd=((1, 1, 40), (1, 239, 96), (113, 203, 40), (113, 113, 96), (799, 3, 64)),
                         varlen=((0, 1, 113, 1023, 64, 700), (5, 1, 113, 1023, 0, 899)),
                         cache=((5, 0, 1000, 77), 2048, 256)),
}


def _dense_shape(b, sq, sk, h, hk, d) -> str:
    heads = f"h{h}" if hk == h else f"h{h}/{hk}"
    return f"b{b} s{sq}" + ("" if sk == sq else f"x{sk}") + f" {heads} d{d}"


def make_cases(sizes: Sizes) -> List[Case]:
    """Every case of a run, in the order they run."""
    b, h, d, s, sk = sizes.batch, sizes.nheads, sizes.head_dim, sizes.seqlen, sizes.seqlen_k
    specs = []  # (kind, shape, check, dtypes)

    def dense(kind, sq, skeys, head_dim, heads=h, heads_k=h, dtypes=sizes.dtypes[-1:], **kwargs):
        shape = dict(batch=b, seqlen_q=sq, seqlen_k=skeys, nheads=heads, nheads_k=heads_k, head_dim=head_dim)
        specs.append((kind, _dense_shape(b, sq, skeys, heads, heads_k, head_dim),
                      functools.partial(check_dense, **shape, **kwargs), dtypes))

    dense("fwd", s, s, d, backward=False)
    for head_dim in sizes.dense_head_dims:
        dense("dense", s, s, head_dim, dtypes=sizes.dtypes)
        dense("causal", s, s, head_dim, dtypes=sizes.dtypes, causal=True)
    dense("causal", s, sk, d, causal=True)  # bottom-right aligned, more keys than queries
    dense("window", s, sk, d, window_size=(16, 8))
    dense("window-causal", sk, s, d, causal=True, window_size=(24, -1))
    dense("softcap", s, s, d, softcap=5.0, causal=True)
    dense("alibi", s, sk, d, alibi=True, causal=True)
    dense("gqa", s, s, d, heads=2 * h, heads_k=h, causal=True)
    dense("mqa", s, sk, d, heads_k=1)
    dense("dropout", s, sk, d, dropout_p=0.17, seed_check=True)
    dense("qkvpacked", s, s, d, packed=True, causal=True)
    for sq, skeys, head_dim in sizes.odd:
        dense("odd", sq, skeys, head_dim, causal=sq > 1)
    lengths_q, lengths_k = sizes.varlen
    lengths = f"lens q{'/'.join(map(str, lengths_q))} k{'/'.join(map(str, lengths_k))}"
    for kind, options in (("varlen", {}), ("varlen-causal-gqa", dict(causal=True, nheads_k=h // 2))):
        options = {"nheads_k": h, **options}
        heads = f"h{h}" if options["nheads_k"] == h else f"h{h}/{options['nheads_k']}"
        specs.append((kind, f"{lengths} {heads} d{d}",
                      functools.partial(check_varlen, lengths_q=lengths_q, lengths_k=lengths_k, nheads=h,
                                        head_dim=d, **options), sizes.dtypes[-1:]))
    cache_seqlens, capacity, page_size = sizes.cache
    for kind, seqlen_q, seqlen_new, options in (("kvcache", 1, 1, {}),
                                                ("kvcache-paged", 1, 1, dict(page_size=page_size)),
                                                ("kvcache-paged", 3, 2, dict(page_size=page_size, causal=True))):
        shape = (f"b{len(cache_seqlens)} s{seqlen_q} +{seqlen_new} cache {'/'.join(map(str, cache_seqlens))}"
                 + (f" pages {options['page_size']}" if "page_size" in options else "") + f" h{h}/{h // 2} d{d}")
        specs.append((kind, shape, functools.partial(check_kvcache, cache_seqlens=cache_seqlens, seqlen_q=seqlen_q,
                                                     seqlen_new=seqlen_new, capacity=capacity, nheads=h,
                                                     nheads_k=h // 2, head_dim=d, **options), sizes.dtypes[-1:]))
    return [Case(kind, shape, dtype, check) for kind, shape, check, dtypes in specs for dtype in dtypes]


# ----------------------------------------------------------------------------------------------
# Running and reporting


def run_case(case: Case, device, seed: int) -> dict:
    """Run one case; an exception is a failed row of its own (the run goes on)."""
    torch.manual_seed(seed + zlib.crc32(f"{case.name} {case.dtype}".encode()))
    started = time.perf_counter()
    explanation, error = None, None
    try:
        rows, explanation = case.check(device, case.dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # a kernel that raises is a failure to report, not the end of the run
        error = f"{type(exc).__name__}: {exc}"
        rows = [Row("-", "?", None, None, None, False, error)]
    return dict(case=case.name, kind=case.kind, shape=case.shape, dtype=DTYPE_NAMES[case.dtype], rows=rows,
                explanation=explanation, error=error, seconds=time.perf_counter() - started)


COLUMNS = ("case", "path", "dtype", "tensor", "flashtile", "pytorch", "allowed", "result")


def _number(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2e}"


class Table:
    """Prints the rows as the cases finish."""

    def __init__(self, cases: Sequence[Case], stream):
        self.width = max([len(c.name) for c in cases] + [len("case")])
        self.stream = stream

    def _line(self, cells) -> None:
        case, path, dtype, tensor, ours, theirs, allowed, result = cells
        print(f"{case:<{self.width}}  {path:<8}  {dtype:<5}  {tensor:<8}  {ours:>9}  {theirs:>9}  {allowed:>9}  "
              f"{result}", file=self.stream, flush=True)

    def header(self) -> None:
        self._line(COLUMNS)

    def case(self, result: dict) -> None:
        for i, row in enumerate(result["rows"]):
            note = f"  {row.note}" if row.note and not row.passed else ""
            self._line((result["case"] if i == 0 else "", row.path, result["dtype"], row.tensor, _number(row.error),
                        _number(row.pytorch_error), _number(row.allowed), ("PASS" if row.passed else "FAIL") + note))


def _json_result(result: dict) -> dict:
    from flashtile.env import _explanation_json

    explanation = result["explanation"]
    return dict({name: result[name] for name in ("case", "kind", "shape", "dtype", "error")},
                seconds=round(result["seconds"], 3), passed=all(row.passed for row in result["rows"]),
                explain=None if explanation is None else _explanation_json(explanation),
                rows=[dataclasses.asdict(row) for row in result["rows"]])


# ----------------------------------------------------------------------------------------------
# The command


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(PROG, __doc__)
    parser.add_argument("--quick", action="store_true", help="fewer and smaller cases (tiny on the CPU)")
    parser.add_argument("--cases", type=lambda text: [part for part in text.split(",") if part], default=None,
                        metavar="TEXT[,TEXT...]",
                        help="run only the cases whose name or dtype (as --list prints them) contains one of these")
    parser.add_argument("--device", default=None,
                        help="cuda (the default where there is a GPU) or cpu (through Triton's interpreter, "
                             "TRITON_INTERPRET=1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)")
    parser.add_argument("--seed", type=int, default=0, help="the inputs' random seed (default: %(default)s)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    return parser


@contextlib.contextmanager
def _poisoned_outputs():
    """FLASHTILE_POISON_OUTPUTS=1 while the cases run: an element a kernel does not write is NaN."""
    saved = os.environ.get("FLASHTILE_POISON_OUTPUTS")
    os.environ["FLASHTILE_POISON_OUTPUTS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["FLASHTILE_POISON_OUTPUTS"]
        else:
            os.environ["FLASHTILE_POISON_OUTPUTS"] = saved


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    device, problem = choose_device(args.device)
    if device is not None:
        restart_under_interpreter(device, argv)  # a command line of its own: safe to start it again
        problem = device_problem(device, PROG)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2

    cases = make_cases(SIZES[device.type == "cuda", args.quick])
    if args.cases:
        cases = [case for case in cases
                 if any(text in f"{case.name} {DTYPE_NAMES[case.dtype]}" for text in args.cases)]
        if not cases:
            print(f"{PROG}: no case matches --cases {','.join(args.cases)} (--list shows them)", file=sys.stderr)
            return 2
    if args.list:
        for case in cases:
            print(f"{case.name} {DTYPE_NAMES[case.dtype]}")
        return 0

    report = sys.stderr if args.json == "-" else sys.stdout
    where = ("{} (sm{}{})".format(torch.cuda.get_device_name(device), *torch.cuda.get_device_capability(device))
             if device.type == "cuda" else "CPU, Triton interpreter (TRITON_INTERPRET=1)")
    print(f"flashtile sanity: {len(cases)} cases on {where}{' (quick)' if args.quick else ''}; "
          "errors are ||x - ref|| / ||ref|| against float64, allowed = 2 x PyTorch's + eps", file=report, flush=True)
    table = Table(cases, report)
    table.header()
    started = time.perf_counter()
    results = []
    with _poisoned_outputs():
        for case in cases:
            result = run_case(case, device, args.seed)
            table.case(result)
            results.append(result)
    seconds = time.perf_counter() - started
    failed = [r for r in results if not all(row.passed for row in r["rows"])]
    rows = sum(len(r["rows"]) for r in results)
    if failed:
        names = ", ".join(f"{r['case']} [{r['dtype']}]" for r in failed)
        print(f"FAILED: {len(failed)} of {len(results)} cases ({names}); {seconds:.1f} s", file=report)
    else:
        print(f"all {len(results)} cases passed ({rows} rows) in {seconds:.1f} s", file=report)

    if args.json:
        import triton

        from flashtile import __version__

        versions = dict(flashtile=__version__, torch=torch.__version__, triton=triton.__version__)
        document = dict(device=str(device), where=where, versions=versions, quick=args.quick, seed=args.seed,
                        seconds=round(seconds, 3), passed=not failed, cases=[_json_result(r) for r in results])
        text = json.dumps(document, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
