"""Claiming an output file before a run writes anything: it may not be one of the inputs, and no other run may be
writing it.

* **Not an input.** The output and the files a run writes beside it (``FILE.partial``, ``FILE.resume.json``,
  ``FILE.lock``) are compared with each input file by device and inode, so a hard or symbolic link to an input, or a
  second spelling of its path, is refused as the input itself is, with or without ``--overwrite``; and so is stdin
  where it is redirected from a file.
* **One run per output.** ``FILE.lock`` is held with an exclusive ``flock`` for the whole run and names the process
  holding it; a second run on the same ``FILE`` refuses at once, naming that process. The operating system drops the
  lock when its process ends, however it ends, so a lock file left by a killed run blocks nothing (``--resume``
  takes it over). Where the file system has no such locks, the run goes on without one.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .inputs import CLIError

try:
    import fcntl
except ImportError:  # not a POSIX system: no lock
    fcntl = None  # type: ignore[assignment]

BESIDE = (".partial", ".resume.json", ".resume.json.tmp", ".lock")  # what a run writes next to its output FILE


def written_beside(output: Path) -> list[Path]:
    """The output and the files a run writes next to it."""
    return [output, *(output.with_name(output.name + suffix) for suffix in BESIDE)]


def _identity(status: os.stat_result) -> tuple[int, int]:
    return status.st_dev, status.st_ino


def input_identities(inputs: Sequence[str]) -> dict[tuple[int, int], str]:
    """Each input file's (device, inode), with the name to show; stdin (``-``, or no files) where it is a file."""
    found = {}
    for name in inputs or ["-"]:
        try:
            status = os.fstat(sys.stdin.fileno()) if name == "-" else os.stat(name)
        except (OSError, ValueError, AttributeError):  # missing (reported later), or stdin that is not a descriptor
            continue
        if name != "-" or stat.S_ISREG(status.st_mode):
            found.setdefault(_identity(status), "stdin (a file redirected to it)" if name == "-" else name)
    return found


def check_not_an_input(flag: str, output: str, written: Sequence[Path], inputs: Sequence[str]) -> None:
    """Refuse ``flag output`` when a file it writes (``written``) is one of ``inputs``: decoding would replace the
    file it reads.

    Raises:
        CLIError: naming the output, the input and the link between them.
    """
    sources = input_identities(inputs)
    for path in written:
        try:
            name = sources.get(_identity(os.stat(path)))
        except OSError:  # not there yet: it cannot be an input
            continue
        if name is not None:
            which = f"{flag} {output}" if path == written[0] else f"{path.name}, written beside {flag} {output},"
            how = "" if os.path.abspath(path) == os.path.abspath(name) else " (the same file through a link or " \
                  "another path)"
            raise CLIError(f"{which} is the input {name}{how}: the run would replace what it reads; write to "
                           "another file")


class OutputLock:
    """``FILE.lock``, held by the one run that writes ``FILE`` (use as a context manager, or :meth:`release`)."""

    def __init__(self, output: Path | None):
        self.output = output  # None: stdout, nothing to lock
        self.path = None if output is None else output.with_name(output.name + ".lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or refuse at once when another process holds it.

        Raises:
            CLIError: naming the process that holds the lock.
        """
        if self.output is None or fcntl is None or not self.output.parent.is_dir() or self.output.is_dir():
            return  # no locks here, or a bad --output that the output's own checks report
        for _ in range(10):  # the holder may remove the file between our open and our lock: then lock the new one
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                return  # an unwritable directory: reported when the output is opened
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise CLIError(f"--output {self.output} is being written by another beamsearch ({holder}); wait for "
                               "it to end, or write to another file") from None
            except OSError:  # a file system without flock
                os.close(fd)
                return
            try:
                same = _identity(os.fstat(fd)) == _identity(os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file and let the lock go (the file first, so that a run waiting on it locks a new one)."""
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> str:
    """Who holds the lock, as the lock file names it (it may be empty for an instant after the holder took it)."""
    for _ in range(5):
        text = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip()
        if text.isdigit():
            return f"process {text}"
        time.sleep(0.05)
    return "a process that did not name itself"


def claim_output(output: str | None, inputs: Sequence[str]) -> OutputLock:
    """What ``decode -o FILE`` checks and takes before anything is written (on the single process's path and the
    ``--ray`` path alike): ``FILE`` and what is written beside it are not inputs, and this run holds ``FILE.lock``.
    Returns the lock (nothing held for stdout), to release when the run ends."""
    if output is None:
        return OutputLock(None)
    path = Path(output)
    check_not_an_input("--output", output, written_beside(path), inputs)
    lock = OutputLock(path)
    lock.acquire()
    return lock
