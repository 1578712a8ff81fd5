"""Stopping criteria: ``(input_ids [N, t], scores) -> BoolTensor [N]``, True where a row must stop.

The classes take the same arguments and give the same results as those of
``transformers.generation.stopping_criteria``, so ours and Hugging Face's can be mixed freely in one
:class:`StoppingCriteriaList`. transformers itself is never imported. Legend: N rows, t tokens so
far (start tokens included), V vocabulary, D total length of the stop strings, W longest stop string.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from .merging import counterpart, foreign_class, merge_user_items
from .results import FinishReason

__all__ = ["EosTokenCriteria", "FinishReason", "MaxLengthCriteria", "MaxTimeCriteria", "StopStringCriteria",
           "StoppingCriteriaList", "build_stopping_criteria", "classify_stop"]


def _full(input_ids: torch.Tensor, value: bool) -> torch.Tensor:
    return torch.full((input_ids.shape[0],), value, dtype=torch.bool, device=input_ids.device)


class MaxLengthCriteria:
    """Stop every row once the sequences hold ``max_length`` tokens (start tokens included).

    Args:
        max_length: total length limit.
        max_position_embeddings: the model's position limit; passing it only warns once when exceeded.
    """

    def __init__(self, max_length: int, max_position_embeddings: int | None = None):
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 0:
            raise ValueError(f"max_length must be an integer >= 0, got {max_length!r}")
        self.max_length = max_length
        self.max_position_embeddings = max_position_embeddings
        self._warned = False

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        """``input_ids [N, t]`` -> ``[N]``, all True when ``t >= max_length``."""
        length = input_ids.shape[1]
        limit = self.max_position_embeddings
        if limit is not None and length < self.max_length and length > limit and not self._warned:
            self._warned = True
            warnings.warn(f"the sequences ({length} tokens) exceed the model's max_position_embeddings ({limit})",
                          stacklevel=2)
        return _full(input_ids, length >= self.max_length)


def is_max_length_criterion(criterion: Any) -> bool:
    """Ours or Hugging Face's max-length criterion (the t2t and limit logic read its ``max_length``)."""
    theirs = counterpart(MaxLengthCriteria)
    return isinstance(criterion, MaxLengthCriteria) or (theirs is not None and isinstance(criterion, theirs))


class MaxTimeCriteria:
    """Stop every row once more than ``max_time`` seconds have passed since ``initial_timestamp``.

    Args:
        max_time: allowed seconds, > 0.
        initial_timestamp: a ``time.time()`` value; defaults to the moment of construction.
    """

    def __init__(self, max_time: float, initial_timestamp: float | None = None):
        if isinstance(max_time, bool) or not isinstance(max_time, (int, float)) or not max_time > 0:
            raise ValueError(f"max_time must be a number > 0, got {max_time!r}")
        self.max_time = max_time
        self.initial_timestamp = time.time() if initial_timestamp is None else initial_timestamp

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        """``input_ids [N, t]`` -> ``[N]``, all True once the time is up."""
        return _full(input_ids, time.time() - self.initial_timestamp > self.max_time)


class EosTokenCriteria:
    """Stop the rows whose last token is one of the end-of-sequence ids.

    Args:
        eos_token_id: one id, a list of ids or an integer tensor of ids (all >= 0).
    """

    def __init__(self, eos_token_id: int | list[int] | torch.Tensor):
        ids = eos_token_id.reshape(-1).tolist() if isinstance(eos_token_id, torch.Tensor) else eos_token_id
        ids = [ids] if isinstance(ids, int) else ids
        if (not isinstance(ids, Iterable) or not (ids := list(ids))
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
            raise ValueError(f"eos_token_id must be an id >= 0 or a non-empty list of them, got {eos_token_id!r}")
        self.eos_token_id = torch.tensor(ids, dtype=torch.long)  # [E]

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, new_token_length: int = 1,
                 **kwargs: Any) -> torch.BoolTensor:
        """``input_ids [N, t]`` -> ``[N]``: any of the last ``new_token_length`` tokens is an eos id."""
        self.eos_token_id = self.eos_token_id.to(input_ids.device)
        return torch.isin(input_ids[:, -new_token_length:], self.eos_token_id).any(dim=-1)


_PREFIX = "abcdef"  # decoded in front of each token so that decoders treat it as a mid-text token
_TABLE_CACHE: OrderedDict = OrderedDict()  # (vocab, mode, stop strings) -> tables; at most 8 entries


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet, character -> byte: printable Latin-1 bytes stand for themselves,
    the other bytes, in increasing order, for the characters from U+0100 on."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def _decoder_types(node: Any) -> set[str]:
    """Every ``"type"`` named anywhere in a decoder's JSON state."""
    if isinstance(node, list):
        return set().union(*map(_decoder_types, node))
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        return found.union(*map(_decoder_types, node.values()))
    return set()


