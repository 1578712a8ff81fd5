"""The T5 (and mT5) decoder as a graph-safe step: the model's own modules, a :class:`StaticCache`, fixed shapes.

As the lean T5 step (``lean.py`` beside it), it calls the decoder's layer norms, projections and feed-forward blocks
directly; the differences are what a captured step needs:

- the position is a 0-d tensor; self-attention reads all T positions of the example-major cache, each row masked
  to its own ancestors (the parent index, :class:`~..caches.StaticCache`), under the position bias of the model's own
  ``compute_bias`` (one ``[H, T, T]`` table made before the search);
- the cross-attention keys and values are computed once per example, ``[B, H, S, d]``, and never reordered nor
  copied: an example's K rows attend to them as K query positions of one call;
- attention is ``scaled_dot_product_attention`` whatever the model's implementation (``eager`` models included:
  the same arithmetic, other rounding).

Tokens equal the lean step's (and transformers'), scores to float rounding: the kernels sum in another order.

Legend: B examples (a bucket), K rows per example, N = B*K, H heads, d head size, S source length, T capacity,
D model width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import attend
from ..caches import StaticCache
from .lean import LEAN_T5, _clamp_float16, _output_scale

# the gate of the graph-safe T5 step: the lean step's plan, strict (a graph replays what it recorded once,
# so no hook and no module from outside torch and transformers anywhere in the model)
GRAPH_T5 = LEAN_T5.captured("the graph-safe T5 step")


class GraphT5:
    """The decoder state of one call: the static cache, the cross-attention keys and values, the bias table.

    Args:
        model: a T5 model the lean step can run (``lean_t5_reason`` is None).
        encoder_hidden: ``[B, S, D]``, the encoder's output (the bucket's examples).
        source_mask: ``[B, S]`` (1: a source token, 0: padding) or None.
        rows_per_example: K.
        capacity: T, decoder positions (start tokens included).
        cache: a :class:`StaticCache` of these shapes to reuse (a kept graph's, ``reuse.py``), or None for a new one.
    """

    def __init__(self, model: Any, encoder_hidden: torch.Tensor, source_mask: torch.Tensor | None,
                 rows_per_example: int, capacity: int, cache: StaticCache | None = None):
        self.model = model
        self.blocks = list(model.decoder.block)
        attention = self.blocks[0].layer[0].SelfAttention
        self.heads, self.head_size = attention.n_heads, attention.key_value_proj_dim
        self.scale = _output_scale(model)
        dtype, device = encoder_hidden.dtype, encoder_hidden.device
        examples = encoder_hidden.shape[0]
        if cache is None:
            cache = StaticCache(len(self.blocks), examples, capacity, rows_per_example, self.heads, self.head_size,
                                dtype, device)
        cache.reset()
        self.cache = cache
        self.cross_keys = [self._heads(b.layer[1].EncDecAttention.k(encoder_hidden)) for b in self.blocks]
        self.cross_values = [self._heads(b.layer[1].EncDecAttention.v(encoder_hidden)) for b in self.blocks]
        self.source_bias = torch.zeros((examples, 1, 1, encoder_hidden.shape[1]), dtype=dtype, device=device)
        if source_mask is not None:
            self.source_bias.masked_fill_(source_mask[:, None, None, :] == 0, torch.finfo(dtype).min)
        self.bias_table = attention.compute_bias(capacity, capacity, device=device)[0]  # [H, T, T]
        self.minimum = torch.finfo(self.bias_table.dtype).min

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """``[B, S, H*d]`` -> ``[B, H, S, d]`` (contiguous)."""
        examples, length = projected.shape[:2]
        return projected.view(examples, length, self.heads, self.head_size).transpose(1, 2).contiguous()

    def static_tensors(self) -> list[torch.Tensor]:
        return [*self.cache.static_tensors(), *self.cross_keys, *self.cross_values, self.source_bias,
                self.bias_table]

    def decode(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The decoder at ``position`` (0-d LongTensor) for every row: tokens ``[N]`` -> logits ``[N, V]``
        (float32); the cache holds the rows' keys and values at ``position`` afterwards."""
        cache, capacity, k = self.cache, self.cache.capacity, self.cache.rows_per_example
        hidden = self.model.decoder.embed_tokens(tokens)  # [N, D]
        cache.claim(position)
        bias = self.bias_table.index_select(1, position.view(1))  # [H, 1, T]
        bias = bias[:, :, :, None].expand(-1, -1, -1, k).reshape(1, self.heads, 1, capacity * k)  # [1, H, 1, T*K]
        mask = torch.where(cache.allowed(position), bias, self.minimum)  # [B, H, K, T*K]
        for layer, block in enumerate(self.blocks):
            hidden = _clamp_float16(self._self_attention(block.layer[0], hidden, mask, layer, position))
            hidden = _clamp_float16(self._cross_attention(block.layer[1], hidden, layer))
            hidden = _clamp_float16(block.layer[2](hidden))
        hidden = self.model.decoder.final_layer_norm(hidden)
        if self.scale is not None:
            hidden = hidden * self.scale
        return self.model.lm_head(hidden).float()

    def _self_attention(self, sublayer: Any, hidden: torch.Tensor, mask: torch.Tensor, layer: int,
                        position: torch.Tensor) -> torch.Tensor:
        attention = sublayer.SelfAttention
        normed = sublayer.layer_norm(hidden)
        rows, heads, size = hidden.shape[0], self.heads, self.head_size
        self.cache.write(layer, position, attention.k(normed).view(rows, heads, size),
                         attention.v(normed).view(rows, heads, size))
        keys, values = self.cache.grouped(layer)  # [B, H, T*K, d]
        mixed = attend(attention.q(normed).view(rows, heads, size), keys, values, mask, 1.0)  # [N, H*d]
        return hidden + attention.o(mixed)

    def _cross_attention(self, sublayer: Any, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        attention = sublayer.EncDecAttention
        normed = sublayer.layer_norm(hidden)
        query = attention.q(normed).view(hidden.shape[0], self.heads, self.head_size)  # [N, H, d]
        mixed = attend(query, self.cross_keys[layer], self.cross_values[layer], self.source_bias, 1.0)
        return hidden + attention.o(mixed)

    def prime(self, input_ids: torch.Tensor) -> None:
        """The start tokens ``[B, t0]`` but the last into the cache, eagerly before the search (the search's first
        step feeds the last one); every row of an example holds the same."""
        for column in range(input_ids.shape[1] - 1):
            position = torch.tensor(column, device=input_ids.device)
            self.decode(input_ids[:, column].repeat_interleave(self.cache.rows_per_example), position)

    def reorder(self, parents: torch.Tensor) -> None:
        """Rows continue ``parents [N]``: the cache's parent index only (graph-safe)."""
        self.cache.reorder(parents)
