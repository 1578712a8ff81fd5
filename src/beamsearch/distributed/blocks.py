"""The resumable output of a decode split into blocks: ``FILE.blocks/`` next to the output ``FILE``.

A block is ``--chunk-size`` consecutive input lines, the same lines the single-process ``beamsearch decode`` reads
as one chunk, so that each block is sorted and batched exactly as there. Each finished block is written to its own
file (``FILE.blocks/block-000003.tsv``, written to a temporary name and renamed), then listed in
``FILE.blocks/manifest.json`` (rewritten to a temporary name and renamed, so it is always either the old or the new
list). A rerun with ``resume`` decodes only the blocks the manifest does not list, after checking that its
fingerprint (inputs, options, block size) is the one the manifest was written for. When every block is there they
are joined in input order into ``FILE`` (written beside it and renamed), the complete output's fingerprint is kept
in ``FILE.resume.json`` as the single process keeps it, and the directory is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cli.inputs import CLIError, Line, chunks, read_lines
from ..cli.outputs import check_fingerprint, check_output_path, is_complete, record_complete, sync_directory

MANIFEST = "manifest.json"
BLOCK_LAYOUT = ("chunk_size", "batch_size", "batch_type")  # which lines share a model batch: in the fingerprint


def output_fingerprint(blocks_fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The complete output's fingerprint: the blocks' without their layout, which does not change the output
    (the single process's fingerprint of the same command)."""
    options = {k: v for k, v in blocks_fingerprint.get("options", {}).items() if k not in BLOCK_LAYOUT}
    return dict(blocks_fingerprint, options=options)


@dataclass(frozen=True)
class Block:
    number: int  # 0-based, in input order
    lines: list[Line]


def read_blocks(paths: list[str], block_lines: int) -> Iterator[Block]:
    """The inputs as blocks of ``block_lines`` lines (the last one may be shorter).

    Raises:
        CLIError: naming the file and line of invalid UTF-8 (before anything is decoded: every block is read
            before the first is sent to a worker).
    """
    for number, (lines, error) in enumerate(chunks(read_lines(paths), block_lines)):
        if error is not None:
            where = str(error).split(";")[0]
            raise CLIError(f"{where}; nothing was decoded (--ray reads every input before it starts)")
        yield Block(number, lines)


class BlockStore:
    """``FILE.blocks/``: one file per finished block and the manifest listing them.

    Like :class:`beamsearch.cli.outputs.Output`: an existing ``FILE`` is replaced only with ``overwrite`` (and
    only once the new output is complete), a directory left by an interrupted run is continued only with
    ``resume`` (same fingerprint) or removed with ``overwrite``, and nothing is created before :meth:`start`.
    """

    def __init__(self, path: str, fmt: str, resume: bool, overwrite: bool):
        self.path = Path(path)
        self.fmt = fmt
        self.folder = self.path.with_name(self.path.name + ".blocks")
        self.manifest = self.folder / MANIFEST
        self.finished: dict[int, dict[str, Any]] = {}
        self.fingerprint: dict[str, Any] = {}
        check_output_path(path, self.folder, f"{self.folder.name}/", resume, overwrite)
        self.resume, self.overwrite = resume, overwrite

    @property
    def complete_already(self) -> bool:
        """``resume`` of a run that finished: ``FILE`` is there and no block directory is left (then
        :func:`~beamsearch.cli.outputs.check_complete` says whether the same command made it)."""
        return self.resume and is_complete(self.path, self.folder)

    def start(self, fingerprint: dict[str, Any]) -> None:
        """Read the manifest of the run to continue (``resume``, same fingerprint) or start an empty one."""
        self.fingerprint = fingerprint
        try:
            if self.resume and self.folder.exists():
                check_fingerprint(self.manifest, fingerprint)
                listed = json.loads(self.manifest.read_text(encoding="utf-8")).get("blocks", {})
                self.finished = {int(k): v for k, v in listed.items() if self._intact(v)}
                return
            if self.folder.exists():  # overwrite
                shutil.rmtree(self.folder)
            self.folder.mkdir()
            self._write_manifest()
        except OSError as e:
            raise CLIError(f"--output {self.path}: {self.folder.name}/ cannot be written ({e.strerror})",
                           status=1) from None

    def _intact(self, entry: dict[str, Any]) -> bool:
        """Whether a listed block's file is there with the contents the manifest recorded."""
        file = self.folder / entry["file"]
        return file.is_file() and _sha256(file.read_bytes()) == entry["sha256"]

    def save(self, number: int, text: str, lines: int) -> None:
        """Write one finished block's records, then list it in the manifest."""
        data = text.encode("utf-8")
        name = f"block-{number:06d}.{self.fmt}"
        try:
            _write_atomically(self.folder / name, data)
            self.finished[number] = {"file": name, "lines": lines, "sha256": _sha256(data)}
            self._write_manifest()
        except OSError as e:
            raise CLIError(f"cannot write {self.folder / name} ({e.strerror or e}); the finished blocks are kept: "
                           "make room and continue with --resume", status=1) from None

    def assemble(self, blocks: int) -> None:
        """Join blocks ``0 .. blocks-1`` in order into ``FILE`` (atomically), keep its fingerprint beside it
        (:func:`output_fingerprint`) and remove the block directory."""
        missing = [n for n in range(blocks) if n not in self.finished]
        if missing:
            raise CLIError(f"blocks {missing[:5]} are not finished; continue with --resume", status=1)
        joined = self.folder / ("joined." + self.fmt)
        try:
            with joined.open("wb") as out:
                for n in range(blocks):
                    with (self.folder / self.finished[n]["file"]).open("rb") as block:
                        shutil.copyfileobj(block, out)
                out.flush()
                os.fsync(out.fileno())
            record_complete(self.path, output_fingerprint(self.fingerprint), joined)
            os.replace(joined, self.path)
            sync_directory(self.path.parent)
            shutil.rmtree(self.folder)
        except OSError as e:
            raise CLIError(f"cannot write {self.path} ({e.strerror or e}); the finished blocks are kept in "
                           f"{self.folder.name}/: make room and continue with --resume", status=1) from None

    def abandon(self) -> None:
        """A failure: keep the finished blocks for ``resume``; remove the directory if none finished."""
        if not self.finished and self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)

    def _write_manifest(self) -> None:
        listed = {str(n): entry for n, entry in sorted(self.finished.items())}
        data = dict(self.fingerprint, blocks=listed)
        _write_atomically(self.manifest, json.dumps(data, indent=1).encode("utf-8"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` so that it is either absent (or its old contents) or complete: a temporary file, fsynced,
    renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    sync_directory(path.parent)
