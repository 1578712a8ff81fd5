"""The self-attention caches of the specialized steps: preallocated, never grown by ``torch.cat``.

- :class:`TimeMajorCache` and :class:`StackedTimeMajorCache`: the eager lean and fast steps' (rows reordered by
  gathering the filled part);
- :class:`StaticCache`: the graph-safe steps', written at a tensor position and never reordered (a parent index).

Legend: L layers, T capacity (positions), N rows, H heads, d head size, t positions filled; for
:class:`StaticCache` also B examples, K rows (slots) per example (N = B*K), G cached heads, P prompt positions.

The graph path's cache, :class:`StaticCache`: eager beam search reorders the cache after every step: each layer's keys
and values are gathered by the beams' parent rows (a copy of the whole filled cache per step). Here nothing is moved.
Each layer keeps its keys and values example-major, ``[B, T, K, G, d]``: at position t, slot j of example b holds what
row ``b*K + j`` wrote at step t. A row's history is a path through its example's slots, kept in a small parent index,
:attr:`StaticCache.ancestry` ``[N, T]``: the slot that holds the row's ancestor at each position. A beam reorder
gathers that index (N x T integers) instead of the cache (N x T x G x d values per layer, twice), and attention reads
the example's K x T keys once for its K query rows, each row masked to its own ancestors
(:meth:`StaticCache.allowed`): the same bytes read as K rows reading T keys each, K times the (small) arithmetic, no
copy.

Every method that runs during a step (:meth:`write`, :meth:`claim`, :meth:`allowed`, :meth:`reorder`) takes the
position as a 0-d tensor and has no data-dependent shape nor host synchronisation, so it can be captured in a CUDA
graph; the buffers are zero-filled once (a masked position still meets a finite key and value).

Rows only ever take parents within their own example (beam search never moves a hypothesis across examples), so a
slot number keeps its meaning after a reorder.
"""

from __future__ import annotations

import torch


