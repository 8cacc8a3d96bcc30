"""`python -m flashtile inspect` (flashtile/tools/inspect.py) and its kernel catalog (tools/catalog.py).

The catalog is checked in-process, without compiling: every variant the sm90 tables can launch,
captured from the real host plans. Compiling needs Triton's compiler, not its interpreter (which
conftest.py turns on without a GPU), so those tests run the command in a child process without
TRITON_INTERPRET: one portable forward (fields, histogram, --map, --compare of two cheap named
configs), one Gluon forward, and the --all / --compare-reports report format on four tiny
preprocess kernels. About 30 s on a 2-core CPU.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flashtile.configs import BWD_GLUON, FWD, FWD_GLUON, GLUON_CANDIDATES, table_config
from flashtile.tools import catalog, inspect

# A d64 call the sliding window keeps on the portable forward (and its autotune candidates' names).
# Dropout keeps a call on the portable kernels (the Hopper forward takes the window alone).
PORTABLE_CALL = ["--shape", "1,256,2,64", "--window", "32,0", "--dropout", "0.1"]
PORTABLE_CONFIGS = ("m64_n64_w4_s3", "m128_n64_w4_s3_tma")
# What the tool itself asks: whether explain sends this call to the Gluon forward on sm90.
GLUON_CALL = catalog.CallSpec(1, 1024, 4, 128)
needs_gluon = pytest.mark.skipif(GLUON_CALL.explain().forward.path != "hopper",
                                 reason="this Triton cannot build the Gluon kernels")


def _inspect(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "flashtile", "inspect", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# ----------------------------------------------------------------------------------------------
# The catalog (no compiling)


def test_catalog_covers_every_table_config():
    rows = catalog.catalog()
    keys = [row.key for row in rows]
    assert len(keys) == len(set(keys)), "the report keys (family, d, causal, variant) must be unique"
    families = {family: [row for row in rows if row.family == family] for family in catalog.FAMILIES}
    # Per head dim and mask: 14 portable forward launches; 3 backward kernels dense, packed, with mods,
    # with an attn_bias and with values of half the head dim.
    assert len(families["portable-fwd"]) == 3 * 2 * 14 and len(families["portable-bwd"]) == 3 * 2 * 15
    for family, kernel in (("gluon-fwd", FWD_GLUON), ("gluon-bwd", BWD_GLUON)):
        for d in (64, 128, 256):
            for causal in (False, True):
                for varlen in (False, True):
                    for sk in catalog.SEQLENS:
                        cfg = table_config(kernel, "sm90", d, causal, sk, torch.bfloat16, varlen)
                        if cfg is None:
                            continue
                        layout = "varlen" if varlen else "dense"
                        assert any(row.head_dim == d and row.causal == causal and row.variant.startswith(layout)
                                   and row.config == repr(cfg) for row in families[family]), (family, d, causal, sk)
    expected = {"gluon-fwd": {"gluon_attn_fwd_kernel"},
                "gluon-bwd": {"gluon_attn_bwd_kernel", "gluon_attn_bwd_d256_kernel",
                              "gluon_attn_bwd_persistent_kernel"},
                "portable-fwd": {"attn_fwd_kernel", "attn_combine_kernel", "kvcache_update_kernel"},
                "portable-bwd": {"attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"}}
    for family, members in families.items():
        names = {row.launch().name for row in members}
        assert names <= expected[family] and names, (family, names)
    d256 = next(row for row in families["gluon-bwd"] if row.head_dim == 256).launch()
    assert d256.name == "gluon_attn_bwd_d256_kernel" and d256.kwargs["HEAD_DIM_TRUE"] == 256


def test_catalog_candidates_add_every_gluon_candidate():
    base = catalog.catalog([128], families=["gluon-fwd"])
    more = catalog.catalog([128], families=["gluon-fwd"], with_candidates=True)
    names = GLUON_CANDIDATES[FWD_GLUON][128]
    assert len(more) - len(base) == 2 * 2 * len(names)  # full and causal, dense and packed
    assert {row.config for row in more if not row.config.startswith("GluonFwdConfig(")} == set(names)


def test_call_launches_follow_explain():
    spec = catalog.CallSpec(2, 1024, 8, 128, nheads_k=2, causal=True)
    explanation = spec.explain()
    fwd = catalog.call_launches(spec, "fwd")
    assert fwd.path == explanation.forward.path and fwd.config == explanation.forward.config
    bwd = catalog.call_launches(spec, "bwd")
    assert [launch.part for launch in bwd.launches][0] == "preprocess"
    if bwd.path == "hopper":
        assert [launch.part for launch in bwd.launches] == ["preprocess", "bwd", "convert"]
        assert bwd.launches[1].kwargs["CAUSAL"] is True
    # Dropout keeps a call on the portable kernels (the Hopper ones take the window alone).
    window = catalog.CallSpec(1, 256, 2, 64, window=(32, 0), dropout_p=0.1)
    found = catalog.call_launches(window, "bwd", config="block_m=32", part="dq")
    assert found.path == "portable" and found.kernel == "bwd_dq" and found.config.block_m == 32
    assert found.launches[2].kwargs["BLOCK_M"] == 32
    with pytest.raises(ValueError, match="no bwd_dq config named"):
        catalog.call_launches(window, "bwd", config="nonesuch", part="dq")


def test_histogram_families_and_ptx_keys():
    sass = """
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;   /* 0x0 */
        /*0010*/               @P0 MUFU.EX2 R3, R4 ;
        /*0020*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0030*/                   SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4], RZ ;
        /*0040*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*0050*/                   FOO R1 ;
