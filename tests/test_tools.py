"""`python -m flashtile <command>` (flashtile/tools/cli.py) and its `sanity` command.

sanity runs in-process through its main(argv), on a couple of its quick cases (tiny shapes through
the interpreter on the CPU): seconds. Failures are injected by swapping a public entry point for a
faulty one, as a broken kernel would look to the tool.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import flashtile
from flashtile.tools import cli, sanity

from _cases import ON_GPU

# Two quick cases, on the GPU's shapes or the CPU's: the forward-only case and the contiguous kv cache.
FEW = "fwd b,kvcache b"


def _python(*args) -> subprocess.CompletedProcess:
    # The child inherits TRITON_INTERPRET=1 from conftest.py when there is no GPU.
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))


def test_help_lists_the_commands():
    done = _python("-m", "flashtile", "--help")
    assert done.returncode == 0, done.stderr
    for name, (_, line) in cli.COMMANDS.items():
        assert f"  {name}" in done.stdout and line in done.stdout
    assert {"bench", "env", "sanity"} <= set(cli.COMMANDS)


def test_importing_flashtile_leaves_the_tools_alone():
    done = _python("-c", "import sys, flashtile; print(sorted(m for m in sys.modules if m.startswith('flashtile.tools')"
                         " or m == 'flashtile.__main__'))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_command_prints_usage(capsys):
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().err


@pytest.mark.parametrize("command,hint", [("bnech", "did you mean 'bench'?"), ("frobnicate", "")])
def test_unknown_command(capsys, command, hint):
    assert cli.main([command, "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"unknown command {command!r}" in err and "commands: sanity, env, bench" in err
    assert hint in err


def test_commands_forward_their_arguments(capsys):
    argv = list(sys.argv)
    for command, expected in ((["bench", "--help"], "--interpret-smoke"),
                              (["help", "env"], "usage: python -m flashtile.env")):
        with pytest.raises(SystemExit) as exit_info:  # argparse's --help
            cli.main(command)
        assert exit_info.value.code == 0
        assert expected in capsys.readouterr().out
    assert sys.argv == argv, "the dispatcher must put sys.argv back"


def test_sanity_through_the_dispatcher_lists_its_cases(capsys):
    assert cli.main(["sanity", "--quick", "--list", "--cases", FEW]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) >= 2 and all(line.startswith(("fwd b", "kvcache b")) for line in listed)


def test_sanity_quick_cases_pass(tmp_path, capsys):
    path = tmp_path / "sanity.json"
    assert sanity.main(["--quick", "--cases", FEW, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("case"))
    assert header.split() == list(sanity.COLUMNS)
    assert "FAIL" not in out and "passed" in out.splitlines()[-1]

    document = json.loads(path.read_text())
    assert document["passed"] is True and document["quick"] is True
    assert document["device"] == ("cuda" if ON_GPU else "cpu")
    kinds = {case["kind"] for case in document["cases"]}
    assert kinds == {"fwd", "kvcache"}
    for case in document["cases"]:
        assert case["passed"] and case["error"] is None and case["seconds"] >= 0
        assert case["explain"]["forward"]["path"] in ("hopper", "portable")
        tensors = [row["tensor"] for row in case["rows"]]
        assert "out" in tensors and "lse" in tensors
        assert ("cache" in tensors) == (case["kind"] == "kvcache")
        for row in case["rows"]:
            assert set(row) == {"tensor", "path", "error", "pytorch_error", "allowed", "passed", "note"}
            if row["tensor"] == "out":
                assert 0 <= row["error"] <= row["allowed"]
                assert row["allowed"] >= row["pytorch_error"]


def test_sanity_json_to_stdout(capsys):
    assert sanity.main(["--quick", "--cases", "fwd b", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["cases"][0]["kind"] == "fwd"
    assert "fwd b" in captured.err  # the table goes to stderr then


def test_sanity_fails_on_a_wrong_output(monkeypatch, tmp_path, capsys):
    real = flashtile.flash_attn_func

    def off_by_a_bit(*args, **kwargs):
        out, lse, probs = real(*args, **kwargs)
        return out * 1.05, lse, probs  # 5%: past the bf16 bound on a GPU (~1.3%) too

    monkeypatch.setattr(flashtile, "flash_attn_func", off_by_a_bit)
    path = tmp_path / "sanity.json"
    assert sanity.main(["--quick", "--cases", FEW, "--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: 1 of 2 cases (fwd b" in out
    document = json.loads(path.read_text())
    assert document["passed"] is False
    by_kind = {case["kind"]: case for case in document["cases"]}
    assert by_kind["kvcache"]["passed"]  # flash_attn_with_kvcache was left alone
    rows = {row["tensor"]: row for row in by_kind["fwd"]["rows"]}
    assert not rows["out"]["passed"] and rows["out"]["error"] > rows["out"]["allowed"]
    assert rows["lse"]["passed"]


def test_sanity_reports_a_case_that_raises(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("a kernel that does not launch")

    monkeypatch.setattr(flashtile, "flash_attn_func", broken)
    assert sanity.main(["--quick", "--cases", "fwd b,odd"]) == 1
    out = capsys.readouterr().out
    assert out.count("RuntimeError: a kernel that does not launch") >= 2  # every case ran, and failed


def test_sanity_needs_a_matching_case(capsys):
    assert sanity.main(["--quick", "--cases", "no such case"]) == 2
    assert "no case matches" in capsys.readouterr().err


@pytest.mark.skipif(ON_GPU, reason="the CPU's message")
def test_sanity_without_a_gpu_says_so(capsys):
    assert sanity.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "TRITON_INTERPRET=1 is set" in err or "CUDA is not available" in err


def test_sanity_covers_every_path():
    """The full sets name every path the brief lists, on the GPU and on the CPU."""
    for on_gpu in (False, True):
        for quick in (False, True):
            cases = sanity.make_cases(sanity.SIZES[on_gpu, quick])
            kinds = {case.kind for case in cases}
            assert {"fwd", "dense", "causal", "window", "softcap", "alibi", "gqa", "mqa", "dropout", "varlen",
                    "kvcache", "kvcache-paged", "qkvpacked", "odd"} <= kinds
            names = [(case.name, case.dtype) for case in cases]
            assert len(names) == len(set(names)), "two cases of the same name"
            if on_gpu and not quick:  # the Hopper kernels' sizes
                assert {64, 128, 256} <= set(sanity.SIZES[on_gpu, quick].dense_head_dims)
                assert sanity.SIZES[on_gpu, quick].seqlen == 1023
            if on_gpu:
                assert torch.bfloat16 in {case.dtype for case in cases}
                assert torch.bfloat16 not in sanity.SIZES[False, quick].dtypes  # the interpreter computes it wrongly
