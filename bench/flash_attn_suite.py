"""Run flash-attn's own test suite against flashtile: a sample of flash-attention v2.8.3's
tests/test_flash_attn.py (the FA2 tests), with flashtile registered as ``flash_attn``
(flashtile.install_as_flash_attn()) before the test module is imported.

On a GPU machine (the upstream tests are CUDA-only), from the repository root:

    python bench/flash_attn_suite.py --upstream .upstream/flash_attn/test_flash_attn.py --out $OUT/fa-suite -n 8

Collecting the file's cases takes about a minute (50 s on a CPU here): ``--save-collected
.upstream/flash_attn/collected.json.gz`` with a ``--dry-run`` on any machine, then ``--collected`` with that
file on the GPU skips it (same sample). .upstream/ is git-ignored: a remote run must carry it. Add
``--time-limit 540`` where one command may run 10 minutes: the run stops there and the summary
still comes out, the cases not reached counted as not run (the cases run interleaved across test
functions, so a cut run still covers every function). ``--dry-run`` (any machine; on a CPU-only one
the module's CUDA queries are answered as an sm90 would) collects, samples and prints the plan
without running anything. ``--cpu`` runs the sampled cases on the CPU through Triton's interpreter,
with the tests' device "cuda" redirected to the CPU: only for tiny cases, to check this harness, e.g.
``--cpu --only test_flash_attn_bwd_overflow --per-function 3 --total 3``.

Getting the upstream file (it is not ours to commit: keep it in the git-ignored .upstream/)::

    git --git-dir=<clone of Dao-AILab/flash-attention>/.git show v2.8.3:tests/test_flash_attn.py \\
        > .upstream/flash_attn/test_flash_attn.py         # and: echo /.upstream/ >> .git/info/exclude

What runs. The file parametrizes 508,772 cases; collecting them all as pytest items takes minutes and
GBs per process, so this script collects their parameters once (plan phase, in a subprocess: the
parametrize marks are expanded, no items are built), picks the sample, and the run phase's pytest
(with xdist workers, ``-n``) parametrizes each test function with only its sampled cases, under
their original ids: node ids are upstream's, e.g. ``test_flash_attn.py::test_flash_attn_output[...]``.

Scope. Out of scope, not sampled, counted per group (OUT_OF_SCOPE below says why):
  - dropout_p > 0: those cases decode flash_attn's S_dmask layout; flashtile's is deliberately not a copy.
Upstream skips, not sampled either (UPSTREAM_SKIPS): parameter combinations the test itself skips at
its first lines on any GPU. Everything else is eligible.

Sampling rule (deterministic for a given file, --seed, --per-function, --total): every test function
first gets min(--per-function, its eligible cases); the slots left up to --total are shared out in
proportion to the square root of each function's remaining eligible cases (largest remainder, capped).
Within a function, cases are drawn in an order shuffled by random.Random(f"{seed}/{function}"),
greedily preferring the case that covers the most (parameter, value) pairs not yet sampled, so every
value of every parameter is present where the quota allows; the rest in shuffled order.

One name the upstream file imports is not in the alias: flash_attn.flash_attn_interface._get_block_size_n
(the key-block width of flash_attn's CUDA kernels, which lays out its S_dmask). The plugin adds a stub
that raises: only the dropout cases (out of scope) call it.

Outputs (--out): plan.json (the sample), results.jsonl (one line per test phase, written as they
finish), summary.json and summary.md (per test function: collected, out of scope, upstream skips,
eligible, sampled, passed, failed, skipped, not run; the rule; versions; GPU), pytest.log.
Exit status: 0 all sampled cases passed (or were skipped by the test); 1 some failed; 2 none failed
but some did not run (time limit, or pytest stopped early); 3 the harness itself failed.

This file is also the pytest plugin (-p) that the subprocesses load; FA_SUITE_* variables drive it.
"""

import argparse
import collections
import datetime
import gzip
import hashlib
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
PLUGIN_NAME = "flashtile_fa_suite_plugin"  # this file, copied under that name for -p

