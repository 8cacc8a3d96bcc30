"""Call plans (flashtile/call_plans.py): a call whose signature was seen replays the first call's
plan without the checks. Each case runs the long way (FLASHTILE_LAUNCH_PLANS=0), then the first
planned call and a replay, and the three must agree: outputs exactly (the same kernels run),
gradients to the last bits (the Hopper backward adds dQ up in no fixed order). On the CPU the
interpreter runs the same replays (plans are kept there for these tests only)."""

import pytest
import torch

import flashtile
from flashtile import call_plans, checks

from _cases import DEVICE, DTYPES, make_qkv, randn

CACHES = (call_plans.DENSE_CALLS, call_plans.VARLEN_CALLS, call_plans.KVCACHE_STEPS)


@pytest.fixture
def planned(monkeypatch):
    """Plans kept (outputs not poisoned), caches empty; yields a counter of the long way's checks."""
    monkeypatch.delenv("FLASHTILE_POISON_OUTPUTS", raising=False)
    if DEVICE == "cpu":
        monkeypatch.setattr(call_plans, "PLANNED_DEVICES", ("cuda", "cpu"))
    for cache in CACHES:
        cache.clear()
    long_ways = []
    for name in ("check_qkv_shapes", "check_tensor"):
        real = getattr(checks, name)

        def counted(*args, real=real, **kwargs):
            long_ways.append(1)
            return real(*args, **kwargs)
        monkeypatch.setattr(checks, name, counted)
    yield long_ways
    for cache in CACHES:
        cache.clear()


def _three_ways(monkeypatch, long_ways, run, seed=0):
    """run() the long way with plans off, then twice with plans on (the second a replay, which must
    not check); the three results, each a tuple of tensors."""
    monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
    torch.manual_seed(seed)
    reference = run()
    monkeypatch.delenv("FLASHTILE_LAUNCH_PLANS")
    torch.manual_seed(seed)
    first = run()
    checked = len(long_ways)
    torch.manual_seed(seed)
    replay = run()
    assert len(long_ways) == checked, "the second call of a signature went the long way"
    return reference, first, replay


def _agree(reference, *others, grads_from=None):
    for result in others:
        for i, (want, got) in enumerate(zip(reference, result)):
            if grads_from is not None and i >= grads_from:
                scale = want.float().abs().max().item() + 1e-6
                torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=4e-3 * scale)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def _dense_run(q, k, v, dout, **options):
    inputs = (q, k, v) + (() if options.get("learnable_sink") is None else (options["learnable_sink"],))

    def run():
        out = flashtile.flash_attn_func(q, k, v, **options)
        if dout is None:
            return (out,)
        return (out, *torch.autograd.grad(out, inputs, dout))
    return run


@pytest.mark.parametrize("case", ["causal", "gqa_window", "softcap", "alibi", "alibi_batch", "dropout", "decode",
                                  "sink", "decode_sink", "no_grad"])
def test_dense(planned, monkeypatch, case):
    dtype = DTYPES[0]
    shapes = {"gqa_window": (2, 70, 90, 4, 2), "decode": (3, 1, 150, 8, 2),
              "decode_sink": (3, 1, 150, 8, 2)}.get(case, (2, 65, 80, 2, 2))
    q, k, v = make_qkv(*shapes, 64, dtype, requires_grad=case != "no_grad")
    dout = None if case == "no_grad" else randn(*q.shape, dtype=dtype)
    options = {"causal": case != "gqa_window"}
    if case == "gqa_window":
        options["window_size"] = (16, 8)
    elif case == "softcap":
        options["softcap"] = 12.0
    elif case.startswith("alibi"):
        options["alibi_slopes"] = torch.rand(*q.shape[:1] * (case == "alibi_batch"), q.shape[2], device=DEVICE)
    elif case == "dropout":
        options["dropout_p"] = 0.2
    elif case.endswith("sink"):  # its gradient too, from the replayed backward
        options["learnable_sink"] = torch.randn(q.shape[2], device=DEVICE, requires_grad=True)
    results = _three_ways(monkeypatch, planned, _dense_run(q, k, v, dout, **options))
    _agree(*results, grads_from=1)
    assert len(call_plans.DENSE_CALLS.plans) == 1


