"""Programmable attention (flashtile/mods.py, block_mask.py): score_mod with score_mod_bwd, mask_mod,
block masks and the built-in mods, forward and backward against float64 twins written in PyTorch,
dense and packed, with causal, windows, GQA, odd lengths, rows left without keys and a learnable
sink; and the errors of wrong mod arguments."""

import functools

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile.configs import DECODE_MAX_ROWS
from flashtile.reference import attention_naive, attention_varlen_naive
from flashtile.testing import check_errors, check_lse, reference_errors

from _cases import DEVICE, DTYPES, ON_GPU, make_packed_qkv, make_qkv, randn

SEQLENS = [(113, 203), (128, 128), (1, 37), (150, 37)] if not ON_GPU else [(1023, 1023), (113, 1500), (1, 4096),
                                                                           (2048, 2048), (1500, 113)]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))]


# --- mods under test, each with its PyTorch twin (scores (b, h, sq, sk); indices broadcastable) ---

@triton.jit
def head_slope_bias(score, b, h, q_idx, kv_idx, aux):
    """score + w[h] * (q - kv) / 16 + u[b]: reads two aux tensors, depends on every index."""
    return score + tl.load(aux[0] + h) * (q_idx - kv_idx).to(tl.float32) * 0.0625 + tl.load(aux[1] + b)


@triton.jit
def additive_bwd(grad, score, b, h, q_idx, kv_idx, aux):
    return grad


def head_slope_bias_twin(w, u):
    def twin(s, b, h, i, j):
        return s + w.to(s.dtype)[h] * (i - j).to(s.dtype) * 0.0625 + u.to(s.dtype)[b]
    return twin


@triton.jit
def half_square(score, b, h, q_idx, kv_idx, aux):
    """A nonlinear mod, so that score_mod_bwd matters: score^2 / 2 (scores here stay small)."""
    return 0.5 * score * score


@triton.jit
def half_square_bwd(grad, score, b, h, q_idx, kv_idx, aux):
    return grad * score


@triton.jit
def every_third_off(b, h, q_idx, kv_idx, aux):
    return ((q_idx + 2 * kv_idx + h + b) % 3) != 0


def every_third_off_twin(b, h, i, j):
    return ((i + 2 * j + h + b) % 3) != 0


@triton.jit
def head_band(b, h, q_idx, kv_idx, aux):
    """A band whose width grows with the head: (q - kv) in [-4, 19 + 3h]."""
    return (q_idx - kv_idx < 20 + 3 * h) & (kv_idx - q_idx < 5)


def head_band_twin(b, h, i, j):
    return (i - j < 20 + 3 * h) & (j - i < 5)


@triton.jit
def first_rows_off(b, h, q_idx, kv_idx, aux):
    """Rows below 10 see no key at all (out 0, lse -inf)."""
    return q_idx >= 10


def first_rows_off_twin(b, h, i, j):
    return (i >= 10) & (j >= 0)


# --- the check ---

def check_mods(fn, q, k, v, kernel_options, reference_options, reference=attention_naive, sink=None):
    """Run ``fn`` with the kernels' mods and compare out, lse, dq, dk, dv (and dsink) with the float64
    reference running the twins, by FlashAttention's rule."""
    extra = {} if sink is None else {"learnable_sink": sink}
    out, lse, _ = fn(q, k, v, return_attn_probs=True, **kernel_options, **extra)
    dout = torch.randn_like(out)
    inputs = (q, k, v) if sink is None else (q, k, v, sink)
    grads = torch.autograd.grad(out, inputs, dout)
    errors, ref_lse = reference_errors(q, k, v, out, dout, grads, reference=reference, **reference_options, **extra)
    check_errors(errors, q.dtype)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlens", SEQLENS)
