"""Every kernel config must compute the same function: asymmetric tiles, several warps
and pipeline depths, run through the override hook against the reference (the GPU also
runs the tuned table's configs)."""

import pytest
import torch

from flashtile import flash_attn_func
from flashtile.configs import (_TUNED, BWD_DKDV, BWD_DQ, BWD_GLUON, BWD_PREPROCESS, FWD, FWD_GLUON, GLUON_CANDIDATES,
                               GluonFwdConfig,
                               KernelConfig, override)
from flashtile.runtime import portable_only
from flashtile.testing import check_errors, reference_errors

from _cases import DTYPES, ON_GPU, check_against_reference, make_qkv

C = KernelConfig
ASYMMETRIC = [C(block_m=16, block_n=32, num_warps=4, num_stages=1), C(block_m=32, block_n=16, num_warps=4, num_stages=2), C(block_m=16, block_n=64, num_warps=4, num_stages=3), C(block_m=64, block_n=16, num_warps=2, num_stages=2),
              C(block_m=32, block_n=16, num_warps=4, num_stages=2, use_tma=True, warp_specialize=True), C(block_m=16, block_n=32, num_warps=4, num_stages=3, use_tma=True)]
if ON_GPU:
    ASYMMETRIC += [C(block_m=32, block_n=64, num_warps=4, num_stages=3), C(block_m=32, block_n=128, num_warps=8, num_stages=3), C(block_m=16, block_n=64, num_warps=4, num_stages=3), C(block_m=128, block_n=32, num_warps=8, num_stages=3), C(block_m=64, block_n=32, num_warps=4, num_stages=3),
                   C(block_m=128, block_n=128, num_warps=8, num_stages=2)]
    for tables in _TUNED.values():
        for kernel, rules in tables.items():
            if kernel not in (FWD_GLUON, BWD_GLUON, BWD_PREPROCESS):
                ASYMMETRIC += [rule.config for rule in rules if rule.config not in ASYMMETRIC]

# The Hopper Gluon kernels: every config of the sm90 table plus the probes' alternatives,
# as (head dim, config) pairs (a config is sized for its head dim).
ON_SM90 = ON_GPU and torch.cuda.get_device_capability() == (9, 0) and not portable_only()
GLUON_FWD, GLUON_BWD = [], []
if ON_SM90:
    for kernel, pairs in ((FWD_GLUON, GLUON_FWD), (BWD_GLUON, GLUON_BWD)):
        candidates = GLUON_CANDIDATES[kernel]
        pairs += [(rule.max_head_dim, rule.config) for rule in _TUNED["sm90"][kernel] if rule.config is not None]
        pairs += [(d, cfg) for d, by_name in candidates.items() for cfg in by_name.values() if (d, cfg) not in pairs]


@pytest.mark.parametrize("kernel", [FWD, BWD_DKDV, BWD_DQ])
@pytest.mark.parametrize("config", ASYMMETRIC, ids=lambda c: f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}")
# On the CPU causal alone: with the window's left edge it still puts both sides of the band inside tiles.
@pytest.mark.parametrize("causal", [False, True] if ON_GPU else [True])
def test_config_computes_the_same_function(kernel, config, causal):
    head_dim = 128 if ON_GPU else 32
    # On the CPU, lengths that still give every config several tiles each way, a partial last one and a
    # window edge inside the band.
    seqlen_q, seqlen_k = (700, 1000) if ON_GPU else (45, 71)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, DTYPES[0])
    with override(**{kernel: config}):
        try:
            check_against_reference(flash_attn_func, q, k, v, causal=causal, window_size=(300 if ON_GPU else 20, -1),
                                    dropout_p=0.1)
        except Exception as exc:
            if "OutOfResources" in type(exc).__name__:
                pytest.skip(f"{config} does not fit this GPU: {exc}")
            raise


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run on sm90 only")
@pytest.mark.parametrize("kernel", [FWD_GLUON, BWD_GLUON])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,nheads_k", [(700, 1000, 2), (1000, 700, 4), (4, 333, 1)])
@pytest.mark.parametrize("index", range(max(len(GLUON_FWD), len(GLUON_BWD), 1)))
def test_gluon_config(kernel, causal, seqlen_q, seqlen_k, nheads_k, index):
    """Each Gluon config, forced through the override hook, against the reference."""
    from flashtile.options import ScoreParams
    from flashtile.dispatch import gluon_config

    pairs = GLUON_FWD if kernel == FWD_GLUON else GLUON_BWD
    if index >= len(pairs):
        pytest.skip("no such config")
    head_dim, config = pairs[index]
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, nheads_k, head_dim, torch.bfloat16)
    with override(**{kernel: config}):
        assert gluon_config(kernel, q, k, v, ScoreParams(softmax_scale=0.1, window_right=0 if causal else -1))
        check_against_reference(flash_attn_func, q, k, v, causal=causal, backward=kernel == BWD_GLUON)


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run on sm90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("row_sum_mma", [False, True])
def test_gluon_forward_lse_accuracy(dtype, row_sum_mma):
    """lse as accurate as GluonFwdConfig.row_sum_mma says: float32 row sums put it within 1e-5
    of float64; row sums on the tensor cores add P rounded to the input dtype, which moves lse by
    at most 2^-8 (bf16) / 2^-11 (fp16). Causal: its top rows, with few keys, are the worst case."""
    from flashtile.options import ScoreParams
    from flashtile.dispatch import gluon_config

    config = GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160, loader_regs=24, row_sum_mma=row_sum_mma)
    q, k, v = make_qkv(2, 1000, 1000, 4, 4, 64, dtype, requires_grad=False)
    with override(**{FWD_GLUON: config}):
        assert gluon_config(FWD_GLUON, q, k, v, ScoreParams(softmax_scale=0.125, window_right=0))
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    errors, ref_lse = reference_errors(q, k, v, out, causal=True)
    check_errors(errors, dtype)
    lse_error = (lse.double() - ref_lse).abs().max().item()
    bound = 1e-5
    if row_sum_mma:
        bound += 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert lse_error <= bound, f"lse off by {lse_error:.2e}, documented bound {bound:.2e}"


