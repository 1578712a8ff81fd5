"""Beam search with the semantics of OpenNMT-py (3.x ``onmt.translate.beam_search.BeamSearch``).

What differs from Hugging Face's beam search (``beam.py``), all reproduced here:

* Each step keeps the top K candidates only, ranked by ``cumulative_log_prob / lp(step + 1)`` where
  ``step`` counts the tokens so far with the start token (so the first generated token is scored
  with ``lp(2)``) and ``lp`` is ``length_penalty_type`` (OpenNMT's default ``"avg"``: ``length ** alpha``;
  ``"wu"``: ``((5 + length) / 6) ** alpha``; ``"none"``) with alpha = ``length_penalty``.
* A candidate that ends with the end token is a finished hypothesis scored with that same normalised
  value, minus the coverage penalty (``coverage_penalty`` "wu" or "summary", weight ``coverage_beta``,
  on the attention summed over the steps); its beam stays in the search with a cumulative log-prob of
  -65504, so it drops out next step. With ``stepwise_penalty`` the coverage penalty is folded into the
  live scores at every step instead.
* An example is done when, at a step where some of its beams end, its best beam has ended (or with
  ``ratio > 0``: when its best live score over ``ratio x source length`` no longer beats the best
  finished score per token) and it holds at least ``num_return_sequences`` (``n_best``) hypotheses.
  It returns its ``n_best`` best hypotheses. At the length limit every beam is a hypothesis; with
  ``max_length_ratio`` (OpenNMT's translate default 1.25) the limit is ``int(max_length_ratio * S + 5)``
  generated tokens for a source of S tokens, if lower (OpenNMT takes the batch's padded S).
* ``block_ngram_repeat`` (n >= 2) forbids a token that would repeat an n-gram of the beam (start token
  included), except n-grams containing a token of ``ignore_when_blocking``; blocked candidates get
  -1e21. As in OpenNMT, n = 1 blocks nothing.
* ``min_new_tokens`` (OpenNMT's ``min_length``) masks the end token through the processors.

Differences kept on purpose (OpenNMT-py 3.5 quirks that depend on batch composition): OpenNMT drops finished
examples from its batch but not from its n-gram blocking state (``forbidden_tokens``), and indexes its
per-beam source lengths by example number for ``ratio``; with several examples in a batch both can mix examples
up (measured with blocking, batches of 3: 11 of 600 examples differ; one example at a time: none). Here
every example keeps its own state. Source positions that received no attention at all (padding) are left out
of the coverage penalty, where OpenNMT's "wu" would count ``log 0``. The end token masked by
``min_new_tokens`` gets ``-inf`` rather than OpenNMT's -65504 (the same unless fewer than K other tokens
exist).

Legend: B batch, K beams, N = B*K, V vocabulary, S source positions, L = max_length, t tokens so
far, t0 start tokens, G = L - t0 generated positions, P = num_return_sequences.
"""

from __future__ import annotations

import math

import torch

from ..beams import flat_parent_rows, flatten_beams, gather_beams, unflatten_beams
from ..processors.pipeline import run_processors
from ..results import SearchResult
from ..scoring import coverage_penalty, length_penalty
from ..stopping import classify_stop
from .base import StepTrace
from .pool import Hypotheses, PoolSearch, first_live

DEAD = -65504.0  # OpenNMT's cumulative log-prob for a beam that ended
BLOCKED = -10e20  # OpenNMT's score for a token that would repeat an n-gram
EMPTY = -1.0e10  # OpenNMT's initial best finished score per token (ratio)


