"""The extra places of a row bucket (``graphs/buckets.py``) filled with the call's last example: the model state's
side of the buckets, shared by the graph-safe steps and the graph path's driver.

Legend: B examples of the call, B' the bucket.
"""

from __future__ import annotations

import torch


def padding_index(examples: int, bucket: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """LongTensor ``[B']``: the call's example that fills each place of the bucket (the last one repeated)."""
    if bucket < examples:
        raise ValueError(f"a bucket of {bucket} examples cannot hold {examples}")
    return torch.arange(bucket, device=device).clamp(max=examples - 1)


def pad_examples(tensor: torch.Tensor | None, bucket: int) -> torch.Tensor | None:
    """``tensor [B, ...]`` -> ``[B', ...]``, the last example repeated (None stays None)."""
    if tensor is None or tensor.shape[0] == bucket:
        return tensor
    return tensor.index_select(0, padding_index(tensor.shape[0], bucket, tensor.device))