def _matching_mode(tokenizer: Any) -> str | None:
    """``"byte_level"`` / ``"byte_fallback"`` (match bytes) or None (match text), from the tokenizer's decoder."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    byte_level = foreign_class("tokenizers.decoders", "ByteLevel")
    if byte_level is not None and isinstance(decoder, byte_level):
        return "byte_level"
    try:
        types = _decoder_types(json.loads(decoder.__getstate__()))
    except (AttributeError, TypeError, ValueError):
        return None
    return "byte_fallback" if "ByteFallback" in types else "byte_level" if "ByteLevel" in types else None


def _vocab_pieces(tokenizer: Any, vocab: dict[str, int], mode: str | None) -> dict[int, str | bytes]:
    """id -> the text (bytes in the byte modes) each vocabulary token adds to a decoded sequence."""
    byte_of = _byte_alphabet() if mode == "byte_level" else {}
    prefix: list[str] | None = None
    pieces: dict[int, str | bytes] = {}
    for token, index in vocab.items():
        if byte_of and all(char in byte_of for char in token):
            pieces[index] = bytes(byte_of[char] for char in token)
        elif mode == "byte_fallback" and re.fullmatch(r"<0x[0-9a-fA-F]{2}>", token):
            pieces[index] = bytes([int(token[3:5], 16)])
        else:  # decode after a fixed prefix, then cut it (and any space the decoder put around it) off
            if prefix is None:
                prefix = tokenizer.convert_ids_to_tokens(tokenizer(_PREFIX, add_special_tokens=False)["input_ids"])
            text = tokenizer.convert_tokens_to_string([*prefix, token])
            text = text[text.index(_PREFIX) + len(_PREFIX):]
            pieces[index] = text.encode("utf-8") if mode else text
    return pieces


def _stop_tables(pieces: dict[int, str | bytes], stops: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token id: ``ends [V+1, D]``, ``fits [V+1, D]``, ``lengths [V+1]``; row V+1 is for unknown ids.

    Column ``offset(s) + r`` stands for "the first r characters of stop string s are still to match".
    ``ends[id, col]``: as the last token, ``id`` can leave exactly r characters to match (its start
    matches the end of the string; r = 0 when the whole string is inside it). ``fits[id, col]``: with r
    characters left, ``id`` continues the match leftwards (the token and ``s[:r]``: one ends with the
    other); the match then has ``max(r - len, 0)`` left. r = 0 (matched) fits every token.
    """
    size, width = max(pieces) + 2, sum(map(len, stops))
    ends, fits = torch.zeros(size, width, dtype=torch.bool), torch.zeros(size, width, dtype=torch.bool)
    lengths = torch.zeros(size, dtype=torch.long)
    lengths[list(pieces)] = torch.tensor([len(piece) for piece in pieces.values()], dtype=torch.long)
    offset = 0
    for stop in stops:
        alphabet, end_cells, fit_cells = set(stop), [], []
        fits[:, offset] = True
        for index, piece in pieces.items():
            if piece and alphabet.isdisjoint(piece):
                continue
            if stop in piece:
                end_cells.append((index, offset))
            for r in range(1, len(stop)):
                if piece.startswith(stop[r:]):
                    end_cells.append((index, offset + r))
                if stop[:r].endswith(piece) or piece.endswith(stop[:r]):
                    fit_cells.append((index, offset + r))
        for table, cells in ((ends, end_cells), (fits, fit_cells)):
            table[tuple(torch.tensor(cells, dtype=torch.long).reshape(-1, 2).T)] = True
        offset += len(stop)
    return ends, fits, lengths