class TimeMajorCache:
    """Keys and values ``[T, N, H, d]`` of every layer, filled up to the caller's length, and one spare buffer of
    that shape for reorders (2L + 1 buffers, not 4L).

    Time-major, a step writes one slice (no ``torch.cat``), a reorder gathers rows of the filled part only, and
    attention reads strided ``[N, H, t, d]`` views. A fixed-shape step (``position`` a tensor) writes at a tensor
    position and attends to all T positions, the unfilled ones masked: its buffers are ``zeroed`` (finite, as a
    masked position still meets a key and a value).
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], zeroed: bool = False):
        self.keys, self.values = keys, values
        self.zeroed = zeroed
        self.spare: torch.Tensor | None = None  # made by the first reorder

    @classmethod
    def empty(cls, layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              zeroed: bool = False) -> TimeMajorCache:
        make = torch.zeros if zeroed else torch.empty
        return cls(*([make(shape, dtype=dtype, device=device) for _ in range(layers)] for _ in range(2)), zeroed)

    def _new(self, like: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shape = like.shape if shape is None else shape
        return like.new_zeros(shape) if self.zeroed else like.new_empty(shape)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0]

    @property
    def rows(self) -> int:
        return self.keys[0].shape[1]

    def write(self, layer: int, position: int | torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """Store the key and value ``[N, H, d]`` of ``position``; returns the layer's keys and values up to it,
        ``[N, H, t, d]`` views (all T positions when ``position`` is a 0-d tensor: the fixed-shape step)."""
        keys, values = self.keys[layer], self.values[layer]
        if isinstance(position, torch.Tensor):
            keys.index_copy_(0, position.view(1), key.unsqueeze(0))
            values.index_copy_(0, position.view(1), value.unsqueeze(0))
            return keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)
        keys[position], values[position] = key, value
        return keys[: position + 1].permute(1, 2, 0, 3), values[: position + 1].permute(1, 2, 0, 3)

    def reorder(self, index: torch.Tensor, length: int, fixed: int = 0) -> None:
        """Rows ``index`` (as many rows as now); positions ``< fixed`` are equal across the rows that ``index``
        merges (an example's copies of its prompt), so they need not move.

        Either the filled part of each buffer is gathered into the spare and the two swap (one copy of ``length``
        positions), or, when fewer than half the positions move, the moving ones are gathered into the spare and
        copied back (two copies of ``length - fixed``)."""
        if self.spare is None:
            self.spare = self._new(self.keys[0])
        moving = length - fixed
        if 2 * moving < length:
            part = self.spare[:moving]
            for buffer in self.keys + self.values:
                torch.index_select(buffer[fixed:length], 1, index, out=part)
                buffer[fixed:length] = part
            return
        for buffers in (self.keys, self.values):
            for layer, buffer in enumerate(buffers):
                torch.index_select(buffer[:length], 1, index, out=self.spare[:length])
                buffers[layer], self.spare = self.spare, buffer

    def gather_rows(self, index: torch.Tensor, length: int) -> None:
        """New buffers holding the rows ``index``, another number of rows (expansion to beams, examples leaving)."""
        def gathered(buffer: torch.Tensor) -> torch.Tensor:
            out = self._new(buffer, (buffer.shape[0], index.shape[0], *buffer.shape[2:]))
            out[:length] = buffer[:length].index_select(1, index)
            return out

        self.spare = None  # freed before the new buffers are made
        self.keys = [gathered(keys) for keys in self.keys]
        self.values = [gathered(values) for values in self.values]

    def grow(self, length: int) -> None:
        """Double the capacity (a stopping rule of the caller's went past it), keeping ``length`` positions."""
        def grown(buffer: torch.Tensor) -> torch.Tensor:
            new = self._new(buffer, (2 * buffer.shape[0], *buffer.shape[1:]))
            new[:length] = buffer[:length]
            return new

        self.spare = None
        self.keys = [grown(keys) for keys in self.keys]
        self.values = [grown(values) for values in self.values]


class StackedTimeMajorCache:
    """The fast T5 step's cache: the keys and values of every layer in one buffer ``[T, N, L, 2, H, d]``, filled up
    to the caller's length, and one spare buffer of that shape for reorders.

    A step writes a layer's key and value with one copy (the query/key/value product's key and value columns lie
    side by side), and a beam reorder gathers every layer's filled part in one ``index_select``, where the per-layer
    :class:`TimeMajorCache` takes 2L calls. Each buffer's per-layer views are made once (the two buffers swap at
    every reorder), not at every step.
    """

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer  # [T, N, L, 2, H, d]
        self.spare: torch.Tensor | None = None  # made by the first reorder
        self._views: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._value_index: torch.Tensor | None = None  # [L, N, H, T]: see value_rows

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> StackedTimeMajorCache:
        return cls(torch.empty(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0]

    @property
    def rows(self) -> int:
        return self.buffer.shape[1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the buffer for one layer: keys and values ``[T, N, 2, H, d]``, keys ``[T, N, H, d]``, values
        ``[T, N, H, d]``."""
        views = self._views.get(id(self.buffer))
        if views is None:
            views = self._views[id(self.buffer)] = [
                (both, both.select(2, 0), both.select(2, 1))
                for both in self.buffer.unbind(2)]
        return views[layer]

    def write(self, layer: int, position: int, key_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's key and value ``[N, 2, H, d]`` at ``position``; returns the layer's keys and values up to
        it, ``[t, N, H, d]`` views."""
        both, keys, values = self.layer(layer)
        both[position].copy_(key_value)
        return keys[: position + 1], values[: position + 1]

    def value_rows(self, length: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        """For a weighted sum of the values by ``embedding_bag``: the buffer as rows of d values, for each layer the
        rows of positions ``< length`` ordered by bag (row n, head h) then position, ``[N*H*t]``, and the bags'
        offsets ``[N*H]``. Made once per step for every layer."""
        steps, rows, layers, _, heads, size = self.buffer.shape
        if self._value_index is None or self._value_index.shape[1:3] != (rows, heads) \
                or self._value_index.shape[3] != steps:
            position = torch.arange(steps, device=self.buffer.device) * (rows * layers * 2 * heads)
            row = torch.arange(rows, device=self.buffer.device)[:, None] * (layers * 2 * heads)
            layer = torch.arange(layers, device=self.buffer.device)[:, None, None] * (2 * heads)
            first = layer + row + heads + torch.arange(heads, device=self.buffer.device)  # [L, N, H]: values at t = 0
            self._value_index = first[..., None] + position  # [L, N, H, T]
        index = self._value_index[..., :length].reshape(layers, -1).unbind(0)
        offsets = torch.arange(0, rows * heads * length, length, device=self.buffer.device)
        return self.buffer.view(-1, size), index, offsets

    def reorder(self, index: torch.Tensor, length: int) -> None:
        """Rows ``index`` (as many rows as now): the filled part gathered into the spare, and the two swapped."""
        if self.spare is None:
            self.spare = torch.empty_like(self.buffer)
        torch.index_select(self.buffer[:length], 1, index, out=self.spare[:length])
        self.buffer, self.spare = self.spare, self.buffer

    def gather_rows(self, index: torch.Tensor, length: int) -> None:
        """A new buffer holding the rows ``index``, another number of rows (expansion to beams, examples leaving)."""
        self.spare = None  # freed before the new buffer is made
        self._views.clear()
        gathered = self.buffer.new_empty((self.buffer.shape[0], index.shape[0], *self.buffer.shape[2:]))
        torch.index_select(self.buffer[:length], 1, index, out=gathered[:length])
        self.buffer = gathered

    def grow(self, length: int) -> None:
        """Double the capacity (a stopping rule of the caller's went past it), keeping ``length`` positions."""
        self.spare = None
        self._views.clear()
        grown = self.buffer.new_empty((2 * self.buffer.shape[0], *self.buffer.shape[1:]))
        grown[:length] = self.buffer[:length]
        self.buffer = grown


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
