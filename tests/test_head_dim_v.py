"""A value head dim of its own (head_dim_v != head_dim_qk, DeepSeek-style 192 / 128): v is (..., dv)
and the output takes dv. Forward, lse and gradients against float64 through flash_attn_func (the
decode route included), flash_attn_varlen_func and flash_attn_with_kvcache (appending new tokens,
contiguous and paged), with causal, windows, GQA, odd lengths, softcap, ALiBi, dropout, sinks,
attn_bias and a score_mod; the deterministic backward; the Hopper path's reason; and the errors."""

import functools

import pytest
import torch

import flashtile
from flashtile.reference import attention_naive, attention_varlen_naive

from _cases import DEVICE, DTYPES, ON_GPU, check_against_reference, make_packed_qkv, make_qkv, randn

# (head_dim_qk, head_dim_v): narrower and wider values, both not powers of two.
# On the GPU: the Hopper forward and backward (192 / 128, and 256 / 96: padded value tiles; 128 / 64 and
# 96 / 128 on the two-warpgroup backward), the Hopper forward with the portable backward (128 / 256), the
# portable kernels (64 / 200).
DIMS = ([(40, 24), (32, 72)] if not ON_GPU
        else [(192, 128), (256, 96), (128, 64), (96, 128), (128, 256), (64, 200)])
SEQLENS = [(113, 203), (1, 37), (60, 37)] if not ON_GPU else [(1023, 1023), (113, 1500), (1, 4096)]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))]


def make(batch, seqlen_q, seqlen_k, nheads, nheads_k, dims, dtype, requires_grad=True):
    """q, k (head dim dims[0]) and v (head dim dims[1])."""
    q, k, _ = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, dims[0], dtype, requires_grad)
    v = randn(batch, seqlen_k, nheads_k, dims[1], dtype=dtype, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES if ON_GPU else DTYPES[:1])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("mask", MASKS)
def test_dense(dtype, dims, seqlens, mask):
    causal, window = mask
    q, k, v = make(2, *seqlens, 4, 2, dims, dtype)
    out = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert out.shape == (2, seqlens[0], 4, dims[1])
    check_against_reference(flashtile.flash_attn_func, q, k, v, causal=causal, window_size=window)


@pytest.mark.parametrize("options", [
    dict(softcap=5.0, causal=True),
    dict(alibi_slopes="per-head"),
    dict(dropout_p=0.17, causal=True),
    dict(deterministic=True, window_size=(20, 3)),
], ids=["softcap", "alibi", "dropout", "deterministic"])
def test_options(options):
    dims, dtype = DIMS[0], DTYPES[0]
    q, k, v = make(2, 77, 130, 4, 2, dims, dtype)
    if options.get("alibi_slopes") == "per-head":
        options = dict(options, alibi_slopes=torch.rand(4, device=DEVICE) * 0.3)
    check_against_reference(flashtile.flash_attn_func, q, k, v, **options)


def test_deterministic_is_bit_identical():
    q, k, v = make(1, 90, 150, 4, 1, DIMS[-1], DTYPES[0])
    runs = []
    for _ in range(2):
        out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("which", [0, 2] if ON_GPU else [0])
def test_varlen(seqused, which):
    dims, dtype = DIMS[which], DTYPES[0]
    q, k, _, cu_q, cu_k = make_packed_qkv([30, 1, 47, 0], [40, 9, 60, 5], 4, 2, dims[0], dtype)
    v = randn(k.shape[0], 2, dims[1], dtype=dtype, requires_grad=True)
    used = {}
    if seqused:
        used = {"seqused_q": torch.tensor([20, 1, 40, 0], dtype=torch.int32, device=DEVICE),
                "seqused_k": torch.tensor([33, 9, 50, 5], dtype=torch.int32, device=DEVICE)}
    fn = functools.partial(flashtile.flash_attn_varlen_func, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=47,
                           max_seqlen_k=60, **used)
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **used)
    check_against_reference(lambda q, k, v, **options: fn(q, k, v, **options)[:2] + (torch.zeros(1),), q, k, v,
                            reference=reference, causal=True)


