"""Launch plans (flashtile/kernels/plans.py): later calls of a signature replay the first call's
plan. On the GPU: replayed calls compute the same function on fresh data, layouts and alignments
that differ get plans of their own, and FLASHTILE_LAUNCH_PLANS=0 or override() bypass them. On the
CPU: the argument bookkeeping of CompiledCall and the cache's bounds."""

import pytest
import torch

from flashtile import flash_attn_func, triton_compat
from flashtile.configs import BWD_GLUON, FWD_GLUON, override, table_config
from flashtile import dispatch, options
from flashtile.kernels import plans
from flashtile.kernels.hopper import launch as hopper_launch
from flashtile.kernels.portable import launch as portable_launch

from _cases import DEVICE, DTYPES, ON_GPU, check_against_reference, make_qkv, randn


_CACHES = (dispatch._FORWARD_PLANS, dispatch._BACKWARD_PLANS, dispatch._SPLIT_FORWARD_PLANS, portable_launch._KVCACHE_UPDATE_PLANS)


def _plan_counts():
    return len(dispatch._FORWARD_PLANS.plans), len(dispatch._BACKWARD_PLANS.plans)


@pytest.fixture
def fresh_plans():
    for cache in _CACHES:
        cache.clear()
    yield
    for cache in _CACHES:
        cache.clear()


@pytest.mark.skipif(not ON_GPU, reason="plans serve CUDA calls only")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, seqlen", [(64, 1023), (128, 113), (256, 512), (40, 239)])
def test_replayed_calls_compute_the_same_function(fresh_plans, dtype, causal, head_dim, seqlen):
    # Three calls of one signature on fresh inputs: the first leaves the plans (one forward, one
    # backward: Hopper or portable kernels), the others replay them.
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, head_dim, dtype)
    expected = (1, 1)
    for call in range(3):
        if call > 0:
            q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, head_dim, dtype)
        check_against_reference(flash_attn_func, q, k, v, causal=causal)
        assert _plan_counts() == expected, _plan_counts()


@pytest.mark.skipif(not ON_GPU, reason="plans serve CUDA calls only")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_batches_replay_with_other_lengths(fresh_plans, head_dim, causal):
    # A plan keys on the packed batch's host maxima and tensor layouts, never on the lengths the
    # prefix sums hold: calls with other lengths under the same maxima replay it, on fresh data.
    from test_varlen import check_varlen, make_packed

    # Same totals (the packed tensors' shapes), same maxima, other lengths.
    mixes = [([300, 1, 77], [256, 300, 1]), ([1, 77, 300], [300, 1, 256]), ([78, 300, 0], [300, 0, 257])]
    for lengths_q, lengths_k in mixes:
        q, k, v = make_packed(lengths_q, lengths_k, 4, 2, head_dim, torch.bfloat16)
        check_varlen(lengths_q, lengths_k, q, k, v, causal=causal)
        assert _plan_counts() == (1, 1), _plan_counts()
    # Other maxima (they size the grid): plans of their own.
    q, k, v = make_packed([64, 33], [64, 40], 4, 2, head_dim, torch.bfloat16)
    check_varlen([64, 33], [64, 40], q, k, v, causal=causal)
    assert _plan_counts() == (2, 2), _plan_counts()


