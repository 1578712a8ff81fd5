"""Using alignments: OpenNMT-py's ``replace_unk`` (an unknown output token becomes the source token it attends to).

Legend: g generated tokens, S source positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def replace_unk(tokens: Sequence[str], alignment: torch.Tensor | Sequence[Sequence[float]], source: Sequence[str],
                unk: str) -> list[str]:
    """Replace each ``unk`` in ``tokens`` by the source token with the highest attention at that step.

    Args:
        tokens: the g generated tokens (strings) of one hypothesis.
        alignment: ``[g, S']`` (S' >= len(source)): that hypothesis' alignments (``SearchResult.alignments[b, j]``).
        source: the S source tokens (strings); attention to positions beyond them (padding) is ignored.
        unk: the unknown token's string.

    Returns:
        The tokens, with unknowns replaced (ties: the first source position, as ``argmax`` gives).
    """
    alignment = torch.as_tensor(alignment, dtype=torch.float32)
    if alignment.dim() != 2 or alignment.shape[0] < len(tokens) or alignment.shape[1] < len(source):
        raise ValueError(f"alignment must be [g >= {len(tokens)}, S >= {len(source)}], got {tuple(alignment.shape)}")
    if not source:
        return list(tokens)
    best = alignment[: len(tokens), : len(source)].argmax(dim=1).tolist()
    return [source[best[i]] if token == unk else token for i, token in enumerate(tokens)]
