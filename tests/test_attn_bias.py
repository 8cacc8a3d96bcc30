"""attn_bias (flashtile/mods.py resolve_attn_bias, kernels/portable/mods.py): an additive bias of the
scores with its gradient, broadcast over any of (batch, heads, queries, keys), against float64, through
flash_attn_func, flash_attn_varlen_func and a packed variant, with causal, windows, GQA, softcap, ALiBi,
odd lengths, a sink and a block mask; the deterministic backward; and the errors of a wrong bias."""

import functools

import pytest
import torch

import flashtile
from flashtile.reference import attention_naive, attention_varlen_naive
from flashtile.testing import call_errors, check_errors, check_lse

from _cases import DEVICE, DTYPES, ON_GPU, make_packed_qkv, make_qkv, randn

SEQLENS = [(113, 203), (1, 37), (150, 37)] if not ON_GPU else [(1023, 1023), (113, 1500), (1, 4096), (1500, 113)]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))]
# Shapes broadcast to (batch 2, heads 4, sq, sk): every pattern of the gradient's sums.
BIAS_SHAPES = {
    "full": lambda sq, sk: (2, 4, sq, sk),
    "per-head": lambda sq, sk: (4, sq, sk),
    "key-padding": lambda sq, sk: (2, 1, 1, sk),
    "per-query": lambda sq, sk: (sq, 1),
    "per-head-constant": lambda sq, sk: (4, 1, 1),
}


def _bias(shape, dtype=torch.float32, requires_grad=True):
    return randn(*shape, dtype=dtype, requires_grad=requires_grad)


def check(fn, q, k, v, **options):
    errors, lse, ref_lse = call_errors(fn, q, k, v, **options)
    assert "dbias" in [name for name, _, _ in errors] or not options["attn_bias"].requires_grad
    check_errors(errors, q.dtype)
    check_lse(lse, ref_lse)


def check_zero_gradient(fn, q, k, v, bias, **options):
    """A bias constant along the keys shifts whole rows, which softmax ignores: its true gradient is 0,
    and ours and PyTorch's (in the inputs' dtype) are rounding noise, so they are compared in absolute
    terms: ours at most 4x PyTorch's plus 10 roundoffs of the dtype. out, dq, dk, dv as check()'s."""
    errors, _, _ = call_errors(fn, q, k, v, attn_bias=bias, **options)
    check_errors([e for e in errors if e[0] != "dbias"], q.dtype)
    out = fn(q, k, v, attn_bias=bias, **options)
    dout = torch.randn_like(out)
    dbias, = torch.autograd.grad(out, bias, dout)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    same, _ = attention_naive(*leaves[:3], attn_bias=leaves[3], dtype=None,
                              **{name: value for name, value in options.items() if name != "deterministic"})
    noise = torch.autograd.grad(same, leaves[3], dout)[0].abs().max().item()
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    assert dbias.abs().max().item() <= 4 * noise + 10 * torch.finfo(q.dtype).eps / 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("mask", MASKS)
def test_dense(dtype, seqlens, mask):
    causal, window = mask
    q, k, v = make_qkv(2, *seqlens, 4, 2, 64, dtype)
    check(flashtile.flash_attn_func, q, k, v, causal=causal, window_size=window,
          attn_bias=_bias(BIAS_SHAPES["full"](*seqlens)))


@pytest.mark.parametrize("pattern", list(BIAS_SHAPES))
@pytest.mark.parametrize("deterministic", [False, True])
def test_broadcast_gradients(pattern, deterministic):
    """The gradient comes back in the bias's own shape, summed over what it broadcasts along (by
    atomics in the kernel, or, deterministic, by torch over a full-size accumulator)."""
    sq, sk = (77, 130) if not ON_GPU else (777, 1300)
    q, k, v = make_qkv(2, sq, sk, 4, 2, 40, DTYPES[0])
    bias = _bias(BIAS_SHAPES[pattern](sq, sk))
    if bias.shape[-1] == 1:
        check_zero_gradient(flashtile.flash_attn_func, q, k, v, bias, causal=True, deterministic=deterministic)
    else:
        check(flashtile.flash_attn_func, q, k, v, causal=True, deterministic=deterministic, attn_bias=bias)


def test_deterministic_is_bit_identical():
    q, k, v = make_qkv(2, 64, 96, 4, 4, 32, DTYPES[0])
    bias = _bias((4, 1, 96))
    grads = []
    for _ in range(2):
        out = flashtile.flash_attn_func(q, k, v, attn_bias=bias, deterministic=True)
        grads.append(torch.autograd.grad(out.sum(), bias)[0])
    assert torch.equal(*grads)


