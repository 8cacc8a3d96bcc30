"""flash_attn_varlen_func and friends: every sequence of a packed batch against the float64
reference run on that sequence alone (outputs, lse, gradients), and the padding utilities."""

import functools

import pytest
import torch

from flashtile import (flash_attn_func, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func, pad_input, unpad_input)
from flashtile.configs import override
from flashtile.reference import attention_varlen_naive

from _cases import DEVICE, DTYPES, ON_GPU, check_against_reference, randn

# Length mixes with empty and single-token sequences; (query lengths, key lengths).
LENGTHS = ([([0, 1, 113, 1023, 64, 700], [5, 1, 113, 1023, 0, 899]), ([257] * 3, [257] * 3),
            ([1, 2, 3, 2048], [3, 1, 2048, 2048])]
           if ON_GPU else [([0, 1, 37, 64, 5], [3, 1, 37, 50, 0]), ([40, 40], [40, 40]), ([1, 70], [65, 2])])
HEAD_DIMS = [40, 64, 128, 256] if ON_GPU else [32, 40]
NHEADS = 4


def cu_seqlens(lengths):
    return torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)


def make_packed(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype):
    q = randn(sum(lengths_q), nheads, head_dim, dtype=dtype, requires_grad=True)
    k = randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, requires_grad=True)
    v = randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, requires_grad=True)
    return q, k, v


