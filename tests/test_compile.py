"""The public functions are PyTorch custom operators: torch.library.opcheck on each op, the eager
path (the ops' bodies without the custom-op layers) equal to the ops, and torch.compile(fullgraph=True)
of small modules (no graph breaks, no recompiles on a second call with the same shapes) matching
eager results, forward and backward.

On CPU the compiled modules run with backend="aot_eager" (dynamo, fake tensors and AOT autograd,
without inductor's C++ compile); on CUDA with the default inductor backend, or aot_eager when the
Triton in use is not the one torch was built with (the test session's header says so)."""

import contextlib

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import triton
import triton.language as tl

import flashtile.ops  # noqa: F401  (registers torch.ops.flashtile)
from flashtile import (create_block_mask, flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_with_kvcache, mod_ops, mods)
from flashtile.mods import resolve_mods

from _cases import DEVICE, DTYPES, INDUCTOR_MISMATCH, ON_GPU, make_qkv, randn

BACKEND = "inductor" if ON_GPU and INDUCTOR_MISMATCH is None else "aot_eager"
SEQLEN, HEAD_DIM = (256, 64) if ON_GPU else (16, 32)
OPS = torch.ops.flashtile

# What the ops take after the public functions folded the options (flashtile/ops.py):
# alibi_slopes, dropout_seed, learnable_sink, floats = [softmax_scale, softcap, dropout_p], and
# ints = [window_left, window_right, deterministic], with [max_seqlen_q, max_seqlen_k] in front for
# varlen. attn_probs takes no sink: PROBS_PLAIN.
PLAIN = (None, None, None, [HEAD_DIM ** -0.5, 0.0, 0.0])
PROBS_PLAIN = (None, None, [HEAD_DIM ** -0.5, 0.0, 0.0])
CAUSAL = [-1, 0, 1]


def _seed():
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=DEVICE)


def _dropout(p=0.2):
    return (None, _seed(), None, [HEAD_DIM ** -0.5, 0.0, p])


def _tol(dtype):
    # Compiled and eager run the same kernels; what differs is the order of float32 dQ atomics
    # (Hopper backward) and inductor's fusions around the op.
    return {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.float16: dict(atol=2e-2, rtol=2e-2),
            torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}[dtype]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# opcheck: schema (declared mutations), fake tensors, autograd registration, AOT dispatch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["separate", "kvpacked", "qkvpacked"])
def test_opcheck_dense(layout):
    q, k, v = make_qkv(2, SEQLEN, SEQLEN, 2, 2 if layout == "qkvpacked" else 1, HEAD_DIM, torch.float32)
    if layout == "kvpacked":
        args = (q, torch.stack([k, v], dim=2).detach().requires_grad_(), None)
    elif layout == "qkvpacked":
        args = (torch.stack([q, k, v], dim=2).detach().requires_grad_(), None, None)
    else:
        args = (q, k, v)
    torch.library.opcheck(OPS.fwd.default, (*args, *PLAIN, CAUSAL))
    with torch.no_grad():  # the backward ops have no backward (no double backward)
        out, lse = OPS.fwd(*args, *PLAIN, CAUSAL)
    dout = torch.randn_like(out)
    torch.library.opcheck(OPS.bwd.default, (dout, *(None if t is None else t.detach() for t in args), out, lse,
                                            *PLAIN, CAUSAL))


def test_opcheck_dense_dropout_and_probs():
    q, k, v = make_qkv(1, SEQLEN, SEQLEN + 3, 2, 1, HEAD_DIM, torch.float16)
    options = _dropout()
    torch.library.opcheck(OPS.fwd.default, (q, k, v, *options, [-1, -1, 0]))
    with torch.no_grad():
        out, lse = OPS.fwd(q, k, v, *options, [-1, -1, 0])
    torch.library.opcheck(OPS.attn_probs.default, (q.detach(), k.detach(), v.detach(), lse, None, None, None, None,
                                                   None, *options[:2], options[3], [-1, -1, 0]))


