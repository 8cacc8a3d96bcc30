"""The C library (`python -m flashtile export`, flashtile/export/).

CPU: every binding of every exportable entry against the Python host plan it mirrors (captured on
meta tensors), an export built into libflashtile.so and the CMake package, the host-only argument
checks of tests/c/check_errors.c, the examples built against the package. GPU (sm90): the C library
against the Python API on the same inputs, and bad arguments leaving memory untouched."""

import ctypes
import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch

from flashtile.export import bindings
from flashtile.export import entries as export_entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_TOOLS = all(shutil.which(t) for t in ("cmake", "cc", "ar"))


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _check_entries(found) -> list:
    """check_binding over each entry's launches, captured at shapes of several sizes (GQA, MQA, odd
    lengths), with the entry's score options (ALiBi slopes per batch on dense calls)."""
    problems = []
    for e in found:
        for seqlen, nheads, nheads_k in ((1000, 4, 2), (77, 8, 8), (300, 6, 1)):
            call = export_entries.sample_call(e.head_dim, export_entries.DTYPES[e.dtype], e.varlen, seqlen, nheads,
                                              nheads_k)
            q, k, v, out, lse, dout, dq, dk, dv, seqs = call
            alibi = None
            if e.portable:
                params = export_entries.score_params(e.options, e.causal, nheads)
                if "alibi" in e.options:
                    alibi = torch.empty((nheads,) if e.varlen else (q.shape[0], nheads), device="meta")
                    params = dataclasses.replace(params, alibi_slopes=alibi)
                launches = export_entries.capture_portable(e.direction, e.config, params, call)
                window, softcap = (params.window_left, params.window_right), params.softcap
            else:
                launches = export_entries.capture(e.direction, e.config, e.causal, call)
                window, softcap = (-1, -1), 0.0
            assert len(launches) == len(e.bindings), e.name
            fields = bindings.call_fields(q, k, v, out, seqs, dout, dq, dk, dv, softmax_scale=0.125, window=window,
                                          softcap=softcap, alibi=alibi)
            tensors = dict(q=q, k=k, v=v, o=out, lse=lse, do=dout, dq=dq, dk=dk, dv=dv, alibi=alibi,
                           cu_q=seqs.cu_seqlens_q if seqs else None, cu_k=seqs.cu_seqlens_k if seqs else None)
            for binding, launch in zip(e.bindings, launches):
                problems += [f"{e.name} ({seqlen}, {nheads}/{nheads_k}): {p}"
                             for p in bindings.check_binding(binding, launch, fields, tensors)]
    return problems


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_hopper_bindings_match_the_python_plans(dtype):
    """Every argument and grid the C library computes for the Hopper kernels equals what the Python
    plan passes, for each entry of every head dim."""
    found = export_entries.entries([64, 96, 128, 192, 256], [dtype], ["forward", "backward", "varlen"])
    assert not export_entries.missing_ranges(found)
    problems = _check_entries(found)
    assert not problems, "\n".join(problems[:20])


def test_portable_bindings_match_the_python_plans():
    """The same for the portable kernels (windows, softcap, ALiBi; head dims off the Hopper list)."""
    found = export_entries.entries([40, 128], ["bf16"], [f for f in export_entries.FEATURES if f != "kvcache"])
    portable = [e for e in found if e.portable]
    assert len(portable) == (18 + 20) * 5  # option sets x (dense, packed, packed decode forward; 2 backward)
    problems = _check_entries(portable)
    assert not problems, "\n".join(problems[:20])


