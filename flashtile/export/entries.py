"""What an export holds: one entry per (direction, dtype, head dim, causal, layout, key-length range)
the sm90 config tables distinguish, each with the kernel launches its plan makes.

An entry's launches are captured from the real host plans on meta tensors (tools/catalog.py), which
gives what each kernel compiles with (constexprs, launch options); bindings.py gives how the C
library computes their runtime arguments. The C library picks an entry the way the Python dispatcher
picks a config: the first entry whose key-length range holds the call's (longest) key length.
"""

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch

from itertools import product

from ..configs import BWD_DKDV, BWD_DQ, BWD_GLUON, BWD_PREPROCESS, FWD, FWD_DECODE, FWD_GLUON, table_config
from ..options import PackedSeqs, ScoreParams
from . import bindings

ARCH = "sm90"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
FEATURES = ("forward", "backward", "varlen", "kvcache", "window", "softcap", "alibi")
PAGE_SIZES = (256,)  # the kv cache's default page sizes (flash_attn 2.x pages: multiples of 256)
# The score options a portable entry is built for (its constexpr flags), as the C library names them.
OPTIONS = ("left", "right", "softcap", "alibi")
UNBOUNDED = 2**62


@dataclass
class Entry:
    direction: str            # "forward" / "backward"
    dtype: str                # "fp16" / "bf16"
    head_dim: int
    causal: bool
    varlen: bool
    min_seqlen_k: int
    max_seqlen_k: int         # exclusive
    config: object
    bindings: List[bindings.Binding]
    launches: list            # the captured tools.catalog.Launch of each binding, in order
    needs_counts: bool = False
    options: frozenset = frozenset()  # portable entries: the score options (OPTIONS) compiled in
    decode: int = -1          # packed portable forwards: 1 for at most configs.DECODE_MAX_ROWS query rows, 0 above
    portable: bool = False
    page_size: int = 0        # kv-cache forwards: the cache's page size (a constexpr of the kernel)
    split: bool = False       # kv-cache forwards: split-KV (partial results, then the combine)

    @property
    def hinted(self) -> bool:
        """Whether strides compile with the divisibility hint (head dims that are multiples of 16: the C
        library then checks strides to be multiples of 16)."""
        return self.head_dim % 16 == 0

    @property
    def name(self) -> str:
        layout = "varlen" if self.varlen else "dense"
        if self.decode == 1:
            layout += "-decode"
        mask = "causal" if self.causal else "full"
        if self.options - {"right"} or ("right" in self.options and not self.causal):
            mask = "+".join(o for o in OPTIONS if o in self.options) + ("-causal" if self.causal else "")
        top = "inf" if self.max_seqlen_k >= UNBOUNDED else self.max_seqlen_k
        if self.direction == "kvcache_update":
            return f"kvcache_update_{self.dtype}_d{self.head_dim}"
        if self.direction == "kvcache":
            rows = "decode" if self.decode == 1 else "rows"
            return f"kvcache_{self.dtype}_d{self.head_dim}_{mask}_page{self.page_size}_{rows}{'_split' * self.split}"
        kind = "portable_" if self.portable else ""
        return f"{self.direction}_{kind}{self.dtype}_d{self.head_dim}_{mask}_{layout}_k{self.min_seqlen_k}-{top}"


def _ranges(kernel: str, head_dim: int, causal: bool, dtype, varlen: bool) -> List[Tuple[int, int, object]]:
    """[(min_seqlen_k, max_seqlen_k, config)]: the table's choice over key lengths, as ranges."""
    from ..configs import _TUNED

    bounds = {1, UNBOUNDED}
    for rule in _TUNED[ARCH][kernel]:
        bounds.update(b for b in (rule.min_seqlen_k, rule.max_seqlen_k) if 0 < b < UNBOUNDED)
    edges = sorted(bounds)
    ranges: List[Tuple[int, int, object]] = []
    for lo, hi in zip(edges, edges[1:]):
        cfg = table_config(kernel, ARCH, head_dim, causal, lo, dtype, varlen)
        if ranges and ranges[-1][2] == cfg:
            ranges[-1] = (ranges[-1][0], hi, cfg)
        else:
            ranges.append((lo, hi, cfg))
    return ranges


