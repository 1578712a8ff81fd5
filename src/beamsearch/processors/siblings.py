"""fairseq's diverse siblings search (Li, Monroe & Jurafsky 2016) as a beam search processor.

Shape legend: N rows (beams), V vocabulary, t tokens so far (prompt included), k = 2 x num_beams.
"""

from __future__ import annotations

import torch

from .base import NEG_INF, LogitsProcessor, check_float, check_int


class SiblingDiversityLogitsProcessor(LogitsProcessor):
    """Penalize siblings: each beam keeps only its ``k = 2 x num_beams`` best next tokens, the r-th best of them
    (r = 1..k) losing ``r x diversity_rate``; every other token gets ``-inf``. From the second generated token
    on, as fairseq's ``DiverseSiblingsSearch`` (``--diversity-rate``); its first step is plain beam search.

    Beam search then takes its candidates from these penalized scores, and the penalties stay in the
    hypotheses' scores, as in fairseq. With ``diversity_rate=0`` it only drops tokens that could not be chosen.
    Pass it in ``logits_processor=[...]`` with ``num_beams > 1`` (it acts on the log-probabilities beam search
    gives its processors).

    Args:
        diversity_rate: the penalty per sibling rank, >= 0.
        num_beams: K.
        prompt_length: the start tokens before the generated ones (1 for an encoder-decoder's decoder start).
    """

    def __init__(self, diversity_rate: float, num_beams: int, prompt_length: int):
        self.diversity_rate = check_float("diversity_rate", diversity_rate, 0.0, float("inf"), low_open=False,
                                          high_open=True)
        self.num_beams = check_int("num_beams", num_beams, 1)
        self.prompt_length = check_int("prompt_length", prompt_length, 0)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]`` (log-probabilities). Returns: scores ``[N, V]``."""
        if input_ids.shape[1] <= self.prompt_length:  # the first generated token: plain beam search
            return scores
        k = min(2 * self.num_beams, scores.shape[1])
        top, tokens = torch.topk(scores, k, dim=-1)  # [N, k], best first
        ranks = torch.arange(1, k + 1, device=scores.device, dtype=scores.dtype) * self.diversity_rate
        return torch.full_like(scores, NEG_INF).scatter(1, tokens, top - ranks)
