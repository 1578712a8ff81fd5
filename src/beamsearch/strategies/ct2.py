"""Beam search with the semantics of CTranslate2 (4.x ``BeamSearch::search`` in ``src/decoding.cc``).

What differs from Hugging Face's beam search (``beam.py``), all reproduced here:

* Processors see the raw ``logits`` and the log-softmax comes after them, so a masked end token
  (``min_new_tokens``) renormalises the other tokens' log-probs.
* Each step keeps C = 2K candidates. A candidate among the first K that ends (end token, or the last
  step) registers a hypothesis with its raw score; its place among the live beams goes to the next
  candidate beyond the first K that does not end, in rank order (if none is left, the ended candidate
  itself stays live). Ending candidates beyond the first K are dropped.
* An example stops at the last step, or once ``round(K * patience)`` hypotheses are registered; when
  ``length_penalty == 0`` (and no coverage penalty) patience is ignored and it stops as soon as the
  best candidate of some step has ended and ``num_return_sequences`` hypotheses are registered.
* The final score is ``sum_log_probs / length ** length_penalty`` where the length counts the end
  token (``decode`` keeps it; the translator strips it from the returned tokens only afterwards);
  hypotheses are sorted by it, best first.

CTranslate2 drops finished examples from the batch; here they stay, masked (nothing more is
registered for them), which gives the same results.

History processors (repetition penalty, n-gram blocking) skip the first start token, as CTranslate2's do
(the engine builds them that way under ``semantics="ct2"``). Coverage penalty and random beam sampling are
rejected; prefix biasing is a processor (``processors/prefix.py``).

Legend: B batch, K beams, C = 2K candidates, N = B*K, V vocabulary, L = max_length, t tokens so far,
t0 start tokens, G = L - t0 generated positions, P = num_return_sequences (the kept hypotheses).
"""

from __future__ import annotations

import math

import torch

from ..beams import flatten_beams, unflatten_beams
from ..processors.pipeline import run_processors
from ..results import SearchResult
from ..scoring import ct2_length_normalised
from ..selection import top_totals
from ..stopping import classify_stop
from .base import MASK, StepTrace
from .pool import Hypotheses, PoolSearch, first_live
from .score_checks import check_enough_hypotheses
from .validation import ct2_max_hypotheses


