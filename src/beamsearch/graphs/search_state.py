"""What the graph path's strategies share: the flags the host reads every few steps, and why a row stopped.

A captured step cannot raise nor tell the host anything. Each step writes two device booleans, ``[going, failed]``
(:class:`SearchFlags`), which the driver reads every few steps in one small transfer; a step whose scores hold NaN
records its index for the example (the first such step of each example) and the driver raises
:class:`~beamsearch.SearchError` naming the step and the example at its next read, as the eager search does at
the step itself (:mod:`beamsearch.strategies.score_checks` says why a NaN reaches the small tensors flagged).

Legend: B examples (a bucket).
"""

from __future__ import annotations

import torch

from ..errors import SearchError
from ..results import FinishReason


class SearchFlags:
    """``values [2]`` bool: the search goes on, a step's scores held NaN; ``first_invalid [B]``: that step."""

    def __init__(self, examples: int, device: torch.device | str):
        self.values = torch.tensor([True, False], device=device)
        self.first_invalid = torch.full((examples,), -1, dtype=torch.long, device=device)

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.values, self.first_invalid]

    def flag(self, invalid: torch.Tensor, step: torch.Tensor) -> None:
        """``invalid [B]``: the examples whose scores hold NaN at ``step`` (0-d: tokens generated before it)."""
        first = self.first_invalid
        first.copy_(torch.where(invalid & (first < 0), step, first))

    def set_going(self, going: torch.Tensor) -> None:
        """The step's verdict (0-d bool), with whether any example failed so far."""
        self.values.copy_(torch.stack((going, (self.first_invalid >= 0).any())))

    def read(self) -> bool:
        """Whether the search goes on (a host synchronisation).

        Raises:
            SearchError: a step's scores held NaN; names the first such step and its first example.
        """
        going, failed = self.values.tolist()
        if failed:
            steps = self.first_invalid.tolist()
            step = min(s for s in steps if s >= 0)
            example = steps.index(step)
            raise SearchError(f"the scores hold NaN (NaN or +inf logits, or every candidate masked) at step {step} "
                              f"(example {example})", step, example)
        return bool(going)


def stop_reasons(is_eos: torch.Tensor, at_max: torch.Tensor) -> torch.Tensor:
    """:class:`FinishReason` codes of rows that stop (``stopping.classify_stop`` at a tensor length): EOS where the
    new token is an end token, else MAX_LENGTH where ``at_max`` (0-d) holds, else STOP_CRITERION."""
    other = torch.where(at_max, int(FinishReason.MAX_LENGTH), int(FinishReason.STOP_CRITERION))
    return torch.where(is_eos, int(FinishReason.EOS), other)
