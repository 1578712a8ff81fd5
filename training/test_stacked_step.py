"""The stacked trainer's step (``stacked_step.py``) on the CPU: what a CUDA graph of it needs.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q training/test_stacked_step.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stacked_fixtures import first_batches, tiny_trainer  # noqa: E402
from stacked_step import snapshot  # noqa: E402

torch.set_num_threads(1)

HOST_READS = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}
RANDOM = {"bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
          "random_", "uniform_", "normal_", "normal", "exponential_", "geometric_", "cauchy_", "log_normal_",
          "multinomial", "randperm", "native_dropout", "dropout", "poisson"}


class OpNames(TorchDispatchMode):
    """Every aten op a block dispatches (forward and backward), by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("distil", [False, True])
def test_a_step_never_reads_the_device_nor_draws_random_numbers(distil):
    """No host read (``.item()``, ``nonzero``, ...) and no random number op inside a step: the first would break a
    CUDA graph's capture, the second would tie the graph to a generator (whose failed capture ended the first GPU
    run). The masks come from the buffer drawn before the step."""
    trainer, data = tiny_trainer(distil=distil)
    bucket, index = data.epoch(0, [1, 2])[0]
    trainer.draw(0, bucket)
    cpu_state = torch.get_rng_state()
    with OpNames() as ops:
        trainer.step(bucket, index)
    assert "bmm" in ops.names and "threshold_backward" in ops.names  # forward and backward were seen
    assert not HOST_READS & set(ops.names), HOST_READS & set(ops.names)
    assert not RANDOM & set(ops.names), RANDOM & set(ops.names)
    assert torch.equal(torch.get_rng_state(), cpu_state)


def test_a_step_reads_its_masks_from_the_buffer():
    """The same state and masks give the same update; other masks (another step number), another one."""
    trainer, data = tiny_trainer()
    bucket, index = data.epoch(0, [1, 2])[0]
    saved = snapshot(trainer.state())

    def update(step: int) -> list[torch.Tensor]:
        for t, s in zip(trainer.state(), saved, strict=True):
            t.data.copy_(s)
        trainer.run(step, bucket, index)
        return snapshot(trainer.params)

    first, again, other = update(4), update(4), update(5)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


def test_members_do_not_mix():
    """Permuting the members (weights and batches) permutes the result: nothing crosses the member axis."""
    perm = torch.tensor([2, 0, 1])
    a, data = tiny_trainer(members=3, rate=0.0)
    b, _ = tiny_trainer(members=3, rate=0.0, data=data)
    with torch.no_grad():
        for t in b.params:
            t.copy_(t[perm].clone())
    for step, (bucket, index) in enumerate(data.epoch(0, [1, 2, 3])[:3]):
        a.run(step, bucket, index)
        b.run(step, bucket, index[perm])
    for x, y in zip(a.params, b.params, strict=True):
        torch.testing.assert_close(y, x[perm], rtol=1e-5, atol=1e-6)


def test_eager_steps_are_deterministic():
    """Two trainers from the same weights and step numbers end equal (the eager reference of the graph check)."""
    a, data = tiny_trainer(distil=True)
    b, _ = tiny_trainer(distil=True, data=data)
    for step, (bucket, index) in enumerate(data.epoch(0, [1, 2])[:4]):
        a.run(step, bucket, index)
        b.run(step, bucket, index)
    assert all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))
    assert set(first_batches(data, 2)) == {0, 1}  # both buckets were there to be stepped