@pytest.mark.parametrize("bias_dtype", [torch.float32, DTYPES[0]])
def test_bias_dtype_views_and_options(bias_dtype):
    """A bias in the inputs' dtype, a transposed view (read by its strides, no copy) and an expanded
    one (its gradient full-size), with softcap and ALiBi before it."""
    q, k, v = make_qkv(2, 97, 97, 4, 4, 64, DTYPES[0])
    slopes = torch.rand(4, device=DEVICE) * 0.2
    transposed = _bias((2, 4, 97, 97), bias_dtype, requires_grad=False).transpose(-1, -2).requires_grad_()
    check(flashtile.flash_attn_func, q, k, v, causal=True, softcap=4.0, alibi_slopes=slopes, attn_bias=transposed)
    expanded = _bias((1, 1, 97, 97), bias_dtype, requires_grad=False).expand(2, 4, 97, 97).requires_grad_()
    check(flashtile.flash_attn_func, q, k, v, attn_bias=expanded)


def test_bias_without_grad_and_probs():
    q, k, v = make_qkv(1, 45, 70, 2, 1, 32, DTYPES[0])
    bias = _bias((1, 2, 45, 70), requires_grad=False)
    check(flashtile.flash_attn_func, q, k, v, causal=True, attn_bias=bias)
    _, _, probs = flashtile.flash_attn_func(q, k, v, causal=True, attn_bias=bias, return_attn_probs=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, 2)) / 32 ** 0.5
    scores = scores + bias.double()
    scores = scores.masked_fill(torch.ones(45, 70, dtype=torch.bool, device=DEVICE).tril(70 - 45).logical_not(),
                                float("-inf"))
    torch.testing.assert_close(probs.double(), torch.softmax(scores, -1), atol=2e-3, rtol=0)


def test_with_sink_and_block_mask():
    seqlen = 113 if not ON_GPU else 1500
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, 64, DTYPES[0])
    block_mask = flashtile.create_block_mask(flashtile.mods.sliding_window(40, 0, device=DEVICE).fn, None, None,
                                             seqlen, seqlen, aux_tensors=[torch.tensor([40, 0], dtype=torch.int32,
                                                                                        device=DEVICE)],
                                             block_size=16 if not ON_GPU else 128)
    sink = (torch.randn(4, device=DEVICE) + 2).requires_grad_()
    bias = _bias((4, seqlen, seqlen))
    errors, lse, ref_lse = call_errors(functools.partial(flashtile.flash_attn_func, block_mask=block_mask), q, k, v,
                                       window_size=(40, 0), learnable_sink=sink, attn_bias=bias)
    assert [name for name, _, _ in errors] == ["out", "dq", "dk", "dv", "dsink", "dbias"]
    # dsink: the rule of test_sinks.py (a sum that cancels shows the input dtype's rounding in full).
    roundoff = torch.finfo(q.dtype).eps / 2
    check_errors([(name, err, max(base, 4 * roundoff) if name == "dsink" else base) for name, err, base in errors],
                 q.dtype)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal):
    """Packed sequences: a (batch, h, max_seqlen_q, max_seqlen_k) bias, sequence b reading its
    top-left corner; and a packed qkv."""
    lengths = [17, 1, 0, 40] if not ON_GPU else [170, 1, 0, 1400]
    q, k, v, cu_q, cu_k = make_packed_qkv(lengths, lengths[::-1], 4, 2, 64, DTYPES[0])
    max_q, max_k = max(lengths), max(lengths)
    bias = _bias((len(lengths), 4, max_q, max_k))
    fn = functools.partial(flashtile.flash_attn_varlen_func, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           max_seqlen_q=max_q, max_seqlen_k=max_k)
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    errors, lse, ref_lse = call_errors(fn, q, k, v, reference=reference, causal=causal, attn_bias=bias)
    check_errors(errors, q.dtype)
    check_lse(lse, ref_lse)


def test_qkvpacked():
    qkv = randn(2, 50, 3, 2, 32, dtype=DTYPES[0], requires_grad=True)
    bias = _bias((2, 1, 50, 50))
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, attn_bias=bias)
    dqkv, dbias = torch.autograd.grad(out.sum(), (qkv, bias))
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    bias_leaf = bias.detach().clone().requires_grad_()
    ref = flashtile.flash_attn_func(q, k, v, causal=True, attn_bias=bias_leaf)
    *ref_grads, ref_dbias = torch.autograd.grad(ref.sum(), (q, k, v, bias_leaf))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dqkv, torch.stack(ref_grads, 2))
    torch.testing.assert_close(dbias, ref_dbias)


