"""Opt-in autotuning (FLASHTILE_AUTOTUNE=1): the choice, its record on disk, and on the GPU a real
call that tunes and still computes the same function."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import triton

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
    slow, fast, table = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2), KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True), KernelConfig(block_m=32, block_n=32)
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

    table, big = GluonBwdConfig(block_m=64, num_stages=2), GluonBwdConfig(block_m=64, num_stages=3)

    def run(cfg):
        if cfg == big:
            raise OutOfResources("shared memory")

    assert autotune.choose("k", [table, big], run, timer=lambda fn: fn() or 1.0) == table
    record = json.loads((cache_dir / "autotune.json").read_text())["k"]
    assert record["config"]["type"] == "GluonBwdConfig" and "OutOfResources" in record["skipped"][0]["error"]


def test_shape_classes():
    compiler = f"|triton{triton.__version__}"  # another compiler may favour another config: tuned again
    key = autotune.shape_key("bwd_dq", torch.device("cpu"), "interpreter", 96, True, 1000, torch.float16)
    assert key == "cpu|interpreter|bwd_dq|d96|causal|float16|sk1024" + compiler
    for seqlen_k, bucket in ((1, 128), (4096, 4096)):
        key = autotune.shape_key("fwd", torch.device("cpu"), "x", 64, False, seqlen_k, torch.float16)
        assert key.endswith(f"|sk{bucket}{compiler}")


# One tuning process (one per GPU, typically): tunes 50 shape classes of its own, each stored as
# soon as it is chosen, once every process has started (so the stores overlap).
_WORKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flashtile import autotune
    from flashtile.configs import KernelConfig

    worker, go = int(sys.argv[1]), Path(sys.argv[2])
    table, other = KernelConfig(block_m=32, block_n=32), KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.005)
    for i in range(50):
        launched = []
        # The table's config wins odd keys, the other one even keys.
        timer = lambda fn: fn() or (1.0 if (launched[-1] == table) == (i % 2 == 1) else 2.0)
        autotune.choose(f"worker{worker}|key{i}", [table, other], launched.append, timer)
""")


def test_processes_tuning_at_once_lose_no_entry(cache_dir, tmp_path_factory):
    # 4 processes (each imports torch: about 2 s of CPU) storing 200 entries between them.
    go = tmp_path_factory.mktemp("signal") / "go"
    env = dict(os.environ, FLASHTILE_CACHE_DIR=str(cache_dir))
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, str(n), str(go)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in range(4)]
    try:
        for worker in workers:
            assert worker.stdout.readline() == "ready\n", worker.communicate()[1]
        go.touch()
        for worker in workers:
            _, err = worker.communicate(timeout=120)
            assert worker.returncode == 0, err
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    recorded = json.loads((cache_dir / "autotune.json").read_text())
    assert sorted(recorded) == sorted(f"worker{n}|key{i}" for n in range(4) for i in range(50))
    for key, entry in recorded.items():
        block = 32 if int(key.rsplit("key", 1)[1]) % 2 == 1 else 64
        assert entry["config"]["block_m"] == block, (key, entry)
    # No temporary file left behind: only the cache and its lock file.
    assert sorted(p.name for p in cache_dir.iterdir()) == ["autotune.json", "autotune.json.lock"]


_GOOD = {"config": {"type": "KernelConfig", "block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 3,
                    "use_tma": False, "warp_specialize": False}, "ms": 1.0, "skipped": [], "timed": []}
_BAD_FILES = {
    "garbage": (b"\x00\xff{not json", "is not valid JSON"),
    "list": (b"[1, 2, 3]", "holds a JSON list, not an object"),
    "foreign entries": (json.dumps({
        "good": _GOOD,
        "new": {"config": {"type": "FutureConfig", "block_m": 64}, "ms": 1.0},
        "old": {"config": {**_GOOD["config"], "block_k": 16}, "ms": 1.0},  # another version's fields
        "number": 3,
    }).encode(), "entry 'new' has an unknown config type 'FutureConfig'"),
}


@pytest.mark.parametrize("kind", list(_BAD_FILES))
def test_a_bad_file_is_ignored_with_a_warning_and_rewritten(cache_dir, kind):
    content, problem = _BAD_FILES[kind]
    path = cache_dir / "autotune.json"
    path.write_bytes(content)
    table, other = KernelConfig(block_m=32, block_n=32), KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    launched = []

    def timer(fn):
        fn()
        return 1.0 if launched[-1] == other else 2.0

    with pytest.warns(RuntimeWarning) as caught:
        assert autotune.choose("new", [table, other], launched.append, timer) == other
    messages = [str(w.message) for w in caught]
    assert any(problem in m and str(path) in m and "ignored" in m for m in messages), messages
    assert len(messages) == len(set(messages))  # each problem once, though the store reads the file again
    assert launched  # the bad entry's shape class was tuned again
    recorded = json.loads(path.read_text())  # rewritten: valid, with the new choice
    assert recorded["new"]["config"]["block_m"] == 64 and recorded["new"]["config"]["type"] == "KernelConfig"
    if kind == "foreign entries":
        assert {"old", "number"} & set(recorded) == set()  # unreadable entries are dropped
        assert any("entry 'old' does not match KernelConfig's fields" in m for m in messages), messages
        assert any("entry 'number' is not an object" in m for m in messages), messages
        assert recorded["good"] == _GOOD  # the valid entry is kept, and still serves its shape class

        def no_timer(fn):
            raise AssertionError("timed again")
        assert autotune.choose("good", [table, other], launched.append, no_timer) == KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=3)
    else:
        assert sorted(recorded) == ["new"]
    autotune.forget()  # a new process reads the rewritten file without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.choose("new", [table], launched.append, timer) == other


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
