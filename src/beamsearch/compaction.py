"""Removing finished examples from a search: which examples are still decoded, and where the others' results wait.

An example whose result can no longer change (every row finished in greedy search; in beam search, no live
beam can beat its finished pool, or the pool is full with ``early_stopping=True``) leaves the batch: its rows
leave the model state (the loop's reorder index simply omits them) and the search tensors, and its final
tensors wait in full-batch buffers until :meth:`ActiveExamples.finish`. Results equal decoding without
removal (tokens; scores to float precision, as the model runs on fewer rows); only the model work for finished
examples is saved.

Removal is exact only when nothing else looks at the removed rows: :func:`removal_is_exact` checks that
every processor can drop rows (:meth:`select_rows`) and that every stopping criterion is one whose verdict
for a row does not depend on the other rows.

Legend: B examples, B' active examples, K rows per example.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .stopping import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

_ROW_INDEPENDENT_CRITERIA = (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria)


def removal_is_exact(processors: Iterable[Any], criteria: Iterable[Any]) -> bool:
    """Whether finished examples can leave the batch without changing any result.

    True when every processor has ``select_rows(index)`` (the built-in ones do; it drops any per-row
    state) and every criterion is a built-in max-length, max-time or EOS criterion.
    """
    processors_ok = all(callable(getattr(p, "select_rows", None)) for p in processors)
    return processors_ok and all(type(c) in _ROW_INDEPENDENT_CRITERIA for c in criteria)


class ActiveExamples:
    """The examples still decoded, and a full-batch copy of the results of those that left.

    What is compacted is passed in, never named: the result part is a :class:`~beamsearch.strategies.pool.Hypotheses`
    (or any object with ``take(index)`` and ``put(index, other)`` over its leading, per-example dimension), the
    others are such objects or tensors whose first dimension is the example.

    Args:
        batch_size: B.
        device: where the index tensors live.
    """

    def __init__(self, batch_size: int, device: torch.device):
        self.ids = torch.arange(batch_size, device=device)  # [B'] original position of each active example
        self.results: Any = None  # the full-batch results, once one example left

    def drop(self, done: Sequence[bool], results: Any, others: Sequence[Any]) -> tuple[torch.Tensor, Any, list[Any]]:
        """Move the examples marked ``done`` (host booleans, ``[B']``) out of ``results`` and ``others``.

        Returns:
            ``(keep, results, others)``: LongTensor ``[B'']``, the positions among the ``B'`` active examples of
            those that stay, and the parts holding only those.
        """
        device = self.ids.device
        keep = torch.tensor([i for i, d in enumerate(done) if not d], dtype=torch.long, device=device)
        gone = torch.tensor([i for i, d in enumerate(done) if d], dtype=torch.long, device=device)
        if self.results is None:  # nothing left before: these results are the full batch, in order
            self.results = results
        else:
            self.results.put(self.ids.index_select(0, gone), results.take(gone))
        self.ids = self.ids.index_select(0, keep)
        return keep, results.take(keep), [_take(part, keep) for part in others]

    def finish(self, results: Any) -> Any:
        """The full-batch results: those of the examples that left, and ``results`` for the active ones."""
        if self.results is None:
            return results
        self.results.put(self.ids, results)
        full, self.results = self.results, None
        return full


def _take(part: Any, index: torch.Tensor) -> Any:
    return part.index_select(0, index) if isinstance(part, torch.Tensor) else part.take(index)
