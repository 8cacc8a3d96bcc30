"""Score options on the Hopper path: sliding windows (left, right, with and without causal), softcap
and ALiBi ((h,) and (b, h) slopes), alone and together, with GQA and packed batches.

Every case first asks flashtile.explain where the call goes and fails if an option leaves the Hopper
forward, or the Hopper backward at head dims up to 128 (on CPU it asks for an sm90 device; the numbers
then come from the portable kernels through the interpreter, which test_attention covers, so the CPU
run checks the routing alone). On an H100 / H200 the call runs and is checked against float64:
output, lse and gradients."""

import functools

import pytest
import torch

import flashtile
from flashtile import flash_attn_func, flash_attn_varlen_func
from flashtile.reference import attention_varlen_naive

from _cases import DEVICE, ON_GPU, check_against_reference, make_qkv

ON_HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)

# (causal, window_size, softcap, alibi): every option alone, and together.
OPTIONS = [
    (True, (1024, -1), 0.0, None),     # a causal sliding window (Mistral, Gemma 2 / 3)
    (False, (256, 256), 0.0, None),    # a two-sided window
    (False, (-1, 64), 0.0, None),      # right side only
    (False, (0, 0), 0.0, None),        # each query sees one key
    (False, (-1, -1), 30.0, None),     # softcap (Gemma 2)
    (True, (-1, -1), 30.0, None),
    (False, (-1, -1), 0.0, "h"),       # ALiBi (BLOOM, MPT)
    (True, (-1, -1), 0.0, "bh"),
    (True, (512, -1), 50.0, "bh"),     # all of them
    (False, (256, 256), 30.0, "h"),    # a window across the diagonal: ALiBi distances of both signs, softcap
]
OPTION_IDS = ["causal-window", "two-sided", "right-only", "window-0-0", "softcap", "causal-softcap", "alibi",
              "causal-alibi-bh", "all", "two-sided-all"]

SHAPES = [  # (seqlen_q, seqlen_k)
    (1023, 1023), (2048, 2048), (113, 1500), (1500, 113),
]


def _options(causal, window_size, softcap, alibi, batch, nheads):
    slopes = None
    if alibi is not None:
        shape = (batch, nheads) if alibi == "bh" else (nheads,)
        slopes = torch.rand(shape, device=DEVICE, dtype=torch.float32) * 0.1
    return dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=slopes)


def _assert_hopper_path(q, k, v, **options):
    """The forward on the Hopper kernels, and the backward too up to head dim 128."""
    capability = None if ON_GPU else (9, 0)
    explanation = flashtile.explain(q, k, v, device_capability=capability, **options)
    assert explanation.forward.path == "hopper", explanation.forward.reason
    backward = "hopper" if q.shape[-1] <= 128 else "portable"
    assert explanation.backward.path == backward, explanation.backward.reason


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256] if ON_GPU else [64])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES if ON_GPU else SHAPES[:1])
@pytest.mark.parametrize("causal,window_size,softcap,alibi", OPTIONS, ids=OPTION_IDS)
def test_dense_options_on_hopper(head_dim, seqlen_q, seqlen_k, causal, window_size, softcap, alibi):
    dtype = torch.bfloat16
    nheads = 4
    device = DEVICE if ON_GPU else "meta"
    q, k, v = (torch.randn(2, s, nheads, head_dim, device=device, dtype=dtype, requires_grad=True)
               for s in (seqlen_q, seqlen_k, seqlen_k))
    options = _options(causal, window_size, softcap, alibi, 2, nheads)
    if not ON_GPU and options["alibi_slopes"] is not None:
        options["alibi_slopes"] = options["alibi_slopes"].to("meta")
    _assert_hopper_path(q, k, v, **options)
    if not ON_HOPPER:
        return
    with torch.no_grad():
        q.mul_(3.0 if softcap else 1.0)  # softcap: logits large enough to reach the cap
    check_against_reference(flash_attn_func, q, k, v, **options)


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,window_size,softcap,alibi", OPTIONS, ids=OPTION_IDS)
def test_gqa_options_on_hopper(dtype, causal, window_size, softcap, alibi):
    q, k, v = make_qkv(2, 777, 1301, 8, 2, 128, dtype)
    options = _options(causal, window_size, softcap, alibi, 2, 8)
    _assert_hopper_path(q, k, v, **options)
    check_against_reference(flash_attn_func, q, k, v, **options)


def _cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)


@pytest.mark.skipif(not ON_HOPPER, reason="the Hopper kernels run on sm90")
@pytest.mark.parametrize("causal,window_size,softcap,alibi", OPTIONS, ids=OPTION_IDS)
def test_varlen_options_on_hopper(causal, window_size, softcap, alibi):
    lengths_q, lengths_k = [1, 300, 1100, 64, 513], [1, 700, 1100, 300, 513]
    dtype = torch.bfloat16
    q = torch.randn(sum(lengths_q), 8, 128, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), 2, 128, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    cu_q, cu_k = _cu_seqlens(lengths_q), _cu_seqlens(lengths_k)
    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    options = _options(causal, window_size, softcap, alibi, len(lengths_q), 8)
    explanation = flashtile.explain(q, k, v, **packed, **options)
    assert explanation.forward.path == explanation.backward.path == "hopper", explanation
    fn = functools.partial(flash_attn_varlen_func, **packed)
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    check_against_reference(fn, q, k, v, reference=reference, **options)


def test_dropout_stays_off_the_hopper_forward():
    q, k, v = (torch.empty(2, 1024, 4, 128, device="meta", dtype=torch.bfloat16) for _ in range(3))
    explanation = flashtile.explain(q, k, v, dropout_p=0.1, device_capability=(9, 0))
    assert explanation.forward.path == "portable"
    assert "dropout" in explanation.forward.reason


SINK_OPTIONS = ["causal-window", "all"]


@pytest.mark.parametrize("causal,window_size,softcap,alibi", [OPTIONS[OPTION_IDS.index(i)] for i in SINK_OPTIONS],
                         ids=SINK_OPTIONS)
def test_learnable_sink_stays_on_hopper(causal, window_size, softcap, alibi):
    """A learnable sink is taken in by the Hopper forward's epilogue and the backward's preprocess:
    with the options, the call stays on the Hopper kernels (the sink's values: tests/test_sinks.py)."""
    device = DEVICE if ON_GPU else "meta"
    q, k, v = (torch.randn(2, 1500, 8, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    options = _options(causal, window_size, softcap, alibi, 2, 8)
    if not ON_GPU and options["alibi_slopes"] is not None:
        options["alibi_slopes"] = options["alibi_slopes"].to("meta")
    sink = torch.randn(8, device=device, requires_grad=True)
    _assert_hopper_path(q, k, v, learnable_sink=sink, **options)