class ONMTBeamSearch(PoolSearch):
    """OpenNMT-py's beam search (see the module docstring).

    ``alive``: the K beams (OpenNMT's ``alive_seq``); its ``scores`` are cumulative log-probs (``topk_log_probs``,
    raw, not normalised), and with a coverage penalty the field ``coverage`` ``[B, K, S]`` holds the attention
    summed over the steps. ``hypotheses``: the P best finished hypotheses (OpenNMT's ``hypotheses``, best first),
    whose ``scores`` are the normalised finished scores (-inf: an empty place), with ``reasons``. Both are
    :class:`Hypotheses`.
    """

    def __init__(self, input_ids, max_length, processors, criteria, *, options, fill_token_id, trace: StepTrace,
                 source_lengths=None):
        (b, t0), k, p, device = input_ids.shape, options.num_beams, options.num_return_sequences, input_ids.device
        super().__init__(input_ids, k, max_length, processors, criteria, trace)
        self.n_best = p
        self.eos_ids = options.eos_token_id
        self.eos = torch.tensor(options.eos_token_id, dtype=torch.long, device=device)
        self.lp_kind, self.alpha = options.length_penalty_type or "avg", options.length_penalty
        self.cov_kind, self.beta = options.coverage_penalty, options.coverage_beta
        self.stepwise = options.stepwise_penalty and self.cov_kind != "none"
        self.ratio = options.ratio
        self.source_lengths = None if source_lengths is None else source_lengths.to(device).float()  # [B]
        self.limits = torch.full((b,), max(max_length - t0, 0), dtype=torch.long, device=device)  # [B] at most
        if options.max_length_ratio > 0:
            tied = (source_lengths.to(device).double() * options.max_length_ratio + 5).long()  # int(S * r + 5)
            self.limits = torch.minimum(self.limits, tied)
        self.ngram = options.block_ngram_repeat
        self.exclusions = torch.tensor(options.ignore_when_blocking or (), dtype=torch.long, device=device)
        # live: the K beams (OpenNMT's alive_seq), scored by their cumulative log-probs
        scores = first_live(b, k, -math.inf, device)
        self.live = Hypotheses.start(input_ids, k, max_length, fill_token_id, scores=scores)
        self.prev_penalty = None  # [B, K] stepwise coverage penalty already folded in
        # an empty place holds fill tokens only (the start tokens too)
        self.hypotheses = Hypotheses.start(
            torch.full_like(input_ids, fill_token_id), p, max_length, fill_token_id,
            scores=torch.full((b, p), -float("inf"), device=device),
            reasons=torch.zeros(b, p, dtype=torch.long, device=device))
        self.pool_count = torch.zeros(b, dtype=torch.long, device=device)  # hypotheses so far, all kept or not
        self.best_per_token = torch.full((b,), EMPTY, device=device)  # ratio: best finished score / length
        self.done = torch.zeros(b, dtype=torch.bool, device=device)  # [B]
        self._over = max_length <= t0

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """One step; returns the flat parent row of each new beam, ``[N]``."""
        b, k, alive = self.batch_size, self.rows_per_example, self.live
        if self.cov_kind != "none" and attention is None:
            raise ValueError("coverage_penalty needs the step function to return (logits, state, attention [N, S])")
        log_probs = run_processors(self.processors, self.tokens(), torch.log_softmax(logits, dim=-1), True)  # [N, V]
        self.trace.record(log_probs, logits)
        self.watch.start(self.length - self.prompt_length, logits, log_probs)
        vocab = log_probs.shape[-1]
        step = self.length - self.prompt_length + 1  # OpenNMT's len(): tokens so far, one start token
        attn = None if attention is None else unflatten_beams(attention.float(), b)  # [B, K, S]
        if self.stepwise and self.prev_penalty is not None:
            alive.scores = alive.scores + self.prev_penalty - self._coverage_penalty(alive.coverage + attn)
        penalty = length_penalty(self.lp_kind, step + 1, self.alpha)
        scores = unflatten_beams(log_probs, b) + alive.scores[:, :, None]  # [B, K, V]
        if penalty != 1:
            scores = scores / penalty
        scores = self._block_ngrams(scores)
        top_scores, flat = torch.topk(scores.reshape(b, k * vocab), k=k)  # [B, K]
        self.watch.flag(torch.isnan(top_scores).any(dim=1) & ~self.done)  # NaN ranks first; done examples are final
        parents, tokens = flat // vocab, flat % vocab  # [B, K]
        token_log_probs = torch.gather(log_probs.reshape(b, k * vocab), 1, flat)  # [B, K]
        self.live = alive.extend(parents, tokens, token_log_probs, flat_parent_rows(parents).reshape(b, k),
                                  self.length)
        self.live.scores = top_scores * penalty
        if attn is not None and self.cov_kind != "none":
            chosen = gather_beams(attn, parents)  # [B, K, S]
            if "coverage" not in self.live:  # the first step
                self.live.coverage, self.prev_penalty = chosen, torch.zeros_like(self.live.scores)
            else:
                self.live.coverage = self.live.coverage + chosen
                self.prev_penalty = self._coverage_penalty(self.live.coverage)
            if not self.stepwise:
                top_scores = top_scores - self._coverage_penalty(self.live.coverage)
        self.length += 1
        ended = torch.isin(tokens, self.eos)  # [B, K]
        stopped = self.criteria(self.tokens(), self.trace.scores).reshape(b, k)
        finished = ended | stopped
        finished |= (self.length - self.prompt_length >= self.limits)[:, None]
        self._update_finished(finished, top_scores)
        return flat_parent_rows(parents)

    def _coverage_penalty(self, coverage: torch.Tensor) -> torch.Tensor:
        """``[B, K, S]`` -> ``[B, K]``; positions never attended to (padding) count as fully covered."""
        coverage = torch.where(coverage == 0, torch.ones_like(coverage), coverage)
        return coverage_penalty(self.cov_kind, coverage, self.beta)

    def _block_ngrams(self, scores: torch.Tensor) -> torch.Tensor:
        """Give ``BLOCKED`` to every token that would repeat an n-gram of its beam. ``scores`` is ``[B, K, V]``."""
        n = self.ngram
        window = self.live.tokens[:, :, self.prompt_length - 1 : self.length]  # [B, K, m], one start token
        m = window.shape[-1]
        if n < 2 or m < n:
            return scores
        grams = window.unfold(2, n, 1)  # [B, K, m - n + 1, n]
        suffix = window[:, :, m - n + 1 :]  # [B, K, n - 1]
        repeats = (grams[..., : n - 1] == suffix[:, :, None, :]).all(dim=-1)  # [B, K, m - n + 1]
        if self.exclusions.numel():
            repeats &= ~torch.isin(grams, self.exclusions).any(dim=-1)
        blocked = torch.zeros(scores.shape, dtype=torch.long, device=scores.device)
        blocked.scatter_add_(2, grams[..., n - 1], repeats.long())
        return scores.masked_fill(blocked > 0, BLOCKED)

    def _update_finished(self, finished: torch.Tensor, scores: torch.Tensor) -> None:
        """Record the hypotheses that ended ([B, K] masks and scores) and decide which examples are done.

        The P best of each example are kept; ties keep the earlier one first (Python's stable sort)."""
        b, k = finished.shape
        new = finished & ~self.done[:, None]  # [B, K]
        any_new = new.any(dim=1)  # [B]
        self.live.scores = self.live.scores.masked_fill(finished, DEAD)
        if self.ratio > 0:
            per_token = torch.where(new, scores / (self.length - self.prompt_length + 2), EMPTY).max(dim=1)[0]
            self.best_per_token = torch.maximum(self.best_per_token, per_token)
            target = self.source_lengths * self.ratio
            flag = (scores[:, 0] / target <= self.best_per_token) | finished.all(dim=1)
        else:
            flag = finished[:, 0]
        reasons = classify_stop(self.tokens(), flatten_beams(new), self.eos_ids, self.max_length).reshape(b, k)
        candidate_scores = torch.where(new, scores, -float("inf"))  # [B, K]
        merged = torch.cat((self.hypotheses.scores, candidate_scores), dim=1)  # [B, P + K]
        order = torch.sort(merged, dim=1, descending=True, stable=True)[1][:, : self.n_best]  # [B, P]
        self.hypotheses = self.hypotheses.merge(self.live.replace(scores=candidate_scores, reasons=reasons), order)
        self.pool_count += new.sum(dim=1)
        self.done |= any_new & flag & (self.pool_count >= self.n_best)

    def is_done(self) -> bool:
        return self._over or self.watch.read(self.done.all().reshape(1))[0] or self.length >= self.max_length

    def result(self) -> SearchResult:
        # nothing is written past a hypothesis's end (its tokens, token log-probs and beam indices there are still the
        # fill values), so its generated length is the count of its beam indices
        pool, t0 = self.hypotheses, self.prompt_length
        generated = (pool.beam_indices >= 0).sum(dim=-1)  # [B, P]
        width = self.watch.read_max(generated)
        token_log_probs = pool.token_log_probs[:, :, :width].contiguous()  # [B, P, width], summed as one block
        scores, logits = self.trace.as_tuples()
        return SearchResult(sequences=pool.tokens[:, :, : t0 + width], sequences_scores=pool.scores,
                            sum_log_probs=token_log_probs.sum(dim=-1), token_log_probs=token_log_probs,
                            lengths=t0 + generated, finish_reason=pool.reasons, prompt_length=t0, scores=scores,
                            logits=logits, beam_indices=pool.beam_indices[:, :, :width])
