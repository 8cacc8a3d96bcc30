"""flash_attn_func against the float64 reference: output, lse and gradients, over shapes,
head dims, masks and dtypes (the FlashAttention tolerance rule, see flashtile.testing)."""

import pytest
import torch

from flashtile import flash_attn_func

from _cases import (BATCH, DEVICE, DTYPES, HEAD_DIMS, MASKS, NHEADS, ON_GPU, SEQLENS, check_against_reference,
                    make_qkv, randn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal,window_size", MASKS[:2])
def test_dense(dtype, head_dim, seqlen_q, seqlen_k, causal, window_size):
    q, k, v = make_qkv(BATCH, seqlen_q, seqlen_k, NHEADS, NHEADS, head_dim, dtype)
    check_against_reference(flash_attn_func, q, k, v, causal=causal, window_size=window_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal,window_size", MASKS[2:])
def test_sliding_window(dtype, seqlen_q, seqlen_k, causal, window_size):
    q, k, v = make_qkv(BATCH, seqlen_q, seqlen_k, NHEADS, NHEADS, 64, dtype)
    check_against_reference(flash_attn_func, q, k, v, causal=causal, window_size=window_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads,nheads_k", [(4, 1), (6, 2), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(37, 113), (113, 37)])
def test_gqa_mqa(dtype, nheads, nheads_k, causal, seqlen_q, seqlen_k):
    q, k, v = make_qkv(BATCH, seqlen_q, seqlen_k, nheads, nheads_k, 40, dtype)
    check_against_reference(flash_attn_func, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(dtype, softcap, causal):
    q, k, v = make_qkv(BATCH, 113, 97, NHEADS, NHEADS, 64, dtype)
    # Larger logits, so the cap is actually reached.
    check_against_reference(flash_attn_func, q * 3, k, v, softcap=softcap, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (20, 10))])
def test_alibi(dtype, per_batch, causal, window_size):
    q, k, v = make_qkv(BATCH, 113, 60, NHEADS, NHEADS, 32, dtype)
    shape = (BATCH, NHEADS) if per_batch else (NHEADS,)
    slopes = torch.rand(shape, device=q.device, dtype=torch.float32) * 0.3
    check_against_reference(flash_attn_func, q, k, v, alibi_slopes=slopes, causal=causal,
                            window_size=window_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softmax_scale", [0.05, 0.5])
def test_softmax_scale(dtype, softmax_scale):
    q, k, v = make_qkv(BATCH, 60, 113, NHEADS, NHEADS, 40, dtype)
    check_against_reference(flash_attn_func, q, k, v, softmax_scale=softmax_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 60), (37, 113)])
def test_all_options_together(dtype, seqlen_q, seqlen_k):
    """GQA + window + softcap + per-batch ALiBi + custom scale at once."""
    q, k, v = make_qkv(BATCH, seqlen_q, seqlen_k, 4, 2, 40, dtype)
    slopes = torch.rand(BATCH, 4, device=q.device, dtype=torch.float32) * 0.2
    check_against_reference(flash_attn_func, q * 2, k, v, causal=True, window_size=(30, -1), softcap=8.0,
                            alibi_slopes=slopes, softmax_scale=0.2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_keys(dtype):
    """Causal with seqlen_q > seqlen_k leaves the first rows with no key: out 0, lse -inf,
    and no NaN in the gradients."""
    q, k, v = make_qkv(1, 70, 20, 2, 2, 32, dtype)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :50] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :50]))
    assert torch.isfinite(lse[:, :, 50:]).all()
    check_against_reference(flash_attn_func, q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_outside_keys(dtype):
    """sq > sk with window (0, 5): row i sees keys i - 60 .. i - 55, so rows below 55 see none."""
    q, k, v = make_qkv(1, 100, 40, 2, 2, 32, dtype)
    check_against_reference(flash_attn_func, q, k, v, window_size=(0, 5))


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_wide_heads(head_dim, causal):
    """float32 inputs at head dims 128 and 256: the config tables size tiles for 16-bit inputs, whose
    pipelines need twice the shared memory in float32 (on sm90, more than the GPU has); the plans
    shrink them until they fit."""
    q, k, v = make_qkv(1, 150, 211, 2, 1, head_dim, torch.float32)
    check_against_reference(flash_attn_func, q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_float32_wide_heads_decoding(head_dim):
    """The same for decode-shaped calls (the decode kernels, split-KV and its combine), through
    flash_attn_func and flash_attn_with_kvcache: their plans shrink too."""
    import flashtile
    from flashtile.reference import attention_naive

    q, k, v = make_qkv(2, 1, 300, 4, 2, head_dim, torch.float32)
    check_against_reference(flash_attn_func, q, k, v, causal=True)
    with torch.no_grad():
        seqlens = torch.tensor([300, 77], dtype=torch.int32, device=DEVICE)
        out = flashtile.flash_attn_with_kvcache(q, k.detach(), v.detach(), cache_seqlens=seqlens, num_splits=3)
        for b in range(2):
            n = int(seqlens[b])
            expected, _ = attention_naive(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
            torch.testing.assert_close(out[b:b + 1].double(), expected, rtol=1e-4, atol=1e-4)


def test_gluon_head_chunks_cover_whole_kv_groups():
    from flashtile.kernels.hopper.launch import GLUON_DQ_CHUNK_BYTES, gluon_head_chunks

    assert gluon_head_chunks(4, 4096, 16, 16, 128) == [(0, 16, 0, 16)]  # the sweep's shapes: one launch
    chunks = gluon_head_chunks(1, 131072, 16, 16, 128)  # 1 GiB of float32 dQ without chunks
    assert [c[:2] for c in chunks] == [(h, h + 1) for h in range(16)]
    assert all(4 * 131072 * (h1 - h0) * 128 <= GLUON_DQ_CHUNK_BYTES for h0, h1, _, _ in chunks)
    gqa = gluon_head_chunks(1, 65536, 32, 8, 128)  # groups of 4 query heads: one KV head per chunk
    assert gqa == [(4 * h, 4 * h + 4, h, h + 1) for h in range(8)]
    assert gluon_head_chunks(1, 131072, 64, 1, 128) == [(0, 64, 0, 1)]  # MQA cannot be split


@pytest.mark.parametrize("packed", [False, True])
def test_preprocess_zeroes_the_dq_accumulator(packed):
    """The backward preprocess (delta, lse in log2 units) zeroes the Gluon backward's float32 dQ
    accumulator in the same pass: every row of every sequence, in a poisoned buffer, head-strided
    like a head chunk; delta and lse_log2 come out as without it."""
    from flashtile.options import PackedSeqs
    from flashtile.kernels.portable.launch import launch_preprocess, row_stats_buffers

    lens = [37, 1, 90]
    batch, seqlen, nheads, head_dim = (1, sum(lens), 3, 40) if packed else (2, 113, 3, 40)
    out, dout = (randn(batch, seqlen, nheads, head_dim, dtype=torch.float16) for _ in range(2))
    lse = randn(batch, nheads, seqlen, dtype=torch.float32)
    seqs = None
    if packed:
        cu = torch.tensor([0, 37, 38, 128], dtype=torch.int32, device=DEVICE)
        seqs = PackedSeqs(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=90, max_seqlen_k=90)
    # A head slice of a wider buffer: the kernel must follow its strides.
    wide = torch.full((batch, seqlen, nheads + 2, head_dim), float("nan"), device=DEVICE)
    acc = wide[:, :, 1:1 + nheads]
    expected = [t.clone() for t in row_stats_buffers(lse)]
    launch_preprocess(out, dout, lse, *expected, seqs)
    delta, lse_log2 = row_stats_buffers(lse)
    launch_preprocess(out, dout, lse, delta, lse_log2, seqs, zero=acc)
    assert torch.equal(acc, torch.zeros_like(acc))
    assert wide[:, :, 0].isnan().all() and wide[:, :, -1].isnan().all()
    torch.testing.assert_close(delta, expected[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse_log2, expected[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon backward runs on sm90 only")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads,nheads_k", [(6, 6), (6, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_in_head_chunks(monkeypatch, dtype, nheads, nheads_k, causal):
    """The long-context memory saver (a Gluon backward per group of heads) on small shapes."""
    from flashtile.kernels.hopper import launch

    monkeypatch.setattr(launch, "GLUON_DQ_ACCUMULATOR_LIMIT", 0)
    monkeypatch.setattr(launch, "GLUON_DQ_CHUNK_BYTES", 1)
    q, k, v = make_qkv(BATCH, 239, 303, nheads, nheads_k, 128, dtype)
    check_against_reference(flash_attn_func, q, k, v, causal=causal)