def test_explain_names_attn_bias():
    """On sm90 the Hopper kernels read a 16-bit bias that varies along the keys at head dims 65 to 128, and
    the backward writes its gradient (summed along the queries too, for a bias broadcast along them); a
    bias constant along the keys, one beside a mask_mod, a float32 one, or head dim 64 stays on the
    portable kernels, and says why. Packed sequences take both Hopper kernels too."""
    q, k, v = make_qkv(1, 64, 64, 2, 2, 128, DTYPES[0], requires_grad=False)
    for shape in ((1, 2, 64, 64), (64, 64)):
        explanation = flashtile.explain(q, k, v, attn_bias=_bias(shape, DTYPES[0]), device_capability=(9, 0))
        assert explanation.forward.path == "hopper", explanation.forward.reason
        assert explanation.backward.path == "hopper", explanation.backward.reason
    explanation = flashtile.explain(q, k, v, attn_bias=_bias((2, 1, 64), DTYPES[0]), device_capability=(9, 0))
    assert explanation.forward.path == "hopper", explanation.forward.reason
    assert explanation.backward.path == "hopper", explanation.backward.reason
    explanation = flashtile.explain(q, k, v, attn_bias=_bias((2, 1, 64), DTYPES[0], requires_grad=False),
                                    device_capability=(9, 0))
    assert explanation.backward.path == "hopper", explanation.backward.reason
    explanation = flashtile.explain(q, k, v, attn_bias=_bias((64, 1)), device_capability=(9, 0))
    assert explanation.forward.path == "portable" and "attn_bias" in explanation.forward.reason
    explanation = flashtile.explain(q, k, v, attn_bias=_bias((1, 2, 64, 64), DTYPES[0]), device_capability=(9, 0),
                                    mask_mod=flashtile.mods.sliding_window(8, 0, device=DEVICE))
    assert explanation.forward.path == "portable" and "attn_bias" in explanation.forward.reason
    explanation = flashtile.explain(q, k, v, attn_bias=_bias((1, 2, 64, 64), torch.float32),
                                    device_capability=(9, 0))
    assert explanation.forward.path == "portable" and "bfloat16" in explanation.forward.reason
    cu = torch.tensor([0, 30, 64], dtype=torch.int32, device=DEVICE)
    explanation = flashtile.explain(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=34,
                                    max_seqlen_k=34, attn_bias=_bias((2, 2, 34, 34), DTYPES[0]),
                                    device_capability=(9, 0))
    assert explanation.forward.path == "hopper", explanation.forward.reason
    assert explanation.backward.path == "hopper", explanation.backward.reason
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, DTYPES[0], requires_grad=False)
    explanation = flashtile.explain(q, k, v, attn_bias=_bias((1, 2, 64, 64), DTYPES[0]), device_capability=(9, 0))
    assert explanation.forward.path == "portable" and "65 to 128" in explanation.forward.reason


@pytest.mark.skipif(not ON_GPU, reason="the Hopper kernels: compiled on sm90")
@pytest.mark.parametrize("head_dim", [128, 96, 64])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("options", ["causal", "full", "window-softcap-alibi", "window-alibi", "softcap", "gqa-sink",
                                     "key-bias", "key-bias-softcap"])
def test_hopper_kernels(head_dim, bias_dtype, options):
    """The Hopper forward and backward adding a 16-bit bias at head dims 65 to 128 (asked of
    flashtile.explain first, so a bias that leaves them fails here; head dim 64 and float32 biases stay
    portable), the backward storing the gradient of a full-shape bias and adding up that of one
    shared by the batch ("full"): odd lengths, every option beside it, -inf in the bias, and a row
    with no key left (out 0, lse -inf, or the sink's logit)."""
    # Key counts of 16-byte rows take the kernels' TMA rings of bias tiles, which start the scores'
    # accumulators (causal, window-alibi, gqa-sink) or, with softcap, add to the capped scores (the forward's
    # "softcap"; the backward loads the bias beside softcap with the bias's gradient); other key counts load
    # the bias from global memory. A bias of one row for every query ("key-bias": (h, 1, sk), its gradient
    # summed along the queries and the batch) is read once per key block, and starts S^T's accumulator in
    # the backward (after softcap, it is added instead).
    sq, sk = {"causal": (1023, 1024), "full": (113, 1500), "window-softcap-alibi": (1023, 1023),
              "window-alibi": (1023, 1024), "softcap": (1000, 1024), "gqa-sink": (1000, 1000),
              "key-bias": (1023, 1023), "key-bias-softcap": (200, 1500)}[options]
    q, k, v = make_qkv(2, sq, sk, 4, 2 if options == "gqa-sink" else 4, head_dim, torch.bfloat16)
    kwargs = dict(causal=options in ("causal", "gqa-sink", "key-bias"))
    if options == "window-softcap-alibi":
        kwargs.update(window_size=(300, 40), softcap=20.0, alibi_slopes=torch.rand(2, 4, device=DEVICE) * 0.1)
    if options == "window-alibi":
        kwargs.update(window_size=(300, 40), alibi_slopes=torch.rand(4, device=DEVICE) * 0.1)
    if options in ("softcap", "key-bias-softcap"):
        kwargs.update(softcap=20.0)
    sink = None
    if options == "gqa-sink":
        sink = torch.randn(4, device=DEVICE).requires_grad_()
        kwargs.update(learnable_sink=sink)
    key_bias = options.startswith("key-bias")
    shape = (4, 1, sk) if key_bias else (2, 4, sq, sk) if options != "full" else (4, sq, sk)
    bias = _bias(shape, bias_dtype, requires_grad=False)
    bias[..., 0 if key_bias else 7, 3::2] = float("-inf")
    bias.requires_grad_()
    explanation = flashtile.explain(q, k, v, attn_bias=bias, **kwargs)
    hopper = head_dim > 64 and bias_dtype != torch.float32
    assert explanation.forward.path == ("hopper" if hopper else "portable"), explanation.forward.reason
    assert explanation.backward.path == ("hopper" if hopper else "portable"), explanation.backward.reason
    errors, lse, ref_lse = call_errors(flashtile.flash_attn_func, q, k, v, attn_bias=bias, **kwargs)
    check_errors(errors, q.dtype)
    check_lse(lse, ref_lse)
    if key_bias:
        return
    # Forward only: the float64 reference's gradient of a row with no key is NaN.
    empty = bias.detach().clone()
    empty[..., 5, :] = float("-inf")
    errors, lse, ref_lse = call_errors(flashtile.flash_attn_func, q, k, v, backward=False, attn_bias=empty, **kwargs)
    check_errors(errors, q.dtype)
    check_lse(lse, ref_lse)
    if sink is None:
        assert torch.isneginf(lse[:, :, 5]).all()
    else:
        torch.testing.assert_close(lse[:, :, 5], sink.detach().expand(2, 4))


