"""flashtile as flash_attn (issue 38): install_as_flash_attn's module alias, flash_attn 2.8's private
entry points, and argument parity (window_size int-likes, paged forwards with grad, flag types,
MHA's constructor arguments, xPos). The expected signatures below are written out from
flash-attention v2.8.3's source (flash_attn/flash_attn_interface.py, bert_padding.py,
layers/rotary.py, modules/mha.py)."""

import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import sys
import types
import warnings

import numpy as np
import pytest
import torch

import flashtile
from flashtile import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, install_as_flash_attn,
                       uninstall_as_flash_attn)
from flashtile.compat import flash_attn as alias_module
from flashtile.compat.flash_attn_private import (_flash_attn_backward, _flash_attn_forward,
                                                 _flash_attn_varlen_backward, _flash_attn_varlen_forward)
from flashtile.modules import MHA, InferenceParams, RotaryEmbedding
from flashtile.modules import mha as mha_module
from flashtile.modules.rotary import apply_rotary_emb_func
from flashtile.reference import apply_rotary, attention_naive, attention_varlen_naive
from flashtile.testing import check_errors, check_lse, reference_errors

from _cases import DEVICE, DTYPES, make_qkv, randn

MODULE_PATHS = ["flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding", "flash_attn.layers",
                "flash_attn.layers.rotary", "flash_attn.modules", "flash_attn.modules.mha"]


def _flash_attn_entries():
    return {name: module for name, module in sys.modules.items() if name == "flash_attn" or
            name.startswith("flash_attn.")}


@pytest.fixture
def alias():
    handle = install_as_flash_attn()
    yield handle
    handle.uninstall()


# ---------------------------------------------------------------------------------------------
# The alias: opt-in, every path imports, install / uninstall, refusal to shadow flash-attn
# ---------------------------------------------------------------------------------------------

def test_importing_flashtile_registers_nothing():
    assert alias_module._active is None
    assert not any(getattr(m, "__flashtile_alias__", False) for m in _flash_attn_entries().values())


def test_every_module_path_imports(alias):
    import flash_attn.flash_attn_interface  # noqa: F401  (the statement form, as user code writes it)
    from flash_attn import flash_attn_func as fa_func
    from flash_attn.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input
    from flash_attn.layers.rotary import RotaryEmbedding as FaRotary, apply_rotary_emb
    from flash_attn.modules.mha import MHA as FaMHA

    for path in MODULE_PATHS:
        assert importlib.import_module(path) is sys.modules[path]
    fa = sys.modules["flash_attn"]
    assert fa.flash_attn_interface is sys.modules["flash_attn.flash_attn_interface"]
    assert fa.layers.rotary is sys.modules["flash_attn.layers.rotary"] and fa.modules.mha.MHA is MHA
    assert fa.__version__ == f"2.8.3+flashtile{flashtile.__version__}"
    assert fa_func is flash_attn_func and FaMHA is MHA and FaRotary is RotaryEmbedding
    assert pad_input is flashtile.pad_input and unpad_input is flashtile.unpad_input
    assert index_first_axis is flashtile.index_first_axis and apply_rotary_emb is apply_rotary_emb_func
    interface = flash_attn.flash_attn_interface
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
                 "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"):
        assert getattr(interface, name) is getattr(flashtile, name) is getattr(fa, name)
    assert interface._flash_attn_forward is _flash_attn_forward
    assert importlib.util.find_spec("flash_attn").origin == "flashtile"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flash_attn.ops")  # not provided: a clear import error, not a half module


def test_index_put_first_axis(alias):
    from flash_attn.bert_padding import index_put_first_axis

    values = randn(3, 2, 4, dtype=torch.float32).requires_grad_()
    indices = torch.tensor([4, 0, 2], device=DEVICE)
    full = index_put_first_axis(values, indices, 6)
    expected = torch.zeros(6, 2, 4, device=DEVICE)
    expected[indices] = values.detach()
    assert torch.equal(full, expected)
    (full * torch.arange(6, device=DEVICE)[:, None, None]).sum().backward()
    assert torch.equal(values.grad, indices.float()[:, None, None].expand(3, 2, 4))


