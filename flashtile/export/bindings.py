"""How the exported C library computes each kernel argument: the host plans' logic, as expressions.

The Python host plans (kernels/hopper/forward_plan.py, backward_plan.py, kernels/portable/launch.py)
work out every launch's grid and arguments from the call's shapes. The C library must launch the
same kernels with the same values, without Python. Each kernel the library embeds gets a binding
here: for every parameter, an expression over the fields of the C library's call struct (``ft_call``
in csrc/runtime.h) — a tensor, a TMA descriptor, an integer, a float — and the grid likewise.

The expressions are written once, in a syntax that is both C and Python (names of ``ft_call`` fields,
integer literals, + - *, comparisons, and the functions CDIV, DIV, MIN, MAX, SEL). codegen.py renders
them as C; :func:`evaluate` evaluates them in Python, and the tests evaluate every binding on the
fields of many calls and compare with what the real host plan passes to the same kernel (captured
on meta tensors, tools/catalog.py): so the C library cannot drift from the plans unseen.

Config values (tile sizes, flags) are the variant's: they are folded into the expressions as
literals when a binding is made (functions below take the config).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..configs import GluonBwdConfig, GluonFwdConfig, padded_head_dim

LOG2E = 1.4426950408889634

# ft_call's fields: integers (int64_t in C), the float scale, and device pointers.
INT_FIELDS = (
    "batch",        # the tensors' batch dim: the batch (dense) or 1 (packed)
    "n_seqs",       # sequences: the batch (dense) or the number of packed sequences
    "rows_q", "rows_k",  # the tensors' row dims: seqlen (dense) or the packed totals
    "max_seqlen_q", "max_seqlen_k",  # the longest sequence (dense: rows_q / rows_k)
    "nheads", "nheads_k", "head_dim",
    "sm_count",     # multiprocessors of the device
    "row_stride",   # floats per (batch, head) row of the backward's delta / lse_log2 (rows_q padded to 4)
    "lse_sb", "lse_sh",  # the forward's lse strides: dense (nheads*rows_q, rows_q), packed (0, rows_q)
    "window_left", "window_right",  # the window's sides, each at least 0 (unbounded sides are constexpr off)
    "alibi_sb",     # the ALiBi slopes' batch stride: 0 for (nheads,) slopes
    *(f"{t}_{s}" for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv") for s in ("sb", "ss", "sh")),
    # The kv-cache call: k / v above are the paged caches (their batch stride the page stride), kn / vn
    # the new tokens appended.
    "seqlen_new", "page_size", "num_pages",
    "seq_pages",    # pages per sequence: the block table's columns
    "bt_sb",        # the block table's row stride
    "n_splits", "keys_per_split",  # split-KV: programs per sequence's keys, keys each (a BLOCK_N multiple)
    *(f"{t}_{s}" for t in ("kn", "vn") for s in ("sb", "ss", "sh")),
)
FLOAT_FIELDS = ("softmax_scale", "softcap")
POINTER_FIELDS = ("q", "k", "v", "o", "lse", "do", "dq", "dk", "dv", "cu_q", "cu_k", "delta", "lse_log2", "dq_acc",
                  "counts", "alibi", "knew", "vnew", "cache_seqlens", "seqused", "block_table", "o_part", "lse_part")

# Tensors of the caller whose strides the library checks to be multiples of 16 elements (and whose
# bases to be 16-byte aligned), so their stride arguments compile with Triton's divisibility hint as
# the Python path's do for such layouts.
CHECKED_STRIDE_FIELDS = tuple(f"{t}_{s}" for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv", "kn", "vn")
                              for s in ("sb", "ss", "sh"))


@dataclass(frozen=True)
class Pointer:
    """A pointer argument: ``field`` (a POINTER_FIELDS name) plus ``offset`` elements (an expression).
    Only offset-free pointers of caller or workspace tensors carry the 16-byte alignment hint."""

    field: str
    offset: str = "0"

    @property
    def aligned(self) -> bool:
        return self.offset == "0"


@dataclass(frozen=True)
class Descriptor:
    """A TMA descriptor over ``base`` with this shape and these strides (expressions, outer dim
    first, in elements; the last stride is 1). The box, swizzle and element type are the compiled
    kernel's (its tensordesc metadata)."""

    base: str
    shape: Tuple[str, ...]
    strides: Tuple[str, ...]


