"""The CUDA-graph path of the stacked trainer (``stacked_graphs.py``) on the CPU, with the CUDA graph API stood in for
by a recorder that behaves like a graph: it records the aten ops of the captured step with their tensors (fixed
addresses) and Python numbers (baked in), and a replay re-runs exactly those ops on whatever the tensors then hold.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q training/test_stacked_graphs.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stacked_fixtures import first_batches, tiny_trainer  # noqa: E402
from stacked_graphs import GraphedSteps, step_difference  # noqa: E402
from stacked_step import snapshot  # noqa: E402

torch.set_num_threads(1)


class Tape(TorchDispatchMode):
    """The aten ops of a capture, (op, args, kwargs, outputs), tensors by reference (kept alive, as a graph's pool
    keeps its memory). A replay re-runs them in order: in-place ops write their arguments again, functional ops' new
    results are copied into the recorded outputs, views are skipped (they alias storage that the replay updates)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    @torch.no_grad()
    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            if func.is_view:
                continue
            result = func(*args, **kwargs)
            if func._schema.is_mutable:
                continue
            for old, new in zip(tree_leaves(out), tree_leaves(result), strict=True):
                if isinstance(old, torch.Tensor):
                    old.copy_(new)


class FakeCuda:
    """Stand-ins for ``torch.cuda``'s graph API. ``fail``: capture_end raises, as for an invalidated capture;
    ``replay``: "tape" (a real graph), "nothing" (a graph that does nothing) or "baked" (a graph that replays the
    dropout bytes it saw at capture, as if they were constants)."""

    def __init__(self, monkeypatch, trainer, fail: bool = False, replay: str = "tape"):
        self.capturing = False
        self.stream_depth = 0
        self.captures = 0
        fake = self

        class Graph:
            def capture_begin(self, pool=None):
                assert fake.stream_depth > 0, "capture on a side stream"
                self.tape = Tape()
                self.tape.__enter__()
                self.bytes = trainer.masks.bytes.clone() if trainer.masks is not None else None
                fake.capturing = True

            def capture_end(self):
                self.tape.__exit__(None, None, None)
                fake.capturing = False
                fake.captures += 1
                if fail:
                    raise RuntimeError("operation failed due to a previous error during capture")

            def replay(self):
                if replay == "nothing":
                    return
                if replay == "baked" and self.bytes is not None:
                    trainer.masks.bytes.copy_(self.bytes)
                self.tape.replay()

        class StreamContext:
            def __init__(self, stream):
                pass

            def __enter__(self):
                fake.stream_depth += 1

            def __exit__(self, *exc):
                fake.stream_depth -= 1
                return False

        class Stream:
            def wait_stream(self, other):
                pass

        for name, value in {"CUDAGraph": Graph, "Stream": Stream, "stream": StreamContext,
                            "current_stream": Stream, "graph_pool_handle": lambda: None,
                            "synchronize": lambda: None}.items():
            monkeypatch.setattr(torch.cuda, name, value)


def graphed(monkeypatch, distil: bool = False, lr: float = 0.0, **fake_options):
    """A trainer (learning rate ``lr`` at capture: 0, as at the start of a phase), its graphs and the stand-in."""
    trainer, data = tiny_trainer(distil=distil, lr=lr)
    fake = FakeCuda(monkeypatch, trainer, **fake_options)
    lines: list[str] = []
    return trainer, data, GraphedSteps(trainer, lines.append, check_lr=1e-3), fake, lines


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("distil", [False, True])
def test_replays_train_as_the_eager_steps_do(monkeypatch, distil):
    """Captured with the learning rate still 0 (the first GPU run's check then saw updates of size 0 and refused
    correct graphs): the check passes, the state is as before, and replays with new indices, learning rates and
    masks give exactly the eager steps' weights (nothing of the captured step's numbers is baked in)."""
    trainer, data, graphs, fake, lines = graphed(monkeypatch, distil)
    eager, _ = tiny_trainer(distil=distil, lr=0.0, data=data)
    before = snapshot(trainer.state())
    assert graphs.capture(first_batches(data, 2)), lines
    assert "using them" in lines[-1] and fake.captures == 2 and not fake.capturing and fake.stream_depth == 0
    assert same(trainer.state(), before) and float(trainer.optimizer.lr) == 0.0
    for step, (bucket, index) in enumerate(data.epoch(1, [1, 2])[:6]):
        for t in (trainer, eager):
            t.optimizer.lr.fill_(1e-3 * (step + 1))
        graphs.run(step, bucket, index)
        eager.run(step, bucket, index)
    assert same(trainer.state(), eager.state())
    assert not same(trainer.params, [b for b in before[:2]])


def test_a_failed_capture_leaves_nothing_capturing_and_training_goes_on(monkeypatch):
    trainer, data, graphs, fake, lines = graphed(monkeypatch, fail=True)
    before = snapshot(trainer.state())
    assert not graphs.capture(first_batches(data, 2))
    assert "unavailable" in lines[-1] and "previous error during capture" in lines[-1]
    assert not fake.capturing and fake.stream_depth == 0 and not graphs.graphs
    assert same(trainer.state(), before)
    bucket, index = data.epoch(0, [1, 2])[0]
    trainer.optimizer.lr.fill_(1e-3)
    trainer.run(0, bucket, index)  # the eager fallback still trains
    assert not torch.equal(trainer.params[0], before[0])


def test_a_step_that_fails_in_capture_still_ends_the_capture(monkeypatch):
    trainer, data, graphs, fake, lines = graphed(monkeypatch)
    step = trainer.step

    def failing(bucket, index):
        if fake.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        step(bucket, index)

    trainer.step = failing
    assert not graphs.capture(first_batches(data, 2))
    assert fake.captures == 1 and not fake.capturing and fake.stream_depth == 0
    assert "not permitted" in lines[-1]


@pytest.mark.parametrize("replay", ["nothing", "baked"])
def test_the_check_refuses_wrong_graphs(monkeypatch, replay):
    """A graph that does nothing (relative difference 1) or replays the masks it was captured with (every step the
    same masks) is refused; the trainer's state is as before."""
    trainer, data, graphs, fake, lines = graphed(monkeypatch, replay=replay)
    before = snapshot(trainer.state())
    assert not graphs.capture(first_batches(data, 2))
    assert "EAGER" in lines[-1] and same(trainer.state(), before)
    if replay == "baked":
        assert "other masks give another loss: False" in lines[-1]


def test_step_difference():
    before = [torch.zeros(3)]
    eager = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.0])]  # weights, moment, loss
    assert step_difference(eager, eager, before) == 0.0
    nothing = [torch.zeros(3), torch.zeros(2), torch.zeros(1)]
    assert step_difference(nothing, eager, before) == pytest.approx(1.0)
    off = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.2])]
    assert step_difference(off, eager, before) == pytest.approx(0.1)
    assert math.isinf(step_difference(eager, nothing, before))  # an eager update of size 0 cannot be compared
