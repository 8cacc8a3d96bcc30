"""The learning guide (docs/guide/) runs: every ```python block of every chapter, in order.

Each chapter runs like a notebook: its blocks execute one after another in one namespace, so a
later block uses what an earlier one defined (exercise checkers, then the solutions in their
<details> blocks). A block fenced as ```python no-run is shown, not run (GPU-only calls, sketches).
Any other word after ``python`` is an error, so a typo cannot silently skip a block.

The guide's code is pure PyTorch on tiny shapes, plus a few flashtile calls on float16 / float32
CPU tensors; without CUDA those run through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1 before triton is imported, as for every other test). The whole file takes a
few seconds on a CPU.

It also checks the guide's bookkeeping: the index links every chapter, every chapter has at least
one exercise with a tested solution, and the repository paths (`flashtile/...`, `bench/results/...`)
and the functions the prose cites as `file.py::name` exist.
"""

import os
import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as conftest.py does (already set there)

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"
CHAPTERS = sorted(p for p in GUIDE.glob("*.md") if p.name != "README.md")

# An opening fence: ```python, optionally followed by a marker; the block runs to the next ``` line.
_FENCE = re.compile(r"^```python([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARKERS = {"": True, "no-run": False}


def code_blocks(path: Path):
    """(first line number, source, runs) of each ```python block of a Markdown file, in order."""
    text = path.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        marker = match.group(1).strip()
        assert marker in MARKERS, f"{path.name}: unknown code block marker {marker!r} (use 'no-run' or none)"
        line = text.count("\n", 0, match.start(2)) + 1
        blocks.append((line, match.group(2), MARKERS[marker]))
    return blocks


def test_chapters_exist():
    assert len(CHAPTERS) == 6, [p.name for p in CHAPTERS]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs(chapter):
    """The chapter's runnable blocks, in order, in one namespace (a fresh one per chapter)."""
    blocks = code_blocks(chapter)
    runnable = [(line, src) for line, src, runs in blocks if runs]
    assert runnable, f"{chapter.name} has no runnable code"
    torch.manual_seed(0)
    namespace = {"__name__": f"guide_{chapter.stem.replace('-', '_')}"}
    for line, src in runnable:
        # Padded to its place in the file, so a failure's traceback names the chapter and its real line.
        code = compile("\n" * (line - 1) + src, str(chapter.relative_to(ROOT)), "exec")
        exec(code, namespace)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_exercises_with_solutions(chapter):
    """At least one exercise; every solution sits in a collapsed <details> block holding runnable code."""
    text = chapter.read_text()
    assert re.search(r"^#+ .*Exercise", text, re.MULTILINE), f"{chapter.name}: no exercise heading"
    details = re.findall(r"<details>(.*?)</details>", text, re.DOTALL)
    assert details, f"{chapter.name}: no <details> solution block"
    for body in details:
        assert re.search(r"^```python\s*$", body, re.MULTILINE), f"{chapter.name}: a <details> block without runnable code"
    # Every exercise's checker is called on the solution, inside a <details> block.
    checkers = re.findall(r"^def (check_exercise_\w+)\(", text, re.MULTILINE)
    assert checkers, f"{chapter.name}: no check_exercise_... function"
    for name in checkers:
        assert any(re.search(rf"^{name}\(", body, re.MULTILINE) for body in details), \
            f"{chapter.name}: no solution calls {name}"


def test_index_links_every_chapter():
    index = (GUIDE / "README.md").read_text()
    for chapter in CHAPTERS:
        assert f"({chapter.name})" in index, f"README.md does not link {chapter.name}"


def _cited_paths(text: str):
    """Repository paths in backticks or Markdown links: flashtile/..., docs/..., bench/..., tests/..."""
    found = set(re.findall(r"`((?:flashtile|docs|bench|tests|examples)/[A-Za-z0-9_./-]+)`", text))
    found |= {p for p in re.findall(r"\]\((?:\.\./)+((?:flashtile|docs|bench|tests|examples)/[^)#\s]+)", text)}
    return {p.rstrip("/.") for p in found}


def test_cited_paths_exist():
    for page in [GUIDE / "README.md", *CHAPTERS]:
        for path in _cited_paths(page.read_text()):
            assert (ROOT / path).exists(), f"{page.name} cites {path}, which does not exist"


def test_relative_links_resolve():
    for page in [GUIDE / "README.md", *CHAPTERS]:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).resolve().exists(), f"{page.name} links {target}, which does not exist"


def test_cited_kernel_names_exist():
    """Names cited as `path.py::name` (a file under flashtile/, by the end of its path: `scores.py`,
    `hopper/forward.py`; it must name one file) are defined there."""
    files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "flashtile").rglob("*.py")]
    checked = 0
    for page in [GUIDE / "README.md", *CHAPTERS]:
        for cited, name in re.findall(r"`((?:[A-Za-z0-9_]+/)*[A-Za-z0-9_]+\.py)::([A-Za-z_][A-Za-z0-9_]*)`",
                                      page.read_text()):
            matches = [f for f in files if f == cited or f.endswith("/" + cited)]
            assert len(matches) == 1, f"{page.name} cites {cited}::{name}: files under flashtile/ ending so: {matches}"
            filename = cited
            source = (ROOT / matches[0]).read_text()
            assert re.search(rf"^\s*(def|class) {name}\b|^{name}\s*[:=]", source, re.MULTILINE), \
                f"{page.name} cites {filename}::{name}, which {matches[0]} does not define"
            checked += 1
    assert checked >= 20, f"only {checked} `file.py::name` citations found"