UPSTREAM = {"repository": "Dao-AILab/flash-attention", "tag": "v2.8.3",
            "commit": "060c9188beec3a8b62b33a3bfa6d5d2d44975fab", "path": "tests/test_flash_attn.py",
            "sha256": "81b462f864efa01bdd31e826339b881754f03822f65d39ad9a1351da6abd2ba0"}

# --cpu only: what Triton's CPU interpreter cannot run (no flashtile question on a GPU).
OUT_OF_SCOPE_CPU = [
    ("bfloat16 under --cpu",
     "Triton's CPU interpreter computes bfloat16 wrongly (numpy has no bfloat16: outputs come back as "
     "garbage, ~1e8); flashtile's own CPU tests use float16 and float32",
     lambda fn, p: p.get("dtype") == {"dtype": "bfloat16"}),
]

# (group, why, predicate(function, params)): cases not sampled because they test what flashtile does
# not mirror on purpose. The first matching group counts a case.
OUT_OF_SCOPE = [
    ("dropout_p > 0",
     "these cases check dropout by decoding flash_attn's S_dmask: its per-tile unnormalised scores in a "
     "buffer rounded up to multiples of 128, decoded with _get_block_size_n (flash_attn's kernel tile "
     "widths), the sign marking dropped entries. flashtile's S_dmask is the normalised probability matrix "
     "(dropped entries negated) and its dropout RNG is its own Philox stream, so neither the decoding nor "
     "the mask can match; flashtile's dropout is tested in tests/test_dropout.py",
     lambda fn, p: float(p.get("dropout_p", 0.0)) > 0.0),
]

# (group, predicate): combinations the upstream test skips itself, unconditionally, at its start.
UPSTREAM_SKIPS = [
    ("test_flash_attn_kvcache: seqlen_q > seqlen_k and new_kv",
     lambda fn, p: fn == "test_flash_attn_kvcache" and p["seqlen_q"] > p["seqlen_k"] and p["new_kv"]),
    ("test_flash_attn_kvcache: not new_kv and rotary_fraction > 0",
     lambda fn, p: fn == "test_flash_attn_kvcache" and not p["new_kv"] and p["rotary_fraction"] > 0.0),
    ("test_flash_attn_kvcache: has_batch_idx with paged_kv_block_size",
     lambda fn, p: fn == "test_flash_attn_kvcache" and p["has_batch_idx"] and p["paged_kv_block_size"] is not None),
    ("test_flash_attn_kvcache: has_leftpad with paged_kv_block_size",
     lambda fn, p: fn == "test_flash_attn_kvcache" and p["has_leftpad"] and p["paged_kv_block_size"] is not None),
    ("softcap > 0 and dropout_p > 0",
     lambda fn, p: float(p.get("softcap", 0.0)) > 0.0 and float(p.get("dropout_p", 0.0)) > 0.0),
]


# =============================================================================================
# Parameter values as JSON (torch dtypes are the only non-JSON values the file parametrizes)
# =============================================================================================

def _encode(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    module = type(value).__module__
    if module == "torch" and type(value).__name__ == "dtype":
        return {"dtype": str(value).replace("torch.", "")}
    raise TypeError(f"cannot carry parameter value {value!r} of type {type(value).__name__}")


def _decode(value):
    if isinstance(value, dict) and set(value) == {"dtype"}:
        import torch

        return getattr(torch, value["dtype"])
    return value


def _shown(value) -> str:
    return f"torch.{value['dtype']}" if isinstance(value, dict) else repr(value)


# =============================================================================================
# The pytest plugin (loaded with -p in the plan and run subprocesses)
# =============================================================================================

_collected: Dict[str, list] = {}
_cpu_mode_active = False


def _no_block_size_n(device, head_dim, is_dropout, is_causal):
    raise NotImplementedError(
        "flash_attn_interface._get_block_size_n gives the key-block width of flash_attn's CUDA kernels, by which "
        "flash_attn lays out its S_dmask; flashtile's S_dmask is the whole normalised probability matrix, so no "
        "width applies. Only the dropout cases (out of scope) call it.")


def pytest_configure(config):
    global _cpu_mode_active
    if not os.environ.get("FA_SUITE_MODE"):
        return
    import torch

    if os.environ.get("FA_SUITE_CPU") == "1":
        # The module asks the device's capability at import (is_sm75 / is_sm8x / is_sm80 / is_sm90) and
        # some tests its memory: answer as an 80 GB sm90 does, so the parameters and checks are the H100's.
        import types

        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
            name="CPU (flash_attn_suite --cpu)", major=9, minor=0, total_memory=80 * 2**30, multi_processor_count=132)
        _cpu_mode_active = True
    import flashtile

    flashtile.install_as_flash_attn()
    interface = sys.modules["flash_attn.flash_attn_interface"]
    if not hasattr(interface, "_get_block_size_n"):
        interface._get_block_size_n = _no_block_size_n


