"""Gather, flatten and reorder helpers over ``[B, K, ...]`` tensors and over model state.

Legend: B batch, K beams (rows per example), N = B*K, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def flatten_beams(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, K, ...]`` -> ``[N, ...]``."""
    return tensor.reshape(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:])


def unflatten_beams(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``[N, ...]`` -> ``[B, K, ...]``."""
    return tensor.reshape(batch_size, tensor.shape[0] // batch_size, *tensor.shape[1:])


def gather_beams(tensor: torch.Tensor, indices: torch.Tensor, flat: torch.Tensor | None = None) -> torch.Tensor:
    """Select beams of each example.

    One ``index_select`` of whole rows of the flattened ``[B*K, ...]`` tensor (on a CPU several times faster than
    ``take_along_dim``, which gathers element by element and wraps every index).

    Args:
        tensor: ``[B, K, ...]``.
        indices: LongTensor ``[B, K']`` of beam positions within each example (0 <= position < K).
        flat: ``flat_rows(indices, K)``, when the caller gathers several tensors with the same indices.

    Returns:
        ``[B, K', ...]``: ``out[b, j] = tensor[b, indices[b, j]]``.
    """
    batch, count = indices.shape
    if flat is None:
        flat = flat_rows(indices, tensor.shape[1])
    rest = tensor.shape[2:]
    return tensor.reshape(batch * tensor.shape[1], *rest).index_select(0, flat).view(batch, count, *rest)


def flat_rows(indices: torch.Tensor, per_example: int) -> torch.Tensor:
    """Positions ``[B, K']`` within each example of ``per_example`` -> rows ``[B*K']`` of the flattened tensor."""
    offsets = torch.arange(0, indices.shape[0] * per_example, per_example, device=indices.device)
    return (indices + offsets[:, None]).reshape(-1)


def flat_parent_rows(parents: torch.Tensor) -> torch.Tensor:
    """Beam positions ``[B, K]`` within each example -> flat row indices ``[N]`` into ``[N, ...]``."""
    batch_size, num_beams = parents.shape
    offsets = torch.arange(batch_size, device=parents.device).unsqueeze(1) * num_beams
    return (parents + offsets).reshape(-1)


def example_rows(examples: torch.Tensor, rows_per_example: int) -> torch.Tensor:
    """Example positions ``[E]`` -> the flat rows ``[E * K]`` of their K rows each, in order."""
    return (examples[:, None] * rows_per_example + torch.arange(rows_per_example, device=examples.device)).reshape(-1)


def reorder_state(state: Any, index: torch.Tensor) -> Any:
    """Reorder (or expand) every row-indexed part of a model state.

    The state is any nesting of dicts, lists, tuples (named or not) and dataclasses whose tensor
    leaves have the row dimension first, or an object with a ``reorder(index)`` method that
    returns the reordered state (or ``None`` after reordering in place). Non-tensor leaves are kept.

    Args:
        state: the model's opaque state.
        index: LongTensor ``[N']`` of source rows; ``out[i] = state[index[i]]``.
    """
    if state is None:
        return None
    if hasattr(state, "reorder") and callable(state.reorder):
        reordered = state.reorder(index)
        return state if reordered is None else reordered
    if isinstance(state, torch.Tensor):
        return state.index_select(0, index.to(state.device))
    if isinstance(state, dict):
        return type(state)((key, reorder_state(value, index)) for key, value in state.items())
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(reorder_state(value, index) for value in state))
    if isinstance(state, (list, tuple)):
        return type(state)(reorder_state(value, index) for value in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {f.name: reorder_state(getattr(state, f.name), index) for f in dataclasses.fields(state)}
        return dataclasses.replace(state, **changes)
    return state
