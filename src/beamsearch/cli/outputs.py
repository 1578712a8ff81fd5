"""Output formats of ``beamsearch decode`` and the incremental, resumable output file.

Every input gives one record, written in input order:

* ``text``: one line, the best hypothesis.
* ``tsv``: one line per hypothesis, ``index<TAB>input<TAB>rank<TAB>score<TAB>hypothesis`` (an empty input
  gives ``index<TAB><TAB>1<TAB><TAB>``).
* ``jsonl``: one JSON object, ``{"index", "source", "input", "hypotheses": [{"text", "tokens", "score",
  "sum_log_probs", "token_log_probs", "finish_reason"}, ...]}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from .inputs import CLIError, Line

FORMATS = ("text", "tsv", "jsonl")


def format_record(fmt: str, line: Line, hyps: list[dict[str, Any]]) -> str:
    """The output text for one input (ending with a newline)."""
    if fmt == "text":
        return (hyps[0]["text"] if hyps else "") + "\n"
    if fmt == "tsv":
        shown = " ".join(line.text.split("\t"))
        if not hyps:
            return f"{line.index}\t{shown}\t1\t\t\n"
        return "".join(f"{line.index}\t{shown}\t{r}\t{h['score']:.6f}\t{h['text']}\n" for r, h in enumerate(hyps, 1))
    record = {"index": line.index, "source": line.source, "input": line.text, "hypotheses": hyps}
    return json.dumps(record, ensure_ascii=False) + "\n"


class Output:
    """Where records go: stdout, or a file written record by record (flushed, fsynced per batch).

    With ``resume``, the records already in the file are kept, a partly written last record is cut off,
    and :attr:`done` says how many inputs to skip. Without it, an existing non-empty file is never
    overwritten unless ``overwrite`` is set.
    """

    def __init__(self, path: str | None, fmt: str, resume: bool = False, overwrite: bool = False):
        self.path = path
        self.done = 0
        if path is None:
            if resume:
                raise CLIError("--resume needs --output FILE")
            self.stream: TextIO = sys.stdout
            return
        p = Path(path)
        if p.is_dir():
            raise CLIError(f"--output {path}: is a directory")
        if p.exists() and p.stat().st_size > 0 and not resume and not overwrite:
            raise CLIError(f"--output {path} exists; use --resume to continue it or --overwrite to replace it")
        if resume and p.exists():
            self.done = _recover(p, fmt)
        try:
            self.stream = p.open("a" if resume else "w", encoding="utf-8", newline="\n")
        except OSError as e:
            raise CLIError(f"--output {path}: cannot be written ({e.strerror})") from None

    def write(self, text: str) -> None:
        self.stream.write(text)

    def sync(self) -> None:
        self.stream.flush()
        if self.path is not None:
            os.fsync(self.stream.fileno())

    def close(self) -> None:
        self.sync()
        if self.path is not None:
            self.stream.close()


def _recover(path: Path, fmt: str) -> int:
    """Cut the file after its last complete record and return the number of complete records."""
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    lines = keep.decode("utf-8", errors="replace").splitlines(keepends=True)
    if fmt == "tsv":
        indices = []
        for n, line in enumerate(lines, 1):
            head = line.split("\t", 1)[0]
            if not head.isdigit():
                raise CLIError(f"--resume: {path}:{n} is not a line of --format tsv output")
            indices.append(int(head))
        # the last index may have been cut between two of its hypotheses: drop it and decode it again
        last = indices[-1] if indices else 0
        n_keep = sum(i != last for i in indices)
        done = len(set(indices[:n_keep]))
        if indices[:n_keep] and indices[n_keep - 1] != done:
            raise CLIError(f"--resume: {path} does not hold records 1..{done} in order")
        keep = "".join(lines[:n_keep]).encode("utf-8")
    else:
        if fmt == "jsonl":
            for n, line in enumerate(lines, 1):
                try:
                    index = json.loads(line)["index"]
                except (ValueError, KeyError, TypeError):
                    raise CLIError(f"--resume: {path}:{n} is not a line of --format jsonl output") from None
                if index != n:
                    raise CLIError(f"--resume: {path}:{n} holds record {index}, expected {n}")
        done = len(lines)
    if len(keep) != len(data):
        with path.open("r+b") as f:
            f.truncate(len(keep))
    return done
