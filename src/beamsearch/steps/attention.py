"""Attention of one new position per row over keys kept per example (the graph path's self- and cross-attention).

An example's K rows query the same key tensor: the self-attention cache's ``[B, G, T*K, d]`` view (each row masked to
its own ancestors, see :class:`~.caches.StaticCache`) or the cross-attention keys ``[B, H, S, d]`` (one copy per
example, never reordered). So the K queries of an example become K query positions of one
``scaled_dot_product_attention`` call over that example's keys, and with grouped-query attention (G key/value heads for
H query heads) each key/value head takes its H/G query heads as more query positions (no ``repeat_kv`` copy). Fixed
shapes, no host sync.

Legend: B examples, K rows per example, N = B*K, H query heads, G key/value heads, X key positions, d head size.
"""

from __future__ import annotations

import torch


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive one ``scaled_dot_product_attention`` makes of it (0 and -inf in
    ``dtype``), once per step instead of once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def group_mask(mask: torch.Tensor, per_group: int) -> torch.Tensor:
    """A mask ``[B, 1, K, X]`` for grouped queries (each key/value head's H/G query heads packed as more query
    positions, as :func:`attend` packs them): ``[B, 1, (H/G)*K, X]``, once per step. ``per_group`` 1: unchanged."""
    if per_group == 1:
        return mask
    if mask.shape[1] != 1:
        raise ValueError("a per-head mask needs as many key/value heads as query heads")
    examples, _, k, width = mask.shape
    return mask[:, :, None].expand(-1, -1, per_group, -1, -1).reshape(examples, 1, per_group * k, width)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Each row's query over its example's keys.

    Args:
        query: ``[N, H, d]``, one position per row (rows grouped by example, K each).
        keys, values: ``[B, G, X, d]``, G dividing H.
        mask: boolean (True: attend) or additive in the query's dtype, broadcast to ``[B, H, K, X]`` when G = H, or
            ``[B, 1, (H/G)*K, X]`` (:func:`group_mask`) when G < H; or None.
        scale: the factor of the query-key products.

    Returns:
        ``[N, H*d]``.
    """
    rows, heads, size = query.shape
    examples, groups = keys.shape[:2]
    k, per_group = rows // examples, heads // groups
    packed = query.view(examples, k, groups, per_group, size).permute(0, 2, 3, 1, 4)  # [B, G, H/G, K, d]
    packed = packed.reshape(examples, groups, per_group * k, size)
    mixed = torch.nn.functional.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale)
    mixed = mixed.view(examples, groups, per_group, k, size).permute(0, 3, 1, 2, 4)  # [B, K, G, H/G, d]
    return mixed.reshape(rows, heads * size)