def test_decode_rows_of_one_sequence_each():
    # One query per sequence and GQA: the decode route, its heads as rows and split-KV.
    dims, dtype = DIMS[1], DTYPES[0]
    q, k, v = make(3, 1, 300 if not ON_GPU else 8192, 8, 2, dims, dtype, requires_grad=False)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    ref_out, ref_lse = attention_naive(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_kvcache_appends_and_attends(paged, seqlen_q):
    (d, dv), dtype, batch, nheads, nheads_k, capacity, new = DIMS[0], DTYPES[0], 3, 4, 2, 96, 2
    q = randn(batch, seqlen_q, nheads, d, dtype=dtype)
    k_new, v_new = randn(batch, new, nheads_k, d, dtype=dtype), randn(batch, new, nheads_k, dv, dtype=dtype)
    k_cache = randn(batch, capacity, nheads_k, d, dtype=dtype)
    v_cache = randn(batch, capacity, nheads_k, dv, dtype=dtype)
    seqlens = torch.tensor([50, 7, 90], dtype=torch.int32, device=DEVICE)
    extra = {}
    k_pool, v_pool = k_cache.clone(), v_cache.clone()
    if paged:  # pages of 16 rows, in reverse order in the pool
        pages = capacity // 16
        order = torch.arange(batch * pages, device=DEVICE).flip(0).view(batch, pages)
        k_pool = torch.empty(batch * pages, 16, nheads_k, d, dtype=dtype, device=DEVICE)
        v_pool = torch.empty(batch * pages, 16, nheads_k, dv, dtype=dtype, device=DEVICE)
        k_pool[order.flatten()] = k_cache.view(batch * pages, 16, nheads_k, d)
        v_pool[order.flatten()] = v_cache.view(batch * pages, 16, nheads_k, dv)
        extra["block_table"] = order.to(torch.int32)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                                 return_softmax_lse=True, **extra)
    assert out.shape == (batch, seqlen_q, nheads, dv)
    for b in range(batch):
        n = int(seqlens[b])
        keys = torch.cat([k_cache[b:b + 1, :n], k_new[b:b + 1]], 1)
        values = torch.cat([v_cache[b:b + 1, :n], v_new[b:b + 1]], 1)
        ref_out, ref_lse = attention_naive(q[b:b + 1], keys, values, causal=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref_out, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=1e-4, atol=1e-4)
    if paged:  # the new values landed in their pages
        written = v_pool[order.flatten()].view(batch, capacity, nheads_k, dv)
        for b in range(batch):
            n = int(seqlens[b])
            assert torch.equal(written[b, n:n + new], v_new[b])


def test_with_sink_bias_and_score_mod():
    dims, dtype = DIMS[1], DTYPES[0]
    q, k, v = make(2, 45, 70, 4, 2, dims, dtype)
    sink = (torch.randn(4, device=DEVICE) + 3).requires_grad_()
    check_against_reference(flashtile.flash_attn_func, q, k, v, causal=True, learnable_sink=sink)
    bias = randn(4, 45, 70, dtype=torch.float32, requires_grad=True)
    check_against_reference(flashtile.flash_attn_func, q, k, v, window_size=(30, 10), attn_bias=bias)
    table = randn(4, 2 * 16 + 1, dtype=torch.float32)

    def twin(s, b, h, i, j):  # the reference's form of relative_bias(table)
        return s + table.to(s.dtype)[h, (j - i).clamp(-16, 16) + 16]
    check_against_reference(functools.partial(flashtile.flash_attn_func, score_mod=flashtile.mods.relative_bias(table)),
                            q, k, v, reference=functools.partial(attention_naive, score_mod=twin), causal=True)


def test_hopper_path_says_why():
    """The Hopper forward takes head_dim_v != head_dim_qk at the head dims it has tiles for, the backward
    with value tiles no wider than the queries' up to head dim 128, and v head dims above 64 beyond it."""
    q, k, v = make(1, 256, 256, 4, 4, (192, 128), DTYPES[0], requires_grad=False)
    explanation = flashtile.explain(q, k, v, causal=True, device_capability=(9, 0))
    assert explanation.forward.path == "hopper" and explanation.backward.path == "hopper"
    q, k, v = make(1, 256, 256, 4, 4, (128, 64), DTYPES[0], requires_grad=False)
    explanation = flashtile.explain(q, k, v, causal=True, device_capability=(9, 0))
    assert explanation.forward.path == "hopper" and explanation.backward.path == "hopper"
    q, k, v = make(1, 256, 256, 4, 4, (64, 128), DTYPES[0], requires_grad=False)
    explanation = flashtile.explain(q, k, v, causal=True, device_capability=(9, 0))
    assert explanation.forward.path == "hopper"
    assert explanation.backward.path == "portable" and "v has head dim 128 and q has 64" in explanation.backward.reason
    # A value head dim the Hopper kernels have no tiles for.
    q, k, v = make(1, 256, 256, 4, 4, (128, 40), DTYPES[0], requires_grad=False)
    explanation = flashtile.explain(q, k, v, device_capability=(9, 0))
    assert explanation.forward.path == "portable" and "head dim 128 (v: 40)" in explanation.forward.reason


def test_errors():
    q, k, v = make(2, 30, 40, 4, 2, (32, 48), DTYPES[0], requires_grad=False)
    with pytest.raises(ValueError, match=r"v has shape \(2, 41, 2, 48\); expected the shape of k"):
        flashtile.flash_attn_func(q, k, torch.cat([v, v[:, :1]], 1))
    with pytest.raises(ValueError, match=r"head dim 300 of v is not supported"):
        flashtile.flash_attn_func(q, k, randn(2, 40, 2, 300, dtype=q.dtype))
    with pytest.raises(ValueError, match="k has head dim 48 but q has 32"):
        flashtile.flash_attn_func(q, v, v)
    with pytest.raises(ValueError, match=r"v has shape \(2, 1, 2, 32\); expected \(batch, seqlen_new"):
        flashtile.flash_attn_with_kvcache(q[:, :1], k, v, k[:, :1], k[:, :1], cache_seqlens=3)
