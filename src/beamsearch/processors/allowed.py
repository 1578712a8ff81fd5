"""A user callback that names the tokens allowed next, per row (Hugging Face's ``prefix_allowed_tokens_fn``).

Shape legend: N rows, V vocabulary, t tokens so far (prompt included), K rows per example.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .base import NEG_INF, LogitsProcessor, check_int

AllowedTokensFn = Callable[[int, torch.Tensor], Sequence[int]]


class PrefixConstrainedLogitsProcessor(LogitsProcessor):
    """Keep only the tokens ``prefix_allowed_tokens_fn(batch_id, row_tokens)`` allows; mask the rest with ``-inf``.

    As in transformers, ``batch_id`` is ``row // num_beams`` of the full batch (transformers 5.24 and later pass
    ``max(num_beams, num_return_sequences)``, so that sampling several sequences counts examples; earlier releases
    pass ``num_beams``, 1 then, and count rows), and (5.18 and later, ``unsatisfiable_fallback``) when every
    allowed token of all an example's rows already scores ``-inf``, the allowed tokens get 0 instead so the
    constraint still holds. The callback runs once per row and step on the host.

    Args:
        prefix_allowed_tokens_fn: ``(batch_id: int, tokens: LongTensor [t]) -> list of token ids`` (non-empty).
        num_beams: K, rows per example in the ``batch_id`` arithmetic.
        batch_ids: LongTensor ``[N]``, the ``batch_id`` of each row once rows were removed; None: ``row // K``.
        unsatisfiable_fallback: the 5.18 rule above (False: ``scores + mask`` alone, as before).
    """

    def __init__(self, prefix_allowed_tokens_fn: AllowedTokensFn, num_beams: int,
                 batch_ids: torch.Tensor | None = None, unsatisfiable_fallback: bool = True):
        fn = prefix_allowed_tokens_fn
        if not callable(fn):
            raise ValueError(f"prefix_allowed_tokens_fn must be callable, got {type(fn).__name__}")
        self.prefix_allowed_tokens_fn = fn
        self.num_beams = check_int("num_beams", num_beams, 1)
        self.batch_ids = batch_ids
        self.unsatisfiable_fallback = unsatisfiable_fallback

    def select_rows(self, index: torch.Tensor) -> PrefixConstrainedLogitsProcessor:
        index = index.cpu()
        ids = index // self.num_beams if self.batch_ids is None else self.batch_ids.index_select(0, index)
        return PrefixConstrainedLogitsProcessor(self.prefix_allowed_tokens_fn, self.num_beams, ids,
                                                self.unsatisfiable_fallback)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        rows = input_ids.shape[0]
        if self.batch_ids is None:
            batch_ids = [row // self.num_beams for row in range(rows)]
        else:
            batch_ids = self.batch_ids.tolist()
        mask = torch.full_like(scores, NEG_INF)
        for row, batch_id in enumerate(batch_ids):
            allowed = self.prefix_allowed_tokens_fn(batch_id, input_ids[row])
            if len(allowed) == 0:
                raise ValueError(f"prefix_allowed_tokens_fn returned no allowed token for batch_id {batch_id} (row "
                                 f"{row}, tokens {input_ids[row].tolist()}): the constraint cannot be met")
            mask[row, allowed] = 0.0
        processed = scores + mask
        if not self.unsatisfiable_fallback:
            return processed
        groups = max(1, rows // self.num_beams)
        unsatisfiable = processed.amax(dim=-1).isneginf().view(groups, -1).all(dim=-1)  # [N / K]
        return torch.where(unsatisfiable.repeat_interleave(rows // groups)[:, None], mask, processed)
