"""Exact search: the hypothesis with the best score under the model, found by branch and bound.

Beam search keeps K hypotheses and can miss the best one (a *search error*); exact search proves it found the
best, which separates search errors from model errors (Stahlberg & Byrne, 2019, "On NMT Search Errors and Model
Errors: Cat Got Your Tongue?"). The score is transformers' beam score, ``sum_log_probs / generated **
length_penalty`` (``length_penalty=0``: the plain sum), over every hypothesis that ends with an end token or
reaches the length limit, with the search's processors applied to the log-softmax as beam search applies them.

Branch and bound, breadth first, so that each step is one batched model call:

- the frontier holds every partial hypothesis that could still beat the best complete one found so far (the
  *incumbent*); a step extends each frontier row by every token;
- a child that ends (an end token, or the length limit) is complete: its score may replace the incumbent;
- any other child survives only if its *bound* beats the incumbent. Log-probs are <= 0, so a continuation's
  total ``s'`` is at most the child's total ``s``, and its score ``s' / L ** length_penalty`` at most
  ``max(s / (g + 1) ** length_penalty, s / G ** length_penalty)`` for a child of g generated tokens and a limit
  of G (the score is monotone in L; Meister, Cotterell & Vieira, 2020, "If beam search is the answer, what was the
  question?", use the same argument). The bound is admissible, so nothing pruned could have won.

The frontier is small when the model is confident: the hypotheses of a length whose total log-prob exceeds ``c``
number at most ``exp(-c)``. A good incumbent from the start prunes most of it: ``incumbent=`` takes a beam search
result over the same inputs (its best score is used as a threshold with a small margin, so a score computed in
another batch shape cannot prune the true best; the incumbent's path is then found again and scored here).
``max_nodes`` bounds the work per example: an example that would expand more stops, is reported unproven
(``proven`` False) with ``upper_bound``, the best score any hypothesis it did not explore could reach.

Legend: B examples, N frontier rows (each belongs to one example), V vocabulary, L = max_length, t tokens so far,
t0 start tokens, G = L - t0 generated positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..processors.pipeline import run_processors
from ..results import FinishReason, SearchResult
from ..scoring import hf_length_normalised
from .pool import Hypotheses, PoolSearch

MARGIN = 1.0e-4  # relative slack on the incumbent's score when it only serves as a pruning threshold


@dataclasses.dataclass(frozen=True)
class ExactResult(SearchResult):
    """A :class:`SearchResult` of exact search (one hypothesis per example).

    Attributes:
        proven: BoolTensor ``[B]``: the hypothesis is the best under the score (the search finished within
            ``max_nodes``).
        upper_bound: FloatTensor ``[B]``: where not proven, no unexplored hypothesis scores above this; -inf where
            proven.
        nodes: LongTensor ``[B]``: partial hypotheses expanded.
    """

    proven: torch.Tensor | None = None
    upper_bound: torch.Tensor | None = None
    nodes: torch.Tensor | None = None

    def to_dicts(self, decode: Any = None) -> list[list[dict[str, Any]]]:
        """:meth:`SearchResult.to_dicts`, each hypothesis with ``proven``, ``upper_bound`` and ``nodes``."""
        out = super().to_dicts(decode)
        for b, hyps in enumerate(out):
            for hyp in hyps:
                hyp.update(proven=bool(self.proven[b]), upper_bound=float(self.upper_bound[b]),
                           nodes=int(self.nodes[b]))
        return out


class ExactSearch(PoolSearch):
    """Branch and bound over all hypotheses up to the length limit (see the module docstring).

    Its live hypotheses are the frontier, one row each (``[N, ...]`` fields, not ``[B, K, ...]``): the loop starts
    it with one row per example."""

    def __init__(self, input_ids: torch.Tensor, max_length: int, processors, *, eos_token_id: tuple[int, ...] | None,
                 fill_token_id: int, length_penalty: float, max_nodes: int, trace,
                 incumbent: SearchResult | None = None):
        if not all(callable(getattr(p, "select_rows", None)) for p in processors):
            raise ValueError("exact search needs processors that can follow rows (select_rows(index)); a user "
                             "processor without it cannot be used with exact_search")
        super().__init__(input_ids, 1, max_length, processors, None, trace)
        (b, t0), device = input_ids.shape, input_ids.device
        self.length_penalty, self.max_nodes = length_penalty, max_nodes
        self.eos = torch.tensor(eos_token_id or (), dtype=torch.long, device=device)  # [E]
        # the frontier: one row per partial hypothesis, "example" [N] says whose; scores hold totals of log-probs
        self.frontier = Hypotheses.start(input_ids, 1, max_length, fill_token_id,
                                         scores=torch.zeros(b, 1, device=device)).map(lambda x: x.squeeze(1))
        self.example = torch.arange(b, device=device)  # [N]
        # the incumbent: the best complete hypothesis found so far, [B, 1]
        self.best = Hypotheses.empty(input_ids, 1, max_length, fill_token_id, float("-inf"))
        self.threshold = torch.full((b,), float("-inf"), device=device)  # [B] what a child's bound must beat
        if incumbent is not None:
            claimed = incumbent.sequences_scores[:, 0].to(device=device, dtype=torch.float32)
            if claimed.shape != (b,):
                raise ValueError(f"incumbent must be a result for the same {b} examples, got scores of shape "
                                 f"{tuple(incumbent.sequences_scores.shape)}")
            self.threshold = claimed - MARGIN * claimed.abs().clamp(min=1.0)
        self.nodes = torch.zeros(b, dtype=torch.long, device=device)  # [B]
        self.upper_bound = torch.full((b,), float("-inf"), device=device)  # [B] of what the budget cut off
        self._done = max_length <= t0

    def tokens(self) -> torch.Tensor:
        return self.frontier.tokens[:, : self.length]  # [N, t]

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """Extend every frontier row by every token; returns the parent row of each new frontier row ``[N']``."""
        log_probs = run_processors(self.processors, self.tokens(), torch.log_softmax(logits, dim=-1), True)  # [N, V]
        self.watch.start(self.length - self.prompt_length, logits, log_probs)
        invalid = torch.zeros(self.batch_size, dtype=torch.bool, device=logits.device)
        self.watch.flag(invalid.index_put((self.example,), torch.isnan(log_probs).any(dim=1), accumulate=True))
        if bool((log_probs > 0).any()):
            raise ValueError("exact search needs log-probs <= 0 (its bound relies on it); a processor raised some "
                             "above 0")
        totals = self.frontier.scores[:, None] + log_probs  # [N, V]
        generated = self.length + 1 - self.prompt_length
        last = self.length + 1 >= self.max_length
        vocab = log_probs.shape[1]
        ends = torch.isin(torch.arange(vocab, device=logits.device), self.eos)[None, :].expand_as(totals)
        if last:
            ends = torch.ones_like(ends)
        self._complete(log_probs, torch.where(ends, hf_length_normalised(totals, generated, self.length_penalty),
                                              float("-inf")))
        bound = torch.maximum(hf_length_normalised(totals, generated + 1, self.length_penalty),
                              hf_length_normalised(totals, self.max_length - self.prompt_length, self.length_penalty))
        threshold = torch.maximum(self.threshold, self.best.scores[:, 0])[self.example]  # [N]
        alive = self._within_budget(~ends & (bound > threshold[:, None]), bound)
        rows, tokens = alive.nonzero(as_tuple=True)  # [N'] each
        self.frontier = self.frontier.take(rows).map(torch.clone)
        self.frontier.scores = totals[rows, tokens]
        position = self.length - self.prompt_length
        self.frontier.tokens[:, self.length] = tokens
        self.frontier.token_log_probs[:, position] = log_probs[rows, tokens]
        self.frontier.beam_indices[:, position] = rows
        self.example = self.example[rows]
        self.length += 1
        self._done = last or rows.numel() == 0
        self.processors = self.processors.select_rows(rows)
        return rows

    def _complete(self, log_probs: torch.Tensor, scores: torch.Tensor) -> None:
        """Make the best complete child of each example (``scores [N, V]``, -inf: not complete) the incumbent if it
        beats it."""
        n, _ = scores.shape
        row_best, row_token = scores.max(dim=1)  # [N]
        best = torch.full_like(self.threshold, float("-inf")).scatter_reduce(0, self.example, row_best, "amax")
        improved = best > self.best.scores[:, 0]  # [B]
        positions = torch.arange(n, device=scores.device)
        first = torch.full_like(self.nodes, n).scatter_reduce(
            0, self.example, torch.where(row_best == best[self.example], positions, n), "amin").clamp(max=n - 1)
        token = row_token[first]  # [B]
        child = self.frontier.take(first).map(torch.clone)
        position = self.length - self.prompt_length
        child.tokens[:, self.length] = token
        child.token_log_probs[:, position] = log_probs[first, token]
        child.beam_indices[:, position] = first
        reason = torch.where(torch.isin(token, self.eos), int(FinishReason.EOS), int(FinishReason.MAX_LENGTH))
        child = child.replace(scores=best, reasons=reason, finished=torch.ones_like(improved))
        self.best = child.map(lambda x: x[:, None]).where(improved, self.best)

    def _within_budget(self, alive: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        """Stop the examples whose surviving children would pass ``max_nodes``: they keep no child, and their
        ``upper_bound`` records the best bound among those children."""
        counts = torch.zeros_like(self.nodes).index_put((self.example,), alive.sum(dim=1), accumulate=True)  # [B]
        over = self.nodes + counts > self.max_nodes  # [B]
        self.nodes = torch.where(over, self.nodes, self.nodes + counts)
        cut = torch.where(alive, bound, float("-inf")).max(dim=1)[0]  # [N] (no host sync to ask whether any is over)
        cut = torch.full_like(self.upper_bound, float("-inf")).scatter_reduce(0, self.example, cut, "amax")
        self.upper_bound = torch.where(over, torch.maximum(self.upper_bound, cut), self.upper_bound)
        return alive & ~over[self.example][:, None]

    def is_done(self) -> bool:
        return self._done

    def result(self) -> ExactResult:
        self.watch.close()
        # what the incumbent's threshold pruned scores at most the threshold: proven only if something as good was
        # found (a claimed score above the truth cannot make a wrong answer look proven)
        best = self.best.scores[:, 0]
        self.upper_bound = torch.where(best < self.threshold, torch.maximum(self.upper_bound, self.threshold),
                                       self.upper_bound)
        proven = self.upper_bound <= best
        return self.best.result(1, self.trace, self.watch, result_type=ExactResult, proven=proven,
                                upper_bound=torch.where(proven, float("-inf"), self.upper_bound), nodes=self.nodes)
