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

import flashtile.ops  # noqa: F401  (registers torch.ops.flashtile)
from flashtile import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_with_kvcache

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
