"""Decode-shaped calls through flash_attn_func and flash_attn_varlen_func (dispatch.decode_route):
at most DECODE_MAX_ROWS query rows per sequence, or up to DECODE_ROUTE_MAX_ROWS against enough keys per
row, run on the decode kernels, GQA heads as rows or sharing tiles where they can, split-KV. Checked
against the float64 reference (out, lse, and the backward that reads them), with splits forced where
the interpreter would not choose them."""

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile import dispatch
from flashtile.configs import (DECODE_MAX_ROWS, DECODE_ROUTE_KEYS_PER_ROW, DECODE_ROUTE_MAX_ROWS, FWD, FWD_DECODE,
                               FWD_DECODE_PACKED)
from flashtile.options import PackedSeqs, ScoreParams
from flashtile.reference import attention_naive
from flashtile.testing import check_lse

from _cases import DEVICE, DTYPES, ON_GPU, check_against_reference, make_qkv, randn

ON_HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)

@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, causal, window", [
    (1, 1, 8, 2, True, (-1, -1)), (1, 300, 8, 2, True, (-1, -1)), (1, 300, 6, 1, False, (-1, -1)),
    (1, 113, 4, 4, True, (32, -1)), (4, 113, 8, 2, True, (-1, -1)), (16, 300, 4, 4, False, (-1, -1)),
    (16, 37, 6, 1, True, (8, 0)), (1, 1023, 8, 2, False, (-1, 3)),
    # The packed decode tile: 8 rows x 4 heads packed; 32 heads of one query as rows.
    (8, 300, 8, 2, True, (-1, -1)), (1, 300, 32, 1, False, (-1, -1)),
    # Chunks past the decode tile: 17 rows x 4 heads on the prefill tile, 40 rows alone on the packed one.
    (17, 300, 8, 2, True, (-1, -1)), (40, 700, 4, 4, True, (-1, -1)), (64, 1100, 6, 1, False, (-1, -1)),
])
def test_dense_decode_shapes(seqlen_q, seqlen_k, nheads, nheads_k, causal, window):
    dtype = DTYPES[0]
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 64, dtype)
    params = ScoreParams(softmax_scale=0.125, window_left=window[0], window_right=0 if causal else window[1])
    assert dispatch.decode_route(q, k, params, None) is not None
    check_against_reference(flashtile.flash_attn_func, q, k, v, causal=causal, window_size=window)


@pytest.mark.parametrize("option", ["softcap", "alibi"])
def test_dense_decode_options(option):
    q, k, v = make_qkv(3, 1, 200, 8, 2, 40, DTYPES[0])
    extra = {"softcap": 20.0} if option == "softcap" else {"alibi_slopes": torch.rand(3, 8, device=DEVICE) * 0.3}
    check_against_reference(flashtile.flash_attn_func, q, k, v, causal=True, **extra)


@pytest.mark.parametrize("seqlen_q, nheads, nheads_k, family", [
    (1, 8, 1, FWD_DECODE), (4, 8, 2, FWD_DECODE), (16, 8, 8, FWD_DECODE),
    (8, 32, 8, FWD_DECODE_PACKED), (16, 32, 8, FWD_DECODE_PACKED), (1, 32, 1, FWD_DECODE_PACKED),
    (1, 64, 1, FWD_DECODE_PACKED), (16, 64, 8, FWD), (1, 128, 1, FWD),
    (17, 8, 1, FWD_DECODE_PACKED), (32, 8, 1, FWD), (40, 8, 1, FWD_DECODE_PACKED), (24, 8, 1, FWD_DECODE_PACKED),
])
def test_decode_tile_takes_the_tile_rows(seqlen_q, nheads, nheads_k, family):
    # Tile rows: the query rows, times the group's heads when they share tiles (packed GQA) or the group
    # alone when its heads are one query's rows: up to 16 the decode tile, up to 64 the packed one; above,
    # the 128-row tile unless 64-row tiles hold packed rows with fewer empty (136, 320: yes; 256: no; head
    # dim 64 here, where the grid's size does not count).
    q = torch.empty(2, seqlen_q, nheads, 64, device="meta")
    k = torch.empty(2, 100, nheads_k, 64, device="meta")
    assert dispatch.decode_kernel(q, k, ScoreParams(softmax_scale=0.125), None)[0] == family


