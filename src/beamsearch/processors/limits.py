"""A generated-length limit tied to each example's source length (fairseq's ``max_len_a * src_len + max_len_b``).

Shape legend: N rows, V vocabulary, t tokens so far (prompt included).
"""

from __future__ import annotations

import torch


class SourceTiedMaxLength:
    """Force the end-of-sequence token once a row has generated ``floor(a * source_length + b)`` tokens.

    As in fairseq's ``SequenceGenerator``, every other token gets ``-inf`` at that step, so the
    hypothesis ends there with its EOS (at most ``limit + 1`` generated tokens, EOS included). Unlike
    fairseq, which uses the padded length of the whole source batch, ``source_length`` is each
    example's own, so a result does not depend on what it was batched with.

    Args:
        a, b: the limit's slope and intercept.
        source_lengths: LongTensor ``[N]``, the source length of each row's example.
        prompt_length: ``t0``, the number of start tokens (not counted as generated).
        eos_token_id: the token forced at the limit (the first EOS id).
    """

    def __init__(self, a: float, b: int, source_lengths: torch.Tensor, prompt_length: int, eos_token_id: int):
        self.limits = torch.floor(a * source_lengths.double() + b).long()  # [N]
        self.prompt_length = prompt_length
        self.eos_token_id = eos_token_id
        # no row is at its limit before this many generated tokens: the steps before it change nothing (a bound read
        # once here, so that those steps cost no host read; rows leaving the batch only raise the true minimum)
        self.earliest = int(self.limits.min()) if self.limits.numel() else 0

    def select_rows(self, index: torch.Tensor) -> SourceTiedMaxLength:
        """This limit for the rows ``index`` only (finished examples removed)."""
        kept = SourceTiedMaxLength.__new__(SourceTiedMaxLength)
        kept.limits = self.limits.index_select(0, index.to(self.limits.device))
        kept.prompt_length, kept.eos_token_id, kept.earliest = self.prompt_length, self.eos_token_id, self.earliest
        return kept

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        generated = input_ids.shape[1] - self.prompt_length
        if generated < self.earliest:
            return scores
        at_limit = generated >= self.limits.to(scores.device)  # [N]
        only_eos = torch.full_like(scores, -float("inf"))
        only_eos[:, self.eos_token_id] = 0.0
        return torch.where(at_limit[:, None], scores + only_eos, scores)
