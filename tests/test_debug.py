"""`python -m flashtile debug` (flashtile/tools/debug.py): the online softmax tile by tile.

The mask translation (cutting keys moves flash_attn's bottom-right diagonal) is checked exactly
with the float64 reference standing in for the kernel, over many shapes and masks; then the real
kernels (through the interpreter on the CPU: tiny shapes) must agree at every tile, an injected
bug must stop the walk at its tile, the dumps must line up for diff, and bad arguments exit 2.
"""

import re

import pytest
import torch

import flashtile
from flashtile.reference import attention_naive
from flashtile.tools import cli, debug

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.float16


def _naive_kernel(q, k, v, return_attn_probs=True, **options):
    """flash_attn_func's contract, computed by the float64 reference: isolates the translation."""
    out, lse = attention_naive(q, k, v, dtype=torch.float64, **options)
    return out, lse, None


MASKS = [dict(), dict(causal=True), dict(window_size=(3, -1)), dict(window_size=(-1, 2)), dict(window_size=(0, 0)),
         dict(window_size=(5, 3)), dict(causal=True, window_size=(4, -1)), dict(window_size=(20, 0)),
         dict(window_size=(0, -1))]


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_the_translated_masks_keep_each_rows_keys(mask):
    """Kernel side with an exact stand-in kernel == the float64 online softmax, at every tile."""
    for seqlen_q, seqlen_k in ((1, 1), (5, 37), (37, 5), (16, 16), (9, 40)):
        q = torch.randn(1, seqlen_q, 2, 8, dtype=torch.float64)
        k, v = (torch.randn(1, seqlen_k, 1, 8, dtype=torch.float64) for _ in range(2))
        for block_n in (4, 16):
            reference, kernel = debug.tile_states(q, k, v, block_n=block_n, kernel=_naive_kernel, **mask)
            assert len(reference) == len(kernel) == -(-seqlen_k // block_n)
            for ref, ker in zip(reference, kernel):
                where = f"sq {seqlen_q} sk {seqlen_k} block {block_n} tile {ref.tile}"
                assert torch.equal(torch.isneginf(ref.lse), torch.isneginf(ker.lse)), where
                finite = ~torch.isneginf(ref.lse)
                torch.testing.assert_close(ker.lse[finite], ref.lse[finite], rtol=0, atol=1e-12, msg=where)
                torch.testing.assert_close(ker.out, ref.out, rtol=0, atol=1e-12, msg=where)
                torch.testing.assert_close(ker.l[finite], ref.l[finite], rtol=1e-12, atol=0, msg=where)
            # The last tile's state is the whole attention.
            out, lse = attention_naive(q, k, v, **mask)
            torch.testing.assert_close(reference[-1].out, out.transpose(1, 2), rtol=0, atol=1e-12)


def test_prefix_call_cuts_rows_whose_window_starts_later():
    # 5 queries, 37 keys, causal, window left 6: row i sees keys i + 26 to i + 32.
    assert debug.prefix_call(5, 37, 16, causal=True, window_size=(6, -1))[0] == 0  # no row sees keys < 16
    # The first 28 keys: rows 0 and 1 see keys 26.. and 27..; the call runs them alone, diagonal at i + 26.
    assert debug.prefix_call(5, 37, 28, causal=True, window_size=(6, -1)) == (2, (0, 6))
    assert debug.prefix_call(5, 37, 32, causal=True, window_size=(6, -1)) == (5, (1, 5))
    assert debug.prefix_call(5, 37, 37, causal=True) == (5, (-1, 0))  # the full call: unchanged


CASES = [
    # (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, block_n, options)
    (1, 5, 37, 2, 2, 16, 16, dict()),
    (1, 5, 37, 2, 2, 16, 16, dict(causal=True)),
    (2, 37, 21, 2, 2, 16, 16, dict(causal=True)),
    (1, 20, 37, 4, 2, 16, 16, dict(window_size=(8, 3))),
    (1, 5, 37, 2, 1, 32, 16, dict(causal=True, window_size=(6, -1))),
    (1, 9, 33, 2, 2, 16, 8, dict(softcap=2.0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]} s{c[1]}x{c[2]} h{c[3]}/{c[4]} d{c[5]} {c[7]}")
def test_the_kernel_agrees_at_every_tile(case):
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, block_n, options = case
    q, k, v = debug.make_inputs(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, DTYPE, DEVICE, init="randn",
                                seed=7)
    reference, kernel = debug.tile_states(q, k, v, block_n=block_n, **options)
    baseline = debug.pytorch_outputs(q, k, v, block_n=block_n, **options)
    assert [s.stop for s in reference] == [s.stop for s in kernel] == [min(n + block_n, seqlen_k)
                                                                       for n in range(0, seqlen_k, block_n)]
    for ref, ker, base in zip(reference, kernel, baseline):
        check = debug.check_tile(ref, ker, DTYPE, base)
        assert check.ok, (ref.tile, check)
        assert ker.path in ("portable", "hopper", "-")


def _run(capsys, *args):
    code = debug.main(["--device", DEVICE, *args])
    return code, capsys.readouterr()


def test_the_command_walks_every_tile(capsys):
    code, out = _run(capsys, "--causal", "--seqlen-q", "5", "--seqlen-k", "37", "--block-n", "16")
    assert code == 0, out.out + out.err
    assert re.findall(r"^tile (\d) ", out.out, re.MULTILINE) == ["0", "1", "2"]
    assert "all 3 tiles agree" in out.out
    assert re.search(r"^kernel: (portable|hopper) ", out.out, re.MULTILINE)


def test_an_injected_bug_stops_the_walk_at_its_tile(monkeypatch, capsys):
    real = flashtile.flash_attn_func
    calls = []

    def buggy(q, k, v, **options):
        calls.append(k.shape[1])
        out, lse, probs = real(q, k, v, **options)
        if k.shape[1] > 16:  # wrong from the second tile of 16 keys on
            out = out.clone()
            out[:, -1, 1, 3] *= 1.5
        return out, lse, probs

    monkeypatch.setattr(flashtile, "flash_attn_func", buggy)
    code, out = _run(capsys, "--seqlen-q", "5", "--seqlen-k", "50", "--block-n", "16", "--seed", "3")
    assert code == 1
    assert calls == [16, 32], "the walk must stop at the diverging tile"
    assert "tile 1  keys [16, 32)" in out.out and "DIVERGES" in out.out
    stop = [line for line in out.out.splitlines() if line.startswith("STOP")]
    assert stop and "tile 1" in stop[0] and "b0 h1 q4 O[3]" in stop[0], out.out
    # The failing tile's rows print side by side, the worst row among them.
    assert "  ref b0 h1 q4 " in out.out and "  ker b0 h1 q4 " in out.out


def test_inject_option(capsys):
    code, out = _run(capsys, "--seqlen-q", "3", "--seqlen-k", "20", "--block-n", "8", "--inject", "2")
    assert code == 1
    assert "STOP at tile 2 (keys [16, 20))" in out.out and re.search(r"b0 h\d q0 O\[0\]", out.out)


def test_the_dumps_line_up_for_diff(tmp_path, capsys):
    code, _ = _run(capsys, "--window", "4,2", "--seqlen-q", "6", "--seqlen-k", "21", "--block-n", "8",
                   "--rows", "0,-1", "--out", str(tmp_path))
    assert code == 0
    ref, ker = ((tmp_path / name).read_text().splitlines() for name in ("reference.txt", "kernel.txt"))
    assert len(ref) == len(ker) == 3 + 3 * (1 + 2 * 2)  # header, then 3 tiles of 2 rows x 2 heads

    def layout(line):
        return re.sub(r"-?\d+(\.\d+)?(e[+-]\d+)?|-?inf|-(?=\s)", "#", line)

    assert [layout(line) for line in ref[1:]] == [layout(line) for line in ker[1:]]
    assert ref[3:] != [] and ref[3] == "tile 0  keys [0, 8)"
    # Row 0's diagonal is key 15 (bottom-right): it sees keys 11 to 17, none of tile 0: empty on both sides.
    assert "lse     -inf" in ref[4] and "lse     -inf" in ker[4]


@pytest.mark.parametrize("args,message", [
    (["--heads", "3", "--heads-k", "2"], "not a multiple of --heads-k"),
    (["--seqlen-q", "4", "--rows", "9"], "row 9 is outside the 4 query rows"),
    (["--seqlen-k", "20", "--block-n", "8", "--inject", "3"], "--inject 3: the case has tiles 0 to 2"),
    (["--head-dim", "1000"], "flash_attn_func would refuse this case: head dim 1000"),
    (["--block-n", "0"], "--block-n must be at least 1"),
] + ([] if ON_GPU else [(["--dtype", "bf16"], "bf16 does not work in Triton's CPU interpreter")]))
def test_bad_arguments_exit_2(capsys, args, message):
    code, out = _run(capsys, *args)
    assert code == 2 and message in out.err, out.err
    assert out.err.startswith("python -m flashtile debug: ")


@pytest.mark.parametrize("args", [["--window", "3"], ["--window", "3,-2"], ["--rows", "a"], ["--dtype", "fp8"]])
def test_malformed_arguments_exit_2(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        debug.main(args)
    assert exit_info.value.code == 2
    assert "python -m flashtile debug: error:" in capsys.readouterr().err


def test_the_dispatcher_runs_it(capsys):
    assert cli.COMMANDS["debug"][0] == "flashtile.tools.debug"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["debug", "--help"])
    assert exit_info.value.code == 0
    assert "--block-n" in capsys.readouterr().out