def _strip_parametrize(metafunc) -> list:
    definition = metafunc.definition
    marks = list(definition.iter_markers(name="parametrize"))
    definition.own_markers = [m for m in definition.own_markers if m.name != "parametrize"]
    return marks


def _selection() -> dict:
    cached = getattr(_selection, "cached", None)
    if cached is None:
        with open(os.environ["FA_SUITE_SELECTION"]) as f:
            cached = _selection.cached = json.load(f)
    return cached


try:
    import pytest as _pytest_module

    _tryfirst = _pytest_module.hookimpl(tryfirst=True)
    _hookwrapper = _pytest_module.hookimpl(hookwrapper=True)
except Exception:  # the runner itself does not need pytest's hook markers
    def _tryfirst(f):
        return f

    _hookwrapper = _tryfirst


@_tryfirst
def pytest_generate_tests(metafunc):
    mode = os.environ.get("FA_SUITE_MODE")
    if mode not in ("plan", "run"):
        return
    name = metafunc.function.__name__
    if mode == "plan":
        # Expand the parametrize marks as pytest does (same order, same ids), record the cases and
        # leave none behind: building 500k items would take minutes.
        for mark in _strip_parametrize(metafunc):
            metafunc.parametrize(*mark.args, **mark.kwargs)
        argnames = list(metafunc._calls[0].params) if metafunc._calls else []
        _collected[name] = {"argnames": argnames,
                            "cases": [[call.id, [_encode(call.params[a]) for a in argnames]]
                                      for call in metafunc._calls]}
        metafunc._calls = []
        return
    _strip_parametrize(metafunc)
    cases = _selection()["cases"].get(name, [])
    if cases:
        argnames = list(cases[0]["params"])
        metafunc.parametrize(argnames, [tuple(_decode(c["params"][a]) for a in argnames) for c in cases],
                             ids=[c["id"] for c in cases])


def pytest_collection_modifyitems(session, config, items):
    mode = os.environ.get("FA_SUITE_MODE")
    if mode == "plan":
        with open(os.environ["FA_SUITE_PLAN_OUT"], "w") as f:
            json.dump(_collected, f)
        config.hook.pytest_deselected(items=list(items))
        items[:] = []
    elif mode == "run":
        rank = {nodeid_suffix: i for i, nodeid_suffix in enumerate(_selection()["order"])}
        keep = [item for item in items if item.name in rank]
        drop = [item for item in items if item.name not in rank]
        keep.sort(key=lambda item: rank[item.name])  # interleaved across functions (the plan's order)
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep


if os.environ.get("FA_SUITE_CPU") == "1":
    @_hookwrapper
    def pytest_runtest_call(item):
        # The tests put their tensors on device "cuda": on the CPU, every torch call that names a CUDA
        # device gets the CPU instead.
        from torch.overrides import TorchFunctionMode

        class _CudaToCpu(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                device = kwargs.get("device")
                if device is not None and str(device).startswith("cuda"):
                    kwargs = dict(kwargs, device="cpu")
                return func(*args, **kwargs)

        with _CudaToCpu():
            yield


def pytest_runtest_logreport(report):
    path = os.environ.get("FA_SUITE_RESULTS")
    if os.environ.get("FA_SUITE_MODE") != "run" or not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # written once, by the controller (or the only process)
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
              "duration": round(float(getattr(report, "duration", 0.0)), 3)}
    if report.failed:
        crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
        last_lines = str(report.longrepr).strip().splitlines() or [""]
        record["message"] = (crash.message if crash is not None else last_lines[-1])[:1000]
        record["longrepr"] = report.longreprtext[-6000:]
        if report.capstdout:
            record["stdout"] = report.capstdout[-3000:]
    elif report.skipped:
        longrepr = report.longrepr
        record["message"] = str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)[:500]
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# =============================================================================================
# The runner
# =============================================================================================