def test_packed_rows_on_64_row_tiles():
    """17 rows x a group of 8 heads: 136 packed rows, on three 64-row tiles rather than two 128-row ones."""
    q, k, v = make_qkv(2, 17, 17 * DECODE_ROUTE_KEYS_PER_ROW + 5, 8, 1, 40, DTYPES[0])
    assert dispatch.decode_kernel(q, k, ScoreParams(softmax_scale=0.1), None) == (FWD_DECODE_PACKED, True)
    check_against_reference(flashtile.flash_attn_func, q, k, v, causal=True)


@pytest.mark.parametrize("batch, seqlen_q, nheads, nheads_k, block_m, options, tiles", [
    (2, 32, 32, 8, 128, {}, 2 * 8), (3, 33, 16, 4, 128, {}, 3 * 4 * 2), (1, 17, 8, 1, 128, {"softcap": 30.0}, 2),
    (2, 2, 64, 1, 128, {"window_left": 100}, 2), (2, 64, 8, 1, 256, {}, 2 * 2),
    # Not packed on the Hopper forward: 64 rows or fewer per kv head, fewer than a tile, one row, a group of 3,
    # ALiBi, a sink.
    (2, 16, 16, 4, 128, {}, 0), (2, 32, 32, 8, 256, {}, 0), (2, 1, 32, 1, 128, {}, 0), (2, 40, 6, 2, 128, {}, 0),
    (2, 32, 32, 8, 128, {"alibi_slopes": torch.ones(32)}, 0),
    (2, 32, 32, 8, 128, {"learnable_sink": torch.ones(32)}, 0),
])
def test_packed_gqa_tiles(batch, seqlen_q, nheads, nheads_k, block_m, options, tiles):
    """Which decode-shaped calls may run on the Hopper forward with their GQA groups packed as rows, and on
    how many of its block_m-row tiles (the grid the rule weighs against the multiprocessors)."""
    q = torch.empty(batch, seqlen_q, nheads, 64, device="meta")
    k = torch.empty(batch, 4096, nheads_k, 64, device="meta")
    params = ScoreParams(softmax_scale=0.125, window_right=0, **options)
    assert dispatch.packed_gqa_tiles(q, k, None, None, params, None, block_m) == tiles
    assert dispatch.packed_gqa_tiles(q, k, None, None, params, PackedSeqs(None, None, seqlen_q, 4096), block_m) == 0


def test_packed_gqa_tiles_varlen():
    """Packed batches: the grid's tiles (every sequence as long as the longest); no seqused."""
    q = torch.empty(1, 100, 32, 64, device="meta")
    k = torch.empty(1, 5000, 8, 64, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    params = ScoreParams(softmax_scale=0.125, window_right=0)
    assert dispatch.packed_gqa_tiles(q, k, None, None, params, PackedSeqs(cu, cu, 40, 4096), 128) == 3 * 8 * 2
    assert dispatch.packed_gqa_tiles(q, k, None, None, params, PackedSeqs(cu, cu, 16, 4096), 128) == 0
    assert dispatch.packed_gqa_tiles(q, k, None, None, params, PackedSeqs(cu, cu, 40, 4096, seqused_q=cu[1:]),
                                     128) == 0


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, options", [
    (3, 32, 4096, 32, 8, 128, dict(causal=True)),
    (2, 33, 1023, 16, 4, 128, dict(causal=True)),
    (2, 33, 1500, 8, 1, 64, dict(causal=True)),
    (3, 4, 1023, 64, 1, 64, dict(causal=False)),
    (2, 24, 2048, 16, 2, 192, dict(causal=True)),
    (2, 63, 1500, 8, 2, 96, dict(causal=True, window_size=(300, 0), softcap=30.0)),
    (2, 40, 2000, 32, 2, 128, dict(causal=False, window_size=(512, 512))),
    (1, 64, 1025, 4, 2, 256, dict(causal=True)),
])
def test_packed_gqa_on_hopper(monkeypatch, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, options):
    """Decode-shaped GQA calls on the Hopper forward with each group's heads packed as rows (any grid here:
    the tile threshold is lifted), against float64: out, lse and the backward that reads them."""
    monkeypatch.setattr(dispatch, "PACKED_GQA_HOPPER_TILES_PER_SM", 0)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    explanation = flashtile.explain(q, k, v, **options)
    assert explanation.forward.path == "hopper", explanation.forward.reason
    assert "packed as rows" in explanation.forward.reason
    check_against_reference(flashtile.flash_attn_func, q, k, v, **options)


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
def test_packed_gqa_on_hopper_takes_large_grids():
    """The table's threshold: 34 sequences x 4 kv heads x 2 tiles (272) take the Hopper forward; 8
    sequences (64 tiles, under 0.6 per SM) stay on the decode kernels, which split the keys."""
    q, k, v = make_qkv(34, 33, 700, 16, 4, 128, torch.bfloat16)
    assert flashtile.explain(q, k, v, causal=True).forward.path == "hopper"
    check_against_reference(flashtile.flash_attn_func, q, k, v, causal=True, backward=False)
    assert flashtile.explain(q[:8], k[:8], v[:8], causal=True).forward.path == "portable"


