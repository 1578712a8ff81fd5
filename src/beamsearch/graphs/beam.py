"""Beam search as a graph-safe step: ``strategies/beam.py``'s transformers beam search at a tensor length.

The arithmetic and its order are those of :class:`~beamsearch.strategies.beam.BeamSearch` without sampling,
scorer, de-duplication or alignments: the processors on the log-softmax, the top C of the K x V totals, candidates
that end among the first K entering the finished pool scored ``total / generated ** length_penalty``, the K best
others the next live beams, and transformers' early-stopping heuristic. What changes is how:

- the length is a 0-d tensor; tokens, log-probs and beam indices are written to a fixed column (``index_copy_``);
  the length penalty's divisors ``g ** length_penalty`` come from a table made on the host (the same float32
  values the eager search divides by);
- the top C is ``torch.topk`` over the ``[B, K*V]`` totals (``selection.top_totals`` returns the same on a CPU, but
  decides on the host);
- every pool tensor is updated in place (a captured step holds their addresses); the step returns the parent row
  of each new beam, which the model state applies to its parent index, not to its cache;
- finished examples are not compacted: an example is done when no live beam can beat its full pool (or the pool
  is full under ``early_stopping=True``), and from then on its pool no longer changes (its candidates are masked
  out, as in the eager search without ``remove_finished``); the bucket's padding examples start done.

Legend: B examples (a bucket), K beams, C candidates per example, N = B*K, V vocabulary, L = max_length,
t0 start tokens, G = L - t0 generated positions.
"""

from __future__ import annotations

import torch

from ..beams import flat_parent_rows, flatten_beams, gather_beams
from ..results import SearchResult
from ..strategies.base import MASK, StepTrace
from ..strategies.pool import Hypotheses, first_live
from ..strategies.score_checks import ScoreWatch
from .processors import GraphProcessor, processor_tensors, run_graph_processors
from .search_state import SearchFlags, stop_reasons


