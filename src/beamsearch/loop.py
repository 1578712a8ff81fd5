"""The decode loop: model step -> strategy (processors, selection, stopping) -> state reorder.

Legend: B batch, K rows per example, N = B*K, V vocabulary, t tokens so far.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .beams import reorder_state
from .results import SearchResult
from .strategies.base import Strategy

StepFn = Callable[[torch.Tensor, Any], tuple]  # -> (logits, state) or (logits, state, attention)


def decode(step: StepFn, state: Any, strategy: Strategy, batch_size: int) -> SearchResult:
    """Drive ``step`` until the strategy is done.

    Args:
        step: ``(tokens [N, t], state) -> (logits [N, V], state)``, or ``(logits, state, attention [N, S])``
            when a coverage penalty needs the attention over the source; the model never sees beams. A step
            with the attribute ``fresh_logits = True`` promises a new logits tensor each call, that no one else
            holds: the search may then mask it in place instead of copying it.
        state: the model state for the ``B`` examples (row dimension first), expanded here to ``N`` rows.
        strategy: owns the search tensors; returns parent rows after each step.
        batch_size: B.
    """
    device = strategy.tokens().device
    expand = torch.arange(batch_size, device=device).repeat_interleave(strategy.rows_per_example)  # [N]
    state = reorder_state(state, expand)
    fresh = bool(getattr(step, "fresh_logits", False))
    while not strategy.is_done():
        out = step(strategy.tokens(), state)
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            got = type(out).__name__
            raise ValueError(f"step must return (logits, state) or (logits, state, attention), got {got}")
        logits, state, *extra = out
        _check_logits(logits, strategy.tokens().shape[0])
        scores = logits.float()  # a copy unless float32 already
        parents = strategy.advance(scores, extra[0] if extra else None, owned=fresh or scores is not logits)
        if parents is not None:
            state = reorder_state(state, parents)
    return strategy.result()


def _check_logits(logits: torch.Tensor, rows: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != rows:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"step must return logits of shape [N={rows}, V], got {shape}")
