"""Beam search and beam sampling over live and finished pools, vectorized over the batch.

The arithmetic follows Hugging Face transformers 5.x beam search exactly (so that tokens and
scores match): only the first beam is live at step 0, each step keeps C = max(2, 1 + #eos) x K
candidates, finished candidates among the first K enter a finished pool scored with
``sum_log_probs / generated_length ** length_penalty``, and ``early_stopping`` (True / False /
"never") decides when the pool can no longer improve. Masks are large finite negatives (-1e9),
added, never ``-inf``, as in the reference.

Legend: B batch, K beams, C candidates per example, N = B*K, V vocabulary, L = max_length,
t tokens so far, t0 start tokens, G = L - t0 generated positions.
"""

from __future__ import annotations

import torch

from ..beams import example_rows, flat_parent_rows, flatten_beams, gather_beams, unflatten_beams
from ..compaction import ActiveExamples
from ..processors.pipeline import run_processors
from ..ranking import PoolKeys, SequenceScorer, UniqueKey, score_candidates
from ..results import SearchResult
from ..scoring import hf_length_normalised
from ..selection import top_totals
from ..stopping import classify_stop
from .base import MASK, StepTrace
from .native_search import native_beam_reason, native_beam_update
from .pool import Hypotheses, PoolSearch, first_live
from .score_checks import check_enough_hypotheses, sample


