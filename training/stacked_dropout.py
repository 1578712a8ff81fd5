"""Dropout for the stacked trainer without a random number generator inside the step.

Before each step the trainer draws random bytes into a buffer from a generator of its own, seeded by (seed, step)
(:meth:`MaskBuffer.draw`, outside the step); the step turns them into one scaled keep-mask (:meth:`MaskBuffer.scaled`)
and every dropout site multiplies its input by the next slice of that mask (:class:`Dropout`). Hence:

* the step contains no random number kernel, so its CUDA graph registers and advances no generator state: a replay
  reads whatever bytes were drawn for its step, and an eager step on the same bytes applies exactly the same masks
  (the graph check compares like with like);
* a capture that fails cannot leave a generator in capture mode: the first GPU run's student phase died of that
  ("Offset increment outside graph capture encountered unexpectedly" from torch's own dropout after a failed capture);
* the masks are a function of (seed, step) only; consecutive steps get independent masks.

A byte ``b`` keeps its element when ``b >= round(256 * rate)``, so the rate is quantised to 1/256 (0.3 -> 77/256 =
0.30078); kept elements are scaled by 1 / (1 - that rate) (inverted dropout).

Legend: K members, B batch, L bucket length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stacked_t5 import T5Shape


def mask_elements(shape: T5Shape, members: int, batch: int, length: int) -> int:
    """How many mask elements one training step of ``members`` x ``batch`` pairs of bucket ``length`` uses: every
    dropout site of :class:`~stacked_t5.StackedT5` (source and target both ``length`` long)."""
    d, ff, h, n, m = shape.d_model, shape.d_ff, shape.heads, shape.layers, shape.dec_layers
    residual = length * d  # embeddings, attention and feed-forward outputs, final norms: [L, d] per pair
    probs = h * length * length  # attention probabilities: [H, L, L] per pair
    encoder = (2 + 2 * n) * residual + n * (probs + length * ff)
    decoder = (2 + 3 * m) * residual + m * (2 * probs + length * ff)
    return members * batch * (encoder + decoder)


class Dropout:
    """One step's dropout: ``drop(x)`` multiplies ``x`` by the next ``x.numel()`` elements of the scaled keep-mask
    (a flat [n] tensor), viewed as ``x``'s shape. With ``mask`` None it returns ``x`` (evaluation)."""

    def __init__(self, mask: torch.Tensor | None = None):
        self.mask = mask
        self.used = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return x
        n = x.numel()
        keep = self.mask[self.used : self.used + n].view(x.shape)
        self.used += n
        return x * keep


NO_DROPOUT = Dropout()  # evaluation: every site returns its input


class MaskBuffer:
    """Random bytes for the dropout masks of one step, drawn outside the step, read inside it.

    Args:
        capacity: bytes (the largest step's :func:`mask_elements`).
        rate: the dropout rate (quantised to 1/256).
        seed: with the step number, seeds each draw.
        dtype: the scaled mask's dtype (the model's compute dtype).
        device: where the buffer lives.
    """

    def __init__(self, capacity: int, rate: float, seed: int, dtype: torch.dtype, device: torch.device):
        if not 0 < rate < 1:
            raise ValueError(f"dropout rate {rate}: must be in (0, 1) (no MaskBuffer without dropout)")
        self.threshold = round(256 * rate)
        self.rate = self.threshold / 256
        self.seed = seed
        self.bytes = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self.generator = torch.Generator(device=device)  # never the default one, never registered with a graph
        self.keep_value = torch.tensor(1 / (1 - self.rate), dtype=dtype, device=device)
        self.zero = torch.zeros((), dtype=dtype, device=device)

    def draw(self, step: int, n: int) -> None:
        """Fill the first ``n`` bytes for ``step`` (between steps; the same (seed, step) gives the same bytes)."""
        self.generator.manual_seed(self.seed * 1_000_003 + step)
        self.bytes[:n].random_(0, 256, generator=self.generator)

    def scaled(self, n: int) -> torch.Tensor:
        """The scaled keep-mask of the first ``n`` bytes: [n] in ``dtype``, 1 / (1 - rate) or 0 (inside the step)."""
        return torch.where(self.bytes[:n] >= self.threshold, self.keep_value, self.zero)