class CT2BeamSearch(PoolSearch):
    """CTranslate2's beam search (``semantics="ct2"``, ``num_beams > 1``)."""

    def __init__(self, input_ids, max_length, processors, criteria, *, options, fill_token_id, trace: StepTrace,
                 source_lengths=None):
        super().__init__(input_ids, options.num_beams, max_length, processors, criteria, trace)
        (b, t0), k, device = input_ids.shape, options.num_beams, input_ids.device
        self.eos_token_id = options.eos_token_id
        self.length_penalty = 0.0 if options.length_penalty_type == "none" else float(options.length_penalty)
        self.num_return_sequences = n = options.num_return_sequences
        self.max_hypotheses = ct2_max_hypotheses(k, options.patience)
        self.early_exit = self.length_penalty == 0.0
        # live: the K beams (CTranslate2's alive_seq), scored by their sums of log-probs; hypotheses: the P
        # registered ones ("finished"; a slot may hold an unregistered candidate, or nothing), scored by their final
        # scores, "sum_log_probs" their sums
        self.live = Hypotheses.start(input_ids, k, max_length, fill_token_id, scores=first_live(b, k, MASK, device))
        self.hypotheses = Hypotheses.empty(input_ids, n, max_length, fill_token_id, -math.inf).replace(
            sum_log_probs=torch.full((b, n), -math.inf, device=device))
        self.num_registered = torch.zeros(b, dtype=torch.long, device=device)  # [B]
        self.top_beam_ended = torch.zeros(b, dtype=torch.bool, device=device)  # [B]
        self.example_done = torch.zeros(b, dtype=torch.bool, device=device)  # [B]
        self._done = max_length <= t0

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """One step; returns the flat parent row of each new live beam, ``[N]``."""
        b = self.batch_size
        if self.length == self.prompt_length:
            check_enough_hypotheses(self.rows_per_example, self.num_return_sequences, logits.shape[-1],
                                    self.eos_token_id, self.max_length - self.prompt_length)
        scores = run_processors(self.processors, self.tokens(), logits, owned and self.trace.logits is None)
        log_probs = torch.log_softmax(scores, dim=-1)  # [N, V]
        self.trace.record(log_probs, logits)
        self.watch.start(self.length - self.prompt_length, logits, scores)
        candidates = self._grow(unflatten_beams(log_probs, b))  # [B, C]
        ended = self.criteria(flatten_beams(candidates.tokens[:, :, : self.length + 1]), self.trace.scores)
        ended = ended.reshape(b, -1) | (self.length + 1 >= self.max_length)  # [B, C]
        registered = ended[:, : self.rows_per_example] & ~self.example_done[:, None]  # [B, K]
        self._register(registered, candidates)
        self.live = candidates.gather(self._live_positions(ended, registered))  # [B, K]
        self.length += 1
        self._update_example_done()
        return self.live.beam_indices[:, :, self.length - 1 - self.prompt_length].reshape(-1)  # [N]

    def _grow(self, log_probs: torch.Tensor) -> Hypotheses:
        """The top C = 2K continuations of each example, scored by their sums of log-probs; ``log_probs [B, K, V]``."""
        b, k, vocab = log_probs.shape
        scores, flat = top_totals(log_probs, self.live.scores, 2 * k)  # [B, C]: topk of the [B, K*V] sums
        self.watch.flag(torch.isnan(scores).any(dim=1) & ~self.example_done)  # NaN ranks first; done ones are final
        parents, tokens = flat // vocab, flat % vocab  # [B, C]
        rows = parents + torch.arange(b, device=flat.device)[:, None] * k  # [B, C] flat rows
        token_log_probs = torch.gather(log_probs.reshape(b, k * vocab), 1, flat)  # [B, C]
        candidates = self.live.extend(parents, tokens, token_log_probs, rows, self.length)
        candidates.scores = scores
        return candidates

    def _register(self, registered: torch.Tensor, candidates: Hypotheses) -> None:
        """Add the ended candidates among the first K (``registered [B, K]``); keep the best P by final score."""
        k, n = self.rows_per_example, self.num_return_sequences
        first = candidates.map(lambda value: value[:, :k])  # [B, K]
        generated = self.length + 1 - self.prompt_length  # the end token counts, as in CTranslate2's decode
        reasons = classify_stop(flatten_beams(first.tokens[:, :, : self.length + 1]), flatten_beams(registered),
                                self.eos_token_id, self.max_length).reshape(registered.shape)  # [B, K]
        final = ct2_length_normalised(first.scores, torch.full_like(reasons, generated), self.length_penalty)
        self.num_registered += registered.sum(dim=-1)
        self.top_beam_ended |= registered[:, 0]
        merged_valid = torch.cat((self.hypotheses.finished, registered), dim=1)  # [B, P + K]
        merged_final = torch.cat((self.hypotheses.scores, final), dim=1)
        order = torch.sort(merged_final, dim=1, descending=True, stable=True)[1]
        order = torch.take_along_dim(order, torch.sort(merged_valid.gather(1, order).int(), dim=1, descending=True,
                                                       stable=True)[1], dim=1)[:, :n]  # [B, P] valid first, best first
        self.hypotheses = self.hypotheses.merge(
            first.replace(scores=final, sum_log_probs=first.scores, finished=registered, reasons=reasons), order)

    def _live_positions(self, ended: torch.Tensor, registered: torch.Tensor) -> torch.Tensor:
        """Which candidate fills each live beam (positions ``[B, K]``, from ``ended [B, C]`` and ``registered [B, K]``):
        itself, or if it was registered, the next unended secondary one."""
        k = self.rows_per_example
        secondary_ended = ended[:, k:]  # [B, K]
        unended_first = torch.sort(secondary_ended.int(), dim=1, stable=True)[1] + k  # [B, K] unended in rank order
        available = (~secondary_ended).sum(dim=1, keepdim=True)  # [B, 1]
        rank = torch.cumsum(registered.long(), dim=1) - 1  # [B, K] the j-th registered takes the j-th unended
        replaced = registered & (rank < available)
        own = torch.arange(k, device=ended.device).expand_as(rank)
        return torch.where(replaced, unended_first.gather(1, rank.clamp(min=0)), own)

    def _update_example_done(self) -> None:
        if self.length >= self.max_length:
            self.example_done[:] = True
        elif self.early_exit:
            self.example_done |= self.top_beam_ended & (self.num_registered >= self.num_return_sequences)
        else:
            self.example_done |= self.num_registered >= self.max_hypotheses

    def is_done(self) -> bool:
        return self._done or self.watch.read(torch.all(self.example_done).reshape(1))[0]

    def result(self) -> SearchResult:
        # the generated lengths are the counts of beam_indices >= 0 (for a registered hypothesis, the end included)
        return self.hypotheses.result(self.num_return_sequences, self.trace, self.watch,
                                      sum_log_probs=self.hypotheses.sum_log_probs)