def _meta(*shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def sample_call(head_dim: int, dtype, varlen: bool, seqlen: int = 1024, nheads: int = 4, nheads_k: int = 2):
    """Meta tensors of one call (GQA), dense or packed (two sequences): q, k, v, out, lse, dout, dq, dk,
    dv, seqs. Each tensor gets its own size (bindings.check_binding tells them apart by it)."""
    batch, rows_q, rows_k = (1, 2 * seqlen - 24, 2 * seqlen) if varlen else (2, seqlen - 24, seqlen)
    q = _meta(batch, rows_q, nheads, head_dim, dtype=dtype)
    k, v = _meta(batch, rows_k, nheads_k, head_dim, dtype=dtype), _meta(batch, rows_k + 1, nheads_k, head_dim,
                                                                        dtype=dtype)[:, :rows_k]
    out, dout, dq = (_meta(batch, rows_q + i, nheads, head_dim, dtype=dtype)[:, :rows_q] for i in (1, 2, 3))
    dk, dv = (_meta(batch, rows_k + i, nheads_k, head_dim, dtype=dtype)[:, :rows_k] for i in (2, 3))
    lse = _meta(batch, nheads, rows_q, dtype=torch.float32)
    seqs = None
    if varlen:
        cu_q = torch.tensor([0, seqlen - 24, rows_q], dtype=torch.int32, device="meta")
        cu_k = torch.tensor([0, seqlen, rows_k, 0], dtype=torch.int32, device="meta")[:3]
        seqs = PackedSeqs(cu_q, cu_k, seqlen, seqlen)
    return q, k, v, out, lse, dout, dq, dk, dv, seqs


def score_params(options, causal: bool, nheads: int = 4) -> ScoreParams:
    """Sample score options of an entry: the windows' sides 32 / 16 keys, softcap 30, ALiBi slopes."""
    right = 0 if causal else (16 if "right" in options else -1)
    alibi = torch.empty(nheads, dtype=torch.float32, device="meta") if "alibi" in options else None
    return ScoreParams(softmax_scale=0.125, window_left=32 if "left" in options else -1, window_right=right,
                       softcap=30.0 if "softcap" in options else 0.0, alibi_slopes=alibi)


def capture_portable(direction: str, cfgs, params: ScoreParams, call) -> list:
    """The launches of the portable forward (cfgs: its config) or backward ((preprocess, dK/dV, dQ))."""
    from ..tools import catalog

    q, k, v, out, lse, dout, dq, dk, dv, seqs = call
    if direction == "forward":
        return catalog.portable_forward(q, k, v, out, lse, params, cfgs, seqs)
    return catalog.portable_backward(q, k, v, out, dout, lse, dq, dk, dv, params, *cfgs, seqs)


def capture(direction: str, cfg, causal: bool, call) -> list:
    """The launches the plan of ``direction`` makes for ``call`` (sample_call's tuple) with ``cfg``."""
    from ..tools import catalog

    q, k, v, out, lse, dout, dq, dk, dv, seqs = call
    params = ScoreParams(softmax_scale=0.125, window_right=0 if causal else -1)
    if direction == "forward":
        return catalog.gluon_forward(q, k, v, out, lse, params, cfg, seqs)
    pre = table_config(BWD_PREPROCESS, ARCH, q.shape[-1], causal, k.shape[1], q.dtype)
    return catalog.gluon_backward(q, k, v, out, dout, lse, dq, dk, dv, params, cfg, pre, seqs)


def entry_bindings(direction: str, cfg, causal: bool, varlen: bool, head_dim: int, dtype) -> List[bindings.Binding]:
    if direction == "forward":
        return [bindings.gluon_forward(cfg, causal, varlen)]
    pre = table_config(BWD_PREPROCESS, ARCH, head_dim, causal, 4096, dtype)
    counts = bindings.backward_needs_counts(cfg, head_dim, varlen)
    return [bindings.bwd_preprocess(pre.block_m, counts, varlen), bindings.gluon_backward(cfg, causal, varlen, head_dim),
            bindings.dq_convert(cfg, varlen, head_dim)]


def entries(head_dims: Sequence[int], dtypes: Sequence[str], features: Sequence[str],
            page_sizes: Sequence[int] = PAGE_SIZES) -> List[Entry]:
    """Every entry of an export of these head dims, dtypes ("fp16", "bf16") and features (the kv
    cache's for these page sizes)."""
    from ..kernels.hopper.tma import HEAD_DIMS

    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"--features: unknown {sorted(unknown)}; expected some of {', '.join(FEATURES)}")
    bad = [d for d in head_dims if not 1 <= d <= 256]
    if bad:
        raise ValueError(f"--head-dims: {bad}; flashtile takes head dims 1 to 256")
    bad = [p for p in page_sizes if not 1 <= p <= 2**20]
    if "kvcache" in features and (bad or not page_sizes):
        raise ValueError(f"--page-sizes: {list(page_sizes)}; expected one or more page sizes of 1 to {2**20} rows")
    directions = [d for d in ("forward", "backward") if d in features]
    layouts = [False] + ([True] if "varlen" in features else [])
    found: List[Entry] = []
    for direction in directions:
        kernel = FWD_GLUON if direction == "forward" else BWD_GLUON
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for head_dim in head_dims:
                if head_dim not in HEAD_DIMS:
                    continue
                for causal in (False, True):
                    for varlen in layouts:
                        call = sample_call(head_dim, dtype, varlen)
                        options = frozenset({"right"}) if causal else frozenset()
                        for lo, hi, cfg in _ranges(kernel, head_dim, causal, dtype, varlen):
                            if cfg is None:  # the table sends these key lengths to the portable kernels
                                found += portable_entries(direction, dtype_name, head_dim, options, causal, varlen,
                                                          lo, hi)
                                continue
                            found.append(Entry(
                                direction, dtype_name, head_dim, causal, varlen, lo, hi, cfg,
                                entry_bindings(direction, cfg, causal, varlen, head_dim, dtype),
                                capture(direction, cfg, causal, call),
                                needs_counts=direction == "backward" and bindings.backward_needs_counts(
                                    cfg, head_dim, varlen), options=options))
    for direction in directions:
        for dtype_name in dtypes:
            for head_dim in head_dims:
                for options, causal in option_sets(features, hopper=head_dim in HEAD_DIMS):
                    for varlen in layouts:
                        found += portable_entries(direction, dtype_name, head_dim, options, causal, varlen)
    if "kvcache" in features:
        for dtype_name in dtypes:
            for head_dim in head_dims:
                found += kvcache_entries(dtype_name, head_dim, features, page_sizes)
    return found