def test_rows_above_the_route_are_not_decode():
    """Past DECODE_MAX_ROWS only a chunk against enough keys per row is decode-shaped; past
    DECODE_ROUTE_MAX_ROWS none is."""
    params = ScoreParams(softmax_scale=0.1)
    rows = DECODE_MAX_ROWS + 1
    q, k, _ = make_qkv(1, rows, DECODE_ROUTE_KEYS_PER_ROW * rows, 2, 2, 32, DTYPES[0], requires_grad=False)
    assert dispatch.decode_route(q, k, params, None) is not None
    assert dispatch.decode_route(q, k[:, :-1], params, None) is None
    assert dispatch.decode_route(q[:, :DECODE_MAX_ROWS], k[:, :DECODE_MAX_ROWS], params, None) is not None
    q, k, _ = make_qkv(1, DECODE_ROUTE_MAX_ROWS + 1, 4096, 2, 2, 32, DTYPES[0], requires_grad=False)
    assert dispatch.decode_route(q, k, params, None) is None
    assert dispatch.decode_route(q[:, :1], k, ScoreParams(softmax_scale=0.1, dropout_p=0.1), None) is None


def _check_sequence(out, lse, q, k, v, **options):
    """One sequence's out (1, s, h, d) and lse (h, s) against float64 attention: at most twice the error of
    the same computation in the inputs' dtype."""
    ref, ref_lse = attention_naive(q, k, v, **options)
    same_dtype, _ = attention_naive(q, k, v, dtype=None, **options)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * (same_dtype.double() - ref).abs().max().item() + 1e-4, err
    check_lse(lse, ref_lse[0])  # d64's tile takes its row sums on the tensor cores (bf16 P)