class GraphBeamSearch:
    """transformers' beam search over fixed shapes (see the module docstring).

    Args:
        input_ids: ``[B, t0]`` LongTensor (a bucket: padding examples included).
        num_beams: K.
        max_length: L.
        processors: graph-safe processors (:func:`.processors.graph_processors`).
        eos_token_id: the end ids, or None.
        fill_token_id: what returned sequences are filled with.
        length_penalty, early_stopping, num_return_sequences: as in transformers.
        real: ``[B]`` BoolTensor, the call's own examples (the others start done).
    """

    def __init__(self, input_ids: torch.Tensor, num_beams: int, max_length: int, processors: list[GraphProcessor],
                 *, eos_token_id: tuple[int, ...] | None, fill_token_id: int, length_penalty: float,
                 early_stopping: bool | str, num_return_sequences: int, real: torch.Tensor):
        (b, t0), k, device = input_ids.shape, num_beams, input_ids.device
        self.prompt_length, self.max_length, self.rows_per_example = t0, max_length, k
        self.processors, self.early_stopping = processors, early_stopping
        self.length_penalty, self.num_return_sequences = length_penalty, num_return_sequences
        self.num_candidates = max(2, 1 + len(eos_token_id or ())) * k
        self.eos = None if eos_token_id is None else torch.tensor(eos_token_id, dtype=torch.long, device=device)
        self.live = Hypotheses.start(input_ids, k, max_length, fill_token_id, scores=first_live(b, k, MASK, device))
        self.finished = Hypotheses.empty(input_ids, k, max_length, fill_token_id, MASK)
        self.can_improve = real[:, None].clone()  # [B, 1]
        self.top_k_mask = torch.arange(self.num_candidates, device=device) < k  # [C]
        self.offsets = torch.arange(b, device=device)[:, None] * k  # [B, 1] first row of each example
        # g ** length_penalty for g generated tokens, float32 as the eager search's Python float becomes
        self.divisors = torch.tensor([float(g) ** length_penalty if g else 1.0 for g in range(max_length - t0 + 2)],
                                     dtype=torch.float32, device=device)
        self.length = torch.tensor(t0, dtype=torch.long, device=device)  # t: tokens so far
        self.flags = SearchFlags(b, device)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor the step reads or writes, in a fixed order (``reuse.py`` loads a call into kept ones)."""
        return [*self.live.fields.values(), *self.finished.fields.values(), self.can_improve, self.length,
                *self.flags.static_tensors(), *processor_tensors(self.processors), self.top_k_mask, self.offsets,
                self.divisors, *([] if self.eos is None else [self.eos])]

    def last_tokens(self) -> torch.Tensor:
        """``[N]``: each beam's last token, what the model is fed next."""
        return self.live.tokens.index_select(2, (self.length - 1).view(1)).reshape(-1)

    def done(self) -> torch.Tensor:
        """``[B]``: examples whose finished pool can no longer change."""
        done = ~self.can_improve[:, 0]
        if self.early_stopping is True:
            done = done | torch.all(self.finished.finished, dim=-1)
        return done

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """One step on the step's logits ``[N, V]`` (float32); returns the flat parent row of each new beam ``[N]``."""
        b, k, length = self.can_improve.shape[0], self.rows_per_example, self.length
        active = ~self.done()  # [B] examples the eager search would still decode
        log_probs = run_graph_processors(self.processors, torch.log_softmax(logits, dim=-1),
                                         flatten_beams(self.live.tokens), length)  # [N, V]
        vocab = log_probs.shape[-1]
        totals = (log_probs.view(b, k, vocab) + self.live.scores[:, :, None]).view(b, k * vocab)  # [B, K*V]
        scores, flat = torch.topk(totals, self.num_candidates)  # [B, C]
        self.flags.flag(torch.isnan(scores).any(dim=1) & active, length - self.prompt_length)
        parents, tokens = flat // vocab, flat % vocab  # [B, C]
        candidates = self.live.gather(parents)
        candidates.tokens.index_copy_(2, length.view(1), tokens[:, :, None])
        column = (length - self.prompt_length).view(1)
        candidates.token_log_probs.index_copy_(2, column, torch.gather(log_probs.view(b, -1), 1, flat)[:, :, None])
        candidates.beam_indices.index_copy_(2, column, (parents + self.offsets)[:, :, None])
        candidates.scores = scores
        at_max = length + 1 >= self.max_length  # 0-d: every candidate reaches the length limit
        is_eos = self._is_eos(tokens)  # [B, C]
        hits = is_eos | at_max  # [B, C]
        self._update_finished(candidates, hits, stop_reasons(is_eos, at_max))
        keep = self._update_running(candidates, hits)
        length.add_(1)
        self._update_can_improve()
        all_hit = torch.all(hits | ~active[:, None])  # every candidate of every decoded example stopped
        self.flags.set_going(~all_hit & torch.any(~self.done()))
        return flat_parent_rows(gather_beams(parents, keep))  # [N]

    def _is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.eos is None:
            return torch.zeros_like(tokens, dtype=torch.bool)
        return (tokens[..., None] == self.eos).any(dim=-1)

    def _update_finished(self, candidates: Hypotheses, hits: torch.Tensor, reasons: torch.Tensor) -> None:
        """Candidates that stopped among the first K enter the finished pool (in place)."""
        pool = self.finished
        just_finished = hits & self.top_k_mask[None, :]  # [B, C]
        penalised = candidates.scores / self._divisor(self.length + 1 - self.prompt_length)
        pool_full = torch.all(pool.finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        penalised += pool_full.to(torch.float32) * MASK
        penalised += (~self.can_improve).to(torch.float32) * MASK
        penalised += (~just_finished) * MASK
        merged_scores = torch.cat((pool.scores, penalised), dim=1)  # [B, K + C]
        keep = torch.topk(merged_scores, k=self.rows_per_example)[1]  # [B, K]
        just = candidates.replace(scores=penalised, finished=just_finished,
                                  reasons=torch.where(just_finished, reasons, 0))
        _assign(pool, pool.merge(just, keep))

    def _update_running(self, candidates: Hypotheses, hits: torch.Tensor) -> torch.Tensor:
        """The best K candidates that did not stop become the live beams (in place); returns their positions."""
        live_scores = candidates.scores + hits.to(torch.float32) * MASK  # [B, C]
        keep = torch.topk(live_scores, k=self.rows_per_example)[1]  # [B, K]
        _assign(self.live, candidates.replace(scores=live_scores).gather(keep))
        return keep

    def _update_can_improve(self) -> None:
        """Whether the best live beam could still beat the worst finished one (transformers' heuristic)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_running = self.live.scores[:, :1] / ((self.max_length - self.prompt_length) ** self.length_penalty)
        else:
            best_running = self.live.scores[:, :1] / self._divisor(self.length - self.prompt_length)
        pool = self.finished
        worst_finished = torch.where(pool.finished, torch.min(pool.scores, dim=1, keepdim=True)[0], MASK)
        improve = self.can_improve & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        self.can_improve.copy_(improve)

    def _divisor(self, generated: torch.Tensor) -> torch.Tensor:
        """``[1]``: ``generated ** length_penalty`` from the table (``index_select``: indexing with a 0-d tensor
        would read it on the host)."""
        return self.divisors.index_select(0, generated.view(1))

    def result(self, examples: int) -> SearchResult:
        """The first ``examples`` examples' result, as the eager search returns it."""
        pool = self.finished.take(torch.arange(examples, device=self.length.device))
        return pool.result(self.num_return_sequences, StepTrace(False, False), ScoreWatch())


def _assign(static: Hypotheses, new: Hypotheses) -> None:
    """Every field of ``static`` takes ``new``'s values in place (the same fields and shapes)."""
    for name, value in static.fields.items():
        value.copy_(new.fields[name])
