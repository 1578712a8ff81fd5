"""Diverse (group) beam search: ``num_beam_groups`` and ``diversity_penalty``, as transformers 4.x ran it.

Vijayakumar et al. (2018), "Diverse Beam Search", with Hamming diversity. The K beams of an example form G
groups of S = K / G beams. Within a step the groups are decoded one after another: group g's log-probs lose
``diversity_penalty x`` (how many beams of groups 0..g-1 chose that token at this step), then the processors
run on the group's rows, then the group runs its own beam search step over its S beams. Each (example, group)
keeps its own finished pool of S hypotheses and its own ``early_stopping`` verdict; at the end the best
``num_return_sequences`` hypotheses over all groups' pools are returned.

The bookkeeping follows transformers 4.x's ``_group_beam_search`` and ``BeamSearchScorer`` (the reference
of the tests), which differ from 5.x's single-group beam search in these points:

- Per group, the 2S best candidates (``max(2, 1 + #eos) x S``) are ranked; an EOS candidate among the first S
  enters the pool, and the first S candidates that are not EOS become the live beams.
- A pool admits a hypothesis while it holds fewer than S, or when it beats the worst one (scores
  ``sum_log_probs / generated_length ** length_penalty``, computed in float64 as 4.x does in Python floats).
- A group is done, for good, once its pool is full and: ``early_stopping=True``; ``False``: the best
  candidate of the step (EOS included) at the current length cannot beat the worst finished score;
  ``"never"``: the same at the longest possible length when ``length_penalty > 0``. A done group's beams carry
  the pad token with score 0; those pad tokens count in the later groups' diversity penalty, as in 4.x.
- Stopping criteria do not finish single beams: the search stops when every group of every example is done or
  when every row meets a criterion (the length limit); then the live beams of the groups not done enter their
  pools, scored by their length.

Legend: B batch, K beams, G groups, S = K / G beams per group, C candidates per group, N = B*K, V vocabulary,
L = max_length, t tokens so far, t0 start tokens, P = L - t0 generated positions.
"""

from __future__ import annotations

import torch

from ..beams import flat_parent_rows, flatten_beams, gather_beams
from ..processors import ProcessorList
from ..results import FinishReason, SearchResult
from ..scoring import hf_length_normalised
from ..selection import top_totals
from .base import MASK, StepTrace
from .score_checks import ScoreWatch

EMPTY = float("-inf")  # the score of an empty place in a finished pool (only ever compared, never multiplied)


