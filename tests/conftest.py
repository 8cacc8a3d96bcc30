"""Test set-up: the same tests run compiled on a GPU, or through Triton's CPU interpreter.

Without CUDA, TRITON_INTERPRET=1 is set here, before anything imports triton, so the
real kernels run on CPU tensors. Shapes and dtypes per device live in ``_cases.py``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FLASHTILE_POISON_OUTPUTS", "1")  # unwritten outputs show up as NaN

import zlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Each test draws its own fresh random inputs, reproducibly per test id (crc32, not hash(): str
    # hashes are salted per process, which made every run, and every xdist worker, draw other inputs).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_report_header(config):
    import triton

    from _cases import INDUCTOR_MISMATCH

    lines = [f"flashtile tests: triton {triton.__version__}, "
             f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU interpreter'}"]
    if INDUCTOR_MISMATCH:
        lines.append(f"torch.compile tests use aot_eager, not inductor: {INDUCTOR_MISMATCH}")
    return lines


def pytest_collection_modifyitems(config, items):
    # FLASHTILE_TEST_SUBSET=N: every test function still runs, with its first case and about 1 / N of the
    # others, picked by a hash of the test id (the same cases every run); =first: the first case alone
    # (CI's second Triton lane).
    subset = os.environ.get("FLASHTILE_TEST_SUBSET", "1")
    every = None if subset == "first" else int(subset)
    if every is not None and every <= 1:
        return
    seen, kept, dropped = set(), [], []
    for item in items:
        function = item.nodeid.split("[")[0]
        if function not in seen or (every is not None and zlib.crc32(item.nodeid.encode()) % every == 0):
            kept.append(item)
        else:
            dropped.append(item)
        seen.add(function)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
