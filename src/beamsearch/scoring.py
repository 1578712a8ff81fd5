"""Length and coverage penalties of the toolkits (GNMT / OpenNMT / tensor2tensor / transformers / CTranslate2).

Length penalties return the divisor of a summed log-prob; coverage penalties return an amount to
subtract from a score. ``length`` is whatever the calling search counts (documented there).

Legend: ``[...]`` any leading shape, S source positions.
"""

from __future__ import annotations

from typing import Any

import torch


def hf_length_normalised(sum_log_probs: torch.Tensor, generated: Any, length_penalty: float) -> torch.Tensor:
    """transformers' beam score: ``sum_log_probs / generated ** length_penalty``, in that order of operations
    (``generated``: a Python number or a tensor of generated lengths; the dtype is the caller's)."""
    return sum_log_probs / (generated**length_penalty)


def ct2_length_normalised(sum_log_probs: torch.Tensor, lengths: torch.Tensor, length_penalty: float) -> torch.Tensor:
    """CTranslate2's final score: ``sum_log_probs / length ** length_penalty`` (float32; ``0 ** 0 = 1``).

    Args:
        sum_log_probs: FloatTensor ``[...]``.
        lengths: LongTensor ``[...]``, generated tokens, the end token included.
        length_penalty: the exponent.
    """
    return sum_log_probs / torch.pow(lengths.to(torch.float32), length_penalty)


def length_penalty(kind: str, length: int | float, alpha: float) -> float:
    """The divisor applied to a summed log-prob of a hypothesis of this length.

    * ``"hf"`` / ``"avg"``: ``length ** alpha`` (transformers; OpenNMT's "avg", which is the mean log-prob at
      alpha 1);
    * ``"wu"`` / ``"gnmt"``: ``((5 + length) / 6) ** alpha`` (GNMT, Wu et al. 2016; tensor2tensor, OpenNMT);
    * ``"none"``: 1.
    """
    if kind in ("hf", "avg"):
        return float(length) ** alpha
    if kind in ("wu", "gnmt"):
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "none":
        return 1.0
    raise ValueError(f"unknown length penalty {kind!r} (expected hf, avg, wu, gnmt or none)")


def coverage_penalty(kind: str, coverage: torch.Tensor, beta: float) -> torch.Tensor:
    """``[..., S]`` summed attention over the source so far -> ``[...]`` penalty (subtracted from scores).

    * ``"wu"`` (GNMT): ``-beta * sum_s log(min(coverage_s, 1))``: positions attended to less than once in
      total cost a penalty;
    * ``"summary"`` (OpenNMT, for summarisation): ``beta * sum_s (max(coverage_s, 1) - 1)``: attending to a
      position more than once in total costs a penalty;
    * ``"none"``: 0.
    """
    if kind == "wu":
        return -beta * torch.log(coverage.clamp(max=1.0)).sum(dim=-1)
    if kind == "summary":
        return beta * (coverage.clamp(min=1.0).sum(dim=-1) - coverage.shape[-1])
    if kind == "none":
        return torch.zeros(coverage.shape[:-1], dtype=coverage.dtype, device=coverage.device)
    raise ValueError(f"unknown coverage penalty {kind!r} (expected wu, summary or none)")
