"""The self-attention cache of the lean steps (``hf_t5.py``, ``hf_gpt2.py``): preallocated and time-major.

Legend: L layers, T capacity (positions), N rows, H heads, d head size, t positions filled.
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
