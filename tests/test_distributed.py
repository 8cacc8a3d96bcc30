"""Context parallelism on flashtile, on 2 ranks: ring-flash-attn over flashtile's flash_attn alias, and
PyTorch's ``context_parallel`` around SDPA with flashtile as its flash implementation.

Each test launches ``tests/distributed_worker.py`` through ``torchrun --standalone --nproc-per-node 2``
as a subprocess (with a timeout), asserts its exit status and reads its JSON: per case, the gathered
out and dq/dk/dv (and lse for ring-flash-attn) against a float64 reference on the full sequence
under FlashAttention's rule (at most 2x PyTorch's same-dtype error + eps; flashtile.testing), next
to single-device flashtile. The worker's per-case table is in the captured output (``-s`` shows it).

On the 2-GPU machine, from the repository root (ring-flash-attn 0.1.8 is a pure-Python wheel in
``.wheels-ring/``; without it the ring tests skip):

    pip install --no-index --no-deps --target /tmp/ring .wheels-ring/*.whl
    PYTHONPATH=/tmp/ring:$PWD python -m pytest -q -rs -s tests/test_distributed.py

One suite by hand (``--suite ring|cp``, ``--device cuda|cpu``, ``--cases`` substrings):

    PYTHONPATH=/tmp/ring:$PWD python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/distributed_worker.py --suite ring --device cuda

Without GPUs: the ring suite runs on gloo with Triton's interpreter on tiny float16 shapes
(~20 s), and the cp suite as a CPU smoke test (flashtile's op kernels registered for the CPU key,
the flash op called directly: see distributed_worker.cp_suite); the GPU tests skip.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import flashtile
from flashtile.runtime import interpreter_problem

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
HAS_RING = importlib.util.find_spec("ring_flash_attn") is not None
TIMEOUT = {"cpu": 300, "cuda": 1800}  # seconds; FLASHTILE_DIST_TIMEOUT overrides

needs_two_gpus = pytest.mark.skipif(
    not TWO_GPUS, reason=f"needs 2 CUDA GPUs (found {torch.cuda.device_count() if torch.cuda.is_available() else 0})")
needs_ring = pytest.mark.skipif(
    not HAS_RING, reason="ring_flash_attn is not installed (pip install --no-index --no-deps --target /tmp/ring "
                         ".wheels-ring/*.whl; PYTHONPATH=/tmp/ring:$PWD)")
INTERPRETER_PROBLEM = interpreter_problem()  # e.g. Triton 3.6.0 with numpy >= 2.3 (a GPU image's)
runs_interpreted = pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=str(INTERPRETER_PROBLEM))
needs_sdpa = pytest.mark.skipif(
    not hasattr(flashtile, "register_sdpa"), reason="flashtile.register_sdpa is missing (flashtile/compat/sdpa.py)")


def run_worker(suite: str, device: str, tmp_path: Path) -> dict:
    """Launch the worker on 2 ranks; return its JSON (pytest.skip if the worker skipped the suite)."""
    if device == "cuda" and not dist.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL")
    if device == "cpu" and not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo")
    result_path = tmp_path / f"{suite}_{device}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           "--suite", suite, "--device", device, "--json", str(result_path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    timeout = int(os.environ.get("FLASHTILE_DIST_TIMEOUT", TIMEOUT[device]))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{suite}/{device} worker timed out after {timeout} s\n{out[-6000:]}\n{err[-6000:]}")
    print(proc.stdout)  # the per-case table
    results = json.loads(result_path.read_text()) if result_path.exists() else None
    assert proc.returncode == 0, (f"{suite}/{device} worker exited {proc.returncode}\n"
                                  f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    assert results is not None, f"the worker wrote no {result_path.name}\n{proc.stdout[-4000:]}"
    if "skipped" in results:
        pytest.skip(results["skipped"])
    return results


def check_results(results: dict) -> None:
    cases = results["cases"]
    assert cases, "the worker ran no cases"
    failed = [c for c in cases if not c["passed"]]
    assert not failed, "failed: " + "; ".join(
        c["case"] + ": " + (c.get("error") or c.get("calls_error") or json.dumps(
            {name: {key: t[key] for key in ("rel_err", "allowed", "single_rel_err")}
             for name, t in c["tensors"].items() if not (t["pass"] and t.get("single_pass", True))} or c.get("lse")))
        for c in failed)


@runs_interpreted
@needs_ring
def test_ring_flash_attn_cpu(tmp_path):
    """ring/zigzag (dense, GQA, odd per-rank length, qkvpacked, varlen) on gloo + Triton's interpreter."""
    check_results(run_worker("ring", "cpu", tmp_path))


@runs_interpreted
@needs_sdpa
def test_context_parallel_sdpa_cpu_smoke(tmp_path):
    """torch's context_parallel ring over flashtile's op kernels (registered for CPU), on gloo."""
    results = run_worker("cp", "cpu", tmp_path)
    check_results(results)
    for case in results["cases"]:
        assert all(fwd > 0 and bwd > 0 for fwd, bwd in case["calls"]), case


@needs_two_gpus
@needs_ring
def test_ring_flash_attn_two_gpus(tmp_path):
    results = run_worker("ring", "cuda", tmp_path)
    assert results["dtype"] == "bfloat16"
    check_results(results)


@needs_two_gpus
@needs_sdpa
def test_context_parallel_sdpa_two_gpus(tmp_path):
    """context_parallel around F.scaled_dot_product_attention, flashtile activated as SDPA's flash impl."""
    results = run_worker("cp", "cuda", tmp_path)
    assert results.get("flash_attention_impl") == "flashtile", results.get("flash_attention_impl")
    check_results(results)
    for case in results["cases"]:
        assert all(fwd > 0 and bwd > 0 for fwd, bwd in case["calls"]), case
