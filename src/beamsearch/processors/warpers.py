"""Sampling warpers: temperature, and the filters that keep only part of the distribution.

Every filter sets removed entries to ``filter_value`` (``-inf``) and keeps at least
``min_tokens_to_keep`` tokens. Ties are treated as in Hugging Face: top-k, epsilon and eta keep every
token tied with the last kept one; top-p, min-p and typical break ties in sort / top-k order.

Shape legend: N rows, V vocabulary, t tokens so far (prompt included).
"""

from __future__ import annotations

import math

import torch

from .base import LogitsProcessor, check_float, check_int


class TemperatureLogitsWarper(LogitsProcessor):
    """Divide the scores by the temperature.

    Args:
        temperature: > 0; below 1 sharpens the distribution, above 1 flattens it.
    """

    def __init__(self, temperature: float):
        self.temperature = check_float(
            "temperature", temperature, 0.0, math.inf, low_open=True, high_open=True
        )

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        return scores / self.temperature


class _Filter(LogitsProcessor):
    """Shared arguments of the filtering warpers."""

    def __init__(self, filter_value: float, min_tokens_to_keep: int):
        self.filter_value = filter_value
        self.min_tokens_to_keep = check_int("min_tokens_to_keep", min_tokens_to_keep, 1)

    def _kth_largest(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """The k-th largest score of each row (k clipped to V): ``[N, 1]``."""
        return scores.topk(min(k, scores.shape[-1]), dim=-1).values[:, -1:]


class TopKLogitsWarper(_Filter):
    """Keep the ``max(top_k, min_tokens_to_keep)`` highest scores, and every score tied with the last.

    Args:
        top_k: int > 0.
        filter_value: the value of removed entries.
        min_tokens_to_keep: int >= 1.
    """

    def __init__(self, top_k: int, filter_value: float = -math.inf, min_tokens_to_keep: int = 1):
        super().__init__(filter_value, min_tokens_to_keep)
        self.top_k = max(check_int("top_k", top_k, 1), self.min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        return scores.masked_fill(scores < self._kth_largest(scores, self.top_k), self.filter_value)


class TopPLogitsWarper(_Filter):
    """Nucleus filtering: drop the least likely tokens whose cumulative probability is ``<= 1 - top_p``.

    Tokens are accumulated from the least likely up (ascending sort of the scores, then softmax
    and cumulative sum); the ``min_tokens_to_keep`` most likely are always kept.

    Args:
        top_p: in [0, 1].
        filter_value: the value of removed entries.
        min_tokens_to_keep: int >= 1.
    """

    def __init__(self, top_p: float, filter_value: float = -math.inf, min_tokens_to_keep: int = 1):
        self.top_p = check_float("top_p", top_p, 0.0, 1.0, low_open=False, high_open=False)
        super().__init__(filter_value, min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        ascending, order = torch.sort(scores, descending=False)  # [N, V]
        drop_sorted = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p)
        drop_sorted[:, -self.min_tokens_to_keep :] = False
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        return scores.masked_fill(drop, self.filter_value)


class MinPLogitsWarper(_Filter):
    """Drop tokens whose probability is below ``min_p`` times the row's highest probability.

    Args:
        min_p: in [0, 1].
        filter_value: the value of removed entries.
        min_tokens_to_keep: int >= 1; the most probable ones are kept.
    """

    def __init__(self, min_p: float, filter_value: float = -math.inf, min_tokens_to_keep: int = 1):
        self.min_p = check_float("min_p", min_p, 0.0, 1.0, low_open=False, high_open=False)
        super().__init__(filter_value, min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        probs = scores.softmax(dim=-1)
        drop = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        keep = probs.topk(min(self.min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
        drop.scatter_(1, keep, False)
        return scores.masked_fill(drop, self.filter_value)


class TypicalLogitsWarper(_Filter):
    """Locally typical filtering: keep the tokens whose surprisal is closest to the row's entropy.

    Tokens are ranked by ``|-log p - H|``; the smallest set holding probability mass ``mass`` is
    kept, plus every token ranked as far as the last one kept, plus the first ``min_tokens_to_keep``.

    Args:
        mass: typical_p, in (0, 1).
        filter_value: the value of removed entries.
        min_tokens_to_keep: int >= 1.
    """

    def __init__(self, mass: float = 0.9, filter_value: float = -math.inf, min_tokens_to_keep: int = 1):
        self.mass = check_float("mass", mass, 0.0, 1.0, low_open=True, high_open=True)
        super().__init__(filter_value, min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        log_probs = scores.log_softmax(dim=-1)
        entropy = -(log_probs * log_probs.exp()).nansum(dim=-1, keepdim=True)  # [N, 1]
        distance = (log_probs + entropy).abs()  # |-log p - H|, [N, V]
        ranked, order = torch.sort(distance, descending=False)
        mass = scores.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (mass < self.mass).sum(dim=-1, keepdim=True).clamp_(max=scores.shape[-1] - 1)  # [N, 1]
        drop = distance > ranked.gather(1, last)
        drop.scatter_(1, order[:, : self.min_tokens_to_keep], False)
        return scores.masked_fill(drop, self.filter_value)


class EpsilonLogitsWarper(_Filter):
    """Drop tokens with probability below ``epsilon``, keeping at least the ``min_tokens_to_keep`` best.

    Args:
        epsilon: in (0, 1).
        filter_value: the value of removed entries.
        min_tokens_to_keep: int >= 1 (ties with the last of them are kept too).
    """

    def __init__(self, epsilon: float, filter_value: float = -math.inf, min_tokens_to_keep: int = 1):
        self.epsilon = check_float("epsilon", epsilon, 0.0, 1.0, low_open=True, high_open=True)
        super().__init__(filter_value, min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        drop = scores.softmax(dim=-1) < self.epsilon
        drop &= scores < self._kth_largest(scores, self.min_tokens_to_keep)
        return scores.masked_fill(drop, self.filter_value)


class EtaLogitsWarper(_Filter):
    """Drop tokens with probability below ``eta = min(epsilon, sqrt(epsilon) * exp(-H))``, H the entropy.

    Args:
        epsilon: eta_cutoff, in (0, 1).
        filter_value: the value of removed entries.
        min_tokens_to_keep: int >= 1 (ties with the last of them are kept too).
        device: accepted for Hugging Face compatibility.
    """

    def __init__(
        self,
        epsilon: float,
        filter_value: float = -math.inf,
        min_tokens_to_keep: int = 1,
        device: object = None,
    ):
        self.epsilon = check_float("epsilon", epsilon, 0.0, 1.0, low_open=True, high_open=True)
        super().__init__(filter_value, min_tokens_to_keep)
        # A 0-d default-dtype tensor, so that eta rounds exactly as in Hugging Face.
        self._epsilon = torch.tensor(self.epsilon)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        log_probs = scores - scores.logsumexp(dim=-1, keepdim=True)  # as torch.distributions.Categorical
        finite = log_probs.clamp(min=torch.finfo(log_probs.dtype).min)
        entropy = -(finite * log_probs.softmax(dim=-1)).sum(dim=-1, keepdim=True)  # [N, 1]
        eta = torch.minimum(self._epsilon, self._epsilon.sqrt() * (-entropy).exp())
        drop = scores.softmax(dim=-1) < eta
        drop &= scores < self._kth_largest(scores, self.min_tokens_to_keep)
        return scores.masked_fill(drop, self.filter_value)
