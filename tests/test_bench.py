"""`python -m flashtile bench dense|varlen|decode|options` (flashtile/tools/bench/) without a GPU.

The timing paths need CUDA; what runs here is everything around them: argument parsing (sizes
such as 1k, flags a mode would ignore), the output folder and its guard, the checks against the
reference through --interpret-smoke (tiny shapes, CPU interpreter, seconds), the files written, and
the optional FlashAttention-4 anchor both absent and (mocked) present. In-process smoke runs need
the interpreter already on (conftest.py turns it on without CUDA); one subprocess run works anywhere.
"""

import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from flashtile.runtime import interpreter_problem
from flashtile.tools import bench
from flashtile.tools.bench import anchors, common, dense, host, report

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="in-process smoke runs need TRITON_INTERPRET=1")


def _absent(monkeypatch):
    """FA4 reported missing, whatever this machine has."""
    monkeypatch.setattr(anchors, "fa4", lambda: anchors.Availability(None, "not available: ModuleNotFoundError: "
                                                                           "No module named 'flash_attn'"))


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("1024", 1024), ("1k", 1024), ("16k", 16384), ("16K", 16384), ("2m", 2**21)])
def test_sizes_take_suffixes(text, value):
    assert common.parse_size(text) == value
    assert common.size_list(f"{text},64") == [value, 64]


@pytest.mark.parametrize("argv,flag,bad", [(["dense", "--seqlens", "1k,4x"], "--seqlens", "'4x'"),
                                           (["dense", "--seqlen-q", "0"], "--seqlen-q", "'0'"),
                                           (["decode", "--cache-lens", "k"], "--cache-lens", "'k'")])
def test_bad_sizes_name_the_flag(capsys, argv, flag, bad):
    err = _error(capsys, argv)
    assert f"argument {flag}" in err and bad in err and "1k or 16k" in err


@pytest.mark.parametrize("argv,flags", [(["decode", "--modes", "fwd"], "--modes"),
                                        (["varlen", "--batches", "3", "--seqlens", "1k"], "--batches --seqlens"),
                                        (["dense", "--cache-lens=8k"], "--cache-lens=8k")])
def test_flags_a_mode_ignores_are_rejected(capsys, argv, flags):
    err = _error(capsys, argv)
    assert f"bench {argv[0]}: error: {argv[0]} does not take {flags}" in err
    assert f"bench {argv[0]} --help" in err


def test_a_mode_is_required_and_help_lists_them(capsys):
    assert "required" in _error(capsys, [])
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("dense", "varlen", "decode", "--interpret-smoke", "not available"))


@pytest.mark.parametrize("argv,message", [
    (["dense", "--heads", "6", "--heads-k", "4"], "--heads-k 4 does not divide 6 query heads"),
    (["dense", "--interpret-smoke", "--seqlens", "16k"], "sizes above 512"),
    (["varlen", "--min-len", "4k", "--max-len", "1k"], "--min-len 4096 is larger than --max-len 1024"),
    (["decode", "--cache-lens", "1000"], "not a multiple of --page 256"),
    (["decode", "--rounds", "0"], "--rounds must be at least 1, got 0"),
])
def test_impossible_runs_are_refused_before_any_work(capsys, argv, message):
    assert message in _error(capsys, argv)


def test_results_never_go_inside_the_package(capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="refusing to write results"):
        common.check_out_dir(common.PACKAGE_DIR / "results")
    assert common.check_out_dir(tmp_path / "out") == (tmp_path / "out").resolve()
    err = _error(capsys, ["dense", "--out", str(common.PACKAGE_DIR / "tools" / "x")])
    assert "refusing to write results" in err and "pass --out" in err
    monkeypatch.chdir(tmp_path)
    default = common.default_out_dir("dense", "NVIDIA H100 80GB HBM3")
    assert default.parent == tmp_path / common.OUT_ROOT_NAME and default.name.endswith("-dense-nvidia-h100-80gb-hbm3")


def test_visible_pairs_count_bottom_right_causal():
    for sq, sk in ((1, 64), (32, 64), (64, 64), (96, 64), (7, 5)):
        brute = sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)
        expected = sq * sk / 2 if sq == sk else brute  # square: the committed numbers' convention
        assert dense.visible_pairs(sq, sk, True) == expected
        assert dense.visible_pairs(sq, sk, False) == sq * sk
    config = dense.AttnConfig(batch=2, seqlen=1024, nheads=8, headdim=64, causal=False, seqlen_q=1, nheads_k=2)
    assert dense.flops(config, "fwd_bwd") == 3.5 * 4 * 2 * 8 * 64 * 1024


