"""The version layer (flashtile/triton_compat.py): the Triton in use is in range, the Gluon names it
picks are builtins of this Triton, host descriptors and launch options, Gluon's status, and the
interpreter's numpy guard. CI runs this file against the oldest and the newest supported Triton."""

import sys

import torch
import triton

from flashtile import runtime, triton_compat
from flashtile.kernels import plans
from flashtile.kernels.hopper import status as hopper_status


def test_version_parsing_and_range():
    assert triton_compat.parse_version("3.9.0") == (3, 9, 0)
    assert triton_compat.parse_version("3.7.1+git1234") == (3, 7, 1)
    assert triton_compat.parse_version("3.10") == (3, 10, 0)
    assert triton_compat.version_supported((3, 6, 0)) and triton_compat.version_supported((3, 9, 5))
    assert not triton_compat.version_supported((3, 5, 1)) and not triton_compat.version_supported((3, 10, 0))
    assert triton_compat.VERSION == triton_compat.parse_version(triton.__version__)
    assert triton_compat.version_supported(), f"CI runs Triton {triton.__version__}, outside {triton_compat.SUPPORTED}"


def test_pyproject_range_matches_the_layer():
    """pyproject's triton requirement and SUPPORTED name the same releases."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    low, high = re.search(r'"triton>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    (lo_major, lo_minor), (hi_major, hi_minor) = triton_compat.SUPPORTED
    assert low == f"{lo_major}.{lo_minor}" and high == f"{hi_major}.{hi_minor + 1}"


def test_gluon_names_are_builtins_of_this_triton():
    """Each name resolves to a Gluon builtin (so calling it inside a kernel emits the IR the direct
    call would), and never to a name this Triton keeps only to raise (3.9's old TMA names)."""
    for name in ("barrier", "tma_load", "tma_store", "tma_reduce_add", "reinterpret"):
        fn = getattr(triton_compat, name)
        assert getattr(fn, "__triton_builtin__", False), name
    from triton.experimental.gluon.language.nvidia.hopper import tma

    if hasattr(tma, "async_load"):  # 3.8 on
        assert triton_compat.tma_load is tma.async_load and triton_compat.tma_store is tma.async_store
    else:
        assert triton_compat.tma_load is tma.async_copy_global_to_shared


def test_gluon_status_on_this_triton():
    available, reason = hopper_status.gluon_status()
    assert available, reason
    assert triton.__version__ in reason


def test_gluon_status_names_the_failure(monkeypatch):
    """A Triton whose Gluon lacks a name the kernels use: the status says why (dispatch then warns
    once and keeps to the portable kernels; tests/test_env.py covers that side)."""
    import flashtile.kernels

    hopper_status.gluon_status.cache_clear()
    import flashtile.kernels.hopper

    monkeypatch.setitem(sys.modules, "flashtile.kernels.hopper.forward", None)  # import fails
    monkeypatch.delattr(flashtile.kernels.hopper, "forward", raising=False)
    try:
        available, reason = hopper_status.gluon_status()
        assert not available
        assert triton.__version__ in reason and "hopper.forward" in reason
    finally:
        hopper_status.gluon_status.cache_clear()


def test_host_descriptors_keep_their_fields():
    t = torch.empty(2, 64, 4, 32, dtype=torch.float16)
    desc = triton_compat.tensor_descriptor(t, list(t.shape), list(t.stride()), [1, 16, 1, 32])
    assert desc.base is t and desc.block_shape == [1, 16, 1, 32] and desc.padding == "zero"
    # Fields later releases added keep their class defaults (3.7's round_f32_to_tf32).
    for field in getattr(type(desc), "__dataclass_fields__", {}):
        getattr(desc, field)


def test_every_launch_passes_the_launch_options():
    """CompiledCall (every planned launch) adds LAUNCH_OPTIONS: FP fusion on, whatever the default
    of the Triton in use."""
    from flashtile.kernels.portable.backward import attn_bwd_preprocess_kernel

    assert triton_compat.LAUNCH_OPTIONS == {"enable_fp_fusion": True}
    names = plans._signature(attn_bwd_preprocess_kernel).names
    call = plans.CompiledCall(attn_bwd_preprocess_kernel, (1,), [0] * len(names), {"num_warps": 4}, slots=())
    assert call.options == {"enable_fp_fusion": True, "num_warps": 4}


def test_interpreter_numpy_guard(monkeypatch):
    """Triton 3.6's interpreter with numpy >= 2.3 computes loop bounds wrongly: a clear error, not a
    wrong answer. Later Tritons, or numpy < 2.3, pass."""
    import numpy

    cases = [((3, 6, 0), "2.3.0", True), ((3, 6, 0), "2.2.6", False), ((3, 7, 1), "2.4.0", False),
             ((3, 9, 0), "2.5.2", False)]
    for version, numpy_version, broken in cases:
        runtime.interpreter_problem.cache_clear()
        monkeypatch.setattr(triton_compat, "VERSION", version)
        monkeypatch.setattr(numpy, "__version__", numpy_version)
        problem = runtime.interpreter_problem()
        assert (problem is not None) == broken, (version, numpy_version)
        if broken:
            assert "numpy<2.3" in problem and numpy_version in problem
    runtime.interpreter_problem.cache_clear()
