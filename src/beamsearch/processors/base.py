"""The processor base class and the argument checks and vocabulary masks the processors share.

Every processor follows Hugging Face's protocol, ``(input_ids, scores) -> scores``, and never
modifies its inputs in place.

Shape legend: N rows, V vocabulary, t tokens so far (prompt included).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

NEG_INF = -math.inf


class LogitsProcessor:
    """Base class of the processors: ``(input_ids [N, t], scores [N, V]) -> scores [N, V]``.

    Subclasses keep their class name equal to the Hugging Face class whose behaviour they
    reproduce, so that :func:`~beamsearch.processors.build_processors` can let a user-supplied
    Hugging Face processor replace the built-in one of the same name, as ``generate`` does.
    """

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Return new scores.

        Args:
            input_ids: LongTensor ``[N, t]``, the tokens so far.
            scores: FloatTensor ``[N, V]``, logits or log-probabilities of the next token.

        Returns:
            FloatTensor ``[N, V]``; ``scores`` itself when nothing changes, never modified in place.
        """
        raise NotImplementedError

    def select_rows(self, index: torch.Tensor) -> LogitsProcessor:
        """This processor for a search that keeps only rows ``index`` (finished examples removed).

        Processors without per-row state return themselves; those with it return a copy (never changed in
        place, since a user may pass the same processor to several searches).
        """
        return self

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name`` if it is not an int >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_float(name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    """Return ``value`` as a float, or raise ValueError naming ``name`` if it is outside the interval."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a number, got {value!r}")
    value = float(value)
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"`{name}` must be in {interval}, got {value!r}")
    return value


def token_ids(name: str, value: Any, *, allow_empty: bool = False) -> tuple[int, ...]:
    """Normalize an id, a sequence of ids or a tensor of ids to a tuple of ints >= 0.

    Raises:
        ValueError: naming ``name``, for anything else (or an empty collection unless allowed).
    """
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"`{name}` must hold integer token ids, got a {value.dtype} tensor")
        value = value.reshape(-1).tolist()
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"`{name}` must be a token id or a sequence of token ids, got {value!r}")
    ids = tuple(value)
    if not ids and not allow_empty:
        raise ValueError(f"`{name}` must not be empty")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(f"`{name}` must hold integer token ids >= 0, got {value!r}")
    return tuple(operator.index(token) for token in ids)


class VocabIds:
    """A fixed set of token ids as a LongTensor of those ``< V``, built once per (V, device).

    Ids ``>= V`` are ignored, as ``torch.isin`` over the vocabulary ignores them in Hugging Face. Masking with
    ``index_fill_`` on these ids touches ``N x k`` entries, where a ``[V]`` boolean mask reads all ``N x V``.
    """

    def __init__(self, ids: tuple[int, ...]):
        self.ids = ids
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def get(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """The ids below ``vocab_size`` on ``device``: LongTensor ``[k']``."""
        key = (vocab_size, device)
        ids = self._cache.get(key)
        if ids is None:
            inside = sorted({token for token in self.ids if token < vocab_size})
            ids = self._cache[key] = torch.tensor(inside, dtype=torch.long, device=device)
        return ids


class IdTensors:
    """A fixed tuple of token ids as a LongTensor ``[k]``, built once per device."""

    def __init__(self, ids: tuple[int, ...]):
        self.ids = ids
        self._cache: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        """The ids as a LongTensor ``[k]`` on ``device``."""
        tensor = self._cache.get(device)
        if tensor is None:
            tensor = self._cache[device] = torch.tensor(self.ids, dtype=torch.long, device=device)
        return tensor
