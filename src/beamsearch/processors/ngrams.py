"""Processors that ban the token completing a forbidden n-gram: repeated n-grams, and bad words.

Both match the last tokens of each row against known prefixes, vectorized over rows, with one
loop over the n-gram length (no-repeat) or over the groups of bad words of equal length.

Shape legend: N rows, V vocabulary, t tokens so far (prompt included), G bad words in a group.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import NEG_INF, LogitsProcessor, check_int, token_ids


def _banned_mask(rows: int, vocab_size: int, tokens: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """BoolTensor ``[N, V + 1]`` true at ``tokens[n, j]`` where ``hit[n, j]``.

    Misses, and tokens >= V (which the model cannot produce), land in the spare last column.
    """
    mask = torch.zeros(rows, vocab_size + 1, dtype=torch.bool, device=tokens.device)
    return mask.scatter_(1, torch.where(hit, tokens.long().clamp(max=vocab_size), vocab_size), True)


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Ban every token that would repeat an n-gram already present in the row (prompt included).

    With ``t`` tokens so far, the next token completes an n-gram whose first ``n - 1`` tokens are the
    row's last ``n - 1``; every earlier occurrence of that prefix bans the token that followed it.

    Args:
        ngram_size: n > 0 (with n = 1, every token already present is banned).
    """

    def __init__(self, ngram_size: int):
        self.ngram_size = check_int("ngram_size", ngram_size, 1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        n, length = self.ngram_size, input_ids.shape[-1]
        if length < n:
            return scores
        starts = length - n + 1  # complete n-grams in the history, one per start position
        hit = torch.ones(input_ids.shape[0], starts, dtype=torch.bool, device=input_ids.device)
        for j in range(n - 1):  # compare position j of every n-gram with position j of the prefix
            hit &= input_ids[:, j : j + starts] == input_ids[:, starts + j, None]
        mask = _banned_mask(input_ids.shape[0], scores.shape[-1], input_ids[:, n - 1 :], hit)
        return scores.masked_fill(mask[:, :-1], NEG_INF)


class NoBadWordsLogitsProcessor(LogitsProcessor):
    """Ban the last token of each bad word when the row ends with the rest of it.

    A one-token bad word is banned at every step. Bad words equal to a single end-of-sequence id are
    dropped (eos is never banned this way); if none is left, the processor does nothing. As in
    Hugging Face, banned entries get ``scores + (-inf)``, so a banned ``+inf`` or ``nan`` becomes ``nan``.

    Args:
        bad_words_ids: a non-empty sequence of non-empty sequences of token ids.
        eos_token_id: optional id(s) of the end-of-sequence token.

    Raises:
        ValueError: at construction for malformed arguments; at the first call on a vocabulary of
            size V if a bad word holds an id >= V.
    """

    def __init__(self, bad_words_ids: Any, eos_token_id: Any = None):
        if isinstance(bad_words_ids, (str, bytes, torch.Tensor)) or not hasattr(bad_words_ids, "__iter__"):
            raise ValueError(
                f"`bad_words_ids` must be a non-empty list of lists of token ids, got {bad_words_ids!r}"
            )
        words = [token_ids("bad_words_ids", word) for word in bad_words_ids]
        if not words:
            raise ValueError("`bad_words_ids` must not be empty")
        eos = (
            set(token_ids("eos_token_id", eos_token_id, allow_empty=True))
            if eos_token_id is not None
            else set()
        )
        self.bad_words_ids = tuple(dict.fromkeys(w for w in words if not (len(w) == 1 and w[0] in eos)))
        self._prepared: dict[tuple[int, torch.device], tuple] = {}

    def _prepare(self, vocab_size: int, device: torch.device) -> tuple:
        key = (vocab_size, device)
        if key not in self._prepared:
            too_large = [token for word in self.bad_words_ids for token in word if token >= vocab_size]
            if too_large:
                raise ValueError(
                    f"`bad_words_ids` holds ids >= the vocabulary size {vocab_size}: {too_large}"
                )
            single = torch.zeros(vocab_size + 1, dtype=torch.bool, device=device)
            single[[w[0] for w in self.bad_words_ids if len(w) == 1]] = True
            by_length: dict[int, list[tuple[int, ...]]] = {}
            for word in self.bad_words_ids:
                if len(word) > 1:
                    by_length.setdefault(len(word) - 1, []).append(word)
            groups = [
                (
                    torch.tensor([w[:-1] for w in group], dtype=torch.long, device=device),  # [G, L]
                    torch.tensor([w[-1] for w in group], dtype=torch.long, device=device),  # [G]
                )
                for group in by_length.values()
            ]
            self._prepared[key] = (single, groups)
        return self._prepared[key]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        if not self.bad_words_ids:
            return scores
        rows, vocab_size = scores.shape
        single, groups = self._prepare(vocab_size, scores.device)
        banned = single.expand(rows, -1)  # [N, V + 1]
        for prefixes, last in groups:
            prefix_length = prefixes.shape[1]
            if prefix_length > input_ids.shape[-1]:
                continue
            hit = (input_ids[:, None, -prefix_length:] == prefixes).all(dim=-1)  # [N, G]
            banned = banned | _banned_mask(rows, vocab_size, last.expand(rows, -1), hit)
        bias = torch.zeros_like(scores).masked_fill_(banned[:, :-1], NEG_INF)
        return scores + bias


class LoopGuardLogitsProcessor(LogitsProcessor):
    """Ban the token that would end a row's generated tokens with ``repeats`` back-to-back copies of one n-gram.

    A degenerate hypothesis loops (``N AH2 N AH2 N AH2 ...``) until the length limit; this stops the loop at its
    ``repeats``-th copy for every period n <= ``max_period``, and leaves any other repetition alone (unlike
    ``no_repeat_ngram_size``, which bans every repeated n-gram). Only generated tokens count, not the prompt.

    With t generated tokens and a period p, the next token x is banned when the last ``repeats * p - 1`` tokens
    repeat with period p and x equals the token p back, so that ``repeats * p`` tokens would repeat.

    Args:
        repeats: copies that are banned, >= 2 (3: a third copy of any n-gram in a row is never produced).
        prompt_length: t0, the start tokens, which never count.
        max_period: the longest n-gram checked.
    """

    def __init__(self, repeats: int, prompt_length: int, max_period: int = 4):
        self.repeats = check_int("loop_guard", repeats, 2)
        self.prompt_length = check_int("prompt_length", prompt_length, 0)
        self.max_period = check_int("max_period", max_period, 1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        mask = self._banned(input_ids, scores)
        return scores if mask is None else scores.masked_fill(mask, NEG_INF)

    def mask_(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """As ``__call__``, but changes ``scores`` in place (for callers that own them, ``run_processors``)."""
        mask = self._banned(input_ids, scores)
        return scores if mask is None else scores.masked_fill_(mask, NEG_INF)

    def _banned(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor | None:
        """BoolTensor ``[N, V]`` of the banned tokens (None: nothing can be banned yet), every period at once.

        With the last ``w`` generated tokens as a window, period p holds when ``window[i] == window[i - p]`` for the
        last ``(repeats - 1) * p - 1`` positions i, and then bans ``window[w - p]``: one gather of the compared
        pairs ``[N, P, I]`` (pairs past a period's own count compare a token with itself), one scatter of the P
        candidate tokens."""
        count = input_ids.shape[1] - self.prompt_length
        plan = self._plan(count, input_ids.device)
        if plan is None:
            return None
        width, left, right, candidates = plan
        window = input_ids[:, input_ids.shape[1] - width :]  # [N, w]
        periodic = (window[:, left] == window[:, right]).all(dim=-1)  # [N, P]
        tokens = window[:, candidates]  # [N, P]
        return _banned_mask(input_ids.shape[0], scores.shape[-1], tokens, periodic)[:, :-1]

    def _plan(self, count: int, device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For ``count`` generated tokens: the window width w and the index tensors of the periods that fit
        (``left``, ``right`` ``[P, I]`` compared positions, ``candidates`` ``[P]``), made once per width."""
        periods = [p for p in range(1, self.max_period + 1) if self.repeats * p - 1 <= count]
        if not periods:
            return None
        width = self.repeats * periods[-1] - 1
        key = (width, device)
        plans = self.__dict__.setdefault("_plans", {})
        if key not in plans:
            compared = (self.repeats - 1) * periods[-1] - 1
            left = torch.full((len(periods), max(compared, 1)), width - 1, dtype=torch.long)
            right = left.clone()
            for row, period in enumerate(periods):
                for i in range((self.repeats - 1) * period - 1):
                    left[row, i], right[row, i] = width - 1 - i, width - 1 - i - period
            candidates = torch.tensor([width - p for p in periods], dtype=torch.long)
            plans[key] = (width, left.to(device), right.to(device), candidates.to(device))
        return plans[key]
