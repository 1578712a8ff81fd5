"""What the graph-safe GPT-2 and Llama steps share: the prompt, run once per example, copied into a static cache.

The prompt runs as the lean step runs it (the lean state's ``prefill``: the model's own forward over the B
examples, positions as transformers' ``cumsum(mask) - 1``, the left padding blocked); its keys and values, next
position ids and padding are then copied into the bucket's :class:`StaticCache` (the last example repeated into the
padding places), every slot of an example holding the example's prompt. The first search step takes the prompt's
logits (outside the graph); every later step is :meth:`GraphDecoder.decode` at a tensor position.

Legend: B examples (a bucket), B0 the call's examples, K rows per example, N = B*K, G cached heads, d head size,
P prompt length, T capacity, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from .attention import additive, group_mask
from .caches import StaticCache
from .padding import padding_index


class GraphDecoder:
    """A decoder-only model's state for one call; subclasses compute :meth:`decode` (their attention reads the
    cache through :meth:`StaticCache.grouped` under :meth:`mask`).

    Args:
        lean_state: the lean step's state for the call (made with ``max_length`` P + 1), not yet prefilled.
        prompt: ``[B0, P]`` LongTensor, the call's prompts.
        examples: B, the bucket.
        rows_per_example: K.
        capacity: T, positions (prompt included).
        layers, heads, head_size: the cache's L, G, d.
        cache: a :class:`StaticCache` of these shapes to reuse (a kept graph's, ``reuse.py``), or None for a new one.
    """

    def __init__(self, lean_state: Any, prompt: torch.Tensor, examples: int, rows_per_example: int, capacity: int,
                 *, layers: int, heads: int, head_size: int, cache: StaticCache | None = None):
        self.model = lean_state.model
        logits = lean_state.prefill(prompt)  # [B0, V] float32, one row per example
        length, device = lean_state.prompt_length, prompt.device
        index = padding_index(prompt.shape[0], examples, device)  # [B]
        if cache is None:
            cache = StaticCache(layers, examples, capacity, rows_per_example, heads, head_size,
                                lean_state.cache.keys[0].dtype, device)
        cache.reset()
        self.cache = cache
        for layer in range(layers):  # the prompt's [P, B0, G, d] as [B, G, P, d]
            keys, values = (buffer[layer][:length].index_select(1, index).permute(1, 2, 0, 3)
                            for buffer in (lean_state.cache.keys, lean_state.cache.values))
            self.cache.fill_prompt(layer, keys, values)
        self.positions = lean_state.positions.index_select(0, index).repeat_interleave(rows_per_example)  # [N]
        self.padding = _padding(lean_state.mask, length, index, capacity)  # [B, T]
        self.first_logits = logits.index_select(0, index).repeat_interleave(rows_per_example, dim=0)  # [N, V]

    def static_tensors(self) -> list[torch.Tensor]:
        return [*self.cache.static_tensors(), self.positions, self.padding]

    def mask(self, position: torch.Tensor, dtype: torch.dtype, per_group: int = 1) -> torch.Tensor:
        """The step's additive attention mask in ``dtype``, ``[B, 1, (H/G)*K, T*K]`` for ``per_group`` = H/G query
        heads per cached head (graph-safe; claims ``position`` for every row first). Made once per step: every
        layer reads it."""
        self.cache.claim(position)
        return group_mask(additive(self.cache.allowed(position, self.padding), dtype), per_group)

    def decode(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The model at ``position`` (0-d LongTensor) for every row: tokens ``[N]`` -> logits ``[N, V]`` (float32);
        subclasses compute it, then advance :attr:`positions` in place."""
        raise NotImplementedError

    def reorder(self, parents: torch.Tensor) -> None:
        """Rows continue ``parents [N]``: the cache's parent index only (positions and padding are per example)."""
        self.cache.reorder(parents)


def _padding(mask: torch.Tensor | None, length: int, index: torch.Tensor, capacity: int) -> torch.Tensor:
    """BoolTensor ``[B, T]`` (True: a position may be attended to) from the lean state's mask over its cache
    (``[B0, T']``: boolean for sdpa, additive for eager; None: no padding). Always a tensor, so that a captured
    step is the same with and without padding."""
    padding = torch.ones((index.shape[0], capacity), dtype=torch.bool, device=index.device)
    if mask is not None:
        prompt = mask[:, :length] if mask.dtype == torch.bool else mask[:, :length] == 0  # [B0, P]
        padding[:, :length] = prompt.index_select(0, index)
    return padding