"""
    assert inspect.sass_histogram(sass) == {"HGMMA (wgmma)": 1, "MUFU (ex2, rcp, ...)": 1,
                                            "TMA (UTMALDG/UTMASTG/UBLKCP)": 1,
                                            "BAR/SYNCS (barriers, mbarrier, fences)": 1,
                                            "integer/address (IMAD/IADD3/LOP3/...)": 1, "other": 1}
    assert [inspect.ptx_key(op) for op in ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                                           "ex2.approx.ftz.f32", "ld.shared.v4.b32", "add.s32",
                                           "cp.async.bulk.tensor.2d.shared::cluster.global")] == \
        ["wgmma.mma_async", "ex2.approx", "ld.shared", "add", "cp.async.bulk"]


def test_bad_arguments_exit_2(capsys):
    assert inspect.main([]) == 2
    assert "give --shape" in capsys.readouterr().err
    assert inspect.main(["--shape", "1,64,2,64", "--compare", "a", "b", "--config", "c"]) == 2
    assert inspect.main(["--all", "--families", "nonesuch"]) == 2
    with pytest.raises(SystemExit) as stop:
        inspect.main(["--shape", "1,64,2"])
    assert stop.value.code == 2


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter is off")
def test_refuses_to_compile_interpreted_kernels(capsys):
    assert inspect.main([*PORTABLE_CALL]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Compiling (child processes without the interpreter)


def test_portable_forward_report_map_and_json(tmp_path):
    report = tmp_path / "report.json"
    done = _inspect(*PORTABLE_CALL, "--map", "ex2", "--json", str(report), "--ptx", str(tmp_path / "k.ptx"))
    assert done.returncode == 0, done.stderr
    found = json.loads(report.read_text())
    assert found["path"] == "portable" and "dropout" in found["reason"]
    s = found["summary"]
    cfg = table_config(FWD, "sm90", 64, False, 256, torch.bfloat16)
    assert s["kernel"] == "attn_fwd_kernel" and s["threads"] == 32 * cfg.num_warps
    assert s["grid"] == [256 // cfg.block_m, 2, 1]
    assert s["regs"] > 0 and s["shared"] > 0 and s["sass_lines"] > 100 and re.fullmatch(r"[0-9a-f]{12}", s["ptx_sha1"])
    assert found["sass_histogram"]["HGMMA (wgmma)"] > 0 and found["sass_histogram"]["MUFU (ex2, rcp, ...)"] > 0
    assert found["ptx_histogram"]["ex2.approx"] > 0
    assert "SASS instructions by family:" in done.stdout and "PTX instructions" in done.stdout
    # --map: the matching PTX per source line and the SASS of that line, or a clear message.
    mapped = done.stdout.split("'ex2':", 1)
    if len(mapped) == 2:
        assert "PTX" in mapped[1] and "MUFU.EX2" in mapped[1] and "flashtile/kernels/portable/" in mapped[1]
    else:
        assert "line info unavailable" in done.stdout
    assert "ex2.approx" in (tmp_path / "k.ptx").read_text()


def test_compare_two_named_configs():
    done = _inspect(*PORTABLE_CALL, "--compare", *PORTABLE_CONFIGS)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"A: {PORTABLE_CONFIGS[0]}" in out and f"B: {PORTABLE_CONFIGS[1]}" in out
    grid = next(line for line in out.splitlines() if line.strip().startswith("grid"))
    assert "[4, 2, 1]" in grid and "[2, 2, 1]" in grid  # 64- against 128-row query tiles of 256 rows
    assert "SASS instructions by family:" in out and "B - A" in out
    bad = _inspect(*PORTABLE_CALL, "--config", "nonesuch")
    assert bad.returncode == 2 and "no fwd config named 'nonesuch'" in bad.stderr and PORTABLE_CONFIGS[0] in bad.stderr


@needs_gluon
def test_gluon_forward():
    done = _inspect("--shape", "1,1024,4,128", "--json", "-")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["path"] == "hopper" and found["summary"]["kernel"] == "gluon_attn_fwd_kernel"
    cfg = table_config(FWD_GLUON, "sm90", 128, False, 1024, torch.bfloat16)
    assert found["summary"]["threads"] == 128 * (cfg.num_consumers + 1)
    for family in ("HGMMA (wgmma)", "TMA (UTMALDG/UTMASTG/UBLKCP)", "BAR/SYNCS (barriers, mbarrier, fences)"):
        assert found["sass_histogram"].get(family, 0) > 0, family
    assert found["ptx_histogram"]["wgmma.mma_async"] > 0


def test_all_report_and_compare_reports(tmp_path):
    first = tmp_path / "a.json"
    done = _inspect("--all", "--head-dims", "64", "--families", "portable-bwd", "--match",
                    "(dense|varlen)/preprocess",
                    "--json", str(first))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("4 kernels compiled for sm90 with triton")
    report = json.loads(first.read_text())
    assert set(report) == {"triton", "ptxas", "kernels"} and len(report["kernels"]) == 4
    needed = {"shared", "regs", "spill_stores", "spill_loads", "sass_lines", "sass_sha1", "ptx_sha1", "family",
              "head_dim", "causal", "variant", "config"}
    for row in report["kernels"]:
        assert needed <= set(row), needed - set(row)
    # A second "version": other registers for one row, a failed compile for another.
    other = dict(report, triton="9.9.9")
    other["kernels"] = [dict(row) for row in report["kernels"]]
    other["kernels"][0]["regs"] = 99
    other["kernels"][1] = {key: other["kernels"][1][key] for key in ("family", "head_dim", "causal", "variant",
                                                                      "config")} | {"error": "boom"}
    second = tmp_path / "b.json"
    second.write_text(json.dumps(other))
    table = _inspect("--compare-reports", str(first), str(second))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines[0] == (f"| kernel | d | mask | variant | {report['triton']} regs spill st/ld | "
                        "9.9.9 regs spill st/ld |")
    assert len(lines) == 2 + 4
    row0 = report["kernels"][0]
    assert lines[2] == (f"| portable-bwd | 64 | full | dense/preprocess | {row0['regs']} "
                        f"{row0['spill_stores']}/{row0['spill_loads']} | 99 {row0['spill_stores']}/"
                        f"{row0['spill_loads']} |")
    assert lines[3].endswith("| FAILED |")


def test_packed_decode_over_one_page_compiles():
    # A block table of one column: specialized seq_pages = 1 crashed Triton 3.6.0's ptxas at head dim 32.
    done = _inspect("--all", "--head-dims", "32", "--families", "portable-fwd", "--match", "decode-pack-gqa-paged")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("2 kernels compiled for sm90 with triton")
