"""The kernel launches flashtile makes, as data that can be compiled without a GPU.

Every launch goes through a :class:`~flashtile.kernels.plans.CompiledCall` built by the real host
plans (ForwardPlan, BackwardPlan, PortableForward, ...). :func:`capture` runs a plan with that
class's call swapped for a recorder, so what is compiled afterwards is exactly what the dispatcher
would launch: the same grid, arguments, constexprs and launch options. The tensors are meta
tensors (shapes, strides and dtypes are all a compile sees), so any shape costs no memory.

Two ways in: :func:`call_launches` for one call (``python -m flashtile inspect --shape ...``), and
:func:`catalog` for every variant the sm90 tables can launch (``inspect --all``, the CI's compile
check).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..configs import (BWD_DKDV, BWD_DQ, BWD_GLUON, BWD_PREPROCESS, FWD, FWD_DECODE, FWD_DECODE_PACKED, FWD_GLUON,
                       GLUON_CANDIDATES, PORTABLE_CANDIDATES, GluonBwdConfig, GluonFwdConfig, KernelConfig,
                       padded_head_dim, table_config)
from ..kernels import plans
from ..block_mask import BlockMask
from ..kernels.portable import mods as builtin_mods
from ..options import Mods, PackedSeqs, ScoreParams
from ..sinks import sink_grad_buffer
from .common import CallSpec

ARCH = "sm90"
DEVICE = "meta"  # what the captured launches' tensors live on: no memory, every shape
SEQLENS = (1024, 2048, 4096, 8192, 16384)  # the key lengths the catalog asks the tables about
FAMILIES = ("gluon-fwd", "gluon-bwd", "portable-fwd", "portable-bwd")

# The part of a call each kernel function plays (``--kernel`` picks one by this name or the function's).
PARTS = {
    "gluon_attn_fwd_kernel": "fwd", "attn_fwd_kernel": "fwd", "attn_combine_kernel": "combine",
    "kvcache_update_kernel": "kvcache-update", "attn_bwd_preprocess_kernel": "preprocess",
    "gluon_attn_bwd_kernel": "bwd", "gluon_attn_bwd_d256_kernel": "bwd", "gluon_attn_bwd_persistent_kernel": "bwd",
    "gluon_bwd_dq_convert_kernel": "convert", "attn_bwd_dkdv_kernel": "dkdv", "attn_bwd_dq_kernel": "dq",
}


@dataclass
class Launch:
    """One kernel launch as a plan would make it: ``kwargs`` holds every parameter by name,
    ``options`` the launch options (num_warps, num_stages, maxnreg, ...)."""

    fn: Any
    grid: Tuple[int, int, int]
    kwargs: Dict[str, Any]
    options: Dict[str, Any]

    @property
    def name(self) -> str:
        return self.fn.fn.__name__

    @property
    def part(self) -> str:
        return PARTS.get(self.name, self.name)

    def compile_kwargs(self) -> dict:
        return {**self.kwargs, **self.options}


def _record(records: list):
    def call(self, *slot_values):
        args = list(self.template)
        for index, value in zip(self.slot_index, slot_values):
            args[index] = value
        records.append(Launch(self.fn, self.grid, dict(zip(self.names, args)), dict(self.options)))
        return None
    return call


def capture(run: Callable[[], object]) -> List[Launch]:
    """The launches ``run()`` makes through CompiledCall, in order; nothing is launched."""
    records: list = []
    saved = plans.CompiledCall.__call__
    plans.CompiledCall.__call__ = _record(records)
    try:
        run()
    finally:
        plans.CompiledCall.__call__ = saved
    return records


def _empty(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=DEVICE)


def _ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ----------------------------------------------------------------------------------------------
# The host plans, on given tensors


def gluon_forward(q, k, v, out, lse, params: ScoreParams, cfg: GluonFwdConfig, seqs: Optional[PackedSeqs] = None):
    """The Hopper forward's launch (dispatch._forward_plan's Gluon branch)."""
    from ..kernels.hopper.launch import GluonForward

    return capture(lambda: GluonForward(q, k, v, out, lse, params, cfg, seqs)(q, k, v, out, lse, params, seqs))


def gluon_packed_gqa_forward(q, k, v, out, lse, params: ScoreParams, cfg: GluonFwdConfig,
                             seqs: Optional[PackedSeqs] = None):
    """The Hopper forward's launch for a decode-shaped GQA call, the groups' heads packed as rows
    (dispatch.packed_gqa_on_hopper); seqs: a kv cache's rows with seqused_k (KVCacheStep), or None."""
    from ..kernels.hopper.launch import GluonForward

    group = q.shape[2] // k.shape[2]
    return capture(lambda: GluonForward(q, k, v, out, lse, params, cfg, seqs, query_group=group)(
        q, k, v, out, lse, params, seqs))


