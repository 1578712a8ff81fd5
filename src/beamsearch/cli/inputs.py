"""Reading the command line's inputs: one example per line, from files or stdin, strict UTF-8 (a leading byte-order
mark dropped)."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows editors write at the start of a text file


class CLIError(Exception):
    """An error the command line reports as one clear message without a traceback: exit status 2 for a usage
    error (bad flags, files or options, the default), 1 for a failure while running (``status=1``)."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


@dataclass
class Line:
    index: int  # 1-based over all inputs, the record number in the output
    source: str  # "file:line"
    text: str


def check_readable(paths: list[str]) -> None:
    """Fail before any decoding if an input file is missing, a directory or unreadable."""
    for p in paths:
        if p == "-":
            continue
        path = Path(p)
        if not path.exists():
            raise CLIError(f"input file {p}: no such file")
        if path.is_dir():
            raise CLIError(f"input file {p}: is a directory")
        try:
            with path.open("rb"):
                pass
        except OSError as e:
            raise CLIError(f"input file {p}: cannot be read ({e.strerror})") from None


@dataclass
class InputFile:
    path: str
    lines: int  # a last line without its newline counts
    sha256: str


def scan_files(paths: list[str]) -> list[InputFile] | None:
    """Each input file's line count (the progress bar's length) and SHA-256 (``--resume``'s fingerprint), in one
    read; None when reading stdin."""
    if not paths or "-" in paths:
        return None
    out = []
    for p in paths:
        digest, n, last = hashlib.sha256(), 0, b"\n"
        with open(p, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
                n += block.count(b"\n")
                last = block[-1:]
        out.append(InputFile(p, n + (last != b"\n"), digest.hexdigest()))
    return out


def read_lines(paths: list[str]) -> Iterator[Line]:
    """Yield every line of the inputs (stdin when ``paths`` is empty or ``-``), without its line ending and, on the
    first line of each input, without a UTF-8 byte-order mark (it is not part of the text).

    Raises:
        CLIError: naming the file and line, when a line is not valid UTF-8.
    """
    index = 0
    for p in paths or ["-"]:
        name = "<stdin>" if p == "-" else p
        stream: BinaryIO = sys.stdin.buffer if p == "-" else open(p, "rb")  # noqa: SIM115
        try:
            for n, raw in enumerate(stream, 1):
                if n == 1:
                    raw = raw.removeprefix(BOM)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CLIError(
                        f"{name}:{n}: invalid UTF-8 ({e.reason} at byte {e.start} of the line); "
                        "every line before it was decoded and written"
                    ) from None
                index += 1
                yield Line(index, f"{name}:{n}", text.rstrip("\r\n"))
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()


def chunks(lines: Iterator[Line], size: int) -> Iterator[tuple[list[Line], CLIError | None]]:
    """Group lines into chunks; a read error ends the stream after the lines read before it."""
    chunk: list[Line] = []
    try:
        for line in lines:
            chunk.append(line)
            if len(chunk) == size:
                yield chunk, None
                chunk = []
    except CLIError as e:
        yield chunk, e
        return
    if chunk:
        yield chunk, None
