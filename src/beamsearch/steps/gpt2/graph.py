"""The GPT-2 decoder as a graph-safe step: the model's own modules over a :class:`StaticCache`, fixed shapes.

As the lean GPT-2 step (``lean.py`` beside it) it calls the blocks' layer norms, projections and MLPs directly;
attention is ``scaled_dot_product_attention`` over the example's cache under the row's ancestry and padding mask
(:class:`.decoder.GraphDecoder`), whatever the model's attention implementation: tokens equal the lean step's,
scores to float rounding.

Legend: B examples (a bucket), K rows per example, N = B*K, H heads, d head size, D = H*d, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import attend
from ..caches import StaticCache
from ..graph_decoder import GraphDecoder
from .lean import LEAN_GPT2

# the gate of the graph-safe GPT-2 step: the lean step's plan, strict (a graph replays what it recorded once,
# so no hook and no module from outside torch and transformers anywhere in the model)
GRAPH_GPT2 = LEAN_GPT2.captured("the graph-safe GPT-2 step")


class GraphGPT2(GraphDecoder):
    """A GPT-2 model's state for one call (see :class:`GraphDecoder`); the cache holds the H heads."""

    def __init__(self, lean_state: Any, prompt: torch.Tensor, examples: int, rows_per_example: int, capacity: int,
                 cache: StaticCache | None = None):
        self.blocks = list(lean_state.model.transformer.h)
        attention = self.blocks[0].attn
        self.heads, self.width, self.scaling = attention.num_heads, attention.split_size, lean_state.scaling
        self.head_size = attention.head_dim
        super().__init__(lean_state, prompt, examples, rows_per_example, capacity, layers=len(self.blocks),
                         heads=self.heads, head_size=self.head_size, cache=cache)

    def decode(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        rows = tokens.shape[0]
        transformer = self.model.transformer
        hidden = transformer.wte(tokens[:, None]) + transformer.wpe(self.positions[:, None])  # [N, 1, D]
        mask = self.mask(position, hidden.dtype)  # [B, 1, K, T*K]
        for layer, block in enumerate(self.blocks):
            hidden = self._attention(block.attn, block.ln_1(hidden), layer, position, mask) + hidden
            hidden = hidden + block.mlp(block.ln_2(hidden))
        self.positions.add_(1)
        hidden = transformer.ln_f(hidden)
        return self.model.lm_head(hidden).view(rows, -1).float()

    def _attention(self, attention: Any, normed: torch.Tensor, layer: int, position: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """Self-attention of the new position: ``[N, 1, D]`` -> ``[N, 1, D]`` (before the residual)."""
        rows, heads, size = normed.shape[0], self.heads, self.head_size
        query, key, value = attention.c_attn(normed).split(self.width, dim=2)  # [N, 1, D] each
        self.cache.write(layer, position, key.view(rows, heads, size), value.view(rows, heads, size))
        keys, values = self.cache.grouped(layer)  # [B, H, T*K, d]
        mixed = attend(query.view(rows, heads, size), keys, values, mask, self.scaling)  # [N, D]
        return attention.c_proj(mixed.view(rows, 1, heads * size))
