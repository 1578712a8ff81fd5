"""Lexically constrained beam search with dynamic beam allocation (Post & Vilar 2018).

Constraints are words or phrases (token sequences) that must appear in the output; a constraint may be
disjunctive (any one of several phrases satisfies it), as transformers 4.x's ``force_words_ids``. On top of
transformers' beam search bookkeeping (finished pool, ``early_stopping``, length penalty):

- candidates are the usual top C = 2K continuations, plus, for every beam, each token that starts or continues a
  phrase of a constraint it has not met yet, plus its single best token;
- the C candidates (ordered by constraints met, then score, so that of the first K, which may finish, those
  that met more come first), and then the K live beams, are chosen bank by bank: bank j holds the hypotheses
  that have produced j constraint tokens (a met constraint counts the length of its longest phrase, one in
  progress the length of the phrase prefix it ends with), each bank gets an equal share of the slots (the
  remainder to the banks that produced the most), and slots a bank cannot fill go to the best remaining
  candidates;
- the end token is allowed only once every constraint is met; a hypothesis that reaches the length limit
  without meeting them all still finishes, ranks after every hypothesis that met them, and reports how many it
  missed (``SearchResult.unmet_constraints``).

Legend: B examples, K beams, C = 2K candidates, V vocabulary, Q constraints, P phrases (all alternatives).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .base import MASK
from .beam import BeamSearch

BANK_GAP = 1.0e4  # per unmet constraint, subtracted from the finished pool's ranking key (not from the scores)


def parse_constraints(force_words_ids: Any) -> list[list[list[int]]]:
    """``[[ids], ...]`` (phrases) or ``[[[ids], [ids]], ...]`` (disjunctive) -> constraints of alternative phrases."""
    if not isinstance(force_words_ids, (list, tuple)) or not force_words_ids:
        raise ValueError(f"force_words_ids must be a non-empty list of constraints, got {force_words_ids!r}")
    constraints = []
    for item in force_words_ids:
        alternatives = item if item and isinstance(item[0], (list, tuple)) else [item]
        phrases = []
        for phrase in alternatives:
            if not isinstance(phrase, (list, tuple)) or not phrase:
                raise ValueError(f"force_words_ids: each phrase must be a non-empty list of token ids, got {phrase!r}")
            for token in phrase:
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"force_words_ids: token ids must be integers >= 0, got {token!r}")
            phrases.append(list(phrase))
        constraints.append(phrases)
    return constraints


class ConstrainedBeamSearch(BeamSearch):
    """Beam search whose outputs must contain every constraint (see the module docstring).

    Args:
        constraints: per constraint, its alternative phrases (:func:`parse_constraints`).
        Everything else as :class:`BeamSearch` (no sampling, no finished-example removal).
    """

    def __init__(self, input_ids: torch.Tensor, num_beams: int, max_length: int, processors, criteria, *,
                 constraints: Sequence[Sequence[Sequence[int]]], **kwargs: Any):
        super().__init__(input_ids, num_beams, max_length, processors, criteria, **kwargs)
        b, device = input_ids.shape[0], input_ids.device
        self.phrases = [(c, list(p)) for c, alternatives in enumerate(constraints) for p in alternatives]
        self._phrase_tensors = [torch.tensor(p, device=device) for _, p in self.phrases]  # made once, not per step
        self.num_constraints = q = len(constraints)
        # the field "met" [B, K, Q] of both pools: which constraints each hypothesis has met
        self.live.met = torch.zeros(b, num_beams, q, dtype=torch.bool, device=device)
        self.finished.met = self.live.met.clone()
        self.constraint_tokens = [max(len(p) for p in alternatives) for alternatives in constraints]  # [Q]
        self.num_banks = sum(self.constraint_tokens) + 1
        self._candidate_bank: torch.Tensor | None = None  # [B, C] constraint tokens produced
        self._completes: torch.Tensor | None = None  # [Q, B, K, V] during a step
        self._banks: torch.Tensor | None = None  # [B, K, V] during a step

    # ------------------------------------------------------------------ constraint bookkeeping

    def _suffix_matches(self, prefix: torch.Tensor) -> torch.Tensor:
        """``[B, K]``: whether each beam's generated tokens end with ``prefix`` (empty: always)."""
        b, k = self.live.scores.shape
        if not len(prefix):
            return torch.ones(b, k, dtype=torch.bool, device=self.live.scores.device)
        if self.length - self.prompt_length < len(prefix):
            return torch.zeros(b, k, dtype=torch.bool, device=self.live.scores.device)
        tail = self.live.tokens[:, :, self.length - len(prefix) : self.length]  # [B, K, len]
        return (tail == prefix).all(dim=-1)

    def _step_tables(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For this step: ``advancing [B, K, V]`` (tokens that start or continue a phrase of an unmet constraint),
        ``completes [Q, B, K, V]`` (tokens that complete one) and ``banks [B, K, V]`` (constraint tokens produced
        once the token is appended)."""
        b, k = self.live.scores.shape
        device = self.live.scores.device
        advancing = torch.zeros(b, k, vocab, dtype=torch.bool, device=device)
        completes = torch.zeros(self.num_constraints, b, k, vocab, dtype=torch.bool, device=device)
        progress = torch.zeros(self.num_constraints, b, k, vocab, dtype=torch.long, device=device)
        for (c, phrase), phrase_tensor in zip(self.phrases, self._phrase_tensors, strict=True):
            unmet = ~self.live.met[:, :, c]  # [B, K]
            for j, token in enumerate(phrase):
                if token >= vocab:
                    raise ValueError(f"force_words_ids holds token {token}, outside the model's {vocab} logits")
                ready = unmet & self._suffix_matches(phrase_tensor[:j])
                advancing[:, :, token] |= ready
                done = j == len(phrase) - 1
                if done:
                    completes[c, :, :, token] |= ready
                value = self.constraint_tokens[c] if done else j + 1
                progress[c, :, :, token] = torch.maximum(progress[c, :, :, token], ready.long() * value)
        met = torch.tensor(self.constraint_tokens, device=device)[:, None, None, None] * self.live.met.permute(
            2, 0, 1)[..., None]  # [Q, B, K, 1] a met constraint keeps its full count
        banks = torch.maximum(progress, met).sum(dim=0)  # [B, K, V]
        return advancing, completes, banks

    # ------------------------------------------------------------------ the search step

    def _grow(self, log_probs: torch.Tensor):
        b, k, vocab = log_probs.shape
        all_met = self.live.met.all(dim=-1)  # [B, K]
        if self.eos_token_id:  # the end only once every constraint is met
            eos = torch.tensor(self.eos_token_id, device=log_probs.device)
            banned = torch.zeros(vocab, dtype=torch.bool, device=log_probs.device)
            banned[eos[eos < vocab]] = True
            log_probs = log_probs.masked_fill(~all_met[:, :, None] & banned, -torch.inf)
        self._advancing, self._completes, self._banks = self._step_tables(vocab)
        self._log_probs = log_probs
        candidates, parents = super()._grow(log_probs)  # "met" gathered from the parents
        completes = self._completes.permute(1, 2, 3, 0).reshape(b, k * vocab, self.num_constraints)  # [B, K*V, Q]
        flat = parents * vocab + candidates.tokens[:, :, self.length]  # [B, C]
        candidates.met = candidates.met | torch.gather(completes, 1, flat[:, :, None].expand(-1, -1,
                                                                                              self.num_constraints))
        self._candidate_bank = torch.gather(self._banks.reshape(b, k * vocab), 1, flat)  # [B, C]
        return candidates, parents

    def _choose_candidates(self, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, k, vocab = log_probs.shape
        c, kv = self.num_candidates, k * vocab
        totals = (log_probs + self.live.scores[:, :, None]).reshape(b, kv)  # [B, K*V]
        union = torch.zeros_like(totals, dtype=torch.bool)
        top, positions = torch.topk(totals, k=c)  # the usual top C
        self.watch.flag(torch.isnan(top).any(dim=1))  # NaN ranks first: if the top C hold none, the rows hold none
        union.scatter_(1, positions, True)
        union |= self._advancing.reshape(b, kv)  # tokens that start or continue an unmet constraint
        best = torch.argmax(self._log_probs, dim=-1) + torch.arange(k, device=totals.device) * vocab  # [B, K]
        union.scatter_(1, best, True)  # each beam's best token
        union &= totals > MASK / 2  # no candidates of dead beams (step 0: only the first beam lives)
        banks = self._banks.reshape(b, kv)  # constraint tokens produced after the token
        chosen = self._allocate(totals, banks, union, c)
        # candidates in order of constraints met, then score: the first K of them may finish, so a hypothesis
        # that met every constraint finishes before one that did not (transformers' rule keeps score order)
        key = torch.gather(banks, 1, chosen) * BANK_GAP * 1e3 + torch.gather(totals, 1, chosen)
        chosen = torch.gather(chosen, 1, torch.argsort(key, dim=1, descending=True, stable=True))
        return torch.gather(totals, 1, chosen), chosen

    def _choose_running(self, live_scores: torch.Tensor, candidates) -> torch.Tensor:
        return self._allocate(live_scores, self._candidate_bank, live_scores > MASK / 2, self.rows_per_example)

    def _allocate(self, scores: torch.Tensor, banks: torch.Tensor, valid: torch.Tensor, slots: int) -> torch.Tensor:
        """Dynamic beam allocation: positions ``[B, slots]`` into ``scores [B, M]``, best score first.

        Bank j (j constraint tokens produced) gets ``slots // banks`` slots, the remainder going to the banks that
        produced the most; unused slots go to the best remaining valid entries, then to any others."""
        q = self.num_banks - 1
        share, extra = divmod(slots, q + 1)
        taken = torch.zeros_like(valid)
        for j in range(q, -1, -1):
            quota = share + (1 if q - j < extra else 0)
            if quota == 0:
                continue
            in_bank = torch.where(valid & (banks == j) & ~taken, scores, -torch.inf)
            values, positions = torch.topk(in_bank, k=min(quota, scores.shape[1]))
            taken.scatter_(1, positions, values > -torch.inf)
        # the taken ones, then the best valid, then the rest: by score within each tier, ties in index order (a
        # key such as score + 4e9 would round the scores away in float32 and leave the choice to topk's tie order)
        tier = taken.to(torch.uint8) + valid.to(torch.uint8)  # [B, M]: 2 taken (always valid), 1 valid, 0 other
        order = torch.sort(scores, dim=1, descending=True, stable=True)[1]
        order = torch.gather(order, 1, torch.sort(torch.gather(tier, 1, order), dim=1, descending=True, stable=True)[1])
        chosen = order[:, :slots]
        order = torch.argsort(torch.gather(scores, 1, chosen), dim=1, descending=True, stable=True)
        return torch.gather(chosen, 1, order)

    def _pool_order(self, merged_scores: torch.Tensor, candidates) -> torch.Tensor:
        unmet = self.num_constraints - torch.cat((self.finished.met, candidates.met), dim=1).sum(dim=-1)
        return merged_scores - BANK_GAP * unmet  # hypotheses that met every constraint rank first

    def result(self):
        unmet = self.num_constraints - self.finished.met[:, : self.num_return_sequences].sum(dim=-1)
        return dataclasses.replace(super().result(), unmet_constraints=unmet)
