"""``python -m flashtile debug``: the online softmax tile by tile, reference beside kernel.

For one small case it walks the keys in tiles of ``--block-n`` and shows, after each tile, the state
FlashAttention keeps per query row: the running max ``m``, the running sum ``l`` (relative to ``m``),
``lse = m + log l`` and the normalised partial output ``O = acc / l``. The reference computes that
state in float64 by the online-softmax recurrence; the kernel side is the real public kernel
(``flashtile.flash_attn_func``) run on the first n keys only, whose ``out`` and ``softmax_lse`` are
exactly what its state after those tiles normalises to. The kernel's own max is not observable from
outside, so its ``l`` is shown at the reference's max: ``exp(lse - m)``. The walk stops at the
first tile where the kernel leaves the tolerance, naming the tile, the row and the quantity.

Masks on the first n keys: flash_attn aligns the causal/window diagonal to the bottom-right corner,
so cutting keys would move it. The kernel calls get the window translated so that every row sees
exactly the keys it sees in the full call (causal is the window's right edge 0); rows whose window
starts past key n see nothing yet and are left out of the call (lse -inf, O 0, as the kernel gives).

On a GPU the kernels run compiled (fp16 or bf16); without one they run through Triton's CPU
interpreter (TRITON_INTERPRET=1; fp16 or fp32). Exit status: 0 if every tile agrees, 1 at a
divergence, 2 for bad arguments.

    python -m flashtile debug --causal --seqlen-q 5 --seqlen-k 37 --block-n 16
    python -m flashtile debug --window 8,0 --seed 3 --rows 0,4 --out dumps/   # then: diff dumps/*.txt
    python -m flashtile debug --inject 1      # perturb the kernel from tile 1 on: the tool stops there
"""

import argparse
import dataclasses
import math
import os
import sys
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..reference import attention_scores, online_softmax_result, online_softmax_step
from .common import choose_device, command_parser, device_problem, restart_under_interpreter

PROG = "python -m flashtile debug"

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
LSE_ATOL = 1e-3  # lse's tolerance under FlashAttention's rule, as flashtile.testing.check_lse uses it


@dataclasses.dataclass
class TileState:
    """One side's state after key tile ``tile``, which holds keys [start, stop): the first ``stop``
    keys have been seen. ``m``, ``l``, ``lse``: (batch, heads, seqlen_q) float64, ``out``
    (batch, heads, seqlen_q, head_dim) float64. The kernel's ``m`` is None (not observable) and its
    ``l`` is taken at the reference's max; ``path`` and ``call`` say how the kernel was called
    (``rows``: the query rows it was called on, the others see no key yet)."""

    tile: int
    start: int
    stop: int
    m: Optional[torch.Tensor]
    l: Optional[torch.Tensor]
    lse: torch.Tensor
    out: torch.Tensor
    path: str = "reference"
    call: str = ""
    rows: int = 0


@dataclasses.dataclass
class TileCheck:
    """Kernel against reference at one tile. ``out_error``/``out_allowed``: relative errors of O
    (FlashAttention's rule), or the worst ratio |diff| / (atol + rtol |ref|) against 1 with
    --atol/--rtol. ``where`` (b, h, row) and ``quantity`` name the worst element when not ``ok``."""

    tile: int
    ok: bool
    out_error: float
    out_allowed: float
    lse_diff: float
    where: Optional[Tuple[int, int, int]] = None
    quantity: str = ""
    reference: float = 0.0
    kernel: float = 0.0
    reason: str = ""


# ----------------------------------------------------------------------------------------------
# Masks on a prefix of the keys


def _edges(causal: bool, window_size) -> Tuple[int, int]:
    left, right = (int(x) for x in window_size)
    return left, (0 if causal else right)