@pytest.mark.parametrize("mask", MASKS)
def test_score_mod(dtype, seqlens, mask):
    causal, window = mask
    q, k, v = make_qkv(2, *seqlens, 4, 2, 40, dtype)
    w, u = randn(4, dtype=torch.float32), randn(2, dtype=torch.float32)
    check_mods(flashtile.flash_attn_func, q, k, v,
               dict(causal=causal, window_size=window, score_mod=head_slope_bias, score_mod_bwd=additive_bwd,
                    aux_tensors=[w, u]),
               dict(causal=causal, window_size=window, score_mod=head_slope_bias_twin(w, u)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonlinear_score_mod_after_softcap(dtype):
    q, k, v = make_qkv(2, 77, 130, 2, 1, 64, dtype)
    check_mods(flashtile.flash_attn_func, q, k, v,
               dict(causal=True, softcap=2.0, score_mod=half_square, score_mod_bwd=half_square_bwd),
               dict(causal=True, softcap=2.0, score_mod=lambda s, *index: 0.5 * s * s))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", MASKS)
def test_mask_mod(dtype, mask):
    causal, window = mask
    q, k, v = make_qkv(2, 113, 150, 4, 2, 64, dtype)
    check_mods(flashtile.flash_attn_func, q, k, v, dict(causal=causal, window_size=window, mask_mod=every_third_off),
               dict(causal=causal, window_size=window, mask_mod=every_third_off_twin))


def test_rows_the_mask_empties_get_zeros_and_minus_inf():
    q, k, v = make_qkv(1, 37, 37, 2, 2, 32, DTYPES[0])
    check_mods(flashtile.flash_attn_func, q, k, v, dict(mask_mod=first_rows_off), dict(mask_mod=first_rows_off_twin))
    out, lse, _ = flashtile.flash_attn_func(q, k, v, mask_mod=first_rows_off, return_attn_probs=True)
    assert torch.equal(out[:, :10], torch.zeros_like(out[:, :10]))
    assert torch.isneginf(lse[..., :10]).all()


BLOCK_SIZES = [16, (16, 32)] if not ON_GPU else [128, (64, 128)]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("mask", MASKS)
def test_block_mask(block_size, mask):
    causal, window = mask
    seqlen = 113 if not ON_GPU else 1500
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, 64, DTYPES[0])
    block_mask = flashtile.create_block_mask(head_band, None, 4, seqlen, seqlen, device=DEVICE, block_size=block_size)
    assert 0 < block_mask.sparsity() < 1
    check_mods(flashtile.flash_attn_func, q, k, v, dict(causal=causal, window_size=window, block_mask=block_mask),
               dict(causal=causal, window_size=window, mask_mod=head_band_twin))


def test_document_block_mask_with_a_score_mod():
    seqlen = 150 if not ON_GPU else 3000
    lengths = [seqlen // 5, seqlen // 2, seqlen - seqlen // 5 - seqlen // 2]
    documents = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]).to(DEVICE)
    mask = flashtile.mods.document_mask(documents)
    block_mask = flashtile.create_block_mask(mask, None, None, seqlen, seqlen, block_size=32 if not ON_GPU else 128)
    assert block_mask.sparsity() > 0
    q, k, v = make_qkv(1, seqlen, seqlen, 4, 4, 64, DTYPES[0])
    slopes = torch.rand(4, device=DEVICE) * 0.3
    check_mods(flashtile.flash_attn_func, q, k, v,
               dict(causal=True, block_mask=block_mask, score_mod=flashtile.mods.alibi(slopes)),
               dict(causal=True, alibi_slopes=slopes, mask_mod=lambda b, h, i, j: documents[i] == documents[j]))


def _documents(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]).to(DEVICE)


@pytest.mark.parametrize("causal", [False, True])
def test_document_mask_runs_as_packed_sequences(causal):
    """The built-in document mask alone (as the mask_mod or as the mask of a block mask), queries lined
    up with keys and every document one run of positions: attention within packed sequences, run as
    flash_attn_varlen_func on the batch's rows end to end (the Hopper kernels where those serve it), a
    sink and GQA included. Outputs and gradients against the float64 reference of the mask."""
    seqlen = 150 if not ON_GPU else 3000
    documents = _documents([seqlen // 5, 1, seqlen // 2, seqlen - seqlen // 5 - seqlen // 2 - 1])
    mask = flashtile.mods.document_mask(documents)
    block_mask = flashtile.create_block_mask(mask, None, None, seqlen, seqlen, block_size=32 if not ON_GPU else 128)
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, 64, DTYPES[0])
    sink = (torch.randn(4, device=DEVICE) + 2).requires_grad_()
    for options in (dict(mask_mod=mask), dict(block_mask=block_mask)):
        explanation = flashtile.explain(q, k, v, causal=causal, device_capability=(9, 0), **options)
        assert "document mask as packed sequences" in explanation.forward.reason, explanation
        out = flashtile.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, **options)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
        errors, _ = reference_errors(q, k, v, out, dout, grads, causal=causal, learnable_sink=sink,
                                     mask_mod=lambda b, h, i, j: documents[i] == documents[j])
        roundoff = torch.finfo(q.dtype).eps / 2
        check_errors([(name, err, max(base, 4 * roundoff) if name == "dsink" else base) for name, err, base in errors],
                     q.dtype)