def check_varlen(lengths_q, lengths_k, q, k, v, seqused_q=None, seqused_k=None, **options):
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    fn = functools.partial(flash_attn_varlen_func, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k),
                           seqused_q=seqused_q, seqused_k=seqused_k)
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                  seqused_q=seqused_q, seqused_k=seqused_k)
    check_against_reference(fn, q, k, v, reference=reference, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("lengths_q,lengths_k", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(dtype, head_dim, lengths_q, lengths_k, causal):
    q, k, v = make_packed(lengths_q, lengths_k, NHEADS, NHEADS, head_dim, dtype)
    check_varlen(lengths_q, lengths_k, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_random_lengths(dtype, causal):
    """A fresh random mix per run (seeded per test id), with an empty and a one-token sequence."""
    top = 1100 if ON_GPU else 90
    lengths_q = [0, 1] + torch.randint(1, top, (5,)).tolist()
    lengths_k = torch.randint(0, top, (7,)).tolist()
    order = torch.randperm(7).tolist()
    lengths_q = [lengths_q[i] for i in order]
    q, k, v = make_packed(lengths_q, lengths_k, NHEADS, 2, 64, dtype)
    check_varlen(lengths_q, lengths_k, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads_k", [1, 2])
@pytest.mark.parametrize("options", [dict(causal=True, window_size=(24, -1)), dict(window_size=(16, 8)),
                                     dict(softcap=5.0, causal=True), dict(alibi="batch"), dict(alibi="heads")])
def test_varlen_options(dtype, nheads_k, options):
    lengths_q, lengths_k = LENGTHS[0]
    q, k, v = make_packed(lengths_q, lengths_k, NHEADS, nheads_k, 64, dtype)
    options = dict(options)
    alibi = options.pop("alibi", None)
    if alibi is not None:
        shape = (len(lengths_q), NHEADS) if alibi == "batch" else (NHEADS,)
        options["alibi_slopes"] = torch.rand(shape, device=DEVICE, dtype=torch.float32) * 0.3
    check_varlen(lengths_q, lengths_k, q, k, v, **options)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_dropout(dtype):
    lengths_q, lengths_k = LENGTHS[0]
    q, k, v = make_packed(lengths_q, lengths_k, NHEADS, 2, 32, dtype)
    check_varlen(lengths_q, lengths_k, q, k, v, dropout_p=0.2, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_seqused(dtype, causal):
    """Sequences use a prefix of the tokens cu_seqlens reserves; the rest stay out of the math."""
    lengths_q, lengths_k = LENGTHS[0]
    q, k, v = make_packed(lengths_q, lengths_k, NHEADS, 2, 32, dtype)
    used_q = torch.tensor([n - n // 3 for n in lengths_q], dtype=torch.int32, device=DEVICE)
    used_k = torch.tensor([n - n // 4 for n in lengths_k], dtype=torch.int32, device=DEVICE)
    check_varlen(lengths_q, lengths_k, q, k, v, seqused_q=used_q, seqused_k=used_k, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_packed_variants(dtype):
    lengths = LENGTHS[0][0]
    cu, max_len = cu_seqlens(lengths), max(lengths)
    qkv = randn(sum(lengths), 3, NHEADS, 40, dtype=dtype, requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, max_len, causal=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(dim=1))
    ref = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(dqkv, torch.stack(ref_grads, dim=1), rtol=0, atol=0)

    kv = torch.stack([k, v], dim=1).detach().requires_grad_()
    out = flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max_len, max_len, causal=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(dkv, torch.stack(ref_grads[1:], dim=1), rtol=0, atol=0)


def test_varlen_matches_dense_on_equal_lengths():
    """Equal lengths: the packed batch is the dense batch; the same kernels give the same bits."""
    batch, seqlen, dtype = 3, 70, torch.float16
    q, k, v = (randn(batch, seqlen, NHEADS, 32, dtype=dtype) for _ in range(3))
    dense = flash_attn_func(q, k, v, causal=True)
    cu = cu_seqlens([seqlen] * batch)
    packed = flash_attn_varlen_func(*(t.reshape(batch * seqlen, NHEADS, 32) for t in (q, k, v)), cu, cu,
                                    seqlen, seqlen, causal=True)
    torch.testing.assert_close(packed.reshape(batch, seqlen, NHEADS, 32), dense, rtol=0, atol=0)


def test_varlen_deterministic_backward():
    lengths_q, lengths_k = LENGTHS[0]
    q, k, v = make_packed(lengths_q, lengths_k, NHEADS, 2, 64, DTYPES[0])
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                     deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_empty_batch_and_all_empty_sequences():
    q, k, v = make_packed([0, 0], [0, 3], NHEADS, NHEADS, 32, DTYPES[0])
    out = flash_attn_varlen_func(q, k, v, cu_seqlens([0, 0]), cu_seqlens([0, 3]), 0, 3)
    assert out.shape == (0, NHEADS, 32)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dk.shape == k.shape and torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


# ---------------------------------------------------------------------------------------------
# Padding utilities
# ---------------------------------------------------------------------------------------------

def test_unpad_pad_round_trip_and_gradients():
    batch, seqlen = 3, 9
    hidden = randn(batch, seqlen, 2, 5, dtype=torch.float32, requires_grad=True)
    mask = torch.zeros(batch, seqlen, dtype=torch.bool, device=DEVICE)
    mask[0, :4] = True
    mask[2, 2:9] = True  # left padding works too: tokens are packed in position order
    packed, indices, cu, max_len, used = unpad_input(hidden, mask)
    assert packed.shape == (11, 2, 5) and max_len == 7
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 4, 11] and used.tolist() == [4, 0, 7]
    torch.testing.assert_close(packed, hidden[mask])
    restored = pad_input(packed, indices, batch, seqlen)
    torch.testing.assert_close(restored, hidden * mask[..., None, None])
    weights = torch.randn_like(restored)
    (grad,) = torch.autograd.grad((restored * weights).sum(), hidden)
    torch.testing.assert_close(grad, weights * mask[..., None, None])


def test_unpad_with_unused_tokens():
    hidden = randn(2, 6, 3, dtype=torch.float32)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], device=DEVICE)
    unused = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1]], device=DEVICE)
    packed, indices, cu, max_len, used = unpad_input(hidden, mask, unused)
    assert cu.tolist() == [0, 4, 10] and used.tolist() == [2, 5] and max_len == 6


def test_padded_attention_through_varlen():
    """The usual pattern: unpad, varlen attention, pad back; padded rows come out zero."""
    batch, seqlen, dtype = 2, 50, DTYPES[0]
    qkv = randn(batch, seqlen, 3, NHEADS, 32, dtype=dtype)
    mask = torch.arange(seqlen, device=DEVICE)[None, :] < torch.tensor([[37], [50]], device=DEVICE)
    packed, indices, cu, max_len, _ = unpad_input(qkv, mask)
    out = pad_input(flash_attn_varlen_qkvpacked_func(packed, cu, max_len, causal=True), indices, batch, seqlen)
    for b, n in enumerate((37, 50)):
        dense = flash_attn_func(*qkv[b:b + 1, :n].unbind(dim=2), causal=True)
        torch.testing.assert_close(out[b:b + 1, :n], dense, rtol=2e-3, atol=2e-3)
    assert torch.equal(out[0, 37:], torch.zeros_like(out[0, 37:]))


# ---------------------------------------------------------------------------------------------
# Paged K/V (block_table): inference over a cache scattered in fixed-size pages
# ---------------------------------------------------------------------------------------------

def to_pages(k, lengths_k, page_size, extra_pages=3):
    """k (total_k, hk, d) -> a shuffled page pool (num_pages, page_size, hk, d) and the block table
    (batch, pages per sequence) that finds every sequence's keys in it; unused slots hold NaN."""
    pages_per_seq = max(1, max(-(-n // page_size) for n in lengths_k))
    num_pages = len(lengths_k) * pages_per_seq + extra_pages
    order = torch.randperm(num_pages).tolist()
    pool = torch.full((num_pages, page_size) + tuple(k.shape[1:]), float("nan"), dtype=k.dtype, device=k.device)
    table = torch.zeros(len(lengths_k), pages_per_seq, dtype=torch.int32)
    start = 0
    for b, n in enumerate(lengths_k):
        for p in range(pages_per_seq):
            page = order.pop()
            table[b, p] = page
            rows = k[start + p * page_size:start + min(n, (p + 1) * page_size)]
            pool[page, :rows.shape[0]] = rows
        start += n
    return pool, table.to(k.device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 48])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_kv(dtype, page_size, causal):
    lengths_q, lengths_k = LENGTHS[0]
    q, k, v = make_packed(lengths_q, lengths_k, NHEADS, 2, 64, dtype)
    kv_pages, table = to_pages(torch.stack([k, v], dim=1).detach(), lengths_k, page_size)
    k_pages, v_pages = kv_pages[:, :, 0], kv_pages[:, :, 1]  # strided views: one table for both
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    with torch.no_grad():
        paged, lse, _ = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                               causal=causal, block_table=table, return_attn_probs=True)
        # Paged K/V runs on the portable kernel: so must the packed run it is compared with bit for bit.
        with override(fwd_gluon=None):
            packed, packed_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                           causal=causal, return_attn_probs=True)
    torch.testing.assert_close(paged, packed, rtol=0, atol=0)
    torch.testing.assert_close(lse, packed_lse, rtol=0, atol=0)


def test_paged_kv_is_inference_only():
    lengths = [5, 9]
    q, k, v = make_packed(lengths, lengths, NHEADS, 2, 32, DTYPES[0])
    k_pages, table = to_pages(k.detach(), lengths, 16)
    cu = cu_seqlens(lengths)
    # As in flash_attn, the forward runs on inputs that require grad; only a backward raises.
    out = flash_attn_varlen_func(q, k_pages, k_pages, cu, cu, 9, 9, block_table=table)
    assert out.requires_grad and torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match="block_table \\(paged K/V\\) serves inference"):
        out.sum().backward()
    with pytest.raises(ValueError, match="block_table has shape \\(1, 1\\); expected \\(2, pages per sequence\\)"):
        with torch.no_grad():
            flash_attn_varlen_func(q, k_pages, k_pages, cu, cu, 9, 9, block_table=table[:1])
