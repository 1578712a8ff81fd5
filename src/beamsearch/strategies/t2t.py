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

import torch

from ..beams import flatten_beams, unflatten_beams
from ..processors.pipeline import run_processors
from ..results import FinishReason, SearchResult
from ..scoring import length_penalty
from ..stopping import StoppingCriteriaList, is_max_length_criterion
from .base import StepTrace
from .pool import Hypotheses, PoolSearch, first_live

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


class T2TBeamSearch(PoolSearch):
    """tensor2tensor's beam search with GNMT length penalty (see the module docstring)."""

    def __init__(self, input_ids, max_length, processors, criteria, *, options, fill_token_id, trace: StepTrace,
                 source_lengths=None):
        # the length limit is the step count below, not a criterion
        super().__init__(input_ids, options.num_beams, max_length, processors, _without_length_limit(criteria), trace)
        (b, t0), k, device = input_ids.shape, options.num_beams, input_ids.device
        self.alpha, self.stop_early = float(options.length_penalty), bool(options.early_stopping)
        self.num_return_sequences = options.num_return_sequences
        eos = options.eos_token_id or ()
        self.eos_token_id = torch.tensor(eos, dtype=torch.long, device=device)  # [E]
        self.num_candidates = (1 + max(len(eos), 1)) * k
        self.decode_length = max(max_length - t0, 0)  # G: t2t's decode_length
        self.step = 0  # t2t's loop index i: steps done
        # live: the K alive beams (t2t's alive_seq), whose "scores" are their sums of log-probs (t2t's
        # alive_log_probs, not penalised);
        # finished: the finished pool, scored by the penalised score (flags "finished", "reasons")
        self.live = Hypotheses.start(input_ids, k, max_length, fill_token_id, scores=first_live(b, k, -INF, device))
        self.finished = Hypotheses.empty(input_ids, k, max_length, fill_token_id, -INF)
        self.all_ended = torch.zeros((), dtype=torch.bool, device=device)

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """One step of t2t's ``inner_loop``; returns the flat parent row of each new alive beam, ``[N]``."""
        log_probs = run_processors(self.processors, self.tokens(), torch.log_softmax(logits, dim=-1), True)  # [N, V]
        self.trace.record(log_probs, logits)
        self.watch.start(self.step, logits, log_probs)
        candidates, scores, finished, reasons = self._grow_topk(unflatten_beams(log_probs, self.batch_size))
        self._grow_alive(candidates, scores, finished)
        self._grow_finished(candidates, scores, finished, reasons)
        self.all_ended = torch.all(finished)
        self.step += 1
        self.length += 1
        return self.live.beam_indices[:, :, self.step - 1].reshape(-1)  # [N]

    def _grow_topk(self, log_probs: torch.Tensor) -> tuple[Hypotheses, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The top C extensions of the alive beams by penalised score (``grow_topk``), from ``log_probs [B, K, V]``:
        the candidates ``[B, C]`` scored by their sums of log-probs, then their penalised scores, whether they ended
        (with an end token or by a stopping criterion) and their FinishReason codes (meaningful where they ended)."""
        b, k, vocab = log_probs.shape
        totals = (log_probs + self.live.scores[:, :, None]).reshape(b, k * vocab)  # [B, K*V]
        penalty = length_penalty("wu", self.step + 1, self.alpha)
        scores, flat = top_k_in_index_order(totals / penalty, min(self.num_candidates, k * vocab))  # [B, C]
        self.watch.flag(torch.isnan(scores).any(dim=1))  # a NaN in any of the example's rows is ranked first
        parents, tokens = flat // vocab, flat % vocab  # [B, C]
        rows = parents + torch.arange(b, device=flat.device)[:, None] * k  # [B, C] flat rows
        token_log_probs = torch.gather(log_probs.reshape(b, k * vocab), 1, flat)  # [B, C]
        candidates = self.live.extend(parents, tokens, token_log_probs, rows, self.length)
        candidates.scores = torch.gather(totals, 1, flat)
        is_eos = torch.isin(tokens, self.eos_token_id)  # [B, C]
        hits = self.criteria(flatten_beams(candidates.tokens[:, :, : self.length + 1]), self.trace.scores)
        finished = is_eos | hits.reshape(is_eos.shape)
        reasons = torch.where(is_eos, int(FinishReason.EOS), int(FinishReason.STOP_CRITERION))
        return candidates, scores, finished, reasons

    def _grow_alive(self, candidates: Hypotheses, scores: torch.Tensor, finished: torch.Tensor) -> None:
        """The best K candidates that did not end become the alive beams (``grow_alive``)."""
        scores = scores + finished.to(torch.float32) * -INF  # [B, C]
        self.live = candidates.gather(stable_top_k(scores, self.rows_per_example)[1])  # [B, K]

    def _grow_finished(self, candidates: Hypotheses, scores: torch.Tensor, finished: torch.Tensor,
                       reasons: torch.Tensor) -> None:
        """Merge the candidates that ended into the finished pool by penalised score (``grow_finished``)."""
        scores = scores + (~finished).to(torch.float32) * -INF  # [B, C]
        keep = stable_top_k(torch.cat((self.finished.scores, scores), dim=1), self.rows_per_example)[1]  # [B, K]
        self.finished = self.finished.merge(candidates.replace(scores=scores, finished=finished, reasons=reasons), keep)

    def is_done(self) -> bool:
        """t2t's ``_is_not_finished``, negated (one host synchronisation)."""
        if self.step >= self.decode_length:
            return True
        lower_bound_alive_scores = self.live.scores[:, 0] / length_penalty("wu", self.decode_length, self.alpha)
        if self.stop_early:
            finished_bound = self.finished.scores.max(dim=1)[0]  # [B]: the best finished
        else:
            finished_bound = self.finished.scores.min()  # []: the worst finished of the whole batch, as in t2t
        bound_is_met = torch.all(finished_bound > lower_bound_alive_scores)
        return self.watch.read((bound_is_met | self.all_ended).reshape(1))[0]

    def result(self) -> SearchResult:
        """Per example, the finished pool if anything finished, else the alive beams with their log-probs."""
        finished = self.finished  # the alive beams count as finished for the result: their reason stands as it is
        alive_reason = FinishReason.MAX_LENGTH if self.length >= self.max_length else FinishReason.NONE
        alive = self.live.replace(finished=torch.ones_like(finished.finished),
                                   reasons=torch.full_like(finished.reasons, int(alive_reason)))
        chosen = finished.where(finished.finished.any(dim=1), alive)  # [B, K]
        return chosen.result(self.num_return_sequences, self.trace, self.watch)




def _without_length_limit(criteria):
    """The stopping criteria but the max-length one: under t2t the length limit ends the loop, not hypotheses."""
    if not isinstance(criteria, list):
        return criteria
    return StoppingCriteriaList(c for c in criteria if not is_max_length_criterion(c))
