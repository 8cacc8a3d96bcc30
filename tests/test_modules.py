"""flashtile.modules against plain PyTorch: the same weights through F.linear, the reference
rotary (flashtile.reference.apply_rotary with tables built here) and attention_naive, in float64
as ground truth. The modules' error may be at most twice that of the same PyTorch computation in
the input dtype (flashtile.testing's rule), for outputs and for input and weight gradients."""

import pytest
import torch
import torch.nn.functional as F

from flashtile.modules import (MHA, FlashCrossAttention, FlashSelfAttention, InferenceParams, RotaryEmbedding,
                               get_alibi_slopes, rotary_positions)
from flashtile.reference import apply_rotary, attention_naive
from flashtile.testing import check_errors, rel_error

from _cases import DEVICE, DTYPES, ON_GPU

EMBED, NHEADS = (256, 4) if ON_GPU else (64, 4)  # head dim 64 on the GPU, 16 on the interpreter
HEAD_DIM = EMBED // NHEADS
BATCH, SEQLEN = (3, 200) if ON_GPU else (2, 24)


def rotary_tables(length, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, device=DEVICE, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(length, device=DEVICE, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos(), angles.sin()


def reference_mha(mha, params, x, x_kv=None, key_padding_mask=None):
    """The MHA layer in plain PyTorch, in the dtype of ``params`` and ``x``; key_padding_mask as
    in MHA (padded rows of the output are 0; rotary positions count real tokens)."""
    h, hk, d = mha.num_heads, mha.num_heads_kv, mha.head_dim

    def linear(name, t):
        return F.linear(t, params[name + ".weight"], params.get(name + ".bias"))

    if mha.cross_attn:
        q = linear("Wq", x).unflatten(-1, (h, d))
        k, v = linear("Wkv", x_kv).unflatten(-1, (2, hk, d)).unbind(2)
    else:
        q, k, v = linear("Wqkv", x).split([h * d, hk * d, hk * d], dim=-1)
        q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))
    batch, seqlen = x.shape[:2]
    keep_q = torch.ones(batch, seqlen, dtype=torch.bool, device=DEVICE)
    keep_k = torch.ones(k.shape[:2], dtype=torch.bool, device=DEVICE)
    if key_padding_mask is not None:
        keep_k = key_padding_mask
        if not mha.cross_attn:
            keep_q = key_padding_mask
    if mha.rotary_emb is not None:
        cos, sin = rotary_tables(seqlen, mha.rotary_emb_dim, mha.rotary_emb.base)
        positions = (keep_q.long().cumsum(-1) - 1).clamp(min=0)
        q = apply_rotary(q, cos, sin, positions, mha.rotary_emb.interleaved)
        k = apply_rotary(k, cos, sin, positions, mha.rotary_emb.interleaved)
    alibi = mha.inner_attn.alibi_slopes
    options = dict(softmax_scale=mha.softmax_scale, causal=mha.causal, window_size=mha.window_size,
                   alibi_slopes=alibi, dtype=None)
    rows = []
    for b in range(batch):  # each sequence alone, over its real tokens
        out_b = attention_naive(q[b:b + 1, keep_q[b]], k[b:b + 1, keep_k[b]], v[b:b + 1, keep_k[b]], **options)[0]
        full = out_b.new_zeros((seqlen, h, d))
        full[keep_q[b]] = out_b[0]
        rows.append(full)
    out = linear("out_proj", torch.stack(rows).flatten(-2))
    return out * keep_q[..., None]


def compare_mha(mha, x, dtype, x_kv=None, key_padding_mask=None, backward=True, **forward):
    """Run ``mha`` on x (and x_kv) and check out, dx and the weight gradients against float64."""
    inputs = [x] + ([x_kv] if x_kv is not None else [])
    for t in inputs:
        t.requires_grad_(backward)
    out = mha(x, x_kv=x_kv, key_padding_mask=key_padding_mask, **forward)
    assert out.shape == x.shape and out.dtype == dtype
    names = [n for n, _ in mha.named_parameters()]
    dout = torch.randn_like(out)
    if key_padding_mask is not None and not mha.cross_attn:
        assert not out[~key_padding_mask].any(), "padded rows of the output are not 0"
    got = list(torch.autograd.grad(out, inputs + list(mha.parameters()), dout)) if backward else []

    def run(ref_dtype):
        params = {n: p.detach().to(ref_dtype).requires_grad_(backward) for n, p in mha.named_parameters()}
        leaves = [t.detach().to(ref_dtype).requires_grad_(backward) for t in inputs]
        ref = reference_mha(mha, params, leaves[0], leaves[1] if x_kv is not None else None, key_padding_mask)
        grads = (torch.autograd.grad(ref, leaves + [params[n] for n in names], dout.to(ref_dtype))
                 if backward else [])
        return ref, grads

    ref64, grads64 = run(torch.float64)
    same, grads_same = run(dtype)
    errors = [("out", rel_error(out, ref64), rel_error(same, ref64))]
    labels = ["dx", "dx_kv"][:len(inputs)] + ["d" + n for n in names]
    errors += [(name, rel_error(g, r), rel_error(s, r)) for name, g, r, s in zip(labels, got, grads64, grads_same)]
    check_errors(errors, dtype)


