"""The public surface: packed variants, strided views, autograd modes, returned
probabilities, determinism, incoming gradients of any stride, empty sizes."""

import pytest
import torch

from flashtile import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashtile.reference import attention_naive
from flashtile.testing import rel_error

from _cases import DEVICE, DTYPES, check_against_reference, make_qkv, randn


def _via_qkvpacked(q, k, v, **options):
    return flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), **options)


def _via_kvpacked(q, k, v, **options):
    return flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked(dtype, causal):
    q, k, v = make_qkv(2, 113, 113, 4, 4, 40, dtype)
    check_against_reference(_via_qkvpacked, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads_k", [1, 2])
def test_kvpacked_gqa(dtype, nheads_k):
    q, k, v = make_qkv(2, 60, 113, 4, nheads_k, 64, dtype)
    check_against_reference(_via_kvpacked, q, k, v, causal=True, window_size=(40, -1))


def test_packed_gradients_land_in_one_tensor():
    qkv = randn(2, 50, 3, 2, 32, dtype=torch.float16, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    (dqkv,) = torch.autograd.grad(out, qkv, torch.randn_like(out))
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype and torch.isfinite(dqkv).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(dtype):
    """(b, h, s, d) tensors transposed, and a head-dim slice of a wider tensor: no copies needed."""
    q = randn(2, 4, 70, 32, dtype=dtype).transpose(1, 2).requires_grad_()
    k = randn(2, 4, 90, 32, dtype=dtype).transpose(1, 2).requires_grad_()
    wide = randn(2, 90, 4, 80, dtype=dtype)
    v = wide[..., 8:40].requires_grad_()
    assert not q.is_contiguous() and not v.is_contiguous() and v.stride(-1) == 1
    check_against_reference(flash_attn_func, q, k, v, causal=True)


def test_no_grad_and_partial_requires_grad():
    q, k, v = make_qkv(1, 40, 40, 2, 2, 32, torch.float16, requires_grad=False)
    with torch.no_grad():
        out = flash_attn_func(q, k, v)
    assert out.grad_fn is None
    k.requires_grad_()
    out = flash_attn_func(q, k, v)
    (dk,) = torch.autograd.grad(out.sum(), k)
    ref_k = k.detach().double().requires_grad_()
    ref_out, _ = attention_naive(q, ref_k, v)
    (ref_dk,) = torch.autograd.grad(ref_out.sum(), ref_k)
    assert rel_error(dk, ref_dk) < 5e-3


def test_expanded_incoming_gradient():
    """out.sum().backward() hands the backward a stride-0 gradient."""
    q, k, v = make_qkv(1, 37, 37, 2, 2, 32, torch.float32)
    flash_attn_func(q, k, v, causal=True).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_naive(*leaves, causal=True)[0].sum().backward()
    for ours, ref in zip((q, k, v), leaves):
        assert rel_error(ours.grad, ref.grad) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_returned_probabilities(dtype):
    q, k, v = make_qkv(2, 60, 70, 4, 2, 32, dtype, requires_grad=False)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs.shape == (2, 4, 60, 70) and probs.dtype == dtype
    assert lse.shape == (2, 4, 60) and lse.dtype == torch.float32
    ref_out, _ = attention_naive(q, k, v, causal=True)
    # P @ v with the returned P reproduces the output.
    p_v = torch.einsum("bhqk,bkhd->bqhd", probs.double(), v.double().repeat_interleave(2, dim=2))
    assert rel_error(p_v, ref_out) < 1e-2
    sums = probs.double().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-2)


@pytest.mark.parametrize("nheads_k", [1, 4])
def test_backward_is_deterministic(nheads_k):
    q, k, v = make_qkv(2, 113, 113, 4, nheads_k, 64, torch.float16)
    dout = torch.randn(2, 113, 4, 64, device=DEVICE, dtype=torch.float16)
    runs = [torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
            for _ in range(3)]
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))


@pytest.mark.parametrize("head_dim", [32, 128])  # 128: a head dim the Hopper kernels take
def test_empty_sizes(head_dim):
    q, k, v = make_qkv(2, 0, 16, 2, 2, head_dim, torch.float16)
    out = flash_attn_func(q, k, v)
    assert out.shape == (2, 0, 2, head_dim)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.all(dk == 0) and torch.all(dv == 0)
    # No keys at all: zeros out, lse -inf, zero dq.
    q, k, v = make_qkv(2, 16, 0, 2, 2, head_dim, torch.float16)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    (dq,) = torch.autograd.grad(out, (q,), torch.randn_like(out))
    assert torch.all(dq == 0)


def test_head_dim_one_and_sixteen():
    for head_dim in (1, 16):
        q, k, v = make_qkv(1, 20, 30, 2, 1, head_dim, torch.float32)
        check_against_reference(flash_attn_func, q, k, v, causal=True)