def prefix_call(seqlen_q: int, seqlen_k: int, n: int, causal: bool = False,
                window_size=(-1, -1)) -> Tuple[int, Tuple[int, int]]:
    """How to call flash_attn on the first ``n`` keys so each query row sees the keys it sees in
    the full (seqlen_q, seqlen_k) call: ``(rows, window)``, run on query rows [0, rows).

    Row i's diagonal sits at key i + seqlen_k - seqlen_q in the full call and at
    i + n - rows in the cut one: the difference ``delta`` widens the right edge and narrows the
    left one. A left edge cannot go right of the diagonal (-1 is "unbounded"), so the call keeps
    only rows whose window starts within the first n keys; rows from ``rows`` on see none yet."""
    left, right = _edges(causal, window_size)
    rows = seqlen_q if left < 0 else max(0, min(seqlen_q, left + n + seqlen_q - seqlen_k))
    delta = seqlen_k - n - (seqlen_q - rows)
    return rows, (left - delta if left >= 0 else -1, right + delta if right >= 0 else -1)


# ----------------------------------------------------------------------------------------------
# The two sides


def _tiles(seqlen_k: int, block_n: int) -> List[Tuple[int, int]]:
    return [(n0, min(n0 + block_n, seqlen_k)) for n0 in range(0, seqlen_k, block_n)]


def _visible(q, k, causal, window_size) -> torch.Tensor:
    from flashtile.reference import visible_keys_mask

    return visible_keys_mask(q.shape[1], k.shape[1], window_size, causal, device=q.device)


def reference_states(q, k, v, *, block_n: int, softmax_scale=None, causal=False, window_size=(-1, -1),
                     softcap=0.0) -> Iterator[TileState]:
    """The online softmax in float64, one key tile at a time, with the state after each tile.

    The recurrence itself (not softmax over a prefix), so its m and l are the ones a kernel
    keeps; tiles a row cannot see leave its state as it was."""
    s_all = attention_scores(q, k, softmax_scale, softcap, dtype=torch.float64)
    s_all = s_all.masked_fill(~_visible(q, k, causal, window_size), float("-inf"))
    v64 = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2).to(torch.float64)
    m = torch.full(s_all.shape[:-1], float("-inf"), dtype=torch.float64, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(*m.shape, q.shape[-1], dtype=torch.float64, device=q.device)
    for tile, (n0, n1) in enumerate(_tiles(k.shape[1], block_n)):
        m, l, acc = online_softmax_step(m, l, acc, s_all[..., n0:n1], v64[:, n0:n1])
        out, lse = online_softmax_result(m, l, acc)
        yield TileState(tile, n0, n1, m.clone(), l.clone(), lse, out, rows=q.shape[1])


def _forward_path(q, k, v, **options) -> str:
    """flashtile.explain's forward path for a call ("?" if it cannot say)."""
    from flashtile import explain

    try:
        return explain(q, k, v, **options).forward.path
    except Exception:  # a refactor of the explanation must not stop the debugging
        return "?"


def kernel_states(q, k, v, *, block_n: int, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  kernel: Optional[Callable] = None) -> Iterator[TileState]:
    """The kernel's state after each key tile: ``kernel`` (default flashtile.flash_attn_func, looked
    up at each call so a patched one is used) on the first n keys, masks translated by
    :func:`prefix_call`. Lazy: a walk that stops early runs no more kernels. ``l`` is None until
    :func:`at_reference_max` expresses it at the reference's max."""
    import flashtile

    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    full = _edges(causal, window_size)
    for tile, (n0, n1) in enumerate(_tiles(seqlen_k, block_n)):
        rows, window = prefix_call(seqlen_q, seqlen_k, n1, causal, window_size)
        # The full call (the last tile's delta is 0) keeps its own flags: the very call a user makes.
        options = (dict(causal=causal, window_size=tuple(window_size)) if window == full and rows == seqlen_q
                   else dict(causal=False, window_size=window))
        options.update(softmax_scale=softmax_scale, softcap=softcap)
        lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float64, device=q.device)
        out = torch.zeros(batch, nheads, seqlen_q, head_dim, dtype=torch.float64, device=q.device)
        path = "-"
        if rows > 0:
            fn = kernel or flashtile.flash_attn_func
            qs, ks, vs = q[:, :rows], k[:, :n1], v[:, :n1]
            with torch.no_grad():
                o, s_lse, _ = fn(qs, ks, vs, return_attn_probs=True, **options)
            out[:, :, :rows] = o.transpose(1, 2).to(torch.float64)
            lse[:, :, :rows] = s_lse.to(torch.float64)
            path = _forward_path(qs, ks, vs, **options)
        if rows == 0:
            call = "not run: no row sees these keys yet"
        elif options["causal"] or options["window_size"] != (-1, -1):
            call = "causal" * options["causal"] + (" window {}".format(options["window_size"])
                                                   if options["window_size"] != (-1, -1) else "")
        else:
            call = "no mask"
        yield TileState(tile, n0, n1, None, None, lse, out, path, call.strip(), rows)