def test_install_uninstall_leaves_sys_modules_as_it_was():
    before = dict(sys.modules)
    handle = install_as_flash_attn()
    assert install_as_flash_attn() is handle  # idempotent
    assert set(_flash_attn_entries()) == set(MODULE_PATHS)
    assert uninstall_as_flash_attn() is True
    assert uninstall_as_flash_attn() is False and handle.uninstall() is False
    assert set(sys.modules) == set(before) and all(sys.modules[n] is m for n, m in before.items())
    with install_as_flash_attn() as handle:
        import flash_attn
        assert flash_attn.flash_attn_func is flash_attn_func
    assert not handle.installed and set(sys.modules) == set(before)


def test_force_replaces_and_restores_an_imported_flash_attn(monkeypatch):
    real = types.ModuleType("flash_attn")  # stands for a real flash_attn already imported
    real.__file__ = "/site-packages/flash_attn/__init__.py"
    monkeypatch.setitem(sys.modules, "flash_attn", real)
    with pytest.raises(RuntimeError, match="flash-attn is installed .*force=True"):
        install_as_flash_attn()
    assert sys.modules["flash_attn"] is real
    handle = install_as_flash_attn(force=True)
    assert sys.modules["flash_attn"] is not real and sys.modules["flash_attn"].flash_attn_func is flash_attn_func
    handle.uninstall()
    assert sys.modules["flash_attn"] is real and set(_flash_attn_entries()) == {"flash_attn"}


