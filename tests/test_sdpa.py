"""flashtile as PyTorch's SDPA flash backend (flashtile.compat.sdpa).

On the CPU the kernels are registered for the CPU dispatch key (sdpa._register_kernels("CPU")), so
the aten flash ops, their autograd formulas and torch.nn.attention.varlen reach flashtile's kernels
through the dispatcher and Triton's interpreter; registration, activation and the fallbacks are
tested as well. On the GPU: F.scaled_dot_product_attention itself with the impl activated, against
float64 (the math backend), and a tiny Hugging Face Llama.
"""

import inspect
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.attention as attention
import torch.nn.functional as F

import flashtile
from flashtile.compat import sdpa
from flashtile.reference import attention_varlen_naive
from flashtile.testing import check_errors, check_lse, reference_errors, rel_error

from _cases import DEVICE, ON_GPU

HAS_REGISTRY = hasattr(attention, "register_flash_attention_impl")
needs_registry = pytest.mark.skipif(not HAS_REGISTRY, reason=f"torch {torch.__version__} has no flash registry")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
aten = torch.ops.aten


def _restore():
    if hasattr(attention, "restore_flash_attention_impl") and attention.current_flash_attention_impl() is not None:
        attention.restore_flash_attention_impl()


@pytest.fixture
def active():
    """flashtile's kernels serving the aten flash ops for DEVICE's tensors; undone afterwards."""
    if ON_GPU:
        if not HAS_REGISTRY:
            pytest.skip(f"torch {torch.__version__} has no flash registry")
        sdpa.register_sdpa()
        attention.activate_flash_attention_impl(sdpa.NAME)
        try:
            yield
        finally:
            _restore()
    else:
        handle = sdpa._register_kernels("CPU")
        try:
            yield
        finally:
            handle.remove()


def _t(x):
    return x.transpose(1, 2)


def _sdpa_inputs(batch, nheads, nheads_k, seqlen_q, seqlen_k, head_dim, dtype):
    """(b, h, s, d) views of (b, s, h, d) tensors, as attention modules make them."""
    def make(s, h):
        return _t(torch.randn(batch, s, h, head_dim, device=DEVICE, dtype=dtype)).requires_grad_()
    return make(seqlen_q, nheads), make(seqlen_k, nheads_k), make(seqlen_k, nheads_k)


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

def test_import_registers_nothing():
    code = ("import flashtile, torch.nn.attention as a; "
            "assert 'flashtile' not in getattr(a, 'list_flash_attention_impls', list)(), 'registered on import'")
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_registry
def test_register_is_idempotent():
    assert flashtile.register_sdpa() == "flashtile"
    assert flashtile.register_sdpa() == "flashtile"
    assert attention.list_flash_attention_impls().count("flashtile") == 1
    assert flashtile.compat.register_sdpa is sdpa.register_sdpa


def test_register_without_registry_says_which_torch(monkeypatch):
    monkeypatch.delattr(attention, "register_flash_attention_impl", raising=False)
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} lacks register_flash_attention_impl")):
        sdpa.register_sdpa()


@needs_registry
def test_activate_and_restore_route_the_cuda_kernel():
    """activate puts flashtile's kernel in aten's CUDA slot, restore takes it out; called boxed so
    the test runs on CPU builds too (DEVICE tensors: the interpreter on the CPU)."""
    sdpa.register_sdpa()
    q, k, v = (x.detach() for x in _sdpa_inputs(1, 2, 2, 17, 17, 32, torch.float16))
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    try:
        for _ in range(2):  # activating again is harmless
            attention.activate_flash_attention_impl("flashtile")
            assert attention.current_flash_attention_impl() == "flashtile"
        kernel = torch.library.get_kernel("aten::_scaled_dot_product_flash_attention", "CUDA")
        before = sdpa.calls["forward"]
        out = kernel.call_boxed(keyset, q, k, v, 0.0, False, False, scale=None)[0]
        assert sdpa.calls["forward"] == before + 1
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        assert rel_error(out, ref) < 2e-3
    finally:
        _restore()
    assert attention.current_flash_attention_impl() is None
    if ON_GPU:  # PyTorch's own kernel is back
        before = sdpa.calls["forward"]
        torch.library.get_kernel("aten::_scaled_dot_product_flash_attention", "CUDA").call_boxed(
            keyset, q, k, v, 0.0, False, False, scale=None)
        assert sdpa.calls["forward"] == before
    else:  # a CPU build has no CUDA kernel of its own
        with pytest.raises(RuntimeError):
            torch.library.get_kernel("aten::_scaled_dot_product_flash_attention", "CUDA")