def _varlen_inputs(lengths_q, lengths_k, dtype, requires_grad=True):
    q = randn(sum(lengths_q), 2, HEAD_DIM, dtype=dtype, requires_grad=requires_grad)
    k = randn(sum(lengths_k), 1, HEAD_DIM, dtype=dtype, requires_grad=requires_grad)
    v = randn(sum(lengths_k), 1, HEAD_DIM, dtype=dtype, requires_grad=requires_grad)
    cu_q, cu_k = (torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)
                  for lengths in (lengths_q, lengths_k))
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def test_opcheck_varlen():
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs((5, 0, SEQLEN), (7, 3, SEQLEN - 2), torch.float32)
    used_k = (cu_k[1:] - cu_k[:-1]).clamp(max=4)
    ints = [max_q, max_k, *CAUSAL]
    for seqused_k in (None, used_k):
        args = (q, k, v, cu_q, cu_k, None, seqused_k, None)
        torch.library.opcheck(OPS.varlen_fwd.default, (*args, *PLAIN, ints))
        with torch.no_grad():
            out, lse = OPS.varlen_fwd(*args, *PLAIN, ints)
        torch.library.opcheck(OPS.varlen_bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                                                       out, lse, cu_q, cu_k, None, seqused_k, *PLAIN, ints))
    torch.library.opcheck(OPS.attn_probs.default, (q.detach(), k.detach(), v.detach(), lse, cu_q, cu_k, None, None,
                                                   None, *PROBS_PLAIN, ints))


def test_opcheck_learnable_sink():
    """A learnable sink is an input of the ops: the backward ops return its gradient after q, k, v's."""
    q, k, v = make_qkv(2, SEQLEN, SEQLEN - 3, 2, 1, HEAD_DIM, torch.float32)
    sink = torch.randn(2, device=DEVICE, requires_grad=True)
    options = (None, None, sink, PLAIN[3])
    torch.library.opcheck(OPS.fwd.default, (q, k, v, *options, CAUSAL))
    with torch.no_grad():
        out, lse = OPS.fwd(q, k, v, *options, CAUSAL)
    # The backward ops have no backward: their inputs are detached.
    detached = (None, None, sink.detach(), PLAIN[3])
    grads = OPS.bwd(torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *detached, CAUSAL)
    assert len(grads) == 4 and grads[3].shape == sink.shape
    torch.library.opcheck(OPS.bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                            *detached, CAUSAL))
    qv, kv, vv, cu_q, cu_k, max_q, max_k = _varlen_inputs((5, 0, SEQLEN), (7, 3, SEQLEN - 2), torch.float32)
    args = (qv, kv, vv, cu_q, cu_k, None, None, None)
    ints = [max_q, max_k, *CAUSAL]
    torch.library.opcheck(OPS.varlen_fwd.default, (*args, *options, ints))
    with torch.no_grad():
        out, lse = OPS.varlen_fwd(*args, *options, ints)
    torch.library.opcheck(OPS.varlen_bwd.default, (torch.randn_like(out), qv.detach(), kv.detach(), vv.detach(),
                                                   out, lse, cu_q, cu_k, None, None, *detached, ints))


def test_opcheck_head_dim_v():
    """v with a head dim of its own: the fake implementations give the output v's head dim."""
    q, k, _ = make_qkv(2, SEQLEN, SEQLEN - 3, 2, 1, HEAD_DIM, torch.float32)
    v = randn(2, SEQLEN - 3, 1, HEAD_DIM + 8, dtype=torch.float32, requires_grad=True)
    torch.library.opcheck(OPS.fwd.default, (q, k, v, *PLAIN, CAUSAL))
    with torch.no_grad():
        out, lse = OPS.fwd(q, k, v, *PLAIN, CAUSAL)
    assert out.shape[-1] == HEAD_DIM + 8
    torch.library.opcheck(OPS.bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                            *PLAIN, CAUSAL))
    cu = torch.tensor([0, 5, SEQLEN], dtype=torch.int32, device=DEVICE)
    args = (q[0], k[0, :SEQLEN - 3], v[0, :SEQLEN - 3], cu, torch.tensor([0, 4, SEQLEN - 3], dtype=torch.int32,
                                                                           device=DEVICE), None, None, None)
    torch.library.opcheck(OPS.varlen_fwd.default, (*args, *PLAIN, [SEQLEN - 5, SEQLEN - 7, *CAUSAL]))


