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

from ..beams import flat_parent_rows
from ..processors import ProcessorList
from ..results import FinishReason, SearchResult
from ..scoring import hf_length_normalised
from ..selection import top_totals
from .base import MASK, StepTrace
from .pool import Hypotheses, PoolSearch, first_live

EMPTY = float("-inf")  # the score of an empty place in a finished pool (only ever compared, never multiplied)


class GroupBeamSearch(PoolSearch):
    """Diverse beam search over G groups of S beams each; ``remove_finished`` does not apply (rows stay).

    ``live``: the K beams of each example, :class:`Hypotheses` ``[B, K]`` (group g's are ``g*S .. g*S + S-1``),
    scored by their float32 sums of log-probs. ``pools``: the finished pool of each (example, group),
    :class:`Hypotheses` ``[B*G, S]`` (row ``b*G + g``), scored by the penalised score in float64 (``EMPTY``: an
    empty place), with ``reasons``.
    """

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
        super().__init__(input_ids, num_beams, max_length, processors, criteria, trace)
        (b, t0), k, g, device = input_ids.shape, num_beams, num_beam_groups, input_ids.device
        s = k // g
        self.num_groups, self.group_size = g, s
        self.diversity_penalty, self.pad_token_id, self.eos_token_id = diversity_penalty, pad_token_id, eos_token_id
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.num_return_sequences = num_return_sequences
        self.num_candidates = max(2, 1 + len(eos_token_id or ())) * s
        self.eos = torch.tensor(eos_token_id, dtype=torch.long, device=device) if eos_token_id else None
        # pool scores in float64, as 4.x's Python floats (float32 where the device has no float64)
        self.pool_dtype = torch.float32 if device.type == "mps" else torch.float64
        # only the first beam of each group is live at step 0
        self.live = Hypotheses.start(input_ids, k, max_length, fill_token_id,
                                     scores=first_live(b * g, s, MASK, device).reshape(b, k))
        # an empty place holds fill tokens only (the start tokens too)
        self.pools = Hypotheses.start(
            torch.full((b * g, t0), fill_token_id, dtype=torch.long, device=device), s, max_length, fill_token_id,
            scores=torch.full((b * g, s), EMPTY, dtype=self.pool_dtype, device=device),
            reasons=torch.zeros(b * g, s, dtype=torch.long, device=device))
        self.pool_counts = torch.zeros(b, g, dtype=torch.long, device=device)  # [B, G] hypotheses held (<= S)
        self.group_done = torch.zeros(b, g, dtype=torch.bool, device=device)  # [B, G]
        # each group's rows, [B*S] flat, and the processors restricted to them (per-row state, e.g. padding)
        beams = torch.arange(k, device=device).reshape(g, s)
        self.group_rows = [(torch.arange(b, device=device)[:, None] * k + beams[i]).reshape(-1) for i in range(g)]
        self.group_processors = [_select_rows(processors, rows) for rows in self.group_rows]
        self._stop: torch.Tensor | bool = max_length <= t0

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """One step: the groups in order; returns the flat parent row of each new live beam, ``[N]``."""
        b, s = self.batch_size, self.group_size
        log_probs = torch.log_softmax(logits, dim=-1)  # [N, V]
        vocab = log_probs.shape[-1]
        self.watch.start(self.length - self.prompt_length, logits)
        tokens = self.tokens()  # [N, t], before this step's reorder
        processed = torch.zeros_like(log_probs) if self.trace.scores is not None else None
        chosen_counts = torch.zeros(b, vocab, device=logits.device)  # [B, V] tokens chosen by earlier groups
        steps = []
        for group, rows in enumerate(self.group_rows):
            group_scores = log_probs.index_select(0, rows)  # [B*S, V]
            if group > 0 and self.diversity_penalty > 0:
                group_scores = group_scores - (self.diversity_penalty * chosen_counts).repeat_interleave(s, dim=0)
            group_scores = self.group_processors[group](tokens.index_select(0, rows), group_scores)
            if processed is not None:
                processed[rows] = group_scores
            steps.append(self._group_step(group, group_scores.reshape(b, s, vocab)))
            token = steps[-1][0]  # [B, S]
            chosen_counts.scatter_add_(1, token, torch.ones_like(token, dtype=chosen_counts.dtype))
        # [B, K] each: the new tokens, their parents within the example, sums of log-probs and the tokens' log-probs
        new_tokens, parents, new_scores, new_log_probs = (torch.cat(part, dim=1) for part in zip(*steps, strict=True))
        self.trace.record(processed if processed is not None else log_probs, logits)
        self.live = self.live.extend(parents, new_tokens, new_log_probs, self._global_rows(parents), self.length)
        self.live.scores = new_scores
        self.length += 1
        hits = self.criteria(self.tokens(), self.trace.scores)  # [N]
        self._stop = torch.all(self.group_done) | torch.all(hits)
        return flat_parent_rows(parents)

    def _group_step(self, group: int, log_probs: torch.Tensor):
        """One beam search step of one group; ``log_probs`` ``[B, S, V]`` processed, diversity penalty included.

        Returns the live beams' tokens, parents (within the example), sums and token log-probs, each ``[B, S]``.
        """
        b, s, vocab = log_probs.shape
        beams = slice(group * s, (group + 1) * s)
        scores, flat = top_totals(log_probs, self.live.scores[:, beams], self.num_candidates)  # [B, C], best first
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
        return live_tokens, live_parents + group * s, live_scores, live_log_probs

    def _add_finished(self, group, scores, parents, tokens, token_log_probs, finishing) -> None:
        """Candidates ``[B, S]`` that end with EOS (where ``finishing``) enter the group's pool."""
        parents = parents + group * self.group_size  # [B, S] within the example
        candidates = self.live.extend(parents, tokens, token_log_probs, self._global_rows(parents), self.length)
        penalised = hf_length_normalised(scores.to(self.pool_dtype), self.length + 1 - self.prompt_length,
                                         self.length_penalty)
        reasons = torch.full_like(tokens, int(FinishReason.EOS))
        pools = torch.arange(self.batch_size, device=tokens.device) * self.num_groups + group  # [B]
        self._merge_into_pools(pools, candidates.replace(scores=torch.where(finishing, penalised, EMPTY),
                                                         reasons=reasons), finishing.sum(dim=1))

    def _merge_into_pools(self, pools: torch.Tensor, new: Hypotheses, added: torch.Tensor) -> None:
        """Keep the S best of each pool and its new hypotheses (4.x's heap: all while it has room, else the better).

        ``pools`` ``[P']`` are rows of ``self.pools``, ``new`` their new hypotheses ``[P', S']``, scored EMPTY where
        there is none, and ``added`` ``[P']`` counts them.
        """
        s = self.group_size
        pool = self.pools.take(pools)  # [P', S]
        keep = torch.topk(torch.cat((pool.scores, new.scores), dim=1), k=s, dim=1)[1]  # [P', S]
        self.pools.put(pools, pool.merge(new, keep))
        counts = self.pool_counts.view(-1)  # [B*G]
        counts[pools] = torch.clamp(counts[pools] + added, max=s)

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
            worst = torch.min(self.pools.scores.reshape(self.batch_size, self.num_groups, -1)[:, group], dim=1)[0]
            verdict = full & (worst >= best)
        self.group_done[:, group] |= verdict

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
        live = self.live.map(lambda value: value.reshape(b * g, s, *value.shape[2:]))  # [B*G, S]
        generated = self.length - self.prompt_length
        scores = hf_length_normalised(live.scores.to(self.pool_dtype), max(generated, 1), self.length_penalty)
        open_groups = ~self.group_done.reshape(-1)  # [B*G]
        reason = FinishReason.MAX_LENGTH if self.length >= self.max_length else FinishReason.STOP_CRITERION
        reasons = torch.full((b * g, s), int(reason), dtype=torch.long, device=scores.device)
        self._merge_into_pools(torch.arange(b * g, device=scores.device), live.replace(
            scores=torch.where(open_groups[:, None], scores, EMPTY), reasons=reasons), open_groups.long() * s)

    def result(self) -> SearchResult:
        b, k, n = self.batch_size, self.rows_per_example, self.num_return_sequences
        self._finalize()
        pools = self.pools.map(lambda value: value.reshape(b, k, *value.shape[2:]))  # [B, K]: all groups' pools
        best = pools.gather(torch.topk(pools.scores, k=n, dim=1)[1])  # [B, n] best over all groups' pools
        return best.result(n, self.trace, self.watch, scores=best.scores.float(), finish_reason=best.reasons)


def _select_rows(processors, rows: torch.Tensor):
    """The processors for one group's rows (those with per-row state keep only these rows' state)."""
    return ProcessorList((p.select_rows(rows) if callable(getattr(p, "select_rows", None)) else p for p in processors),
                         getattr(processors, "foreign", None))