def test_documents_that_are_not_runs_stay_a_mask():
    """A document with positions in two runs is no set of sequences: the mask runs as a mask_mod."""
    documents = _documents([20, 30, 20])
    documents[50:] = 0  # document 0 again after document 1
    q, k, v = make_qkv(1, 70, 70, 2, 2, 32, DTYPES[0])
    mask = flashtile.mods.document_mask(documents)
    explanation = flashtile.explain(q, k, v, causal=True, mask_mod=mask, device_capability=(9, 0))
    assert explanation.forward.path == "portable" and "mask_mod" in explanation.forward.reason
    check_mods(flashtile.flash_attn_func, q, k, v, dict(causal=True, mask_mod=mask),
               dict(causal=True, mask_mod=lambda b, h, i, j: documents[i] == documents[j]))


@triton.jit
def keep_all(b, h, q_idx, kv_idx, aux):
    return q_idx >= 0


@pytest.mark.parametrize("builtin", ["alibi", "softcap", "relative_bias"])
@pytest.mark.parametrize("as_mod", [False, True])
def test_builtin_mods(builtin, as_mod):
    """Alone, ALiBi (queries lined up with keys) and softcap run as flash_attn's options; with a
    mask_mod beside them, as score mods."""
    dtype = DTYPES[0]
    q, k, v = make_qkv(2, 97, 97, 4, 2, 64, dtype)
    if builtin == "alibi":
        slopes = torch.rand(4, device=DEVICE)
        mod, reference = flashtile.mods.alibi(slopes), dict(alibi_slopes=slopes)
    elif builtin == "softcap":
        mod, reference = flashtile.mods.softcap(3.0, device=DEVICE), dict(softcap=3.0)
    else:
        table = randn(4, 2 * 16 + 1, dtype=torch.float32)

        def twin(s, b, h, i, j):
            return s + table.to(s.dtype)[h, (j - i).clamp(-16, 16) + 16]
        mod, reference = flashtile.mods.relative_bias(table), dict(score_mod=twin)
    mask = dict(mask_mod=keep_all) if as_mod else {}
    check_mods(flashtile.flash_attn_func, q, k, v, dict(causal=True, score_mod=mod, **mask),
               dict(causal=True, **reference))


def relative_bias_twin(table):
    distance = table.shape[1] // 2

    def twin(s, b, h, i, j):
        return s + table.to(s.dtype)[h, (j - i).clamp(-distance, distance) + distance]
    return twin


@pytest.mark.parametrize("seqlens", SEQLENS if ON_GPU else SEQLENS[:1])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256] if ON_GPU else [64])
@pytest.mark.parametrize("max_distance", [16, 128] if ON_GPU else [16])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=False), dict(window_size=(300, 40), softcap=5.0)])
def test_relative_bias_in_the_hopper_forward(seqlens, head_dim, max_distance, options):
    """mods.relative_bias alone runs in the Hopper kernels (a tile farther than D from every row adds
    one entry of the table, the rest gather), with flash_attn's options beside it; the backward at
    head dims above 128 on the portable kernels. GQA, lengths that are not multiples of the tiles,
    and seqlen_q != seqlen_k (the table reads raw positions, not bottom-right ones). A decode-shaped
    forward (a few query rows) takes the decode kernels instead."""
    dtype = DTYPES[-1] if ON_GPU else DTYPES[0]
    q, k, v = make_qkv(2, *seqlens, 4, 2, head_dim, dtype)
    table = randn(4, 2 * max_distance + 1, dtype=torch.float32)
    mod = flashtile.mods.relative_bias(table)
    explanation = flashtile.explain(q, k, v, score_mod=mod, device_capability=(9, 0), **options)
    if seqlens[0] <= DECODE_MAX_ROWS:
        assert explanation.forward.path == "portable" and "query row" in explanation.forward.reason
    else:
        assert explanation.forward.path == "hopper", explanation.forward.reason
    if head_dim <= 128:
        assert explanation.backward.path == "hopper", explanation.backward.reason
    else:
        assert explanation.backward.path == "portable" and "bias table" in explanation.backward.reason
    check_mods(flashtile.flash_attn_func, q, k, v, dict(score_mod=mod, **options),
               dict(score_mod=relative_bias_twin(table), **options))


