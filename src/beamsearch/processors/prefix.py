"""A forced target prefix per example (CTranslate2's ``target_prefix``, OpenNMT-py's ``tgt_prefix``).

Shape legend: N rows, V vocabulary, t tokens so far (prompt included), P longest prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import NEG_INF, LogitsProcessor, check_int


class TargetPrefixLogitsProcessor(LogitsProcessor):
    """Force each example's first generated tokens: at generated position ``i < len(prefix)`` only ``prefix[i]``
    keeps its score, every other token gets ``-inf``; after the prefix, nothing changes.

    The forced token keeps the score it had, so in beam search (whose processors see log-probabilities) the
    prefix's log-probabilities count in the hypothesis score; where processors see raw logits (greedy search,
    sampling, ``semantics="ct2"``) the renormalized forced token scores 0.

    Args:
        prefixes: one list of token ids per row (an empty list: no prefix for that row).
        prompt_length: ``t0``, the start tokens before the generated ones.
    """

    def __init__(self, prefixes: Sequence[Sequence[int]], prompt_length: int):
        rows = [list(p) for p in prefixes]
        for row in rows:
            for token in row:
                check_int("target_prefix token", token, 0)
        width = max((len(r) for r in rows), default=0)
        self.tokens = torch.zeros(len(rows), max(width, 1), dtype=torch.long)  # [N, P]
        for i, row in enumerate(rows):
            self.tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        self.lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)  # [N]
        self.prompt_length = check_int("prompt_length", prompt_length, 0)

    def select_rows(self, index: torch.Tensor) -> TargetPrefixLogitsProcessor:
        kept = TargetPrefixLogitsProcessor.__new__(TargetPrefixLogitsProcessor)
        index = index.to(self.tokens.device)
        kept.tokens, kept.lengths = self.tokens.index_select(0, index), self.lengths.index_select(0, index)
        kept.prompt_length = self.prompt_length
        return kept

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        position = input_ids.shape[1] - self.prompt_length
        if position >= self.tokens.shape[1]:
            return scores
        if self.tokens.shape[0] != scores.shape[0]:
            raise ValueError(f"target_prefix has {self.tokens.shape[0]} rows, the scores {scores.shape[0]}")
        if self.tokens.device != scores.device:
            self.tokens, self.lengths = self.tokens.to(scores.device), self.lengths.to(scores.device)
        if position == 0 and int(self.tokens.max()) >= scores.shape[1]:  # checked once, at the first step
            raise ValueError(f"target_prefix holds token {int(self.tokens.max())}, outside the model's "
                             f"{scores.shape[1]} logits")
        forced = self.tokens[:, position : position + 1]  # [N, 1]
        keep = torch.full_like(scores, NEG_INF).scatter(1, forced, scores.gather(1, forced))
        return torch.where((position < self.lengths)[:, None], keep, scores)


class PrefixBiasLogitsProcessor(LogitsProcessor):
    """Bias, not force, toward each example's prefix (CTranslate2's ``prefix_bias_beta``; Arthur et al., 2019).

    While a row's generated tokens still equal the start of its prefix, its next-token distribution becomes
    ``(1 - beta) * p + beta * onehot(prefix[i])`` at generated position ``i < len(prefix)``; a row that left the
    prefix, or went past it, is not changed. Returns log-probabilities for the biased rows, so it must be the
    last processor before the search normalizes (``build_processors`` puts it there).

    Args:
        prefixes: one list of token ids per row.
        beta: in (0, 1).
        prompt_length: ``t0``.
    """

    def __init__(self, prefixes: Sequence[Sequence[int]], beta: float, prompt_length: int):
        self.forced = TargetPrefixLogitsProcessor(prefixes, prompt_length)  # holds the prefix tensors
        if not 0.0 < beta < 1.0:
            raise ValueError(f"prefix_bias_beta must be in (0, 1), got {beta!r}")
        self.beta = float(beta)

    def select_rows(self, index: torch.Tensor) -> PrefixBiasLogitsProcessor:
        kept = PrefixBiasLogitsProcessor.__new__(PrefixBiasLogitsProcessor)
        kept.forced, kept.beta = self.forced.select_rows(index), self.beta
        return kept

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        prefix, lengths, t0 = self.forced.tokens, self.forced.lengths, self.forced.prompt_length
        position = input_ids.shape[1] - t0
        if position >= prefix.shape[1]:
            return scores
        prefix, lengths = prefix.to(scores.device), lengths.to(scores.device)
        on_prefix = (input_ids[:, t0:] == prefix[:, :position]).all(dim=1) & (position < lengths)  # [N]
        target = prefix[:, position : position + 1]  # [N, 1]
        probs = torch.softmax(scores.float(), dim=-1) * (1.0 - self.beta)
        biased = torch.log(probs.scatter_add(1, target, torch.full_like(target, self.beta, dtype=probs.dtype)))
        return torch.where(on_prefix[:, None], biased.to(scores.dtype), scores)