@dataclass
class Binding:
    """One kernel launch of an exported variant: the function, its grid, every runtime parameter's
    source (Pointer, Descriptor, an int expression, or ("float", expression)), the constexprs and
    launch options it compiles with (from the captured plan), and launch attributes."""

    kernel: str
    grid: Tuple[str, str, str]
    params: Dict[str, object]
    pdl: bool = False


def _fmt(value) -> str:
    return str(int(value))


def _tensor4(name: str, rows: str, heads: str, dims: str = "head_dim") -> Descriptor:
    return Descriptor(name, ("batch", rows, heads, dims),
                      (f"{name}_sb", f"{name}_ss", f"{name}_sh", "1"))


def _batch_stride(expr: str) -> str:
    # kernels/portable/launch._batch_stride: a batch of one is never indexed past entry 0.
    return f"SEL(batch > 1, {expr}, 0)"


def gluon_forward(cfg: GluonFwdConfig, causal: bool, varlen: bool) -> Binding:
    """forward_plan.ForwardPlan's launch."""
    block_m = cfg.block_m
    persistent = cfg.persistent and not varlen
    tiles = f"CDIV(max_seqlen_q, {block_m})"
    if varlen:
        grid = (tiles, "nheads", "n_seqs")
    elif persistent:
        units = f"CDIV({tiles}, 2)" if causal else tiles
        grid = (f"MIN({units} * nheads * batch, {cfg.ctas_per_sm} * sm_count)", "1", "1")
    else:
        grid = (tiles, "nheads", "batch")
    params = {
        "q_desc": _tensor4("q", "rows_q", "nheads"), "k_desc": _tensor4("k", "rows_k", "nheads_k"),
        "v_desc": _tensor4("v", "rows_k", "nheads_k"), "o_desc": _tensor4("o", "rows_q", "nheads"),
        "lse_ptr": Pointer("lse"), "stride_lse_b": "lse_sb", "stride_lse_h": "lse_sh",
        "seqlen_q": "rows_q", "seqlen_k": "rows_k", "nheads": "nheads", "head_group": "DIV(nheads, nheads_k)",
        "n_batch": "batch", "qk_scale_log2": ("float", f"softmax_scale * {LOG2E!r}"),
        # The C library's Hopper forward takes no window, softcap, ALiBi (their entries are portable),
        # relative-bias table, attn_bias or table of pages (its kv-cache entries are portable).
        "window_left": "0", "window_right": "0", "softcap_scale": ("float", "0.0"), "softcap_log2": ("float", "0.0"),
        "stride_alibi_b": "0", "rel_bias_distance": "0", "stride_bias_b": "0", "stride_bias_h": "0",
        "stride_bias_m": "0", "bias_batches": "1", "bias_heads": "1", "stride_table": "0", "page_size": "1",
        "table_keys": "0",
    }
    if causal and not varlen and not persistent and cfg.heads_per_group != 1:
        # forward_plan.heads_per_group with factor 1; 0 in the config: sized from the SM count.
        params["heads_per_group"] = (_fmt(cfg.heads_per_group) if cfg.heads_per_group else
                                     f"MAX(1, MIN(nheads * batch, CDIV(sm_count, MAX({tiles}, 1))))")
    if varlen:
        params.update({"cu_seqlens_q": Pointer("cu_q"), "cu_seqlens_k": Pointer("cu_k"), "o_ptr": Pointer("o"),
                       "stride_o_s": "o_ss", "stride_o_h": "o_sh"})
    return Binding("gluon_attn_fwd_kernel", grid, params)