PERSISTENT_FWD = [(d, cfg) for d, cfg in GLUON_FWD if cfg.persistent]
PERSISTENT_BWD = [(d, cfg) for d, cfg in GLUON_BWD if cfg.persistent]


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run on sm90 only")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(777, 777), (1000, 300), (300, 1000), (64, 64)])
@pytest.mark.parametrize("index", range(max(len(PERSISTENT_FWD), 1)))
def test_gluon_persistent_forward_many_tiles(causal, seqlen_q, seqlen_k, index):
    """A persistent forward with several tiles per CTA (more tiles than SMs): the K/V ring, the
    ping-pong turns and the Q hand-back carry over from tile to tile, causal pairs of tiles, tiles
    without keys (seqlen_q > seqlen_k) in between."""
    if index >= len(PERSISTENT_FWD):
        pytest.skip("no such config")
    head_dim, config = PERSISTENT_FWD[index]
    q, k, v = make_qkv(6, seqlen_q, seqlen_k, 16, 4, head_dim, torch.bfloat16)
    with override(fwd_gluon=config):
        check_against_reference(flash_attn_func, q, k, v, causal=causal, backward=False)


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run on sm90 only")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(777, 777), (1000, 300), (300, 1000), (64, 64), (1, 239), (239, 1)])
@pytest.mark.parametrize("ctas", [3, None], ids=["3ctas", "1persm"])
@pytest.mark.parametrize("index", range(max(len(PERSISTENT_BWD), 1)))
def test_gluon_persistent_backward_many_units(causal, seqlen_q, seqlen_k, ctas, index, monkeypatch):
    """A persistent backward with many key blocks per CTA (3 CTAs, or one per SM): the ring position,
    the dS^T buffers' phases and the K, V hand-over carry over from key block to key block, through
    ragged key blocks and query heads of a GQA group."""
    from flashtile.kernels.hopper import backward_plan

    if index >= len(PERSISTENT_BWD):
        pytest.skip("no such config")
    head_dim, config = PERSISTENT_BWD[index]
    if ctas is not None:
        # Plans are off under override(), so the next backward builds its grid with this SM count.
        monkeypatch.setattr(backward_plan, "multiprocessors", lambda device: ctas)
    q, k, v = make_qkv(6, seqlen_q, seqlen_k, 16, 4, head_dim, torch.bfloat16)
    with override(bwd_gluon=config):
        check_against_reference(flash_attn_func, q, k, v, causal=causal)


def test_gluon_forward_register_cap():
    """ctas_per_sm > 1 caps registers per thread so that many CTAs fit an SM's 64K, and a
    consumer / loader split that does not fit the cap is refused before anything compiles."""
    from flashtile.kernels.hopper.forward_plan import register_cap

    assert register_cap(GluonFwdConfig(block_n=128, num_stages=2)) == {}
    one_consumer = GluonFwdConfig(block_n=64, num_stages=2, num_consumers=1, consumer_regs=136, loader_regs=24, ctas_per_sm=3)
    assert register_cap(one_consumer) == {"maxnreg": 80}  # 3 CTAs x 256 threads x 80 <= 65536
    with pytest.raises(ValueError, match="3 CTAs per SM leave 80 registers"):
        register_cap(GluonFwdConfig(block_n=64, num_stages=2, num_consumers=1, consumer_regs=144, loader_regs=24, ctas_per_sm=3))