def portable_forward(q, k, v, out, lse, params: ScoreParams, cfg: KernelConfig, seqs: Optional[PackedSeqs] = None):
    from ..kernels.portable.launch import PortableForward

    return capture(lambda: PortableForward(q, k, v, out, lse, params, cfg, seqs)(q, k, v, out, lse, params, seqs))


def gluon_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, cfg: GluonBwdConfig, pre_cfg,
                   seqs: Optional[PackedSeqs] = None):
    """Preprocess, Gluon backward and dQ convert (kernels/hopper/launch.GluonBackward)."""
    from ..kernels.hopper.launch import GluonBackward

    return capture(lambda: GluonBackward(q, k, v, out, dout, lse, dq, dk, dv, params, cfg, pre_cfg, seqs)(
        q, k, v, out, dout, lse, dq, dk, dv, params, seqs, dsink=sink_grad_buffer(params.learnable_sink)))


def portable_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams, pre_cfg, dkdv_cfg, dq_cfg,
                      seqs: Optional[PackedSeqs] = None):
    """Preprocess, dK/dV and dQ (kernels/portable/launch.PortableBackward)."""
    from ..kernels.portable.launch import PortableBackward

    return capture(lambda: PortableBackward(q, k, v, out, dout, lse, dq, dk, dv, params, pre_cfg, dkdv_cfg, dq_cfg,
                                            seqs)(q, k, v, out, dout, lse, dq, dk, dv, params, seqs,
                                                  dsink=sink_grad_buffer(params.learnable_sink)))


# ----------------------------------------------------------------------------------------------
# Config names: the Gluon candidates have theirs (configs.GLUON_CANDIDATES); the portable ones get
# one from their fields, so that `--config m128_n64_w4_s3_tma` names a PORTABLE_CANDIDATES entry.


def portable_name(cfg: KernelConfig) -> str:
    return (f"m{cfg.block_m}_n{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}" + "_tma" * cfg.use_tma
            + "_ws" * cfg.warp_specialize)


def candidates(kernel: str, head_dim: int) -> Dict[str, Any]:
    """{name: config} the autotuner searches for ``kernel`` at this head dim (padded)."""
    d = padded_head_dim(head_dim)
    if kernel in GLUON_CANDIDATES:
        return dict(GLUON_CANDIDATES[kernel].get(d, {}))
    return {portable_name(cfg): cfg for cfg in PORTABLE_CANDIDATES.get(kernel, {}).get(d, [])}


def config_kwargs(cfg) -> str:
    """A config in keyword form, only the fields that differ from the defaults (plus the required
    ones): what one would type into the constructor."""
    if cfg is None:
        return "None"
    if isinstance(cfg, tuple):
        return " + ".join(config_kwargs(c) for c in cfg)
    parts = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            parts.append(f"{f.name}={value}")
    return f"{type(cfg).__name__}({', '.join(parts)})"


def resolve_config(text: str, kernel: str, head_dim: int, table) -> Any:
    """``--config``: a candidate name of ``kernel`` (see :func:`candidates`), "table", or
    ``field=value,...`` replacing fields of the table's config. ValueError with the choices."""
    if text in ("table", "", None):
        return table
    named = candidates(kernel, head_dim)
    if text in named:
        return named[text]
    if "=" in text:
        if table is None:
            raise ValueError(f"{kernel} has no table config at head dim {head_dim} to change fields of")
        fields = {f.name: f for f in dataclasses.fields(table)}
        changes = {}
        for item in text.split(","):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in fields:
                raise ValueError(f"{type(table).__name__} has no field {name!r} (fields: {', '.join(fields)})")
            default = getattr(table, name)
            if isinstance(default, bool):
                changes[name] = value.strip().lower() in ("1", "true", "yes", "on")
            else:
                changes[name] = type(default)(value.strip())
        return dataclasses.replace(table, **changes)
    raise ValueError(f"no {kernel} config named {text!r} at head dim {head_dim}; names: "
                     f"{', '.join(named) or '(none)'}, or 'table', or field=value,...")


# ----------------------------------------------------------------------------------------------
# One call


@dataclass
class CallLaunches:
    """What one direction of a call launches on sm90: the path, the config that was used (the
    table's or the one asked for), every launch, and notes (head chunks, forced path)."""

    direction: str
    path: str
    kernel: str  # the config table's kernel name (fwd_gluon, fwd, bwd_dkdv, ...)
    config: Any
    reason: str
    launches: List[Launch]
    notes: List[str] = field(default_factory=list)


