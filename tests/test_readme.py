"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2


def test_the_quick_start_output_is_what_make_run_prints(capsys):
    """The README's `make run` output block is the command's real output: same words, ranks, hypotheses and finish
    reasons, scores within the score tolerance (they are printed to 6 decimals)."""
    from beamsearch.cli.main import main

    shown = re.search(r"```text\n(1\thello\t1.*?)```", README.read_text(), flags=re.S).group(1).splitlines()
    examples = Path(__file__).resolve().parents[1] / "examples" / "words.txt"
    assert main(["decode", str(examples), "--num-beams", "5", "--num-return-sequences", "3", "--format", "tsv",
                 "-q"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(shown) == 24
    for want, got in zip(shown, printed, strict=True):
        want, got = want.split("\t"), got.split("\t")
        assert want[:3] + want[4:] == got[:3] + got[4:]
        assert abs(float(want[3]) - float(got[3])) <= 1.2e-4 * max(1.0, abs(float(want[3]))) + 1e-6
