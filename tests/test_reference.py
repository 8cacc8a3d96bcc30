"""The references themselves: the blockwise online softmax equals the naive definition,
the naive one agrees with torch's SDPA, and the semantic facts of the contract hold."""

import pytest
import torch
import torch.nn.functional as F

from flashtile.reference import attention_blockwise, attention_naive, visible_keys_mask
from flashtile.testing import rel_error


def _qkv(b, sq, sk, h, hk, d):
    return (torch.randn(b, sq, h, d, dtype=torch.float64), torch.randn(b, sk, hk, d, dtype=torch.float64),
            torch.randn(b, sk, hk, d, dtype=torch.float64))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (37, 37), (113, 60), (60, 113)])
@pytest.mark.parametrize("options", [
    {}, {"causal": True}, {"window_size": (10, 3)}, {"causal": True, "window_size": (5, -1)},
    {"softcap": 2.0}, {"alibi": True}, {"alibi": True, "causal": True, "softcap": 5.0},
])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64)])
def test_blockwise_equals_naive(seqlen_q, seqlen_k, options, block_m, block_n):
    options = dict(options)
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 4, 2, 24)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(2, 4, dtype=torch.float32)
    out, lse = attention_naive(q, k, v, **options)
    out_b, lse_b = attention_blockwise(q, k, v, block_m=block_m, block_n=block_n, dtype=torch.float64, **options)
    assert rel_error(out_b, out) < 1e-12
    assert torch.equal(torch.isneginf(lse_b), torch.isneginf(lse))
    finite = torch.isfinite(lse)
    assert torch.allclose(lse_b[finite], lse[finite], atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_naive_agrees_with_sdpa(causal):
    q, k, v = _qkv(2, 50, 50, 3, 3, 16)
    out, _ = attention_naive(q, k, v, causal=causal)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)
    assert rel_error(out, sdpa) < 1e-12


def test_causal_is_bottom_right_aligned():
    keep = visible_keys_mask(2, 5, causal=True)
    assert keep.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    keep = visible_keys_mask(5, 2, causal=True)
    assert keep.sum(1).tolist() == [0, 0, 0, 1, 2]


def test_window_is_inclusive_around_the_diagonal():
    keep = visible_keys_mask(4, 4, window_size=(1, 1))
    assert keep.int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]


def test_causal_alibi_is_a_row_shift():
    """Under causal, -slope*|i + sk - sq - j| differs from -slope*(sk - 1 - j) by a per-row constant."""
    q, k, v = _qkv(1, 20, 30, 2, 2, 8)
    slopes = torch.tensor([0.3, 0.7])
    out, _ = attention_naive(q, k, v, causal=True, alibi_slopes=slopes)
    keep = visible_keys_mask(20, 30, causal=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
    s = s - slopes.double()[None, :, None, None] * (29 - torch.arange(30, dtype=torch.float64))
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    assert rel_error(torch.einsum("bhqk,bkhd->bqhd", p, v), out) < 1e-12


def test_row_without_keys_is_zero():
    q, k, v = _qkv(1, 6, 3, 1, 1, 4)
    out, lse = attention_naive(q, k, v, causal=True)
    assert torch.all(out[:, :3] == 0) and torch.all(torch.isneginf(lse[:, :, :3]))
