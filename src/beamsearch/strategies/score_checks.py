"""Checks on the scores of a step (NaN, rows with nothing to sample) and on beams too many for the vocabulary.

Why a small tensor suffices to find a NaN. A softmax or log-softmax row holding a NaN, a +inf (``inf - inf``) or
no finite score at all (``-inf - -inf``) is NaN throughout: its maximum and its sum are NaN, and every entry is
computed from them. ``torch.max`` returns a NaN and ``torch.topk`` ranks it above every number. So a NaN anywhere
in a row reaches what a strategy already reduces the row to: the chosen tokens' log-probs ``[N]``, the best
candidates' totals ``[B, C]``, the first column of a softmax ``[N]``. Strategies hand such a tensor to
:meth:`ScoreWatch.flag` and read it in the same transfer as their "all done?" check (:meth:`ScoreWatch.read`):
no pass over ``[N, V]`` and no extra host synchronisation. Only once the flag is up are the step's tensors
searched, to say what went wrong.

Rows whose every score is -inf (a processor masked every token), in transformers 5.x and so here:

- greedy search: ``argmax`` takes token 0 (``max`` too); the token's log-prob is -inf (log-softmax would say NaN);
- sampling: the softmax is NaN and ``torch.multinomial`` raises RuntimeError; we raise :class:`SearchError`;
- beam search: processors run after the log-softmax, so a masked beam's candidates total -inf and the example's
  other beams fill in; with every beam of an example masked the example stops and returns its finished
  hypotheses, padded with placeholders scored -1e9; we return the same;
- beam sampling: as beam search while one beam of the example keeps a finite score, else as sampling (an error).

Logits that the model itself returns all -inf, or holding NaN or +inf, make beam search's log-softmax NaN
(transformers returns NaN scores) and greedy search's chosen log-prob NaN: we raise. The other toolkits' beam
searches raise on NaN alike; stochastic beam search keeps treating a fully masked row as a dead end.

Legend: B batch (B' examples still decoded), K rows per example, N = B*K, V vocabulary, C candidates per example,
R rows sampled from, X entries per row.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import SearchError


class ScoreWatch:
    """NaN in the scores of the current step: flagged on small tensors, read with the step's host sync."""

    def __init__(self) -> None:
        self._step: tuple | None = None  # start()'s arguments: the step under watch
        self._invalid: torch.Tensor | None = None  # [B'] bool
        # a listener whose small tensor rides along with every read (streaming: the committed prefix), so that it
        # costs no host sync of its own; None (the default) leaves read() as it was
        self.rider: Any = None

    def start(self, step: int, logits: torch.Tensor, scores: torch.Tensor | None = None,
              example_ids: torch.Tensor | None = None, masked_rows_allowed: bool = False) -> None:
        """Watch a step (its tensors are kept until it is read, only to name what went wrong).

        Args:
            step: tokens generated before this step (0 for the first): the index into ``result.scores``.
            logits: FloatTensor ``[N', V]``, the step's logits as the model returned them.
            scores: FloatTensor ``[N', V]`` after the processors, or None.
            example_ids: LongTensor ``[B']``, the original index of each example still decoded (None: all are).
            masked_rows_allowed: the strategy copes with rows of ``scores`` that are all -inf but flags them with
                the NaN rows (it cannot tell them apart cheaply): when the flag is up, ``scores`` decides.
        """
        self._step, self._invalid = (step, logits, scores, example_ids, masked_rows_allowed), None

    def flag(self, invalid: torch.Tensor) -> None:
        """``invalid``: BoolTensor ``[B']``, the examples whose scores hold NaN (or'ed with earlier flags)."""
        self._invalid = invalid if self._invalid is None else self._invalid | invalid

    def read(self, values: torch.Tensor) -> list:
        """``values.tolist()`` for a 1-D tensor ``[X]``, the step's flag read in the same host transfer.

        Raises:
            SearchError: the scores of the watched step hold NaN; names the step and the first such example.
        """
        if self.rider is not None:
            return self._read_with_rider(values)
        invalid, self._invalid = self._invalid, None
        if invalid is None:
            return values.tolist()
        *values, failed = torch.cat((values.reshape(-1), invalid.any().reshape(1).to(values.dtype))).tolist()
        if failed and not self._only_masked_rows(invalid):
            raise SearchError(*self._describe(invalid))
        self._step = None  # the step's tensors are no longer needed
        return values

    def _read_with_rider(self, values: torch.Tensor) -> list:
        """``read(values)`` with the rider's ``values() -> LongTensor [X']`` in the same transfer; the rider's
        ``receive(list)`` gets its part. Bool values come back as bools."""
        rider, self.rider = self.rider, None
        try:
            extra = rider.values()
            dtype = torch.promote_types(values.dtype, extra.dtype)
            count = values.numel()
            joined = self.read(torch.cat((values.reshape(-1).to(dtype), extra.to(device=values.device, dtype=dtype))))
        finally:
            self.rider = rider
        rider.receive([int(v) for v in joined[count:]])
        head = joined[:count]
        return [bool(v) for v in head] if values.dtype == torch.bool else head

    def close(self) -> None:
        """Read a flag still pending (after a last step that ended without a host sync)."""
        if self._invalid is not None:
            self.read(self._invalid.new_zeros(0))

    def read_max(self, tensor: torch.Tensor) -> int:
        """``int(tensor.max())`` (0 for an empty tensor), with a flag still pending read in the same transfer:
        strategies call it in ``result`` (the width of the result), so that the last step costs no host sync."""
        if not tensor.numel():
            self.close()
            return 0
        return int(self.read(tensor.max().reshape(1))[0])

    def _only_masked_rows(self, invalid: torch.Tensor) -> bool:
        """Whether the flagged examples' processed scores hold no NaN nor +inf (so only all -inf rows), where the
        strategy allows those."""
        *_, scores, _, masked_rows_allowed = self._step
        if not masked_rows_allowed:
            return False
        flagged = invalid.repeat_interleave(scores.shape[0] // invalid.shape[0])  # [N']
        return not bool((torch.isnan(scores[flagged]) | torch.isposinf(scores[flagged])).any())

    def _describe(self, invalid: torch.Tensor) -> tuple[str, int, int]:
        """The error's message, step and example."""
        step, logits, scores, example_ids, _ = self._step
        index = int(torch.nonzero(invalid)[0, 0])
        k = logits.shape[0] // invalid.shape[0]
        rows = slice(index * k, (index + 1) * k)
        example = index if example_ids is None else int(example_ids[index])
        what = describe_rows(logits[rows], None if scores is None else scores[rows])
        return f"{what} at step {step} (example {example})", step, example


def describe_rows(logits: torch.Tensor, scores: torch.Tensor | None) -> str:
    """What makes an example's scores NaN: ``logits [K, V]`` as the model returned them, ``scores [K, V]`` processed."""
    for tensor, name in ((logits, "the model's logits"), (scores, "the processed scores")):
        if tensor is None:
            continue
        if torch.isnan(tensor).any():
            return f"{name} hold NaN"
        if torch.isposinf(tensor).any():
            return f"{name} hold +inf"
        if torch.isneginf(tensor).all(dim=-1).any():
            return f"{name} are -inf for every token (nothing left to choose from)"
    return "the candidates' scores hold NaN (every candidate is masked, or a NaN arose in the search)"


def sample(probs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.multinomial(probs, count)`` (without replacement) over softmax rows that may hold no distribution.

    A softmax row is either a distribution or NaN throughout (see the module docstring), so its first entry tells.
    torch checks ``probs`` itself: on the CPU that raises RuntimeError, caught here; elsewhere it is an asynchronous
    device assert that would leave the device unusable, so there the rows without a distribution are made uniform
    first (one elementwise pass, on those devices only). Either way the caller gets samples for every row and
    reports the invalid rows at its host sync, through :class:`ScoreWatch`.

    Args:
        probs: FloatTensor ``[R, X]``, softmax rows.
        count: samples per row, at most X.

    Returns:
        ``(samples [R, count], invalid [R])``: LongTensor samples (meaningless in the invalid rows) and a BoolTensor
        of the rows with no distribution.
    """
    invalid = torch.isnan(probs[:, 0])  # [R]
    if probs.device.type == "cpu":
        try:
            return torch.multinomial(probs, count), invalid
        except RuntimeError:
            invalid = ~torch.isfinite(probs).all(dim=-1)  # the error path: check every entry
    return torch.multinomial(torch.where(invalid[:, None], 1.0, probs), count), invalid


def count_continuations(vocab: int, eos_token_id: tuple[int, ...] | None, new_tokens: int, cap: int) -> int:
    """How many distinct continuations of at most ``new_tokens`` tokens ``vocab`` logits allow (one ends at its
    first end-of-sequence token), counted up to ``cap``."""
    num_eos = len({token for token in eos_token_id or () if 0 <= token < vocab})
    ended, running = 0, 1
    for _ in range(new_tokens):
        ended, running = ended + running * num_eos, running * (vocab - num_eos)
        if ended + running >= cap:
            return cap
    return ended + running


def check_enough_hypotheses(num_beams: int, num_return_sequences: int, vocab: int,
                            eos_token_id: tuple[int, ...] | None, new_tokens: int) -> None:
    """Refuse a beam search that would return placeholder hypotheses (score -1e9) for want of candidates.

    The first step extends one beam per example: with more beams than tokens, the beams beyond the V candidates
    are placeholders, as in transformers. They drop out once real hypotheses outnumber the beams, and are
    returned exactly when fewer distinct hypotheses exist than ``num_return_sequences`` (e.g. 41 beams over 40
    tokens for one new token). So the search refuses that case only: a beam as wide as every hypothesis of a
    tiny vocabulary (an exhaustive search) stays allowed, and returns what transformers returns.

    Raises:
        SearchError: naming num_beams, the vocabulary size and num_return_sequences.
    """
    if num_beams <= vocab:  # then num_return_sequences <= vocab <= the continuations of one token
        return
    available = count_continuations(vocab, eos_token_id, new_tokens, num_return_sequences)
    if available < num_return_sequences:
        raise SearchError(
            f"num_beams ({num_beams}) is larger than the vocabulary size ({vocab}), and only {available} distinct "
            f"hypotheses of at most {new_tokens} new tokens exist, fewer than num_return_sequences "
            f"({num_return_sequences}): the result would hold placeholder hypotheses scored -1e9"
        )
