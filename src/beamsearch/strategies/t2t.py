"""tensor2tensor's beam search (``semantics="t2t"``): alive and finished pools, GNMT length penalty.

Reproduces ``tensor2tensor.utils.beam_search.beam_search``. Each step:

1. ``grow_topk``: extend every alive beam by every token and keep the top C candidates by
   ``log_prob / ((5 + i + 1) / 6) ** alpha`` (i = steps done before this one, so i + 1 generated
   tokens, the end token included);
2. ``grow_alive``: the best K candidates, those that ended pushed down by ``-INF``, become the alive
   beams, which carry raw log-probs;
3. ``grow_finished``: the finished pool and the candidates (those that did not end pushed down by
   ``-INF``) are merged, and the best K by penalised score stay.

The search stops after G steps or once ``_is_finished``'s bound holds for the whole batch: the best
alive log-prob divided by the largest penalty ``((5 + G) / 6) ** alpha`` is below, for every example,
its best finished score (``stop_early=True``) or the lowest finished score *of the whole batch*
(``stop_early=False``, t2t's global ``reduce_min``). An example returns its finished pool if any
hypothesis in it finished, else its alive beams scored by their log-probs.

Mapping onto this library (every choice below is t2t's unless it says otherwise):

- ``max_length`` counts the t0 start tokens; t2t's ``decode_length`` (generated tokens, the end token
  included) is G = max_length - t0. alpha is ``length_penalty``, ``stop_early`` is ``early_stopping``.
- ``INF`` is t2t's finite 1e7; the initial alive log-probs are ``[0, -INF, ...]`` and the finished
  scores ``-INF``. A finished slot never filled holds the start tokens, then fill tokens, score -INF.
- Ties rank the lower index first, as TF's ``top_k`` (this matters: in float32 ``score - INF`` rounds to
  ``-INF`` for scores near 0, and the finished pool's empty slots must then win over unfinished candidates).
  The alive log-probs are gathered, not recovered as ``score * penalty`` (a last-bit difference).
- Several end ids (t2t has one): a candidate ending with any of them is finished, and C = (1 + E) K
  for E ids (t2t's 2K for one), so that K candidates are always still alive.
- Stopping criteria other than the length limit (stop strings, ``max_time``, user criteria) end a
  candidate as if it produced an end token (reason STOP_CRITERION); the search stops when every
  candidate ended. The length limit is t2t's own: alive beams at the limit are not finished.

Legend: B batch, K beams, C candidates per example, N = B*K, V vocabulary, L = max_length,
t tokens so far, t0 start tokens, G = L - t0 generated positions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..beams import flat_parent_rows, flatten_beams, gather_beams, unflatten_beams
from ..processors.pipeline import run_processors
from ..results import FinishReason, SearchResult
from ..scoring import length_penalty
from ..stopping import StoppingCriteriaList, is_max_length_criterion
from .base import StepTrace
from .score_checks import ScoreWatch

INF = 1.0e7  # tensor2tensor's "infinity": finite, so that -INF * 0 is 0


def stable_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, best first, equal values in index order (TF's ``top_k``).

    Args:
        scores: FloatTensor ``[B, M]``.
        k: how many to keep, ``k <= M``.

    Returns:
        ``(values [B, k], indices [B, k])``.
    """
    values, indices = torch.sort(scores, dim=1, descending=True, stable=True)  # [B, M]
    return values[:, :k], indices[:, :k]


