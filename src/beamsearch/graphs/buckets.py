"""Row buckets: a batch is padded to one of a few example counts, so that one captured step serves many batches.

A CUDA graph replays fixed shapes. The graph path pads the B examples of a call to the smallest bucket that holds
them (powers of two: 1, 2, 4, ..., then multiples of the largest), repeating the last example in the extra places.
The padding examples are decoded like the others but count as finished from the start: they never keep the search
going and are cut from the result. Inside a bucket finished examples are masked, not compacted (their rows keep
being computed, their results frozen), so the shapes never change during a call.

Which example fills each extra place (the last one) is the model state's side, ``steps/padding.py``.

Legend: B examples of the call, B' the bucket (examples decoded), K rows per example.
"""

from __future__ import annotations

import torch

LARGEST_POWER = 256  # buckets grow by doubling up to this many examples, then by this many


def bucket_size(examples: int) -> int:
    """The number of examples decoded for a call of ``examples`` (B' >= B): the next power of two up to
    :data:`LARGEST_POWER`, then the next multiple of it."""
    if examples < 1:
        raise ValueError(f"a bucket holds at least one example, got {examples}")
    if examples > LARGEST_POWER:
        return -(-examples // LARGEST_POWER) * LARGEST_POWER
    size = 1
    while size < examples:
        size *= 2
    return size


def real_examples(examples: int, bucket: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """BoolTensor ``[B']``: True for the call's own examples, False for the padding."""
    return torch.arange(bucket, device=device) < examples