def sample_kvcache_call(head_dim: int, dtype, rows: int, page_size: int, nheads: int = 4, nheads_k: int = 2):
    """Meta tensors of one kv-cache call (two sequences, GQA, two new tokens each): q, k_cache,
    v_cache, k_new, v_new, out, lse, cache_seqlens, block_table, each with its own storage size."""
    q = _meta(2, rows, nheads, head_dim, dtype=dtype)
    k_cache = _meta(20, page_size, nheads_k, head_dim, dtype=dtype)
    v_cache = _meta(21, page_size, nheads_k, head_dim, dtype=dtype)[:20]
    k_new = _meta(2, 2, nheads_k, head_dim, dtype=dtype)
    v_new = _meta(2, 3, nheads_k, head_dim, dtype=dtype)[:, :2]
    out = _meta(2, rows + 1, nheads, head_dim, dtype=dtype)[:, :rows]
    lse = _meta(2, nheads, rows, dtype=torch.float32)
    cache_seqlens = _meta(2, dtype=torch.int32)
    block_table = _meta(2, 11, dtype=torch.int32)[:, :10]
    return q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens, block_table


def capture_kvcache(cfg, params: ScoreParams, call, split: bool) -> list:
    """The launches of the kv-cache call's update (no rotary) and forward (``split``: 3 splits and
    the combine; ``cfg``: the forward's config) on sample_kvcache_call's tensors."""
    from ..kernels.portable.launch import PortableForward, SplitForward, launch_kvcache_update
    from ..tools import catalog

    q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens, block_table = call

    def run():
        _, seqused = launch_kvcache_update(q, k_new, v_new, k_cache, v_cache, None, None, cache_seqlens, block_table,
                                           True, params.causal)
        seqs = PackedSeqs(None, None, q.shape[1], block_table.shape[1] * k_cache.shape[1], seqused_k=seqused,
                          block_table=block_table)
        if split:
            SplitForward(q, k_cache, v_cache, out, lse, params, seqs, 3, cfg)(q, k_cache, v_cache, out, lse, params,
                                                                              seqs)
        else:
            PortableForward(q, k_cache, v_cache, out, lse, params, cfg, seqs)(q, k_cache, v_cache, out, lse, params,
                                                                              seqs)
    return catalog.capture(run)


def kvcache_entries(dtype_name: str, head_dim: int, features: Sequence[str], page_sizes: Sequence[int]) -> List[Entry]:
    """The kv-cache call's entries for one dtype and head dim: the update (appending new tokens), and
    the forward over a paged cache for each option set and page size, for a few query rows per
    sequence (decoding) and more, each plain and split-KV."""
    dtype = DTYPES[dtype_name]
    found = []
    for options, causal in option_sets(features, hopper=False):
        params = score_params(options, causal)
        for page_size in page_sizes:
            for decode, kernel, rows in ((1, FWD_DECODE, 1), (0, FWD, 40)):
                cfg = table_config(kernel, ARCH, head_dim, causal, 4096, dtype, paged=True)
                call = sample_kvcache_call(head_dim, dtype, rows, page_size)
                for split in (False, True):
                    launches = capture_kvcache(cfg, params, call, split)
                    if not found:  # the update: one entry, its page size a runtime argument
                        found.append(Entry("kvcache_update", dtype_name, head_dim, False, True, 1, UNBOUNDED, None,
                                           [bindings.kvcache_update()], launches[:1], portable=True))
                    binds = [bindings.kvcache_forward(cfg, options, split)] + [bindings.split_combine()] * split
                    found.append(Entry("kvcache", dtype_name, head_dim, causal, True, 1, UNBOUNDED, cfg, binds,
                                       launches[1:], options=options, decode=decode, portable=True,
                                       page_size=page_size, split=split))
    return found