def _check_kvcache_entries(found) -> list:
    """check_binding over the kv-cache entries' launches at several shapes: GQA, MQA, and for the
    decode entries without options the query heads of a group as the rows of their kv head (the
    strided views the C library, like the Python path, runs the forward on)."""
    problems = []
    for e in found:
        dtype = export_entries.DTYPES[e.dtype]
        for nheads, nheads_k, as_rows in ((4, 2, False), (8, 8, False), (6, 1, False), (8, 2, True)):
            if as_rows and (e.decode != 1 or e.options - {"right"} or e.causal):
                continue
            rows = 1 if e.decode == 1 else 40
            call = export_entries.sample_kvcache_call(e.head_dim, dtype, rows, e.page_size or 256, nheads, nheads_k)
            q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens, block_table = call
            if as_rows:  # kvcache_attention's heads_as_rows views
                group = nheads // nheads_k
                q, out = (t[:, 0].unflatten(1, (nheads_k, group)).transpose(1, 2) for t in (q, out))
                lse = lse[:, :, 0].unflatten(1, (nheads_k, group))
                call = (q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens, block_table)
            params = export_entries.score_params(e.options, e.causal, nheads)
            alibi = None
            if "alibi" in e.options:
                alibi = torch.empty((q.shape[0], q.shape[2]), device="meta")
                params = dataclasses.replace(params, alibi_slopes=alibi)
            launches = export_entries.capture_kvcache(e.config or export_entries.table_config(
                "fwd", "sm90", e.head_dim, False, 4096, dtype), params, call, e.split)
            if e.direction == "kvcache_update":
                launches = launches[:1]
            else:
                launches = launches[1:]
            assert len(launches) == len(e.bindings), e.name
            fields = bindings.kvcache_call_fields(q, k_cache, v_cache, out, lse, k_new, v_new, block_table,
                                                  **_splits(e, block_table.shape[1] * k_cache.shape[1], 3),
                                                  softmax_scale=0.125, window=(params.window_left,
                                                                               params.window_right),
                                                  softcap=params.softcap, alibi=alibi)
            tensors = dict(q=q, k=k_cache, v=v_cache, o=out, lse=lse, knew=k_new, vnew=v_new, alibi=alibi,
                           cache_seqlens=cache_seqlens, block_table=block_table)
            for binding, launch in zip(e.bindings, launches):
                problems += [f"{e.name} ({nheads}/{nheads_k}{' as rows' if as_rows else ''}): {p}"
                             for p in bindings.check_binding(binding, launch, fields, tensors)]
    return problems