def test_refuses_to_shadow_an_installed_flash_attn(monkeypatch):
    find_spec = importlib.util.find_spec
    fake = importlib.machinery.ModuleSpec("flash_attn", None, origin="/site-packages/flash_attn/__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: fake if name == "flash_attn" else find_spec(name, *args))
    before = set(sys.modules)
    with pytest.raises(RuntimeError, match="/site-packages/flash_attn/__init__.py.*does not shadow.*force=True"):
        install_as_flash_attn()
    assert set(sys.modules) == before
    with pytest.raises(TypeError, match="force must be a bool"):
        install_as_flash_attn(force="yes")
    with install_as_flash_attn(force=True):
        assert sys.modules["flash_attn"].__version__.startswith("2.8.3+flashtile")
    assert set(sys.modules) == before


def test_distribution_metadata_while_installed():
    # transformers and others ask importlib.metadata for flash_attn's version.
    before = list(sys.meta_path)
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("flash_attn")
    with install_as_flash_attn():
        for name in ("flash_attn", "flash-attn", "Flash.Attn"):
            assert importlib.metadata.version(name) == alias_module.VERSION == sys.modules["flash_attn"].__version__
        assert importlib.metadata.metadata("flash_attn")["Name"] == "flash_attn"
        assert "flash_attn" in importlib.metadata.packages_distributions()["flash_attn"]
        assert [d.version for d in importlib.metadata.distributions() if d.metadata["Name"] == "flash_attn"] == [
            alias_module.VERSION]
        assert not list(importlib.metadata.distributions(name="flash_attn", path=[]))  # not on any path
        assert install_as_flash_attn() is alias_module._active  # installing twice adds no second finder
        assert len(sys.meta_path) == len(before) + 1
    assert sys.meta_path == before
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("flash-attn")


def test_distribution_metadata_of_a_real_flash_attn_is_kept_unless_forced(tmp_path, monkeypatch):
    # A flash-attn distribution whose module importlib cannot find (so install needs no force): its
    # metadata stays what importlib.metadata reports unless force=True.
    info = tmp_path / "flash_attn-2.7.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.7.4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.meta_path)
    assert importlib.metadata.version("flash_attn") == "2.7.4"
    with install_as_flash_attn():
        assert importlib.metadata.version("flash_attn") == "2.7.4" and sys.meta_path == before
    with install_as_flash_attn(force=True):
        assert importlib.metadata.version("flash-attn") == alias_module.VERSION
    assert importlib.metadata.version("flash_attn") == "2.7.4" and sys.meta_path == before


# ---------------------------------------------------------------------------------------------
# Signatures: flash_attn 2.8.3's, written out ((name, default); REQ = no default)
# ---------------------------------------------------------------------------------------------

REQ = inspect.Parameter.empty
SCORE = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
         ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
PUBLIC = {
    "flash_attn_func": [("q", REQ), ("k", REQ), ("v", REQ)] + SCORE,
    "flash_attn_qkvpacked_func": [("qkv", REQ)] + SCORE,
    "flash_attn_kvpacked_func": [("q", REQ), ("kv", REQ)] + SCORE,
    "flash_attn_varlen_qkvpacked_func": [("qkv", REQ), ("cu_seqlens", REQ), ("max_seqlen", REQ)] + SCORE,
    "flash_attn_varlen_kvpacked_func": [("q", REQ), ("kv", REQ), ("cu_seqlens_q", REQ), ("cu_seqlens_k", REQ),
                                        ("max_seqlen_q", REQ), ("max_seqlen_k", REQ)] + SCORE,
    "flash_attn_varlen_func": [("q", REQ), ("k", REQ), ("v", REQ), ("cu_seqlens_q", REQ), ("cu_seqlens_k", REQ),
                               ("max_seqlen_q", REQ), ("max_seqlen_k", REQ)] + SCORE + [("block_table", None)],
    "flash_attn_with_kvcache": [
        ("q", REQ), ("k_cache", REQ), ("v_cache", REQ), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
}
_OPTS = [("dropout_p", REQ), ("softmax_scale", REQ), ("causal", REQ), ("window_size_left", REQ),
         ("window_size_right", REQ), ("softcap", REQ), ("alibi_slopes", REQ)]
_GRADS = [("dout", REQ), ("q", REQ), ("k", REQ), ("v", REQ), ("out", REQ), ("softmax_lse", REQ), ("dq", REQ),
          ("dk", REQ), ("dv", REQ)]
_VARLEN = [("cu_seqlens_q", REQ), ("cu_seqlens_k", REQ), ("max_seqlen_q", REQ), ("max_seqlen_k", REQ)]
PRIVATE = {
    "_flash_attn_forward": [("q", REQ), ("k", REQ), ("v", REQ)] + _OPTS + [("return_softmax", REQ)],
    "_flash_attn_varlen_forward": [("q", REQ), ("k", REQ), ("v", REQ)] + _VARLEN + [
        ("dropout_p", REQ), ("softmax_scale", REQ), ("causal", REQ), ("window_size_left", -1),
        ("window_size_right", -1), ("softcap", 0.0), ("alibi_slopes", None), ("return_softmax", False),
        ("block_table", None), ("leftpad_k", None), ("seqused_k", None), ("zero_tensors", False)],
    "_flash_attn_backward": _GRADS + _OPTS + [("deterministic", REQ), ("rng_state", None)],
    "_flash_attn_varlen_backward": _GRADS + _VARLEN + _OPTS + [("deterministic", REQ), ("rng_state", None),
                                                               ("zero_tensors", False)],
}
OTHERS = {
    ("flash_attn.bert_padding", "pad_input"): [("hidden_states", REQ), ("indices", REQ), ("batch", REQ),
                                               ("seqlen", REQ)],
    ("flash_attn.bert_padding", "unpad_input"): [("hidden_states", REQ), ("attention_mask", REQ),
                                                 ("unused_mask", None)],
    ("flash_attn.layers.rotary", "apply_rotary_emb"): [
        ("x", REQ), ("cos", REQ), ("sin", REQ), ("interleaved", False), ("inplace", False), ("seqlen_offsets", 0),
        ("cu_seqlens", None), ("max_seqlen", None)],
    ("flash_attn.layers.rotary", "RotaryEmbedding"): [("dim", REQ), ("base", 10000.0), ("interleaved", False),
                                                      ("scale_base", None), ("device", None)],
    ("flash_attn.modules.mha", "MHA"): [
        ("embed_dim", REQ), ("num_heads", REQ), ("num_heads_kv", None), ("cross_attn", False),
        ("qkv_proj_bias", True), ("out_proj_bias", True), ("dropout", 0.0), ("softmax_scale", None),
        ("causal", False), ("layer_idx", None), ("dwconv", False), ("rotary_emb_dim", 0),
        ("rotary_emb_base", 10000.0), ("rotary_emb_scale_base", None), ("rotary_emb_interleaved", False),
        ("use_alibi", False), ("window_size", (-1, -1)), ("fused_bias_fc", False), ("use_flash_attn", False),
        ("return_residual", False), ("checkpointing", False), ("device", None), ("dtype", None)],
}


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_signatures_match_flash_attn_2_8(alias):
    interface = sys.modules["flash_attn.flash_attn_interface"]
    for name, expected in PUBLIC.items():
        # flashtile may add trailing keyword arguments (flash_attn_varlen_func: seqused_q, seqused_k)
        assert _params(getattr(interface, name))[:len(expected)] == expected, name
    for name, expected in PRIVATE.items():
        assert _params(getattr(interface, name)) == expected, name
    for (module, name), expected in OTHERS.items():
        assert _params(getattr(sys.modules[module], name)) == expected, name


# ---------------------------------------------------------------------------------------------
# The private forward / backward: flashtile's public functions and the float64 reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_private_dense_matches_public_and_reference(dtype):
    q, k, v = make_qkv(2, 19, 27, 4, 2, 32, dtype)
    options = dict(softmax_scale=0.3, causal=True, window_size=(9, -1), softcap=0.0, alibi_slopes=None)
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, 0.0, 0.3, True, 9, -1, 0.0, None, False)
    assert not out.requires_grad and s_dmask.numel() == 0
    assert rng_state.dtype == torch.int64 and tuple(rng_state.shape) == (2,)
    ref_out, ref_lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    assert torch.equal(out, ref_out.detach()) and torch.equal(lse, ref_lse)

    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    softmax_d = _flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, 0.0, 0.3, True,
                                     9, -1, 0.0, None, False, rng_state)
    grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    for got, want in zip((dq, dk, dv), grads):  # written in place, the same kernels as autograd's
        assert torch.equal(got, want)
    errors, reference_lse = reference_errors(q, k, v, out, dout, (dq, dk, dv), **options)
    check_errors(errors, dtype)
    check_lse(lse, reference_lse)
    # softmax_d: rowsum(dout * out) in flash_attn's (b, h, round128(sq)) layout, zeros past sq
    assert softmax_d.shape == (2, 4, 128) and softmax_d.dtype == torch.float32
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[:, :, :19], delta)
    assert not softmax_d[:, :, 19:].any()