def option_sets(features: Sequence[str], hopper: bool) -> List[Tuple[frozenset, bool]]:
    """[(options, causal)] the portable entries cover: the window shapes (none, causal, and with the
    window feature left / right / both sides), with and without softcap and ALiBi when asked for;
    plain and causal attention only where the Hopper kernels do not serve the head dim."""
    windows = [(frozenset(), False), (frozenset({"right"}), True)]
    if "window" in features:
        windows += [(frozenset({"left"}), False), (frozenset({"right"}), False), (frozenset({"left", "right"}), False)]
    softcaps = [frozenset()] + ([frozenset({"softcap"})] if "softcap" in features else [])
    alibis = [frozenset()] + ([frozenset({"alibi"})] if "alibi" in features else [])
    sets = []
    for (window, causal), softcap, alibi in product(windows, softcaps, alibis):
        options = window | softcap | alibi
        if hopper and options <= {"right"} and (causal or not options):
            continue  # plain or causal: the Hopper entries
        sets.append((options, causal))
    return sets


def portable_entries(direction: str, dtype_name: str, head_dim: int, options: frozenset, causal: bool,
                     varlen: bool, min_seqlen_k: int = 1, max_seqlen_k: int = UNBOUNDED) -> List[Entry]:
    """The portable entries of one option set for key lengths in [min_seqlen_k, max_seqlen_k): the
    forward (packed batches: also the decode config for a few query rows) or the backward
    (preprocess, dK/dV, dQ)."""
    dtype = DTYPES[dtype_name]
    call = sample_call(head_dim, dtype, varlen)
    params = score_params(options, causal)
    found = []
    if direction == "forward":
        kinds = [(FWD_DECODE, 1), (FWD, 0)] if varlen else [(FWD, -1)]
        for kernel, decode in kinds:
            cfg = table_config(kernel, ARCH, head_dim, causal, 4096, dtype)
            if decode == 1:
                q, k, v, out, lse, dout, dq, dk, dv, seqs = call
                seqs = PackedSeqs(seqs.cu_seqlens_q, seqs.cu_seqlens_k, 1, seqs.max_seqlen_k)
                sample = (q, k, v, out, lse, dout, dq, dk, dv, seqs)
            else:
                sample = call
            if head_dim % 16:  # no TMA without 16-element strides (Entry.hinted)
                cfg = replace(cfg, use_tma=False, warp_specialize=False)
            use_tma = cfg.use_tma and not varlen
            found.append(Entry(direction, dtype_name, head_dim, causal, varlen, min_seqlen_k, max_seqlen_k, cfg,
                               [bindings.portable_forward(cfg, options, varlen, use_tma)],
                               capture_portable(direction, cfg, params, sample), options=options, decode=decode,
                               portable=True))
        return found
    cfgs = tuple(table_config(kernel, ARCH, head_dim, causal, 4096, dtype) for kernel in (BWD_PREPROCESS, BWD_DKDV, BWD_DQ))
    found.append(Entry(direction, dtype_name, head_dim, causal, varlen, min_seqlen_k, max_seqlen_k, cfgs,
                       [bindings.bwd_preprocess(cfgs[0].block_m, False, varlen, zero=False),
                        bindings.portable_backward("attn_bwd_dkdv_kernel", cfgs[1], options, varlen),
                        bindings.portable_backward("attn_bwd_dq_kernel", cfgs[2], options, varlen)],
                       capture_portable(direction, cfgs, params, call), options=options, portable=True))
    return found


def missing_ranges(found: List[Entry]) -> List[str]:
    """Combinations whose key lengths the entries do not cover from 1 up (a table with a gap)."""
    groups: dict = {}
    for e in found:
        if e.decode != 1:  # decode entries come beside the others, for fewer query rows
            groups.setdefault((e.direction, e.dtype, e.head_dim, e.causal, e.varlen, e.options), []).append(e)
    gaps = []
    for key, group in groups.items():
        reach = 1
        for e in sorted(group, key=lambda e: e.min_seqlen_k):
            if e.min_seqlen_k > reach:
                gaps.append(f"{key}: key lengths {reach}-{e.min_seqlen_k - 1}")
            reach = max(reach, e.max_seqlen_k)
        if reach < UNBOUNDED:
            gaps.append(f"{key}: key lengths from {reach}")
    return gaps


def describe(found: List[Entry]) -> Optional[str]:
    return "\n".join(e.name for e in found) or None
