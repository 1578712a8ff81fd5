"""The hypotheses a search keeps: one type for live beams, candidates and finished pools.

A :class:`Hypotheses` holds M hypotheses of each of B examples as ``[B, M, ...]`` tensors, one per field:

- ``tokens`` ``[B, M, L]`` LongTensor: the start tokens, the generated tokens, then fill tokens;
- ``scores`` ``[B, M]`` float: what ranks them (see the glossary in docs/design.md: a total of log-probs for
  live beams, a penalised score in a finished pool, a Gumbel key...);
- ``token_log_probs`` ``[B, M, G]`` float32: each generated token's log-prob, 0 after the end;
- ``beam_indices`` ``[B, M, G]`` LongTensor: the flat row each token was chosen from, -1 after the end;
- any other ``[B, M, ...]`` field a strategy adds (finish reasons, finished flags, alignments, constraint state).

Every operation applies to all fields alike, so that a strategy never lists them: :meth:`gather` picks
hypotheses per example, :meth:`merge` joins a pool with new hypotheses and keeps some, :meth:`extend` makes
children of parents with one more token, :meth:`where` chooses per example between two pools, and
:meth:`result` builds the :class:`SearchResult`. The same fields leave and rejoin the batch through
:meth:`take` and :meth:`put` (the compaction protocol of :class:`beamsearch.compaction.ActiveExamples`).
All of it is indexing: no arithmetic, so results are those of the strategies' own formulas.

Legend: B examples, M hypotheses per example, L = max_length, G = L - t0 generated positions, t0 start tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..beams import flat_rows, flatten_beams, gather_beams
from ..results import FinishReason, SearchResult
from .score_checks import ScoreWatch


class Hypotheses:
    """M hypotheses per example; every field a ``[B, M, ...]`` tensor (see the module docstring).

    Args:
        prompt_length: t0, the start tokens at the head of ``tokens``.
        **fields: the tensors; a field given as None is absent.
    """

    def __init__(self, prompt_length: int, **fields: torch.Tensor | None):
        object.__setattr__(self, "prompt_length", prompt_length)
        object.__setattr__(self, "fields", {name: value for name, value in fields.items() if value is not None})

    @classmethod
    def start(cls, input_ids: torch.Tensor, count: int, max_length: int, fill_token_id: int,
              **fields: torch.Tensor | None) -> Hypotheses:
        """``count`` hypotheses per example holding only the start tokens ``input_ids [B, t0]``.

        ``tokens`` is ``[B, count, max(L, t0)]`` (fill tokens after t0), ``token_log_probs`` zeros and
        ``beam_indices`` -1, both ``[B, count, G]``; ``fields`` adds the rest (``scores`` among them).
        """
        b, t0 = input_ids.shape
        g = max(max_length - t0, 0)
        tokens = torch.full((b, count, max(max_length, t0)), fill_token_id, dtype=torch.long, device=input_ids.device)
        tokens[:, :, :t0] = input_ids[:, None, :]
        return cls(t0, tokens=tokens, token_log_probs=torch.zeros(b, count, g, device=input_ids.device),
                   beam_indices=torch.full((b, count, g), -1, dtype=torch.long, device=input_ids.device), **fields)

    @classmethod
    def empty(cls, input_ids: torch.Tensor, count: int, max_length: int, fill_token_id: int, score: float,
              dtype: torch.dtype = torch.float32) -> Hypotheses:
        """A finished pool with ``count`` empty places per example: ``scores`` all ``score`` (``dtype``),
        ``finished`` False, ``reasons`` 0 (``FinishReason.NONE``)."""
        b, device = input_ids.shape[0], input_ids.device
        return cls.start(input_ids, count, max_length, fill_token_id,
                         scores=torch.full((b, count), score, dtype=dtype, device=device),
                         finished=torch.zeros(b, count, dtype=torch.bool, device=device),
                         reasons=torch.zeros(b, count, dtype=torch.long, device=device))

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(f"no hypothesis field {name!r}") from None

    def __setattr__(self, name: str, value: torch.Tensor) -> None:
        self.fields[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Hypotheses:
        """A new pool with ``fn`` applied to every field."""
        return Hypotheses(self.prompt_length, **{name: fn(value) for name, value in self.fields.items()})

    def replace(self, **changes: torch.Tensor) -> Hypotheses:
        """A shallow copy with some fields replaced or added."""
        return Hypotheses(self.prompt_length, **{**self.fields, **changes})

    def gather(self, index: torch.Tensor) -> Hypotheses:
        """The hypotheses at ``index`` (LongTensor ``[B, M']`` of positions within each example)."""
        flat = flat_rows(index, self.tokens.shape[1])  # the same rows of every field
        return self.map(lambda value: gather_beams(value, index, flat))

    def merge(self, new: Hypotheses, keep: torch.Tensor) -> Hypotheses:
        """Join this pool ``[B, M, ...]`` and ``new`` ``[B, M2, ...]`` (same fields) and keep ``keep [B, M']``.

        ``keep`` indexes the joined ``[B, M + M2]`` hypotheses: positions below M are this pool's.
        """
        flat = flat_rows(keep, self.tokens.shape[1] + new.tokens.shape[1])
        return Hypotheses(self.prompt_length, **{
            name: gather_beams(torch.cat((value, new.fields[name]), dim=1), keep, flat)
            for name, value in self.fields.items()})

    def extend(self, parents: torch.Tensor, tokens: torch.Tensor, token_log_probs: torch.Tensor,
               rows: torch.Tensor, length: int) -> Hypotheses:
        """Children: the hypotheses at ``parents`` with one more token at position ``length``.

        Args:
            parents: LongTensor ``[B, C]`` of positions within each example.
            tokens: LongTensor ``[B, C]``, the new tokens.
            token_log_probs: float32 ``[B, C]``, their log-probs.
            rows: LongTensor ``[B, C]``, the flat row each was chosen from (``beam_indices``).
            length: t, the tokens before this one (start tokens included).
        """
        children = self.gather(parents)
        position = length - self.prompt_length
        children.tokens[:, :, length] = tokens
        children.token_log_probs[:, :, position] = token_log_probs
        children.beam_indices[:, :, position] = rows
        return children

    def where(self, choose: torch.Tensor, other: Hypotheses) -> Hypotheses:
        """Per example, this pool where ``choose [B]`` holds, else ``other`` (same fields and shapes)."""
        def pick(name: str, value: torch.Tensor) -> torch.Tensor:
            return torch.where(choose.reshape(-1, *([1] * (value.dim() - 1))), value, other.fields[name])

        return Hypotheses(self.prompt_length, **{name: pick(name, value) for name, value in self.fields.items()})

    def take(self, index: torch.Tensor) -> Hypotheses:
        """The examples at ``index`` (LongTensor ``[E]`` into the leading dimension), every field."""
        return self.map(lambda value: value.index_select(0, index))

    def put(self, index: torch.Tensor, other: Hypotheses) -> None:
        """In place: the examples at ``index [E]`` take ``other``'s values (``other`` has E examples)."""
        for name, value in self.fields.items():
            value[index] = other.fields[name]

    def result(self, count: int, trace: Any, watch: Any, *, scores: torch.Tensor | None = None,
               finish_reason: torch.Tensor | None = None, result_type: type = SearchResult,
               **extra: Any) -> SearchResult:
        """The first ``count`` hypotheses of each example as a result, cut to the longest generated length.

        Args:
            count: n, hypotheses returned per example.
            trace: the search's :class:`~beamsearch.strategies.base.StepTrace`.
            watch: its :class:`~beamsearch.strategies.score_checks.ScoreWatch` (reads the width, a host sync).
            scores: ``[B, n]`` ``sequences_scores``; default the ``scores`` field.
            finish_reason: ``[B, n]``; default the ``reasons`` field where ``finished`` holds, else NONE.
            result_type: :class:`SearchResult` or a subclass; ``extra`` fills its other fields.
        """
        t0 = self.prompt_length
        beam_indices = self.beam_indices[:, :count]  # [B, n, G]
        generated = (beam_indices >= 0).sum(dim=-1)  # [B, n]
        width = watch.read_max(generated)
        token_log_probs = self.token_log_probs[:, :count, :width]
        if finish_reason is None:
            finish_reason = torch.where(self.finished[:, :count], self.reasons[:, :count], int(FinishReason.NONE))
        step_scores, logits = trace.as_tuples()
        fields = dict(sum_log_probs=token_log_probs.sum(dim=-1), alignments=None)
        if "alignments" in self:
            fields["alignments"] = self.alignments[:, :count, :width]
        fields.update(extra)
        return result_type(
            sequences=self.tokens[:, :count, : t0 + width],
            sequences_scores=self.scores[:, :count] if scores is None else scores,
            token_log_probs=token_log_probs,
            lengths=t0 + generated,
            finish_reason=finish_reason,
            prompt_length=t0,
            scores=step_scores,
            logits=logits,
            beam_indices=beam_indices[:, :, :width],
            **fields,
        )


class PoolSearch:
    """What the strategies over pools share: their configuration, the step's length and the live pool's tokens.

    A subclass keeps its K live hypotheses per example in ``self.live`` (:class:`Hypotheses` ``[B, K, ...]``),
    whose tokens the model sees next.

    Args:
        input_ids: LongTensor ``[B, t0]``, the start tokens.
        rows_per_example: K.
        max_length: L, start tokens included.
        processors, criteria, trace: the search's processors, stopping criteria and step trace.
    """

    live: Hypotheses
    recorder: Any = None  # a trace.TraceRecorder while tracing (beam search calls it once per step)

    def __init__(self, input_ids: torch.Tensor, rows_per_example: int, max_length: int, processors: Any,
                 criteria: Any, trace: Any):
        self.batch_size, self.prompt_length = input_ids.shape
        self.rows_per_example, self.max_length = rows_per_example, max_length
        self.processors, self.criteria, self.trace = processors, criteria, trace
        self.length = self.prompt_length  # t: tokens so far, start tokens included
        self.watch = ScoreWatch()  # NaN in the step's scores, read with the step's one host sync

    def tokens(self) -> torch.Tensor:
        return flatten_beams(self.live.tokens[:, :, : self.length])  # [N, t]


def first_live(batch_size: int, count: int, dead: float, device: torch.device) -> torch.Tensor:
    """Initial scores ``[B, count]`` float32: 0 for the first hypothesis, ``dead`` for the others (only the first
    beam is expanded at the first step, so that the K beams do not repeat each other)."""
    scores = torch.full((batch_size, count), dead, device=device)
    scores[:, 0] = 0.0
    return scores
