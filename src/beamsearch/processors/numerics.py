"""Numeric clean-up processors: replace inf/nan, and renormalize to log-probabilities.

Shape legend: N rows, V vocabulary, t tokens so far (prompt included).
"""

from __future__ import annotations

import torch

from .base import LogitsProcessor


class InfNanRemoveLogitsProcessor(LogitsProcessor):
    """Replace ``nan`` by 0 and ``+inf`` / ``-inf`` by the largest / lowest finite value of the dtype."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        info = torch.finfo(scores.dtype)
        return torch.nan_to_num(scores, nan=0.0, posinf=info.max, neginf=info.min)


class LogitNormalization(LogitsProcessor):
    """Renormalize the scores to log-probabilities: ``log_softmax`` over the vocabulary."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        return scores.log_softmax(dim=-1)