def call_launches(spec: CallSpec, direction: str, config: Optional[str] = None,
                  part: Optional[str] = None) -> CallLaunches:
    """The launches of ``direction`` ("fwd" / "bwd") of the call ``spec`` on sm90, with the table's
    config, or ``config`` (resolve_config's forms; a Gluon candidate name moves a call onto the
    Hopper path if its tensors allow). ``part``: the portable backward's kernel the config is for
    ("dkdv" / "dq"; default dkdv)."""
    from ..dispatch import forward_kernel, hopper_takes
    from ..kernels.hopper.tma import qkv_unsupported
    from ..options import resolve_options

    explanation = spec.explain()
    choice = explanation.forward if direction == "fwd" else explanation.backward
    q, k, v = spec.qkv()
    params = resolve_options(q, spec.dropout_p, None, spec.causal, spec.window, spec.softcap,
                             spec.options()["alibi_slopes"])
    head_dim, seqlen_k = spec.head_dim, k.shape[1]
    gluon_kernel = FWD_GLUON if direction == "fwd" else BWD_GLUON
    path, cfg, notes, reason = choice.path, choice.config, [], choice.reason
    if config not in (None, "", "table") and path != "hopper" and config in candidates(gluon_kernel, head_dim):
        problem = qkv_unsupported(q, k, v) or (None if hopper_takes(gluon_kernel, params, head_dim)
                                               else "its score options")
        if problem:
            raise ValueError(f"--config {config} is a Hopper config, but this call cannot take the Hopper path: "
                             f"{problem}")
        path, cfg = "hopper", None
        notes.append(f"--config {config}: the Hopper path, which the table does not give this call ({choice.reason})")

    if direction == "fwd":
        out, lse = torch.empty_like(q), _empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        if path == "hopper":
            table = cfg if cfg is not None else table_config(FWD_GLUON, ARCH, head_dim, spec.causal, seqlen_k, q.dtype)
            cfg = resolve_config(config, FWD_GLUON, head_dim, table)
            return CallLaunches("fwd", path, FWD_GLUON, cfg, reason,
                                gluon_forward(q, k, v, out, lse, params, cfg), notes)
        kernel = forward_kernel(q, k, None)
        cfg = resolve_config(config, kernel, head_dim, cfg)
        return CallLaunches("fwd", path, kernel, cfg, reason, portable_forward(q, k, v, out, lse, params, cfg), notes)

    out, dout = torch.empty_like(q), torch.empty_like(q)
    lse = _empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    pre_cfg = table_config(BWD_PREPROCESS, ARCH, head_dim, spec.causal, seqlen_k, q.dtype)
    if path == "hopper":
        from ..kernels.hopper.launch import gluon_head_chunks

        table = cfg if cfg is not None else table_config(BWD_GLUON, ARCH, head_dim, spec.causal, seqlen_k, q.dtype)
        cfg = resolve_config(config, BWD_GLUON, head_dim, table)
        chunks = gluon_head_chunks(q.shape[0], q.shape[1], q.shape[2], k.shape[2], head_dim)
        if len(chunks) > 1:
            h0, h1, hk0, hk1 = chunks[0]
            notes.append(f"the dQ accumulator is large: {len(chunks)} launches of {h1 - h0} heads each; "
                         "this is the first")
            q, out, dout, dq = (t[:, :, h0:h1] for t in (q, out, dout, dq))
            k, v, dk, dv = (t[:, :, hk0:hk1] for t in (k, v, dk, dv))
            lse = lse[:, h0:h1]
        return CallLaunches("bwd", path, BWD_GLUON, cfg, reason,
                            gluon_backward(q, k, v, out, dout, lse, dq, dk, dv, params, cfg, pre_cfg), notes)
    dkdv_cfg, dq_cfg = cfg
    kernel = BWD_DQ if part == "dq" else BWD_DKDV
    if kernel == BWD_DQ:
        dq_cfg = cfg = resolve_config(config, BWD_DQ, head_dim, dq_cfg)
    else:
        dkdv_cfg = cfg = resolve_config(config, BWD_DKDV, head_dim, dkdv_cfg)
    return CallLaunches("bwd", path, kernel, cfg, reason,
                        portable_backward(q, k, v, out, dout, lse, dq, dk, dv, params, pre_cfg, dkdv_cfg, dq_cfg),
                        notes)