def test_reference_handles_gqa_and_more_queries_than_keys():
    q, dout = torch.randn(2, 12, 4, 16), torch.randn(2, 12, 4, 16)
    k, v = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    got = dense.reference(q, k, v, causal=True, dout=dout, chunk_bytes=1)
    assert {name: tuple(t.shape) for name, t in got.items()} == {
        "out": (2, 12, 4, 16), "dq": (2, 12, 4, 16), "dk": (2, 8, 2, 16), "dv": (2, 8, 2, 16)}
    assert all(torch.isfinite(t).all() for t in got.values())
    assert got["out"][:, :4].abs().max() == 0  # the first sq - sk queries see no key
    # Against autograd through the expanded heads and an explicit mask.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(2, dim=2).transpose(1, 2) for t in leaves[1:])
    scores = leaves[0].transpose(1, 2) @ kk.transpose(-1, -2) * 16**-0.5
    mask = torch.ones(12, 8, dtype=torch.bool).triu(8 - 12 + 1)
    probs = torch.softmax(scores.masked_fill(mask, -1e9), -1) * (~mask.all(-1, keepdim=True))
    out = (probs @ vv).transpose(1, 2)
    grads = torch.autograd.grad(out, leaves, dout)
    for name, want in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        torch.testing.assert_close(got[name], want.detach(), atol=1e-5, rtol=1e-5)


def test_fa4_probe_never_raises(monkeypatch):
    anchors.fa4.cache_clear()
    try:
        found = anchors.fa4()
        assert found.status.startswith("available (") == found.available
        assert found.available or found.status.startswith("not available: ")
        anchors.fa4.cache_clear()
        monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import fails with ImportError
        found = anchors.fa4()
        assert not found.available and found.status.startswith("not available: ") and "flash_attn.cute" in found.status
    finally:
        anchors.fa4.cache_clear()
    assert anchors.fa4_output(("out", "lse")) == "out" and anchors.fa4_output("out") == "out"


def test_table_reports_ratios_to_each_anchor():
    def rec(system, tflops, seqlen):
        return dense.Record(system=system, headdim=128, causal=True, seqlen=seqlen, seqlen_q=seqlen, batch=1,
                            nheads=16, nheads_k=4, mode="fwd", dtype="bf16", repeat=0, ms=1.0, tflops=tflops,
                            rel_err=1e-3, ok=True)

    records = [rec("flashtile", 500.0, 1024), rec("cudnn", 400.0, 1024), rec("fa4", 625.0, 1024),
               rec("flashtile", 600.0, 4096), rec("cudnn", 600.0, 4096)]
    records[-1].skipped, records[-1].tflops = "RuntimeError: no kernel", None
    table = dense.build_table(records, ["flashtile", "cudnn", "fa4"], timing=True)
    assert table.header == ["hdim", "heads", "causal", "mode", "seqlen", "flashtile", "cudnn", "fa4",
                            "ft/cudnn", "ft/fa4", "ok"]
    assert table.rows[0][1] == "16/4" and table.rows[0][5:10] == ["500.0", "400.0", "625.0", "1.25", "0.80"]
    assert table.rows[1][6:8] == ["skip", "-"]
    assert "geomean flashtile/x, fwd: cudnn 1.25, fa4 0.80" in table.notes
    assert any(note.startswith("skipped cudnn x1: RuntimeError") for note in table.notes)
    markdown = report.render_markdown(table)
    assert markdown.splitlines()[1].startswith("|---:|---:|:---|:---|")


