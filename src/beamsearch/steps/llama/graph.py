"""The Llama decoder as a graph-safe step: the model's own modules over a :class:`StaticCache`, fixed shapes.

As the lean Llama step (``lean.py`` beside it) it calls the embedding, rotary embedding, RMS norms, projections,
the model module's ``apply_rotary_pos_emb`` and the MLP directly; the cache holds the G key/value heads, and each
key/value head attends for its H/G query heads in one ``scaled_dot_product_attention`` call (the queries packed as
more query positions, no ``repeat_kv`` copy) under the row's ancestry and padding mask, whatever the model's
attention implementation: tokens equal the lean step's, scores to float rounding.

Legend: B examples (a bucket), K rows per example, N = B*K, H query heads, G key/value heads, d head size,
D hidden size, V vocabulary.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..attention import attend
from ..caches import StaticCache
from ..graph_decoder import GraphDecoder
from .lean import LEAN_LLAMA

# the gate of the graph-safe Llama step: the lean step's plan, strict (a graph replays what it recorded once,
# so no hook and no module from outside torch and transformers anywhere in the model)
GRAPH_LLAMA = LEAN_LLAMA.captured("the graph-safe Llama step")


class GraphLlama(GraphDecoder):
    """A Llama model's state for one call (see :class:`GraphDecoder`)."""

    def __init__(self, lean_state: Any, prompt: torch.Tensor, examples: int, rows_per_example: int, capacity: int,
                 cache: StaticCache | None = None):
        model = lean_state.model
        config = model.config
        self.layers = list(model.model.layers[: config.num_hidden_layers])
        attention = self.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling, self.head_size = attention.scaling, attention.head_dim
        self.apply_rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb  # the one the model calls
        super().__init__(lean_state, prompt, examples, rows_per_example, capacity, layers=len(self.layers),
                         heads=self.kv_heads, head_size=self.head_size, cache=cache)

    def decode(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        rows = tokens.shape[0]
        decoder = self.model.model
        hidden = decoder.embed_tokens(tokens[:, None])  # [N, 1, D]
        rotary = decoder.rotary_emb(hidden, self.positions[:, None])  # cos, sin [N, 1, d]
        mask = self.mask(position, hidden.dtype, self.heads // self.kv_heads)  # [B, 1, (H/G)*K, T*K]
        for index, layer in enumerate(self.layers):
            hidden = hidden + self._attention(layer.self_attn, layer.input_layernorm(hidden), index, position,
                                              rotary, mask)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.positions.add_(1)
        hidden = decoder.norm(hidden)
        return self.model.lm_head(hidden).view(rows, -1).float()

    def _attention(self, attention: Any, normed: torch.Tensor, layer: int, position: torch.Tensor,
                   rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """Self-attention of the new position: ``[N, 1, D]`` -> ``[N, 1, D]`` (before the residual)."""
        rows, size = normed.shape[0], self.head_size
        query = attention.q_proj(normed).view(rows, 1, self.heads, size).transpose(1, 2)  # [N, H, 1, d]
        key = attention.k_proj(normed).view(rows, 1, self.kv_heads, size).transpose(1, 2)  # [N, G, 1, d]
        value = attention.v_proj(normed).view(rows, self.kv_heads, size)  # [N, G, d]
        query, key = self.apply_rotary(query, key, *rotary)
        self.cache.write(layer, position, key[:, :, 0], value)
        keys, values = self.cache.grouped(layer)  # [B, G, T*K, d]
        mixed = attend(query[:, :, 0], keys, values, mask, self.scaling)  # [N, H*d]
        return attention.o_proj(mixed.view(rows, 1, self.heads * size))
