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

import torch

from ..beams import flat_parent_rows, flatten_beams, gather_beams, unflatten_beams
from ..processors.pipeline import run_processors
from ..results import SearchResult
from ..scoring import coverage_penalty, length_penalty
from ..stopping import classify_stop
from .base import StepTrace
from .score_checks import ScoreWatch

DEAD = -65504.0  # OpenNMT's cumulative log-prob for a beam that ended
BLOCKED = -10e20  # OpenNMT's score for a token that would repeat an n-gram
EMPTY = -1.0e10  # OpenNMT's initial best finished score per token (ratio)


class ONMTBeamSearch:
    """OpenNMT-py's beam search (see the module docstring)."""

    def __init__(self, input_ids, max_length, processors, criteria, *, options, fill_token_id, trace: StepTrace,
                 source_lengths=None):
        _check_options(options)
        b, t0 = input_ids.shape
        k = options.num_beams
        device = input_ids.device
        self.rows_per_example = k
        self.batch_size, self.prompt_length, self.max_length = b, t0, max_length
        self.processors, self.criteria, self.trace = processors, criteria, trace
        self.eos_ids = options.eos_token_id
        self.eos = torch.tensor(options.eos_token_id, dtype=torch.long, device=device)
        self.fill = fill_token_id
        self.lp_kind = options.length_penalty_type or "avg"
        self.alpha = options.length_penalty
        self.cov_kind, self.beta = options.coverage_penalty, options.coverage_beta
        self.stepwise = options.stepwise_penalty and self.cov_kind != "none"
        self.n_best = options.num_return_sequences
        self.ratio = options.ratio
        if self.ratio > 0 and source_lengths is None:
            raise ValueError("ratio needs the source lengths (search(..., source_lengths=))")
        if options.max_length_ratio > 0 and source_lengths is None:
            raise ValueError("max_length_ratio needs the source lengths (search(..., source_lengths=)); "
                             "pass max_length_ratio=0 to turn OpenNMT's default limit off")
        self.source_lengths = None if source_lengths is None else source_lengths.to(device).float()  # [B]
        g = max(max_length - t0, 0)
        self.limits = torch.full((b,), g, dtype=torch.long, device=device)  # [B] generated tokens at most
        if options.max_length_ratio > 0:
            tied = (source_lengths.to(device).double() * options.max_length_ratio + 5).long()  # int(S * r + 5)
            self.limits = torch.minimum(self.limits, tied)
        self.ngram = options.block_ngram_repeat
        self.exclusions = torch.tensor(options.ignore_when_blocking or (), dtype=torch.long, device=device)
        self.length = t0
        self.sequences = torch.full((b, k, max(max_length, t0)), fill_token_id, dtype=torch.long, device=device)
        self.sequences[:, :, :t0] = input_ids[:, None, :]  # [B, K, L]
        self.alive = torch.full((b, k), -float("inf"), device=device)  # [B, K] cumulative log-probs
        self.alive[:, 0] = 0.0
        self.token_log_probs = torch.zeros(b, k, g, device=device)  # [B, K, G]
        self.beam_indices = torch.full((b, k, g), -1, dtype=torch.long, device=device)  # [B, K, G]
        self.coverage = None  # [B, K, S] attention summed over the steps
        self.prev_penalty = None  # [B, K] stepwise coverage penalty already folded in
        p = self.n_best
        self.pool_sequences = torch.full((b, p, max(max_length, t0)), fill_token_id, dtype=torch.long, device=device)
        self.pool_scores = torch.full((b, p), -float("inf"), device=device)  # [B, P] best first
        self.pool_token_log_probs = torch.zeros(b, p, g, device=device)
        self.pool_beam_indices = torch.full((b, p, g), -1, dtype=torch.long, device=device)
        self.pool_lengths = torch.full((b, p), t0, dtype=torch.long, device=device)
        self.pool_reasons = torch.zeros(b, p, dtype=torch.long, device=device)
        self.pool_count = torch.zeros(b, dtype=torch.long, device=device)  # hypotheses so far, all kept or not
        self.best_per_token = torch.full((b,), EMPTY, device=device)  # ratio: best finished score / length
        self.done = torch.zeros(b, dtype=torch.bool, device=device)  # [B]
        self._over = max_length <= t0
        self.watch = ScoreWatch()  # NaN in the beams' scores, read with the step's host sync

    def tokens(self) -> torch.Tensor:
        return flatten_beams(self.sequences[:, :, : self.length])  # [N, t]

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """One step; returns the flat parent row of each new beam, ``[N]``."""
        b, k = self.batch_size, self.rows_per_example
        if self.cov_kind != "none" and attention is None:
            raise ValueError("coverage_penalty needs the step function to return (logits, state, attention [N, S])")
        log_probs = run_processors(self.processors, self.tokens(), torch.log_softmax(logits, dim=-1), True)  # [N, V]
        self.trace.record(log_probs, logits)
        self.watch.start(self.length - self.prompt_length, logits, log_probs)
        vocab = log_probs.shape[-1]
        step = self.length - self.prompt_length + 1  # OpenNMT's len(): tokens so far, one start token
        attn = None if attention is None else unflatten_beams(attention.float(), b)  # [B, K, S]
        if self.stepwise and self.prev_penalty is not None:
            self.alive = self.alive + self.prev_penalty - self._coverage_penalty(self.coverage + attn)
        penalty = length_penalty(self.lp_kind, step + 1, self.alpha)
        scores = unflatten_beams(log_probs, b) + self.alive[:, :, None]  # [B, K, V]
        if penalty != 1:
            scores = scores / penalty
        scores = self._block_ngrams(scores)
        top_scores, flat = torch.topk(scores.reshape(b, k * vocab), k=k)  # [B, K]
        self.watch.flag(torch.isnan(top_scores).any(dim=1) & ~self.done)  # NaN ranks first; done examples are final
        self.alive = top_scores * penalty
        parents, tokens = flat // vocab, flat % vocab  # [B, K]
        position = self.length - self.prompt_length
        self.sequences = gather_beams(self.sequences, parents)
        self.sequences[:, :, self.length] = tokens
        self.token_log_probs = gather_beams(self.token_log_probs, parents)
        self.token_log_probs[:, :, position] = torch.gather(log_probs.reshape(b, k * vocab), 1, flat)
        self.beam_indices = gather_beams(self.beam_indices, parents)
        self.beam_indices[:, :, position] = flat_parent_rows(parents).reshape(b, k)
        if attn is not None and self.cov_kind != "none":
            chosen = gather_beams(attn, parents)  # [B, K, S]
            if self.coverage is None:
                self.coverage = chosen
                self.prev_penalty = torch.zeros_like(self.alive)
            else:
                self.coverage = gather_beams(self.coverage, parents) + chosen
                self.prev_penalty = self._coverage_penalty(self.coverage)
            if not self.stepwise:
                top_scores = top_scores - self._coverage_penalty(self.coverage)
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
        window = self.sequences[:, :, self.prompt_length - 1 : self.length]  # [B, K, m], one start token
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
        """Record the hypotheses that ended ([B, K] masks and scores) and decide which examples are done."""
        b, k = finished.shape
        new = finished & ~self.done[:, None]  # [B, K]
        any_new = new.any(dim=1)  # [B]
        self.alive = self.alive.masked_fill(finished, DEAD)
        if self.ratio > 0:
            per_token = torch.where(new, scores / (self.length - self.prompt_length + 2), EMPTY).max(dim=1)[0]
            self.best_per_token = torch.maximum(self.best_per_token, per_token)
            target = self.source_lengths * self.ratio
            flag = (scores[:, 0] / target <= self.best_per_token) | finished.all(dim=1)
        else:
            flag = finished[:, 0]
        reasons = classify_stop(self.tokens(), flatten_beams(new), self.eos_ids, self.max_length).reshape(b, k)
        self._merge_pool(new, scores, reasons)
        self.pool_count += new.sum(dim=1)
        self.done |= any_new & flag & (self.pool_count >= self.n_best)

    def _merge_pool(self, new: torch.Tensor, scores: torch.Tensor, reasons: torch.Tensor) -> None:
        """Keep the P best hypotheses of each example; ties keep the earlier one first (Python's stable sort)."""
        p = self.n_best
        candidate_scores = torch.where(new, scores, -float("inf"))  # [B, K]
        merged = torch.cat((self.pool_scores, candidate_scores), dim=1)  # [B, P + K]
        order = torch.sort(merged, dim=1, descending=True, stable=True)[1][:, :p]  # [B, P]
        lengths = torch.full_like(reasons, self.length)

        def pick(pool: torch.Tensor, beams: torch.Tensor) -> torch.Tensor:
            return gather_beams(torch.cat((pool, beams), dim=1), order)

        self.pool_scores = pick(self.pool_scores, candidate_scores)
        self.pool_sequences = pick(self.pool_sequences, self.sequences)
        self.pool_token_log_probs = pick(self.pool_token_log_probs, self.token_log_probs)
        self.pool_beam_indices = pick(self.pool_beam_indices, self.beam_indices)
        self.pool_lengths = pick(self.pool_lengths, lengths)
        self.pool_reasons = pick(self.pool_reasons, reasons)

    def is_done(self) -> bool:
        return self._over or self.watch.read(self.done.all().reshape(1))[0] or self.length >= self.max_length

    def result(self) -> SearchResult:
        generated = self.pool_lengths - self.prompt_length  # [B, P]
        width = self.watch.read_max(generated)
        positions = torch.arange(self.pool_sequences.shape[-1], device=generated.device)
        sequences = self.pool_sequences.masked_fill(positions >= self.pool_lengths[:, :, None], self.fill)
        steps = torch.arange(width, device=generated.device)
        token_log_probs = self.pool_token_log_probs[:, :, :width].masked_fill(steps >= generated[:, :, None], 0.0)
        beam_indices = self.pool_beam_indices[:, :, :width].masked_fill(steps >= generated[:, :, None], -1)
        scores, logits = self.trace.as_tuples()
        return SearchResult(
            sequences=sequences[:, :, : self.prompt_length + width],
            sequences_scores=self.pool_scores,
            sum_log_probs=token_log_probs.sum(dim=-1),
            token_log_probs=token_log_probs,
            lengths=self.pool_lengths,
            finish_reason=self.pool_reasons,
            prompt_length=self.prompt_length,
            scores=scores,
            logits=logits,
            beam_indices=beam_indices,
        )


def _check_options(options) -> None:
    if options.do_sample:
        raise ValueError("semantics='onmt' is beam search: do_sample=True is not supported with it")
    if not options.eos_token_id:
        raise ValueError("semantics='onmt' needs eos_token_id (hypotheses finish on the end token)")
    if (options.length_penalty_type or "avg") not in ("avg", "wu", "gnmt", "none"):
        raise ValueError(f"semantics='onmt' supports length_penalty_type avg, wu or none, not "
                         f"{options.length_penalty_type!r}")