# ---------------------------------------------------------------------------------------------
# Eager calls: the ops' bodies in a plain autograd.Function (less host time), same results
# ---------------------------------------------------------------------------------------------

def test_eager_path_is_the_op():
    """Eager public calls skip the custom-op layers (ops.dense_attention / varlen_attention run the
    same bodies through an autograd.Function): outputs and gradients equal the ops' bit for bit."""
    q, k, v = make_qkv(2, SEQLEN, SEQLEN, 2, 1, HEAD_DIM, torch.float32)
    # deterministic=True as in CAUSAL: bit equality needs dQ summed in a fixed order.
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    assert type(out.grad_fn).__name__ == "_EagerDenseBackward"
    out_op, _ = OPS.fwd(q, k, v, *PLAIN, CAUSAL)
    dout = torch.randn_like(out)
    assert torch.equal(out, out_op)
    for g, g_op in zip(_grads(out, (q, k, v), dout), _grads(out_op, (q, k, v), dout)):
        assert torch.equal(g, g_op)

    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs((5, 0, SEQLEN), (7, 3, SEQLEN - 2), torch.float32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, deterministic=True)
    assert type(out.grad_fn).__name__ == "_EagerVarlenBackward"
    out_op, _ = OPS.varlen_fwd(q, k, v, cu_q, cu_k, None, None, None, *PLAIN, [max_q, max_k, *CAUSAL])
    dout = torch.randn_like(out)
    assert torch.equal(out, out_op)
    for g, g_op in zip(_grads(out, (q, k, v), dout), _grads(out_op, (q, k, v), dout)):
        assert torch.equal(g, g_op)


def _cache(batch=2, capacity=None, dtype=torch.float16):
    capacity = capacity or SEQLEN
    k_cache = torch.randn(batch, capacity, 1, HEAD_DIM, device=DEVICE, dtype=dtype)
    return k_cache, torch.randn_like(k_cache)


def test_opcheck_kvcache():
    """The op declares that it writes k_cache and v_cache (test_schema fails on undeclared writes)."""
    k_cache, v_cache = _cache()
    q = randn(2, 1, 2, HEAD_DIM, dtype=torch.float16)
    k, v = (randn(2, 2, 1, HEAD_DIM, dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    cos, sin = (torch.rand(SEQLEN, HEAD_DIM // 4, device=DEVICE) for _ in range(2))
    for new in ((k, v), (None, None)):
        # extras = [rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
        # learnable_sink];
        # floats = [softmax_scale, softcap]; ints = [causal, window_left, window_right, rotary_interleaved,
        # num_splits].
        extras = [cos, sin, None, None, None, None, None]
        torch.library.opcheck(OPS.kvcache_fwd.default, (q, k_cache, v_cache, *new, seqlens, extras,
                                                        [HEAD_DIM ** -0.5, 0.0], [1, -1, -1, 1, 1]))


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): no graph breaks, no recompiles, same results as eager
# ---------------------------------------------------------------------------------------------

def _compiled(module):
    return torch.compile(module, fullgraph=True, backend=BACKEND)


def _run_twice(compiled, *args):
    """The compiled call, then a second one with the same shapes that must not recompile."""
    result = compiled(*args)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(*args)
    return result


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


class Attention(torch.nn.Module):
    """q, k, v projections around flash_attn_func: the attention sits between ops inductor fuses."""

    def __init__(self, dim, nheads, dtype, **options):
        super().__init__()
        self.nheads, self.options = nheads, options
        self.qkv = torch.nn.Linear(dim, 3 * dim, device=DEVICE, dtype=dtype)

    def forward(self, x):
        batch, seqlen, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seqlen, 3, self.nheads, dim // self.nheads).unbind(dim=2)
        return flash_attn_func(q, k, v, **self.options).reshape(batch, seqlen, dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(4, 2), softcap=5.0)])
def test_compile_flash_attn_func(dtype, options):
    module = Attention(2 * HEAD_DIM, 2, dtype, **options)
    x = randn(2, SEQLEN, 2 * HEAD_DIM, dtype=dtype, requires_grad=True)
    dout = torch.randn_like(x)
    out = _run_twice(_compiled(module), x)
    grads = _grads(out, (x, module.qkv.weight), dout)
    ref = module(x)
    ref_grads = _grads(ref, (x, module.qkv.weight), dout)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **_tol(dtype))