def make_mha(dtype, **kwargs):
    torch.manual_seed(0)
    return MHA(EMBED, NHEADS, device=DEVICE, dtype=dtype, **kwargs)


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


MHA_CONFIGS = {
    "plain": dict(),
    "causal-gqa-rotary": dict(num_heads_kv=2, causal=True, rotary_emb_dim=HEAD_DIM),
    "mqa-window-partial-rotary": dict(num_heads_kv=1, causal=True, window_size=(7, 0), rotary_emb_dim=HEAD_DIM // 2,
                                      rotary_emb_interleaved=True, qkv_proj_bias=False),
    "alibi-scale": dict(use_alibi=True, causal=True, softmax_scale=0.2, out_proj_bias=False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(MHA_CONFIGS))
def test_mha(dtype, config):
    mha = make_mha(dtype, **MHA_CONFIGS[config])
    compare_mha(mha, randn(BATCH, SEQLEN, EMBED, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cross_attn", [False, True])
def test_mha_key_padding_mask(dtype, cross_attn):
    """Left padding, right padding, none, and a middle hole: only real tokens attend and are attended."""
    options = dict(cross_attn=True, num_heads_kv=2) if cross_attn else dict(num_heads_kv=2, causal=True,
                                                                           rotary_emb_dim=HEAD_DIM)
    mha = make_mha(dtype, **options)
    mask = torch.ones(4, SEQLEN, dtype=torch.bool, device=DEVICE)
    mask[0, :5] = False
    mask[1, -7:] = False
    mask[3, 3:9] = False
    x = randn(4, SEQLEN, EMBED, dtype=dtype)
    x_kv = randn(4, SEQLEN + 5, EMBED, dtype=dtype) if cross_attn else None
    if cross_attn:
        mask = torch.cat([mask, torch.ones(4, 5, dtype=torch.bool, device=DEVICE)], dim=1)
        mask[2, -3:] = False
    compare_mha(mha, x, dtype, x_kv=x_kv, key_padding_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_varlen(dtype):
    """Packed x with cu_seqlens equals each sequence through the dense reference."""
    mha = make_mha(dtype, num_heads_kv=2, causal=True, rotary_emb_dim=HEAD_DIM // 2)
    lengths = [SEQLEN, 5, 0, SEQLEN - 3]
    cu_seqlens = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    x = randn(sum(lengths), EMBED, dtype=dtype)
    # As a padded batch, the reference's mask marks the same tokens.
    mask = torch.arange(SEQLEN, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]
    padded = torch.zeros(len(lengths), SEQLEN, EMBED, device=DEVICE, dtype=dtype)
    padded[mask] = x
    out = mha(x, cu_seqlens=cu_seqlens, max_seqlen=max(lengths))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, mha.parameters(), dout)
    padded_out = torch.zeros_like(padded)
    padded_out[mask] = out
    params = {n: p.detach().double() for n, p in mha.named_parameters()}
    ref = reference_mha(mha, params, padded.double(), key_padding_mask=mask)
    same = reference_mha(mha, {n: p.detach() for n, p in mha.named_parameters()}, padded, key_padding_mask=mask)
    check_errors([("out", rel_error(padded_out, ref), rel_error(same, ref))], dtype)
    # And the packed call equals the key_padding_mask call, weights' gradients included.
    out_mask = mha(padded, key_padding_mask=mask)
    grads_mask = torch.autograd.grad(out_mask[mask], mha.parameters(), dout)
    # (The same kernels on the same packed tokens; on the GPU an atomic dQ order may move last bits.)
    eps = torch.finfo(dtype).eps
    assert rel_error(out_mask[mask], out) <= eps
    for g, gm in zip(grads, grads_mask):
        assert rel_error(g, gm) <= eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("varlen", [False, True])
def test_inner_attention_modules(dtype, varlen):
    """FlashSelfAttention / FlashCrossAttention against attention_naive, with per-call causal."""
    h, d, sk = NHEADS, HEAD_DIM, SEQLEN + 9
    window = (9, 3)
    self_attn = FlashSelfAttention(causal=False, window_size=window, softmax_scale=0.3)
    cross_attn = FlashCrossAttention(causal=True)
    qkv = randn(BATCH, SEQLEN, 3, h, d, dtype=dtype).requires_grad_()
    q = randn(BATCH, SEQLEN, h, d, dtype=dtype).requires_grad_()
    kv = randn(BATCH, sk, 2, 2, d, dtype=dtype).requires_grad_()
    if varlen:
        cu_q = torch.arange(BATCH + 1, dtype=torch.int32, device=DEVICE) * SEQLEN
        cu_k = torch.arange(BATCH + 1, dtype=torch.int32, device=DEVICE) * sk
        out_self = self_attn(qkv.flatten(0, 1), causal=True, cu_seqlens=cu_q, max_seqlen=SEQLEN)
        out_self = out_self.unflatten(0, (BATCH, -1))
        out_cross = cross_attn(q.flatten(0, 1), kv.flatten(0, 1), cu_seqlens=cu_q, max_seqlen=SEQLEN, cu_seqlens_k=cu_k,
                               max_seqlen_k=sk).unflatten(0, (BATCH, -1))
    else:
        out_self = self_attn(qkv, causal=True)
        out_cross = cross_attn(q, kv)
    for out, leaves, (rq, rk, rv), opts in (
            (out_self, [qkv], qkv.unbind(2), dict(causal=True, window_size=window, softmax_scale=0.3)),
            (out_cross, [q, kv], (q, *kv.unbind(2)), dict(causal=True))):
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, leaves, dout)
        errors = []
        ref_runs = []
        for ref_dtype in (torch.float64, dtype):
            ls = [t.detach().to(ref_dtype).requires_grad_() for t in leaves]
            args = ls[0].unbind(2) if len(ls) == 1 else (ls[0], *ls[1].unbind(2))
            ref = attention_naive(*args, dtype=None, **opts)[0]
            ref_runs.append((ref, torch.autograd.grad(ref, ls, dout.to(ref_dtype))))
        (ref64, g64), (same, gsame) = ref_runs
        errors.append(("out", rel_error(out, ref64), rel_error(same, ref64)))
        errors += [(f"grad{i}", rel_error(g, r), rel_error(s, r)) for i, (g, r, s) in enumerate(zip(got, g64, gsame))]
        check_errors(errors, dtype)


def test_dropout_only_in_training():
    dtype = DTYPES[0]
    mha = make_mha(dtype, dropout=0.5, causal=True)
    x = randn(BATCH, SEQLEN, EMBED, dtype=dtype)
    mha.eval()
    plain = make_mha(dtype, causal=True)  # same seed: the same weights
    torch.testing.assert_close(mha(x), plain(x), rtol=0, atol=0)
    mha.train()
    torch.manual_seed(1)
    a = mha(x)
    torch.manual_seed(1)
    b = mha(x)
    assert torch.equal(a, b), "dropout is not reproducible under torch.manual_seed"
    assert not torch.allclose(a, plain(x)), "dropout did nothing in training mode"


def test_alibi_slopes():
    assert get_alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    six = get_alibi_slopes(6)
    assert six[:4] == [2.0 ** (-2 * (i + 1)) for i in range(4)] and six[4:] == [2.0 ** -1, 2.0 ** -3]


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding(interleaved):
    """The module's rotation (qkv-packed and q/kv forms, int and per-sequence offsets, packed
    positions) against flashtile.reference.apply_rotary; channels past rotary_dim untouched."""
    rotary_dim, d = 8, 12
    rotary = RotaryEmbedding(rotary_dim, interleaved=interleaved)
    cos, sin = rotary_tables(64, rotary_dim)
    qkv = torch.randn(2, 5, 3, 2, d, device=DEVICE)
    offsets = torch.tensor([3, 40], device=DEVICE)
    out = rotary(qkv, seqlen_offset=offsets)
    positions = offsets[:, None] + torch.arange(5, device=DEVICE)
    for i in range(2):
        torch.testing.assert_close(out[:, :, i], apply_rotary(qkv[:, :, i], cos, sin, positions, interleaved))
    assert torch.equal(out[:, :, 2], qkv[:, :, 2]) and torch.equal(out[..., rotary_dim:], qkv[..., rotary_dim:])
    q, kv = rotary(qkv[:, :, 0], qkv[:, :, 1:], seqlen_offset=7)
    positions = torch.arange(7, 12, device=DEVICE).expand(2, 5)
    torch.testing.assert_close(q, apply_rotary(qkv[:, :, 0], cos, sin, positions, interleaved))
    torch.testing.assert_close(kv[:, :, 0], apply_rotary(qkv[:, :, 1], cos, sin, positions, interleaved))
    assert torch.equal(kv[:, :, 1], qkv[:, :, 2])
    cu_seqlens = torch.tensor([0, 3, 3, 10], dtype=torch.int32, device=DEVICE)
    assert rotary_positions(cu_seqlens, 10).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    # Tables follow the need and stay float32 when the module is cast.
    rotary.to(torch.float16)
    cos_t, _ = rotary.cos_sin(300, DEVICE)
    assert cos_t.dtype == torch.float32 and cos_t.shape[0] >= 300


DECODE_CONFIGS = {
    "gqa-rotary": dict(num_heads_kv=2, causal=True, rotary_emb_dim=HEAD_DIM),
    "mqa-rotary-interleaved-window": dict(num_heads_kv=1, causal=True, rotary_emb_dim=HEAD_DIM // 2,
                                          rotary_emb_interleaved=True, window_size=(6, 0)),
    "mha-alibi": dict(causal=True, use_alibi=True),
}


def two_layer(dtype, **options):
    torch.manual_seed(0)
    return torch.nn.ModuleList([MHA(EMBED, NHEADS, layer_idx=i, device=DEVICE, dtype=dtype, **options)
                                for i in range(2)])


def run_layers(layers, x, **kwargs):
    for layer in layers:
        x = x + layer(x, **kwargs)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(DECODE_CONFIGS))
@torch.no_grad()
def test_incremental_decoding(dtype, config):
    """Two stacked layers: a prefill of the prompt and two single-token steps and a 2-token step through
    the kv cache give the full-sequence forward's outputs."""
    layers = two_layer(dtype, **DECODE_CONFIGS[config]).eval()
    prompt, steps = SEQLEN // 2, [1, 1, 2]
    total = prompt + sum(steps)
    x = randn(BATCH, total, EMBED, dtype=dtype)
    params = InferenceParams(max_seqlen=total + 3, max_batch_size=BATCH + 1)
    outs = [run_layers(layers, x[:, :prompt], inference_params=params)]
    params.seqlen_offset = prompt
    for n in steps:
        start = params.seqlen_offset
        outs.append(run_layers(layers, x[:, start:start + n], inference_params=params))
        params.seqlen_offset += n
    decoded = torch.cat(outs, dim=1)
    full = run_layers(layers, x)
    assert params.key_value_memory_dict[1].shape == (BATCH + 1, total + 3, 2, layers[0].num_heads_kv, HEAD_DIM)
    # Both runs in the input dtype; they differ by rounding only (other tile orders, split-KV).
    scale = full.abs().max().item()
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype] * max(scale, 1.0)
    torch.testing.assert_close(decoded, full, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_decoding_padded_prompts(dtype):
    """Prompts of different lengths (left- and right-padded, one batch): a prefill with
    key_padding_mask, then steps with lengths_per_sample, equal each sequence's own forward."""
    layers = two_layer(dtype, num_heads_kv=2, causal=True, rotary_emb_dim=HEAD_DIM).eval()
    lengths, steps = [9, 4, 6], 2
    width = max(lengths)
    prompts = [randn(1, n + steps, EMBED, dtype=dtype) for n in lengths]  # prompt, then the decoded tokens
    x = torch.zeros(len(lengths), width, EMBED, device=DEVICE, dtype=dtype)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(lengths):
        lo = width - n if b == 1 else 0  # sequence 1 is left-padded
        x[b, lo:lo + n] = prompts[b][0, :n]
        mask[b, lo:lo + n] = True
    params = InferenceParams(max_seqlen=width + steps, max_batch_size=len(lengths))
    prefill = run_layers(layers, x, key_padding_mask=mask, inference_params=params)
    params.lengths_per_sample = mask.sum(-1, dtype=torch.int32)
    params.seqlen_offset = width
    decoded = []
    for t in range(steps):
        step_x = torch.stack([prompts[b][0, n + t] for b, n in enumerate(lengths)])[:, None]
        decoded.append(run_layers(layers, step_x, inference_params=params))
        params.lengths_per_sample += 1
        params.seqlen_offset += 1
    decoded = torch.cat(decoded, dim=1)
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
    for b, n in enumerate(lengths):
        alone = run_layers(layers, prompts[b])
        scale = max(alone.abs().max().item(), 1.0)
        torch.testing.assert_close(prefill[b][mask[b]], alone[0, :n], rtol=0, atol=tol * scale)
        torch.testing.assert_close(decoded[b], alone[0, n:], rtol=0, atol=tol * scale)
