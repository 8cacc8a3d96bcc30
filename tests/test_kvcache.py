"""flash_attn_with_kvcache against a reference that builds each sequence's keys and values by hand
(cache prefix, appended tokens, rotary), for contiguous and paged caches."""

import pytest
import torch
import triton
import triton.language as tl

from flashtile import flash_attn_with_kvcache, mods
from flashtile.reference import apply_rotary, attention_naive
from flashtile.testing import check_errors, check_lse, rel_error

from _cases import DEVICE, DTYPES, ON_GPU

NHEADS, NHEADS_K = 4, 2
HEAD_DIM = 64 if ON_GPU else 32


def rotary_tables(length, rotary_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=DEVICE).float() / rotary_dim))
    angles = torch.arange(length, device=DEVICE).float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def reference(q, k_full, v_full, cache_seqlens, seqlen_new, dtype, leftpad=None, **options):
    """Per sequence: attention of q[b] over cache positions [leftpad[b], cache_seqlens[b] + seqlen_new)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b]) + seqlen_new
        start = 0 if leftpad is None else int(leftpad[b])
        per_seq = dict(options)
        if per_seq.get("alibi_slopes") is not None:
            per_seq["alibi_slopes"] = per_seq["alibi_slopes"][b:b + 1]
        out, lse = attention_naive(q[b:b + 1], k_full[b:b + 1, start:n], v_full[b:b + 1, start:n], dtype=dtype,
                                   **per_seq)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def to_paged(cache, page_size):
    """(batch, seqlen_cache, hk, d) -> shuffled pool (num_pages, page_size, hk, d) and block table."""
    batch, seqlen = cache.shape[:2]
    per_seq = seqlen // page_size
    order = torch.randperm(batch * per_seq + 2, device=DEVICE)
    table = order[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    pool = torch.randn((batch * per_seq + 2, page_size) + tuple(cache.shape[2:]), dtype=cache.dtype, device=DEVICE)
    pool[table.long()] = cache.view(batch, per_seq, page_size, *cache.shape[2:])
    return pool, table


# Cache layouts: "rows" picks contiguous cache rows through cache_batch_idx, "direct" is sequence b
# on cache row b (read without a table), "paged" is a shuffled pool of pages with a block table.
LAYOUTS = ["rows", "direct", "paged"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (3, 3), (4, 0), (1, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_kvcache(dtype, layout, seqlen_q, seqlen_new, causal, rotary):
    run_kvcache_case(dtype, layout, seqlen_q, seqlen_new, causal, rotary)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 7, 0])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kvcache_splits(dtype, num_splits, layout):
    """Split-KV: every split count (forced, and automatic) gives the same result, rows without keys too."""
    run_kvcache_case(dtype, layout, 1, 1, True, "interleaved", num_splits=num_splits)
    run_kvcache_case(dtype, layout, 4, 0, False, None, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("options", [dict(softcap=5.0), dict(window_size=(20, 0)), dict(alibi=True)])
def test_kvcache_options(dtype, seqlen_q, options):
    run_kvcache_case(dtype, "paged", seqlen_q, 1, True, None, num_splits=2, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_leftpad(dtype, causal):
    run_kvcache_case(dtype, "rows", 2, 2, causal, "halves", leftpad=[3, 0, 41])


@pytest.mark.parametrize("head_dim", [64, 128, 256] if ON_GPU else [HEAD_DIM])
@pytest.mark.parametrize("layout", ["direct", "paged"])
@pytest.mark.parametrize("seqlen_q", [17, 40, 64, 65])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_chunk(head_dim, layout, seqlen_q, num_splits):
    """A chunk of queries appended and attended at once (chunked prefill), causal, bottom-right
    aligned to each sequence's cache: up to 64 rows the group's two heads share tiles (34 rows on the
    packed decode tile, 80 and 128 on the prefill one), 65 rows keep a tile per query head."""
    run_kvcache_case(DTYPES[0], layout, seqlen_q, seqlen_q, True, None, num_splits=num_splits, lengths=(5, 0, 31),
                     head_dim=head_dim)


@triton.jit
def key_distance_bias(score, b, h, q_idx, kv_idx, aux):
    """score + w[h] * (q - kv) / 16: reads an aux tensor, depends on the head and both positions."""
    return score + tl.load(aux[0] + h) * (q_idx - kv_idx).to(tl.float32) * 0.0625


@triton.jit
def every_third_off(b, h, q_idx, kv_idx, aux):
    return ((q_idx + 2 * kv_idx + h) % 3) != 0


def key_distance_bias_twin(w):
    return lambda s, b, h, i, j: s + w.to(s.dtype)[h] * (i - j).to(s.dtype) / 16


def every_third_off_twin(b, h, i, j):
    return ((i + 2 * j + h) % 3) != 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_mods(layout, seqlen_q, num_splits):
    """A score mod reading an aux tensor and a mask mod on the kv-cache call, GQA (heads as rows and packed
    GQA tiles step aside: the mods see query heads and rows), split or not; raw positions, as the
    reference's per-sequence dense attention sees them."""
    w = torch.rand(NHEADS, device=DEVICE)
    kernel_mods = dict(score_mod=key_distance_bias, mask_mod=every_third_off, aux_tensors=[w])
    reference_mods = dict(score_mod=key_distance_bias_twin(w), mask_mod=every_third_off_twin)
    run_kvcache_case(DTYPES[0], layout, seqlen_q, 1, True, None, num_splits=num_splits, kernel_mods=kernel_mods,
                     reference_mods=reference_mods)
    if layout == "rows" and seqlen_q == 4:
        run_kvcache_case(DTYPES[0], layout, seqlen_q, 2, False, "halves", leftpad=[3, 0, 41], num_splits=num_splits,
                         kernel_mods=kernel_mods, reference_mods=reference_mods)