def test_compile_packed_dropout_and_probs():
    """qkvpacked with dropout: the seed is drawn in the graph and the backward reuses it; the
    returned probabilities (a separate op) compile too."""
    def attend(qkv):
        out, lse, probs = flash_attn_qkvpacked_func(qkv, dropout_p=0.25, causal=True, return_attn_probs=True)
        return out * 2, lse, probs

    dtype = DTYPES[0]
    qkv = randn(1, SEQLEN, 3, 2, HEAD_DIM, dtype=dtype, requires_grad=True)
    dout = torch.randn(1, SEQLEN, 2, HEAD_DIM, device=DEVICE, dtype=dtype)
    # Inductor draws random numbers its own way unless fallback_random; then the seeds match eager's.
    with torch._inductor.config.patch(fallback_random=True) if ON_GPU else contextlib.nullcontext():
        torch.manual_seed(7)
        out, lse, probs = _compiled(attend)(qkv)
        (dqkv,) = _grads(out, qkv, dout)
    torch.manual_seed(7)
    ref, ref_lse, ref_probs = attend(qkv)
    (ref_dqkv,) = _grads(ref, qkv, dout)
    assert not lse.requires_grad and not probs.requires_grad
    assert torch.equal(probs < 0, ref_probs < 0)  # the same dropout mask
    torch.testing.assert_close(out, ref, **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, **_tol(torch.float32))
    torch.testing.assert_close(dqkv, ref_dqkv, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_compile_flash_attn_varlen_func(dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs((3, SEQLEN, 1), (SEQLEN - 1, 5, 9), dtype)

    def attend(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q * 1.5, k, v, cu_q, cu_k, max_q, max_k, causal=True)

    dout = torch.randn_like(q)
    out = _run_twice(_compiled(attend), q, k, v, cu_q, cu_k)
    grads = _grads(out, (q, k, v), dout)
    ref = attend(q, k, v, cu_q, cu_k)
    ref_grads = _grads(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **_tol(dtype))


def test_compile_head_dim_v():
    dtype = DTYPES[0]
    q, k, _ = make_qkv(2, SEQLEN, SEQLEN, 2, 1, HEAD_DIM, dtype)
    v = randn(2, SEQLEN, 1, HEAD_DIM // 2, dtype=dtype, requires_grad=True)

    def attend(q, k, v):
        return flash_attn_func(q, k * 0.5, v, causal=True) * 2

    out = _run_twice(_compiled(attend), q, k, v)
    dout = torch.randn_like(out)
    grads = _grads(out, (q, k, v), dout)
    ref = attend(q, k, v)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    for g, r in zip(grads, _grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, r, **_tol(dtype))


def test_compile_learnable_sink():
    """A learnable sink (sinks.py) compiles with its autograd Function; the sink gets its gradient."""
    dtype = DTYPES[0]
    q, k, v = (randn(2, SEQLEN, 2, HEAD_DIM, dtype=dtype, requires_grad=True) for _ in range(3))
    sink = torch.randn(2, device=DEVICE, requires_grad=True)

    def attend(q, k, v, sink):
        return flash_attn_func(q, k, v, causal=True, learnable_sink=sink) * 2

    dout = torch.randn_like(q)
    out = _run_twice(_compiled(attend), q, k, v, sink)
    grads = _grads(out, (q, k, v, sink), dout)
    ref = attend(q, k, v, sink)
    ref_grads = _grads(ref, (q, k, v, sink), dout)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **_tol(g.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True])
def test_compile_flash_attn_with_kvcache(dtype, paged):
    """One decoding step appending new k, v: the compiled call writes the caches in place like eager."""
    batch, seqlen_new, page = 2, 2, SEQLEN // 4
    k_cache, v_cache = _cache(batch, dtype=dtype)
    block_table = None
    if paged:  # the same positions as (batch * 4) pages in reverse order
        k_cache, v_cache = (t.view(batch * 4, page, 1, HEAD_DIM).flip(0).contiguous() for t in (k_cache, v_cache))
        block_table = torch.arange(batch * 4 - 1, -1, -1, dtype=torch.int32, device=DEVICE).view(batch, 4)
    q = randn(batch, seqlen_new, 2, HEAD_DIM, dtype=dtype)
    k, v = (randn(batch, seqlen_new, 1, HEAD_DIM, dtype=dtype) for _ in range(2))
    seqlens = torch.tensor([3, SEQLEN - seqlen_new], dtype=torch.int32, device=DEVICE)
    cos, sin = (torch.rand(SEQLEN, HEAD_DIM // 4, device=DEVICE) for _ in range(2))

    def step(q, k_cache, v_cache, k, v, seqlens):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=seqlens, block_table=block_table, causal=True,
                                           return_softmax_lse=True)
        return out + 1, lse

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    compiled = _compiled(step)
    with torch.no_grad():
        out, lse = compiled(q, k_cache, v_cache, k, v, seqlens)
        ref, ref_lse = step(q, k_ref, v_ref, k, v, seqlens)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # written in place, as eager
        torch.testing.assert_close(out, ref, **_tol(dtype))
        torch.testing.assert_close(lse, ref_lse, **_tol(torch.float32))
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled(q, k_cache, v_cache, k, v, seqlens.flip(0))  # new values, same shapes


# ---------------------------------------------------------------------------------------------
# Programmable attention under torch.compile (flashtile/mod_ops.py): the mods ops
# ---------------------------------------------------------------------------------------------

@triton.jit
def scaled_by_head(score, b, h, q_idx, kv_idx, aux):
    """score * w[h]: reads an aux tensor, so new values of it must reach a compiled call."""
    return score * tl.load(aux[0] + h)


@triton.jit
def scaled_by_head_bwd(grad, score, b, h, q_idx, kv_idx, aux):
    return grad * tl.load(aux[0] + h)


@triton.jit
def every_third_off(b, h, q_idx, kv_idx, aux):
    return ((q_idx + 2 * kv_idx + h) % 3) != 0


@triton.jit
def even_keys_off(b, h, q_idx, kv_idx, aux):
    return (kv_idx % 2) == 1


def _compare(compiled_fn, eager_fn, args, grad_of, dtype, calls=2):
    """``calls`` compiled calls with fresh values in the same shapes (the first compiles, the others
    must not), each equal to the eager call, forward and the gradients of ``grad_of(args)``."""
    compiled = _compiled(compiled_fn)
    for call in range(calls):
        if call:
            args = [torch.randn_like(a).requires_grad_(a.requires_grad) if a.is_floating_point() else a
                    for a in args]
        with torch._dynamo.config.patch(error_on_recompile=call > 0):
            out = compiled(*args)
        ref = eager_fn(*args)
        dout = torch.randn_like(ref)
        torch.testing.assert_close(out, ref, **_tol(dtype))
        inputs = grad_of(args)
        for g, r in zip(_grads(out, inputs, dout), _grads(ref, inputs, dout)):
            torch.testing.assert_close(g, r, **_tol(g.dtype))


def test_opcheck_mods():
    """The mods ops with a registered spec: a score mod reading an aux tensor and a mask mod."""
    q, k, v = make_qkv(2, SEQLEN, SEQLEN - 3, 2, 1, HEAD_DIM, torch.float32)
    weights = torch.rand(2, device=DEVICE) + 0.5
    mods = resolve_mods(scaled_by_head, scaled_by_head_bwd, every_third_off, [weights], None, 2, 2, SEQLEN,
                        SEQLEN - 3, q.device)
    key, tensors, ints = mod_ops.split(mods)
    args = (q, k, v, [], *PLAIN, CAUSAL, tensors, ints, key)
    torch.library.opcheck(OPS.mods_fwd.default, args)
    with torch.no_grad():
        out, lse = OPS.mods_fwd(*args)
    torch.library.opcheck(OPS.mods_bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                                 [], *PLAIN, CAUSAL, tensors, ints, key, False))
    torch.library.opcheck(OPS.mods_attn_probs.default, (q.detach(), k.detach(), v.detach(), lse, [], *PLAIN[:2],
                                                        PLAIN[3], CAUSAL, tensors, ints, key))
    # The kv-cache op declares its writes of k_cache and v_cache.
    k_cache, v_cache = _cache()
    q1, k1, v1 = (randn(2, 1, n, HEAD_DIM, dtype=torch.float16) for n in (2, 1, 1))
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    key, tensors, ints = mod_ops.split(resolve_mods(scaled_by_head, None, every_third_off, [weights], None, 2, 2, 1,
                                                    SEQLEN, q1.device))
    torch.library.opcheck(OPS.mods_kvcache_fwd.default, (q1, k_cache, v_cache, k1, v1, seqlens, [None] * 7,
                                                         [HEAD_DIM ** -0.5, 0.0], [1, -1, -1, 1, 1], tensors, ints, key))


# The public functions' calls with mods compile as one op from torch 2.13 on (mod_ops.TRACEABLE).
needs_traceable_mods = pytest.mark.skipif(not mod_ops.TRACEABLE, reason=f"torch {torch.__version__}'s dynamo cannot "
                                          "look at @triton.jit functions passed as values (mod_ops.py)")


def test_compile_mods_ops():
    """The mods ops compiled directly, the key made eagerly (any torch): a mask mod and an attn_bias with
    its gradient, equal to the public eager call."""
    dtype = DTYPES[0]
    q, k, v = make_qkv(2, SEQLEN, SEQLEN - 2, 2, 2, HEAD_DIM, dtype)
    bias = randn(2, 1, SEQLEN - 2, dtype=torch.float32, requires_grad=True)
    key, tensors, ints = mod_ops.split(resolve_mods(None, None, every_third_off, None, None, 2, 2, SEQLEN, SEQLEN - 2,
                                                    q.device, attn_bias=bias))

    def attend(q, k, v, tensors):
        return OPS.mods_fwd(q, k, v, [], *PLAIN, CAUSAL, tensors, ints, key)[0] * 2

    out = _compiled(attend)(q, k, v, tensors)
    ref = flash_attn_func(q, k, v, causal=True, deterministic=True, mask_mod=every_third_off, attn_bias=bias) * 2
    dout = torch.randn_like(out)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    for g, r in zip(_grads(out, (q, k, v, bias), dout), _grads(ref, (q, k, v, bias), dout)):
        torch.testing.assert_close(g, r, **_tol(g.dtype))


def test_compile_mods_eager_before_torch_2_13(monkeypatch):
    """Where dynamo cannot trace the mods (torch < 2.13), a call with mods runs eagerly: fullgraph=True
    raises with the reason, a plain torch.compile equals eager. (Forced here on any torch.)"""
    from flashtile import interface
    monkeypatch.setattr(mod_ops, "TRACEABLE", False)
    gated = mod_ops.compiles_as_op(getattr(interface.flash_attn_func, "__wrapped__", interface.flash_attn_func))
    dtype = DTYPES[0]
    q, k, v = make_qkv(1, SEQLEN, SEQLEN, 2, 2, HEAD_DIM, dtype, requires_grad=False)

    def attend(q, k, v):
        return gated(q, k, v, mask_mod=every_third_off) + 1

    with pytest.raises(Exception, match="torch 2.13"):
        _compiled(attend)(q, k, v)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(attend, backend=BACKEND)(q, k, v), attend(q, k, v), **_tol(dtype))


@needs_traceable_mods
@pytest.mark.parametrize("dtype", DTYPES)
def test_compile_score_and_mask_mods(dtype):
    """A score mod reading an aux tensor, its backward and a mask mod, with causal and GQA: new aux values
    reach the compiled call without a recompile."""
    def attend(q, k, v, weights):
        return flash_attn_func(q, k, v, causal=True, score_mod=scaled_by_head, score_mod_bwd=scaled_by_head_bwd,
                               mask_mod=every_third_off, aux_tensors=[weights]) * 2

    q, k, v = make_qkv(2, SEQLEN, SEQLEN + 5, 2, 1, HEAD_DIM, dtype)
    weights = torch.rand(2, device=DEVICE) + 0.5
    _compare(attend, attend, [q, k, v, weights], lambda a: a[:3], dtype)


@needs_traceable_mods
def test_compile_another_mod_recompiles():
    """The mods' functions are part of the compiled call's guards: another mask_mod compiles again
    (never the first one's key with the second one's call)."""
    dtype = DTYPES[0]
    q, k, v = make_qkv(1, SEQLEN, SEQLEN, 2, 2, HEAD_DIM, dtype, requires_grad=False)

    def attend(q, k, v, mask_mod):
        return flash_attn_func(q, k, v, mask_mod=mask_mod)

    compiled = _compiled(attend)
    for mask_mod in (every_third_off, even_keys_off, every_third_off):
        torch.testing.assert_close(compiled(q, k, v, mask_mod), attend(q, k, v, mask_mod), **_tol(dtype))
    assert not torch.allclose(attend(q, k, v, every_third_off), attend(q, k, v, even_keys_off))


@needs_traceable_mods
@pytest.mark.parametrize("shape", ["full", "broadcast"])
def test_compile_attn_bias(shape):
    """attn_bias and its gradient (in the bias's shape, summed over broadcast dimensions) compiled."""
    dtype = DTYPES[0]
    q, k, v = make_qkv(2, SEQLEN, SEQLEN - 2, 2, 2, HEAD_DIM, dtype)
    bias_shape = (2, 2, SEQLEN, SEQLEN - 2) if shape == "full" else (2, 1, SEQLEN - 2)
    bias = randn(*bias_shape, dtype=torch.float32, requires_grad=True)

    def attend(q, k, v, bias):
        return flash_attn_func(q, k, v, attn_bias=bias, causal=shape == "full")

    _compare(attend, attend, [q, k, v, bias], lambda a: a, dtype)


@needs_traceable_mods
def test_compile_block_mask_and_probs():
    """A block mask built outside the compiled function, and return_attn_probs with a mask mod."""
    dtype = DTYPES[0]
    q, k, v = make_qkv(2, SEQLEN, SEQLEN, 2, 2, HEAD_DIM, dtype)
    block_mask = create_block_mask(every_third_off, None, 2, SEQLEN, SEQLEN, device=DEVICE, block_size=16)

    def attend(q, k, v):
        return flash_attn_func(q, k, v, block_mask=block_mask) + 1

    _compare(attend, attend, [q, k, v], lambda a: a, dtype)

    def probs(q, k, v):
        return flash_attn_func(q, k, v, mask_mod=even_keys_off, return_attn_probs=True)

    with torch.no_grad():
        for got, want in zip(_compiled(probs)(q, k, v), probs(q, k, v)):
            torch.testing.assert_close(got, want, **_tol(got.dtype))


@needs_traceable_mods
def test_compile_varlen_mods():
    """Packed sequences with a score mod and a mask mod, and with an attn_bias (per sequence)."""
    dtype = DTYPES[0]
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs((5, 1, SEQLEN), (7, 3, SEQLEN - 2), dtype)
    weights = torch.rand(2, device=DEVICE) + 0.5
    bias = randn(3, 2, max_q, max_k, dtype=torch.float32, requires_grad=True)

    def attend(q, k, v, weights, bias):
        modded = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, score_mod=scaled_by_head,
                                        score_mod_bwd=scaled_by_head_bwd, mask_mod=every_third_off,
                                        aux_tensors=[weights])
        return modded + flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, attn_bias=bias)

    _compare(attend, attend, [q, k, v, weights, bias], lambda a: [a[0], a[1], a[2], a[4]], dtype)


