"""Ensembles: decode with several models at once, their next-token distributions averaged at every step.

``mode="prob"`` averages probabilities (fairseq's ``EnsembleModel``; OpenNMT-py's ``avg_raw_probs``);
``mode="log"`` averages log-probabilities (OpenNMT-py's default). Optional weights make either a weighted mean.
The search normalizes what a step returns (``log_softmax``), so "log" decodes with the normalized geometric mean
(a product of experts); OpenNMT-py adds the unnormalized mean to its beam scores, which differs by a constant per
row and step, so its hypotheses can rank differently.
The combined step returns log-probabilities, and its state is a tuple with each model's own state, so the
engine reorders every model's cache together.

Legend: M models, N rows, V vocabulary, t tokens so far, S source positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

MODES = ("log", "prob")


def ensemble_step(steps: Sequence[Callable], mode: str = "log", weights: Sequence[float] | None = None) -> Callable:
    """One step function for M models: ``(tokens [N, t], states: tuple of M) -> (log-probs [N, V], states)``.

    Args:
        steps: each model's step function (``(tokens, state) -> (logits, state)`` or with attention ``[N, S]``
            as a third output, which is then averaged too).
        mode: "log" (mean of log-probabilities) or "prob" (log of the mean of probabilities).
        weights: one non-negative weight per model (normalized to sum to 1); default equal.

    Raises:
        ValueError: no steps, an unknown mode, or weights of the wrong number or sign.
    """
    steps = list(steps)
    if not steps or not all(callable(s) for s in steps):
        raise ValueError("ensemble_step needs a non-empty list of step functions")
    if mode not in MODES:
        raise ValueError(f"ensemble mode must be one of {MODES}, got {mode!r}")
    if weights is None:
        weights = [1.0] * len(steps)
    weights = [float(w) for w in weights]
    if len(weights) != len(steps) or any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"ensemble weights must be {len(steps)} non-negative numbers, not all 0, got {weights}")
    share = [w / sum(weights) for w in weights]

    def step(tokens: torch.Tensor, states: tuple) -> tuple:
        if not isinstance(states, tuple) or len(states) != len(steps):
            raise ValueError(f"the ensemble state must be a tuple of {len(steps)} model states")
        log_probs, new_states, attentions = [], [], []
        for i, (model_step, state) in enumerate(zip(steps, states, strict=True)):
            logits, state, *extra = model_step(tokens, state)
            if log_probs and logits.shape != log_probs[0].shape:
                raise ValueError(f"ensemble model {i} returns logits of shape {tuple(logits.shape)}, model 0 "
                                 f"{tuple(log_probs[0].shape)}: the models must share the target vocabulary")
            log_probs.append(torch.log_softmax(logits.float(), dim=-1))
            new_states.append(state)
            attentions.extend(extra[:1])
        stacked = torch.stack(log_probs)  # [M, N, V]
        if mode == "log":
            combined = sum(w * lp for w, lp in zip(share, log_probs, strict=True))
        else:
            offsets = torch.tensor([math.log(w) if w > 0 else -math.inf for w in share], device=stacked.device)
            combined = torch.logsumexp(stacked + offsets[:, None, None], dim=0)
        if len(attentions) == len(steps):
            attention = sum(w * a.float() for w, a in zip(share, attentions, strict=True))
            return combined, tuple(new_states), attention
        return combined, tuple(new_states)

    step.fresh_logits = True  # computed here (see loop.decode)
    return step