def backward_needs_counts(cfg: GluonBwdConfig, head_dim: int, varlen: bool) -> bool:
    """Whether the backward takes the int32 (batch, nheads_k) counts (BackwardPlan.needs_counts)."""
    return not varlen and ((cfg.persistent and padded_head_dim(head_dim) == 64 and cfg.dq_split_m)
                           or cfg.overlap_convert)


def bwd_preprocess(block_m: int, needs_counts: bool, varlen: bool, zero: bool = True) -> Binding:
    """kernels/portable/launch.preprocess_call, zeroing the dQ accumulator (and the counts) when
    ``zero`` (the Hopper backward's)."""
    params = {
        "Out": Pointer("o"), "DOut": Pointer("do"), "Lse": Pointer("lse"), "Delta": Pointer("delta"),
        "LseLog2": Pointer("lse_log2"),
        "stride_ob": _batch_stride("o_sb"), "stride_os": "o_ss", "stride_oh": "o_sh",
        "stride_dob": _batch_stride("do_sb"), "stride_dos": "do_ss", "stride_doh": "do_sh",
        "stride_lse_b": _batch_stride("nheads * rows_q"), "stride_lse_h": "rows_q",
        "stride_delta_b": _batch_stride("nheads * row_stride"), "stride_delta_h": "row_stride",
        "stride_zero_b": _batch_stride("rows_q * nheads * head_dim") if zero else "0",
        "stride_zero_s": "nheads * head_dim" if zero else "0", "stride_zero_h": "head_dim" if zero else "0",
        "nheads_k": "nheads_k" if needs_counts else "0", "nheads": "nheads", "seqlen_q": "rows_q",
    }
    if zero:
        params["ZeroRows"] = Pointer("dq_acc")
    if needs_counts:
        params["ZeroCounts"] = Pointer("counts")
    if varlen:
        params["CuSeqlensQ"] = Pointer("cu_q")
    return Binding("attn_bwd_preprocess_kernel", (f"CDIV(max_seqlen_q, {block_m})", "nheads", "n_seqs"), params)