@needs_traceable_mods
def test_compile_relative_bias_table():
    """flashtile.mods.relative_bias built inside the compiled function from a tensor: new table values
    reach the compiled call (the table is an input of the op, not a constant of the graph)."""
    dtype = DTYPES[0]
    q, k, v = make_qkv(1, SEQLEN, SEQLEN, 2, 2, HEAD_DIM, dtype)
    table = torch.randn(2, 9, device=DEVICE)

    def attend(q, k, v, table):
        return flash_attn_func(q, k, v, causal=True, score_mod=mods.relative_bias(table))

    _compare(attend, attend, [q, k, v, table], lambda a: a[:3], dtype)


@needs_traceable_mods
def test_compile_document_mask():
    """A document mask compiles as a mask mod (the packed-sequence shortcut needs the ids on the host);
    create_block_mask inside a compiled function raises and says to build the mask outside."""
    dtype = DTYPES[0]
    q, k, v = make_qkv(2, SEQLEN, SEQLEN, 2, 2, HEAD_DIM, dtype)
    ids = torch.tensor([0] * 5 + [1] * (SEQLEN - 9) + [2] * 4, device=DEVICE)
    documents = mods.document_mask(ids)

    def attend(q, k, v):
        return flash_attn_func(q, k, v, mask_mod=documents)

    _compare(attend, attend, [q, k, v], lambda a: a, dtype)

    def builds_mask(q, k, v):
        return flash_attn_func(q, k, v, block_mask=create_block_mask(documents, None, None, SEQLEN, SEQLEN))

    with pytest.raises(Exception, match="outside"):
        _compiled(builds_mask)(q, k, v)