class BeamSearch(PoolSearch):
    """Beam search (``do_sample=False``) or beam sampling (``do_sample=True``).

    ``live``: the K beams, scored by their total log-prob; ``finished``: the pool of K finished hypotheses,
    scored by the penalised score (flags ``finished``, ``reasons``). Both are :class:`Hypotheses` ``[B, K]``.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        num_beams: int,
        max_length: int,
        processors,
        criteria,
        *,
        do_sample: bool,
        eos_token_id: tuple[int, ...] | None,
        fill_token_id: int,
        length_penalty: float,
        early_stopping: bool | str,
        num_return_sequences: int,
        trace: StepTrace,
        remove_finished: bool = False,
        sequence_scorer: SequenceScorer | None = None,
        unique_key: UniqueKey | None = None,
        output_alignments: bool = False,
        sort_samples: bool = True,
    ):
        super().__init__(input_ids, num_beams, max_length, processors, criteria, trace)
        (b, t0), k, device = input_ids.shape, num_beams, input_ids.device
        self.do_sample, self.eos_token_id = do_sample, eos_token_id
        self.sort_samples = sort_samples  # beam sampling: candidates by total, best first (transformers >= 5.24)
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.num_return_sequences = num_return_sequences
        self.num_candidates = max(2, 1 + len(eos_token_id or ())) * k
        self.live = Hypotheses.start(input_ids, k, max_length, fill_token_id, scores=first_live(b, k, MASK, device))
        self.finished = Hypotheses.empty(input_ids, k, max_length, fill_token_id, MASK)
        self.can_improve = torch.ones(b, 1, dtype=torch.bool, device=device)  # [B, 1]
        self.hits = torch.zeros(b, k, dtype=torch.bool, device=device)  # [B, C] candidates that met a criterion
        self.top_k_mask = torch.arange(self.num_candidates, device=device) < k  # [C]
        self._done = max_length <= t0
        self.example_ids = torch.arange(b, device=device)  # [B'] original position of each active example
        self.scorer = sequence_scorer  # ranks finished hypotheses instead of sum / length ** length_penalty
        self.pool_keys = None if unique_key is None else PoolKeys(unique_key, t0)  # a de-duplicated pool
        # alignments: the step's attention over the source [N, S], kept per generated token along each beam in
        # the field "alignments" [B, K, G, S] of both pools, added at the first step
        self.keep_alignments = output_alignments
        # finished examples leave the batch (only when that is exact: see compaction.removal_is_exact)
        self.active = ActiveExamples(b, device) if remove_finished else None
        self.native: bool | None = None  # the bookkeeping in one C++ call (native_search.py), decided at the first step

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None,
                owned: bool = False) -> torch.Tensor | None:
        """One step; returns the flat parent row of each new live beam, ``[N]`` (fewer rows once examples left), or
        None when there is nothing to reorder."""
        b = self.live.scores.shape[0]  # B': the active examples
        before = self.live.scores, self.can_improve  # for the trace
        if self.length == self.prompt_length:
            check_enough_hypotheses(self.rows_per_example, self.num_return_sequences, logits.shape[-1],
                                    self.eos_token_id, self.max_length - self.prompt_length)
        log_probs = run_processors(self.processors, self.tokens(), torch.log_softmax(logits, dim=-1), True)  # [N, V]
        self.trace.record(log_probs, logits)
        self.watch.start(self.length - self.prompt_length, logits, log_probs, self.example_ids)
        if self.native is None:  # CTranslate2's, OpenNMT's and tensor2tensor's beam searches have rules of their own
            self.native = type(self) is BeamSearch and native_beam_reason(self) is None
        if self.native:
            values, positions = self._choose_candidates(unflatten_beams(log_probs, b))  # [B, C]
            return self._leave(*native_beam_update(self, log_probs, values, positions))
        if self.keep_alignments:
            self._start_alignments(attention)
        candidates, parents = self._grow(unflatten_beams(log_probs, b))  # [B, C]
        if self.keep_alignments:
            position = self.length - self.prompt_length
            candidates.alignments[:, :, position] = gather_beams(attention.float().reshape(b, self.rows_per_example,
                                                                                           -1), parents)
        self.hits = self.criteria(flatten_beams(candidates.tokens[:, :, : self.length + 1]), self.trace.scores)
        self.hits = self.hits.reshape(b, self.num_candidates)  # [B, C]
        pool_keep = self._update_finished(candidates)
        keep = self._update_running(candidates)
        self.length += 1
        self._update_can_improve()
        if self.recorder is not None:
            self.recorder.beam_step(self, logits, log_probs, candidates, parents, keep, pool_keep, before)
        rows = flat_parent_rows(gather_beams(parents, keep))  # [N]
        return rows if self.active is None else self._remove_done(rows)

    def _remove_done(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Decide whether the search goes on (the step's one host sync) and drop the examples that are done.

        An example is done when no live beam can beat its finished pool, or the pool is full under
        ``early_stopping=True``: either way its pool can no longer change. The search ends when every example
        is done or every candidate hit a criterion (with row-independent criteria only: the length limit).
        Returns None (nothing to reorder) when the search ends here or every beam continued from its own row.
        """
        done = ~self.can_improve[:, 0]  # [B']
        if self.early_stopping is True:
            done = done | torch.all(self.finished.finished, dim=-1)
        identity = torch.all(rows == torch.arange(rows.shape[0], device=rows.device))
        *done, all_hit, identity = self.watch.read(torch.cat((done, torch.stack((torch.all(self.hits), identity)))))
        return self._leave(rows, done, all_hit, identity)

    def _leave(self, rows: torch.Tensor, done: list, all_hit: bool, identity: bool) -> torch.Tensor | None:
        """Act on the step's verdicts (read from the host): end the search, or drop the examples that are done."""
        k = self.rows_per_example
        self._done = bool(all_hit) or all(done)
        if self._done:
            return None
        if not any(done):
            return None if identity else rows
        keep, self.finished, (self.live, self.can_improve) = self.active.drop(
            done, self.finished, (self.live, self.can_improve))  # [B'']
        self.example_ids = self.active.ids
        kept_rows = example_rows(keep, k)  # [N'']
        self.processors = self.processors.select_rows(kept_rows)
        return rows.index_select(0, kept_rows)

    def _start_alignments(self, attention: torch.Tensor | None) -> None:
        """At the first step, add the "alignments" field ``[B, K, G, S]`` (zeros) to both pools."""
        if attention is None:
            raise ValueError("output_alignments needs the step function to return (logits, state, attention [N, S])")
        if "alignments" not in self.live:
            b, k, g = self.live.beam_indices.shape
            self.live.alignments = attention.new_zeros(b, k, g, attention.shape[-1], dtype=torch.float32)
            self.finished.alignments = self.live.alignments.clone()

    def _grow(self, log_probs: torch.Tensor) -> tuple[Hypotheses, torch.Tensor]:
        """The top (or sampled) C continuations of each example, scored by their totals, and their parent beams
        ``[B, C]``. ``log_probs`` is ``[B, K, V]``."""
        b, k, vocab = log_probs.shape
        if self.do_sample:
            totals = (log_probs + self.live.scores[:, :, None]).reshape(b, k * vocab)  # [B, K*V]
            flat, invalid = sample(torch.softmax(totals, dim=-1), self.num_candidates)  # [B, C], [B]
            # an example with no live beam left (every one -inf, e.g. past a source-tied limit) has nothing to
            # sample and stays with its finished pool, as in beam search; any other example must have a distribution,
            # and a NaN in the totals (the model's NaN or +inf) is fatal whatever the live scores (a live score far
            # below MASK, e.g. logits of 1e30, is still a live beam)
            self.watch.flag(invalid & (self.live.scores > MASK / 2).any(dim=1) | torch.isnan(totals).any(dim=1))
            scores = torch.gather(totals, 1, flat)  # [B, C], in the order drawn
            if self.sort_samples:
                scores, order = scores.sort(dim=-1, descending=True)
                flat = flat.gather(1, order)
        else:
            scores, flat = self._choose_candidates(log_probs)  # [B, C]
            self.watch.flag(torch.isnan(scores).any(dim=1))  # a NaN in any of the example's rows is ranked first
        parents, tokens = flat // vocab, flat % vocab  # [B, C]
        rows = parents + self.example_ids[:, None] * k  # rows of the full batch, as HF's beam indices
        token_log_probs = torch.gather(log_probs.reshape(b, k * vocab), 1, flat)  # [B, C]
        candidates = self.live.extend(parents, tokens, token_log_probs, rows, self.length)
        candidates.scores = scores
        return candidates, parents

    def _choose_candidates(self, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The C candidates of each example from ``log_probs [B, K, V]``: (their totals with the beam scores,
        positions in ``[K*V]``), best first; transformers' ``topk`` over the ``[B, K*V]`` totals."""
        return top_totals(log_probs, self.live.scores, self.num_candidates)

    def _choose_running(self, live_scores: torch.Tensor, candidates: Hypotheses) -> torch.Tensor:
        """Candidate positions ``[B, K]`` of the next live beams, best first, from ``live_scores [B, C]``."""
        return torch.topk(live_scores, k=self.rows_per_example)[1]

    def _pool_order(self, merged_scores: torch.Tensor, candidates: Hypotheses) -> torch.Tensor:
        """What ranks the finished pool and the just-finished candidates ``[B, K + C]`` (the scores themselves)."""
        return merged_scores

    def _update_running(self, candidates: Hypotheses) -> torch.Tensor:
        """The best K candidates that did not stop become the live beams; returns their candidate positions."""
        live_scores = candidates.scores + self.hits.to(torch.float32) * MASK  # [B, C]
        keep = self._choose_running(live_scores, candidates)  # [B, K]
        self.live = candidates.replace(scores=live_scores).gather(keep)
        return keep

    def _update_finished(self, candidates: Hypotheses) -> torch.Tensor:
        """Merge candidates that just stopped (among the first K) into the finished pool; returns what was kept of
        the old pool and the candidates, ``[B, K]`` positions in ``[K + C]``."""
        pool = self.finished
        just_finished = self.hits & self.top_k_mask[None, :]  # [B, C]
        generated = self.length + 1 - self.prompt_length
        scores = candidates.scores
        if self.scorer is None:
            penalised = hf_length_normalised(scores, generated, self.length_penalty)
        else:
            hooked = score_candidates(self.scorer, candidates.tokens, candidates.token_log_probs, self.prompt_length,
                                      generated)
            penalised = torch.where(scores > MASK / 2, hooked, scores)  # masked beams' candidates stay masked
        pool_full = torch.all(pool.finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        penalised += pool_full.to(torch.float32) * MASK
        penalised += (~self.can_improve).to(torch.float32) * MASK
        penalised += (~just_finished) * MASK
        if self.pool_keys is not None:
            lengths = self.prompt_length + (pool.beam_indices >= 0).sum(dim=-1)  # [B, K]
            self.pool_keys.dedupe(penalised, just_finished, candidates.tokens, self.length + 1, pool.scores,
                                  pool.finished, pool.tokens, lengths, drop=2 * MASK)
        reasons = classify_stop(flatten_beams(candidates.tokens[:, :, : self.length + 1]), flatten_beams(just_finished),
                                self.eos_token_id, self.max_length).reshape(just_finished.shape)
        merged_scores = torch.cat((pool.scores, penalised), dim=1)  # [B, K + C]
        keep = torch.topk(self._pool_order(merged_scores, candidates), k=self.rows_per_example)[1]  # [B, K]
        self.finished = pool.merge(candidates.replace(scores=penalised, finished=just_finished, reasons=reasons), keep)
        return keep

    def _update_can_improve(self) -> None:
        """Whether the best live beam could still beat the worst finished one (HF's heuristic).

        With a sequence scorer nothing is known about future scores: only a full pool under
        ``early_stopping=True``, the length limit or every beam finishing ends the search."""
        if self.scorer is not None:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_length
        else:
            best_length = self.length - self.prompt_length
        best_running = self.live.scores[:, :1] / (best_length**self.length_penalty)  # [B, 1]
        pool = self.finished
        worst_finished = torch.where(pool.finished, torch.min(pool.scores, dim=1, keepdim=True)[0], MASK)
        self.can_improve = self.can_improve & torch.any(best_running > worst_finished, dim=-1, keepdim=True)

    def could_win(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The hypotheses that the returned best can still come from (streaming's committed prefix is theirs).

        The best returned is the finished pool's first. A hypothesis in the pool only leaves it for a better one, and
        every later finisher descends from a live beam of now; so the best is one of the pool's best now (all those
        tied with it: ``topk`` may order ties either way) or a descendant of a live beam, while the live beams can
        still enter the pool (``can_improve``, and not a full pool under ``early_stopping=True``). A subclass that
        orders its pool otherwise (``_pool_order``) counts every finished hypothesis.

        Returns:
            ``tokens [B, M, L]``, ``lengths [B, M]`` (start tokens included), ``eligible [B, M]`` bool, and
            ``leader [B]``: the position of the current best (the first live beam unless the pool's best scores at
            least its length-normalised total, or the live beams are out), for provisional streaming. M = 2K: the
            live beams, then the pool.
        """
        live, pool, k = self.live, self.finished, self.rows_per_example
        pool_lengths = self.prompt_length + (pool.beam_indices >= 0).sum(dim=-1)  # [B, K]
        pool_scores = torch.where(pool.finished, pool.scores, float("-inf"))  # [B, K]
        best_finished = pool_scores.amax(dim=1, keepdim=True)  # [B, 1]
        if type(self)._pool_order is BeamSearch._pool_order:
            finished_ok = pool.finished & (pool.scores == best_finished)
        else:
            finished_ok = pool.finished
        live_open = self.can_improve[:, :1]  # [B, 1]
        if self.early_stopping is True:
            live_open = live_open & ~torch.all(pool.finished, dim=-1, keepdim=True)
        generated = max(self.length - self.prompt_length, 1)
        live_best = live.scores[:, :1] / (generated**self.length_penalty)  # [B, 1]
        finished_leads = (~live_open | (best_finished >= live_best))[:, 0] & pool.finished.any(dim=1)  # [B]
        leader = torch.where(finished_leads, k + pool_scores.argmax(dim=1), 0)  # [B]
        tokens = torch.cat((live.tokens, pool.tokens), dim=1)  # [B, 2K, L]
        lengths = torch.cat((torch.full_like(pool_lengths, self.length), pool_lengths), dim=1)  # [B, 2K]
        eligible = torch.cat((live_open.expand(-1, k), finished_ok), dim=1)  # [B, 2K]
        return tokens, lengths, eligible, leader

    def is_done(self) -> bool:
        if self._done or self.active is not None:  # with removal, advance() decided
            return self._done
        open_pool = ~(torch.all(self.finished.finished) & (self.early_stopping is True))
        going = torch.any(self.can_improve) & open_pool & ~torch.all(self.hits)
        return not self.watch.read(going.reshape(1))[0]

    def result(self) -> SearchResult:
        if self.active is not None:
            self.finished = self.active.finish(self.finished)
        return self.finished.result(self.num_return_sequences, self.trace, self.watch)
