"""Helpers for tests that run ``beamsearch`` as real processes (signals, locks, a terminal): the command, a word list,
waiting for what a running process writes, and the check that an output holds every input once, in order."""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from beamsearch.cli.evaluate import CMUDICT_TEST
from beamsearch.evaluation import read_references

BEAMSEARCH = [sys.executable, "-m", "beamsearch"]
SOURCE = str(Path(__file__).resolve().parents[1] / "src")


def environment() -> dict[str, str]:
    """The child's environment: this checkout's beamsearch, one thread (the machine is shared)."""
    return dict(os.environ, PYTHONPATH=SOURCE, OMP_NUM_THREADS="1")


def word_list(folder: Path, count: int, name: str = "words.txt") -> tuple[Path, list[str]]:
    """A file of ``count`` CMUdict test words, one per line (the test split repeated as needed)."""
    words = [word for word, _ in read_references(CMUDICT_TEST)]
    lines = list(itertools.islice(itertools.cycle(words), count))
    path = folder / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path, lines


def decode_argv(source: Path, output: Path, *extra: str) -> list[str]:
    """``beamsearch decode``'s arguments for a TSV output (one line per input: the best hypothesis only)."""
    return ["decode", str(source), "--format", "tsv", "--output", str(output), "--threads", "1", "-q", *extra]


def start(argv: list[str], **popen: object) -> subprocess.Popen:
    return subprocess.Popen([*BEAMSEARCH, *argv], env=environment(), **popen)


def run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*BEAMSEARCH, *argv], env=environment(), capture_output=True, text=True, timeout=timeout)


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, what: str, seconds: float = 180) -> None:
    """Wait until ``condition()`` holds while ``process`` runs (fails if it ends first or ``seconds`` pass)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the process ended (status {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.05)


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def command_line(text: str) -> list[str]:
    """The arguments of a ``beamsearch ...`` command line that a message printed (to :func:`run` them)."""
    words = shlex.split(text)
    assert words[0] == "beamsearch", words
    return words[1:]


def assert_every_input_once_in_order(output: Path, lines: list[str]) -> None:
    rows = [row.split("\t") for row in output.read_text(encoding="utf-8").splitlines()]
    assert [int(row[0]) for row in rows] == list(range(1, len(lines) + 1))
    assert [row[1] for row in rows] == lines
    assert all(row[2] == "1" and row[4] for row in rows)


class Terminal:
    """``beamsearch`` run in a pseudo-terminal that is its controlling terminal, as at a shell's prompt: what is typed
    goes to its stdin, Ctrl-C (``\\x03``) makes the terminal send it SIGINT, Ctrl-D (``\\x04``) ends its input."""

    def __init__(self, argv: list[str]):
        import fcntl
        import pty
        import termios

        self.master, follower = pty.openpty()

        def take_the_terminal() -> None:  # in the child, a session leader (start_new_session): its terminal
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.process = start(argv, stdin=follower, stdout=follower, stderr=follower, start_new_session=True,
                             preexec_fn=take_the_terminal)
        os.close(follower)
        self.screen = b""

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def read_until(self, condition: Callable[[bytes], bool], seconds: float = 180) -> bytes:
        """Read what the program shows until ``condition(screen)`` holds or it ends; returns the screen so far."""
        import select

        deadline = time.monotonic() + seconds
        while not condition(self.screen) and time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    self.screen += os.read(self.master, 4096)
                except OSError:  # the program ended and closed the terminal
                    break
        return self.screen

    def finish(self, seconds: float = 60) -> int:
        """Wait for the program to end, reading what it still shows; its exit status."""
        deadline = time.monotonic() + seconds
        while self.process.poll() is None and time.monotonic() < deadline:
            self.read_until(lambda screen: False, seconds=0.2)
        self.read_until(lambda screen: False, seconds=0.2)
        os.close(self.master)
        return self.process.wait(timeout=5)
