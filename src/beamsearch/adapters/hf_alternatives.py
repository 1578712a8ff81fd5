"""Alternatives at the first free position (CTranslate2's ``return_alternatives``), for Hugging Face models.

After each example's target prefix (none: the first generated token), the ``k`` most likely next tokens are
taken (end-of-sequence tokens masked before the softmax), and each is continued to the end by the same search
(greedy or beam search) with the prefix and that token forced: an interactive-translation view of "what else
could come here".
The alternatives are returned in the order of that token's probability, not re-ranked by their final scores,
and each score counts the alternative token's own log-probability (not the prefix's), as CTranslate2 does
(greedy continuation under ``semantics="ct2"`` equals its ``return_alternatives``; the tests check it).

Legend: B examples, k alternatives, T total length, T' generated positions, S source positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..results import SearchResult
from .hf import search_model


@torch.no_grad()
def search_alternatives(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                        num_alternatives: int, target_prefix: Sequence[Sequence[int]] | None = None,
                        **kwargs: Any) -> SearchResult:
    """Decode ``num_alternatives`` continuations per example, one per most likely token after its prefix.

    Args:
        model: a Hugging Face model; ``input_ids`` / ``attention_mask`` ``[B, S]`` as for ``generate``.
        num_alternatives: k >= 1.
        target_prefix: per example, the forced tokens before the alternatives (default none).
        **kwargs: the generation options of the continuation (``num_beams``, ``semantics``, ...);
            ``num_return_sequences`` must stay 1.

    Returns:
        A :class:`~beamsearch.SearchResult` with ``sequences`` ``[B, k, T]`` (``beam_indices`` omitted: they
        would index the expanded batch).
    """
    if isinstance(num_alternatives, bool) or not isinstance(num_alternatives, int) or num_alternatives < 1:
        raise ValueError(f"num_alternatives must be an integer >= 1, got {num_alternatives!r}")
    if kwargs.get("num_return_sequences", 1) != 1:
        raise ValueError("search_alternatives returns one hypothesis per alternative: leave num_return_sequences 1")
    for name in ("max_rows", "output_scores", "output_logits", "do_sample"):
        if kwargs.get(name):
            raise ValueError(f"{name} is not supported with search_alternatives")
    b, k = input_ids.shape[0], num_alternatives
    prefixes = [list(p) for p in (target_prefix if target_prefix is not None else [[]] * b)]
    if len(prefixes) != b:
        raise ValueError(f"target_prefix must hold one list of token ids per example ({b})")
    masks = {} if attention_mask is None else {"attention_mask": attention_mask}
    greedy = {name: value for name, value in kwargs.items()
              if name not in ("num_beams", "early_stopping", "max_new_tokens", "max_length")}
    first = search_model(model, input_ids=input_ids, **masks, **greedy, num_beams=1, output_scores=True,
                         return_dict_in_generate=True, target_prefix=prefixes,
                         max_new_tokens=max(map(len, prefixes)) + 1, remove_finished=False)
    eos = kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    chosen, chosen_log_probs = [], []
    for example, prefix in enumerate(prefixes):
        if len(prefix) >= len(first.scores):
            raise ValueError(f"example {example}: its prefix leaves no free position within the length limit")
        scores = first.scores[len(prefix)][example].float()  # the processed logits (greedy search)
        eos_ids = torch.tensor(eos, dtype=torch.long, device=scores.device)
        log_probs = torch.log_softmax(scores.index_fill(0, eos_ids, -torch.inf), dim=-1)
        top = torch.topk(log_probs, k)  # the end is no alternative: masked before the softmax, as CTranslate2
        if not torch.isfinite(top.values).all():
            raise ValueError(f"example {example}: fewer than {k} tokens are possible after its prefix")
        chosen.extend(prefix + [token] for token in top.indices.tolist())
        chosen_log_probs.extend(top.values.tolist())
    expanded = {"input_ids": input_ids.repeat_interleave(k, dim=0)}
    if attention_mask is not None:
        expanded["attention_mask"] = attention_mask.repeat_interleave(k, dim=0)
    result = search_model(model, **expanded, **kwargs, target_prefix=chosen)
    if kwargs.get("num_beams", model.generation_config.num_beams or 1) == 1:
        result = _score_alternative_tokens(result, chosen, chosen_log_probs, kwargs.get("length_penalty"), model)
    return _regroup(result, b, k)


def _score_alternative_tokens(result: SearchResult, chosen: list[list[int]], log_probs: list[float],
                              length_penalty: float | None, model: Any) -> SearchResult:
    """Greedy search scores forced tokens 0: give each alternative token its own log-probability back."""
    token_log_probs = result.token_log_probs.clone()  # [B * k, 1, T']
    for row, (tokens, value) in enumerate(zip(chosen, log_probs, strict=True)):
        token_log_probs[row, 0, len(tokens) - 1] = value
    total = token_log_probs.sum(dim=-1)
    if length_penalty is None:
        length_penalty = model.generation_config.length_penalty
    penalty = 1.0 if length_penalty is None else length_penalty
    generated = (result.lengths - result.prompt_length).clamp(min=1).to(total.dtype)
    return dataclasses.replace(result, token_log_probs=token_log_probs, sum_log_probs=total,
                               sequences_scores=total / generated**penalty)


def _regroup(result: SearchResult, b: int, k: int) -> SearchResult:
    """``[B * k, 1, ...]`` -> ``[B, k, ...]``."""

    def group(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.reshape(b, k, *tensor.shape[2:])

    return SearchResult(
        sequences=group(result.sequences), sequences_scores=group(result.sequences_scores),
        sum_log_probs=group(result.sum_log_probs), token_log_probs=group(result.token_log_probs),
        lengths=group(result.lengths), finish_reason=group(result.finish_reason),
        prompt_length=result.prompt_length, alignments=group(result.alignments),
    )
