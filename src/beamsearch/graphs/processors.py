"""The processors a captured step can run: the built-in ones that depend only on the length so far.

The search's processors (``processors/pipeline.py``'s :func:`build_processors`, so the same list in the same
order as ``generate``) read the length from ``input_ids.shape[-1]``, a host integer, which a captured step cannot
change. Each processor of this table is translated into one that reads the length from a 0-d tensor and masks with
a ``[V]`` vocabulary mask prepared before the search; any other processor is refused (the driver refuses the
options that make them first, by name: ``eligibility.py``).
The masks are those of ``processors/masks.py``: -inf where masked, and for a forced token 0 at its ids and -inf
elsewhere.

Legend: N rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..processors.masks import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from ..processors.numerics import InfNanRemoveLogitsProcessor, LogitNormalization

GraphProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (scores [N, V], length 0-d) -> scores


class LengthMask:
    """Mask fixed ids (``ids [V]`` bool) wherever ``applies(length)`` holds (every step when None), in place."""

    def __init__(self, ids: torch.Tensor, applies: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.ids, self.applies = ids, applies

    def __call__(self, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        mask = self.ids if self.applies is None else self.ids & self.applies(length)
        return scores.masked_fill_(mask, float("-inf"))


class LengthForce:
    """Force fixed ids (``forced [V]``: 0 at them, -inf elsewhere) wherever ``applies(length)`` holds."""

    def __init__(self, forced: torch.Tensor, applies: Callable[[torch.Tensor], torch.Tensor]):
        self.forced, self.applies = forced, applies

    def __call__(self, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        return torch.where(self.applies(length), self.forced, scores)


class LengthFree:
    """A processor that reads nothing but the scores (``InfNanRemoveLogitsProcessor``, ``LogitNormalization``)."""

    def __init__(self, processor: Callable[[None, torch.Tensor], torch.Tensor]):
        self.processor = processor

    def __call__(self, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        return self.processor(None, scores)


def graph_processors(processors: list, vocab_size: int, device: torch.device) -> list[GraphProcessor]:
    """The graph-safe form of each of ``processors`` (a built :class:`ProcessorList`, user processors refused
    before), in order.

    Raises:
        ValueError: naming the option of a processor a captured step cannot run.
    """
    def ids_mask(ids: tuple[int, ...]) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[[token for token in ids if token < vocab_size]] = True
        return mask.to(device)

    def forced(ids: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(vocab_size).masked_fill(~ids_mask(ids).cpu(), float("-inf")).to(device)

    out: list[GraphProcessor] = []
    for p in processors:
        if isinstance(p, MinLengthLogitsProcessor):
            out.append(LengthMask(ids_mask(p.eos_token_id), lambda t, m=p.min_length: t < m))
        elif isinstance(p, MinNewTokensLengthLogitsProcessor):
            out.append(LengthMask(ids_mask(p.eos_token_id),
                                  lambda t, s=p.prompt_length_to_skip, m=p.min_new_tokens: t - s < m))
        elif isinstance(p, SuppressTokensLogitsProcessor):
            out.append(LengthMask(ids_mask(p.suppress_tokens)))
        elif isinstance(p, SuppressTokensAtBeginLogitsProcessor):
            out.append(LengthMask(ids_mask(p.begin_suppress_tokens), lambda t, b=p.begin_index: t == b))
        elif isinstance(p, ForcedBOSTokenLogitsProcessor):
            out.append(LengthForce(forced((p.bos_token_id,)), lambda t: t == 1))
        elif isinstance(p, ForcedEOSTokenLogitsProcessor):
            out.append(LengthForce(forced(p.eos_token_id), lambda t, m=p.max_length: t == m - 1))
        elif isinstance(p, (InfNanRemoveLogitsProcessor, LogitNormalization)):
            out.append(LengthFree(p))
        else:
            raise ValueError(f"cuda_graphs=True cannot capture the processor {type(p).__name__}: it reads the "
                             "tokens or the length on the host at every step (leave cuda_graphs unset for it)")
    return out


def run_graph_processors(processors: list[GraphProcessor], scores: torch.Tensor,
                         length: torch.Tensor) -> torch.Tensor:
    """Apply them in order to ``scores [N, V]`` (owned: masked in place) at ``length`` (0-d, tokens so far)."""
    for processor in processors:
        scores = processor(scores, length)
    return scores
