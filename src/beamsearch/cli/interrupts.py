"""Stopping a command on SIGINT (Ctrl-C) or SIGTERM: one line on stderr, exit status 128 + the signal's number.

While a command runs (:func:`signals_stop_the_run`), both signals raise :class:`Interrupted` in the main thread, so that
the command's cleanup runs (a file output keeps what was written, for ``--resume``) and ``main`` prints what was kept
and how to continue, instead of a ``KeyboardInterrupt`` traceback (SIGINT) or nothing at all (SIGTERM's default
ends the process where it is). A record is written whole or not at all (:func:`signals_held`): a signal that comes
while one is written takes effect right after it, so the count of written inputs is exact.
"""

from __future__ import annotations

import shlex
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (a ``KeyboardInterrupt``, so that ``except Exception`` does not swallow it).

    Attributes:
        signum: the signal's number (``signal.SIGINT`` or ``signal.SIGTERM``).
        kept: what the stopped run left for later, as a phrase (``"120 of 400 inputs are written in
            out.tsv.partial"``), set by the command on its way out; None where nothing is kept.
        resumable: whether the same command with ``--resume`` continues what was kept.
    """

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.kept: str | None = None
        self.resumable = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def status(self) -> int:
        """The exit status a shell gives a process this signal ended: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


def as_interrupted(error: KeyboardInterrupt) -> Interrupted:
    """``error`` as an :class:`Interrupted`: a plain ``KeyboardInterrupt`` (raised before the handlers were set, or
    by code that raises it itself) counts as SIGINT."""
    return error if isinstance(error, Interrupted) else Interrupted(signal.SIGINT)


class _Handler:
    """The signal handler while a command runs: raise, or wait for the end of a held block. Every signal raises (none
    is ignored after the first), so that a run whose first Interrupted some library swallowed can still be stopped."""

    def __init__(self) -> None:
        self.held = 0  # depth of signals_held blocks in progress
        self.pending: int | None = None  # a signal that came during a held block

    def __call__(self, signum: int, frame: Any) -> None:
        if self.held:
            self.pending = self.pending or signum
            return
        raise Interrupted(signum)


_handler: _Handler | None = None  # the handler in place while a command runs in the main thread


@contextmanager
def signals_stop_the_run() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM raise :class:`Interrupted` (in the main thread; elsewhere nothing
    changes, as Python sets signal handlers there only); the handlers before are put back after."""
    global _handler
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in STOPPING_SIGNALS}
    outer, _handler = _handler, _Handler()
    for signum in STOPPING_SIGNALS:
        signal.signal(signum, _handler)
    try:
        yield
    finally:
        _handler = outer
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextmanager
def signals_held() -> Iterator[None]:
    """A signal that comes while the block runs stops the run right after it (nothing changes outside
    :func:`signals_stop_the_run`)."""
    handler = _handler
    if handler is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    handler.held += 1
    try:
        yield
    finally:
        handler.held -= 1
        if not handler.held and handler.pending is not None:
            signum, handler.pending = handler.pending, None
            raise Interrupted(signum)


def resume_command(argv: Sequence[str]) -> str:
    """The command that continues a stopped ``beamsearch`` run: its arguments without ``--overwrite`` (or an
    abbreviation argparse took for it) and with ``--resume``, quoted for a POSIX shell."""
    arguments, positional_only = [], False
    for argument in argv:
        positional_only = positional_only or argument == "--"
        if not positional_only and len(argument) > 3 and "--overwrite".startswith(argument):
            continue
        arguments.append(argument)
    if not any(len(a) > 3 and "--resume".startswith(a) for a in arguments[: _end_of_options(arguments)]):
        arguments.insert(_end_of_options(arguments), "--resume")
    return shlex.join(["beamsearch", *arguments])


def _end_of_options(arguments: list[str]) -> int:
    return arguments.index("--") if "--" in arguments else len(arguments)


def stopped_line(stop: Interrupted, argv: Sequence[str]) -> str:
    """The one line a stopped command prints: the signal, what was kept and how to continue."""
    kept = stop.kept or "nothing was written"
    how = f"; continue with: {resume_command(argv)}" if stop.resumable else ""
    return f"beamsearch: stopped by {stop.name}: {kept}{how}"
