"""Dropout: reproducible under torch.manual_seed, drops the right fraction, unbiased,
and the backward regenerates exactly the forward's mask."""

import pytest
import torch

from flashtile import flash_attn_func
from flashtile.reference import attention_naive, visible_keys_mask
from flashtile.testing import rel_error

from _cases import DEVICE, DTYPES, check_against_reference, make_qkv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (20, 10))])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 60), (37, 128)])
def test_dropout_matches_reference_with_its_mask(dtype, causal, window_size, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 40, dtype)
    check_against_reference(flash_attn_func, q, k, v, dropout_p=0.17, causal=causal, window_size=window_size)


def test_dropout_with_softcap_and_alibi():
    q, k, v = make_qkv(2, 60, 60, 2, 2, 32, torch.float16)
    slopes = torch.rand(2, device=DEVICE) * 0.2
    check_against_reference(flash_attn_func, q, k, v, dropout_p=0.25, softcap=10.0, alibi_slopes=slopes,
                            causal=True)


def test_reproducible_with_manual_seed():
    q, k, v = make_qkv(2, 70, 90, 2, 2, 32, torch.float16)
    results = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        out = flash_attn_func(q, k, v, dropout_p=0.3)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out, *grads))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1])), "same seed, different result"
    assert not torch.equal(results[0][0], results[2][0]), "different seeds gave the same dropout"


def test_successive_calls_draw_new_masks():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 32, torch.float16, requires_grad=False)
    assert not torch.equal(flash_attn_func(q, k, v, dropout_p=0.5), flash_attn_func(q, k, v, dropout_p=0.5))


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_drop_fraction(dropout_p):
    """Among the visible entries, the kept fraction is 1 - p within 5 standard deviations."""
    q, k, v = make_qkv(2, 128, 96, 2, 2, 32, torch.float16, requires_grad=False)
    _, _, probs = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True, return_attn_probs=True)
    visible = visible_keys_mask(128, 96, causal=True, device=q.device).expand_as(probs)
    kept = (probs[visible] > 0).double()
    n = kept.numel()
    sigma = (dropout_p * (1 - dropout_p) / n) ** 0.5
    assert abs(kept.mean().item() - (1 - dropout_p)) < 5 * sigma
    assert torch.all(probs[~visible] == 0)


def test_unbiased_on_average():
    """E[dropout(P) @ v] = P @ v: the mean over many draws approaches the undropped output."""
    q, k, v = make_qkv(1, 32, 32, 2, 2, 16, torch.float32, requires_grad=False)
    draws = 300
    mean = sum(flash_attn_func(q, k, v, dropout_p=0.4).double() for _ in range(draws)) / draws
    exact, _ = attention_naive(q, k, v)
    single = rel_error(flash_attn_func(q, k, v, dropout_p=0.4), exact)
    # One draw is off by ~single; the mean of independent draws shrinks like 1/sqrt(draws).
    assert rel_error(mean, exact) < 3 * single / draws**0.5


def test_lse_ignores_dropout():
    q, k, v = make_qkv(1, 50, 50, 2, 2, 32, torch.float16, requires_grad=False)
    _, lse_dropped, _ = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    _, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(lse_dropped, lse)