def test_relative_bias_in_the_hopper_forward_packed():
    dtype = DTYPES[-1] if ON_GPU else DTYPES[0]
    # On the CPU (the portable kernels; the routing is test_relative_bias_in_the_hopper_forward's) shorter.
    lengths_q, lengths_k, distance = ([300, 1, 470, 0], [400, 9, 600, 5], 64) if ON_GPU else ([30, 1, 47, 0],
                                                                                              [40, 9, 60, 5], 8)
    q, k, v, cu_q, cu_k = make_packed_qkv(lengths_q, lengths_k, 4, 2, 64, dtype)
    table = randn(4, 2 * distance + 1, dtype=torch.float32)
    layout = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    check_mods(functools.partial(flashtile.flash_attn_varlen_func, **layout), q, k, v,
               dict(causal=True, score_mod=flashtile.mods.relative_bias(table)),
               dict(causal=True, score_mod=relative_bias_twin(table)),
               reference=functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


def test_builtin_alibi_sees_raw_positions():
    """seqlen_q != seqlen_k: the mod's |q_idx - kv_idx| is not flash_attn's bottom-right distance,
    so the call stays a score mod."""
    q, k, v = make_qkv(1, 40, 90, 2, 2, 32, DTYPES[0])
    slopes = torch.rand(2, device=DEVICE)
    check_mods(flashtile.flash_attn_func, q, k, v, dict(score_mod=flashtile.mods.alibi(slopes)),
               dict(score_mod=lambda s, b, h, i, j: s - slopes.to(s.dtype)[h] * (i - j).abs()))


@pytest.mark.parametrize("use_block_mask", [False, True])
def test_varlen(use_block_mask):
    dtype = DTYPES[0]
    q, k, v, cu_q, cu_k = make_packed_qkv([30, 1, 47, 0], [40, 9, 60, 5], 4, 2, 64, dtype)
    w, u = randn(4, dtype=torch.float32), randn(4, dtype=torch.float32)
    layout = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=47, max_seqlen_k=60)
    fn = functools.partial(flashtile.flash_attn_varlen_func, **layout)
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    masks = dict(mask_mod=every_third_off)
    if use_block_mask:
        masks = dict(block_mask=flashtile.create_block_mask(every_third_off, 4, None, 47, 60, device=DEVICE,
                                                            block_size=16))
    check_mods(fn, q, k, v, dict(causal=True, score_mod=head_slope_bias, score_mod_bwd=additive_bwd,
                                 aux_tensors=[w, u], **masks),
               dict(causal=True, score_mod=head_slope_bias_twin(w, u), mask_mod=every_third_off_twin),
               reference=reference)


def test_with_learnable_sink():
    q, k, v = make_qkv(2, 64, 96, 4, 2, 64, DTYPES[0])
    sink = (torch.randn(4, device=DEVICE) + 2).requires_grad_()
    check_mods(flashtile.flash_attn_func, q, k, v, dict(mask_mod=every_third_off),
               dict(mask_mod=every_third_off_twin), sink=sink)