# ---------------------------------------------------------------------------------------------
# The ops' numerics (through the dispatcher and autograd)
# ---------------------------------------------------------------------------------------------

def _check_sdpa_layout(q, k, v, out, lse, dout, grads, **options):
    errors, ref_lse = reference_errors(_t(q), _t(k), _t(v), _t(out), _t(dout), [_t(g) for g in grads], **options)
    check_errors(errors, q.dtype)
    check_lse(lse, ref_lse)


SDPA_CASES = [  # (nheads, nheads_k, seqlen_q, seqlen_k, head_dim, causal)
    (2, 2, 1, 1, 32, False), (4, 2, 37, 37, 40, True), (2, 1, 113, 60, 32, True), (2, 2, 60, 113, 40, False),
] if not ON_GPU else [
    (4, 4, 1, 1, 64, False), (8, 2, 113, 113, 96, True), (4, 1, 1023, 1023, 128, True), (4, 4, 113, 239, 64, False),
    (4, 2, 239, 113, 128, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32])
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_flash_op_matches_reference(active, dtype, case):
    """aten::_scaled_dot_product_flash_attention + its backward; is_causal is the op's (FA2's)
    bottom-right alignment, as in the reference."""
    nheads, nheads_k, seqlen_q, seqlen_k, head_dim, causal = case
    q, k, v = _sdpa_inputs(2, nheads, nheads_k, seqlen_q, seqlen_k, head_dim, dtype)
    before = sdpa.calls.copy()
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=0.2)
    assert (cum_q, cum_k, max_q, max_k) == (None, None, seqlen_q, seqlen_k)
    assert out.stride() == torch.empty_like(q).stride(), "out must have the layout the meta kernel promises"
    assert rng_state.dtype == unused.dtype == torch.uint64 and rng_state.shape == (2,) and debug.numel() == 0
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert sdpa.calls["forward"] == before["forward"] + 1 and sdpa.calls["backward"] == before["backward"] + 1
    _check_sdpa_layout(q, k, v, out, lse, dout, grads, causal=causal, softmax_scale=0.2)