@needs_traceable_mods
def test_compile_kvcache_mods():
    """A decoding step with a score mod and a mask mod: the compiled call writes the caches in place and
    attends as eager does (torch.ops.flashtile.mods_kvcache_fwd)."""
    dtype = DTYPES[0]
    batch = 2
    k_cache, v_cache = _cache(batch, dtype=dtype)
    q = randn(batch, 2, 2, HEAD_DIM, dtype=dtype)
    k, v = (randn(batch, 2, 1, HEAD_DIM, dtype=dtype) for _ in range(2))
    seqlens = torch.tensor([3, SEQLEN - 2], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(2, device=DEVICE) + 0.5

    def step(q, k_cache, v_cache, k, v, seqlens, weights):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True,
                                       score_mod=scaled_by_head, mask_mod=every_third_off, aux_tensors=[weights])

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    compiled = _compiled(step)
    with torch.no_grad():
        out = compiled(q, k_cache, v_cache, k, v, seqlens, weights)
        ref = step(q, k_ref, v_ref, k, v, seqlens, weights)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        torch.testing.assert_close(out, ref, **_tol(dtype))
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = compiled(q, k_cache, v_cache, k, v, seqlens.flip(0), weights * 2)
        ref = step(q, k_ref, v_ref, k, v, seqlens.flip(0), weights * 2)
        torch.testing.assert_close(out, ref, **_tol(dtype))
