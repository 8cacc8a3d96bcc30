"""`python -m flashtile configs` (tools/configs_cmd.py) and `python -m flashtile tune` (tools/tune.py).

configs runs in-process on meta tensors (flashtile.explain for a hypothetical sm90 / sm80): seconds.
tune's cache commands run against a temporary FLASHTILE_CACHE_DIR; its progress reporting is driven
through autotune.choose with a fake timer, and without a GPU it must say that tuning needs one.
"""

import json
import re

import pytest
import torch

from flashtile import autotune
from flashtile.configs import (BWD_DKDV, BWD_GLUON, FWD, FWD_GLUON, GLUON_CANDIDATES, GluonFwdConfig, _TUNED,
                               table_config)
from flashtile.tools import configs_cmd, tune
from flashtile.tools.catalog import CallSpec, config_kwargs

from _cases import ON_GPU


def _run(capsys, *argv) -> tuple:
    status = configs_cmd.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ----------------------------------------------------------------------------------------------
# configs


def test_shape_on_the_hopper_path(capsys):
    status, out, _ = _run(capsys, "--shape", "2,4096,16,128", "--causal")
    assert status == 0
    if CallSpec(2, 4096, 16, 128, causal=True).explain().forward.path != "hopper":
        pytest.skip("this Triton cannot build the Gluon kernels")
    cfg = table_config(FWD_GLUON, "sm90", 128, True, 4096, torch.bfloat16)
    assert "forward: hopper (gluon_attn_fwd_kernel)" in out
    assert f"  config: {config_kwargs(cfg)}" in out
    assert "  reason: sm90, bfloat16, head dim 128, causal attention: the Hopper Gluon forward" in out
    index = next(i for i, rule in enumerate(_TUNED["sm90"][FWD_GLUON])
                 if rule.matches(128, True, 4096, torch.bfloat16, False))
    assert f'rule (fwd_gluon): configs._TUNED["sm90"]["fwd_gluon"][{index}]: head dim <= 128, causal' in out
    assert "backward: hopper" in out and "rule (bwd_gluon)" in out and "rule (bwd_preprocess)" in out


def test_shape_on_the_portable_path(capsys):
    status, out, _ = _run(capsys, "--shape", "1,1024,8,64", "--heads-k", "2", "--window", "32,0", "--dropout", "0.1")
    assert status == 0
    assert "forward: portable (attn_fwd_kernel)" in out and "dropout" in out
    assert f"config: {config_kwargs(table_config(FWD, 'sm90', 64, False, 1024, torch.bfloat16))}" in out
    assert 'rule (bwd_dkdv): configs._TUNED["sm90"]["bwd_dkdv"][0]: head dim <= 64' in out
    status, out, _ = _run(capsys, "--shape", "1,1024,8,64", "--device-capability", "8.0")
    assert status == 0
    assert "decided for sm80" in out and "the Hopper kernels need sm90" in out
    assert 'configs._DEFAULT_GPU["fwd"][0]: head dim <= 64' in out


def test_tables(capsys):
    status, out, _ = _run(capsys, "--tables", "--kernel", FWD_GLUON)
    assert status == 0
    rules = _TUNED["sm90"][FWD_GLUON]
    assert 'sm90 fwd_gluon (configs._TUNED["sm90"]["fwd_gluon"]), first match wins:' in out
    for index, rule in enumerate(rules):
        line = next(line for line in out.splitlines() if line.startswith(f"  {index} "))
        assert configs_cmd.rule_keys(rule) in line and config_kwargs(rule.config) in line
    status, out, _ = _run(capsys, "--tables", "--kernel", BWD_DKDV)
    assert "sm90 bwd_dkdv" in out and "defaults bwd_dkdv" in out  # the tuned rules, then the defaults
    status, out, _ = _run(capsys, "--tables", "--arch", "interpreter", "--kernel", FWD)
    assert out.strip() == "interpreter fwd: KernelConfig(block_m=32, block_n=32)"


def test_candidates(capsys):
    status, out, _ = _run(capsys, "--candidates", "--kernel", BWD_GLUON, "--head-dim", "128")
    assert status == 0
    named = GLUON_CANDIDATES[BWD_GLUON][128]
    assert out.splitlines()[0] == f"bwd_gluon d128: {len(named)} candidates (* = in the sm90 table)"
    in_table = {rule.config for rule in _TUNED["sm90"][BWD_GLUON]}
    for name, cfg in named.items():
        line = next(line for line in out.splitlines() if f" {name} " in line)
        assert line.startswith("  *" if cfg in in_table else "   ") and config_kwargs(cfg) in line
    status, out, _ = _run(capsys, "--candidates", "--kernel", FWD, "--head-dim", "64")
    assert re.search(r"\n  [ *] m64_n64_w4_s3 +KernelConfig\(block_m=64, block_n=64, num_stages=3\)\n", out)