# ----------------------------------------------------------------------------------------------
# Every variant the sm90 tables can launch


@dataclass
class Variant:
    """One row of the compile check: ``build()`` captures the launches, ``part`` picks the one
    this row compiles (by Launch.part)."""

    family: str
    head_dim: int
    causal: bool
    variant: str
    config: str
    build: Callable[[], List[Launch]]
    part: str

    def launch(self) -> Launch:
        launches = self.build()
        return next(launch for launch in launches if launch.part == self.part)

    @property
    def key(self) -> tuple:
        return (self.family, self.head_dim, self.causal, self.variant)


def table_configs(kernel: str, head_dim: int, causal: bool) -> dict:
    """{config: {"dense" / "varlen": "1k-4k" (the key lengths it serves)}}: what the sm90 table
    picks for (kernel, head dim, causal) over SEQLENS, dense and packed."""
    found: dict = {}
    for varlen in (False, True):
        for sk in SEQLENS:
            cfg = table_config(kernel, ARCH, head_dim, causal, sk, torch.bfloat16, varlen)
            if cfg is not None:
                found.setdefault(cfg, {}).setdefault("varlen" if varlen else "dense", []).append(f"{sk // 1024}k")
    return {cfg: {layout: f"{ks[0]}-{ks[-1]}" if len(ks) > 1 else ks[0] for layout, ks in where.items()}
            for cfg, where in found.items()}


def _params(causal: bool) -> ScoreParams:
    return ScoreParams(softmax_scale=0.1, window_right=0 if causal else -1)


def _option_params(causal: bool, batch: int, nheads: int) -> ScoreParams:
    """Every score option the Hopper kernels take, at once: a sliding window (ending at the diagonal
    when causal), softcap and (b, h) ALiBi slopes; and a learnable sink."""
    return ScoreParams(softmax_scale=0.1, softcap=30.0, window_left=512 if causal else 256,
                       window_right=0 if causal else 256, alibi_slopes=_empty(batch, nheads, dtype=torch.float32),
                       learnable_sink=_empty(nheads, dtype=torch.float32))


def _with_sink(params: ScoreParams, nheads: int) -> ScoreParams:
    return dataclasses.replace(params, learnable_sink=_empty(nheads, dtype=torch.float32))