def at_reference_max(kernel: TileState, reference: TileState) -> TileState:
    """The kernel's l at the reference's running max, exp(lse - m): the kernel's sum rescaled to
    the same max (l exp(m) is the same whatever the max), so the two l's compare directly."""
    m = reference.m.masked_fill(torch.isneginf(reference.m), 0.0)
    return dataclasses.replace(kernel, l=torch.exp(kernel.lse - m))


def tile_states(q, k, v, *, block_n: int = 16, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, kernel: Optional[Callable] = None) -> Tuple[List[TileState], List[TileState]]:
    """Both sides' state after every key tile: ``(reference, kernel)``, lists of :class:`TileState`
    (q, k, v as for flash_attn_func; on the CPU through Triton's interpreter)."""
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    reference = list(reference_states(q, k, v, block_n=block_n, **options))
    kernel_side = [at_reference_max(state, ref)
                   for state, ref in zip(kernel_states(q, k, v, block_n=block_n, kernel=kernel, **options), reference)]
    return reference, kernel_side


# ----------------------------------------------------------------------------------------------
# Comparing


def pytorch_outputs(q, k, v, *, block_n: int, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0) -> List[torch.Tensor]:
    """Plain PyTorch in the input dtype over the first n keys of each tile, (b, h, sq, d): its
    error against float64 is the yardstick of FlashAttention's rule."""
    s_all = attention_scores(q, k, softmax_scale, softcap, dtype=q.dtype)
    s_all = s_all.masked_fill(~_visible(q, k, causal, window_size), float("-inf"))
    v_full = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    outs = []
    for _, n1 in _tiles(k.shape[1], block_n):
        p = torch.softmax(s_all[..., :n1], dim=-1).nan_to_num(0.0)
        outs.append(torch.einsum("bhqk,bkhd->bhqd", p, v_full[:, :n1]))
    return outs