def _scope(fn: str, params: dict, cpu: bool = False):
    """('out', group) / ('skip', group) / ('eligible', None)."""
    for group, _, predicate in OUT_OF_SCOPE + (OUT_OF_SCOPE_CPU if cpu else []):
        if predicate(fn, params):
            return "out", group
    for group, predicate in UPSTREAM_SKIPS:
        if predicate(fn, params):
            return "skip", group
    return "eligible", None


def _quotas(eligible: Dict[str, int], per_function: int, total: int) -> Dict[str, int]:
    quota = {fn: min(per_function, n) for fn, n in eligible.items()}
    left = total - sum(quota.values())
    while left > 0:
        room = {fn: eligible[fn] - quota[fn] for fn in eligible if eligible[fn] > quota[fn]}
        if not room:
            break
        weights = {fn: math.sqrt(r) for fn, r in room.items()}
        scale = left / sum(weights.values())
        shares = {fn: min(room[fn], int(weights[fn] * scale)) for fn in room}
        given = sum(shares.values())
        if given < left:  # the largest remainders get one more each, then ties by name
            order = sorted(room, key=lambda fn: (-(weights[fn] * scale - int(weights[fn] * scale)), fn))
            for fn in order:
                if given >= left:
                    break
                if shares[fn] < room[fn]:
                    shares[fn] += 1
                    given += 1
        for fn, s in shares.items():
            quota[fn] += s
        left -= given
        if given == 0:
            break
    return quota


def _draw(cases: List[dict], quota: int, rng: random.Random) -> List[dict]:
    order = list(range(len(cases)))
    rng.shuffle(order)
    keys = [{(name, json.dumps(value, sort_keys=True)) for name, value in cases[i]["params"].items()} for i in order]
    uncovered = set().union(*keys) if keys else set()
    chosen, taken = [], [False] * len(order)
    while len(chosen) < quota and uncovered:
        best, best_gain = None, 0
        most = len({name for name, _ in uncovered})  # no case covers more than one value per parameter
        for j, pairs in enumerate(keys):
            if not taken[j]:
                gain = len(pairs & uncovered)
                if gain > best_gain:
                    best, best_gain = j, gain
                    if gain == most:
                        break
        if best is None:
            break
        taken[best] = True
        chosen.append(order[best])
        uncovered -= keys[best]
    for j in range(len(order)):
        if len(chosen) >= quota:
            break
        if not taken[j]:
            taken[j] = True
            chosen.append(order[j])
    return [cases[i] for i in sorted(chosen)]  # in the file's order within the function


def _cases(entry: dict):
    """A function's collected cases ({"argnames", "cases": [[id, values], ...]}) as {"id", "params"} dicts."""
    argnames = entry["argnames"]
    for case_id, values in entry["cases"]:
        yield {"id": case_id, "params": dict(zip(argnames, values))}


