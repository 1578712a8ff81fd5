"""Processors that mask or force fixed tokens depending only on the length so far.

Min-length, suppression and forced first/last tokens. Masked entries become ``-inf``; a forced
token gets ``0`` and every other entry ``-inf``.

Shape legend: N rows, V vocabulary, t tokens so far (prompt included).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import NEG_INF, IdTensors, LogitsProcessor, VocabIds, check_int, token_ids


class _TokenMask(LogitsProcessor):
    """A processor that masks the fixed ids of ``self._ids`` at the steps where ``_applies``.

    ``mask_`` does it in place, for callers that own the scores (see ``pipeline.run_processors``); ``__call__``
    never changes its input.
    """

    _ids: VocabIds

    def _applies(self, input_ids: torch.Tensor) -> bool:
        return True

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        return self._fill_(scores.clone()) if self._applies(input_ids) else scores

    def mask_(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """As ``__call__``, but changes ``scores`` in place."""
        return self._fill_(scores) if self._applies(input_ids) else scores

    def _fill_(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill_(-1, self._ids.get(scores.shape[-1], scores.device), NEG_INF)


class MinLengthLogitsProcessor(_TokenMask):
    """Mask the end-of-sequence ids while the total length (prompt included) is below ``min_length``.

    Args:
        min_length: int >= 0; the eos ids are masked while ``t < min_length``.
        eos_token_id: an id, a sequence of ids or a LongTensor of ids (ids >= V are ignored).
        device: accepted for Hugging Face compatibility; masks are built on the scores' device.
    """

    def __init__(self, min_length: int, eos_token_id: Any, device: Any = None):
        self.min_length = check_int("min_length", min_length, 0)
        self.eos_token_id = token_ids("eos_token_id", eos_token_id, allow_empty=True)
        self._ids = VocabIds(self.eos_token_id)

    def _applies(self, input_ids: torch.Tensor) -> bool:
        return input_ids.shape[-1] < self.min_length


class MinNewTokensLengthLogitsProcessor(_TokenMask):
    """Mask the end-of-sequence ids while fewer than ``min_new_tokens`` tokens follow the prompt.

    Args:
        prompt_length_to_skip: int >= 0, the prompt length ``t0``.
        min_new_tokens: int >= 0; the eos ids are masked while ``t - t0 < min_new_tokens``.
        eos_token_id: an id, a sequence of ids or a LongTensor of ids (ids >= V are ignored).
        device: accepted for Hugging Face compatibility.
    """

    def __init__(
        self, prompt_length_to_skip: int, min_new_tokens: int, eos_token_id: Any, device: Any = None
    ):
        self.prompt_length_to_skip = check_int("prompt_length_to_skip", prompt_length_to_skip, 0)
        self.min_new_tokens = check_int("min_new_tokens", min_new_tokens, 0)
        self.eos_token_id = token_ids("eos_token_id", eos_token_id, allow_empty=True)
        self._ids = VocabIds(self.eos_token_id)

    def _applies(self, input_ids: torch.Tensor) -> bool:
        return input_ids.shape[-1] - self.prompt_length_to_skip < self.min_new_tokens


class SuppressTokensLogitsProcessor(_TokenMask):
    """Mask a fixed set of tokens at every step.

    Args:
        suppress_tokens: ids to mask (may be empty; ids >= V are ignored).
        device: accepted for Hugging Face compatibility.
    """

    def __init__(self, suppress_tokens: Any, device: Any = None):
        self.suppress_tokens = token_ids("suppress_tokens", suppress_tokens, allow_empty=True)
        self._ids = VocabIds(self.suppress_tokens)


class SuppressTokensAtBeginLogitsProcessor(_TokenMask):
    """Mask a fixed set of tokens at exactly one step: when ``t == begin_index``.

    Args:
        begin_suppress_tokens: ids to mask (may be empty; ids >= V are ignored).
        begin_index: the length ``t`` at which to mask them (usually the prompt length).
        device: accepted for Hugging Face compatibility.
    """

    def __init__(self, begin_suppress_tokens: Any, begin_index: int, device: Any = None):
        self.begin_suppress_tokens = token_ids(
            "begin_suppress_tokens", begin_suppress_tokens, allow_empty=True
        )
        self.begin_index = check_int("begin_index", begin_index, 0)
        self._ids = VocabIds(self.begin_suppress_tokens)

    def set_begin_index(self, begin_index: int) -> None:
        """Change the step at which the tokens are masked."""
        self.begin_index = check_int("begin_index", begin_index, 0)

    def _applies(self, input_ids: torch.Tensor) -> bool:
        return input_ids.shape[-1] == self.begin_index


def _force(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Scores ``[N, V]`` that are ``0`` at ``ids`` and ``-inf`` elsewhere."""
    return torch.full_like(scores, NEG_INF).index_fill_(1, ids, 0.0)


class ForcedBOSTokenLogitsProcessor(LogitsProcessor):
    """Force ``bos_token_id`` as the first generated token (when ``t == 1``).

    Args:
        bos_token_id: the id to force; it must be < V.
    """

    def __init__(self, bos_token_id: int):
        self.bos_token_id = check_int("bos_token_id", bos_token_id, 0)
        self._ids = IdTensors((self.bos_token_id,))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        if input_ids.shape[-1] != 1:
            return scores
        return _force(scores, self._ids.get(scores.device))


class ForcedEOSTokenLogitsProcessor(LogitsProcessor):
    """Force the end-of-sequence ids (all of them, at ``0``) at the last step (when ``t == max_length - 1``).

    Args:
        max_length: the total length limit, prompt included.
        eos_token_id: an id, a sequence of ids or a LongTensor of ids; each must be < V.
        device: accepted for Hugging Face compatibility.
    """

    def __init__(self, max_length: int, eos_token_id: Any, device: Any = None):
        self.max_length = check_int("max_length", max_length, 0)
        self.eos_token_id = token_ids("eos_token_id", eos_token_id)
        self._ids = IdTensors(self.eos_token_id)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        if input_ids.shape[-1] != self.max_length - 1:
            return scores
        return _force(scores, self._ids.get(scores.device))
