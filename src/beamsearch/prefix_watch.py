"""The committed prefix: which tokens of a running search are final, read after each step (streaming's source).

**The committed prefix.** After each step, the tokens at generated positions ``0 .. p-1`` are final (no later step
can change them) when every hypothesis that the returned best can still come from holds them: every live beam
while the live beams can still enter the finished pool, and every finished hypothesis that can still be the best
returned (for transformers' beam search: those tied with the pool's best; a finished hypothesis only leaves the
pool for a better one). The committed prefix is the longest common prefix of those hypotheses (the strategy says
which they are: ``could_win()``); each step emits what it adds, and the end of the search emits the rest of the
best hypothesis. So the committed chunks, joined, are the best hypothesis' generated tokens, and no chunk is ever
taken back (``tests/test_streaming.py`` checks both on hundreds of random searches). Strategies without
``could_win`` (the other toolkits' beam searches, exact and stochastic beam search) emit everything at the end.

**Provisional mode** streams the current best instead (the leading live beam, or the finished pool's best once it
leads) with corrections: each event says "from generated position p on, the text is now these tokens"; applied in
order, the events end with the best hypothesis.

The prefix is computed on the device and read with the strategy's own per-step host transfer
(:attr:`~beamsearch.strategies.score_checks.ScoreWatch.rider`): streaming adds no host synchronisation.
Streaming decodes one example at a time (B = 1), as transformers' streamers.

Legend: M hypotheses the best can come from, L = max_length, t0 start tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """Tokens streamed from a search.

    Attributes:
        position: the generated position (0: the first token after the start tokens) the tokens start at. A
            committed event always starts where the previous one ended; a provisional one replaces everything from
            ``position`` on.
        tokens: the token ids.
        committed: True when these tokens are final (committed mode, and the end of provisional mode).
    """

    position: int
    tokens: tuple[int, ...]
    committed: bool


Listener = Callable[[StreamEvent], None]


class PrefixWatch:
    """Reads the committed prefix (or the current best) of a strategy after each step and hands events on.

    Args:
        strategy: a strategy with ``could_win()`` and ``watch``, or any other (then only :meth:`finish` emits).
        listener: called with each :class:`StreamEvent`.
        provisional: stream the current best with corrections instead of the committed prefix.
    """

    def __init__(self, strategy: Any, listener: Listener, provisional: bool = False):
        self.strategy, self.listener, self.provisional = strategy, listener, provisional
        self.prompt_length = strategy.prompt_length
        self.shown: list[int] = []  # generated tokens emitted so far (committed, or the provisional best)
        if hasattr(strategy, "could_win"):
            strategy.watch.rider = self

    def values(self) -> torch.Tensor:
        """LongTensor ``[2 + X]``: the end of the committed prefix (or of the best), then tokens from where the
        emitted ones end (committed) or from the first generated position (provisional), up to the step's length."""
        tokens, lengths, eligible, leader = self.strategy.could_win()
        tokens, lengths, eligible = tokens[0], lengths[0], eligible[0]  # [M, L], [M], [M]
        m, width = tokens.shape
        length = min(self.strategy.length, width)
        positions = torch.arange(width, device=tokens.device)
        # past its end a hypothesis holds a mark of its own, so that no other agrees with it there
        marked = torch.where(positions[None, :] < lengths[:, None], tokens,
                             -1 - torch.arange(m, device=tokens.device)[:, None])  # [M, L]
        if self.provisional:
            best = marked[leader[0]]
            return torch.cat((lengths[leader[0]].reshape(1), best[self.prompt_length:length]))
        first = torch.argmax(eligible.to(torch.long))  # the first eligible hypothesis: the reference
        reference = marked[first]  # [L]
        agree = torch.all((marked == reference[None, :]) | ~eligible[:, None], dim=0)  # [L]
        end = torch.minimum(torch.cumprod(agree.to(torch.long), dim=0).sum(), lengths[first])
        end = torch.where(eligible.any(), end, -1)
        start = self.prompt_length + len(self.shown)
        return torch.cat((end.reshape(1), reference[start:length]))

    def receive(self, values: list[int]) -> None:
        """The host values of :meth:`values`: emit what they add."""
        end, *tokens = values
        if self.provisional:
            self._show(tokens[: max(end - self.prompt_length, 0)], committed=False)
            return
        new = end - self.prompt_length - len(self.shown)
        if new > 0:
            self._commit(tokens[:new])

    def finish(self, result: Any) -> None:
        """After the search: emit the rest of the best hypothesis (and check that the stream led to it)."""
        self.strategy.watch.rider = None
        best = result.sequences[0, 0, self.prompt_length : int(result.lengths[0, 0])].tolist()
        if self.provisional:
            self._show(best, committed=True)
            return
        if best[: len(self.shown)] != self.shown:
            raise RuntimeError(f"streaming committed {self.shown}, which the best hypothesis {best} does not start "
                               "with (please report this)")
        self._commit(best[len(self.shown):], force=True)

    def _commit(self, tokens: list[int], force: bool = False) -> None:
        if tokens or force:
            self.listener(StreamEvent(len(self.shown), tuple(tokens), True))
            self.shown.extend(tokens)

    def _show(self, tokens: list[int], committed: bool) -> None:
        """Provisional: emit the change from what was shown to ``tokens`` (from the first position that differs)."""
        same = 0
        while same < min(len(tokens), len(self.shown)) and tokens[same] == self.shown[same]:
            same += 1
        if committed or same < len(self.shown) or same < len(tokens):
            self.listener(StreamEvent(same, tuple(tokens[same:]), committed))
            self.shown = list(tokens)
