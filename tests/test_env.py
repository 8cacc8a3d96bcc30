"""`python -m flashtile.env`, flashtile.explain and the Gluon fallback warning, on the CPU.

explain launches nothing, so these run in seconds: the sm90 decisions are taken for a
hypothetical device (device_capability=(9, 0)) from CPU tensors.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import triton

import flashtile
from flashtile import triton_compat
from flashtile.kernels.hopper import status as hopper_status
from flashtile.configs import FWD_DECODE, FWD_GLUON, GluonBwdConfig, GluonFwdConfig, table_config
from flashtile import dispatch
from flashtile.dispatch import gluon_config, gluon_decision
from flashtile.options import ScoreParams

from _cases import DEVICE, ON_GPU

SM90 = (9, 0)
UNAVAILABLE = (False, f"Gluon does not import on Triton {triton.__version__} (a test's stand-in)")


@pytest.fixture(autouse=True)
def _hopper_possible(monkeypatch):
    # Decide as on a Triton that runs Gluon, whatever this one and the environment say; every test
    # starts with the once-per-process fallback warning not yet given.
    monkeypatch.delenv("FLASHTILE_PORTABLE", raising=False)
    monkeypatch.setattr(hopper_status, "gluon_status", lambda: (True, "a test's stand-in"))
    dispatch.reset_gluon_fallback_warning()
    yield
    dispatch.reset_gluon_fallback_warning()


def _dense(dtype=torch.bfloat16, head_dim=128, nheads=4, nheads_k=2, seqlen=64):
    q = torch.randn(2, seqlen, nheads, head_dim, dtype=dtype)
    k, v = (torch.randn(2, seqlen, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    return q, k, v


def _packed(head_dim=128, nheads=4, nheads_k=2):
    """Two sequences of 24 and 40 tokens, packed."""
    q = torch.randn(64, nheads, head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(64, nheads_k, head_dim, dtype=torch.bfloat16) for _ in range(2))
    cu_seqlens = torch.tensor([0, 24, 64], dtype=torch.int32)
    return q, k, v, dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=40, max_seqlen_k=40)


def _run_env(*args) -> subprocess.CompletedProcess:
    # The child inherits TRITON_INTERPRET=1 from conftest.py when there is no GPU.
    return subprocess.run([sys.executable, "-m", "flashtile.env", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))


# ------------------------------------------------------------------------------------------------
# python -m flashtile.env
# ------------------------------------------------------------------------------------------------

def test_env_prints_the_bug_report_facts():
    done = _run_env()
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    for key in ("flashtile", "python", "platform", "torch", "torch_cuda", "triton", "triton_supported", "ptxas",
                "numpy", "transformers", "cuda_available", "driver", "interpreter", "flashtile_env", "gluon"):
        assert key in lines, f"no {key!r} line in:\n{done.stdout}"
    assert lines["flashtile"] == flashtile.__version__
    assert lines["triton"] == triton.__version__
    assert lines["gluon"].startswith(("available", "unavailable"))
    assert "FLASHTILE_POISON_OUTPUTS=1" in lines["flashtile_env"]  # set by conftest.py


def test_env_json_explains_a_shape():
    done = _run_env("--json", "--shape", "2,256,8,128", "--heads-k", "2", "--causal", "--device-capability", "9.0")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["flashtile"] == flashtile.__version__ and found["triton"] == triton.__version__
    assert isinstance(found["gluon"]["available"], bool) and found["gluon"]["reason"]
    explained = found["explain"]
    assert "(2, 256, 8, 128)" in explained["call"] and "causal" in explained["call"]
    # The child asks the real gluon_status: the path follows it.
    path = "hopper" if found["gluon"]["available"] else "portable"
    assert explained["forward"]["path"] == path and explained["backward"]["path"] == path


# ------------------------------------------------------------------------------------------------
# flashtile.explain
# ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(ON_GPU, reason="CPU tensors run (through the interpreter) only on machines without CUDA")
def test_explain_cpu_tensors_run_portable():
    explanation = flashtile.explain(*_dense(torch.float16), causal=True)
    for choice in (explanation.forward, explanation.backward):
        assert choice.path == "portable" and "not a CUDA tensor" in choice.reason
    assert explanation.forward.kernel == "attn_fwd_kernel"
    assert "portable" in str(explanation)


def test_explain_sm90_plain_causal_takes_hopper():
    explanation = flashtile.explain(*_dense(), causal=True, device_capability=SM90)
    assert explanation.forward.path == "hopper" and explanation.backward.path == "hopper"
    assert explanation.forward.kernel == "gluon_attn_fwd_kernel"
    assert isinstance(explanation.forward.config, GluonFwdConfig)
    assert isinstance(explanation.backward.config, GluonBwdConfig)
    assert "sm90" in explanation.forward.reason and "causal" in explanation.forward.reason
    text = str(explanation)
    assert "forward: hopper" in text and "backward: hopper" in text


def test_explain_packed_sm90_takes_hopper():
    q, k, v, layout = _packed()
    explanation = flashtile.explain(q, k, v, **layout, device_capability=SM90)
    assert explanation.forward.path == "hopper" and explanation.backward.path == "hopper"


def _slopes():
    return torch.rand(4, dtype=torch.float32)


@pytest.mark.parametrize("options,expected", [
    (dict(dropout_p=0.1), "dropout"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi_slopes="slopes"), "ALiBi"),
    (dict(window_size=(16, 16)), "sliding window"),
], ids=["dropout", "softcap", "alibi", "window"])
def test_explain_options_off_the_hopper_path(options, expected):
    """Dropout keeps both directions off the Hopper kernels; softcap, ALiBi and windows run on them,
    but for the head-dim-256 backward."""
    if options.get("alibi_slopes") == "slopes":
        options = dict(alibi_slopes=_slopes())
    explanation = flashtile.explain(*_dense(), causal=True, device_capability=SM90, **options)
    if expected == "dropout":
        for choice in (explanation.forward, explanation.backward):
            assert choice.path == "portable" and expected in choice.reason, choice.reason
        assert explanation.forward.kernel == "attn_fwd_kernel"
        return
    assert explanation.forward.path == explanation.backward.path == "hopper", explanation
    assert explanation.forward.kernel == "gluon_attn_fwd_kernel"
    wide = flashtile.explain(*_dense(head_dim=256), causal=True, device_capability=SM90, **options)
    assert wide.forward.path == "hopper" and wide.backward.path == "portable", wide
    assert expected in wide.backward.reason and "head dim 256" in wide.backward.reason


@pytest.mark.parametrize("dtype,head_dim,expected", [(torch.bfloat16, 40, "head dim 40"),
                                                     (torch.float32, 128, "float32")], ids=["head_dim_40", "fp32"])
def test_explain_tensors_off_the_hopper_path(dtype, head_dim, expected):
    explanation = flashtile.explain(*_dense(dtype, head_dim), device_capability=SM90)
    for choice in (explanation.forward, explanation.backward):
        assert choice.path == "portable" and expected in choice.reason, choice.reason


def test_explain_deterministic_moves_only_the_backward():
    explanation = flashtile.explain(*_dense(), causal=True, deterministic=True, device_capability=SM90)
    assert explanation.forward.path == "hopper"
    assert explanation.backward.path == "portable" and "deterministic=True" in explanation.backward.reason


@pytest.mark.parametrize("page_size, path", [(16, "portable"), (256, "hopper")])
def test_explain_paged_kv(page_size, path):
    """Pages of a multiple of the Hopper forward's key blocks are read there; smaller ones are not."""
    q, _, _, layout = _packed()
    k_cache, v_cache = (torch.randn(6, page_size, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    block_table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    explanation = flashtile.explain(q, k_cache, v_cache, **layout, block_table=block_table, device_capability=SM90)
    assert explanation.forward.path == path, explanation.forward.reason
    if path == "portable":
        assert f"pages of {page_size} keys" in explanation.forward.reason, explanation.forward.reason
    assert explanation.backward.path == "none"


def test_explain_decode_over_pages_takes_the_paged_config():
    """One query per sequence over a paged cache runs on the decode kernels with the sm90 table's paged row:
    each K/V load waits on a page-number load, which takes pipeline stages of its own."""
    q = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(6, 256, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    layout = dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1,
                  cu_seqlens_k=torch.tensor([0, 700, 1300], dtype=torch.int32), max_seqlen_k=700,
                  block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32))
    explanation = flashtile.explain(q, k_cache, v_cache, **layout, device_capability=SM90)
    assert explanation.forward.path == "portable", explanation.forward.reason
    paged = table_config(FWD_DECODE, "sm90", 128, False, 700, torch.bfloat16, paged=True)
    assert explanation.forward.config == paged != table_config(FWD_DECODE, "sm90", 128, False, 700, torch.bfloat16)


def test_explain_seqused_k():
    q, k, v, layout = _packed()
    seqused_k = torch.tensor([20, 30], dtype=torch.int32)
    explanation = flashtile.explain(q, k, v, **layout, seqused_k=seqused_k, device_capability=SM90)
    # The forward zeroes the values past seqused_k; the backward would add them into dK and dV.
    assert explanation.forward.path == "hopper", explanation.forward.reason
    assert explanation.backward.path == "portable" and "seqused_k" in explanation.backward.reason


def test_explain_flashtile_portable(monkeypatch):
    monkeypatch.setenv("FLASHTILE_PORTABLE", "1")
    explanation = flashtile.explain(*_dense(), causal=True, device_capability=SM90)
    for choice in (explanation.forward, explanation.backward):
        assert choice.path == "portable" and "FLASHTILE_PORTABLE=1" in choice.reason


def test_explain_gluon_unavailable(monkeypatch):
    monkeypatch.setattr(hopper_status, "gluon_status", lambda: UNAVAILABLE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # explain reports the fallback; it does not warn
        explanation = flashtile.explain(*_dense(), causal=True, device_capability=SM90)
    for choice in (explanation.forward, explanation.backward):
        assert choice.path == "portable" and "unavailable" in choice.reason and triton.__version__ in choice.reason


def test_explain_checks_arguments_like_the_call():
    q, k, v = _dense()
    with pytest.raises(ValueError, match="dropout_p"):
        flashtile.explain(q, k, v, dropout_p=1.5, device_capability=SM90)
    with pytest.raises(ValueError, match="cu_seqlens"):
        flashtile.explain(q, k, v, seqused_k=torch.zeros(2, dtype=torch.int32))


def test_explain_draws_no_dropout_seed():
    q, k, v = (t.to(DEVICE) for t in _dense(torch.float16))
    state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if ON_GPU else None
    flashtile.explain(q, k, v, dropout_p=0.1)
    assert torch.equal(state, torch.get_rng_state())
    if ON_GPU:
        assert torch.equal(cuda_state, torch.cuda.get_rng_state())


def test_explain_meta_tensors_for_a_hypothetical_gpu():
    q, k, v = (t.to("meta") for t in _dense())
    assert flashtile.explain(q, k, v, device_capability=SM90).forward.path == "hopper"
    assert flashtile.explain(q, k, v, device_capability=(8, 0)).forward.reason.startswith("the GPU is sm80")


# ------------------------------------------------------------------------------------------------
# The fallback warning, and the decision function the launch path asks
# ------------------------------------------------------------------------------------------------

def _plain_causal():
    q, k, v = _dense()
    return q, k, v, ScoreParams(softmax_scale=0.125, window_right=0)


def test_gluon_unavailable_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(hopper_status, "gluon_status", lambda: UNAVAILABLE)
    q, k, v, params = _plain_causal()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions = [gluon_decision(FWD_GLUON, q, k, v, params, device_capability=SM90) for _ in range(2)]
    fallbacks = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    message = str(fallbacks[0].message)
    assert triton.__version__ in message and "portable" in message and UNAVAILABLE[1] in message
    for config, reason in decisions:
        assert config is None and "unavailable" in reason


def test_no_fallback_warning_off_the_hopper_path(monkeypatch):
    monkeypatch.setattr(hopper_status, "gluon_status", lambda: UNAVAILABLE)
    q, k, v, _ = _plain_causal()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config, reason = gluon_decision(FWD_GLUON, q, k, v, ScoreParams(softmax_scale=0.125, dropout_p=0.1),
                                        device_capability=SM90)
    assert config is None and "dropout" in reason


def test_gluon_config_keeps_cpu_calls_portable():
    q, k, v, params = _plain_causal()
    assert gluon_config(FWD_GLUON, q, k, v, params) is None
