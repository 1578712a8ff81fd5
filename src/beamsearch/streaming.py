"""Streaming a search's output as an iterator (:func:`stream`), and to transformers' streamers.

What is streamed, and when a token is final, is :mod:`beamsearch.prefix_watch`'s committed prefix (or, with
``provisional=True``, the current best with corrections).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .prefix_watch import Listener, StreamEvent

__all__ = ["Stream", "StreamEvent", "stream", "streamer_listener"]


class Stream:
    """An iterator over a search's :class:`StreamEvent` s; ``result`` holds the :class:`SearchResult` once it ends.

    The search runs in a thread that hands events over as they come; leaving the loop early stops it at its next
    step. Errors of the search are raised by the iteration.
    """

    _END = object()

    def __init__(self, run: Callable[[Listener], Any]):
        self.result: Any = None
        self._events: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(run,), daemon=True)
        self._started = False

    def _work(self, run: Callable[[Listener], Any]) -> None:
        def listener(event: StreamEvent) -> None:
            if self._stop.is_set():
                raise _Stopped
            self._events.put(event)

        try:
            self.result = run(listener)
            self._events.put(self._END)
        except _Stopped:
            self._events.put(self._END)
        except BaseException as e:  # handed to the reader
            self._events.put(e)

    def __iter__(self) -> Iterator[StreamEvent]:
        if not self._started:
            self._started = True
            self._thread.start()
        try:
            while True:
                item = self._events.get()
                if item is self._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._stop.set()


class _Stopped(Exception):
    """The reader left: the search stops."""


def stream(step: Any, input_ids: torch.Tensor, state: Any = None, *, provisional: bool = False,
           **search_arguments: Any) -> Stream:
    """Search as :func:`beamsearch.search` does, streaming the output as it becomes final.

    ``for event in beamsearch.stream(step, input_ids, num_beams=4, ...)`` yields :class:`StreamEvent` s: committed
    chunks (joined: the best hypothesis' generated tokens, EOS included if it has one), or with
    ``provisional=True`` the current best with corrections. ``input_ids`` must hold one example (``[1, t0]``).
    The returned :class:`Stream` holds the :class:`SearchResult` in ``result`` once iterated to the end.
    """
    from .engine import search

    grad = torch.is_grad_enabled()  # per thread in torch: the search's thread takes the caller's

    def run(listener: Listener) -> Any:
        with torch.set_grad_enabled(grad):
            return search(step, input_ids, state, stream_to=listener, provisional=provisional, **search_arguments)

    return Stream(run)


def streamer_listener(streamer: Any) -> Listener:
    """A listener feeding transformers' streamer protocol: each committed chunk is ``put`` as a LongTensor ``[X]``
    (the caller puts the prompt first and calls ``end()`` after the search)."""

    def listener(event: StreamEvent) -> None:
        if event.tokens:
            streamer.put(torch.tensor(event.tokens, dtype=torch.long))

    return listener