def _packed(lengths_q, lengths_k, nheads, nheads_k, dtype, head_dim=64):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(sum(lengths_q), nheads, head_dim, dtype=dtype)
    k = randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype)
    v = randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths_q, lengths_k, nheads, nheads_k, head_dim, options", [
    ([33, 17, 64, 1, 0, 40], [1500, 700, 2048, 300, 64, 1023], 16, 4, 128, dict(causal=True)),
    ([64, 9, 50], [4500, 2000, 999], 64, 8, 64, dict(causal=False)),
    ([24, 31], [800, 1200], 16, 2, 96, dict(causal=True, window_size=(200, 0), softcap=20.0)),
])
def test_packed_gqa_varlen_on_hopper(monkeypatch, dtype, lengths_q, lengths_k, nheads, nheads_k, head_dim, options):
    """flash_attn_varlen_func with a few query rows per sequence on the Hopper forward, each group's heads packed
    as rows (the tile threshold lifted): each sequence's out and lse against float64."""
    monkeypatch.setattr(dispatch, "PACKED_GQA_HOPPER_TILES_PER_SM", 0)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, nheads, nheads_k, dtype, head_dim)
    lengths = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    explanation = flashtile.explain(q, k, v, **lengths, **options)
    assert "packed as rows" in explanation.forward.reason, explanation.forward.reason
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, lengths["max_seqlen_q"],
                                                   lengths["max_seqlen_k"], return_attn_probs=True, **options)
    window = options.get("window_size", (-1, -1))
    for i in range(len(lengths_k)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if qs.stop == qs.start:
            continue
        _check_sequence(out[qs][None], lse[:, qs], q[qs][None], k[ks][None], v[ks][None], causal=options["causal"],
                        window_size=window, softcap=options.get("softcap", 0.0))


class _HopperForwardSpy:
    """Records the query_group of every Hopper forward plan dispatch builds (a fresh plan cache: the
    calls below build theirs)."""

    def __init__(self, monkeypatch):
        from flashtile import call_plans
        from flashtile.kernels.hopper import launch

        self.groups, real = [], launch.GluonForward

        def spy(*args, query_group=1, **kwargs):
            self.groups.append(query_group)
            return real(*args, query_group=query_group, **kwargs)
        monkeypatch.setattr(launch, "GluonForward", spy)
        for cache in (call_plans.KVCACHE_STEPS, call_plans.VARLEN_CALLS, dispatch._FORWARD_PLANS):
            cache.clear()


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqlen_q, seqlen_new, nheads, nheads_k, head_dim, capacity, options", [
    (32, 32, 32, 8, 128, 4096, dict(causal=True)),
    (17, 0, 8, 1, 128, 3000, dict(causal=True)),
    (64, 64, 8, 1, 64, 2048, dict(causal=False)),
    (24, 24, 16, 2, 96, 1500, dict(causal=True, window_size=(300, 0), softcap=30.0)),
    (40, 0, 16, 4, 256, 1100, dict(causal=True)),
    (200, 200, 8, 2, 128, 3000, dict(causal=True)),  # a prefill chunk: a tile per query head
    (150, 0, 8, 2, 64, 2000, dict(causal=True, alibi_slopes=(3, 8))),  # ALiBi: per-head, so only chunks
])
def test_kvcache_on_hopper_over_nan_slots(monkeypatch, dtype, seqlen_q, seqlen_new, nheads, nheads_k, head_dim,
                                          capacity, options):
    """flash_attn_with_kvcache on the Hopper forward (a few rows with GQA: the groups packed as rows, the tile
    threshold lifted; a prefill chunk: the dense tiles), over caches whose free slots hold NaN: the kernel
    reads whole key blocks past each sequence's length and must zero those values. Per sequence against
    float64 attention over its used keys."""
    monkeypatch.setattr(dispatch, "PACKED_GQA_HOPPER_TILES_PER_SM", 0)
    spy = _HopperForwardSpy(monkeypatch)
    batch = 3
    options = _with_slopes(options)
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k_cache, v_cache = (randn(batch, capacity, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    k_new, v_new = (randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype) if seqlen_new else None
                    for _ in range(2))
    # Used lengths ending inside a key block, on a block edge, and the whole cache.
    lengths = [capacity - seqlen_new - 77, 128 * 3 - seqlen_new, capacity - seqlen_new]
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for b, n in enumerate(lengths):
        k_cache[b, n + seqlen_new:] = float("nan")
        v_cache[b, n + seqlen_new:] = float("nan")
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=cache_seqlens,
                                                 return_softmax_lse=True, num_splits=1, **options)
    assert spy.groups == [nheads // nheads_k if seqlen_q <= DECODE_ROUTE_MAX_ROWS else 1], spy.groups
    for b, n in enumerate(lengths):
        _check_sequence(out[b:b + 1], lse[b], q[b:b + 1], k_cache[b:b + 1, :n + seqlen_new],
                        v_cache[b:b + 1, :n + seqlen_new], **_sequence_options(options, b))


def _with_slopes(options: dict) -> dict:
    """The options with alibi_slopes given as a shape made a tensor of random slopes."""
    if "alibi_slopes" not in options:
        return options
    return dict(options, alibi_slopes=torch.rand(*options["alibi_slopes"], device=DEVICE) * 0.3)


def _sequence_options(options: dict, b: int) -> dict:
    """The options of sequence b alone: (batch, heads) ALiBi slopes sliced to its row."""
    slopes = options.get("alibi_slopes")
    if slopes is None or slopes.dim() == 1:
        return options
    return dict(options, alibi_slopes=slopes[b:b + 1])


def _cache_through_table(layout, batch, capacity, nheads_k, head_dim, dtype, page_size=256):
    """(k_cache, v_cache, the keyword arguments that address them, rows): a kv cache of NaN through a table,
    whose sequence b's key slots are rows(b) (the (page, row) pairs, or (cache row, position) ones). layout:
    "paged" (shuffled pages of page_size keys, spare pages between), "batch_idx" (contiguous rows picked by
    cache_batch_idx) or "leftpad" (contiguous rows, each sequence's keys from cache_leftpad on)."""
    if layout == "paged":
        pages = capacity // page_size
        k_cache, v_cache = (torch.full((batch * pages + 5, page_size, nheads_k, head_dim), float("nan"), dtype=dtype,
                                       device=DEVICE) for _ in range(2))
        table = torch.randperm(batch * pages + 5, device=DEVICE)[:batch * pages].view(batch, pages).int()
        return k_cache, v_cache, dict(block_table=table), \
            lambda b, t: (table[b, t // page_size].item(), t % page_size)
    k_cache, v_cache = (torch.full((batch + 2, capacity, nheads_k, head_dim), float("nan"), dtype=dtype,
                                   device=DEVICE) for _ in range(2))
    if layout == "batch_idx":
        rows = torch.tensor([3, 0, 4][:batch], dtype=torch.int32, device=DEVICE)
        return k_cache, v_cache, dict(cache_batch_idx=rows), lambda b, t: (rows[b].item(), t)
    pads = torch.tensor([5, 130, 0][:batch], dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, dict(cache_leftpad=pads), lambda b, t: (b, t)


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
@pytest.mark.parametrize("layout, seqlen_q, seqlen_new, nheads, nheads_k, head_dim, options", [
    ("paged", 32, 32, 32, 8, 128, dict(causal=True)),
    ("paged", 64, 0, 8, 1, 64, dict(causal=False)),
    ("paged", 200, 200, 8, 2, 128, dict(causal=True)),  # a prefill chunk: a tile per query head
    ("batch_idx", 17, 17, 8, 1, 128, dict(causal=True)),
    ("batch_idx", 40, 0, 16, 4, 256, dict(causal=True, window_size=(300, 0), softcap=30.0)),
    ("leftpad", 32, 0, 32, 8, 128, dict(causal=True)),
    ("leftpad", 150, 150, 16, 2, 96, dict(causal=False)),
    ("paged", 130, 0, 8, 2, 128, dict(causal=True, alibi_slopes=(8,))),
])
def test_kvcache_tables_on_hopper_over_nan_slots(monkeypatch, layout, seqlen_q, seqlen_new, nheads, nheads_k,
                                                 head_dim, options):
    """flash_attn_with_kvcache on the Hopper forward through a table: pages of 256 keys, the rows picked by
    cache_batch_idx, or left-padded rows. Every slot the sequences do not use holds NaN (the padding, spare
    pages, the tail past each length). Per sequence against float64 attention over its keys."""
    monkeypatch.setattr(dispatch, "PACKED_GQA_HOPPER_TILES_PER_SM", 0)
    spy = _HopperForwardSpy(monkeypatch)
    batch, capacity = 3, 2048
    options = _with_slopes(options)
    k_cache, v_cache, table, slot = _cache_through_table(layout, batch, capacity, nheads_k, head_dim,
                                                         torch.bfloat16)
    pads = table["cache_leftpad"].tolist() if layout == "leftpad" else [0] * batch
    # Ends inside a key block, on a block edge, and at the capacity.
    ends = [capacity - seqlen_new - 77, 128 * 3 - seqlen_new, capacity - seqlen_new]
    for b in range(batch):
        for t in range(pads[b], ends[b]):
            page, row = slot(b, t)
            k_cache[page, row] = randn(nheads_k, head_dim, dtype=torch.bfloat16)
            v_cache[page, row] = randn(nheads_k, head_dim, dtype=torch.bfloat16)
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=torch.bfloat16)
    k_new, v_new = (randn(batch, seqlen_new, nheads_k, head_dim, dtype=torch.bfloat16) if seqlen_new else None
                    for _ in range(2))
    cache_seqlens = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=cache_seqlens,
                                                 return_softmax_lse=True, num_splits=1, **table, **options)
    assert spy.groups == [nheads // nheads_k if seqlen_q <= DECODE_ROUTE_MAX_ROWS else 1], spy.groups
    for b in range(batch):
        slots = [slot(b, t) for t in range(pads[b], ends[b] + seqlen_new)]
        pages, rows = (torch.tensor(i, device=DEVICE) for i in zip(*slots))
        _check_sequence(out[b:b + 1], lse[b], q[b:b + 1], k_cache[pages, rows][None], v_cache[pages, rows][None],
                        **_sequence_options(options, b))


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
@pytest.mark.parametrize("lengths_q, options", [([300, 1, 129, 64], dict(causal=True)),
                                                ([33, 17, 64, 40], dict(causal=False))])
def test_varlen_paged_on_hopper_over_nan_slots(monkeypatch, lengths_q, options):
    """flash_attn_varlen_func over pages of 256 keys (cu_seqlens_k counts each sequence's keys): the Hopper
    forward (a few rows with GQA: the groups packed as rows, the tile threshold lifted), every slot past a
    sequence's keys NaN (its last page's tail, spare pages)."""
    monkeypatch.setattr(dispatch, "PACKED_GQA_HOPPER_TILES_PER_SM", 0)
    spy = _HopperForwardSpy(monkeypatch)
    lengths_k = [1500, 700, 2048, 257]
    k_cache, v_cache, table, slot = _cache_through_table("paged", 4, 2048, 8, 128, torch.bfloat16)
    q, _, _, cu_q, cu_k = _packed(lengths_q, lengths_k, 32, 8, torch.bfloat16, 128)
    for b, n in enumerate(lengths_k):
        for t in range(n):
            page, row = slot(b, t)
            k_cache[page, row] = randn(8, 128, dtype=torch.bfloat16)
            v_cache[page, row] = randn(8, 128, dtype=torch.bfloat16)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                   return_attn_probs=True, **table, **options)
    assert spy.groups == [1 if max(lengths_q) > DECODE_ROUTE_MAX_ROWS else 4], spy.groups
    for i, n in enumerate(lengths_k):
        qs = slice(int(cu_q[i]), int(cu_q[i + 1]))
        pages, rows = (torch.tensor(x, device=DEVICE) for x in zip(*[slot(i, t) for t in range(n)]))
        _check_sequence(out[qs][None], lse[:, qs], q[qs][None], k_cache[pages, rows][None],
                        v_cache[pages, rows][None], **options)


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
def test_kvcache_pages_smaller_than_a_key_block_stay_portable(monkeypatch):
    """Pages of 64 keys under the d128 forward's 128-key blocks: the portable kernels, and still right."""
    monkeypatch.setattr(dispatch, "PACKED_GQA_HOPPER_TILES_PER_SM", 0)
    spy = _HopperForwardSpy(monkeypatch)
    k_cache, v_cache, table, slot = _cache_through_table("paged", 2, 1024, 2, 128, torch.bfloat16, page_size=64)
    k_cache.normal_()
    v_cache.normal_()
    q = randn(2, 32, 8, 128, dtype=torch.bfloat16)
    cache_seqlens = torch.tensor([1000, 300], dtype=torch.int32, device=DEVICE)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True, **table)
    assert spy.groups == []
    for b, n in enumerate(cache_seqlens.tolist()):
        pages, rows = (torch.tensor(i, device=DEVICE) for i in zip(*[slot(b, t) for t in range(n)]))
        ref, _ = attention_naive(q[b:b + 1], k_cache[pages, rows][None], v_cache[pages, rows][None], causal=True)
        same_dtype, _ = attention_naive(q[b:b + 1], k_cache[pages, rows][None], v_cache[pages, rows][None],
                                        causal=True, dtype=None)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        assert err <= 2 * (same_dtype.double() - ref).abs().max().item() + 1e-4, err


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
@pytest.mark.parametrize("nheads, nheads_k, lengths_q, options", [
    (16, 4, [300, 1, 129, 64], dict(causal=True)),  # the dense tiles
    (32, 8, [33, 17, 64, 40], dict(causal=False)),  # GQA groups packed as rows
])
def test_varlen_seqused_k_on_hopper_over_nan_slots(monkeypatch, nheads, nheads_k, lengths_q, options):
    """flash_attn_varlen_func with seqused_k: the Hopper forward, the keys past each sequence's used ones
    NaN (the backward runs on the portable kernels, which do not read them)."""
    monkeypatch.setattr(dispatch, "PACKED_GQA_HOPPER_TILES_PER_SM", 0)
    spy = _HopperForwardSpy(monkeypatch)
    lengths_k, used = [1500, 700, 2048, 400], [1400, 1, 2048, 257]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, nheads, nheads_k, torch.bfloat16, 128)
    for i, n in enumerate(used):
        k[int(cu_k[i]) + n:int(cu_k[i + 1])] = float("nan")
        v[int(cu_k[i]) + n:int(cu_k[i + 1])] = float("nan")
    seqused_k = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                   seqused_k=seqused_k, return_attn_probs=True, **options)
    assert spy.groups == [1 if max(lengths_q) > DECODE_ROUTE_MAX_ROWS else nheads // nheads_k], spy.groups
    for i, n in enumerate(used):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i]) + n)
        _check_sequence(out[qs][None], lse[:, qs], q[qs][None], k[ks][None], v[ks][None], **options)