def _splits(e, capacity: int, asked: int) -> dict:
    """SplitForward's rule (attention.c has the same): keys per split rounded up to BLOCK_N, and the
    splits that leaves."""
    if not e.split:
        return dict(n_splits=1, keys_per_split=0)
    keys = -(-(-(-capacity // asked)) // e.config.block_n) * e.config.block_n
    return dict(n_splits=-(-capacity // keys), keys_per_split=keys)


def test_kvcache_bindings_match_the_python_plans():
    """The kv-cache call's update, paged forward (decode and more rows, plain and split) and combine."""
    found = export_entries.entries([40, 128], ["bf16"], ["kvcache", "window", "softcap", "alibi"], (16, 256))
    assert len(found) == 2 * (1 + 20 * 2 * 4)  # head dims x (update + option sets x page sizes x 4 forwards)
    problems = _check_kvcache_entries(found)
    assert not problems, "\n".join(problems[:20])


def test_a_wrong_binding_is_caught():
    """The check is not vacuous: a binding that passes the wrong stride is reported."""
    e = export_entries.entries([128], ["bf16"], ["forward"])[0]
    call = export_entries.sample_call(128, torch.bfloat16, False)
    q, k, v, out, lse, dout, dq, dk, dv, seqs = call
    launch = export_entries.capture(e.direction, e.config, e.causal, call)[0]
    fields = bindings.call_fields(q, k, v, out, seqs, softmax_scale=0.125)
    wrong = bindings.Binding(e.bindings[0].kernel, e.bindings[0].grid,
                             {**e.bindings[0].params, "stride_lse_h": "lse_sb"})
    assert any("stride_lse_h" in p for p in bindings.check_binding(wrong, launch, fields, {}))


def test_export_rejects_what_it_cannot_embed(tmp_path):
    from flashtile.tools import export_cmd

    with pytest.raises(SystemExit):
        export_cmd.main(["--head-dims", "64"])  # --out is required
    assert export_cmd.main(["--head-dims", "300", "--out", str(tmp_path)]) == 2
    assert export_cmd.main(["--dtypes", "fp8", "--out", str(tmp_path)]) == 2
    assert export_cmd.main(["--features", "dropout", "--out", str(tmp_path)]) == 2
    assert export_cmd.main(["--arch", "sm80", "--out", str(tmp_path)]) == 2


def _export_dir(tmp_path_factory, head_dims, dtypes, features) -> str:
    """An export: FLASHTILE_EXPORT_DIR when set (a prebuilt one, e.g. carried to a GPU machine),
    else a fresh one."""
    prebuilt = os.environ.get("FLASHTILE_EXPORT_DIR")
    if prebuilt:
        return prebuilt
    out = str(tmp_path_factory.mktemp("export"))
    # A process of its own: compiling needs the real Triton, not the interpreter the CPU tests run.
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "flashtile", "export", "--head-dims", ",".join(map(str, head_dims)),
                          "--dtypes", ",".join(dtypes), "--features", ",".join(features), "--jobs", "2", "--out", out],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    if not HAVE_TOOLS:
        pytest.skip("needs cmake, cc and ar")
    return _export_dir(tmp_path_factory, [64], ["bf16"], ["forward", "backward", "varlen", "kvcache"])


def _cmake_build(source: str, build: str, export_dir: str) -> None:
    subprocess.run(["cmake", "-S", source, "-B", build, f"-Dflashtile_DIR={export_dir}/lib/cmake/flashtile",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True, text=True)
    subprocess.run(["cmake", "--build", build, "-j", "2"], check=True, capture_output=True, text=True)


def test_export_writes_a_library_and_a_cmake_package(small_export):
    for path in ("include/flashtile.h", "lib/libflashtile.so", "lib/libflashtile_static.a",
                 "lib/cmake/flashtile/flashtileConfig.cmake", "lib/cmake/flashtile/flashtileConfigVersion.cmake",
                 "share/flashtile/manifest.json", "share/flashtile/examples/CMakeLists.txt"):
        assert os.path.exists(os.path.join(small_export, path)), path
    lib = ctypes.CDLL(os.path.join(small_export, "lib", "libflashtile.so"))
    lib.flashtile_build_info.restype = ctypes.c_char_p
    info = lib.flashtile_build_info().decode()
    assert "head dims: 64" in info and "sm90" in info
    exported = subprocess.run(["nm", "-D", "--defined-only", os.path.join(small_export, "lib", "libflashtile.so")],
                              capture_output=True, text=True).stdout
    symbols = {line.split()[-1] for line in exported.splitlines() if " T " in line}
    assert symbols == {"flashtile_attention_args_init", "flashtile_attention_forward",
                       "flashtile_attention_forward_workspace_size", "flashtile_attention_backward",
                       "flashtile_attention_backward_workspace_size", "flashtile_kvcache_args_init",
                       "flashtile_kvcache_forward", "flashtile_kvcache_forward_workspace_size",
                       "flashtile_status_string", "flashtile_last_error", "flashtile_build_info"}


def test_argument_checks_from_c(small_export, tmp_path):
    """tests/c/check_errors.c, built with CMake against the package: every bad argument gets its
    status and a message naming it, on a machine without a GPU too."""
    _cmake_build(os.path.join(ROOT, "tests", "c"), str(tmp_path / "build"), small_export)
    run = subprocess.run([str(tmp_path / "build" / "check_errors")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in run.stdout


def test_examples_build_against_the_package(small_export, tmp_path):
    if not (os.path.exists("/usr/local/cuda/include/cuda_runtime.h") or os.environ.get("CUDA_HOME")):
        pytest.skip("the examples use the CUDA runtime: no CUDA toolkit here")
    # The copy the export ships (examples/c in this checkout, the wheel's copy when installed).
    _cmake_build(os.path.join(small_export, "share", "flashtile", "examples"), str(tmp_path / "build"), small_export)
    for name in ("mha_fwd_bwd", "varlen_inference"):
        assert os.access(tmp_path / "build" / name, os.X_OK)


# ------------------------------------------------------------------------------------------------
# On an sm90 GPU


@pytest.fixture(scope="module")
def gpu_export(tmp_path_factory):
    if not _sm90():
        pytest.skip("needs an sm90 GPU")
    if not HAVE_TOOLS:
        pytest.skip("needs cmake, cc and ar")
    from flashtile.export.capi import Library

    return Library(_export_dir(tmp_path_factory, [64, 128], ["bf16", "fp16"],
                               ["forward", "backward", "varlen", "kvcache"]))


@pytest.mark.parametrize("case", [
    (2, 1024, 1024, 8, 8, 128, True, None), (2, 1023, 1023, 8, 2, 128, False, None),
    (1, 113, 1023, 4, 1, 64, True, None), (2, 1, 1023, 8, 8, 64, False, None),
    (8, 1024, 1024, 8, 2, 128, True, [1, 113, 1023, 517, 64, 2000]),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_library_matches_the_python_api(gpu_export, case, dtype):
    from flashtile.export.compare import check_case

    b, sq, sk, h, hk, d, causal, lengths = case
    result = check_case(gpu_export, b, sq, sk, h, hk, d, dtype, causal, lengths)
    assert result["ok"], result


def test_bad_arguments_leave_memory_untouched(gpu_export):
    from flashtile.export.capi import CError

    q, k, v = (torch.randn(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, 7.0)
    lse = torch.full((2, 4, 256), 3.0, device="cuda")
    storage = torch.randn(q.numel() + 8, device="cuda", dtype=torch.bfloat16)
    bad = {
        "q misaligned": dict(q=torch.as_strided(storage, q.shape, q.stride(), 1)),
        "head dim 96 not exported": dict(q=q[..., :96], k=k[..., :96], v=v[..., :96]),
    }
    for what, change in bad.items():
        t = {**dict(q=q, k=k, v=v), **change}
        o = out if t["q"].shape == q.shape else out[..., :96]
        a = gpu_export.args(t["q"], t["k"], t["v"], o, lse, causal=True)
        with pytest.raises(CError):
            gpu_export.forward(a)
        torch.cuda.synchronize()
        assert bool((out == 7.0).all()) and bool((lse == 3.0).all()), what
    a = gpu_export.args(q, k, v, out, lse, causal=True)
    a.window_left = 64
    with pytest.raises(CError, match="window"):
        gpu_export.forward(a)
    a = gpu_export.args(q, k, v, out, None, causal=True)
    size = ctypes.c_size_t()
    gpu_export.lib.flashtile_attention_forward_workspace_size(ctypes.byref(a), ctypes.byref(size))
    assert size.value > 0
    ws = torch.empty(size.value, dtype=torch.uint8, device="cuda")
    status = gpu_export.lib.flashtile_attention_forward(ctypes.byref(a), ctypes.c_void_p(ws.data_ptr()),
                                                         ctypes.c_size_t(size.value - 1), None)
    assert status == 4 and "workspace" in gpu_export.last_error()
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_kvcache_matches_the_python_api(gpu_export, case, dtype):
    """The kv-cache call: decoding (GQA heads as rows, automatic splits), MQA, speculative rows, a
    prefill chunk, no new tokens with 3 splits; the caches bitwise equal after the append."""
    from flashtile.export.compare import KVCACHE_CASES, check_kvcache_case

    b, sq, new, h, hk, d, causal, splits = KVCACHE_CASES[case]
    result = check_kvcache_case(gpu_export, b, sq, new, h, hk, d, dtype, causal, num_splits=splits)
    assert result["ok"], result


def test_bad_kvcache_arguments_leave_the_cache_untouched(gpu_export):
    from flashtile.export.capi import CError

    k_cache, v_cache = (torch.randn(8, 256, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    saved = k_cache.clone(), v_cache.clone()
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    lens = torch.tensor([10, 1000], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, 7.0)
    k_new = torch.randn(2, 1025, 2, 128, device="cuda", dtype=torch.bfloat16)
    bad = {
        "seqlen_new over capacity": dict(k=k_new, v=k_new),
        "page size not exported": dict(k_cache=k_cache.view(16, 128, 2, 128), v_cache=v_cache.view(16, 128, 2, 128)),
        "head dim 96 not exported": dict(q=q[..., :96], k_cache=k_cache[..., :96], v_cache=v_cache[..., :96]),
    }
    for what, change in bad.items():
        t = {**dict(q=q, k_cache=k_cache, v_cache=v_cache, k=None, v=None), **change}
        o = out if t["q"].shape == q.shape else out[..., :96]
        a = gpu_export.kvcache_args(t["q"], t["k_cache"], t["v_cache"], o, lens, table, t["k"], t["v"], causal=True)
        with pytest.raises(CError):
            gpu_export.kvcache_forward(a)
        torch.cuda.synchronize()
        assert bool((out == 7.0).all()) and torch.equal(k_cache, saved[0]) and torch.equal(v_cache, saved[1]), what
    # Past the capacity on the device (cache_seqlens + seqlen_new > max_pages_per_seq * page_size): the
    # keys that do not fit are dropped, no other sequence's page is written.
    lens = torch.tensor([1020, 100], dtype=torch.int32, device="cuda")
    k_new = torch.randn(2, 8, 2, 128, device="cuda", dtype=torch.bfloat16)
    a = gpu_export.kvcache_args(q, k_cache, v_cache, out, lens, table, k_new, k_new, causal=True)
    gpu_export.kvcache_forward(a)
    torch.cuda.synchronize()
    assert torch.equal(k_cache[3, 252:], k_new[0, :4])  # positions 1020..1023 of sequence 0 (its last page)
    assert torch.equal(k_cache[4, 100:108], k_new[1])
    # Sequence 0's other 4 tokens would have gone to the next row of the block table (page 4, rows 0..3).
    assert torch.equal(k_cache[:3], saved[0][:3]) and torch.equal(k_cache[4, :100], saved[0][4, :100])
    assert torch.equal(k_cache[5:], saved[0][5:])
    assert bool(out.isfinite().all())