def _mod_params(causal: bool, nheads: int, seqlen: int) -> ScoreParams:
    """Programmable attention at once: a score mod with its backward (a relative-position bias), a
    mask mod (documents) and a block mask of 128 x 128 blocks (its lists as meta tensors)."""
    blocks = -(-seqlen // 128)
    counts, indices = _empty(1, nheads, blocks, dtype=torch.int32), _empty(1, nheads, blocks, blocks, dtype=torch.int32)
    lists = (counts, indices, counts, indices)
    documents = _empty(seqlen, dtype=torch.int32)
    block_mask = BlockMask(builtin_mods.document_mask, (documents,), None, nheads, seqlen, seqlen, (128, 128),
                           _empty(1, nheads, blocks, blocks, dtype=torch.int8), lists, lists)
    mods = Mods(builtin_mods.relative_bias_score, builtin_mods.additive_bwd, builtin_mods.document_mask,
                (_empty(nheads, 33, dtype=torch.float32), _empty(1, dtype=torch.int32)), (documents,), block_mask)
    return ScoreParams(softmax_scale=0.1, window_right=0 if causal else -1, mods=mods)


def _attn_bias_params(causal: bool, nheads: int, seqlen: int, layout: str = "tiles",
                      softcap: float = 0.0) -> ScoreParams:
    """attn_bias (1, nheads, seqlen, seqlen), shared by the batch, with the dQ kernel's gradient
    accumulation (mods.resolve_attn_bias, AttnBias.backward_mods), and softcap. layout "row": one query row
    (a bias broadcast along the queries); "padded": rows 4 keys longer than the call's, which no TMA
    descriptor covers (the Hopper kernels load its tiles); "tiles": neither (they come through the rings)."""
    from ..mods import resolve_mods

    if layout == "row":
        bias = _empty(1, nheads, 1, seqlen)
    elif layout == "padded":
        bias = _empty(1, nheads, seqlen, seqlen + 4)[..., :seqlen]
    else:
        bias = _empty(1, nheads, seqlen, seqlen)
    mods = resolve_mods(None, None, None, None, None, 2, nheads, seqlen, seqlen, bias.device, attn_bias=bias)
    mods, _ = mods.attn_bias.backward_mods(mods)
    return ScoreParams(softmax_scale=0.1, window_right=0 if causal else -1, softcap=softcap, mods=mods)


def _relative_bias_params(causal: bool, nheads: int) -> ScoreParams:
    """A relative-position bias table alone (mods.relative_bias, D = 128): the one mod the Hopper
    kernels take."""
    table = _empty(nheads, 257, dtype=torch.float32)
    mods = Mods(builtin_mods.relative_bias_score, builtin_mods.additive_bwd, None, (table, _empty(1, dtype=torch.int32)),
                relative_bias_table=table)
    return ScoreParams(softmax_scale=0.1, window_right=0 if causal else -1, mods=mods)


def gluon_fwd_builds(d: int, cfg, causal: bool, dtype) -> list:
    """(layout, build) of the Hopper forward: a dense batch, a packed one, a dense batch with every
    score option at once (a sliding window, softcap, (b, h) ALiBi slopes), one with a relative-bias
    table, at head dim 128 four with an attn_bias (dispatch.hopper_takes: through the ring, its tiles loaded,
    one row loaded, and with softcap, which the bias follows), and
    from head dim 128 a dense batch whose values have half the head dim (head_dim_v != head_dim_qk), and
    decode-shaped GQA rows packed into tiles (at head dim 128 also over a kv cache: its rows with seqused_k,
    its pages, and a prefill chunk's dense tiles over left-padded rows)."""
    h = 2048 // d
    q = _empty(2, 1024, h, d, dtype=dtype)
    out, lse = torch.empty_like(q), _empty(2, h, 1024, dtype=torch.float32)
    qv = _empty(1, 3000, h, d, dtype=dtype)
    outv, lsev = torch.empty_like(qv), _empty(1, h, 3000, dtype=torch.float32)
    seqs = PackedSeqs(_ints([0, 1000, 3000]), _ints([0, 1000, 3000]), 2000, 2000)
    params, options = _params(causal), _option_params(causal, 2, h)
    builds = [("dense", lambda: gluon_forward(q, q, q, out, lse, params, cfg)),
              ("varlen", lambda: gluon_forward(qv, qv, qv, outv, lsev, params, cfg, seqs)),
              ("options", lambda: gluon_forward(q, q, q, out, lse, options, cfg)),
              ("relative-bias", lambda: gluon_forward(q, q, q, out, lse, _relative_bias_params(causal, h), cfg))]
    if d == 128:
        builds.append(("attn-bias", lambda: gluon_forward(q, q, q, out, lse, _attn_bias_params(causal, h, 1024), cfg)))
        builds.append(("attn-bias-padded", lambda: gluon_forward(q, q, q, out, lse,
                                                                 _attn_bias_params(causal, h, 1024, "padded"), cfg)))
        builds.append(("attn-bias-row", lambda: gluon_forward(q, q, q, out, lse,
                                                              _attn_bias_params(causal, h, 1024, "row"), cfg)))
        builds.append(("attn-bias-softcap", lambda: gluon_forward(q, q, q, out, lse, _attn_bias_params(
            causal, h, 1024, softcap=20.0), cfg)))
    if d >= 128:
        v_half = _empty(2, 1024, h, d // 2, dtype=dtype)
        builds.append(("head-dim-v", lambda: gluon_forward(q, q, v_half, torch.empty_like(v_half), lse, params, cfg)))
    # 32 query rows per sequence, a group of 4 heads packed as rows.
    qg, kg = _empty(2, 32, 8, d, dtype=dtype), _empty(2, 4096, 2, d, dtype=dtype)
    outg, lseg = torch.empty_like(qg), _empty(2, 8, 32, dtype=torch.float32)
    builds.append(("packed-gqa", lambda: gluon_packed_gqa_forward(qg, kg, kg, outg, lseg, params, cfg)))
    if d == 128:  # the same rows over a kv cache, seqused_k of its rows in use (the loader zeroes V past them)
        cache_rows = PackedSeqs(None, None, 32, 4096, seqused_k=_ints([4000, 1000]))
        builds.append(("kv-cache", lambda: gluon_packed_gqa_forward(qg, kg, kg, outg, lseg, params, cfg, cache_rows)))
        # ... over a paged cache (pages of 256 keys), and a prefill chunk over left-padded rows (a table of one
        # page per sequence, key_shift).
        pages = _empty(40, 256, 2, d, dtype=dtype)
        paged = PackedSeqs(None, None, 32, 4096, seqused_k=_ints([4000, 1000]),
                           block_table=_ints([list(range(16)), list(range(20, 36))]))
        builds.append(("kv-cache-paged", lambda: gluon_packed_gqa_forward(qg, pages, pages, outg, lseg, params, cfg,
                                                                          paged)))
        qc = _empty(2, 200, 8, d, dtype=dtype)
        outc, lsec = torch.empty_like(qc), _empty(2, 8, 200, dtype=torch.float32)
        padded = PackedSeqs(None, None, 200, 4096, seqused_k=_ints([3000, 900]), block_table=_ints([[1], [0]]),
                            key_shift=_ints([7, 100]))
        builds.append(("kv-cache-leftpad", lambda: gluon_forward(qc, kg, kg, outc, lsec, params, cfg, padded)))
    return builds


def gluon_bwd_builds(d: int, cfg, causal: bool, dtype) -> list:
    """(layout, build) of the Hopper backward (GQA: half as many KV heads), dense and packed, up to
    head dim 128 a dense batch with every score option and one with a relative-bias table, at head dim
    128 two with an attn_bias and its gradient (through the ring; one row, its gradient summed along the
    queries), and from head dim 128 a dense batch whose values have half the head dim."""
    h, hk = 2048 // d, 2048 // d // 2
    params = _params(causal)
    pre = table_config(BWD_PREPROCESS, ARCH, d, causal, 4096, dtype)

    def tensors(batch, rows):
        q, k = _empty(batch, rows, h, d, dtype=dtype), _empty(batch, rows, hk, d, dtype=dtype)
        lse = _empty(batch, h, rows, dtype=torch.float32)
        return q, k, k, torch.empty_like(q), torch.empty_like(q), lse, torch.empty_like(q), torch.empty_like(k), \
            torch.empty_like(k)
    dense, packed = tensors(2, 1024), tensors(1, 3000)
    seqs = PackedSeqs(_ints([0, 1000, 3000]), _ints([0, 1000, 3000]), 2000, 2000)
    builds = [("dense", lambda: gluon_backward(*dense, params, cfg, pre)),
              ("varlen", lambda: gluon_backward(*packed, params, cfg, pre, seqs))]
    if d <= 128:
        options = _option_params(causal, 2, h)
        builds.append(("options", lambda: gluon_backward(*dense, options, cfg, pre)))
        builds.append(("relative-bias", lambda: gluon_backward(*dense, _relative_bias_params(causal, h), cfg, pre)))
    if d == 128:
        builds.append(("attn-bias", lambda: gluon_backward(*dense, _attn_bias_params(causal, h, 1024), cfg, pre)))
        builds.append(("attn-bias-row", lambda: gluon_backward(*dense, _attn_bias_params(causal, h, 1024, "row"), cfg,
                                                               pre)))
    if d >= 128:
        builds.append(("head-dim-v", lambda: gluon_backward(*_half_values(list(dense)), params, cfg, pre)))
    return builds


def portable_fwd_builds(d: int, causal: bool, dtype) -> list:
    """(variant, part, build) of the portable forward: dense, packed, paged, a kv cache (paged,
    left-padded), split-KV decoding and its combine, the kv-cache update, dense with mods and
    with an attn_bias, and dense with values of half the head dim."""
    from ..kernels.portable.launch import SplitForward, dependents_launch_point, launch_forward, launch_kvcache_update

    h = 1024 // d
    params = _params(causal)
    q = _empty(2, 512, h, d, dtype=dtype)
    out, lse = torch.empty_like(q), _empty(2, h, 512, dtype=torch.float32)
    qv = _empty(1, 1000, h, d, dtype=dtype)
    outv, lsev = torch.empty_like(qv), _empty(1, h, 1000, dtype=torch.float32)
    cu = _ints([0, 400, 1000])
    pages = _empty(20, 32, h, d, dtype=dtype)
    table = torch.zeros(2, 10, dtype=torch.int32, device=DEVICE)
    # Pages of 256 keys hold whole key tiles: one table entry per tile (tile_io.load_kv_rows), not one per row.
    pages_256, table_256 = _empty(6, 256, h, d, dtype=dtype), torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    cfg = table_config(FWD, ARCH, d, causal, 4096, dtype)
    dec = table_config(FWD_DECODE, ARCH, d, causal, 4096, dtype)
    # Keys read through a table take the tables' paged rows.
    cfg_paged, dec_paged = (table_config(kernel, ARCH, d, causal, 4096, dtype, paged=True)
                            for kernel in (FWD, FWD_DECODE))
    dec_packed, dec_packed_paged = (table_config(FWD_DECODE_PACKED, ARCH, d, causal, 4096, dtype, paged=paged)
                                    for paged in (False, True))
    q1 = _empty(1, 2, h, d, dtype=dtype)
    out1, lse1 = _empty(1, 2, h, d, dtype=torch.float32), _empty(1, h, 2, dtype=torch.float32)
    cu1 = _ints([0, 1, 2])
    paged = PackedSeqs(cu, cu, 600, 600, block_table=table)
    # Speculative decoding with GQA: 4 query rows, the group's heads packed into one tile's rows.
    q4, k4 = _empty(2, 4, h, d, dtype=dtype), _empty(2, 600, max(h // 4, 1), d, dtype=dtype)
    out4, lse4 = _empty(2, 4, h, d, dtype=torch.float32), _empty(2, h, 4, dtype=torch.float32)
    # 16 query rows: 64 packed rows, the packed decode tile.
    q16, out16, lse16 = _empty(2, 16, h, d, dtype=dtype), _empty(2, 16, h, d, dtype=torch.float32), _empty(
        2, h, 16, dtype=torch.float32)
    # The same packed over pages smaller than its key tile (a page number per row), one page per sequence.
    q16p, pages_g = _empty(1, 32, h, d, dtype=dtype), _empty(40, 16, max(h // 4, 1), d, dtype=dtype)
    table_1 = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    out16p, lse16p = torch.empty_like(q16p), _empty(1, h, 32, dtype=torch.float32)
    dependents = dependents_launch_point(d)  # the split forwards' combine launch (sm90's)
    rows = [
        ("fwd/dense", "fwd", lambda: launch_forward(q, q, q, out, lse, params, cfg)),
        ("fwd/varlen", "fwd", lambda: launch_forward(qv, qv, qv, outv, lsev, _with_sink(params, h), cfg,
                                                     PackedSeqs(cu, cu, 600, 600))),
        ("fwd/paged", "fwd", lambda: launch_forward(qv, pages, pages, outv, lsev, params, cfg_paged, paged)),
        ("fwd/decode-split", "fwd", lambda: launch_forward(
            q1, pages_256, pages_256, out1, lse1, params, dec_paged, PackedSeqs(cu1, cu, 1, 600,
                                                                                block_table=table_256),
            splits=(3, 256, out1.numel(), lse1.numel()), launch_dependents=dependents)),
        ("fwd/kvcache", "fwd", lambda: launch_forward(
            qv, pages, pages, outv, lsev, params, cfg_paged, PackedSeqs(cu, cu, 600, 600, block_table=table,
                                                                  key_shift=_ints([0, 400])))),
        ("fwd/combine", "combine", lambda: SplitForward(qv, pages, pages, outv, lsev, _with_sink(params, h), paged, 3,
                                                        dec_paged, overlap=True)(qv, pages, pages, outv, lsev,
                                                                           _with_sink(params, h), paged)),
        ("fwd/decode-pack-gqa", "fwd", lambda: launch_forward(
            q4, k4, k4, out4, lse4, params, dec, PackedSeqs(None, None, 4, 600, dense_batch=2),
            splits=(3, 256, out4.numel(), lse4.numel()), pack_gqa=True, launch_dependents=dependents)),
        ("fwd/decode-pack-gqa-64", "fwd", lambda: launch_forward(
            q16, k4, k4, out16, lse16, params, dec_packed, PackedSeqs(None, None, 16, 600, dense_batch=2),
            splits=(3, 256, out16.numel(), lse16.numel()), pack_gqa=True, launch_dependents=dependents)),
        ("fwd/decode-pack-gqa-paged", "fwd", lambda: launch_forward(
            q16p, pages_g, pages_g, out16p, lse16p, params, dec_packed_paged, PackedSeqs(
                _ints([0, 16, 32]), cu, 16, 600, block_table=table_1), pack_gqa=True)),
        ("fwd/mods", "fwd", lambda: launch_forward(q, q, q, out, lse, _mod_params(causal, h, 512), cfg)),
        ("fwd/attn-bias", "fwd", lambda: launch_forward(q, q, q, out, lse, _attn_bias_params(causal, h, 512), cfg)),
        ("fwd/head-dim-v", "fwd", lambda: launch_forward(q, q, q[..., :d // 2].contiguous(), out[..., :d // 2],
                                                         lse, params, cfg)),
    ]
    k1 = _empty(2, 1, max(h // 4, 1), d, dtype=dtype)
    cache = _empty(20, 32, max(h // 4, 1), d, dtype=dtype)
    cos = _empty(640, d // 4, dtype=torch.float32)
    for interleaved in (False, True):
        rows.append((f"kvcache-update{'-interleaved' if interleaved else ''}", "kvcache-update",
                     lambda i=interleaved: launch_kvcache_update(_empty(2, 1, h, d, dtype=dtype), k1, k1, cache, cache,
                                                                 cos, cos, cu[:2], table, i, causal)))
    return [(name, part, (lambda run=run: capture(run))) for name, part, run in rows]


def portable_bwd_builds(d: int, causal: bool, dtype) -> list:
    """(layout, build) of the portable backward (preprocess, dK/dV, dQ), dense and packed, dense with
    score and mask mods and a block mask, dense with an attn_bias and its gradient, and dense with
    values of half the head dim."""
    h = 1024 // d
    params = _params(causal)
    pre, dkdv, dq = (table_config(kernel, ARCH, d, causal, 4096, dtype)
                     for kernel in (BWD_PREPROCESS, BWD_DKDV, BWD_DQ))

    def tensors(batch, rows):
        t = [_empty(batch, rows, h, d, dtype=dtype) for _ in range(9)]
        t[5] = _empty(batch, h, rows, dtype=torch.float32)
        return t
    cu = _ints([0, 400, 1000])
    dense, packed = tensors(2, 512), tensors(1, 1000)
    return [("dense", lambda: portable_backward(*dense, params, pre, dkdv, dq)),
            ("varlen", lambda: portable_backward(*packed, _with_sink(params, h), pre, dkdv, dq,
                                                 PackedSeqs(cu, cu, 600, 600))),
            ("mods", lambda: portable_backward(*dense, _mod_params(causal, h, 512), pre, dkdv, dq)),
            ("attn-bias", lambda: portable_backward(*dense, _attn_bias_params(causal, h, 512), pre, dkdv, dq)),
            ("head-dim-v", lambda: portable_backward(*_half_values(dense), params, pre, dkdv, dq))]


def _half_values(tensors: list) -> list:
    """portable_backward's (q, k, v, out, dout, lse, dq, dk, dv) with v, out, dout, dv of half the head dim."""
    return [t[..., :t.shape[-1] // 2].contiguous() if i in (2, 3, 4, 8) else t for i, t in enumerate(tensors)]


def catalog(head_dims: Sequence[int] = (64, 128, 256), dtype=torch.bfloat16, with_candidates: bool = False,
            families: Optional[Sequence[str]] = None) -> List[Variant]:
    """Every kernel variant the sm90 tables can launch: each distinct config the tables pick for
    these head dims, full and causal, dense and packed batches, 1k to 16k keys (the Gluon forward
    and backward), the portable forward (dense, packed, paged, kv cache, split-KV decoding, its
    combine, the kv-cache update) and the portable backward (preprocess, dK/dV, dQ).
    ``with_candidates``: also every Gluon candidate config (configs.GLUON_CANDIDATES), dense and
    packed. Nothing is compiled here."""
    families = tuple(families or FAMILIES)
    rows: List[Variant] = []
    for d in head_dims:
        for causal in (False, True):
            if "gluon-fwd" in families:
                rows += _gluon_rows("gluon-fwd", FWD_GLUON, gluon_fwd_builds, d, causal, dtype, with_candidates)
            if "gluon-bwd" in families:
                rows += _gluon_rows("gluon-bwd", BWD_GLUON, gluon_bwd_builds, d, causal, dtype, with_candidates)
            if "portable-fwd" in families:
                rows += [Variant("portable-fwd", d, causal, name, "table", build, part)
                         for name, part, build in portable_fwd_builds(d, causal, dtype)]
            if "portable-bwd" in families:
                for layout, build in portable_bwd_builds(d, causal, dtype):
                    rows += [Variant("portable-bwd", d, causal, f"{layout}/{part}", "table", build, part)
                             for part in ("preprocess", "dkdv", "dq")]
    return rows


def _gluon_rows(family: str, kernel: str, builds, d: int, causal: bool, dtype, with_candidates: bool) -> list:
    part = "fwd" if kernel == FWD_GLUON else "bwd"
    rows = []
    for cfg, where in table_configs(kernel, d, causal).items():
        for layout, build in builds(d, cfg, causal, dtype):
            # The variants of a dense call compile each config the dense table picks.
            lengths = where.get(layout if layout in ("dense", "varlen") else "dense")
            if lengths is not None:
                rows.append(Variant(family, d, causal, f"{layout} {lengths}", repr(cfg), build, part))
    if with_candidates:
        for name, cfg in candidates(kernel, d).items():
            for layout, build in builds(d, cfg, causal, dtype):
                if layout in ("dense", "varlen"):
                    rows.append(Variant(family, d, causal, f"{layout} {name}", name, build, part))
    return rows