@pytest.mark.skipif(not ON_GPU, reason="the Hopper kernels: compiled on sm90")
@pytest.mark.parametrize("layout", ["ring-stored", "loads-added"])
def test_hopper_varlen(layout):
    """Packed sequences with a 16-bit bias on the Hopper forward and backward: a bias per sequence whose key
    count gives 16-byte rows (both kernels read it through their rings; its gradient is stored), and one
    shared by the sequences whose rows are not (loaded; its gradient added up); empty and one-row
    sequences, -inf in the bias."""
    lengths = [170, 1, 0, 1400] if layout == "ring-stored" else [171, 1, 0, 1401]
    q, k, v, cu_q, cu_k = make_packed_qkv(lengths, lengths[::-1], 4, 2, 128, torch.bfloat16)
    max_len = max(lengths)
    shape = (len(lengths), 4, max_len, max_len) if layout == "ring-stored" else (4, max_len, max_len)
    bias = _bias(shape, torch.bfloat16, requires_grad=False)
    bias[..., 3, 5::2] = float("-inf")
    bias.requires_grad_()
    fn = functools.partial(flashtile.flash_attn_varlen_func, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           max_seqlen_q=max_len, max_seqlen_k=max_len)
    explanation = flashtile.explain(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_len,
                                    max_seqlen_k=max_len, causal=True, attn_bias=bias)
    assert explanation.forward.path == "hopper", explanation.forward.reason
    assert explanation.backward.path == "hopper", explanation.backward.reason
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    errors, lse, ref_lse = call_errors(fn, q, k, v, reference=reference, causal=True, attn_bias=bias)
    check_errors(errors, q.dtype)
    check_lse(lse, ref_lse)


def test_errors():
    q, k, v = make_qkv(2, 30, 40, 4, 2, 32, DTYPES[0], requires_grad=False)
    with pytest.raises(TypeError, match="attn_bias must be a torch.Tensor"):
        flashtile.flash_attn_func(q, k, v, attn_bias=[[0.0]])
    with pytest.raises(ValueError, match="attn_bias must be a floating-point"):
        flashtile.flash_attn_func(q, k, v, attn_bias=torch.zeros(30, 40, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"attn_bias must broadcast to \(batch, nheads, seqlen_q, seqlen_k\) = "
                                         r"\(2, 4, 30, 40\), got shape \(3, 30, 40\)"):
        flashtile.flash_attn_func(q, k, v, attn_bias=_bias((3, 30, 40)))
    with pytest.raises(ValueError, match="attn_bias must broadcast"):
        flashtile.flash_attn_func(q, k, v, attn_bias=_bias((1, 2, 4, 30, 40)))
    with pytest.raises(ValueError, match="attn_bias and score_mod were both given"):
        flashtile.flash_attn_func(q, k, v, attn_bias=_bias((30, 40)), score_mod=flashtile.mods.softcap(2.0, DEVICE))
    if ON_GPU:
        with pytest.raises(ValueError, match="attn_bias is on cpu"):
            flashtile.flash_attn_func(q, k, v, attn_bias=torch.zeros(30, 40))
