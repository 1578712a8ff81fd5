"""What the decode loop needs from a search strategy, and the per-step trace both strategies keep.

Legend: B batch, K rows per example (beams, or samples), N = B*K, V vocabulary, t tokens so far.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..results import SearchResult

# The score of a masked beam or candidate (transformers' -1e9): large and finite, so that adding it keeps
# arithmetic exact where -inf would give NaN (-inf - -inf), and a beam with it drops out of any top-k. One
# constant for every strategy; the toolkits' own values (OpenNMT's -65504, tensor2tensor's 1e7) are theirs.
MASK = -1.0e9


class Processor(Protocol):
    """A logits processor: ``(input_ids [N, t], scores [N, V]) -> scores [N, V]`` (Hugging Face's protocol)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor: ...


class Criterion(Protocol):
    """A stopping criterion: ``(input_ids [N, t], scores) -> BoolTensor [N]``, True where a row must stop."""

    def __call__(self, input_ids: torch.Tensor, scores: Any) -> torch.Tensor: ...


class Strategy(Protocol):
    """A search strategy. It never touches the model: it returns parent rows and the loop reorders state."""

    rows_per_example: int

    def tokens(self) -> torch.Tensor:
        """The tokens so far, ``[N, t]``, start tokens included: what the model sees next."""

    def advance(
        self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False
    ) -> torch.Tensor | None:
        """Consume one step of raw logits ``[N, V]`` (float32); return parent rows ``[N]`` or None if unchanged.

        ``attention`` is the step's attention over the source, ``[N, S]``, when the step function returns
        one (coverage penalties need it); ``owned``: no one else holds ``logits``, so the strategy may change
        them in place. Strategies that do not use either ignore it.
        """

    def is_done(self) -> bool:
        """Whether the search is over (the one host synchronisation per step)."""

    def result(self) -> SearchResult:
        """The final result."""


class StepTrace:
    """Per-step tensors a user asked for: processed scores and raw logits, each ``[N, V]`` per step."""

    def __init__(self, keep_scores: bool, keep_logits: bool):
        self.scores: list[torch.Tensor] | None = [] if keep_scores else None
        self.logits: list[torch.Tensor] | None = [] if keep_logits else None

    def record(self, scores: torch.Tensor, logits: torch.Tensor) -> None:
        if self.scores is not None:
            self.scores.append(scores.clone())
        if self.logits is not None:
            self.logits.append(logits.clone())

    def as_tuples(self) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
        scores = tuple(self.scores) if self.scores is not None else None
        logits = tuple(self.logits) if self.logits is not None else None
        return scores, logits