def make_plan(collected: Dict[str, dict], per_function: int, total: int, seed: int,
              only: Optional[List[str]] = None, cpu: bool = False) -> dict:
    scope = OUT_OF_SCOPE + (OUT_OF_SCOPE_CPU if cpu else [])
    functions = {}
    eligible_cases = {}
    out_groups = collections.OrderedDict((g, collections.Counter()) for g, _, _ in scope)
    skip_groups = collections.OrderedDict((g, collections.Counter()) for g, _ in UPSTREAM_SKIPS)
    for fn, entry in collected.items():
        counts = {"collected": len(entry["cases"]), "out_of_scope": 0, "upstream_skip": 0, "eligible": 0}
        eligible_cases[fn] = []
        for case in _cases(entry):
            kind, group = _scope(fn, case["params"], cpu)
            if kind == "out":
                counts["out_of_scope"] += 1
                out_groups[group][fn] += 1
            elif kind == "skip":
                counts["upstream_skip"] += 1
                skip_groups[group][fn] += 1
            else:
                counts["eligible"] += 1
                eligible_cases[fn].append(case)
        functions[fn] = counts
    sampled_fns = [fn for fn in functions if not only or fn in only]
    quotas = _quotas({fn: functions[fn]["eligible"] for fn in sampled_fns}, per_function, total)
    cases_out = {}
    for fn in functions:
        chosen = _draw(eligible_cases[fn], quotas[fn], random.Random(f"{seed}/{fn}")) if fn in quotas else []
        cases_out[fn] = chosen
        functions[fn]["sampled"] = len(chosen)
    # Run order: round robin over the functions, so that a run cut short still covers each of them.
    order, queues = [], [[f"{fn}[{c['id']}]" for c in cases_out[fn]] for fn in functions]
    while any(queues):
        for queue in queues:
            if queue:
                order.append(queue.pop(0))
    return {
        "rule": {"seed": seed, "per_function": per_function, "total": total, "only": only or None,
                 "text": "each test function gets min(per_function, eligible); the slots left up to total go "
                         "to the functions in proportion to sqrt(eligible left) (largest remainder, capped); "
                         "within a function a seeded shuffle (random.Random(f'{seed}/{function}')), greedy "
                         "on uncovered (parameter, value) pairs first"},
        "functions": functions,
        "out_of_scope": [{"group": g, "why": why, "count": sum(out_groups[g].values()),
                          "per_function": dict(out_groups[g])} for g, why, _ in scope],
        "upstream_skips": [{"group": g, "count": sum(skip_groups[g].values()), "per_function": dict(skip_groups[g])}
                           for g, _ in UPSTREAM_SKIPS],
        "cases": cases_out,
        "order": order,
    }


def _env(tmp: Path, cpu: bool, **fa_vars) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written beside the upstream file
    if cpu:
        env["FA_SUITE_CPU"] = "1"
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("FA_SUITE_CPU", None)
    for key, value in fa_vars.items():
        env[key] = str(value)
    return env


def _pytest_base(tmp: Path, upstream: Path) -> List[str]:
    return [sys.executable, "-m", "pytest", str(upstream), "-c", str(tmp / "pytest.ini"),
            "--rootdir", str(upstream.parent), "-p", PLUGIN_NAME, "-p", "no:cacheprovider"]


def _collect(tmp: Path, upstream: Path, cpu: bool) -> Dict[str, list]:
    plan_out = tmp / "collected.json"
    cmd = _pytest_base(tmp, upstream) + ["-q", "--collect-only"]
    started = time.time()
    proc = subprocess.run(cmd, env=_env(tmp, cpu, FA_SUITE_MODE="plan", FA_SUITE_PLAN_OUT=plan_out),
                          capture_output=True, text=True)
    if not plan_out.exists():
        sys.stderr.write(proc.stdout[-8000:] + proc.stderr[-8000:])
        raise SystemExit(f"collecting {upstream} failed (pytest exit {proc.returncode}); its output is above")
    with open(plan_out) as f:
        collected = json.load(f)
    print(f"collected {sum(len(e['cases']) for e in collected.values())} cases of {len(collected)} test functions "
          f"in {time.time() - started:.0f} s")
    return collected