def check_tile(reference: TileState, kernel: TileState, dtype: torch.dtype, pytorch_out: Optional[torch.Tensor] = None,
               atol: Optional[float] = None, rtol: Optional[float] = None) -> TileCheck:
    """Does the kernel's tile agree with the reference's? Rows with no visible key must be empty
    on both sides (lse -inf, O 0). Then, with ``atol``/``rtol``: every element of lse and O within
    atol + rtol |ref|; otherwise FlashAttention's rule: O's relative error at most twice
    ``pytorch_out``'s plus flashtile.testing.EPSILON, lse within 1e-3 (1 + |lse|)."""
    from flashtile.testing import allowed_error, rel_error

    def worst(scaled, quantity, ref, ker, reason):
        index = tuple(int(i) for i in torch.nonzero(scaled == scaled.max())[0])
        b, h, row = index[:3]
        name = quantity if len(index) == 3 else f"{quantity}[{index[3]}]"
        return dict(where=(b, h, row), quantity=name, reference=float(ref[index]), kernel=float(ker[index]),
                    reason=reason)

    ref_lse, ker_lse = reference.lse, kernel.lse
    finite = ~torch.isneginf(ref_lse)
    lse_diff = (ker_lse - ref_lse).abs().masked_fill(~finite, 0.0)
    lse_diff_max = float(lse_diff.max()) if lse_diff.numel() else 0.0
    out_diff = (kernel.out - reference.out).abs()
    summary = dict(tile=reference.tile, lse_diff=lse_diff_max)

    bad = torch.isnan(ker_lse) | torch.isnan(kernel.out).any(dim=-1) | (torch.isneginf(ker_lse) != ~finite)
    if bad.any():
        b, h, row = (int(i) for i in torch.nonzero(bad)[0])
        got, want = float(ker_lse[b, h, row]), float(ref_lse[b, h, row])
        quantity, reason = "lse", "the kernel's and the reference's rows with no visible key differ"
        if math.isnan(got):
            reason = "NaN in the kernel's lse"
        elif torch.isnan(kernel.out[b, h, row]).any():
            column = int(torch.nonzero(torch.isnan(kernel.out[b, h, row]))[0])
            quantity, reason = f"O[{column}]", "NaN in the kernel's O"
            got, want = math.nan, float(reference.out[b, h, row, column])
        return TileCheck(ok=False, out_error=math.inf, out_allowed=0.0, where=(b, h, row), quantity=quantity,
                         reference=want, kernel=got, reason=reason, **summary)

    if atol is not None or rtol is not None:
        atol, rtol = atol or 0.0, rtol or 0.0
        tol_out = atol + rtol * reference.out.abs()
        tol_lse = atol + rtol * ref_lse.abs().masked_fill(~finite, 0.0)
        ratio_out = out_diff / tol_out.clamp_min(1e-300)
        ratio_lse = lse_diff / tol_lse.clamp_min(1e-300)
        out_ratio = float(ratio_out.max()) if ratio_out.numel() else 0.0
        lse_ratio = float(ratio_lse.max()) if ratio_lse.numel() else 0.0
        result = TileCheck(ok=out_ratio <= 1.0 and lse_ratio <= 1.0, out_error=out_ratio, out_allowed=1.0,
                           **summary)
        if not result.ok:
            if lse_ratio > out_ratio:
                found = worst(ratio_lse, "lse", ref_lse, ker_lse, "lse beyond atol + rtol |ref|")
            else:
                found = worst(ratio_out, "O", reference.out, kernel.out, "O beyond atol + rtol |ref|")
            result = dataclasses.replace(result, **found)
        return result

    out_error = rel_error(kernel.out, reference.out)
    base = rel_error(pytorch_out, reference.out) if pytorch_out is not None else 0.0
    allowed = allowed_error(base, dtype)
    lse_excess = lse_diff / (LSE_ATOL * (1.0 + ref_lse.abs().masked_fill(~finite, 0.0)))
    result = TileCheck(ok=out_error <= allowed and bool((lse_excess <= 1.0).all()), out_error=out_error,
                       out_allowed=allowed, **summary)
    if not result.ok:
        if out_error > allowed:
            found = worst(out_diff, "O", reference.out, kernel.out,
                          f"O's error {out_error:.2e} exceeds the allowed {allowed:.2e} "
                          f"(2 x PyTorch {DTYPE_NAMES.get(dtype, dtype)}'s {base:.2e} + eps)")
        else:
            found = worst(lse_excess, "lse", ref_lse, ker_lse, f"lse off by more than {LSE_ATOL} (1 + |lse|)")
        result = dataclasses.replace(result, **found)
    return result


# ----------------------------------------------------------------------------------------------
# Printing


def _num(x: float, digits: int, fixed: bool = False) -> str:
    """``digits`` significant digits, or with ``fixed`` as many decimals (O: values near 0 then
    print as 0.000 on both sides, not as rounding noise in the last digit of a tiny number)."""
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.{digits}f}" if fixed else f"{x:.{digits}g}"


def row_line(state: TileState, reference: TileState, b: int, h: int, row: int, cols: int, digits: int,
             kernel_m: str = "") -> str:
    """One query row's state: m, l, lse and the first ``cols`` values of O. A kernel state shows the
    reference's m (``kernel_m`` replaces it: its own is not observable), so l is comparable."""
    width = digits + 5
    m = kernel_m if kernel_m and state.m is None else _num(float(reference.m[b, h, row]), digits)
    values = " ".join(f"{_num(float(x), digits, fixed=True):>{width}}" for x in state.out[b, h, row, :cols])
    return (f"b{b} h{h} q{row:<3} m {m:>{width}}  l {_num(float(state.l[b, h, row]), digits):>{width}}  "
            f"lse {_num(float(state.lse[b, h, row]), digits):>{width}}  O {values}")


