"""The repetition penalty: scale down the scores of tokens already present in the row.

Shape legend: N rows, V vocabulary, t tokens so far (prompt included).
"""

from __future__ import annotations

import numbers

import torch

from .base import LogitsProcessor, check_float, check_int


class RepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """Penalize, once each, the tokens present in the row: ``s * p`` where ``s < 0``, else ``s / p``.

    Args:
        penalty: p > 0; above 1 discourages repetition, below 1 encourages it.
        prompt_ignore_length: leading positions to ignore: an int for all rows, or a LongTensor
            ``[N]`` per row (e.g. the left-padding length of each row). None ignores nothing.

    Ids >= V in the history are ignored (the model cannot produce them).
    """

    def __init__(self, penalty: float, prompt_ignore_length: int | torch.Tensor | None = None):
        self.penalty = check_float("penalty", penalty, 0.0, float("inf"), low_open=True, high_open=True)
        if isinstance(prompt_ignore_length, torch.Tensor):
            if prompt_ignore_length.dim() != 1 or prompt_ignore_length.is_floating_point():
                raise ValueError(
                    "`prompt_ignore_length` must be an int or a 1-D integer tensor, got a "
                    f"{prompt_ignore_length.dtype} tensor of shape {tuple(prompt_ignore_length.shape)}"
                )
        elif prompt_ignore_length is not None:
            if not isinstance(prompt_ignore_length, numbers.Integral):
                raise ValueError(
                    f"`prompt_ignore_length` must be an int or a 1-D tensor, got {prompt_ignore_length!r}"
                )
            prompt_ignore_length = check_int("prompt_ignore_length", prompt_ignore_length, 0)
        self.prompt_ignore_length = prompt_ignore_length

    def select_rows(self, index: torch.Tensor) -> RepetitionPenaltyLogitsProcessor:
        if not isinstance(self.prompt_ignore_length, torch.Tensor):
            return self
        ignore = self.prompt_ignore_length
        return RepetitionPenaltyLogitsProcessor(self.penalty, ignore.index_select(0, index.to(ignore.device)))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        rows, vocab_size = scores.shape
        ignore = self.prompt_ignore_length
        history = input_ids.long().clamp(max=vocab_size)  # ids >= V go to a spare column
        if isinstance(ignore, int):
            history = history[:, ignore:]
        elif isinstance(ignore, torch.Tensor):
            if ignore.shape[0] != input_ids.shape[0]:
                raise ValueError(
                    f"`prompt_ignore_length` has {ignore.shape[0]} rows, input_ids {input_ids.shape[0]}"
                )
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
            history = history.masked_fill(positions < ignore.to(input_ids.device)[:, None], vocab_size)
        seen = torch.zeros(rows, vocab_size + 1, dtype=torch.bool, device=scores.device)
        seen = seen.scatter_(1, history, True)[:, :-1]
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen, penalized, scores)
