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

Legend: B examples, B' active examples, g leading entries per example (1 for ``[B, K, ...]`` tensors, K for
``[N, ...]`` row tensors), K rows per example.
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
    """The examples still decoded, and full-batch buffers holding the final tensors of those that left.

    Args:
        batch_size: B.
        device: where the index tensors live.
        per_example: attribute names of the owner's tensors with ``g`` leading entries per example; all are
            compacted when examples leave.
        results: the subset of ``per_example`` that makes up the result; kept in full-batch buffers.
        group: g.
    """

    def __init__(self, batch_size: int, device: torch.device, per_example: Sequence[str], results: Sequence[str],
                 group: int = 1):
        self.ids = torch.arange(batch_size, device=device)  # [B'] original position of each active example
        self.per_example, self.results, self.group = tuple(per_example), tuple(results), group
        self.buffers: dict[str, torch.Tensor] | None = None  # full-batch result tensors, once one example left

    def entries(self, examples: torch.Tensor) -> torch.Tensor:
        """Example positions ``[E]`` -> their leading-dimension entries ``[E * g]``."""
        if self.group == 1:
            return examples
        offsets = torch.arange(self.group, device=examples.device)
        return (examples[:, None] * self.group + offsets).reshape(-1)

    def drop(self, owner: Any, done: Sequence[bool]) -> torch.Tensor:
        """Move the examples marked ``done`` (host booleans, ``[B']``) out of ``owner``'s tensors.

        Returns:
            LongTensor ``[B'']``: the positions, among the ``B'`` active examples, of those that stay.
        """
        device = self.ids.device
        keep = torch.tensor([i for i, d in enumerate(done) if not d], dtype=torch.long, device=device)
        gone = torch.tensor([i for i, d in enumerate(done) if d], dtype=torch.long, device=device)
        if self.buffers is None:  # nothing left before: the owner's tensors are the full batch, in order
            self.buffers = {name: getattr(owner, name) for name in self.results}
        else:
            target = self.entries(self.ids.index_select(0, gone))
            for name in self.results:
                self.buffers[name][target] = getattr(owner, name).index_select(0, self.entries(gone))
        kept = self.entries(keep)
        for name in self.per_example:
            setattr(owner, name, getattr(owner, name).index_select(0, kept))
        self.ids = self.ids.index_select(0, keep)
        return keep

    def finish(self, owner: Any) -> None:
        """Put the active examples' result tensors into the buffers and give the owner full-batch tensors."""
        if self.buffers is None:
            return
        target = self.entries(self.ids)
        for name in self.results:
            self.buffers[name][target] = getattr(owner, name)
            setattr(owner, name, self.buffers[name])
        self.buffers = None