def test_private_dense_dropout_regenerates_the_mask():
    dtype, p = torch.float16, 0.25
    q, k, v = make_qkv(1, 16, 24, 2, 1, 16, dtype, requires_grad=False)
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, p, None, False, -1, -1, 0.0, None, True)
    assert s_dmask.shape == (1, 2, 16, 24)
    keep = s_dmask >= 0  # dropped probabilities come back negated
    assert 0 < (~keep).sum() < keep.numel()
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, None, False, -1, -1, 0.0, None, True, rng_state)
    errors, ref_lse = reference_errors(q, k, v, out, dout, (dq, dk, dv), dropout_mask=keep, dropout_p=p)
    check_errors(errors, dtype)
    check_lse(lse, ref_lse)
    with pytest.raises(ValueError, match="needs the rng_state the forward returned"):
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, None, False, -1, -1, 0.0, None, True)
    with pytest.raises(ValueError, match="dq is float16 \\(1, 16, 2, 8\\)"):
        _flash_attn_backward(dout, q, k, v, out, lse, dq[..., :8], dk, dv, 0.0, None, False, -1, -1, 0.0, None,
                             False)


def _packed(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype):
    q = randn(sum(lengths_q), nheads, head_dim, dtype=dtype, requires_grad=True)
    k = randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, requires_grad=True)
    v = randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, requires_grad=True)
    cu = [torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32) for lengths in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