def test_probs_follow_the_mods():
    q, k, v = make_qkv(1, 40, 50, 2, 2, 32, DTYPES[0], requires_grad=False)
    _, _, probs = flashtile.flash_attn_func(q, k, v, score_mod=half_square, mask_mod=every_third_off,
                                            return_attn_probs=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 32 ** 0.5
    index = (torch.zeros(1, 1, 1, 1, dtype=torch.long, device=DEVICE), torch.arange(2, device=DEVICE)[:, None, None],
             torch.arange(40, device=DEVICE)[:, None], torch.arange(50, device=DEVICE)[None, :])
    s = (0.5 * s * s).masked_fill(~every_third_off_twin(*index), float("-inf"))
    torch.testing.assert_close(probs.double(), torch.softmax(s, -1), atol=2e-3, rtol=0)


# --- errors ---

def _qkv():
    return make_qkv(1, 16, 16, 2, 2, 32, DTYPES[0])


def test_a_backward_without_score_mod_bwd_names_it():
    q, k, v = _qkv()
    out = flashtile.flash_attn_func(q, k, v, score_mod=half_square)
    with pytest.raises(ValueError, match="score_mod_bwd"):
        out.sum().backward()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(score_mod=lambda s, *a: s), TypeError, "score_mod must be a @triton.jit function"),
    (dict(mask_mod=every_third_off_twin), TypeError, "mask_mod must be a @triton.jit function"),
    (dict(score_mod_bwd=additive_bwd), ValueError, "score_mod_bwd was given without score_mod"),
    (dict(aux_tensors=[]), ValueError, "aux_tensors were given without"),
    (dict(score_mod=head_slope_bias, aux_tensors=torch.zeros(2)), TypeError, "aux_tensors must be a list"),
    (dict(score_mod=head_slope_bias, aux_tensors=["strided"]), ValueError, r"aux_tensors\[1\] must be contiguous"),
    (dict(score_mod=head_slope_bias, aux_tensors=[torch.zeros(2, device="meta")]), ValueError, r"aux_tensors\[0\] is on meta"),
    (dict(block_mask="mask"), TypeError, "block_mask must be a flashtile.BlockMask"),
])
def test_wrong_mod_arguments_raise(kwargs, error, match):
    q, k, v = _qkv()
    if kwargs.get("aux_tensors") == ["strided"]:  # made here, on the tests' device
        kwargs["aux_tensors"] = [torch.zeros(2, device=DEVICE), torch.zeros(4, 2, device=DEVICE)[:, 0]]
    with pytest.raises(error, match=match):
        flashtile.flash_attn_func(q, k, v, **kwargs)


def test_a_block_mask_of_other_sizes_or_another_mask_raises():
    q, k, v = _qkv()
    block_mask = flashtile.create_block_mask(head_band, None, None, 16, 32, device=DEVICE, block_size=16)
    with pytest.raises(ValueError, match="block_mask was built for seqlen_k=32, but the call has seqlen_k=16"):
        flashtile.flash_attn_func(q, k, v, block_mask=block_mask)
    block_mask = flashtile.create_block_mask(head_band, None, None, 16, 16, device=DEVICE, block_size=16)
    with pytest.raises(ValueError, match="mask_mod differs"):
        flashtile.flash_attn_func(q, k, v, block_mask=block_mask, mask_mod=every_third_off)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        flashtile.create_block_mask(head_band, None, None, 16, 16, device=DEVICE, block_size=48)
    with pytest.raises(TypeError, match="mask_mod must be a @triton.jit function"):
        flashtile.create_block_mask(head_band_twin, None, None, 16, 16, device=DEVICE)


def test_builtin_mod_arguments_are_checked():
    with pytest.raises(ValueError, match="slopes must have shape"):
        flashtile.mods.alibi(torch.ones(2, 2))
    with pytest.raises(ValueError, match="cap must be a number > 0"):
        flashtile.mods.softcap(0.0)
    with pytest.raises(ValueError, match="table must have shape"):
        flashtile.mods.relative_bias(torch.ones(2, 4))
    with pytest.raises(ValueError, match="document_ids must be an integer"):
        flashtile.mods.document_mask(torch.ones(4))


