"""The processors a captured step can run: the built-in ones that depend only on the length so far.

The search's processors (``processors/pipeline.py``'s :func:`build_processors`, so the same list in the same order as
``generate``) read the length from ``input_ids.shape[-1]``, a host integer, which a captured step cannot change. Each
processor of this table is translated into one that reads the length from a 0-d tensor, the tokens from the fixed ``[N,
L]`` buffer, and masks with tensors prepared before the search; any other processor is refused (the driver refuses the
options that make them first, by name: ``steps/chooser.check_graph_call``). The arithmetic is the eager processors':
-inf where masked, a forced token 0 at its ids and -inf elsewhere, the source-tied limit's ``scores + only_eos``, the
loop guard's windows (each period's fixed window, valid once enough tokens are there).

Legend: N rows, V vocabulary, L = max_length (the token buffer's width).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..processors.limits import SourceTiedMaxLength
from ..processors.masks import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from ..processors.ngrams import LoopGuardLogitsProcessor, _banned_mask
from ..processors.numerics import InfNanRemoveLogitsProcessor, LogitNormalization

# (scores [N, V], tokens [N, L], length 0-d: tokens so far) -> scores [N, V]
GraphProcessor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LengthMask:
    """Mask fixed ids (``ids [V]`` bool) wherever ``applies(length)`` holds (every step when None), in place."""

    def __init__(self, ids: torch.Tensor, applies: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.ids, self.applies = ids, applies

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.ids]

    def __call__(self, scores: torch.Tensor, tokens: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        mask = self.ids if self.applies is None else self.ids & self.applies(length)
        return scores.masked_fill_(mask, float("-inf"))


class LengthForce:
    """Force fixed ids (``forced [V]``: 0 at them, -inf elsewhere) wherever ``applies(length)`` holds."""

    def __init__(self, forced: torch.Tensor, applies: Callable[[torch.Tensor], torch.Tensor]):
        self.forced, self.applies = forced, applies

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.forced]

    def __call__(self, scores: torch.Tensor, tokens: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        return torch.where(self.applies(length), self.forced, scores)


class LengthFree:
    """A processor that reads nothing but the scores (``InfNanRemoveLogitsProcessor``, ``LogitNormalization``)."""

    def __init__(self, processor: Callable[[None, torch.Tensor], torch.Tensor]):
        self.processor = processor

    def static_tensors(self) -> list[torch.Tensor]:
        return []

    def __call__(self, scores: torch.Tensor, tokens: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        return self.processor(None, scores)


class SourceLimit:
    """``SourceTiedMaxLength``: the end token forced (``scores + only_eos``) in the rows whose generated length
    reached their limit (``limits [N]``)."""

    def __init__(self, limits: torch.Tensor, prompt_length: int, only_eos: torch.Tensor):
        self.limits, self.prompt_length, self.only_eos = limits, prompt_length, only_eos

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.limits, self.only_eos]

    def __call__(self, scores: torch.Tensor, tokens: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        at_limit = (length - self.prompt_length) >= self.limits  # [N]
        return torch.where(at_limit[:, None], scores + self.only_eos, scores)


class LoopGuard:
    """``LoopGuardLogitsProcessor`` over the token buffer: for each period p, the last ``repeats * p - 1`` tokens
    (a fixed-size window ending at the length) checked once that many tokens were generated."""

    def __init__(self, processor: LoopGuardLogitsProcessor, device: torch.device):
        self.prompt_length, self.repeats = processor.prompt_length, processor.repeats
        needs = [processor.repeats * period - 1 for period in range(1, processor.max_period + 1)]
        self.offsets = [torch.arange(-need, 0, device=device) for need in needs]  # positions before the length

    def static_tensors(self) -> list[torch.Tensor]:
        return list(self.offsets)

    def __call__(self, scores: torch.Tensor, tokens: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        rows, vocab = scores.shape
        generated = length - self.prompt_length
        mask = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=scores.device)
        for period, offsets in enumerate(self.offsets, 1):
            need = offsets.shape[0]
            window = tokens.index_select(1, (length + offsets).clamp(min=0))  # [N, need]
            periodic = (window[:, period:] == window[:, :-period]).all(dim=1) & (generated >= need)  # [N]
            mask |= _banned_mask(rows, vocab, window[:, need - period, None], periodic[:, None])
        return scores.masked_fill(mask[:, :-1], float("-inf"))


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
        elif isinstance(p, SourceTiedMaxLength):
            only_eos = torch.full((vocab_size,), float("-inf")).index_fill_(0, torch.tensor([p.eos_token_id]), 0.0)
            out.append(SourceLimit(p.limits.to(device), p.prompt_length, only_eos.to(device)))
        elif isinstance(p, LoopGuardLogitsProcessor):
            out.append(LoopGuard(p, device))
        else:
            raise ValueError(f"cuda_graphs=True cannot capture the processor {type(p).__name__}: it reads the "
                             "tokens or the length on the host at every step (leave cuda_graphs unset for it)")
    return out


def processor_tensors(processors: list[GraphProcessor]) -> list[torch.Tensor]:
    """Every tensor the processors read (a captured step holds their addresses)."""
    return [tensor for processor in processors for tensor in processor.static_tensors()]


def run_graph_processors(processors: list[GraphProcessor], scores: torch.Tensor, tokens: torch.Tensor,
                         length: torch.Tensor) -> torch.Tensor:
    """Apply them in order to ``scores [N, V]`` (owned: masked in place), the rows' tokens ``[N, L]`` holding
    ``length`` (0-d) tokens so far."""
    for processor in processors:
        scores = processor(scores, tokens, length)
    return scores