def test_private_varlen_matches_public_and_reference():
    dtype, lengths_q, lengths_k = torch.float16, [5, 0, 11], [7, 3, 9]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 32, dtype)
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 11, 9, 0.0, None, True,
                                                              window_size_left=4)
    assert s_dmask.numel() == 0 and tuple(rng_state.shape) == (2,)
    ref_out, ref_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 9, causal=True, window_size=(4, -1),
                                                 return_attn_probs=True)
    assert torch.equal(out, ref_out.detach()) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    softmax_d = _flash_attn_varlen_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, cu_q,
                                            cu_k, 11, 9, 0.0, None, True, 4, -1, 0.0, None, True, rng_state)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(ref_out, (q, k, v), dout)):
        assert torch.equal(got, want)
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    errors, _ = reference_errors(q, k, v, out, dout, (dq, dk, dv), reference=reference, causal=True,
                                 window_size=(4, -1))
    check_errors(errors, dtype)
    # softmax_d: (h, total_q + 128 * batch), sequence b's rows from cu_seqlens_q[b] + 128 * b
    assert softmax_d.shape == (4, 16 + 128 * 3)
    delta = (dout.float() * out.float()).sum(-1).t()
    torch.testing.assert_close(softmax_d[:, 0:5], delta[:, 0:5])
    torch.testing.assert_close(softmax_d[:, 5 + 256:5 + 256 + 11], delta[:, 5:16])
    assert softmax_d.abs().sum().item() == pytest.approx(delta.abs().sum().item(), rel=1e-5)
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 11, 9, 0.0, None, False,
                                   leftpad_k=torch.zeros(3, dtype=torch.int32, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# Argument parity
# ---------------------------------------------------------------------------------------------

def test_window_size_int_likes():
    q, k, v = make_qkv(1, 12, 20, 2, 2, 16, torch.float32, requires_grad=False)
    expected = flash_attn_func(q, k, v, window_size=(3, 2))
    for window in ([3, 2], (np.int64(3), np.int32(2)), (torch.tensor(3), torch.tensor([2])),
                   torch.tensor([3, 2]), torch.tensor([[3, 2]], dtype=torch.int32), np.array([3, 2])):
        assert torch.equal(flash_attn_func(q, k, v, window_size=window), expected), repr(window)
    window = torch.randint(0, 20, (2,))  # the reproducer
    as_ints = flash_attn_func(q, k, v, window_size=tuple(window.tolist()))
    assert torch.equal(flash_attn_func(q, k, v, window_size=window), as_ints)
    for bad in (torch.tensor([1.5, 2.0]), torch.tensor([1, 2, 3]), (True, 0), (torch.tensor(True), 1), (2, 1.0)):
        with pytest.raises(ValueError, match="window_size must be a pair of ints"):
            flash_attn_func(q, k, v, window_size=bad)
    # the packed and kv-cache entry points read the window through the same check
    lengths = [12]
    cu = torch.tensor([0, 12], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, lengths[0], 20,
                                                      window_size=torch.tensor([3, 2])), expected[0])
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=20, window_size=torch.tensor([3, 2]))
    torch.testing.assert_close(out, expected)


def test_kvcache_window_size_int_likes():
    # flash_attn_with_kvcache reads the window through checks.window_pair, like every entry point: a
    # (1, 2) tensor, whose window_size[0] is not one int, is read as (3, 2) too.
    q, k, v = make_qkv(2, 3, 24, 4, 2, 16, torch.float32, requires_grad=False)
    seqlens = torch.tensor([24, 17], dtype=torch.int32, device=DEVICE)
    for causal in (False, True):
        expected = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal, window_size=(3, 2))
        for window in ([3, 2], (np.int64(3), np.int32(2)), (torch.tensor(3), torch.tensor([2])), torch.tensor([3, 2]),
                       torch.tensor([[3, 2]], dtype=torch.int32), np.array([3, 2])):
            out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal, window_size=window)
            assert torch.equal(out, expected), (causal, repr(window))
    unbounded = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)
    assert torch.equal(flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, window_size=torch.tensor([-1, -1])),
                       unbounded)
    for bad in (torch.tensor([1.5, 2.0]), torch.tensor([1, 2, 3]), (True, 0), (2, 1.0), 3):
        with pytest.raises(ValueError, match="window_size must be a pair of ints"):
            flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, window_size=bad)
    with pytest.raises(ValueError, match="window_size entries must be >= 0, or -1"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, window_size=(-2, 0))


