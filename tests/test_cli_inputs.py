"""The command line's inputs with a UTF-8 byte-order mark (as Windows editors save text files): the mark is dropped on
every path that reads inputs (files, stdin, ``--stream``, ``eval --data``; ``--ray`` in tests/test_ray.py), so each
input decodes as the same input without it. The expected outputs are the same command's on the file without the mark.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from beamsearch.cli.inputs import read_lines

BOM = "\ufeff".encode("utf-8")  # the byte-order mark as UTF-8 writes it: EF BB BF
WORDS = ["its", "hello", "cat"]


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def lines_of(words: list[str], newline: str = "\n") -> bytes:
    return "".join(word + newline for word in words).encode("utf-8")


def stdin_of(data: bytes) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")


def test_the_mark_is_dropped_from_the_first_line_of_each_file(tmp_path):
    first = write(tmp_path / "first.txt", BOM + lines_of(["its", "cat"]))
    second = write(tmp_path / "second.txt", BOM + lines_of(["dog"], "\r\n"))  # with CRLF line endings too
    lines = list(read_lines([first, second]))
    assert [line.text for line in lines] == ["its", "cat", "dog"]
    assert [line.source for line in lines] == [f"{first}:1", f"{first}:2", f"{second}:1"]
    assert [line.index for line in lines] == [1, 2, 3]


def test_a_mark_elsewhere_is_text(tmp_path):
    """Only a file's first bytes can be a byte-order mark: U+FEFF inside the text is left to the tokenizer."""
    path = write(tmp_path / "in.txt", b"cat\n" + BOM + b"dog\n")
    assert [line.text for line in read_lines([path])] == ["cat", "\ufeffdog"]


def test_the_mark_is_dropped_from_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", stdin_of(BOM + lines_of(["its", "cat"])))
    assert [line.text for line in read_lines(["-"])] == ["its", "cat"]
    monkeypatch.setattr(sys, "stdin", stdin_of(BOM + lines_of(["its"])))
    assert [line.text for line in read_lines([])] == ["its"]


pytest.importorskip("transformers")

from beamsearch.cli import main  # noqa: E402


def decoded(argv: list[str], capsys) -> tuple[str, str]:
    """stdout and stderr of ``main(argv)``, which must succeed."""
    capsys.readouterr()
    assert main(argv) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize("fmt", ["text", "tsv", "jsonl"])
def test_decode_a_file_with_the_mark_as_without_it(tmp_path, capsys, fmt):
    plain = write(tmp_path / "plain.txt", lines_of(WORDS))
    marked = write(tmp_path / "marked.txt", BOM + lines_of(WORDS))
    want, _ = decoded(["decode", plain, "--format", fmt, "-q"], capsys)
    got, err = decoded(["decode", marked, "--format", fmt, "-q"], capsys)
    assert got == want.replace("plain.txt:", "marked.txt:")  # jsonl's source field names the file
    assert "vocabulary" not in err  # the mark was not read as a character the model does not know
    assert len(want.splitlines()) >= len(WORDS)


def test_decode_stdin_with_the_mark_as_without_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", stdin_of(lines_of(WORDS)))
    want, _ = decoded(["decode", "-", "--format", "tsv", "-q"], capsys)
    monkeypatch.setattr(sys, "stdin", stdin_of(BOM + lines_of(WORDS)))
    got, err = decoded(["decode", "-", "--format", "tsv", "-q"], capsys)
    assert got == want and "vocabulary" not in err
    assert [row.split("\t")[1] for row in got.splitlines()] == WORDS


def test_stream_with_the_mark_as_without_it(tmp_path, capsys, monkeypatch):
    plain = write(tmp_path / "plain.txt", lines_of(WORDS))
    marked = write(tmp_path / "marked.txt", BOM + lines_of(WORDS))
    want, _ = decoded(["decode", "--stream", plain], capsys)
    got, err = decoded(["decode", "--stream", marked], capsys)
    assert got == want and "vocabulary" not in err
    monkeypatch.setattr(sys, "stdin", stdin_of(BOM + lines_of(WORDS)))
    got, err = decoded(["decode", "--stream"], capsys)
    assert got == want and "vocabulary" not in err
    assert len(want.splitlines()) == len(WORDS)


def test_eval_references_with_the_mark_as_without_it(tmp_path, capsys):
    """``eval --data``: the first input is the word, not U+FEFF and the word (an unknown character to the model, which
    changes its output), so every score is the one without the mark."""
    rows = b"its\tIH1 T S\nhello\tHH AH0 L OW1\tHH EH0 L OW1\ncat\tK AE1 T\n"
    plain = write(tmp_path / "plain.tsv", rows)
    marked = write(tmp_path / "marked.tsv", BOM + rows)

    def scores(path: str) -> list[list[str]]:
        out, err = decoded(["eval", "--data", path, "--beams", "1", "5", "-q"], capsys)
        assert "vocabulary" not in err
        table = [row.split("|")[1:-1] for row in out.splitlines() if row.startswith("| greedy") or
                 row.startswith("| beam")]
        return [cells[:4] for cells in table]  # the speed column varies from run to run

    want = scores(plain)
    assert len(want) == 2
    assert scores(marked) == want