def gluon_backward(cfg: GluonBwdConfig, causal: bool, varlen: bool, head_dim: int) -> Binding:
    """backward_plan.BackwardPlan's main kernel."""
    from ..kernels.hopper.backward import BLOCK_N, KEYS_PER_CONSUMER

    block_d = padded_head_dim(head_dim)
    block_n = KEYS_PER_CONSUMER if block_d == 256 else BLOCK_N
    key_blocks = f"CDIV(max_seqlen_k, {block_n})"
    rows = Descriptor("lse_log2", ("batch * nheads * row_stride",), ("1",))
    params = {
        "q_desc": _tensor4("q", "rows_q", "nheads"), "do_desc": _tensor4("do", "rows_q", "nheads"),
        "k_desc": _tensor4("k", "rows_k", "nheads_k"), "v_desc": _tensor4("v", "rows_k", "nheads_k"),
        "dk_desc": _tensor4("dk", "rows_k", "nheads_k"), "dv_desc": _tensor4("dv", "rows_k", "nheads_k"),
        "dq_desc": Descriptor("dq_acc", ("batch", "rows_q", "nheads", "head_dim"),
                              ("rows_q * nheads * head_dim", "nheads * head_dim", "head_dim", "1")),
        "lse_desc": rows, "delta_desc": Descriptor("delta", rows.shape, rows.strides),
        "seqlen_q": "rows_q", "seqlen_k": "rows_k", "nheads": "nheads", "head_group": "DIV(nheads, nheads_k)",
        "lse_row_stride": "row_stride", "qk_scale_log2": ("float", f"softmax_scale * {LOG2E!r}"),
        "softmax_scale": ("float", "softmax_scale"),
    }
    persistent = backward_needs_counts(cfg, head_dim, varlen) and not cfg.overlap_convert
    if persistent:
        units = f"{key_blocks} * nheads_k * n_seqs"
        params.update({"counter_ptr": Pointer("counts"), "n_key_blocks": key_blocks, "nheads_k": "nheads_k",
                       "n_units": units})
        return Binding("gluon_attn_bwd_persistent_kernel", (f"MIN({units}, sm_count)", "1", "1"), params)
    heads_first = cfg.heads_first and not varlen
    grid = ("nheads_k", key_blocks, "n_seqs") if heads_first else (key_blocks, "nheads_k", "n_seqs")
    if varlen:
        params.update({"cu_seqlens_q": Pointer("cu_q"), "cu_seqlens_k": Pointer("cu_k"),
                       "lse_ptr": Pointer("lse_log2"), "delta_ptr": Pointer("delta"), "dk_ptr": Pointer("dk"),
                       "stride_dk_s": "dk_ss", "stride_dk_h": "dk_sh", "dv_ptr": Pointer("dv"),
                       "stride_dv_s": "dv_ss", "stride_dv_h": "dv_sh"})
    if cfg.overlap_convert and not varlen:
        params["done_counts"] = Pointer("counts")
    if block_d != 256:
        # The C library's Hopper backward takes no window, softcap, ALiBi (their entries are portable),
        # relative-bias table or attn_bias.
        params.update({"window_left": "0", "window_right": "0", "softcap_scale": ("float", "0.0"),
                       "softcap_log2": ("float", "0.0"), "stride_alibi_b": "0", "rel_bias_distance": "0",
                       **{f"stride_{name}_{dim}": "0" for name in ("bias", "grad") for dim in "bhm"},
                       "bias_batches": "1", "bias_heads": "1"})
    kernel = "gluon_attn_bwd_d256_kernel" if block_d == 256 else "gluon_attn_bwd_kernel"
    return Binding(kernel, grid, params)


def dq_convert(cfg: GluonBwdConfig, varlen: bool, head_dim: int) -> Binding:
    """backward_plan.BackwardPlan's dQ convert (block of 32 rows)."""
    from ..kernels.hopper.backward import BLOCK_N, KEYS_PER_CONSUMER

    block_n = KEYS_PER_CONSUMER if padded_head_dim(head_dim) == 256 else BLOCK_N
    overlap = cfg.overlap_convert and not varlen
    params = {
        "Acc": Pointer("dq_acc"), "DQ": Pointer("dq"), "stride_dqb": "dq_sb", "stride_dqs": "dq_ss",
        "stride_dqh": "dq_sh", "seqlen_q": "rows_q", "nheads": "nheads", "scale": ("float", "softmax_scale"),
        "nheads_k": "nheads_k", "done_target": f"CDIV(max_seqlen_k, {block_n})",
    }
    if varlen:
        params["RowsEnd"] = Pointer("cu_q", "n_seqs")
    if overlap:
        params["DoneCounts"] = Pointer("counts")
    return Binding("gluon_bwd_dq_convert_kernel", ("CDIV(rows_q, 32)", "nheads", "batch"), params, pdl=overlap)


def _score_params(options) -> dict:
    """ScoreParams.kernel_args's runtime values for an entry's options (a set of "left", "right",
    "softcap", "alibi"): the scales, window sides and ALiBi slopes."""
    softcap = "softcap" in options
    if softcap:
        qk_scale = "softmax_scale / softcap"
    else:
        qk_scale = f"softmax_scale * {LOG2E!r}"
    params = {"qk_scale": ("float", qk_scale), "softcap_log2": ("float", f"softcap * {LOG2E!r}" if softcap else "0.0"),
              "window_left": "window_left" if "left" in options else "0",
              "window_right": "window_right" if "right" in options else "0",
              "dropout_p": ("float", "0.0"), "stride_alibi_b": "alibi_sb" if "alibi" in options else "0"}
    # The block mask's scalars (kernels/portable): the C library takes no mods.
    params.update({"stride_lists_b": "0", "stride_lists_h": "0", "list_width": "0"})
    if "alibi" in options:
        params["AlibiSlopes"] = Pointer("alibi")
    return params