def test_sliding_window_block_mask_is_flash_attn_window():
    """Alone, the built-in window runs as window_size=; beside a score mod, as a block mask on the
    portable kernels. Both compute flash_attn's window."""
    seqlen = 150 if not ON_GPU else 2000
    q, k, v = make_qkv(1, seqlen, seqlen, 2, 2, 64, DTYPES[0])
    mask = flashtile.mods.sliding_window(40, 0, device=DEVICE)
    block_mask = flashtile.create_block_mask(mask, None, None, seqlen, seqlen, block_size=32 if not ON_GPU else 128)
    check_mods(flashtile.flash_attn_func, q, k, v, dict(block_mask=block_mask), dict(window_size=(40, 0)))
    slopes = torch.rand(2, device=DEVICE)
    check_mods(flashtile.flash_attn_func, q, k, v, dict(block_mask=block_mask, score_mod=flashtile.mods.alibi(slopes)),
               dict(window_size=(40, 0), alibi_slopes=slopes))


def test_builtin_sliding_window_runs_as_window_size():
    q, k, v = make_qkv(1, 256, 256, 2, 2, 64, DTYPES[0], requires_grad=False)
    mask = flashtile.mods.sliding_window(40, 0, device=DEVICE)
    block_mask = flashtile.create_block_mask(mask, None, None, 256, 256, block_size=32 if not ON_GPU else 128)
    # The call's own causal / window_size intersect the built-in's.
    for options, window in ((dict(mask_mod=mask), (40, 0)), (dict(block_mask=block_mask), (40, 0)),
                            (dict(mask_mod=mask, window_size=(10, 5)), (10, 0)),
                            (dict(block_mask=block_mask, causal=True, window_size=(-1, 3)), (40, 0))):
        explanation = flashtile.explain(q, k, v, device_capability=(9, 0), **options)
        assert explanation.forward.path == "hopper", explanation
        assert f"sliding window {window}" in explanation.forward.reason
    # Queries not lined up with keys: raw positions are not flash_attn's, the mask stays a mask_mod.
    explanation = flashtile.explain(q[:, :100], k, v, mask_mod=mask, device_capability=(9, 0))
    assert explanation.forward.path == "portable" and "mask_mod" in explanation.forward.reason
    with pytest.raises(ValueError, match="block_mask was built for seqlen_q=256"):
        flashtile.flash_attn_func(q[:, :100], k[:, :100], v[:, :100], block_mask=block_mask)


def test_explain_names_the_mods():
    q, k, v = make_qkv(1, 256, 256, 2, 2, 64, DTYPES[0], requires_grad=False)
    explanation = flashtile.explain(q, k, v, causal=True, mask_mod=every_third_off, device_capability=(9, 0))
    assert explanation.forward.path == "portable" and "mask_mod" in explanation.forward.reason
    assert explanation.backward.path == "portable" and "mask_mod" in explanation.backward.reason
    # A built-in that is one of flash_attn's options runs as that option, on the Hopper kernels.
    explanation = flashtile.explain(q, k, v, causal=True, score_mod=flashtile.mods.softcap(5.0, device=DEVICE),
                                    device_capability=(9, 0))
    assert "softcap" in explanation.forward.reason


@pytest.mark.parametrize("variant", ["qkv", "kv", "varlen_qkv", "varlen_kv"])
def test_packed_variants_take_sinks_and_mods(variant):
    """The packed entry points give what flash_attn_func gives on the unpacked tensors, gradients
    (the sink's too) included."""
    batch, seqlen, nheads, head_dim = 2, 50, 2, 32
    qkv = randn(batch, seqlen, 3, nheads, head_dim, dtype=DTYPES[0], requires_grad=True)
    sink = (torch.randn(nheads, device=DEVICE) + 2).requires_grad_()
    options = dict(causal=True, learnable_sink=sink, mask_mod=every_third_off)
    cu_seqlens = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32, device=DEVICE)
    if variant == "qkv":
        out = flashtile.flash_attn_qkvpacked_func(qkv, **options)
    elif variant == "kv":
        out = flashtile.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], **options)
    elif variant == "varlen_qkv":
        out = flashtile.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu_seqlens, seqlen, **options)
    else:
        flat = qkv.flatten(0, 1)
        out = flashtile.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu_seqlens, cu_seqlens, seqlen, seqlen,
                                                        **options)
    out = out.reshape(batch, seqlen, nheads, head_dim)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qkv, sink), dout)
    expected = flashtile.flash_attn_func(*qkv.unbind(2), **options)
    expected_grads = torch.autograd.grad(expected, (qkv, sink), dout)
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
