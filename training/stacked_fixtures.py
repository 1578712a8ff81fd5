"""Small data and trainers for the stacked trainer's CPU tests (``training/test_stacked_*.py``)."""

from __future__ import annotations

import torch
from stacked_data import BucketedData
from stacked_step import Objective, StackTrainer
from stacked_t5 import StackedT5, T5Shape, init_flat

SHAPE = T5Shape(vocab_size=101, d_model=32, d_ff=48, layers=2, heads=4, d_kv=8)


def tiny_data(batch: int = 8, seed: int = 0) -> BucketedData:
    """40 random pairs of 3..7 letters (and as many phones) in two buckets (lengths 5 and 8) of batches of ``batch``."""
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randint(3, 30, (n,), generator=g).tolist() + [1],
              torch.randint(32, 101, (n,), generator=g).tolist() + [1]) for n in [3, 4, 5, 6, 7] * 8]
    return BucketedData(pairs, batch, torch.device("cpu"), lengths=(5, 64))


def add_random_targets(data: BucketedData, seed: int = 1) -> None:
    """A random teachers' distribution [N, L, V] for every pair (distillation)."""
    g = torch.Generator().manual_seed(seed)
    data.add_targets(lambda src, dec: torch.randn(*src.shape, SHAPE.vocab_size, generator=g).softmax(-1))


def tiny_trainer(members: int = 2, rate: float = 0.3, distil: bool = False, lr: float = 1e-3,
                 data: BucketedData | None = None) -> tuple[StackTrainer, BucketedData]:
    """A trainer of ``members`` tiny T5s (seeds 1, 2, ...) with dropout ``rate``; ``distil``: students of random
    targets (alpha 0.5, 0.8, ...)."""
    data = data if data is not None else tiny_data()
    objective = Objective(0.1)
    if distil:
        if data.buckets[0].target is None:
            add_random_targets(data)
        objective = Objective(0.1, torch.linspace(0.5, 0.8, members))
    matrices, vectors = init_flat(SHAPE, seeds=list(range(1, members + 1)))
    trainer = StackTrainer(StackedT5(SHAPE), matrices, vectors, data, objective, rate, seed=7)
    trainer.optimizer.lr.fill_(lr)
    return trainer, data


def first_batches(data: BucketedData, members: int) -> dict[int, torch.Tensor]:
    """bucket -> the first index [K, B] of that bucket in epoch 0."""
    first: dict[int, torch.Tensor] = {}
    for bucket, index in data.epoch(0, list(range(1, members + 1))):
        first.setdefault(bucket, index)
    return first