@pytest.mark.skipif(not ON_GPU, reason="plans serve CUDA calls only")
@pytest.mark.parametrize("layout", ["rows", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_calls_replay_with_other_lengths(fresh_plans, layout, num_splits):
    # The cache update, and the forward (split or not), replay their plans with other cache lengths.
    from test_kvcache import run_kvcache_case

    for lengths in ((5, 0, 70), (90, 17, 1), (0, 0, 0)):
        run_kvcache_case(torch.bfloat16, layout, 1, 1, True, "interleaved", num_splits=num_splits, lengths=lengths)
        forward_plans = len(dispatch._SPLIT_FORWARD_PLANS.plans if num_splits > 1 else dispatch._FORWARD_PLANS.plans)
        assert (forward_plans, len(portable_launch._KVCACHE_UPDATE_PLANS.plans)) == (1, 1)


@pytest.mark.skipif(not ON_GPU, reason="plans serve CUDA calls only")
def test_layouts_and_alignments_get_plans_of_their_own(fresh_plans):
    dtype = torch.bfloat16
    q, k, v = make_qkv(2, 256, 256, 4, 4, 128, dtype)
    check_against_reference(flash_attn_func, q, k, v, causal=True)
    # The same shapes as views of a packed qkv (other strides), then a base 8 bytes off 16-byte alignment.
    qkv = randn(2, 256, 3, 4, 128, dtype=dtype, requires_grad=True)
    check_against_reference(flash_attn_func, *qkv.unbind(2), causal=True)
    buffer = randn(3 * 2 * 256 * 4 * 128 + 4, dtype=dtype)
    shifted = [buffer[4 + i * q.numel():4 + (i + 1) * q.numel()].view(q.shape).detach().requires_grad_()
               for i in range(3)]
    assert shifted[0].data_ptr() % 16 == 8
    check_against_reference(flash_attn_func, *shifted, causal=True)
    # TMA cannot address the shifted tensors: the portable kernels serve them, with plans of their own.
    assert _plan_counts() == (3, 3)


@pytest.mark.skipif(not ON_GPU, reason="plans serve CUDA calls only")
@pytest.mark.parametrize("window_size", [(-1, -1), (32, 0)])
def test_deterministic_backward_replays_bit_for_bit(fresh_plans, window_size):
    # deterministic=True (and sliding windows) take the portable backward; its replayed calls give the
    # gradients of the call that made the plan, bit for bit, and the float64 reference's on fresh inputs.
    q, k, v = make_qkv(2, 333, 333, 4, 2, 64, torch.bfloat16)
    dout = randn(*q.shape, dtype=q.dtype)
    grads = []
    for _ in range(3):
        out = flash_attn_func(q, k, v, window_size=window_size, deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for replayed in grads[1:]:
        for first, again in zip(grads[0], replayed):
            torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert _plan_counts() == (1, 1)
    q, k, v = make_qkv(2, 333, 333, 4, 2, 64, torch.bfloat16)
    check_against_reference(flash_attn_func, q, k, v, window_size=window_size, deterministic=True)
    assert _plan_counts() == (1, 1)


@pytest.mark.skipif(not ON_GPU, reason="plans serve CUDA calls only")
def test_plans_off_and_overrides_bypass_them(fresh_plans, monkeypatch):
    q, k, v = make_qkv(2, 300, 300, 4, 4, 64, torch.float16, requires_grad=False)
    with_plans = [flash_attn_func(q, k, v, causal=True) for _ in range(2)]
    monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
    dispatch._FORWARD_PLANS.clear()
    without = flash_attn_func(q, k, v, causal=True)
    assert _plan_counts() == (0, 0)
    monkeypatch.delenv("FLASHTILE_LAUNCH_PLANS")
    for out in with_plans:
        torch.testing.assert_close(out, without, rtol=0, atol=0)  # the same kernel, bit for bit
    # Inside override() the config is the override's, never a plan's.
    cfg = table_config(FWD_GLUON, "sm90", 64, causal=True, seqlen_k=300)
    with override(fwd_gluon=cfg, bwd_gluon=table_config(BWD_GLUON, "sm90", 64, causal=True, seqlen_k=300)):
        flash_attn_func(q, k, v, causal=True)
    assert _plan_counts() == (0, 0)


class _FakeKernel:
    """What a compiled kernel looks like to CompiledCall: run(...) records the launch."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _FakeJit:
    """A JIT function: fn is the Python function; [grid](**kwargs) records the binding."""

    def __init__(self, fn):
        self.fn = fn
        self.kernel = _FakeKernel()
        self.bound = []

    def __getitem__(self, grid):
        def bind(**kwargs):
            self.bound.append((grid, kwargs))
            return self.kernel
        return bind


def _kernel(a_ptr, b_ptr, n, scale, flag=None, BLOCK: int = 16, EVEN: bool = True):
    pass


def test_compiled_call_binds_once_then_replays_in_signature_order(monkeypatch):
    monkeypatch.setattr(triton_compat, "current_stream", lambda: 1234)
    jit = _FakeJit(_kernel)
    call = plans.CompiledCall(jit, (3, 2), ("A0", "B0", 10), dict(scale=0.5, BLOCK=32, num_warps=4),
                              slots=("a_ptr", "b_ptr"))
    assert call("A1", "B1") is jit.kernel
    assert jit.bound == [((3, 2, 1), dict(a_ptr="A1", b_ptr="B1", n=10, scale=0.5, flag=None, BLOCK=32, EVEN=True,
                                          **triton_compat.LAUNCH_OPTIONS, num_warps=4))]
    call("A2", "B2")
    assert len(jit.bound) == 1  # not bound again
    (launch_args,) = jit.kernel.launches
    grid, stream, function, metadata, launch_metadata = launch_args[:3], launch_args[3], *launch_args[4:7]
    assert grid == (3, 2, 1) and stream == 1234 and function == "function" and metadata == "metadata"
    assert launch_metadata is None
    assert list(launch_args[9:]) == ["A2", "B2", 10, 0.5, None, 32, True]


def test_compiled_call_needs_every_argument():
    with pytest.raises(AssertionError, match="scale"):
        plans.CompiledCall(_FakeJit(_kernel), (1,), ("A", "B", 1), {}, slots=())


def test_plan_cache_is_bounded():
    cache = plans.PlanCache(capacity=3)
    for key in range(5):
        cache.put(key, key)
    assert sorted(cache.plans) == [2, 3, 4] and cache.get(4) == 4 and cache.get(0) is None


def test_get_or_make_keeps_what_it_makes_unless_the_key_is_none():
    cache, made = plans.PlanCache(), []

    def make():
        made.append(object())
        return made[-1]
    assert cache.get_or_make("k", make) is cache.get_or_make("k", make) is made[0]
    assert cache.get_or_make(None, make) is made[1] and len(cache.plans) == 1
    assert cache.get_or_make(None, make) is made[2]


def test_plans_are_off_under_override_and_autotune(monkeypatch):
    assert plans.enabled()
    with override(fwd=table_config("fwd", "interpreter", 64)):
        assert not plans.enabled()
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    assert not plans.enabled()
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
    assert not plans.enabled()


def test_plans_keep_no_tensor_alive():
    """A cached plan outlives the call that made it: it must not hold that call's tensors (a model's
    activations and gradients, the backward's float32 dQ accumulator). Built on CPU tensors: the
    plans only read their shapes, strides and dtypes here."""
    import gc
    import weakref

    from flashtile.kernels.hopper import backward_plan, forward_plan

    dtype = torch.float16
    q, k, v = (torch.randn(2, 256, 2, 64, dtype=dtype) for _ in range(3))
    out, dout, dq, dk, dv = (torch.randn_like(q) for _ in range(5))
    lse = torch.randn(2, 2, 256)
    delta, lse_log2 = portable_launch.row_stats_buffers(lse)
    dq_acc = backward_plan.dq_accumulator(q)
    params = options.ScoreParams(softmax_scale=0.125, window_right=0)
    # A decoding call's split forward over a paged cache (q: one row per sequence).
    q1, out1, lse1 = q[:, :1], out[:, :1], lse[:, :, :1]
    seqs = options.PackedSeqs(None, None, 1, 256, seqused_k=torch.tensor([100, 256], dtype=torch.int32),
                             block_table=torch.tensor([[0], [1]], dtype=torch.int32))
    tensors = (q, k, v, out, dout, dq, dk, dv, lse, delta, lse_log2, dq_acc, seqs.seqused_k, seqs.block_table)
    refs = [weakref.ref(t) for t in tensors]
    portable = [table_config(name, "interpreter", 64) for name in ("bwd_preprocess", "bwd_dkdv", "bwd_dq")]
    built = [
        forward_plan.ForwardPlan(q, k, v, out, lse, 0.125, True, table_config(FWD_GLUON, "sm90", 64, False, 256)),
        backward_plan.BackwardPlan(q, k, v, dout, lse_log2, delta, dq, dk, dv, dq_acc, 0.125, True,
                                    table_config(BWD_GLUON, "sm90", 64, True, 256), max_seqlen_k=256),
        hopper_launch.GluonBackward(q, k, v, out, dout, lse, dq, dk, dv, params, table_config(BWD_GLUON, "sm90", 64, True, 256),
                             portable[0]),
        portable_launch.PortableForward(q, k, v, out, lse, params, table_config("fwd", "interpreter", 64)),
        portable_launch.PortableBackward(q, k, v, out, dout, lse, dq, dk, dv, params, *portable),
        portable_launch.preprocess_call(out, dout, lse, delta, lse_log2, zero=dq_acc),
        portable_launch.SplitForward(q1, k, v, out1, lse1, params, seqs, 4),
    ]
    del q, k, v, out, dout, dq, dk, dv, lse, delta, lse_log2, dq_acc, tensors, q1, out1, lse1, seqs
    gc.collect()
    assert all(ref() is None for ref in refs), [i for i, ref in enumerate(refs) if ref() is not None]
    assert len(built) == 7 and built[-1].combine is not None


@pytest.mark.parametrize("rows", [1, 40])
def test_dispatcher_plans_keep_no_tensor_alive(rows):
    """The dispatcher's plans are made by closures over the first call's tensors (refitted to the
    shared memory on that call); once made they must drop them, or every cached signature would
    keep a call's K and V alive: a decoding step's whole cache (one query: the decode route; 40
    rows: the Hopper or portable forward) and the kv-cache path's split forward."""
    import gc
    import weakref

    dtype = torch.float16
    q, out = randn(2, rows, 4, 64, dtype=dtype), torch.empty(2, rows, 4, 64, device=DEVICE, dtype=dtype)
    k, v = randn(2, 96, 2, 64, dtype=dtype), randn(2, 96, 2, 64, dtype=dtype)
    lse = torch.empty(2, 4, rows, device=DEVICE, dtype=torch.float32)
    seqs = options.PackedSeqs(None, None, rows, 96, seqused_k=torch.tensor([50, 96], dtype=torch.int32, device=DEVICE))
    refs = [weakref.ref(t) for t in (q, k, v, out, lse)]
    params = options.ScoreParams(softmax_scale=0.125)
    forward = dispatch._forward_plan(q, k, v, out, lse, params, None)
    forward(q, k, v, out, lse, params, None)
    split = dispatch.attention_forward_split(q, k, v, out, lse, params, seqs, 2)
    del q, k, v, out, lse, seqs
    gc.collect()
    assert all(ref() is None for ref in refs), [i for i, ref in enumerate(refs) if ref() is not None]
    assert forward is not None and split is not None


def test_portable_backward_plan_on_fresh_tensors():
    """A PortableBackward made on one call's tensors computes the gradients of another call of the
    same signature: what the long way (attention_backward without a plan) gives, bit for bit. Runs
    the real kernels (through the interpreter on the CPU)."""
    dtype = torch.float16 if ON_GPU else torch.float32
    params = options.ScoreParams(softmax_scale=0.125, window_left=20, window_right=0)

    def call():
        q, k, v = make_qkv(2, 77, 77, 2, 1, 32, dtype, requires_grad=False)
        out, lse = torch.empty_like(q), torch.empty(2, 2, 77, device=q.device)
        dispatch.attention_forward(q, k, v, out, lse, params)
        return q, k, v, out, randn(*q.shape, dtype=dtype), lse, torch.empty_like(q), torch.empty_like(k), \
            torch.empty_like(v)

    first = call()
    arch = "interpreter" if not ON_GPU else dispatch.arch_of(first[0].device)
    configs = [table_config(name, arch, 32, seqlen_k=77) for name in ("bwd_preprocess", "bwd_dkdv", "bwd_dq")]
    plan = portable_launch.PortableBackward(*first, params, *configs)
    second = call()
    plan(*second, params)
    expected = [torch.empty_like(t) for t in second[-3:]]
    with override(bwd_gluon=None):  # plans are off inside override(): the long way, same kernels and configs
        dispatch.attention_backward(*second[:6], *expected, params, deterministic=True)
    for got, want in zip(second[-3:], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compiled_call_takes_every_slot(monkeypatch):
    monkeypatch.setattr(triton_compat, "current_stream", lambda: 0)
    call = plans.CompiledCall(_FakeJit(_kernel), (1,), ("A", "B", 1, 0.5), {}, slots=("a_ptr", "b_ptr"))
    assert call.template[:2] == [None, None]  # the construction's tensors are not kept
    with pytest.raises(AssertionError):
        call("A")


@pytest.fixture
def busy_switching():
    # Switch threads every microsecond (CPython's default is 5 ms): races show up in a short test.
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _in_threads(count, work):
    """Run ``work(index)`` in ``count`` threads at once; their results, or the first exception."""
    import threading

    start, results, errors = threading.Barrier(count), [None] * count, []

    def body(index):
        start.wait()
        try:
            results[index] = work(index)
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"
    if errors:
        raise errors[0]
    return results


def test_plan_cache_under_many_threads(busy_switching):
    # 16 threads, 12 keys, room for 4 plans: constant eviction. Every plan returned is the one made
    # for its key, and the cache never holds more than its capacity.
    import random
    import time

    cache, capacity = plans.PlanCache(capacity=4), 4
    sizes = []

    def work(index):
        rng, deadline, calls = random.Random(index), time.monotonic() + 1.0, 0
        while time.monotonic() < deadline or calls < 200:
            key = rng.randrange(12)
            action = rng.random()
            if action < 0.8:
                plan = cache.get_or_make(key, lambda key=key: (key, object()))
                assert plan[0] == key, (plan, key)
            elif action < 0.9:
                plan = cache.get(key)
                assert plan is None or plan[0] == key, (plan, key)
            elif action < 0.99:
                cache.put(key, (key, object()))
            else:
                cache.clear()
            sizes.append(len(cache.plans))
            calls += 1
        return calls

    assert sum(_in_threads(16, work)) >= 16 * 200
    assert max(sizes) <= capacity and len(cache.plans) <= capacity


def test_threads_making_one_plan_share_the_first(busy_switching):
    # make() runs outside the cache's lock (it compiles kernels, and may use other caches): all 8
    # threads are inside it at once (else the barrier times out), and all get the plan kept first.
    import threading

    cache, inside = plans.PlanCache(capacity=2), threading.Barrier(8, timeout=30)

    def make():
        inside.wait()
        return object()

    got = _in_threads(8, lambda index: cache.get_or_make("key", make))
    assert all(plan is got[0] for plan in got) and cache.get("key") is got[0] and len(cache.plans) == 1


@pytest.fixture
def one_interpreted_kernel_at_a_time(monkeypatch):
    # Triton's CPU interpreter is not thread-safe: while it runs a kernel it patches triton.language
    # module-wide and keeps the program id in a global. On the CPU, kernels run one at a time, so
    # the test exercises the rest of the call path (flashtile's host code, autograd) concurrently.
    if ON_GPU:
        return
    import threading

    from triton.runtime import interpreter

    lock, run = threading.RLock(), interpreter.GridExecutor.__call__

    def serialized(self, *args, **kwargs):
        with lock:
            return run(self, *args, **kwargs)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", serialized)


def test_concurrent_calls_from_threads(fresh_plans, one_interpreted_kernel_at_a_time):
    # The whole call path (on CUDA with its plans) from 8 threads at once, each on inputs of its
    # own: every result matches the reference.
    dtype = torch.float16 if ON_GPU else torch.float32
    inputs = [make_qkv(1, 64, 48 + 8 * (i % 2), 2, 1, 32, dtype) for i in range(8)]
    _in_threads(8, lambda index: check_against_reference(flash_attn_func, *inputs[index], causal=index % 2 == 0))