@pytest.mark.parametrize("lengths_q", [[1, 1, 1], [1, 0, 1], [4, 1, 3], [20, 0, 33]])
@pytest.mark.parametrize("nheads, nheads_k", [(8, 2), (4, 4)])
def test_packed_decode_shapes(lengths_q, nheads, nheads_k):
    """One query per sequence (as a (batch, 1) tensor, GQA heads as rows, lse through a buffer),
    sequences without a query, and a few rows each (the packed layout kept), up to chunks of 17-64."""
    lengths_k = [300, 17, 1000]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, nheads, nheads_k, DTYPES[0])
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                                   return_attn_probs=True)
    for i in range(len(lengths_k)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if qs.stop == qs.start:
            continue
        ref, ref_lse = attention_naive(q[qs][None], k[ks][None], v[ks][None], causal=True)
        same_dtype, _ = attention_naive(q[qs][None], k[ks][None], v[ks][None], causal=True, dtype=None)
        err = (out[qs][None].double() - ref).abs().max().item()
        assert err <= 2 * (same_dtype.double() - ref).abs().max().item() + 1e-4
        assert torch.allclose(lse[:, qs].double(), ref_lse[0], atol=1e-4)


@pytest.mark.parametrize("lengths_q", [[1, 1, 1], [4, 1, 3], [16, 0, 9]])
def test_paged_decode_shapes(lengths_q):
    """Decode-shaped flash_attn_varlen_func calls over a paged cache take the decode route as well (one query per
    sequence: GQA heads as rows through the table), every slot past a sequence's keys NaN."""
    lengths_k, nheads, nheads_k = [300, 17, 200], 8, 2
    k_cache, v_cache, table, slot = _cache_through_table("paged", 3, 320, nheads_k, 64, DTYPES[0], page_size=32)
    keys = []
    for b, n in enumerate(lengths_k):
        pages, rows = (torch.tensor(x, device=DEVICE) for x in zip(*[slot(b, t) for t in range(n)]))
        k_cache[pages, rows] = randn(n, nheads_k, 64, dtype=DTYPES[0])
        v_cache[pages, rows] = randn(n, nheads_k, 64, dtype=DTYPES[0])
        keys.append((k_cache[pages, rows][None], v_cache[pages, rows][None]))
    q, _, _, cu_q, cu_k = _packed(lengths_q, lengths_k, nheads, nheads_k, DTYPES[0])
    seqs = PackedSeqs(cu_q, cu_k, max(lengths_q), max(lengths_k), block_table=table["block_table"])
    assert dispatch.decode_route(q[None], k_cache, ScoreParams(softmax_scale=0.125), seqs) is not None
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                   causal=True, return_attn_probs=True, **table)
    for i, (k, v) in enumerate(keys):
        qs = slice(int(cu_q[i]), int(cu_q[i + 1]))
        if qs.stop > qs.start:
            _check_sequence(out[qs][None], lse[:, qs], q[qs][None], k, v, causal=True)


