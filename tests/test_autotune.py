"""Opt-in autotuning (FLASHTILE_AUTOTUNE=1): the choice, its record on disk, and on the GPU a real
call that tunes and still computes the same function."""

import json

import pytest
import torch

from flashtile import autotune, flash_attn_func
from flashtile.configs import GluonBwdConfig, KernelConfig

from _cases import ON_GPU, check_against_reference, make_qkv


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    autotune.forget()
    yield tmp_path
    autotune.forget()


def test_choose_records_the_fastest(cache_dir):
    slow, fast, table = KernelConfig(64, 64, 4, 2), KernelConfig(128, 64, 8, 3, True), KernelConfig(32, 32)
    times = {table: 2.0, slow: 3.0, fast: 1.0}
    launched = []

    def timer(fn):
        fn()
        return times[launched[-1]]

    key = "gpu|sm90|fwd|d128|causal|bfloat16|sk4096"
    assert autotune.choose(key, [table, slow, fast], launched.append, timer) == fast
    assert sorted(map(str, launched)) == sorted(map(str, [table, slow, fast]))
    record = json.loads((cache_dir / "autotune.json").read_text())[key]
    assert record["config"]["type"] == "KernelConfig" and record["ms"] == 1.0 and len(record["timed"]) == 3

    autotune.forget()  # a new process: the choice comes from the file, nothing is timed again

    def no_timer(fn):
        raise AssertionError("timed again")
    assert autotune.choose(key, [table, slow], launched.append, no_timer) == fast


def test_candidates_that_do_not_fit_are_skipped(cache_dir):
    class OutOfResources(Exception):
        pass

    table, big = GluonBwdConfig(64, 2), GluonBwdConfig(64, 3)

    def run(cfg):
        if cfg == big:
            raise OutOfResources("shared memory")

    assert autotune.choose("k", [table, big], run, timer=lambda fn: fn() or 1.0) == table
    record = json.loads((cache_dir / "autotune.json").read_text())["k"]
    assert record["config"]["type"] == "GluonBwdConfig" and "OutOfResources" in record["skipped"][0]["error"]


def test_shape_classes():
    key = autotune.shape_key("bwd_dq", torch.device("cpu"), "interpreter", 96, True, 1000, torch.float16)
    assert key.endswith("|interpreter|bwd_dq|d96|causal|float16|sk1024")
    assert autotune.shape_key("fwd", torch.device("cpu"), "x", 64, False, 1, torch.float16).endswith("|sk128")
    assert autotune.shape_key("fwd", torch.device("cpu"), "x", 64, False, 4096, torch.float16).endswith("|sk4096")


@pytest.mark.skipif(not ON_GPU, reason="timing candidates needs a GPU")
@pytest.mark.parametrize("head_dim,causal", [(128, True), (96, False), (40, True)])
def test_autotuned_call_is_correct_and_recorded(cache_dir, monkeypatch, head_dim, causal):
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    q, k, v = make_qkv(2, 300, 300, 4, 2, head_dim, torch.bfloat16)
    check_against_reference(flash_attn_func, q, k, v, causal=causal)
    recorded = json.loads((cache_dir / "autotune.json").read_text())
    kernels = {key.split("|")[2] for key in recorded}
    assert kernels & {"fwd", "fwd_gluon"} and kernels & {"bwd_gluon", "bwd_dq"}, kernels
    # Later calls read the choice: same result, nothing new recorded.
    check_against_reference(flash_attn_func, q, k, v, causal=causal)
    assert json.loads((cache_dir / "autotune.json").read_text()).keys() == recorded.keys()