def test_configs_bad_arguments(capsys):
    assert _run(capsys)[0] == 2
    status, _, err = _run(capsys, "--tables", "--kernel", "nonesuch")
    assert status == 2 and "one of fwd" in err
    status, _, err = _run(capsys, "--candidates", "--kernel", "bwd_preprocess")
    assert status == 2 and "no candidates" in err


# ----------------------------------------------------------------------------------------------
# tune


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    autotune.forget()
    yield tmp_path
    autotune.forget()


def _entry(ms: float, cfg: GluonFwdConfig) -> dict:
    as_json = {"type": "GluonFwdConfig", **cfg.__dict__}
    return {"config": as_json, "ms": ms, "skipped": [], "timed": [{"config": as_json, "ms": ms * 1.25}]}


def test_show_and_clear(cache_dir, capsys):
    assert tune.main(["--show"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"cache: {cache_dir / 'autotune.json'} (no file yet)",
                                                    "  no entries"]
    cfg = GluonFwdConfig(block_n=128, num_stages=2, pingpong=True)
    key = "NVIDIA H100|sm90|fwd_gluon|d128|causal|bfloat16|sk4096|triton3.9.0"
    (cache_dir / "autotune.json").write_text(json.dumps({key: _entry(0.4, cfg), "broken": {"config": 3}}))
    assert tune.main(["--show"]) == 0
    out = capsys.readouterr().out
    assert f"  {key}\n    {config_kwargs(cfg)}: 0.400 ms, table's 0.500 ms (1.25x); 1 timed, 0 skipped" in out
    assert "broken: unreadable entry" in out
    assert tune.main(["--clear"]) == 0
    assert "(2 entries removed)" in capsys.readouterr().out
    assert json.loads((cache_dir / "autotune.json").read_text()) == {}


def test_progress_reports_each_candidate(cache_dir, capsys):
    # The dispatcher's call, as FLASHTILE_AUTOTUNE=1 makes it: the table's config first, then candidates.
    table = table_config(FWD_GLUON, "sm90", 128, False, 4096, torch.bfloat16)
    named = {name: cfg for name, cfg in GLUON_CANDIDATES[FWD_GLUON][128].items() if cfg != table}
    configs = [table, *list(named.values())[:2]]
    ms = iter([0.5, 0.4, 0.6])

    def run(cfg):
        if cfg is configs[2]:
            raise RuntimeError("out of shared memory")
    timed = set()
    key = "GPU|sm90|fwd_gluon|d128|full|bfloat16|sk4096|triton"
    with autotune.reporting(tune._progress_bars(128, timed)):
        chosen = autotune.choose(key, configs, run, timer=lambda fn: (fn(), next(ms))[1])
    assert chosen == configs[1]
    err = capsys.readouterr().err.splitlines()
    names = list(named)
    assert err[0].startswith("fwd_gluon  [") and "1/3 table: 0.500 ms, best table 0.500 ms" in err[0]
    assert f"2/3 {names[0]}: 0.400 ms, best {names[0]} 0.400 ms" in err[1]
    assert f"3/3 {names[1]}: skipped (RuntimeError)" in err[2]
    assert timed == {key}
    entry = json.loads((cache_dir / "autotune.json").read_text())[key]
    assert entry["ms"] == 0.4 and len(entry["skipped"]) == 1


@pytest.mark.skipif(ON_GPU, reason="checks the message without a GPU")
def test_tune_without_a_gpu(capsys):
    assert tune.main(["--shape", "1,1024,8,64"]) == 2
    err = capsys.readouterr().err
    assert "tuning times kernels on a GPU" in err and "--show and --clear work anywhere" in err


@pytest.mark.slow
@pytest.mark.skipif(not ON_GPU, reason="tuning needs a GPU")
def test_tune_on_the_gpu(cache_dir, capsys, monkeypatch):
    monkeypatch.setenv("FLASHTILE_PORTABLE", "1")  # the portable forward: few candidates, quick compiles
    assert tune.main(["--shape", "1,256,2,64", "--direction", "fwd"]) == 0
    out = capsys.readouterr().out
    assert "fwd: winner KernelConfig(" in out and "table's" in out
    assert any("|fwd|d64|full|" in key for key in json.loads((cache_dir / "autotune.json").read_text()))