def tile_header(state: TileState) -> str:
    return f"tile {state.tile}  keys [{state.start}, {state.stop})"


def dump(states: Sequence[TileState], references: Sequence[TileState], rows, title: str, case: str, cols: int,
         digits: int) -> str:
    """A text dump with the same layout for either side: ``diff reference.txt kernel.txt`` shows
    the lines where they differ at ``digits`` significant digits."""
    lines = [f"# flashtile debug, {title}", f"# {case}",
             "# per row: m (the reference's running max; the kernel's is not observable), l = exp(lse - m), "
             f"lse, O[:{cols}]"]
    for state, reference in zip(states, references):
        lines.append(tile_header(state))
        lines += ["  " + row_line(state, reference, b, h, row, cols, digits) for b, h, row in rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# The command


def make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, device, init="range", seed=0):
    """q, k, v: ``range`` fills them from arange patterns in [-1, 1] (multiples of 1/8, exact in
    any dtype, the same everywhere); ``randn`` draws them with ``seed`` on the CPU, then moves them."""
    shapes = ((batch, seqlen_q, nheads, head_dim), (batch, seqlen_k, nheads_k, head_dim),
              (batch, seqlen_k, nheads_k, head_dim))
    if init == "range":
        tensors = [((torch.arange(math.prod(shape)) * step + offset) % 17 - 8).reshape(shape) / 8.0
                   for shape, step, offset in zip(shapes, (5, 7, 3), (0, 4, 11))]
    else:
        generator = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(shape, generator=generator) for shape in shapes]
    return tuple(t.to(dtype=dtype, device=device) for t in tensors)


def _pair(text: str) -> Tuple[int, int]:
    try:
        left, right = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two ints LEFT,RIGHT (-1: unbounded), got {text!r}") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"window edges are >= 0, or -1 for unbounded; got {text!r}")
    return left, right


