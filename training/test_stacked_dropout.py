"""The stacked trainer's dropout masks (``stacked_dropout.py``) on the CPU:

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q training/test_stacked_dropout.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stacked_dropout import NO_DROPOUT, Dropout, MaskBuffer, mask_elements  # noqa: E402
from stacked_fixtures import SHAPE, tiny_trainer  # noqa: E402
from stacked_t5 import PAD, StackedT5, T5Shape, init_flat  # noqa: E402

torch.set_num_threads(1)


def buffer(capacity: int = 1 << 20, rate: float = 0.3, seed: int = 5) -> MaskBuffer:
    return MaskBuffer(capacity, rate, seed, torch.float32, torch.device("cpu"))


def test_masks_are_a_function_of_seed_and_step():
    masks = buffer()
    masks.draw(12, 4096)
    first = masks.scaled(4096).clone()
    masks.draw(13, 4096)
    second = masks.scaled(4096).clone()
    masks.draw(12, 4096)
    assert torch.equal(masks.scaled(4096), first)  # the same step: the same mask
    assert not torch.equal(second, first)  # the next step: another mask
    other = buffer(seed=6)
    other.draw(12, 4096)
    assert not torch.equal(other.scaled(4096), first)  # another seed: another mask


def test_keep_rate_and_scale():
    masks = buffer()
    n = 1 << 20
    masks.draw(0, n)
    scaled = masks.scaled(n)
    assert masks.threshold == 77 and masks.rate == 77 / 256  # 0.3 quantised to 1/256
    keep_value = 256 / 179
    assert scaled.unique().tolist() == pytest.approx([0.0, keep_value])
    kept = (scaled > 0).double().mean().item()
    tolerance = 5 * (179 / 256 * 77 / 256 / n) ** 0.5  # five standard errors of a binomial proportion
    assert abs(kept - 179 / 256) < tolerance
    assert abs(scaled.double().mean().item() - 1) < tolerance * keep_value  # inverted dropout: mean 1


def test_draw_fills_only_the_prefix():
    masks = buffer(capacity=100)
    masks.draw(3, 40)
    assert masks.bytes[:40].any() and not masks.bytes[40:].any()


def test_rate_must_be_strictly_between_0_and_1():
    for rate in (0.0, 1.0):
        with pytest.raises(ValueError):
            buffer(rate=rate)
    trainer, _ = tiny_trainer(rate=0.0)
    assert trainer.masks is None


def test_dropout_takes_consecutive_slices():
    mask = torch.arange(1.0, 11.0)
    drop = Dropout(mask)
    a, b = torch.ones(2, 2), torch.full((3,), 2.0)
    torch.testing.assert_close(drop(a), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    torch.testing.assert_close(drop(b), torch.tensor([10.0, 12.0, 14.0]))
    assert drop.used == 7
    x = torch.randn(3)
    assert NO_DROPOUT(x) is x and NO_DROPOUT.used == 0


@pytest.mark.parametrize("shape", [SHAPE, T5Shape(vocab_size=101, d_model=16, d_ff=24, layers=3, heads=2, d_kv=4),
                                   T5Shape(vocab_size=101, d_model=16, d_ff=24, layers=3, heads=2, d_kv=4,
                                           decoder_layers=1)])
def test_mask_elements_counts_every_site(shape):
    """The formula the buffer is sized by equals what the model's dropout sites take (a step checks it too)."""
    k, b, length = 2, 3, 7
    matrices, vectors = init_flat(shape, seeds=[1, 2])
    model = StackedT5(shape)
    src = torch.randint(3, 101, (k, b, length))
    src[:, 0, 4:] = PAD
    drop = Dropout(torch.ones(10**6))
    with torch.no_grad():
        w = model.weights(matrices, vectors)
        enc, mask = model.encode(w, src, drop)
        model.decode(w, src, enc, mask, drop)
    assert drop.used == mask_elements(shape, k, b, length)
