"""Custom ranking of finished hypotheses in beam search: a sequence-scoring hook and a de-duplicated n-best.

Both act inside the search, where hypotheses enter the finished pool, not on the returned list: a hypothesis
that scores low under the hook, or repeats a key already in the pool, leaves room for another one.

Legend: B' examples, C candidates per example, K pool size, G generated positions, M = B' * C.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

# (generated tokens [M, g], their log-probs [M, g], generated lengths [M]) -> scores [M]
SequenceScorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
UniqueKey = Callable[[Sequence[int]], Hashable]


def check_ranking(sequence_scorer: Any, unique: Any) -> UniqueKey | None:
    """Validate the options; returns the key function of ``unique`` (None when not de-duplicating)."""
    if sequence_scorer is not None and not callable(sequence_scorer):
        raise ValueError(f"sequence_scorer must be callable, got {type(sequence_scorer).__name__}")
    if unique is None or unique is False:
        return None
    if unique is True:
        return tuple
    if not callable(unique):
        raise ValueError(f"unique must be True, False or a key function of the token list, got {unique!r}")
    return unique


def score_candidates(scorer: SequenceScorer, sequences: torch.Tensor, token_log_probs: torch.Tensor,
                     prompt_length: int, generated: int) -> torch.Tensor:
    """The hook's scores of candidates that all have ``generated`` tokens: ``[B', C, L]`` -> ``[B', C]``."""
    b, c = sequences.shape[:2]
    tokens = sequences[:, :, prompt_length : prompt_length + generated].reshape(b * c, generated)
    log_probs = token_log_probs[:, :, :generated].reshape(b * c, generated)
    lengths = torch.full((b * c,), generated, dtype=torch.long, device=sequences.device)
    scores = scorer(tokens, log_probs, lengths)
    if not isinstance(scores, torch.Tensor) or scores.shape != (b * c,):
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"sequence_scorer must return a tensor of shape [{b * c}] (one score per hypothesis), "
                         f"got {got}")
    return scores.to(torch.float32).reshape(b, c)


class PoolKeys:
    """The keys of each example's finished pool, kept on the host (one synchronisation per step with candidates).

    Args:
        key: the key function of a generated token list.
        prompt_length: t0, the start tokens (not part of the key).
    """

    def __init__(self, key: UniqueKey, prompt_length: int):
        self.key, self.prompt_length = key, prompt_length

    def _keys(self, sequences: torch.Tensor, lengths: Sequence[int]) -> list[Hashable]:
        rows = sequences.tolist()
        return [self.key(row[self.prompt_length : length]) for row, length in zip(rows, lengths, strict=True)]

    def dedupe(self, penalised: torch.Tensor, just_finished: torch.Tensor, sequences: torch.Tensor, length: int,
               pool_scores: torch.Tensor, pool_finished: torch.Tensor, pool_sequences: torch.Tensor,
               pool_lengths: torch.Tensor, drop: float) -> None:
        """Give ``drop`` (in place) to candidates whose key is already taken by a better pool entry or candidate,
        and free (``pool_finished`` False, score ``drop``) pool entries that a better candidate with their key
        replaces. ``penalised`` / ``just_finished`` ``[B', C]``; ``pool_*`` ``[B', K]``; ``length`` = t + 1."""
        rows = just_finished.any(dim=1).nonzero().squeeze(1).tolist()
        for b in rows:
            taken: dict[Hashable, tuple[float, int | None]] = {}  # key -> (score, pool slot or None: candidate)
            slots = pool_finished[b].nonzero().squeeze(1).tolist()
            if slots:
                keys = self._keys(pool_sequences[b, slots], pool_lengths[b, slots].tolist())
                for slot, key, score in zip(slots, keys, pool_scores[b, slots].tolist(), strict=True):
                    if key not in taken or score > taken[key][0]:
                        taken[key] = (score, slot)
            candidates = just_finished[b].nonzero().squeeze(1).tolist()
            scores = penalised[b, candidates].tolist()
            keys = self._keys(sequences[b, candidates], [length] * len(candidates))
            for c, key, score in sorted(zip(candidates, keys, scores, strict=True), key=lambda x: -x[2]):
                if key in taken and taken[key][0] >= score:
                    penalised[b, c] = drop
                    continue
                if key in taken and taken[key][1] is not None:  # the candidate replaces a worse pool entry
                    slot = taken[key][1]
                    pool_scores[b, slot], pool_finished[b, slot] = drop, False
                taken[key] = (score, None)
