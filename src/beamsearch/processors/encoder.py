"""Processors that look at the source (the encoder's input ids; for decoder-only models, the prompt).

Blenderbot's stock generation config sets ``encoder_no_repeat_ngram_size=3``: these reproduce transformers'
``EncoderRepetitionPenaltyLogitsProcessor`` and ``EncoderNoRepeatNGramLogitsProcessor``. The source ids are
taken as given, padding included, as transformers takes them.

Shape legend: N rows, V vocabulary, t tokens so far (prompt included), S source length.
"""

from __future__ import annotations

import torch

from .base import NEG_INF, LogitsProcessor, check_float, check_int


def _source_rows(name: str, encoder_input_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(encoder_input_ids, torch.Tensor) or encoder_input_ids.dim() != 2:
        raise ValueError(f"`{name}` needs the source ids as a [N, S] LongTensor")
    if encoder_input_ids.is_floating_point():
        raise ValueError(f"`{name}` needs integer source ids, got {encoder_input_ids.dtype}")
    return encoder_input_ids.long()


class EncoderRepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """Scale the scores of the tokens present in the row's source by ``1 / penalty``: with penalty > 1 they are
    encouraged (a hallucination penalty: ``s / p`` where ``s < 0``, else ``s * p``).

    Transformers before 5.19 gathered the ``[B, S]`` source ids from the ``[B*K, V]`` scores, so that row ``r < B``
    took example ``r``'s source and the other rows none: ``applies`` ``[N]`` (with ``encoder_input_ids`` holding the
    source of example ``r`` in row ``r``) reproduces that; None: every row, its own example's source.

    Args:
        penalty: p > 0.
        encoder_input_ids: LongTensor ``[N, S]``, each row's source ids.
        applies: BoolTensor ``[N]``, the rows penalised (None: all).
    """

    def __init__(self, penalty: float, encoder_input_ids: torch.Tensor, applies: torch.Tensor | None = None):
        self.encoder_penalty = check_float("encoder_repetition_penalty", penalty, 0.0, float("inf"), low_open=True,
                                           high_open=True)
        self.penalty = 1 / self.encoder_penalty  # transformers' arithmetic: multiply by 1 / p, divide by 1 / p
        self.encoder_input_ids = _source_rows("encoder_repetition_penalty", encoder_input_ids)
        self.applies = applies

    def select_rows(self, index: torch.Tensor) -> EncoderRepetitionPenaltyLogitsProcessor:
        applies = None if self.applies is None else self.applies.index_select(0, index.to(self.applies.device))
        return EncoderRepetitionPenaltyLogitsProcessor(self.encoder_penalty,
                                                       self.encoder_input_ids.index_select(0, index), applies)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        source = self.encoder_input_ids.to(scores.device)  # [N, S]
        score = torch.gather(scores, 1, source)  # [N, S]
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        processed = scores.scatter(1, source, score)
        if self.applies is None:
            return processed
        return torch.where(self.applies.to(scores.device)[:, None], processed, scores)


class EncoderNoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Ban every token that would complete an n-gram of the row's source.

    With ``t`` tokens so far, the next token completes an n-gram whose first ``n - 1`` tokens are the row's last
    ``n - 1``; every occurrence of that prefix in the source bans the source token that followed it (n = 1: every
    source token). Nothing is banned while the row has fewer than ``n - 1`` tokens.

    Args:
        ngram_size: n > 0.
        encoder_input_ids: LongTensor ``[N, S]``, each row's source ids.
    """

    def __init__(self, ngram_size: int, encoder_input_ids: torch.Tensor):
        self.ngram_size = check_int("encoder_no_repeat_ngram_size", ngram_size, 1)
        self.encoder_input_ids = _source_rows("encoder_no_repeat_ngram_size", encoder_input_ids)

    def select_rows(self, index: torch.Tensor) -> EncoderNoRepeatNGramLogitsProcessor:
        return EncoderNoRepeatNGramLogitsProcessor(self.ngram_size, self.encoder_input_ids.index_select(0, index))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        n, length = self.ngram_size, input_ids.shape[-1]
        source = self.encoder_input_ids.to(input_ids.device)  # [N, S]
        starts = source.shape[1] - n + 1  # the source's n-grams, one per start position
        if length < n - 1 or starts < 1:
            return scores
        hit = torch.ones(source.shape[0], starts, dtype=torch.bool, device=input_ids.device)  # [N, starts]
        for j in range(n - 1):  # position j of each source n-gram against the row's j-th last-(n-1) token
            hit &= source[:, j : j + starts] == input_ids[:, length - n + 1 + j, None]
        vocab_size = scores.shape[-1]
        banned = source[:, n - 1 :].clamp(max=vocab_size)  # [N, starts]; ids >= V go to a spare column
        mask = torch.zeros(source.shape[0], vocab_size + 1, dtype=torch.bool, device=scores.device)
        mask.scatter_(1, torch.where(hit, banned, vocab_size), True)
        return scores.masked_fill(mask[:, :-1], NEG_INF)