def _load_collected(path: Path, upstream: Path) -> Dict[str, dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        saved = json.load(f)
    sha = hashlib.sha256(upstream.read_bytes()).hexdigest()
    if saved.get("sha256") != sha:
        raise SystemExit(f"{path} was collected from another file (sha256 {saved.get('sha256')}, {upstream} has {sha})")
    print(f"collected cases from {path} (saved {saved.get('date')})")
    return saved["functions"]


def _save_collected(path: Path, upstream: Path, collected: Dict[str, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump({"sha256": hashlib.sha256(upstream.read_bytes()).hexdigest(),
                   "date": datetime.datetime.now().isoformat(timespec="seconds"), "functions": collected}, f)
    print(f"collected cases saved to {path}")


def _versions() -> dict:
    import importlib.metadata

    info = {"python": platform.python_version()}
    for dist in ("torch", "triton", "pytest", "pytest-xdist", "einops", "flashtile"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    sys.path.insert(0, str(REPO))
    try:
        from flashtile._version import __version__ as flashtile_version
        from flashtile.compat.flash_attn import VERSION

        info["flashtile"] = flashtile_version  # the tree this runs from, whether or not it is installed
        info["flash_attn (alias)"] = VERSION
    finally:
        sys.path.pop(0)
    return info


def _gpu() -> Optional[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))})"
    except Exception:
        pass
    return None


def _print_plan(plan: dict) -> None:
    fns = plan["functions"]
    width = max(len(fn) for fn in fns)
    print(f"\n{'test function':<{width}}  {'collected':>9}  {'out':>6}  {'up-skip':>7}  {'eligible':>8}  "
          f"{'sampled':>7}")
    for fn, c in fns.items():
        print(f"{fn:<{width}}  {c['collected']:>9}  {c['out_of_scope']:>6}  {c['upstream_skip']:>7}  "
              f"{c['eligible']:>8}  {c['sampled']:>7}")
    tot = {k: sum(c[k] for c in fns.values()) for k in ("collected", "out_of_scope", "upstream_skip", "eligible",
                                                        "sampled")}
    print(f"{'total':<{width}}  {tot['collected']:>9}  {tot['out_of_scope']:>6}  {tot['upstream_skip']:>7}  "
          f"{tot['eligible']:>8}  {tot['sampled']:>7}")
    print("\nout of scope (not sampled):")
    for g in plan["out_of_scope"]:
        print(f"  {g['group']}: {g['count']} cases -- {g['why']}")
    print("upstream skips (the test skips these itself; not sampled):")
    for g in plan["upstream_skips"]:
        print(f"  {g['group']}: {g['count']}")
    print(f"\nsampling: {plan['rule']['text']} (seed {plan['rule']['seed']}, per_function "
          f"{plan['rule']['per_function']}, total {plan['rule']['total']})")


def _run(tmp: Path, upstream: Path, out: Path, plan: dict, workers: int, cpu: bool, time_limit: Optional[float],
         extra: List[str]) -> int:
    selection = tmp / "selection.json"
    with open(selection, "w") as f:
        json.dump({"cases": plan["cases"], "order": plan["order"]}, f)
    results = out / "results.jsonl"
    results.unlink(missing_ok=True)
    cmd = _pytest_base(tmp, upstream) + ["-q", "--tb=short", "-rfE", "--disable-warnings"]
    if workers:
        cmd += ["-n", str(workers)]
    cmd += extra
    print("\n$ " + " ".join(cmd), flush=True)
    log = open(out / "pytest.log", "w")
    proc = subprocess.Popen(cmd, env=_env(tmp, cpu, FA_SUITE_MODE="run", FA_SUITE_SELECTION=selection,
                                          FA_SUITE_RESULTS=results),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def pump():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=time_limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"\n--time-limit {time_limit:.0f} s reached: stopping pytest (process group {proc.pid})", flush=True)
        os.killpg(proc.pid, signal.SIGTERM)  # the group this script started: pytest and its workers
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    log.close()
    return -1 if timed_out else proc.returncode


def _outcomes(results: Path) -> Dict[str, dict]:
    """nodeid -> {"outcome": passed / failed / skipped, "duration", "message", ...} from the phase lines."""
    cases: Dict[str, dict] = {}
    if not results.exists():
        return cases
    with open(results) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            case = cases.setdefault(r["nodeid"], {"outcome": None, "duration": 0.0})
            case["duration"] = round(case["duration"] + r.get("duration", 0.0), 3)
            if r["outcome"] == "failed":
                if case["outcome"] != "failed":
                    case.update(outcome="failed", phase=r["when"], message=r.get("message"),
                                longrepr=r.get("longrepr"), stdout=r.get("stdout"))
            elif r["outcome"] == "skipped" and case["outcome"] is None:
                case.update(outcome="skipped", message=r.get("message"))
            elif r["outcome"] == "passed" and r["when"] == "call" and case["outcome"] is None:
                case["outcome"] = "passed"
    return cases


def _summarize(out: Path, plan: dict, upstream: Path, args, pytest_rc: Optional[int], seconds: float) -> int:
    outcomes = _outcomes(out / "results.jsonl")
    base = "test_flash_attn.py::"
    functions = plan["functions"]
    cases = []
    for fn, chosen in plan["cases"].items():
        for c in chosen:
            nodeid = f"{base}{fn}[{c['id']}]"
            got = outcomes.get(nodeid, {})
            outcome = got.get("outcome") or "not run"
            cases.append(dict({"nodeid": nodeid, "function": fn, "params": c["params"], "outcome": outcome},
                              **{k: v for k, v in got.items() if k != "outcome" and v is not None}))
    for fn, counts in functions.items():
        for key in ("passed", "failed", "skipped", "not run"):
            counts[key] = sum(1 for c in cases if c["function"] == fn and c["outcome"] == key)
    totals = {key: sum(c[key] for c in functions.values()) for key in
              ("collected", "out_of_scope", "upstream_skip", "eligible", "sampled", "passed", "failed", "skipped",
               "not run")}
    exit_code = 1 if totals["failed"] else (2 if totals["not run"] else 0)
    sha = hashlib.sha256(upstream.read_bytes()).hexdigest()
    upstream_info = dict(UPSTREAM, file=str(upstream), sha256_of_file=sha, matches=sha == UPSTREAM["sha256"])
    summary = {
        "upstream": upstream_info, "versions": _versions(),
        "gpu": _gpu() or ("CPU (interpreter)" if args.cpu else None),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "seconds": round(seconds, 1), "pytest_exit": pytest_rc, "exit": exit_code, "sampling": plan["rule"],
        "totals": totals, "functions": functions, "out_of_scope": plan["out_of_scope"],
        "upstream_skips": plan["upstream_skips"], "cases": cases,
    }
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=1)

    lines = [f"# flash-attn's own tests ({UPSTREAM['tag']}, {UPSTREAM['path']}) against flashtile", ""]
    lines.append(f"- upstream: {UPSTREAM['repository']} {UPSTREAM['tag']} ({UPSTREAM['commit'][:12]}), file sha256 "
                 f"{sha[:16]}{'' if upstream_info['matches'] else ' (DIFFERS from the v2.8.3 file)'}")
    lines.append(f"- GPU: {summary['gpu']}; versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()))
    lines.append(f"- command: `{summary['command']}`; {summary['seconds']:.0f} s; pytest exit {pytest_rc}")
    lines.append(f"- sampling: {plan['rule']['text']}; seed {plan['rule']['seed']}, per_function "
                 f"{plan['rule']['per_function']}, total {plan['rule']['total']}"
                 + (f", only {', '.join(plan['rule']['only'])}" if plan["rule"]["only"] else ""))
    lines.append("")
    lines.append(f"**{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped, "
                 f"{totals['not run']} not run** of {totals['sampled']} sampled "
                 f"({totals['eligible']} eligible of {totals['collected']} collected)")
    lines.append("")
    cols = ["collected", "out_of_scope", "upstream_skip", "eligible", "sampled", "passed", "failed", "skipped",
            "not run"]
    lines.append("| test function | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    lines.append("|---|" + "---:|" * len(cols))
    for fn, c in functions.items():
        lines.append(f"| {fn} | " + " | ".join(str(c[k]) for k in cols) + " |")
    lines.append("| **total** | " + " | ".join(str(totals[k]) for k in cols) + " |")
    lines.append("")
    lines.append("Out of scope (not sampled):")
    for g in plan["out_of_scope"]:
        lines.append(f"- {g['group']}: {g['count']} cases. {g['why']}.")
    lines.append("")
    lines.append("Upstream skips (the test skips these combinations itself at its start; not sampled): "
                 + "; ".join(f"{g['group']}: {g['count']}" for g in plan["upstream_skips"]) + ".")
    failed = [c for c in cases if c["outcome"] == "failed"]
    if failed:
        lines += ["", f"## Failures ({len(failed)})", ""]
        for c in failed[:100]:
            lines.append(f"- `{c['nodeid']}`: {c.get('message', '')}")
    skipped = [c for c in cases if c["outcome"] == "skipped"]
    if skipped:
        reasons = collections.Counter(c.get("message", "") for c in skipped)
        lines += ["", "Skipped by the tests at run time: " + "; ".join(f"{n} x {r!r}" for r, n in reasons.items())]
    with open(out / "summary.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return exit_code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=Path, default=REPO / ".upstream/flash_attn/test_flash_attn.py",
                        help="flash-attention v2.8.3's tests/test_flash_attn.py (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="where plan.json, results.jsonl, summary.json/.md and pytest.log "
                        "go (required unless --dry-run)")
    parser.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers (0: none)")
    parser.add_argument("--per-function", type=int, default=20, help="cases each test function gets first")
    parser.add_argument("--total", type=int, default=500, help="cases in all, at least (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", help="sample only this test function (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="collect, sample and print the plan; run nothing")
    parser.add_argument("--list", action="store_true", help="with --dry-run: print every sampled node id")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU through Triton's interpreter, the "
                        "tests' 'cuda' tensors on the CPU (tiny cases only: a check of this harness)")
    parser.add_argument("--time-limit", type=float, help="seconds for the pytest run; then it is stopped and the "
                        "summary written with the rest as not run")
    parser.add_argument("--save-collected", type=Path, help="write the collected cases there (.json or .json.gz) "
                        "for --collected to reuse")
    parser.add_argument("--collected", type=Path, help="reuse cases collected by --save-collected from the same "
                        "file (skips the minute of collection; the sample is the same)")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args(argv)

    upstream = args.upstream.resolve()
    if not upstream.exists():
        parser.error(f"{upstream} does not exist: put flash-attention v2.8.3's tests/test_flash_attn.py there "
                     "(the top of bench/flash_attn_suite.py says how)")
    if not args.dry_run and args.out is None:
        parser.error("--out is required unless --dry-run")
    has_cuda = _gpu() is not None
    if not args.dry_run and not has_cuda and not args.cpu:
        parser.error("no CUDA device: the upstream tests are CUDA-only. Use --dry-run for the plan, or --cpu to "
                     "run (tiny) cases through the interpreter")
    if args.only:
        unknown = [fn for fn in args.only if not fn.startswith("test_")]
        if unknown:
            parser.error(f"--only takes test function names (test_...), got {unknown}")
    cpu = args.cpu or not has_cuda  # a dry run on a CPU machine answers the module's CUDA queries as an sm90

    tmp = Path(tempfile.mkdtemp(prefix="fa_suite_"))
    try:
        shutil.copy(__file__, tmp / f"{PLUGIN_NAME}.py")
        (tmp / "pytest.ini").write_text("[pytest]\n")  # none of this repository's pytest settings
        started = time.time()
        collected = _load_collected(args.collected, upstream) if args.collected else _collect(tmp, upstream, cpu)
        if args.save_collected:
            _save_collected(args.save_collected, upstream, collected)
        if args.only:
            missing = [fn for fn in args.only if fn not in collected]
            if missing:
                parser.error(f"--only: no such test function in {upstream.name}: {missing}")
        plan = make_plan(collected, args.per_function, args.total, args.seed, args.only, cpu=args.cpu)
        _print_plan(plan)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / "plan.json", "w") as f:
                json.dump({k: plan[k] for k in ("rule", "functions", "out_of_scope", "upstream_skips", "cases",
                                                "order")}, f, indent=1)
        if args.dry_run:
            if args.list:
                print("\n".join(f"test_flash_attn.py::{nodeid}" for nodeid in plan["order"]))
            return 0
        rc = _run(tmp, upstream, args.out, plan, args.workers, args.cpu, args.time_limit, args.pytest_args)
        code = _summarize(args.out, plan, upstream, args, rc, time.time() - started)
        if rc not in (0, 1, -1) and code == 0:
            print(f"pytest exited {rc} (not a test failure): see {args.out / 'pytest.log'}")
            return 3
        return code
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