def test_paged_varlen_forward_with_grad_and_backward_raises():
    q, k, v, cu, _ = _packed([5, 9], [5, 9], 2, 1, 16, torch.float32)
    pages = torch.zeros(2, 16, 1, 16, device=DEVICE)
    pages[0, :5], pages[1, :9] = k.detach()[:5], k.detach()[5:]
    k_pages = pages.clone().requires_grad_()
    table = torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE)
    out = flash_attn_varlen_func(q, k_pages, k_pages, cu, cu, 9, 9, causal=True, block_table=table)
    assert out.requires_grad
    with torch.no_grad():
        packed = flash_attn_varlen_func(q, k, k, cu, cu, 9, 9, causal=True)
    # Other tiles, other sums: on the interpreter numpy's BLAS may round the last bit differently.
    torch.testing.assert_close(out.detach(), packed, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="no backward through a paged cache"):
        out.sum().backward()
    out = flash_attn_varlen_func(q, pages, pages, cu, cu, 9, 9, block_table=table)  # only q needs a gradient
    with pytest.raises(RuntimeError, match="no backward through a paged cache"):
        torch.autograd.grad(out.sum(), q)


def test_flag_types():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, requires_grad=False)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    cases = [(TypeError, "deterministic must be a bool, got str 'yes'", dict(deterministic="yes")),
             (ValueError, "causal must be a bool \\(True / False, or 0 / 1\\), got 2", dict(causal=2)),
             (TypeError, "return_attn_probs must be a bool, got NoneType", dict(return_attn_probs=None)),
             (TypeError, "causal must be a bool, got Tensor", dict(causal=torch.tensor(True)))]
    for exc, match, kwargs in cases:
        with pytest.raises(exc, match=match):
            flash_attn_func(q, k, v, **kwargs)
        with pytest.raises(exc, match=match):
            flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, **kwargs)
    expected = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flash_attn_func(q, k, v, causal=np.bool_(True), deterministic=1), expected)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        _flash_attn_backward(q, q, k, v, q, torch.zeros(1, 2, 8, device=DEVICE), None, None, None, 0.0, None, False,
                             -1, -1, 0.0, None, "no")
    with pytest.raises(TypeError, match="zero_tensors must be a bool"):
        _flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 8, 8, 0.0, None, False, zero_tensors="no")


def test_explain_checks_deterministic_like_the_call():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, requires_grad=False)
    for bad, exc, match in (("yes", TypeError, "deterministic must be a bool, got str 'yes'"),
                            (None, TypeError, "deterministic must be a bool, got NoneType"),
                            (2, ValueError, "deterministic must be a bool \\(True / False, or 0 / 1\\), got 2")):
        with pytest.raises(exc, match=match):
            flash_attn_func(q, k, v, deterministic=bad)
        with pytest.raises(exc, match=match):
            flashtile.explain(q, k, v, deterministic=bad)
    for capability in (None, (9, 0)):
        expected = str(flashtile.explain(q, k, v, deterministic=True, device_capability=capability))
        for flag in (1, np.bool_(True)):
            assert str(flashtile.explain(q, k, v, deterministic=flag, device_capability=capability)) == expected


# ---------------------------------------------------------------------------------------------
# MHA's flash_attn arguments and xPos
# ---------------------------------------------------------------------------------------------

EMBED, NHEADS = 32, 2


def _twins(**kwargs):
    """An MHA with kwargs and one with the same weights without them."""
    torch.manual_seed(0)
    mha = MHA(EMBED, NHEADS, device=DEVICE, dtype=torch.float32, **kwargs)
    plain = MHA(EMBED, NHEADS, device=DEVICE, dtype=torch.float32,
                **{k: v for k, v in kwargs.items() if k not in ("return_residual", "checkpointing")})
    plain.load_state_dict(mha.state_dict())
    return mha, plain


def test_mha_return_residual():
    mha, plain = _twins(causal=True, return_residual=True)
    x = randn(2, 10, EMBED, dtype=torch.float32)
    out, residual = mha(x)
    assert residual is x and torch.equal(out, plain(x))