def _ints(text: str) -> List[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(PROG, __doc__)
    shape = parser.add_argument_group("the case (defaults: small; larger on a GPU)")
    shape.add_argument("--batch", type=int, default=1)
    shape.add_argument("--heads", type=int, default=2)
    shape.add_argument("--heads-k", type=int, default=None, help="key/value heads (GQA; default: --heads)")
    shape.add_argument("--seqlen-q", type=int, default=None, help="default 16 (GPU: 128)")
    shape.add_argument("--seqlen-k", type=int, default=None, help="default 77 (GPU: 300)")
    shape.add_argument("--head-dim", type=int, default=None, help="default 16 (GPU: 64)")
    shape.add_argument("--dtype", choices=DTYPES, default="fp16", help="bf16 only on a GPU (default: %(default)s)")
    shape.add_argument("--causal", action="store_true")
    shape.add_argument("--window", type=_pair, default=(-1, -1), metavar="LEFT,RIGHT")
    shape.add_argument("--softcap", type=float, default=0.0)
    shape.add_argument("--softmax-scale", type=float, default=None, help="default 1/sqrt(head dim)")
    shape.add_argument("--init", choices=("range", "randn"), default=None,
                       help="range: deterministic arange patterns (the default); randn: seeded normal draws "
                            "(the default when --seed is given)")
    shape.add_argument("--seed", type=int, default=None)
    shape.add_argument("--device", default=None,
                       help="cuda (the default where there is a GPU) or cpu (Triton's interpreter)")
    walk = parser.add_argument_group("the walk and the report")
    walk.add_argument("--block-n", type=int, default=None,
                      help="keys per tile (default: the kernel's own block_n, as flashtile.explain reports it)")
    walk.add_argument("--rows", type=_ints, default=None, metavar="I[,I...]",
                      help="query rows to print, for every batch and head; negative counts from the end "
                           "(default: first, middle, last)")
    walk.add_argument("--cols", type=int, default=4, help="values of O to print per row (default: %(default)s)")
    walk.add_argument("--digits", type=int, default=None,
                      help="significant digits of m, l, lse and decimals of O printed "
                           "(default 3 for fp16/bf16, 6 for fp32)")
    walk.add_argument("--atol", type=float, default=None,
                      help="elementwise tolerance on O and lse (with --rtol); default: FlashAttention's rule")
    walk.add_argument("--rtol", type=float, default=None)
    walk.add_argument("--all", action="store_true", help="print every tile's rows, not only the failing one's")
    walk.add_argument("--out", metavar="DIR", help="write reference.txt and kernel.txt there, to diff")
    walk.add_argument("--inject", type=int, default=None, metavar="TILE",
                      help="self-test: perturb the kernel's O from this tile on (the walk should stop there)")
    return parser


def _problem(args, device: torch.device) -> Optional[str]:
    """Why these arguments cannot run here, or None."""
    problem = device_problem(device, PROG)
    if problem is not None:
        return problem
    if device.type == "cpu" and args.dtype == "bf16":
        return "--dtype bf16 does not work in Triton's CPU interpreter: use fp16 or fp32 there (or a GPU)"
    for name in ("batch", "heads", "heads_k", "seqlen_q", "seqlen_k", "head_dim", "block_n", "cols", "digits"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.heads % args.heads_k:
        return f"--heads {args.heads} is not a multiple of --heads-k {args.heads_k} (GQA groups query heads)"
    if args.softcap < 0:
        return f"--softcap must be >= 0 (0: off), got {args.softcap}"
    if (args.atol is not None and args.atol < 0) or (args.rtol is not None and args.rtol < 0):
        return "--atol and --rtol must be >= 0"
    for row in args.rows:
        if not -args.seqlen_q <= row < args.seqlen_q:
            return f"--rows: row {row} is outside the {args.seqlen_q} query rows"
    return None


def _injected(tile_from: int, block_n: int) -> Callable:
    """flash_attn_func, with O of the first row perturbed once the call sees keys past tile
    ``tile_from``: what a kernel bug in that tile would look like from outside."""
    import flashtile

    def call(q, k, v, **options):
        out, lse, probs = flashtile.flash_attn_func(q, k, v, **options)
        if k.shape[1] > tile_from * block_n:
            out = out.clone()
            out[:, 0, :, 0] += 0.25
        return out, lse, probs

    return call


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    device, problem = choose_device(args.device)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    restart_under_interpreter(device, argv)
    gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    for name, default in (("heads_k", args.heads), ("seqlen_q", 128 if gpu else 16), ("seqlen_k", 300 if gpu else 77),
                          ("head_dim", 64 if gpu else 16), ("digits", 6 if dtype == torch.float32 else 3)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.rows = args.rows if args.rows is not None else sorted({0, args.seqlen_q // 2, args.seqlen_q - 1})
    problem = _problem(args, device)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    init = args.init or ("randn" if args.seed is not None else "range")
    q, k, v = make_inputs(args.batch, args.seqlen_q, args.seqlen_k, args.heads, args.heads_k, args.head_dim, dtype,
                          device, init, args.seed or 0)
    options = dict(softmax_scale=args.softmax_scale, causal=args.causal, window_size=args.window,
                   softcap=args.softcap)

    import flashtile

    try:  # the full call's checks, as flash_attn_func makes them, before any kernel runs
        explanation = flashtile.explain(q, k, v, **options)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"{PROG}: flash_attn_func would refuse this case: {exc}", file=sys.stderr)
        return 2
    forward = explanation.forward
    if args.block_n is None:
        args.block_n = getattr(forward.config, "block_n", None) or (64 if gpu else 16)
    block_n = args.block_n
    tiles = _tiles(args.seqlen_k, block_n)
    if args.inject is not None and not 0 <= args.inject < len(tiles):
        print(f"{PROG}: --inject {args.inject}: the case has tiles 0 to {len(tiles) - 1}", file=sys.stderr)
        return 2

    heads = f"h{args.heads}" + (f"/{args.heads_k}" if args.heads_k != args.heads else "")
    masks = " causal" * args.causal + (f" window {args.window[0]},{args.window[1]}" if args.window != (-1, -1) else "")
    masks += f" softcap {args.softcap:g}" if args.softcap else ""
    case = (f"b{args.batch} sq{args.seqlen_q} sk{args.seqlen_k} {heads} d{args.head_dim} {args.dtype}{masks}, "
            f"init {init}" + (f" seed {args.seed or 0}" if init == "randn" else "")
            + f"; {len(tiles)} tiles of {block_n} keys")
    rule = (f"|diff| <= {args.atol or 0:g} + {args.rtol or 0:g} |ref| on O and lse"
            if args.atol is not None or args.rtol is not None else
            f"O within 2 x PyTorch {args.dtype}'s error + eps (relative), lse within {LSE_ATOL:g} (1 + |lse|)")
    print(f"flashtile debug: {case}")
    print(f"kernel: {forward.path} ({forward.kernel}) on {explanation.device}: {forward.reason}")
    print("  each tile runs it on the first n keys (masks translated to keep each row's keys); "
          "m is the reference's (the kernel's own is not observable), l = exp(lse - m)")
    print(f"tolerance: {rule}")
    if args.inject is not None:
        print(f"injected: the kernel's O[b, 0, h, 0] += 0.25 from tile {args.inject} on")

    rows = sorted({row % args.seqlen_q for row in args.rows})
    printed = [(b, h, row) for b in range(args.batch) for h in range(args.heads) for row in rows]
    baseline = pytorch_outputs(q, k, v, block_n=block_n, **options) if args.atol is None and args.rtol is None else None
    kernel = _injected(args.inject, block_n) if args.inject is not None else None
    references, kernels, failure = [], [], None
    walk = zip(reference_states(q, k, v, block_n=block_n, **options),
               kernel_states(q, k, v, block_n=block_n, kernel=kernel, **options))
    for reference, state in walk:  # lazily: the kernels after a divergence do not run
        state = at_reference_max(state, reference)
        references.append(reference)
        kernels.append(state)
        check = check_tile(reference, state, dtype, None if baseline is None else baseline[reference.tile],
                           args.atol, args.rtol)
        _print_tile(reference, state, check, printed, args, verbose=args.all or not check.ok)
        if not check.ok:
            failure = check
            break

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        dumped = sorted(set(printed) | ({failure.where} if failure else set()))
        for name, states, title in (("reference.txt", references, "reference (float64 online softmax)"),
                                    ("kernel.txt", kernels, "kernel (flash_attn_func on the first n keys)")):
            with open(os.path.join(args.out, name), "w") as f:
                f.write(dump(states, references, dumped, title, case, args.cols, args.digits))
        print(f"dumps: {os.path.join(args.out, 'reference.txt')} and {os.path.join(args.out, 'kernel.txt')} "
              f"(diff them)")
    if failure is not None:
        b, h, row = failure.where
        print(f"STOP at tile {failure.tile} (keys [{references[-1].start}, {references[-1].stop})): b{b} h{h} q{row} "
              f"{failure.quantity}: kernel {failure.kernel:.6g}, reference {failure.reference:.6g}; {failure.reason}")
        return 1
    print(f"all {len(tiles)} tiles agree" if len(tiles) > 1 else "the one tile agrees")
    return 0


def _print_tile(reference: TileState, kernel: TileState, check: TileCheck, printed, args, verbose: bool) -> None:
    status = "ok" if check.ok else "DIVERGES"
    error = (f"O err {check.out_error:.2e} (allowed {check.out_allowed:.2e})" if args.atol is None and args.rtol is None
             else f"worst |diff|/tol {check.out_error:.2g}")
    cut = f", rows q<{kernel.rows}" if 0 < kernel.rows < args.seqlen_q else ""
    print(f"{tile_header(reference)}  {kernel.path} ({kernel.call}{cut})  {error}  lse |diff| {check.lse_diff:.1e}  "
          f"{status}")
    if not verbose:
        return
    rows = list(printed) + ([check.where] if check.where and check.where not in printed else [])
    for b, h, row in rows:
        print("  ref " + row_line(reference, reference, b, h, row, args.cols, args.digits))
        print("  ker " + row_line(kernel, reference, b, h, row, args.cols, args.digits, kernel_m="-"))


if __name__ == "__main__":
    sys.exit(main())