def test_flash_attention_forward_dense_window(active):
    """aten::_flash_attention_forward on (b, s, h, d) with a sliding window, and its backward."""
    dtype = torch.float16
    q = torch.randn(2, 45, 4, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 50, 2, 32, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    out, lse, rng_state, _, _ = aten._flash_attention_forward(q, k, v, None, None, 45, 50, 0.0, False, False,
                                                              window_size_left=8, window_size_right=3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    errors, ref_lse = reference_errors(q, k, v, out, dout, grads, window_size=(8, 3))
    check_errors(errors, dtype)
    check_lse(lse, ref_lse)


def _varlen_attn():
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if not hasattr(varlen, "varlen_attn"):
        pytest.skip("torch.nn.attention.varlen has no varlen_attn")
    return varlen


def _varlen_kwargs(fn, causal: bool) -> dict:
    """Causal and GQA as this torch's varlen functions take them (2.11: is_causal and no enable_gqa)."""
    params = inspect.signature(fn).parameters
    kwargs = {"enable_gqa": True} if "enable_gqa" in params else {}
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    else:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    return kwargs


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attn(active, causal):
    """torch.nn.attention.varlen.varlen_attn: packed forward and backward (GQA where this torch takes it), and
    varlen_attn_out."""
    varlen = _varlen_attn()
    dtype = torch.float16
    lens_q, lens_k = [5, 1, 40, 0, 17], [9, 1, 33, 4, 17]
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).to(torch.int32)
    options = _varlen_kwargs(varlen.varlen_attn, causal)
    q = torch.randn(sum(lens_q), 4, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    nheads_k = 2 if "enable_gqa" in options else 4
    k, v = (torch.randn(sum(lens_k), nheads_k, 32, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    before = sdpa.calls.copy()
    out, lse = varlen.varlen_attn(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                  return_aux=varlen.AuxRequest(lse=True), **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert sdpa.calls["varlen_forward"] == before["varlen_forward"] + 1
    assert sdpa.calls["varlen_backward"] == before["varlen_backward"] + 1

    def reference(q, k, v, **options):
        return attention_varlen_naive(q, k, v, cu_q, cu_k, **options)

    errors, ref_lse = reference_errors(q, k, v, out, dout, grads, reference=reference, causal=causal)
    check_errors(errors, dtype)
    check_lse(lse, ref_lse)
    if hasattr(varlen, "varlen_attn_out") and sdpa._op_exists(sdpa._FLASH_FWD_INPLACE):
        written = torch.empty_like(out)
        with torch.no_grad():
            varlen.varlen_attn_out(written, q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                   **_varlen_kwargs(varlen.varlen_attn_out, causal))
        torch.testing.assert_close(written, out, rtol=0, atol=0)


def test_dropout_is_reproducible_and_is_flashtiles(active):
    """Same torch seed, same mask: equal to flashtile.flash_attn_func's under that seed (forward and
    backward, so the backward regenerates the forward's mask), and right against the reference
    with that mask; another seed gives another mask."""
    dtype = torch.float16
    q, k, v = _sdpa_inputs(2, 4, 2, 37, 45, 32, dtype)
    dout = torch.randn(2, 4, 37, 32, device=DEVICE, dtype=dtype)

    def run(seed):
        torch.manual_seed(seed)
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.3, False, False)
        return (res[0], res[1], res[6], *torch.autograd.grad(res[0], (q, k, v), dout))

    first, again, other = run(5), run(5), run(6)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])
    qf, kf, vf = (_t(x).detach().requires_grad_() for x in (q, k, v))
    torch.manual_seed(5)
    out_ft, lse_ft, probs = flashtile.flash_attn_func(qf, kf, vf, dropout_p=0.3, return_attn_probs=True)
    assert torch.equal(_t(first[0]), out_ft) and torch.equal(first[1], lse_ft)
    assert first[2].view(torch.int64)[0].item() != 0, "rng_state holds the seed"
    grads_ft = torch.autograd.grad(out_ft, (qf, kf, vf), _t(dout))
    for g, g_ft in zip(first[3:], grads_ft):
        assert torch.equal(_t(g), g_ft)
    errors, _ = reference_errors(qf, kf, vf, out_ft, _t(dout), grads_ft, dropout_mask=probs >= 0, dropout_p=0.3)
    check_errors(errors, dtype)


# ---------------------------------------------------------------------------------------------
# Fallbacks (PyTorch's kernels stood in by a recorder)
# ---------------------------------------------------------------------------------------------

class _Recorder:
    def __init__(self, result):
        self.result, self.seen = result, []

    def call_boxed(self, keyset, *args, **kwargs):
        self.seen.append((args, kwargs))
        return self.result


@pytest.fixture
def natives(monkeypatch):
    """Recorders in place of PyTorch's kernels, and a fresh warn-once memory."""
    monkeypatch.setattr(sdpa, "_warned", set())
    monkeypatch.setattr(sdpa, "_native_rng", type(sdpa._native_rng)())
    fakes = {}
    for op in sdpa._ARGS:
        rng = torch.zeros(2, dtype=torch.uint64)
        result = (("native-out", "lse", None, None, 1, 1, rng, None, None) if op == sdpa._SDPA_FWD
                  else ("native-out", "lse", rng, None, None) if op == sdpa._FLASH_FWD else ("native",))
        fakes[op] = _Recorder(result)
    monkeypatch.setattr(sdpa, "_native", fakes)
    return fakes


def _small(dtype=torch.float16, head_dim=32, seqlen=8):
    return [torch.randn(1, 2, seqlen, head_dim, device=DEVICE, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("what, make, match", [
    ("debug mask", lambda: (_small(), dict(return_debug_mask=True)), "return_debug_mask"),
    ("float64", lambda: (_small(torch.float64), {}), "float64"),
    ("head dim", lambda: (_small(head_dim=288), {}), "head dim 288"),
    ("int", lambda: ([torch.ones(1, 2, 8, 32, dtype=torch.int32, device=DEVICE)] * 3, {}), "int32"),
])
def test_sdpa_forward_falls_back_with_a_warning_once(natives, what, make, match):
    (q, k, v), options = make()
    args = (q, k, v, 0.0, False, options.get("return_debug_mask", False))
    with pytest.warns(RuntimeWarning, match=f"PyTorch's kernel instead: .*{match}"):
        result = sdpa._sdpa_forward_kernel(None, *args, scale=None)
    assert result[0] == "native-out" and natives[sdpa._SDPA_FWD].seen[0] == (args, {"scale": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        sdpa._sdpa_forward_kernel(None, *args, scale=None)
    assert sum(n for reason, n in sdpa.fallbacks.items() if match in reason) >= 2


def test_flash_forward_falls_back_on_alibi_and_dense_seqused(natives):
    q, k, v = (_t(x) for x in _small())
    for kwargs, match in ((dict(alibi_slopes=torch.ones(2, device=DEVICE)), "alibi_slopes"),
                          (dict(seqused_k=torch.ones(1, dtype=torch.int32, device=DEVICE)), "dense call")):
        with pytest.warns(RuntimeWarning, match=match):
            result = sdpa._flash_forward_kernel(None, q, k, v, None, None, 8, 8, 0.0, False, False, **kwargs)
        assert result[0] == "native-out"


def test_fallback_without_a_kernel_of_torchs_own_raises(natives, monkeypatch):
    monkeypatch.setitem(sdpa._native, sdpa._SDPA_FWD, None)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="float64.*no kernel of its own"):
        sdpa._sdpa_forward_kernel(None, *_small(torch.float64), 0.0, False, False, scale=None)


def test_dropout_backward_follows_its_forward(natives):
    """A dropout forward PyTorch's kernel ran has its backward run there too (same mask); a dropout
    backward flashtile cannot take after flashtile's own forward raises rather than mixing masks."""
    q, k, v = _small()
    with pytest.warns(RuntimeWarning):
        fwd = sdpa._sdpa_forward_kernel(None, q, k, v, 0.2, False, True, scale=None)
    lse = torch.zeros(1, 2, 8, device=DEVICE)
    bwd_args = (q, q, k, v, q, lse, None, None, 8, 8, 0.2, False, fwd[6], fwd[7])
    assert sdpa._sdpa_backward_kernel(None, *bwd_args, scale=None) == ("native",)
    # The same backward with a seed flashtile drew, and a logsumexp it cannot take:
    ours = sdpa._rng_state(torch.ones(1, dtype=torch.int64, device=DEVICE), DEVICE)
    bad_lse = torch.zeros(1, 2, 7, device=DEVICE)
    with pytest.raises(RuntimeError, match="dropout_p > 0 cannot run: logsumexp"):
        sdpa._sdpa_backward_kernel(None, q, q, k, v, q, bad_lse, None, None, 8, 8, 0.2, False, ours, fwd[7],
                                   scale=None)
    with pytest.warns(RuntimeWarning, match="logsumexp"):  # without dropout PyTorch's kernel may take it
        assert sdpa._sdpa_backward_kernel(None, q, q, k, v, q, bad_lse, None, None, 8, 8, 0.0, False, ours, fwd[7],
                                          scale=None) == ("native",)


# ---------------------------------------------------------------------------------------------
# GPU: F.scaled_dot_product_attention itself
# ---------------------------------------------------------------------------------------------

def _math(q, k, v, dtype, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(*leaves, **kwargs), leaves


def _check_against_math(q, k, v, out, dout, grads, **kwargs):
    """FlashAttention's rule: error vs float64 (the math backend) at most 2x the math backend's own
    error in the input dtype, plus a small epsilon."""
    ref, ref_leaves = _math(q, k, v, torch.float64, **kwargs)
    same, same_leaves = _math(q, k, v, q.dtype, **kwargs)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    same_grads = torch.autograd.grad(same, same_leaves, dout)
    errors = [("out", rel_error(out, ref), rel_error(same, ref))]
    errors += [(n, rel_error(g, r), rel_error(s, r)) for n, g, r, s in zip(("dq", "dk", "dv"), grads, ref_grads,
                                                                           same_grads)]
    check_errors(errors, q.dtype)


def _flash_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("seqlen", [1, 113, 1023])
@pytest.mark.parametrize("causal, gqa", [(False, False), (True, False), (True, True)])
def test_sdpa_with_flashtile_active(active, dtype, head_dim, seqlen, causal, gqa):
    q, k, v = _sdpa_inputs(2, 8, 2 if gqa else 8, seqlen, seqlen, head_dim, dtype)
    before = sdpa.calls.copy()
    with _flash_only():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert sdpa.calls["forward"] > before["forward"] and sdpa.calls["backward"] > before["backward"]
    _check_against_math(q, k, v, out, dout, grads, is_causal=causal, enable_gqa=gqa)


@gpu_only
def test_sdpa_unequal_lengths_and_odd_head_dim(active):
    """sq != sk (not causal: SDPA sends causal ones elsewhere) and a head dim SDPA pads to 8."""
    q, k, v = _sdpa_inputs(2, 4, 4, 113, 1023, 72, torch.bfloat16)
    before = sdpa.calls["forward"]
    with _flash_only():
        out = F.scaled_dot_product_attention(q, k, v, scale=0.1)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert sdpa.calls["forward"] > before
    _check_against_math(q, k, v, out, dout, grads, scale=0.1)


@gpu_only
def test_sdpa_causal_alignment(active):
    """SDPA's is_causal with sq != sk is top-left: it must not come out bottom-right (torch routes it
    away from flash); causal_lower_right reaches the flash op and comes out bottom-right."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _sdpa_inputs(2, 4, 4, 113, 239, 64, torch.float16)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref, _ = _math(q, k, v, torch.float32, is_causal=True)
    assert rel_error(out, ref) < 2e-3
    before = sdpa.calls["forward"]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(113, 239))
    assert sdpa.calls["forward"] == before + 1
    mask = torch.ones(113, 239, dtype=torch.bool, device=DEVICE).tril(239 - 113)
    ref, _ = _math(q, k, v, torch.float32, attn_mask=mask)
    assert rel_error(out, ref) < 2e-3


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_dropout(active, dtype):
    """Same seed, same output and gradients; another seed another; E[out] right: with uniform
    attention (q = 0) and v = 1 each output is kept / (sk (1 - p)), about 1 on average."""
    q, k, v = _sdpa_inputs(2, 8, 2, 1023, 1023, 64, dtype)

    def run(seed):
        torch.manual_seed(seed)
        with _flash_only():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True)
        return (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    first, again, other = run(1), run(1), run(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])
    zeros = torch.zeros(4, 8, 1023, 64, device=DEVICE, dtype=dtype)
    ones = torch.ones(4, 8, 1023, 64, device=DEVICE, dtype=dtype)
    before = sdpa.calls["forward"]
    with _flash_only():
        out = F.scaled_dot_product_attention(zeros, zeros, ones, dropout_p=0.3)
    assert sdpa.calls["forward"] == before + 1
    per_row = out[..., 0].float()  # kept / (1023 * 0.7) for each (b, h, row)
    n = 1023
    sigma_row = (0.3 / (0.7 * n)) ** 0.5
    assert abs(per_row.mean().item() - 1.0) < 5 * sigma_row / per_row.numel() ** 0.5 + 2e-3
    assert abs(per_row.std().item() - sigma_row) < 0.2 * sigma_row


@gpu_only
def test_hf_llama_sdpa_same_logits_with_flashtile():
    transformers = pytest.importorskip("transformers")
    if not HAS_REGISTRY:
        pytest.skip(f"torch {torch.__version__} has no flash registry")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=512)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(device=DEVICE, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 200), device=DEVICE)
    # The flash backend only: on sm90+ SDPA's default order may pick cuDNN, which flashtile does not replace.
    with torch.no_grad(), _flash_only():
        plain = model(ids).logits.float()
        sdpa.register_sdpa()
        attention.activate_flash_attention_impl("flashtile")
        try:
            before = sdpa.calls["forward"]
            ours = model(ids).logits.float()
            assert sdpa.calls["forward"] >= before + config.num_hidden_layers, "flashtile's kernels did not run"
        finally:
            _restore()
    assert rel_error(ours, plain) < 1e-2