def test_dense_replay_takes_the_call_tensors(planned):
    """Same signature, new tensors and new ALiBi slopes: the replay computes with them."""
    q, k, v = make_qkv(2, 40, 50, 2, 2, 32, DTYPES[0], requires_grad=False)
    slopes = torch.rand(2, device=DEVICE)
    flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    q2, k2, v2 = make_qkv(2, 40, 50, 2, 2, 32, DTYPES[0], requires_grad=False)
    slopes2 = torch.rand(2, device=DEVICE) + 1
    checked = len(planned)
    out = flashtile.flash_attn_func(q2, k2, v2, causal=True, alibi_slopes=slopes2)
    assert len(planned) == checked
    ref = flashtile.reference.attention_naive(q2, k2, v2, causal=True, alibi_slopes=slopes2)[0]
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_other_signatures_are_checked(planned):
    q, k, v = make_qkv(2, 40, 50, 2, 2, 32, DTYPES[0], requires_grad=False)
    flashtile.flash_attn_func(q, k, v)
    flashtile.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match="batch size"):
        flashtile.flash_attn_func(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="window_size"):
        flashtile.flash_attn_func(q, k, v, window_size=(-2, 0))


def test_settings_keep_no_plan(planned, monkeypatch):
    monkeypatch.setenv("FLASHTILE_POISON_OUTPUTS", "1")
    q, k, v = make_qkv(1, 20, 20, 2, 2, 32, DTYPES[0], requires_grad=False)
    flashtile.flash_attn_func(q, k, v)
    assert not call_plans.DENSE_CALLS.plans
    assert call_plans.dense_key(q, k, v, 0.0, None, False, [-1, -1], 0.0, None, False, False) is None


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("case", ["causal", "seqused", "one_query_each", "seqused_sink", "no_grad"])
def test_varlen(planned, monkeypatch, case):
    dtype = DTYPES[0]
    lengths_q, lengths_k = ([1, 1, 1] if case == "one_query_each" else [30, 1, 47]), [40, 9, 60]
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    grad = case != "no_grad"
    q = randn(sum(lengths_q), 4, 64, dtype=dtype, requires_grad=grad)
    k, v = (randn(sum(lengths_k), 2, 64, dtype=dtype, requires_grad=grad) for _ in range(2))
    dout = randn(*q.shape, dtype=dtype) if grad else None
    used, inputs = {}, (q, k, v)
    if case.startswith("seqused"):
        used = {"seqused_q": torch.tensor([20, 1, 40], dtype=torch.int32, device=DEVICE),
                "seqused_k": torch.tensor([33, 9, 50], dtype=torch.int32, device=DEVICE)}
    if case.endswith("sink"):
        used["learnable_sink"] = torch.randn(4, device=DEVICE, requires_grad=True)
        inputs += (used["learnable_sink"],)

    def run():
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                               **used)
        return (out,) if dout is None else (out, *torch.autograd.grad(out, inputs, dout))
    _agree(*_three_ways(monkeypatch, planned, run), grads_from=1)
    assert len(call_plans.VARLEN_CALLS.plans) == 1


@pytest.mark.parametrize("case", ["plain", "int_seqlens", "append_rotary", "batch_idx", "leftpad", "paged",
                                  "rows", "alibi"])