def test_missing_matplotlib_skips_the_plot(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(report, "matplotlib_pyplot", lambda: None)
    message = report.save_plot(lambda plt: pytest.fail("must not draw"), tmp_path / "tflops.png")
    assert "matplotlib is not installed" in message and not (tmp_path / "tflops.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


@needs_interpreter
def test_dense_smoke_writes_json_and_markdown_and_reports_absent_fa4(tmp_path, capsys, monkeypatch):
    _absent(monkeypatch)
    argv = ["dense", "--interpret-smoke", "--seqlens", "64", "--seqlen-q", "32", "--heads", "4", "--heads-k", "2",
            "--causal", "true", "--modes", "fwd,fwd+bwd", "--anchors", "fa4", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    assert "[1/2]" in captured.err and "[2/2]" in captured.err and "elapsed" in captured.err  # progress
    assert "anchor fa4: not available: ModuleNotFoundError" in captured.err
    document = json.loads((tmp_path / "results.json").read_text())
    meta, records = document["meta"], document["records"]
    assert meta["complete"] and meta["interpret_smoke"] and meta["command"][:4] == ["-m", "flashtile", "bench", "dense"]
    assert meta["anchors"] == {"fa4": "not available: ModuleNotFoundError: No module named 'flash_attn'"}
    assert meta["systems"] == ["flashtile"]
    assert [(r["system"], r["mode"], r["seqlen_q"], r["seqlen"], r["nheads_k"], r["ok"]) for r in records] == [
        ("flashtile", "fwd", 32, 64, 2, True), ("flashtile", "fwd_bwd", 32, 64, 2, True)]
    assert set(records[1]["rel_errs"]) == {"out", "dq", "dk", "dv"}
    markdown = (tmp_path / "results.md").read_text()
    assert "fa4: not available: ModuleNotFoundError" in markdown and "| 32/64 |" in markdown
    assert not (tmp_path / "tflops.png").exists()  # no timing, no plot


@needs_interpreter
def test_dense_smoke_runs_a_present_fa4_next_to_flashtile(tmp_path, capsys, monkeypatch):
    def flash_attn_func(q, k, v, causal=False):  # FA4's signature and (out, lse) return, in torch math
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), is_causal=causal)
        return out.transpose(1, 2).to(q.dtype), None

    fake = types.SimpleNamespace(flash_attn_func=flash_attn_func)
    monkeypatch.setattr(anchors, "fa4", lambda: anchors.Availability(fake, "available (flash-attn-4 mock)"))
    assert bench.main(["dense", "--interpret-smoke", "--causal", "false", "--modes", "fwd_bwd",
                       "--anchors", "fa4", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["meta"]["anchors"] == {"fa4": "available (flash-attn-4 mock)"}
    assert [(r["system"], r["ok"]) for r in document["records"]] == [("flashtile", True), ("fa4", True)]
    assert "| flashtile | fa4 | ft/fa4 | ok |" in (tmp_path / "results.md").read_text()
    capsys.readouterr()


@needs_interpreter
def test_varlen_smoke(tmp_path, capsys, monkeypatch):
    _absent(monkeypatch)
    assert bench.main(["varlen", "--interpret-smoke", "--heads-k", "1", "--causal", "true", "--modes", "fwd_bwd",
                       "--anchors", "padded,sdpa,fa4", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "varlen.json").read_text())
    by_system = {r["system"]: r for r in document["records"]}
    assert set(by_system) == {"flashtile", "padded", "sdpa"}
    assert by_system["flashtile"]["ok"] and set(by_system["flashtile"]["rel_errs"]) == {"out", "dq", "dk", "dv"}
    assert by_system["sdpa"]["ok"] and by_system["padded"]["rel_err"] is None  # padded attends to padding
    assert sum(document["meta"]["lengths"]) == 160
    assert document["meta"]["anchors"]["fa4"].startswith("not available: ")
    assert "flashtile varlen benchmark" in (tmp_path / "varlen.md").read_text()
    capsys.readouterr()


@needs_interpreter
def test_decode_smoke(tmp_path, capsys, monkeypatch):
    _absent(monkeypatch)
    assert bench.main(["decode", "--interpret-smoke", "--seqlen-q", "1,2", "--causal", "both", "--anchors", "sdpa,fa4",
                       "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "decode.json").read_text())
    systems = ["flashtile", "flashtile-paged", "flashtile-func", "flashtile-varlen", "flashtile-varlen-paged", "sdpa"]
    # One query row runs once (not causal); two run with and without the causal mask.
    assert [(r["system"], r["seqlen_q"], r["causal"], r["ok"]) for r in document["records"]] == [
        (name, rows, causal, True) for rows, causal in ((1, False), (2, False), (2, True)) for name in systems]
    assert document["meta"]["causal"] == [False, True]
    assert document["meta"]["anchors"]["fa4"].startswith("not available")
    markdown = (tmp_path / "decode.md").read_text()
    assert "| 2 | 64 | 2 | yes |" in markdown and "| 2 | 64 | 1 | no |" in markdown
    capsys.readouterr()


@needs_interpreter
def test_options_smoke(tmp_path, capsys):
    assert bench.main(["options", "--interpret-smoke", "--heads-k", "1", "--sets", "plain-causal,window-softcap",
                       "--modes", "fwd_bwd", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "options.json").read_text())
    assert [(r["system"], r["set"], r["ok"]) for r in document["records"]] == [
        ("flashtile", "plain-causal", True), ("flashtile", "window-softcap", True)]
    assert set(document["records"][1]["rel_errs"]) == {"out", "dq", "dk", "dv"}
    assert document["records"][1]["causal_shaped"] is True
    assert "flashtile options benchmark" in (tmp_path / "options.md").read_text()
    capsys.readouterr()


@needs_interpreter
def test_host_smoke(tmp_path, capsys):
    """Every row runs and is checked against the anchor (timing needs the GPU)."""
    assert bench.main(["host", "--interpret-smoke", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "host.json").read_text())
    assert [r["row"] for r in document["records"]] == list(host.ROWS)
    assert all(r["ok"] and r["flashtile_us"] is None for r in document["records"])
    assert "host time per eager call" in (tmp_path / "host.md").read_text()
    capsys.readouterr()


def test_options_count_the_visible_pairs():
    from flashtile.tools.bench import options

    assert options.visible_pairs(4, options.option_set("plain-full", 2, 0.0)) == 16
    assert options.visible_pairs(4, options.option_set("plain-causal", 2, 0.0)) == 10
    assert options.visible_pairs(4, options.option_set("window-causal", 1, 0.0)) == 7  # 1 + 2 + 2 + 2
    assert options.visible_pairs(4, options.option_set("window-both", 2, 0.0)) == 10  # (1, 1): 2 + 3 + 3 + 2


@pytest.mark.skipif(interpreter_problem() is not None, reason="this Triton's CPU interpreter cannot run here")
def test_smoke_through_the_command_line(tmp_path):
    """The documented command, in a fresh process (which turns the interpreter on by itself)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "flashtile", "bench", "dense", "--interpret-smoke", "--modes", "fwd",
                           "--causal", "true"], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / common.OUT_ROOT_NAME).iterdir()  # default: under the working directory
    assert run_dir.name.endswith("-dense-cpu")
    assert {p.name for p in run_dir.iterdir()} == {"results.json", "results.md"}
    assert "flashtile" in done.stdout and "[1/1]" in done.stderr


def test_old_spelling_still_runs_dense_and_maps_old_flags():
    from flashtile import bench as old

    assert old.translate([]) == ["dense"]
    assert old.translate(["--quick", "--systems", "flashtile,sdpa-cudnn"]) == ["dense", "--quick", "--anchors", "cudnn"]
    assert old.translate(["--systems=flashtile"]) == ["dense", "--anchors", "none"]
    assert old.translate(["--varlen", "--headdims", "128", "--varlen-modes", "fwd"]) == [
        "varlen", "--headdims", "128", "--modes", "fwd"]
    assert old.translate(["--decode"]) == ["decode"]
    assert old.translate(["varlen", "--tokens", "8k"]) == ["varlen", "--tokens", "8k"]
    assert old.SYSTEMS["sdpa-cudnn"] is dense.SYSTEMS["cudnn"] and old.flops is dense.flops


def test_the_package_has_no_import_cycle():
    """Every module's intra-package imports, as a graph: acyclic, and nothing imports flashtile.bench."""
    package = Path(bench.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("flashtile.bench", "flashtile.bench_varlen", "flashtile.bench_decode")
                if node.level == 1:
                    edges |= {node.module} if node.module else {alias.name for alias in node.names}
        graph[path.stem] = edges - {"__init__"}
    state: dict = {}

    def visit(name, trail):
        assert state.get(name) != "open", f"import cycle: {' -> '.join(trail + [name])}"
        if state.get(name) is None:
            state[name] = "open"
            for target in graph.get(name, ()):
                visit(target, trail + [name])
            state[name] = "done"

    for name in graph:
        visit(name, [])
    assert "dense" in graph["varlen"] and "dense" not in graph["report"]
