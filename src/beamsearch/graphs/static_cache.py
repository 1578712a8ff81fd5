"""The graph path's self-attention cache: preallocated, written at a tensor position, never reordered.

Eager beam search reorders the cache after every step: each layer's keys and values are gathered by the beams'
parent rows (a copy of the whole filled cache per step). Here nothing is moved. Each layer keeps its keys and values
example-major, ``[B, T, K, G, d]``: at position t, slot j of example b holds what row ``b*K + j`` wrote at step t.
A row's history is a path through its example's slots, kept in a small parent index, :attr:`StaticCache.ancestry`
``[N, T]``: the slot that holds the row's ancestor at each position. A beam reorder gathers that index (N x T
integers) instead of the cache (N x T x G x d values per layer, twice), and attention reads the example's K x T
keys once for its K query rows, each row masked to its own ancestors (:meth:`StaticCache.allowed`): the same bytes
read as K rows reading T keys each, K times the (small) arithmetic, no copy.

Every method that runs during a step (:meth:`write`, :meth:`claim`, :meth:`allowed`, :meth:`reorder`) takes the
position as a 0-d tensor and has no data-dependent shape nor host synchronisation, so it can be captured in a CUDA
graph; the buffers are zero-filled once (a masked position still meets a finite key and value).

Rows only ever take parents within their own example (beam search never moves a hypothesis across examples), so a
slot number keeps its meaning after a reorder.

Legend: L layers, B examples, K rows (slots) per example, N = B*K, T capacity (positions), G cached heads,
d head size, P prompt positions.
"""

from __future__ import annotations

import torch


class StaticCache:
    """Keys and values ``[B, T, K, G, d]`` of every layer and the parent index ``ancestry [N, T]``.

    Args:
        layers: L.
        examples: B (a bucket: padding examples included).
        capacity: T, positions (start tokens and prompt included).
        rows_per_example: K.
        heads: G, the cached (key/value) heads.
        head_size: d.
        dtype, device: of the keys and values.
    """

    def __init__(self, layers: int, examples: int, capacity: int, rows_per_example: int, heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (examples, capacity, rows_per_example, heads, head_size)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.examples, self.capacity, self.rows_per_example = examples, capacity, rows_per_example
        self.slots = torch.arange(rows_per_example, device=device)  # [K]
        self.own = self.slots.repeat(examples)  # [N] each row's own slot
        self.ancestry = self.own[:, None].repeat(1, capacity)  # [N, T] every row its own ancestor at first
        self.times = torch.arange(capacity, device=device)  # [T]

    @property
    def rows(self) -> int:
        return self.examples * self.rows_per_example

    def static_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads or writes that hold a call's data (a captured step holds their addresses; the
        others are constants of the shapes)."""
        return [*self.keys, *self.values, self.ancestry]

    def reset(self) -> None:
        """Ready for another call of the same shapes: every row its own ancestor again. The keys and values stay:
        a position is written before it is attended to, and the mask hides the others (finite values, so that a
        masked position adds an exact zero)."""
        self.ancestry.copy_(self.own[:, None].expand_as(self.ancestry))

    # ------------------------------------------------------------------ before the search (eager)

    def fill_prompt(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Positions ``[0, P)`` of every slot from an example's prompt keys and values ``[B, G, P, d]`` (the rows of
        an example share their prompt)."""
        length = keys.shape[2]
        self.keys[layer][:, :length] = keys.permute(0, 2, 1, 3)[:, :, None]  # [B, P, 1, G, d] to every slot
        self.values[layer][:, :length] = values.permute(0, 2, 1, 3)[:, :, None]

    # ------------------------------------------------------------------ during a step (graph-safe)

    def write(self, layer: int, position: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store each row's key and value ``[N, G, d]`` of ``position`` (0-d LongTensor) in its own slot."""
        examples, _, k, heads, size = self.keys[layer].shape
        self.keys[layer].index_copy_(1, position.view(1), key.reshape(examples, 1, k, heads, size))
        self.values[layer].index_copy_(1, position.view(1), value.reshape(examples, 1, k, heads, size))

    def claim(self, position: torch.Tensor) -> None:
        """At ``position`` every row's ancestor is itself (what :meth:`write` stores there this step)."""
        self.ancestry.index_copy_(1, position.view(1), self.own[:, None])

    def grouped(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values as ``[B, G, T*K, d]`` views (key ``t*K + s``: position t of slot s)."""
        examples, capacity, k, heads, size = self.keys[layer].shape

        def view(buffer: torch.Tensor) -> torch.Tensor:
            return buffer.permute(0, 3, 1, 2, 4).reshape(examples, heads, capacity * k, size)

        return view(self.keys[layer]), view(self.values[layer])

    def allowed(self, position: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """BoolTensor ``[B, 1, K, T*K]``: which of its example's keys each row attends to at ``position``: its
        ancestor's slot at every position up to ``position`` (and not a padding position: ``padding [B, T]``
        True where a position may be attended to)."""
        examples, k, capacity = self.examples, self.rows_per_example, self.capacity
        ancestors = self.ancestry.view(examples, k, capacity, 1) == self.slots  # [B, K, T, K]
        mask = ancestors & (self.times <= position).view(1, 1, capacity, 1)
        if padding is not None:
            mask = mask & padding.view(examples, 1, capacity, 1)
        return mask.view(examples, 1, k, capacity * k)

    def reorder(self, parents: torch.Tensor) -> None:
        """Row n continues row ``parents[n]`` (LongTensor ``[N]``, flat rows of the same example): only the parent
        index moves, in place."""
        self.ancestry.copy_(self.ancestry.index_select(0, parents))