@pytest.mark.parametrize("packed", [False, True, "paged"])
@pytest.mark.parametrize("nheads_k", [2, 8])
def test_forced_splits(packed, nheads_k):
    """Split-KV and its merge, which the interpreter never picks by itself (one split off the GPU); packed, and
    packed over shuffled pages of 100 keys."""
    dtype = DTYPES[0]
    batch, nheads, seqlen_k = 3, 8, 700
    q, k, v = make_qkv(batch, 1, seqlen_k, nheads, nheads_k, 64, dtype, requires_grad=False)
    params = ScoreParams(softmax_scale=0.125, window_right=0)
    ref, ref_lse = attention_naive(q, k, v, softmax_scale=0.125, causal=True)
    out = torch.full_like(q, float("nan"))
    if packed:
        cu = torch.arange(0, batch + 1, dtype=torch.int32, device=DEVICE)
        cu_k = cu * seqlen_k
        seqs = PackedSeqs(cu, cu_k, 1, seqlen_k)
        tensors = (q.reshape(1, batch, nheads, 64), k.reshape(1, -1, nheads_k, 64), v.reshape(1, -1, nheads_k, 64),
                   out.view(1, batch, nheads, 64))
        if packed == "paged":  # page i of the pool holds the keys' page order[i]
            order = torch.randperm(batch * 7, device=DEVICE)
            table = torch.argsort(order).int().view(batch, 7)
            seqs = PackedSeqs(cu, cu_k, 1, seqlen_k, block_table=table)
            tensors = (tensors[0], *(t.reshape(batch * 7, 100, nheads_k, 64)[order] for t in (k, v)), tensors[3])
        lse = torch.full((1, nheads, batch), float("nan"), device=DEVICE)
    else:
        seqs, tensors = None, (q, k, v, out)
        lse = torch.full((batch, nheads, 1), float("nan"), device=DEVICE)
    plan = dispatch.DecodeForward(*tensors, lse, params, seqs, num_splits=3)
    plan(*tensors, lse, params, seqs)
    got_lse = lse[0].t()[:, :, None] if packed else lse
    same_dtype, _ = attention_naive(q, k, v, softmax_scale=0.125, causal=True, dtype=None)
    assert (out.double() - ref).abs().max().item() <= 2 * (same_dtype.double() - ref).abs().max().item() + 1e-4
    assert torch.allclose(got_lse.double(), ref_lse, atol=1e-4)