def _bsh(prefix: str, tensor: str) -> dict:
    """(batch, seq, head) stride arguments, the batch stride 0 for a batch of one."""
    return {f"stride_{prefix}b": _batch_stride(f"{tensor}_sb"), f"stride_{prefix}s": f"{tensor}_ss",
            f"stride_{prefix}h": f"{tensor}_sh"}


def portable_forward(cfg, options, varlen: bool, use_tma: bool) -> Binding:
    """kernels/portable/launch.PortableForward (no split, no pages)."""
    from ..kernels.portable.launch import PortableForward  # noqa: F401 (the plan this mirrors)

    if use_tma:
        tensors = {"Q": _tensor4("q", "rows_q", "nheads"), "K": _tensor4("k", "rows_k", "nheads_k"),
                   "V": _tensor4("v", "rows_k", "nheads_k"), "Out": _tensor4("o", "rows_q", "nheads")}
    else:
        tensors = {"Q": Pointer("q"), "K": Pointer("k"), "V": Pointer("v"), "Out": Pointer("o")}
    params = {**tensors, "Lse": Pointer("lse"), **_bsh("q", "q"), **_bsh("k", "k"), **_bsh("v", "v"),
              **_bsh("o", "o"), "stride_lse_b": _batch_stride("nheads * rows_q"), "stride_lse_h": "rows_q",
              "stride_lse_r": "1",
              "stride_bt": "0", "seq_pages": "0", "num_pages": "0", "num_splits": "1", "keys_per_split": "0",
              "split_stride_o": "0", "split_stride_lse": "0", "nheads": "nheads",
              "head_group": "DIV(nheads, nheads_k)", "seqlen_q": "rows_q", "seqlen_k": "rows_k",
              **_score_params(options)}
    if varlen:
        params.update({"CuSeqlensQ": Pointer("cu_q"), "CuSeqlensK": Pointer("cu_k")})
    return Binding("attn_fwd_kernel", (f"CDIV(max_seqlen_q, {cfg.block_m})", "nheads", "n_seqs"), params)


def portable_backward(kernel: str, cfg, options, varlen: bool) -> Binding:
    """kernels/portable/launch.portable_bwd_call: the dK/dV ("attn_bwd_dkdv_kernel") or dQ kernel."""
    dkdv = kernel == "attn_bwd_dkdv_kernel"
    grads = {"DK": Pointer("dk"), "DV": Pointer("dv"), **_bsh("dk", "dk"), **_bsh("dv", "dv")} if dkdv else \
        {"DQ": Pointer("dq"), **_bsh("dq", "dq")}
    params = {"Q": Pointer("q"), "K": Pointer("k"), "V": Pointer("v"), "DOut": Pointer("do"),
              "LseLog2": Pointer("lse_log2"), "Delta": Pointer("delta"), **grads,
              **_bsh("q", "q"), **_bsh("k", "k"), **_bsh("v", "v"), **_bsh("do", "do"),
              "stride_delta_b": _batch_stride("nheads * row_stride"), "stride_delta_h": "row_stride",
              "nheads": "nheads", "head_group": "DIV(nheads, nheads_k)", "seqlen_q": "rows_q", "seqlen_k": "rows_k",
              "softmax_scale": ("float", "softmax_scale"), **_score_params(options)}
    if varlen:
        params.update({"CuSeqlensQ": Pointer("cu_q"), "CuSeqlensK": Pointer("cu_k")})
    grid = ((f"CDIV(max_seqlen_k, {cfg.block_n})", "nheads_k", "n_seqs") if dkdv
            else (f"CDIV(max_seqlen_q, {cfg.block_m})", "nheads", "n_seqs"))
    return Binding(kernel, grid, params)


