"""The documentation's Python examples run as written, and no code block hides its language.

Every ```python block of docs/*.md runs here, each in a fresh namespace; README.md's run in test_readme.py.
Blocks that are not meant to run are fenced with another language (text for output samples, sh for shell
commands), and every fence of README.md and docs/*.md must name one of those, so that a bare fence cannot
hold Python that neither test runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", flags=re.S | re.M)
LANGUAGES = {"python", "text", "sh"}


def fenced_blocks(path: Path) -> list[tuple[str, int, str]]:
    """``(language, line of the opening fence, code)`` for every fenced block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    return [(m.group(1).strip(), text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)]


PYTHON_BLOCKS = [
    pytest.param(code, f"docs/{page.name}:{line}", id=f"{page.name}:{line}")
    for page in PAGES
    for language, line, code in fenced_blocks(page)
    if language == "python"
]


@pytest.fixture
def one_thread():
    """The examples' models are tiny: one thread is as fast, and much faster when other work holds the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("code", "where"), PYTHON_BLOCKS)
def test_docs_python_block_runs(code, where, one_thread):
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("path", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_every_fence_names_its_language(path):
    text = path.read_text(encoding="utf-8")
    assert text.count("```") % 2 == 0, f"{path.name}: an unclosed code fence"
    bad = [(line, language) for language, line, _ in fenced_blocks(path) if language not in LANGUAGES]
    assert not bad, f"{path.name}: fences without one of {sorted(LANGUAGES)} (line, language): {bad}"


def test_docs_have_python_examples():
    assert PAGES, "docs/*.md not found"
    assert len(PYTHON_BLOCKS) >= 5