def test_kvcache(planned, monkeypatch, case):
    dtype, batch, nheads, nheads_k, d = DTYPES[0], 3, 8, 2, 64
    seqlen_q = 4 if case == "rows" else 1
    q = randn(batch, seqlen_q, nheads, d, dtype=dtype)
    rows, capacity = batch + 1, 160
    k_cache, v_cache = (randn(rows, capacity, nheads_k, d, dtype=dtype) for _ in range(2))
    options = {"cache_seqlens": torch.tensor([100, 7, 150], dtype=torch.int32, device=DEVICE), "causal": True}
    if case == "int_seqlens":
        options["cache_seqlens"] = 120
    if case in ("append_rotary", "batch_idx", "leftpad"):
        options.update(k=randn(batch, 2, nheads_k, d, dtype=dtype), v=randn(batch, 2, nheads_k, d, dtype=dtype))
    if case == "append_rotary":
        options.update(rotary_cos=randn(capacity, 16, dtype=torch.float32),
                       rotary_sin=randn(capacity, 16, dtype=torch.float32))
    if case == "batch_idx":
        options["cache_batch_idx"] = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEVICE)
    if case == "leftpad":
        options["cache_leftpad"] = torch.tensor([5, 0, 20], dtype=torch.int32, device=DEVICE)
    if case == "paged":
        k_cache, v_cache = (randn(12, 32, nheads_k, d, dtype=dtype) for _ in range(2))
        options["block_table"] = torch.randperm(12, dtype=torch.int32, device=DEVICE)[:9].view(3, 3)
        options["cache_seqlens"] = torch.tensor([90, 7, 96], dtype=torch.int32, device=DEVICE)
    if case == "alibi":
        options["alibi_slopes"] = torch.rand(nheads, device=DEVICE)

    def run():
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **options)
        return out, lse, kc, vc
    with torch.no_grad():
        _agree(*_three_ways(monkeypatch, planned, run))
    assert len(call_plans.KVCACHE_STEPS.plans) == 1


def test_kvcache_int_seqlens_change(planned):
    """An int cache_seqlens keys by type: each replay uses its own value."""
    q = randn(2, 1, 4, 32, dtype=DTYPES[0])
    k_cache, v_cache = (randn(2, 64, 4, 32, dtype=DTYPES[0]) for _ in range(2))
    with torch.no_grad():
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10)
        out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=50)
    ref = flashtile.flash_attn_func(q, k_cache[:, :50], v_cache[:, :50])
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


def test_varlen_replay_takes_new_lengths(planned):
    """Same signature, other sequence tensors (and the same ones rewritten in place): the replay reads
    the lengths each call passes."""
    q = randn(60, 2, 32, dtype=DTYPES[0])
    k, v = (randn(60, 2, 32, dtype=DTYPES[0]) for _ in range(2))
    first, second = _cu([10, 50]), _cu([35, 25])
    for cu in (first, second, first):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 50, 50, causal=True)
        if cu is first:
            first.copy_(_cu([30, 30]))
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 50, 50, causal=True)
        bounds = cu.tolist()
        for start, end in zip(bounds, bounds[1:]):
            ref = flashtile.flash_attn_func(q[None, start:end], k[None, start:end], v[None, start:end], causal=True)
            torch.testing.assert_close(out[start:end], ref[0], rtol=1e-3, atol=1e-3)
    assert len(call_plans.VARLEN_CALLS.plans) == 1


def test_varlen_backward_sees_its_forwards_lengths(planned):
    """Sequence tensors rewritten in place between a planned forward and its backward: the backward
    raises (they are saved for it, as on the long way), not a gradient of other lengths."""
    q, k, v = (randn(60, 2, 32, dtype=DTYPES[0], requires_grad=True) for _ in range(3))
    cu = _cu([10, 50])
    for call in range(2):  # the first call leaves the plan, the second replays it
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 50, 50, causal=True)
        if call == 1:
            cu.copy_(_cu([30, 30]))
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
        else:
            out.sum().backward()


def test_settings_are_read_as_they_change(monkeypatch):
    """The settings part of a key follows os.environ (set and unset in this process)."""
    from flashtile.runtime import environment_reader

    read = environment_reader(("FLASHTILE_TEST_SETTING", "FLASHTILE_TEST_OTHER"))
    monkeypatch.delenv("FLASHTILE_TEST_SETTING", raising=False)
    unset = read()
    assert unset[0] is None
    monkeypatch.setenv("FLASHTILE_TEST_SETTING", "1")
    one = read()
    monkeypatch.setenv("FLASHTILE_TEST_SETTING", "0")
    assert len({unset, one, read()}) == 3
    monkeypatch.delenv("FLASHTILE_TEST_SETTING")
    assert read() == unset