def top_k_in_index_order(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stable_top_k` for long rows (``[B, K*V]``): ``torch.topk``, then ties put in index order.

    Which of several values tied at the k-th place are kept is ``torch.topk``'s choice: an exact tie
    between two different continuations at the cut is the one place this can differ from TF.
    """
    _, indices = torch.topk(scores, k=k, dim=1)  # [B, k], order among ties unspecified
    indices = torch.sort(indices, dim=1)[0]
    values, order = torch.sort(torch.gather(scores, 1, indices), dim=1, descending=True, stable=True)
    return values, torch.gather(indices, 1, order)


class _Candidates(NamedTuple):
    """The top C extensions of the alive beams (``grow_topk``'s output); every field is ``[B, C, ...]``."""

    sequences: torch.Tensor  # [B, C, L]
    log_probs: torch.Tensor  # [B, C] float32 sums of log-probs
    scores: torch.Tensor  # [B, C] penalised
    finished: torch.Tensor  # [B, C] bool: ended with an end token or by a stopping criterion
    reasons: torch.Tensor  # [B, C] FinishReason codes (meaningful where finished)
    token_log_probs: torch.Tensor  # [B, C, G]
    beam_indices: torch.Tensor  # [B, C, G]
    parents: torch.Tensor  # [B, C] alive beam (0..K-1) each candidate extends


class T2TBeamSearch:
    """tensor2tensor's beam search with GNMT length penalty (see the module docstring)."""

    def __init__(self, input_ids, max_length, processors, criteria, *, options, fill_token_id, trace: StepTrace,
                 source_lengths=None):
        _check_options(options)
        b, t0 = input_ids.shape
        k = options.num_beams
        device = input_ids.device
        self.rows_per_example = k
        self.batch_size, self.prompt_length, self.max_length = b, t0, max_length
        self.processors, self.trace = processors, trace
        self.criteria = _without_length_limit(criteria)  # the length limit is the step count below
        self.alpha, self.stop_early = float(options.length_penalty), bool(options.early_stopping)
        self.num_return_sequences = options.num_return_sequences
        eos = options.eos_token_id or ()
        self.eos_token_id = torch.tensor(eos, dtype=torch.long, device=device)  # [E]
        self.num_candidates = (1 + max(len(eos), 1)) * k
        self.decode_length = max(max_length - t0, 0)  # G: t2t's decode_length
        self.step = 0  # t2t's loop index i: steps done
        self.length = t0
        g = self.decode_length
        self.alive_seq = torch.full((b, k, t0 + g), fill_token_id, dtype=torch.long, device=device)
        self.alive_seq[:, :, :t0] = input_ids[:, None, :]  # [B, K, L]
        self.alive_log_probs = torch.full((b, k), -INF, device=device)  # [B, K] float32
        self.alive_log_probs[:, 0] = 0.0
        self.alive_token_log_probs = torch.zeros(b, k, g, device=device)  # [B, K, G]
        self.alive_beam_indices = torch.full((b, k, g), -1, dtype=torch.long, device=device)  # [B, K, G]
        self.alive_parents = torch.zeros(b, k, dtype=torch.long, device=device)  # [B, K]
        self.finished_seq = self.alive_seq.clone()  # [B, K, L]
        self.finished_scores = torch.full((b, k), -INF, device=device)  # [B, K] penalised
        self.finished_flags = torch.zeros(b, k, dtype=torch.bool, device=device)  # [B, K]
        self.finished_reasons = torch.zeros(b, k, dtype=torch.long, device=device)  # [B, K]
        self.finished_token_log_probs = self.alive_token_log_probs.clone()  # [B, K, G]
        self.finished_beam_indices = self.alive_beam_indices.clone()  # [B, K, G]
        self.all_ended = torch.zeros((), dtype=torch.bool, device=device)
        self.watch = ScoreWatch()  # NaN in the candidates' scores, read with the step's host sync

    def tokens(self) -> torch.Tensor:
        return flatten_beams(self.alive_seq[:, :, : self.length])  # [N, t]

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """One step of t2t's ``inner_loop``; returns the flat parent row of each new alive beam, ``[N]``."""
        log_probs = run_processors(self.processors, self.tokens(), torch.log_softmax(logits, dim=-1), True)  # [N, V]
        self.trace.record(log_probs, logits)
        self.watch.start(self.step, logits, log_probs)
        candidates = self._grow_topk(unflatten_beams(log_probs, self.batch_size))
        self._grow_alive(candidates)
        self._grow_finished(candidates)
        self.all_ended = torch.all(candidates.finished)
        self.step += 1
        self.length += 1
        return flat_parent_rows(self.alive_parents)

    def _grow_topk(self, log_probs: torch.Tensor) -> _Candidates:
        """The top C extensions of the alive beams by penalised score. ``log_probs`` is ``[B, K, V]``."""
        b, k, vocab = log_probs.shape
        totals = (log_probs + self.alive_log_probs[:, :, None]).reshape(b, k * vocab)  # [B, K*V]
        penalty = length_penalty("wu", self.step + 1, self.alpha)
        scores, flat = top_k_in_index_order(totals / penalty, min(self.num_candidates, k * vocab))  # [B, C]
        self.watch.flag(torch.isnan(scores).any(dim=1))  # a NaN in any of the example's rows is ranked first
        parents, tokens = flat // vocab, flat % vocab  # [B, C]
        sequences = gather_beams(self.alive_seq, parents)  # [B, C, L]
        sequences[:, :, self.length] = tokens
        token_log_probs = gather_beams(self.alive_token_log_probs, parents)  # [B, C, G]
        token_log_probs[:, :, self.step] = torch.gather(log_probs.reshape(b, k * vocab), 1, flat)
        beam_indices = gather_beams(self.alive_beam_indices, parents)  # [B, C, G]
        beam_indices[:, :, self.step] = parents + torch.arange(b, device=flat.device)[:, None] * k
        is_eos = torch.isin(tokens, self.eos_token_id)  # [B, C]
        hits = self.criteria(flatten_beams(sequences[:, :, : self.length + 1]), self.trace.scores)
        finished = is_eos | hits.reshape(is_eos.shape)
        reasons = torch.where(is_eos, int(FinishReason.EOS), int(FinishReason.STOP_CRITERION))
        return _Candidates(sequences, torch.gather(totals, 1, flat), scores, finished, reasons,
                           token_log_probs, beam_indices, parents)

    def _grow_alive(self, candidates: _Candidates) -> None:
        """The best K candidates that did not end become the alive beams (``grow_alive``)."""
        scores = candidates.scores + candidates.finished.to(torch.float32) * -INF  # [B, C]
        keep = stable_top_k(scores, self.rows_per_example)[1]  # [B, K]
        self.alive_seq = gather_beams(candidates.sequences, keep)
        self.alive_log_probs = gather_beams(candidates.log_probs, keep)
        self.alive_token_log_probs = gather_beams(candidates.token_log_probs, keep)
        self.alive_beam_indices = gather_beams(candidates.beam_indices, keep)
        self.alive_parents = gather_beams(candidates.parents, keep)

    def _grow_finished(self, candidates: _Candidates) -> None:
        """Merge the candidates that ended into the finished pool by penalised score (``grow_finished``)."""
        scores = candidates.scores + (~candidates.finished).to(torch.float32) * -INF  # [B, C]
        merged_scores = torch.cat((self.finished_scores, scores), dim=1)  # [B, K + C]
        self.finished_scores, keep = stable_top_k(merged_scores, self.rows_per_example)  # [B, K]

        def merge(pool: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return gather_beams(torch.cat((pool, new), dim=1), keep)

        self.finished_seq = merge(self.finished_seq, candidates.sequences)
        self.finished_flags = merge(self.finished_flags, candidates.finished)
        self.finished_reasons = merge(self.finished_reasons, candidates.reasons)
        self.finished_token_log_probs = merge(self.finished_token_log_probs, candidates.token_log_probs)
        self.finished_beam_indices = merge(self.finished_beam_indices, candidates.beam_indices)

    def is_done(self) -> bool:
        """t2t's ``_is_not_finished``, negated (one host synchronisation)."""
        if self.step >= self.decode_length:
            return True
        lower_bound_alive_scores = self.alive_log_probs[:, 0] / length_penalty("wu", self.decode_length, self.alpha)
        if self.stop_early:
            finished_bound = self.finished_scores.max(dim=1)[0]  # [B]: the best finished
        else:
            finished_bound = self.finished_scores.min()  # []: the worst finished of the whole batch, as in t2t
        bound_is_met = torch.all(finished_bound > lower_bound_alive_scores)
        return self.watch.read((bound_is_met | self.all_ended).reshape(1))[0]

    def result(self) -> SearchResult:
        """Per example, the finished pool if anything finished, else the alive beams with their log-probs."""
        n = self.num_return_sequences
        any_finished = self.finished_flags.any(dim=1, keepdim=True)  # [B, 1]

        def pick(finished: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
            choose = any_finished.reshape(*any_finished.shape, *([1] * (finished.dim() - 2)))
            return torch.where(choose, finished, alive)[:, :n]

        beam_indices = pick(self.finished_beam_indices, self.alive_beam_indices)  # [B, n, G]
        generated = (beam_indices >= 0).sum(dim=-1)  # [B, n]
        width = self.watch.read_max(generated)
        token_log_probs = pick(self.finished_token_log_probs, self.alive_token_log_probs)[:, :, :width]
        alive_reason = FinishReason.MAX_LENGTH if self.length >= self.max_length else FinishReason.NONE
        finished_reasons = torch.where(self.finished_flags, self.finished_reasons, int(FinishReason.NONE))
        reasons = pick(finished_reasons, torch.full_like(finished_reasons, int(alive_reason)))
        scores, logits = self.trace.as_tuples()
        return SearchResult(
            sequences=pick(self.finished_seq, self.alive_seq)[:, :, : self.prompt_length + width],
            sequences_scores=pick(self.finished_scores, self.alive_log_probs),
            sum_log_probs=token_log_probs.sum(dim=-1),
            token_log_probs=token_log_probs,
            lengths=self.prompt_length + generated,
            finish_reason=reasons,
            prompt_length=self.prompt_length,
            scores=scores,
            logits=logits,
            beam_indices=beam_indices[:, :, :width],
        )


def _check_options(options) -> None:
    """Reject the options t2t's beam search has no meaning for."""
    if options.do_sample:
        raise ValueError("semantics='t2t' is a deterministic beam search: do_sample=True is not supported")
    if options.early_stopping not in (True, False):
        raise ValueError(f"early_stopping is t2t's stop_early under semantics='t2t': True or False, "
                         f"got {options.early_stopping!r}")
    if options.length_penalty_type not in (None, "gnmt", "wu"):
        raise ValueError(f"semantics='t2t' uses the GNMT length penalty ((5 + length) / 6) ** length_penalty; "
                         f"length_penalty_type={options.length_penalty_type!r} is not supported")
    if options.coverage_penalty != "none":
        raise ValueError("semantics='t2t' has no coverage penalty: use coverage_penalty='none'")


def _without_length_limit(criteria):
    """The stopping criteria but the max-length one: under t2t the length limit ends the loop, not hypotheses."""
    if not isinstance(criteria, list):
        return criteria
    return StoppingCriteriaList(c for c in criteria if not is_max_length_criterion(c))