def run_kvcache_case(dtype, layout, seqlen_q, seqlen_new, causal, rotary, leftpad=None, num_splits=1, alibi=False,
                     lengths=(5, 0, 70), kernel_mods=None, reference_mods=None, head_dim=HEAD_DIM,
                     **score_options):
    batch, seqlen_cache, page_size = 3, 96, 16
    cache_rows = 5  # more rows than sequences; cache_batch_idx picks them (contiguous cache)
    q = torch.randn(batch, seqlen_q, NHEADS, head_dim, device=DEVICE, dtype=dtype)
    k_cache = torch.randn(cache_rows, seqlen_cache, NHEADS_K, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(batch, seqlen_new, NHEADS_K, head_dim, device=DEVICE, dtype=dtype) if seqlen_new else None
    v_new = torch.randn_like(k_new) if seqlen_new else None
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    batch_idx = torch.tensor([4, 0, 2] if layout == "rows" else [0, 1, 2], dtype=torch.int32, device=DEVICE)
    cos = sin = None
    if rotary:
        cos, sin = rotary_tables(seqlen_cache, head_dim // 2)

    # The reference: each sequence's full keys / values, built by hand.
    rows = batch_idx.long()
    k_full, v_full = k_cache[rows].clone(), v_cache[rows].clone()
    q_ref = q
    if seqlen_new:
        positions = cache_seqlens[:, None].long() + torch.arange(seqlen_new, device=DEVICE)
        k_put = apply_rotary(k_new, cos, sin, positions, rotary == "interleaved") if rotary else k_new
        for b in range(batch):
            start = int(cache_seqlens[b])
            k_full[b, start:start + seqlen_new] = k_put[b]
            v_full[b, start:start + seqlen_new] = v_new[b]
    if rotary:
        steps = torch.arange(seqlen_q, device=DEVICE)[None, :] * (1 if causal else 0)
        q_ref = apply_rotary(q, cos, sin, cache_seqlens[:, None].long() + steps, rotary == "interleaved")

    kwargs = dict(k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens, causal=causal,
                  rotary_interleaved=rotary == "interleaved", return_softmax_lse=True, num_splits=num_splits)
    if leftpad is not None:
        leftpad = torch.tensor(leftpad, dtype=torch.int32, device=DEVICE)
        kwargs["cache_leftpad"] = leftpad
    kwargs.update(score_options, **(kernel_mods or {}))
    if alibi:
        score_options["alibi_slopes"] = kwargs["alibi_slopes"] = torch.rand(batch, NHEADS, device=DEVICE) * 0.2
    if layout == "paged":
        pool_k, table = to_paged(k_cache[rows].contiguous(), page_size)
        pool_v, _ = to_paged(v_cache[rows].contiguous(), page_size)
        pool_v[table.long()] = v_cache[rows].view(batch, -1, page_size, NHEADS_K, head_dim)
        out, lse = flash_attn_with_kvcache(q, pool_k, pool_v, block_table=table, **kwargs)
        written_k = pool_k[table.long()].view(batch, seqlen_cache, NHEADS_K, head_dim)
    else:
        unused = [1, 3] if layout == "rows" else [3, 4]
        untouched = k_cache[unused].clone()
        if layout == "rows":
            kwargs["cache_batch_idx"] = batch_idx
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        written_k = k_cache[rows]
        assert torch.equal(k_cache[unused], untouched), "rows no sequence uses were written"
    assert out.shape == q.shape and lse.shape == (batch, NHEADS, seqlen_q)
    # Appended keys are copied exactly; rotated ones may differ from the float32 reference by the
    # last bit where the GPU fuses x1 * cos - x2 * sin into one FMA.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(written_k, k_full, rtol=eps if rotary else 0, atol=eps if rotary else 0)

    options = dict(causal=causal, leftpad=leftpad, **score_options, **(reference_mods or {}))
    ref, ref_lse = reference(q_ref.double(), k_full.double(), v_full.double(), cache_seqlens, seqlen_new,
                             torch.float64, **options)
    same, _ = reference(q_ref, k_full, v_full, cache_seqlens, seqlen_new, None, **options)
    check_errors([("out", rel_error(out, ref), rel_error(same, ref))], dtype)
    check_lse(lse, ref_lse)


def test_kvcache_tells_autograd_the_caches_changed():
    # Eager calls run the kvcache_fwd op's body without the op (ops.kvcache_attention_call): they
    # still bump the caches' version counters as the op's mutation declaration would.
    q = torch.randn(2, 1, NHEADS, HEAD_DIM, device=DEVICE, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 32, NHEADS_K, HEAD_DIM, device=DEVICE, dtype=torch.float16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, NHEADS_K, HEAD_DIM, device=DEVICE, dtype=torch.float16) for _ in range(2))
    versions = (k_cache._version, v_cache._version)
    with torch.no_grad():
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=3)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    with torch.inference_mode():  # inference tensors have no version counter
        k_inf, v_inf = k_cache.clone(), v_cache.clone()
        again = flash_attn_with_kvcache(q, k_inf, v_inf, k_new, v_new, cache_seqlens=3)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_kvcache_bad_input_leaves_the_cache_untouched():
    q = torch.randn(2, 1, NHEADS, HEAD_DIM, device=DEVICE, dtype=DTYPES[0])
    k_cache = torch.randn(2, 8, NHEADS_K, HEAD_DIM, device=DEVICE, dtype=DTYPES[0])
    before = k_cache.clone()
    k = torch.randn(2, 3, NHEADS_K, HEAD_DIM, device=DEVICE, dtype=DTYPES[0])
    full = torch.tensor([6, 2], dtype=torch.int32, device=DEVICE)
    if not ON_GPU:  # contents are checked on CPU, and on CUDA with FLASHTILE_VALIDATE=1
        with pytest.raises(ValueError, match="cache_seqlens\\[0\\] = 6 plus 3 new tokens does not fit"):
            flash_attn_with_kvcache(q, k_cache, k_cache, k=k, v=k, cache_seqlens=full)
        assert torch.equal(k_cache, before)
        table = torch.tensor([[0], [5]], dtype=torch.int32)
        with pytest.raises(ValueError, match="block_table\\[1\\] points at page 5, outside the 2 pages of k_cache"):
            flash_attn_with_kvcache(q, k_cache, k_cache, k=k, v=k, cache_seqlens=1, block_table=table)
        assert torch.equal(k_cache, before)
    with pytest.raises(ValueError, match="k has shape"):
        flash_attn_with_kvcache(q, k_cache, k_cache, k=k[:1], v=k[:1], cache_seqlens=0)
    if not ON_GPU:
        with pytest.raises(ValueError, match="cache_leftpad\\[0\\] = 6 is outside \\[0, cache_seqlens\\[0\\] = 1\\]"):
            flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=torch.tensor([1, 2], dtype=torch.int32),
                                    cache_leftpad=full)
    with pytest.raises(ValueError, match="cache_leftpad must be an int32 tensor"):
        flash_attn_with_kvcache(q, k_cache, k_cache, cache_leftpad=full.long())
    strided = torch.tensor([[1, 0], [2, 0]], dtype=torch.int32, device=DEVICE)[:, 0]  # read at b, not 2 b
    for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad"):
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            flash_attn_with_kvcache(q, k_cache, k_cache, **{"cache_seqlens": 2, name: strided})
    with pytest.raises(ValueError, match="rotary_dim = 2 \\* rotary_cos.shape\\[1\\]"):
        cos = torch.ones(16, HEAD_DIM, device=DEVICE)
        flash_attn_with_kvcache(q, k_cache, k_cache, rotary_cos=cos, rotary_sin=cos)
    assert torch.equal(k_cache, before)


def test_kvcache_relative_bias_mod():
    """flashtile.mods.relative_bias on the kv-cache call: its table runs as a score mod here (the Hopper
    forward's table path reads packed sequences only; gluon_decision sends cache layouts elsewhere)."""
    table = torch.randn(NHEADS, 9, device=DEVICE)

    def twin(s, b, h, i, j):
        return s + table.to(s.dtype)[h, (j - i).clamp(-4, 4) + 4]

    run_kvcache_case(DTYPES[0], "paged", 2, 1, True, None, num_splits=2,
                     kernel_mods=dict(score_mod=mods.relative_bias(table)), reference_mods=dict(score_mod=twin))
