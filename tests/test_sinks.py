"""Learnable sinks (flashtile/sinks.py): forward, lse and gradients (the sink's too) against float64,
through flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache, with causal, windows,
GQA, odd lengths and rows that see no key; and the errors of a wrong sink."""

import functools

import pytest
import torch

import flashtile
from flashtile.reference import attention_naive, attention_varlen_naive

from flashtile.testing import call_errors, check_errors, check_lse

from _cases import DEVICE, DTYPES, ON_GPU, make_packed_qkv, make_qkv, randn

# (seqlen_q, seqlen_k); causal at seqlen_q > seqlen_k leaves the first rows without keys.
SHAPES = [(113, 203), (128, 128), (1, 37), (150, 37)] if not ON_GPU else [(1023, 1023), (113, 1500), (1, 4096),
                                                                          (2048, 2048), (1500, 113)]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))]


def check_against_reference(fn, q, k, v, **options):
    """_cases.check_against_reference, with the sink's gradient bounded by its own rule: dsink sums
    exp(sink - lse) rowsum(dO * O) over rows, O rounded to the input dtype (as the kernels' rowsum
    is, FlashAttention's too), and where that sum cancels the rounding shows in full. Its bound is
    PyTorch's same-dtype error or 8 roundoffs of the input dtype, whichever is larger."""
    errors, lse, ref_lse = call_errors(fn, q, k, v, **options)
    roundoff = torch.finfo(q.dtype).eps / 2
    check_errors([(name, err, max(base, 4 * roundoff) if name == "dsink" else base) for name, err, base in errors],
                 q.dtype)
    check_lse(lse, ref_lse)


def _sink(nheads, dtype=torch.float32, requires_grad=True):
    # Logits around the rows' lse (a few units), so the sink takes a fair share of every row.
    return (torch.randn(nheads, device=DEVICE, dtype=torch.float32) * 2 + 3).to(dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlens", SHAPES)
@pytest.mark.parametrize("mask", MASKS)
def test_dense(dtype, seqlens, mask):
    causal, window = mask
    q, k, v = make_qkv(2, *seqlens, 4, 2, 64, dtype)
    check_against_reference(flashtile.flash_attn_func, q, k, v, causal=causal, window_size=window,
                            learnable_sink=_sink(4))


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16 if ON_GPU else torch.float16])
def test_sink_dtype_and_softcap(sink_dtype):
    dtype = DTYPES[0]
    q, k, v = make_qkv(1, 77, 130, 2, 2, 40, dtype)
    check_against_reference(flashtile.flash_attn_func, q, k, v, causal=True, softcap=5.0,
                            learnable_sink=_sink(2, sink_dtype))


def test_rows_without_keys_get_the_sink():
    q, k, v = make_qkv(1, 16, 4, 2, 2, 32, DTYPES[0], requires_grad=False)
    sink = _sink(2, requires_grad=False)
    # Causal, bottom-right aligned: the first 12 of 16 rows see no key.
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out[:, :12], torch.zeros_like(out[:, :12]))
    torch.testing.assert_close(lse[..., :12], sink[None, :, None].expand(1, 2, 12))


@pytest.mark.parametrize("seqused", [False, True])
def test_varlen(seqused):
    dtype = DTYPES[0]
    q, k, v, cu_q, cu_k = make_packed_qkv([30, 1, 47, 0], [40, 9, 60, 5], 4, 2, 64, dtype)
    used = {}
    if seqused:
        used = {"seqused_q": torch.tensor([20, 1, 40, 0], dtype=torch.int32, device=DEVICE),
                "seqused_k": torch.tensor([33, 9, 50, 5], dtype=torch.int32, device=DEVICE)}
    sink = _sink(4)
    fn = functools.partial(flashtile.flash_attn_varlen_func, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=47,
                           max_seqlen_k=60, **used)
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **used)
    check_against_reference(lambda q, k, v, **options: fn(q, k, v, **options)[:2] + (torch.zeros(1),), q, k, v,
                            reference=reference, causal=True, learnable_sink=sink)


@pytest.mark.parametrize("num_splits", [0, 3])
def test_kvcache(num_splits):
    """One query per sequence with GQA (the group's heads share tiles: the sink is per query head, so
    not as the rows of a kv head); num_splits 3: the combine kernel takes the sink in."""
    dtype, batch, nheads, nheads_k, d = DTYPES[0], 3, 8, 2, 64
    q = randn(batch, 1, nheads, d, dtype=dtype)
    k_cache, v_cache = (randn(batch, 160, nheads_k, d, dtype=dtype) for _ in range(2))
    seqlens = torch.tensor([100, 7, 150], dtype=torch.int32, device=DEVICE)
    sink = _sink(nheads, requires_grad=False)
    for _ in range(2):  # the first call leaves a call plan (on CUDA), the second replays it
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, learnable_sink=sink,
                                                     num_splits=num_splits, return_softmax_lse=True)
        for b in range(batch):
            n = int(seqlens[b])
            ref_out, ref_lse = attention_naive(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                                               learnable_sink=sink)
            torch.testing.assert_close(out[b:b + 1].double(), ref_out, rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=1e-4, atol=1e-4)


def test_bad_sinks():
    q, k, v = make_qkv(1, 8, 8, 4, 2, 32, DTYPES[0], requires_grad=False)
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(nheads,\) = \(4,\)"):
        flashtile.flash_attn_func(q, k, v, learnable_sink=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="learnable_sink must be a floating-point tensor"):
        flashtile.flash_attn_func(q, k, v, learnable_sink=torch.zeros(4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="learnable_sink must be a torch.Tensor"):
        flashtile.flash_attn_func(q, k, v, learnable_sink=[0.0] * 4)
    if ON_GPU:
        with pytest.raises(ValueError, match="learnable_sink is on cpu"):
            flashtile.flash_attn_func(q, k, v, learnable_sink=torch.zeros(4))