@triton.jit
def _key_slope(score, b, h, q_idx, kv_idx, aux):
    return score - tl.load(aux[0] + h) * kv_idx.to(tl.float32) * 0.01 + q_idx.to(tl.float32) * 0.1


@triton.jit
def _every_third_key_off(b, h, q_idx, kv_idx, aux):
    return ((kv_idx + h + b) % 3) != 0


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mods_on_the_decode_route(seqlen_q, num_splits):
    """Score and mask mods on decode-shaped calls: the decode kernels and split-KV, each query head on
    its own rows (no heads as rows, no packed GQA tiles: a mod sees query heads and rows)."""
    batch, nheads, nheads_k, seqlen_k = 2, 8, 2, 500
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, 64, DTYPES[0], requires_grad=False)
    w = torch.rand(nheads, device=DEVICE)
    mods = flashtile.mods.resolve_mods(_key_slope, None, _every_third_key_off, [w], None, batch, nheads, seqlen_q,
                                       seqlen_k, q.device)
    params = ScoreParams(softmax_scale=0.125, window_right=0, mods=mods)
    assert dispatch.decode_route(q, k, params, None) is not None
    assert dispatch.decode_kernel(q, k, params, None)[1] is False  # no packed GQA tiles

    def score_twin(s, b, h, i, j):
        return s - w.to(s.dtype)[h] * j.to(s.dtype) * 0.01 + i.to(s.dtype) * 0.1

    def mask_twin(b, h, i, j):
        return ((j + h + b) % 3) != 0
    ref, ref_lse = attention_naive(q, k, v, softmax_scale=0.125, causal=True, score_mod=score_twin,
                                   mask_mod=mask_twin)
    same_dtype, _ = attention_naive(q, k, v, softmax_scale=0.125, causal=True, score_mod=score_twin,
                                    mask_mod=mask_twin, dtype=None)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, nheads, seqlen_q), float("nan"), device=DEVICE)
    plan = dispatch.DecodeForward(q, k, v, out, lse, params, None, num_splits=num_splits)
    plan(q, k, v, out, lse, params, None)
    assert (out.double() - ref).abs().max().item() <= 2 * (same_dtype.double() - ref).abs().max().item() + 1e-4
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4)
    # The public call takes the same route.
    public, public_lse, _ = flashtile.flash_attn_func(q, k, v, softmax_scale=0.125, causal=True, score_mod=_key_slope,
                                                      mask_mod=_every_third_key_off, aux_tensors=[w],
                                                      return_attn_probs=True)
    assert (public.double() - ref).abs().max().item() <= 2 * (same_dtype.double() - ref).abs().max().item() + 1e-4
    assert torch.allclose(public_lse.double(), ref_lse, atol=1e-4)