class GroupBeamSearch:
    """Diverse beam search over G groups of S beams each; ``remove_finished`` does not apply (rows stay)."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        num_beams: int,
        num_beam_groups: int,
        diversity_penalty: float,
        max_length: int,
        processors,
        criteria,
        *,
        eos_token_id: tuple[int, ...] | None,
        pad_token_id: int,
        fill_token_id: int,
        length_penalty: float,
        early_stopping: bool | str,
        num_return_sequences: int,
        trace: StepTrace,
    ):
        b, t0 = input_ids.shape
        k, g = num_beams, num_beam_groups
        s = k // g
        device = input_ids.device
        self.rows_per_example, self.num_groups, self.group_size = k, g, s
        self.batch_size, self.prompt_length, self.max_length = b, t0, max_length
        self.diversity_penalty, self.pad_token_id = diversity_penalty, pad_token_id
        self.criteria, self.trace, self.eos_token_id = criteria, trace, eos_token_id
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.num_return_sequences = num_return_sequences
        self.num_candidates = max(2, 1 + len(eos_token_id or ())) * s
        self.eos = torch.tensor(eos_token_id, dtype=torch.long, device=device) if eos_token_id else None
        # pool scores in float64, as 4.x's Python floats (float32 where the device has no float64)
        self.pool_dtype = torch.float32 if device.type == "mps" else torch.float64
        width, generated = max(max_length, t0), max(max_length - t0, 0)
        self.length = t0
        self.running_sequences = torch.full((b, k, width), fill_token_id, dtype=torch.long, device=device)
        self.running_sequences[:, :, :t0] = input_ids[:, None, :]  # [B, K, L]
        self.running_scores = torch.zeros(b, g, s, device=device)
        self.running_scores[:, :, 1:] = MASK  # only the first beam of each group is live at step 0
        self.running_scores = self.running_scores.reshape(b, k)  # [B, K] float32 sums of log-probs
        self.running_beam_indices = torch.full((b, k, generated), -1, dtype=torch.long, device=device)  # [B, K, P]
        self.running_token_log_probs = torch.zeros(b, k, generated, device=device)  # [B, K, P]
        # one finished pool of S hypotheses per (example, group)
        self.pool_sequences = torch.full((b, g, s, width), fill_token_id, dtype=torch.long, device=device)
        self.pool_scores = torch.full((b, g, s), EMPTY, dtype=self.pool_dtype, device=device)  # [B, G, S] penalised
        self.pool_beam_indices = torch.full((b, g, s, generated), -1, dtype=torch.long, device=device)
        self.pool_token_log_probs = torch.zeros(b, g, s, generated, device=device)  # [B, G, S, P]
        self.pool_reasons = torch.zeros(b, g, s, dtype=torch.long, device=device)  # [B, G, S] FinishReason codes
        self.pool_counts = torch.zeros(b, g, dtype=torch.long, device=device)  # [B, G] hypotheses held (<= S)
        self.group_done = torch.zeros(b, g, dtype=torch.bool, device=device)  # [B, G]
        # each group's rows, [B*S] flat, and the processors restricted to them (per-row state, e.g. padding)
        beams = torch.arange(k, device=device).reshape(g, s)
        self.group_rows = [(torch.arange(b, device=device)[:, None] * k + beams[i]).reshape(-1) for i in range(g)]
        self.group_processors = [_select_rows(processors, rows) for rows in self.group_rows]
        self._stop: torch.Tensor | bool = max_length <= t0
        self.watch = ScoreWatch()  # NaN in the candidates' scores, read with the step's host sync

    def tokens(self) -> torch.Tensor:
        return flatten_beams(self.running_sequences[:, :, : self.length])  # [N, t]

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """One step: the groups in order; returns the flat parent row of each new live beam, ``[N]``."""
        b, k, s = self.batch_size, self.rows_per_example, self.group_size
        log_probs = torch.log_softmax(logits, dim=-1)  # [N, V]
        vocab = log_probs.shape[-1]
        self.watch.start(self.length - self.prompt_length, logits)
        tokens = self.tokens()  # [N, t], before this step's reorder
        processed = torch.zeros_like(log_probs) if self.trace.scores is not None else None
        chosen_counts = torch.zeros(b, vocab, device=logits.device)  # [B, V] tokens chosen by earlier groups
        parents = torch.empty(b, k, dtype=torch.long, device=logits.device)  # [B, K] within the example
        new_tokens = torch.empty_like(parents)  # [B, K]
        new_scores = torch.empty(b, k, device=logits.device)  # [B, K] sums of log-probs
        new_log_probs = torch.empty(b, k, device=logits.device)  # [B, K] the new tokens' log-probs
        for group, rows in enumerate(self.group_rows):
            group_scores = log_probs.index_select(0, rows)  # [B*S, V]
            if group > 0 and self.diversity_penalty > 0:
                group_scores = group_scores - (self.diversity_penalty * chosen_counts).repeat_interleave(s, dim=0)
            group_scores = self.group_processors[group](tokens.index_select(0, rows), group_scores)
            if processed is not None:
                processed[rows] = group_scores
            beams = slice(group * s, (group + 1) * s)
            token, parent, score, token_log_prob = self._group_step(group, group_scores.reshape(b, s, vocab))
            parents[:, beams], new_tokens[:, beams] = parent + group * s, token
            new_scores[:, beams], new_log_probs[:, beams] = score, token_log_prob
            chosen_counts.scatter_add_(1, token, torch.ones_like(token, dtype=chosen_counts.dtype))
        self.trace.record(processed if processed is not None else log_probs, logits)
        self._update_running(parents, new_tokens, new_scores, new_log_probs)
        self.length += 1
        hits = self.criteria(self.tokens(), self.trace.scores)  # [N]
        self._stop = torch.all(self.group_done) | torch.all(hits)
        return flat_parent_rows(parents)

    def _group_step(self, group: int, log_probs: torch.Tensor):
        """One beam search step of one group; ``log_probs`` ``[B, S, V]`` processed, diversity penalty included.

        Returns the live beams' tokens, parents (within the group), sums and token log-probs, each ``[B, S]``.
        """
        b, s, vocab = log_probs.shape
        beams = slice(group * s, (group + 1) * s)
        scores, flat = top_totals(log_probs, self.running_scores[:, beams], self.num_candidates)  # [B, C], best first
        parents, tokens = flat // vocab, flat % vocab  # [B, C]
        token_log_probs = torch.gather(log_probs.reshape(b, s * vocab), 1, flat)  # [B, C]
        is_eos = torch.isin(tokens, self.eos) if self.eos is not None else torch.zeros_like(tokens, dtype=torch.bool)
        done = self.group_done[:, group].clone()  # [B], before this step (the update below is in place)
        # a NaN in any of the group's rows is ranked first; a group done before this step only carries pad tokens
        self.watch.flag(torch.isnan(scores).any(dim=1) & ~done)
        finishing = is_eos[:, :s] & ~done[:, None]  # [B, S]: EOS among the first S, in groups still open
        if self.eos is not None:
            self._add_finished(group, scores[:, :s], parents[:, :s], tokens[:, :s], token_log_probs[:, :s], finishing)
        live = torch.sort(is_eos.to(torch.uint8), dim=1, stable=True)[1][:, :s]  # [B, S] first S non-EOS, in order
        live_parents, live_tokens = torch.gather(parents, 1, live), torch.gather(tokens, 1, live)
        live_scores, live_log_probs = torch.gather(scores, 1, live), torch.gather(token_log_probs, 1, live)
        self._update_done(group, scores[:, 0])
        # a group done before this step carries the pad token with score 0 (4.x's placeholder)
        done = done[:, None]
        live_tokens = torch.where(done, self.pad_token_id, live_tokens)
        live_parents = torch.where(done, torch.arange(s, device=done.device), live_parents)
        live_scores = torch.where(done, 0.0, live_scores)
        live_log_probs = torch.where(done, 0.0, live_log_probs)
        return live_tokens, live_parents, live_scores, live_log_probs

    def _add_finished(self, group, scores, parents, tokens, token_log_probs, finishing) -> None:
        """Candidates ``[B, S]`` that end with EOS (where ``finishing``) enter the group's pool."""
        beams = slice(group * self.group_size, (group + 1) * self.group_size)
        position = self.length - self.prompt_length
        sequences = gather_beams(self.running_sequences[:, beams], parents)  # [B, S, L]
        sequences[:, :, self.length] = tokens
        beam_indices = gather_beams(self.running_beam_indices[:, beams], parents)  # [B, S, P]
        beam_indices[:, :, position] = self._global_rows(parents + group * self.group_size)
        log_probs = gather_beams(self.running_token_log_probs[:, beams], parents)  # [B, S, P]
        log_probs[:, :, position] = token_log_probs
        penalised = hf_length_normalised(scores.to(self.pool_dtype), position + 1, self.length_penalty)
        penalised = torch.where(finishing, penalised, EMPTY)
        reasons = torch.full_like(tokens, int(FinishReason.EOS))
        groups = slice(group, group + 1)
        self._merge_into_pools(groups, penalised[:, None], sequences[:, None], beam_indices[:, None],
                               log_probs[:, None], reasons[:, None], finishing.sum(dim=1)[:, None])

    def _merge_into_pools(self, groups: slice, scores, sequences, beam_indices, token_log_probs, reasons, added):
        """Keep the S best of each pool and its new hypotheses (4.x's heap: all while it has room, else the better).

        The new hypotheses are ``[B, G', S', ...]`` for the pools ``groups`` (G' of them); ``scores`` is EMPTY
        where there is none, and ``added`` ``[B, G']`` counts them.
        """
        s = self.group_size
        merged = torch.cat((self.pool_scores[:, groups], scores), dim=2)  # [B, G', S + S']
        keep = torch.topk(merged, k=s, dim=2)[1]  # [B, G', S]

        def select(pool: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            both = torch.cat((pool[:, groups], new), dim=2)
            return torch.take_along_dim(both, keep.reshape(*keep.shape, *([1] * (both.dim() - 3))), dim=2)

        self.pool_sequences[:, groups] = select(self.pool_sequences, sequences)
        self.pool_beam_indices[:, groups] = select(self.pool_beam_indices, beam_indices)
        self.pool_token_log_probs[:, groups] = select(self.pool_token_log_probs, token_log_probs)
        self.pool_reasons[:, groups] = select(self.pool_reasons, reasons)
        self.pool_scores[:, groups] = torch.take_along_dim(merged, keep, dim=2)
        self.pool_counts[:, groups] = torch.clamp(self.pool_counts[:, groups] + added, max=s)

    def _update_done(self, group: int, best_scores: torch.Tensor) -> None:
        """4.x's ``BeamHypotheses.is_done`` for one group; ``best_scores`` ``[B]``: the step's best candidate."""
        full = self.pool_counts[:, group] >= self.group_size  # [B]
        if self.early_stopping is True:
            verdict = full
        else:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                length = self.max_length - self.prompt_length
            else:
                length = self.length + 1 - self.prompt_length
            best = hf_length_normalised(best_scores.to(self.pool_dtype), length, self.length_penalty)
            worst = torch.min(self.pool_scores[:, group], dim=1)[0]
            verdict = full & (worst >= best)
        self.group_done[:, group] |= verdict

    def _update_running(self, parents, tokens, scores, token_log_probs) -> None:
        """The new live beams, ``[B, K]`` each: parents within the example, tokens, sums and token log-probs."""
        position = self.length - self.prompt_length
        self.running_sequences = gather_beams(self.running_sequences, parents)
        self.running_sequences[:, :, self.length] = tokens
        self.running_beam_indices = gather_beams(self.running_beam_indices, parents)
        self.running_beam_indices[:, :, position] = self._global_rows(parents)
        self.running_token_log_probs = gather_beams(self.running_token_log_probs, parents)
        self.running_token_log_probs[:, :, position] = token_log_probs
        self.running_scores = scores

    def _global_rows(self, beams: torch.Tensor) -> torch.Tensor:
        """Beam positions ``[B, X]`` within each example -> rows of the flat ``[N]`` batch (HF's beam indices)."""
        offsets = torch.arange(self.batch_size, device=beams.device)[:, None] * self.rows_per_example
        return beams + offsets

    def is_done(self) -> bool:
        if self.length >= self.max_length:
            return True
        return self.watch.read(torch.as_tensor(self._stop).reshape(1))[0]  # the step's one host synchronisation

    def _finalize(self) -> None:
        """The live beams of the groups not done enter their pools, scored at their length (4.x's finalize)."""
        b, g, s = self.batch_size, self.num_groups, self.group_size
        generated = self.length - self.prompt_length
        scores = hf_length_normalised(self.running_scores.reshape(b, g, s).to(self.pool_dtype), max(generated, 1),
                                      self.length_penalty)
        scores = torch.where(self.group_done[:, :, None], EMPTY, scores)
        reason = FinishReason.MAX_LENGTH if self.length >= self.max_length else FinishReason.STOP_CRITERION
        reasons = torch.full((b, g, s), int(reason), dtype=torch.long, device=scores.device)
        width = self.running_sequences.shape[-1]
        self._merge_into_pools(
            slice(None), scores, self.running_sequences.reshape(b, g, s, width),
            self.running_beam_indices.reshape(b, g, s, -1), self.running_token_log_probs.reshape(b, g, s, -1),
            reasons, (~self.group_done).long() * s,
        )

    def result(self) -> SearchResult:
        b, k = self.batch_size, self.rows_per_example
        self._finalize()
        n = self.num_return_sequences
        order = torch.topk(self.pool_scores.reshape(b, k), k=n, dim=1)[1]  # [B, n] best over all groups' pools
        beam_indices = gather_beams(self.pool_beam_indices.reshape(b, k, -1), order)  # [B, n, P]
        generated = (beam_indices >= 0).sum(dim=-1)  # [B, n]
        width = self.watch.read_max(generated)
        token_log_probs = gather_beams(self.pool_token_log_probs.reshape(b, k, -1), order)[:, :, :width]
        sequences = gather_beams(self.pool_sequences.reshape(b, k, -1), order)
        scores, logits = self.trace.as_tuples()
        return SearchResult(
            sequences=sequences[:, :, : self.prompt_length + width],
            sequences_scores=gather_beams(self.pool_scores.reshape(b, k), order).float(),
            sum_log_probs=token_log_probs.sum(dim=-1),
            token_log_probs=token_log_probs,
            lengths=self.prompt_length + generated,
            finish_reason=gather_beams(self.pool_reasons.reshape(b, k), order),
            prompt_length=self.prompt_length,
            scores=scores,
            logits=logits,
            beam_indices=beam_indices[:, :, :width],
        )


def _select_rows(processors, rows: torch.Tensor):
    """The processors for one group's rows (those with per-row state keep only these rows' state)."""
    return ProcessorList((p.select_rows(rows) if callable(getattr(p, "select_rows", None)) else p for p in processors),
                         getattr(processors, "foreign", None))