def kvcache_update() -> Binding:
    """kernels/portable/launch.launch_kvcache_update without rotary tables: the new keys and values
    written into the paged cache, and seqused <- cache_seqlens + seqlen_new."""
    params = {"Q": Pointer("q"), "QOut": Pointer("q"), "K": Pointer("knew"), "V": Pointer("vnew"),
              "KCache": Pointer("k"), "VCache": Pointer("v"), "CacheSeqlens": Pointer("cache_seqlens"),
              "BlockTable": Pointer("block_table"), "SeqUsedK": Pointer("seqused"),
              "stride_cos": "0", "stride_bt": "bt_sb", "seqlen_q": "rows_q", "seqlen_new": "seqlen_new",
              "nheads": "nheads", "nheads_k": "nheads_k", "page_size": "page_size", "num_pages": "num_pages",
              "seq_pages": "seq_pages"}
    for prefix, tensor in (("q", "q"), ("qo", "q"), ("k", "kn"), ("v", "vn"), ("kc", "k"), ("vc", "v")):
        outer = "p" if prefix in ("kc", "vc") else "b"
        params.update({f"stride_{prefix}{outer}": f"{tensor}_sb", f"stride_{prefix}s": f"{tensor}_ss",
                       f"stride_{prefix}h": f"{tensor}_sh"})
    return Binding("kvcache_update_kernel", ("seqlen_new", "MAX(nheads, nheads_k)", "batch"), params)


def kvcache_forward(cfg, options, split: bool) -> Binding:
    """kernels/portable/launch.PortableForward over a paged cache (the kv-cache call), or with
    ``split`` SplitForward's two launches' first: partial results into the workspace's o_part and
    lse_part, (n_splits, batch, rows, heads, head_dim) and (n_splits, batch, heads, rows) float32."""
    def cache_stride(expr: str) -> str:
        return f"SEL(num_pages > 1, {expr}, 0)"  # _batch_stride of the (pages, page_size, hk, d) cache
    if split:
        out = {"Out": Pointer("o_part"), "Lse": Pointer("lse_part"),
               "stride_ob": _batch_stride("rows_q * nheads * head_dim"), "stride_os": "nheads * head_dim",
               "stride_oh": "head_dim", "stride_lse_b": _batch_stride("nheads * rows_q"), "stride_lse_h": "rows_q",
               "stride_lse_r": "1",
               "num_splits": "n_splits", "keys_per_split": "keys_per_split",
               "split_stride_o": "batch * rows_q * nheads * head_dim", "split_stride_lse": "batch * nheads * rows_q"}
    else:
        out = {"Out": Pointer("o"), "Lse": Pointer("lse"), **_bsh("o", "o"), "stride_lse_b": _batch_stride("lse_sb"),
               "stride_lse_h": "lse_sh", "stride_lse_r": "1", "num_splits": "1", "keys_per_split": "0",
               "split_stride_o": "0", "split_stride_lse": "0"}
    params = {"Q": Pointer("q"), "K": Pointer("k"), "V": Pointer("v"), **out, **_bsh("q", "q"),
              "stride_kb": cache_stride("k_sb"), "stride_ks": "k_ss", "stride_kh": "k_sh",
              "stride_vb": cache_stride("v_sb"), "stride_vs": "v_ss", "stride_vh": "v_sh",
              "SeqUsedK": Pointer("seqused"), "BlockTable": Pointer("block_table"), "stride_bt": "bt_sb",
              "seq_pages": "seq_pages", "num_pages": "num_pages", "nheads": "nheads",
              "head_group": "DIV(nheads, nheads_k)", "seqlen_q": "rows_q", "seqlen_k": str(2**31 - 1),
              **_score_params(options)}
    blocks = f"CDIV(max_seqlen_q, {cfg.block_m})"
    return Binding("attn_fwd_kernel", (f"{blocks} * n_splits" if split else blocks, "nheads", "batch"), params)