def test_mha_checkpointing_same_output_and_gradients():
    mha, plain = _twins(causal=True, dropout=0.3, checkpointing=True)  # dropout: the recompute redraws the mask
    x = randn(2, 10, EMBED, dtype=torch.float32)
    results = []
    for module in (mha, plain):
        leaf = x.clone().requires_grad_()
        torch.manual_seed(7)
        out = module(leaf)
        grads = torch.autograd.grad(out, [leaf] + list(module.parameters()), torch.ones_like(out))
        results.append((out.detach(), grads))
    (out_ckpt, grads_ckpt), (out_plain, grads_plain) = results
    assert torch.equal(out_ckpt, out_plain)
    for a, b in zip(grads_ckpt, grads_plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_mha_build_flags_and_dwconv(monkeypatch):
    monkeypatch.setattr(mha_module, "_warned_build_flags", set())
    for flag in ("use_flash_attn", "fused_bias_fc"):
        with pytest.warns(UserWarning, match=f"MHA\\({flag}=True\\) has no effect in flashtile"):
            MHA(EMBED, NHEADS, **{flag: True})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            MHA(EMBED, NHEADS, **{flag: True})  # once per process
    with pytest.raises(NotImplementedError, match="dwconv"):
        MHA(EMBED, NHEADS, dwconv=True)


def _flash_attn_xpos_tables(dim, seqlen, scale_base, base=10000.0):
    """flash_attn's RotaryEmbedding._update_cos_sin_cache with scale_base, float32 as there."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=DEVICE, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(seqlen, device=DEVICE, dtype=torch.float32), inv_freq)
    scale = (torch.arange(0, dim, 2, device=DEVICE, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
    power = (torch.arange(seqlen, device=DEVICE, dtype=torch.float32) - seqlen // 2) / scale_base
    scale = scale ** power[:, None]
    return (freqs.cos() * scale, freqs.sin() * scale), (freqs.cos() / scale, freqs.sin() / scale)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_xpos_as_flash_attn(interleaved):
    dim, seqlen, scale_base = 8, 12, 4.0
    rotary = RotaryEmbedding(dim, interleaved=interleaved, scale_base=scale_base)
    qkv = randn(2, seqlen, 3, 2, 16, dtype=torch.float32)
    (cos_q, sin_q), (cos_k, sin_k) = _flash_attn_xpos_tables(dim, seqlen, scale_base)
    positions = torch.arange(seqlen, device=DEVICE).expand(2, seqlen)
    want_q = apply_rotary(qkv[:, :, 0], cos_q, sin_q, positions, interleaved)
    want_k = apply_rotary(qkv[:, :, 1], cos_k, sin_k, positions, interleaved)
    got = rotary(qkv)
    torch.testing.assert_close(got[:, :, 0], want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, :, 1], want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, :, 2], qkv[:, :, 2])
    plain = RotaryEmbedding(dim, interleaved=interleaved)(qkv)
    assert not torch.allclose(got[:, :, 0], plain[:, :, 0])  # xPos changes q and k ...
    q, kv = rotary(qkv[:, :, 0], qkv[:, :, 1:])  # ... also in the (q, kv) form
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[:, :, 0], want_k, rtol=1e-5, atol=1e-5)


def test_mha_rotary_emb_scale_base():
    torch.manual_seed(0)
    scale_base, seqlen = 4.0, 10
    mha = MHA(EMBED, NHEADS, causal=True, rotary_emb_dim=8, rotary_emb_scale_base=scale_base, layer_idx=0,
              device=DEVICE, dtype=torch.float32)
    x = randn(2, seqlen, EMBED, dtype=torch.float32)
    q, k, v = mha.Wqkv(x).detach().unflatten(-1, (3, NHEADS, EMBED // NHEADS)).unbind(2)
    (cos_q, sin_q), (cos_k, sin_k) = _flash_attn_xpos_tables(8, seqlen, scale_base)
    positions = torch.arange(seqlen, device=DEVICE).expand(2, seqlen)
    q, k = apply_rotary(q, cos_q, sin_q, positions, False), apply_rotary(k, cos_k, sin_k, positions, False)
    context, _ = attention_naive(q, k, v, causal=True, dtype=torch.float32)
    torch.testing.assert_close(mha(x), mha.out_proj(context.flatten(-2)), rtol=1e-4, atol=1e-5)
    params = InferenceParams(max_seqlen=16, max_batch_size=2, seqlen_offset=seqlen)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="xPos"):
        mha(x[:, :1], inference_params=params)


def test_apply_rotary_emb_flash_attn_signature():
    cos, sin = (t.float() for t in _flash_attn_xpos_tables(8, 16, 1e9)[0])  # scale_base 1e9: plain RoPE tables
    x = randn(2, 6, 2, 12, dtype=torch.float32)
    # int offset
    positions = (torch.arange(6, device=DEVICE) + 3).expand(2, 6)
    torch.testing.assert_close(apply_rotary_emb_func(x, cos, sin, seqlen_offsets=3), apply_rotary(x, cos, sin,
                                                                                                  positions, False))
    # tensor offsets; positions past the tables stay unrotated (as flash_attn's kernel)
    offsets = torch.tensor([0, 12], device=DEVICE)
    got = apply_rotary_emb_func(x, cos, sin, interleaved=True, seqlen_offsets=offsets)
    torch.testing.assert_close(got[0], apply_rotary(x[:1], cos, sin, positions[:1] - 3, True)[0])
    torch.testing.assert_close(got[1, :4], apply_rotary(x[1:, :4], cos, sin, positions[:1, :4] + 9, True)[0])
    assert torch.equal(got[1, 4:], x[1, 4:])
    # packed, with per-sequence offsets, in place
    packed = x.flatten(0, 1).clone()
    cu = torch.tensor([0, 4, 12], dtype=torch.int32, device=DEVICE)
    result = apply_rotary_emb_func(packed, cos, sin, inplace=True, seqlen_offsets=torch.tensor([1, 2]),
                                   cu_seqlens=cu, max_seqlen=8)
    assert result is packed
    want = torch.cat([apply_rotary(x.flatten(0, 1)[None, :4], cos, sin, torch.arange(1, 5)[None], False)[0],
                      apply_rotary(x.flatten(0, 1)[None, 4:], cos, sin, torch.arange(2, 10)[None], False)[0]])
    torch.testing.assert_close(packed, want)
    with pytest.raises(ValueError, match="exceeds the 16 positions"):
        apply_rotary_emb_func(x, cos, sin, seqlen_offsets=11)


# ---------------------------------------------------------------------------------------------
# torch.compile (aot_eager: dynamo, fake tensors and AOT autograd around the same kernels)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_paged_forward_with_grad(fresh_dynamo):
    """AOT autograd traces the backward while compiling: the paged refusal must wait for a real backward."""
    q, _, _, cu, _ = _packed([5, 9], [5, 9], 2, 1, 16, torch.float32)
    pages = randn(2, 16, 1, 16, dtype=torch.float32, requires_grad=True)
    table = torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE)
    attend = torch.compile(lambda q, kv: flash_attn_varlen_func(q, kv, kv, cu, cu, 9, 9, causal=True,
                                                                block_table=table), fullgraph=True, backend="aot_eager")
    out = attend(q, pages)
    with torch.no_grad():
        assert torch.equal(out.detach(), flash_attn_varlen_func(q, pages, pages, cu, cu, 9, 9, causal=True,
                                                                block_table=table))
    with pytest.raises(RuntimeError, match="no backward through a paged cache"):
        out.sum().backward()


def test_compiled_private_forward_backward(fresh_dynamo):
    from flashtile.compat.flash_attn_private import _backward_op

    q, k, v = make_qkv(1, 8, 8, 2, 1, 16, torch.float32, requires_grad=False)
    dout = torch.randn_like(q)

    def step(q, k, v, dout):
        out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, True, -1, -1, 0.0, None,
                                         False, rng_state)
        return out, dq, dk, dv, softmax_d

    for eager, compiled in zip(step(q, k, v, dout), torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v,
                                                                                                              dout)):
        assert torch.equal(eager, compiled)
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    torch.library.opcheck(_backward_op, (dout, q, k, v, out, lse, *(torch.empty_like(t) for t in (q, k, v)), None,
                                         None, None, None, [0.25, 0.0, 0.0], [-1, 0, 0]))