class StopStringCriteria:
    """Stop the rows whose decoded text has one of ``stop_strings`` ending inside the last token.

    A stop string may start inside an earlier token and run past the end of the last one, as in
    Hugging Face; like it, only the last W tokens (W = longest stop string, in characters or, for
    byte-level and byte-fallback tokenizers, UTF-8 bytes) are read, and ids outside the vocabulary
    never match. Each token's text is computed once, at construction.

    Args:
        tokenizer: the model's Hugging Face tokenizer (``get_vocab``, ``convert_tokens_to_string``).
        stop_strings: one non-empty string or a list of them.
    """

    def __init__(self, tokenizer: Any, stop_strings: str | list[str]):
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if (not isinstance(stop_strings, Iterable) or not (stop_strings := tuple(stop_strings))
                or any(not isinstance(s, str) or not s for s in stop_strings)):
            raise ValueError(f"stop_strings must be a non-empty string or list of them, got {stop_strings!r}")
        if tokenizer is None:
            raise ValueError("StopStringCriteria needs a tokenizer, got tokenizer=None")
        self.stop_strings: tuple[str, ...] = stop_strings
        mode = _matching_mode(tokenizer)
        stops = tuple(s.encode("utf-8") for s in stop_strings) if mode else stop_strings
        vocab = tokenizer.get_vocab()
        key = (tuple(vocab.items()), mode, stops)
        if key not in _TABLE_CACHE:
            _TABLE_CACHE[key] = _stop_tables(_vocab_pieces(tokenizer, vocab, mode), stops)
            if len(_TABLE_CACHE) > 8:
                _TABLE_CACHE.popitem(last=False)
        _TABLE_CACHE.move_to_end(key)
        self._ends, self._fits, self._lengths = _TABLE_CACHE[key]
        if not self._ends.any():
            raise ValueError(f"stop_strings: no token of the vocabulary can end any of {stop_strings!r}")
        lens = torch.tensor([len(s) for s in stops])
        self._window = int(lens.max())  # W
        starts = torch.cumsum(lens, 0) - lens
        self._starts, self._base = starts, starts.repeat_interleave(lens)  # [S], [D]: column of r = 0
        self._remaining = torch.arange(int(lens.sum())) - self._base  # [D]: r of each column

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        """``input_ids [N, t]`` -> ``[N]``: True where a stop string ends within the last token."""
        device = input_ids.device
        if self._ends.device != device:
            for name in ("_ends", "_fits", "_lengths", "_starts", "_base", "_remaining"):
                setattr(self, name, getattr(self, name).to(device))
        if input_ids.shape[1] == 0:
            return _full(input_ids, False)
        unknown = self._ends.shape[0] - 1
        ids = input_ids[:, -self._window:]  # [N, w], w <= W
        ids = torch.where((ids < 0) | (ids > unknown), unknown, ids)
        state = self._ends.index_select(0, ids[:, -1])  # [N, D]: which remainders are possible after the last token
        for j in range(ids.shape[1] - 2, -1, -1):  # walk left over the earlier tokens
            token = ids[:, j]
            alive = state & self._fits.index_select(0, token)  # [N, D]
            left = (self._remaining - self._lengths.index_select(0, token)[:, None]).clamp(min=0)  # [N, D]
            state = torch.zeros_like(left).scatter_add_(1, self._base + left, alive.long()) > 0
        return state.index_select(1, self._starts).any(dim=-1)


class StoppingCriteriaList(list):
    """A list of criteria, itself a criterion: a row stops when any criterion says so."""

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        """``input_ids [N, t]`` -> ``[N]``, the OR of every criterion's answer."""
        stop = _full(input_ids, False)
        for criterion in self:
            stop = stop | criterion(input_ids, scores, **kwargs)
        return stop

    @property
    def max_length(self) -> int | None:
        """The ``max_length`` of the first max-length criterion (ours or Hugging Face's), else None."""
        for criterion in self:
            if is_max_length_criterion(criterion):
                return criterion.max_length
        return None


def build_stopping_criteria(options: Any, prompt_length: int, tokenizer: Any = None,
                            user_criteria: Iterable[Any] | None = ()) -> StoppingCriteriaList:
    """The criteria of a search, in Hugging Face's order: max length, max time, stop strings, eos.

    User criteria then replace the built-in one of the same kind in place; the others are appended.

    Args:
        options: a :class:`beamsearch.options.SearchOptions`.
        prompt_length: start tokens per row (resolves ``max_new_tokens``).
        tokenizer: needed only with ``stop_strings``.
        user_criteria: extra criteria ``(input_ids [N, t], scores) -> BoolTensor [N]``.

    Raises:
        ValueError: ``stop_strings`` are set but ``tokenizer`` is None.
    """
    criteria: list[Any] = [MaxLengthCriteria(options.resolved_max_length(prompt_length))]
    if options.max_time is not None:
        criteria.append(MaxTimeCriteria(options.max_time))
    if options.stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass the model's tokenizer as tokenizer=...")
        criteria.append(StopStringCriteria(tokenizer, list(options.stop_strings)))
    if options.eos_token_id:
        criteria.append(EosTokenCriteria(list(options.eos_token_id)))
    return StoppingCriteriaList(merge_user_items(criteria, list(user_criteria or ())))


def classify_stop(input_ids: torch.LongTensor, stopped: torch.BoolTensor,
                  eos_token_id: tuple[int, ...] | list[int] | int | None, max_length: int) -> torch.LongTensor:
    """Why each stopped row stopped, as :class:`FinishReason` codes.

    Args:
        input_ids: ``[N, t]`` the rows, their new token included.
        stopped: ``[N]`` True for the rows that a criterion stopped at this step.
        eos_token_id: the end-of-sequence id(s), or None.
        max_length: the total length limit.

    Returns:
        LongTensor ``[N]``: NONE where not stopped, else EOS if the last token is an eos id, else
        MAX_LENGTH if ``t >= max_length``, else STOP_CRITERION (time, stop string, user criterion).
    """
    length = input_ids.shape[1]
    other = FinishReason.MAX_LENGTH if length >= max_length else FinishReason.STOP_CRITERION
    codes = torch.full(stopped.shape, int(other), dtype=torch.long, device=input_ids.device)
    if eos_token_id is not None and length > 0:
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                           dtype=torch.long, device=input_ids.device)
        codes = torch.where(torch.isin(input_ids[:, -1], eos), int(FinishReason.EOS), codes)
    return torch.where(stopped, codes, int(FinishReason.NONE))