def split_combine() -> Binding:
    """SplitForward's combine: the partial results merged into out and lse."""
    params = {"OutPartial": Pointer("o_part"), "LsePartial": Pointer("lse_part"), "Out": Pointer("o"),
              "Lse": Pointer("lse"), "stride_ps": "batch * rows_q * nheads * head_dim",
              "stride_pb": "rows_q * nheads * head_dim", "stride_pr": "nheads * head_dim", "stride_ph": "head_dim",
              "stride_ls": "batch * nheads * rows_q", "stride_lb": "nheads * rows_q", "stride_lh": "rows_q",
              "stride_ob": "o_sb", "stride_or": "o_ss", "stride_oh": "o_sh", "stride_lse_b": "lse_sb",
              "stride_lse_h": "lse_sh", "stride_lse_r": "1", "num_rows": "rows_q", "num_splits": "n_splits"}
    return Binding("attn_combine_kernel", ("rows_q", "nheads", "batch"), params)  # COMBINE_ROWS = 1


# ----------------------------------------------------------------------------------------------
# Evaluation in Python (the tests' side of the check)

FUNCTIONS = {
    "CDIV": lambda a, b: -(-a // b),
    "DIV": lambda a, b: a // b,
    "MIN": min,
    "MAX": max,
    "SEL": lambda c, a, b: a if c else b,
}


def evaluate(expr: str, fields: dict):
    """The value of a binding expression over ``fields`` (integer division as in C for the
    non-negative values these take)."""
    return eval(expr, {"__builtins__": {}}, {**FUNCTIONS, **fields})  # noqa: S307 (our own expressions)


def call_fields(q, k, v, out, seqs=None, dout=None, dq=None, dk=None, dv=None, softmax_scale=1.0,
                sm_count=132, window=(-1, -1), softcap=0.0, alibi=None) -> dict:
    """ft_call's integer and float fields for a call on these (b, s, h, d) tensors (the packed ones as
    batch-1 views), as the C library fills them (attention.c)."""
    batch, rows_q, nheads, head_dim = q.shape
    rows_k, nheads_k = k.shape[1], k.shape[2]
    varlen = seqs is not None
    f = {"batch": batch, "n_seqs": seqs.cu_seqlens_q.numel() - 1 if varlen else batch,
         "rows_q": rows_q, "rows_k": rows_k,
         "max_seqlen_q": seqs.max_seqlen_q if varlen else rows_q,
         "max_seqlen_k": seqs.max_seqlen_k if varlen else rows_k,
         "nheads": nheads, "nheads_k": nheads_k, "head_dim": head_dim, "sm_count": sm_count,
         "row_stride": (rows_q + 3) // 4 * 4,
         "lse_sb": 0 if varlen else nheads * rows_q, "lse_sh": rows_q, "softmax_scale": softmax_scale,
         "window_left": max(window[0], 0), "window_right": max(window[1], 0), "softcap": softcap,
         "alibi_sb": alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0}
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        t = q if t is None else t
        f[f"{name}_sb"], f[f"{name}_ss"], f[f"{name}_sh"] = t.stride(0), t.stride(1), t.stride(2)
    return f


def kvcache_call_fields(q, k_cache, v_cache, out, lse, k_new=None, v_new=None, block_table=None, n_splits=1,
                        keys_per_split=0, **options) -> dict:
    """ft_call's fields for a kv-cache call as the C library fills them: q, out and lse may be the
    strided views the forward runs on (GQA heads as rows); the caches are (pages, page_size, hk, d)."""
    f = call_fields(q, k_cache, v_cache, out, **options)
    f.update({"lse_sb": lse.stride(0), "lse_sh": lse.stride(1), "seqlen_new": 0 if k_new is None else k_new.shape[1],
              "page_size": k_cache.shape[1], "num_pages": k_cache.shape[0], "seq_pages": block_table.shape[1],
              "bt_sb": block_table.stride(0), "n_splits": n_splits, "keys_per_split": keys_per_split})
    for name, t in (("kn", k_new), ("vn", v_new)):
        t = k_cache if t is None else t
        f[f"{name}_sb"], f[f"{name}_ss"], f[f"{name}_sh"] = t.stride(0), t.stride(1), t.stride(2)
    return f


def check_binding(binding: Binding, launch, fields: dict, tensors: Dict[str, Optional[torch.Tensor]]) -> list:
    """Where ``binding`` disagrees with a captured ``launch`` (tools/catalog.Launch) of the same
    kernel: a list of messages, empty when every runtime argument and the grid match. ``tensors``
    names the call's tensors by pointer field; workspace tensors the plan allocated itself (delta,
    lse_log2, dq_acc, counts) are matched by dtype and layout instead of identity."""
    problems = []
    if launch.name != binding.kernel:
        return [f"kernel {launch.name}, binding for {binding.kernel}"]
    grid = tuple(evaluate(e, fields) for e in binding.grid)
    if grid != tuple(launch.grid):
        problems.append(f"{binding.kernel}: grid {grid}, plan {launch.grid}")
    declared = constexpr_names(launch.fn)
    for name, value in launch.kwargs.items():
        if name in declared:
            continue
        source = binding.params.get(name)
        if value is None:
            if source is not None:
                problems.append(f"{binding.kernel}.{name}: the plan passes None, the binding {source}")
            continue
        if source is None:
            problems.append(f"{binding.kernel}.{name}: no binding for the plan's {type(value).__name__}")
            continue
        if isinstance(source, Pointer):
            problems += _check_pointer(binding.kernel, name, source, value, fields, tensors)
        elif isinstance(source, Descriptor):
            problems += _check_descriptor(binding.kernel, name, source, value, fields, tensors)
        elif isinstance(source, tuple):
            got = evaluate(source[1], fields)
            if abs(got - value) > 1e-12 * abs(value):
                problems.append(f"{binding.kernel}.{name}: {got} != plan {value}")
        else:
            got = evaluate(source, fields)
            if got != value:
                problems.append(f"{binding.kernel}.{name}: {source} = {got}, plan {value}")
    extra = set(binding.params) - set(n for n, v in launch.kwargs.items() if v is not None)
    if extra:
        problems.append(f"{binding.kernel}: bindings for arguments the plan leaves None: {sorted(extra)}")
    return problems


def constexpr_names(fn) -> set:
    """The parameters a @triton.jit / @gluon.jit kernel declares constexpr (compiled or interpreted)."""
    import inspect

    return {name for name, p in inspect.signature(fn.fn).parameters.items() if "constexpr" in str(p.annotation)}


def _check_pointer(kernel, name, source: Pointer, value, fields, tensors) -> list:
    if not isinstance(value, torch.Tensor):
        return [f"{kernel}.{name}: the plan passes {type(value).__name__}, the binding a pointer"]
    expected = tensors.get(source.field)
    offset = evaluate(source.offset, fields)
    if expected is not None:
        # Meta tensors have no addresses: the storage's size stands for its identity (the tests give
        # each tensor of a call its own size).
        if (value.dtype != expected.dtype or value.untyped_storage().nbytes() != expected.untyped_storage().nbytes()
                or value.storage_offset() - expected.storage_offset() != offset):
            return [f"{kernel}.{name}: {source} does not match the plan's tensor"]
    return []


def _check_descriptor(kernel, name, source: Descriptor, value, fields, tensors) -> list:
    shape = [evaluate(e, fields) for e in source.shape]
    strides = [evaluate(e, fields) for e in source.strides]
    if list(value.shape) != shape or list(value.strides) != strides:
        return [f"{kernel}.{name}: shape {shape} strides {strides}, plan {list(value.shape)} {list(value.strides)}"]
    expected = tensors.get(source.base)
    if expected is not None and value.base.dtype != expected.dtype:
        return [f"{kernel}.{name}: base dtype {value.base.dtype}, expected {expected.dtype}"]
    return []
