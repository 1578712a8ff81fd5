"""The stacked trainer's step as CUDA graphs: one per bucket, captured once, checked against the eager step, then
replayed with a new index, learning rate and dropout masks at every step.

Two lessons of the first GPU run (``training/README.md``, "Issue 31"):

* The check must compare like with like. It replays a graph and runs the eager step from the same saved state, with
  the same dropout masks (drawn once, read by both) and a positive learning rate (``check_lr``). The first run checked
  before its phase had set the learning rate, so both updates were 0 and the ratio of their sizes gave a "relative
  difference" of exactly 1.0: correct graphs were refused and the run trained eagerly at a third of the speed.
* A capture that fails must not take the process with it. :meth:`GraphedSteps._capture` always ends the stream
  capture (``capture_end`` in ``finally``) and leaves the stream context; the step runs no random number kernel, so no
  generator is left in capture mode (the first run's student phase died of that when its capture failed); cuBLAS's
  workspaces are cleared before and after capturing (as torch's cudagraph trees do), so no graph depends on a
  workspace that an earlier capture allocated.

Any error or mismatch leaves ``ready`` False and the caller steps eagerly, from the state it had before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from stacked_step import StackTrainer, restore, snapshot

CHECK_STEP = 10**9  # the step numbers whose masks the check draws (never a training step's)


def clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()


def end_allocating_to_pool(pool) -> None:
    """After a failed ``capture_end``: the capture is over (``cudaStreamEndCapture`` ends it, success or not) but
    ``capture_end`` raised before telling the caching allocator, which would otherwise go on treating a capture as
    underway (no event processing, no release of cached blocks). Best effort: a private torch API."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except Exception:
        pass


def step_difference(replayed: Sequence[torch.Tensor], eager: Sequence[torch.Tensor], before: Sequence[torch.Tensor],
                    ) -> float:
    """How far a replayed step is from the eager one, both from the weights ``before``: the largest relative
    difference of the loss (``[..., loss]``, last), of Adam's first moment (the middle tensors: the clipped gradient)
    and of the size of the update (the first ``len(before)`` tensors are the new weights). Not the update itself:
    Adam's first step is sign(gradient), which rounding noise can flip. An eager update of size 0 cannot be compared
    (inf): the check's learning rate must be positive."""
    n = len(before)

    def norm(tensors) -> float:
        return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))

    def relative(a, b) -> float:
        return norm([x - y for x, y in zip(a, b, strict=True)]) / max(norm(b), 1e-30)

    eager_size = norm([x - y for x, y in zip(eager[:n], before, strict=True)])
    if eager_size == 0:
        return math.inf
    replayed_size = norm([x - y for x, y in zip(replayed[:n], before, strict=True)])
    return max(relative(replayed[-1:], eager[-1:]), relative(replayed[n:-1], eager[n:-1]),
               abs(1 - replayed_size / eager_size))


class GraphedSteps:
    """One CUDA graph of :meth:`StackTrainer.step` per bucket; :meth:`run` draws the step's masks, copies the index
    into the graph's static index and replays.

    Args:
        trainer: the trainer whose step is captured.
        log: progress lines.
        check_lr: the learning rate of the check's steps (positive; the phase's peak).
    """

    tolerance = 0.02

    def __init__(self, trainer: StackTrainer, log: Callable[[str], None], check_lr: float):
        if check_lr <= 0:
            raise ValueError(f"check_lr {check_lr}: the check needs a positive learning rate")
        self.trainer, self.log, self.check_lr = trainer, log, check_lr
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.index: dict[int, torch.Tensor] = {}
        self.ready = False

    def capture(self, examples: dict[int, torch.Tensor]) -> bool:
        """Capture and check one graph per bucket of ``examples`` (bucket -> an index [K, B] of that bucket). The
        trainer's state and learning rate are restored afterwards, whatever happened."""
        t0 = time.time()
        state = self.trainer.state()
        saved = snapshot(state)
        lr = self.trainer.optimizer.lr.clone()
        try:
            self._capture_all(examples)
            worst, masks_read = self._check(examples, saved)
            self.ready = math.isfinite(worst) and worst < self.tolerance and masks_read
            verdict = "using them" if self.ready else "EAGER"
            self.log(f"CUDA graphs: {len(self.graphs)} captured and checked in {time.time() - t0:.1f}s; largest "
                     f"relative difference from the eager step (same masks, lr {self.check_lr:g}) {worst:.2e}; "
                     f"other masks give another loss: {masks_read}: {verdict}")
        except Exception as e:  # any capture problem: train eagerly
            context = e.__context__
            during = f" (raised while handling {type(context).__name__}: {context})" if context is not None else ""
            self.log(f"CUDA graphs unavailable ({type(e).__name__}: {e}{during}); training eagerly")
            self.ready = False
        if not self.ready:
            self.graphs.clear()
        if torch.cuda.is_available():  # (--graphs on without a GPU fails above, at the first stream)
            torch.cuda.synchronize()
        restore(state, saved)
        self.trainer.optimizer.lr.copy_(lr)
        return self.ready

    def _capture_all(self, examples: dict[int, torch.Tensor]) -> None:
        cuda = torch.cuda
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):  # warm-up on a side stream (autograd's and cuBLAS's lazy state), as torch advises
            for bucket, index in examples.items():
                self.index[bucket] = index.clone()
                for step in range(2):
                    self.trainer.run(step, bucket, self.index[bucket])
        cuda.current_stream().wait_stream(side)
        cuda.synchronize()
        clear_cublas_workspaces()
        pool = cuda.graph_pool_handle()
        stream = cuda.Stream()
        try:
            for bucket in examples:
                self.graphs[bucket] = self._capture(bucket, pool, stream)
        finally:
            cuda.synchronize()
            clear_cublas_workspaces()

    def _capture(self, bucket: int, pool, stream) -> torch.cuda.CUDAGraph:
        """One graph; the capture is ended even when the step fails (else the stream stays in capture mode)."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # as torch.cuda.graph does: nothing else in flight
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                self.trainer.step(bucket, self.index[bucket])
            finally:
                try:
                    graph.capture_end()
                except Exception:
                    end_allocating_to_pool(pool)
                    raise
        return graph

    def _check(self, examples: dict[int, torch.Tensor], saved: list[torch.Tensor]) -> tuple[float, bool]:
        """Every graph against the eager step (:func:`step_difference`), and whether a replay reads its masks: two
        replays from the same state with other masks must give other losses (with dropout)."""
        trainer = self.trainer
        n = len(trainer.params)

        def watched() -> list[torch.Tensor]:
            return snapshot([*trainer.params, *trainer.optimizer.exp_avg, trainer.loss_sum])

        def replay(step: int, bucket: int, index: torch.Tensor) -> list[torch.Tensor]:
            self._reset(saved)
            self.run(step, bucket, index)
            return watched()

        worst = 0.0
        for number, (bucket, index) in enumerate(examples.items()):
            replayed = replay(CHECK_STEP + number, bucket, index)
            self._reset(saved)
            trainer.step(bucket, index)  # the same masks: drawn by the replay's run, not drawn again
            worst = max(worst, step_difference(replayed, watched(), saved[:n]))
        if trainer.masks is None:
            return worst, True
        bucket, index = next(iter(examples.items()))
        first, second = (replay(CHECK_STEP + s, bucket, index)[-1] for s in (0, 1))
        return worst, not torch.equal(first, second)

    def _reset(self, saved: list[torch.Tensor]) -> None:
        restore(self.trainer.state(), saved)
        self.trainer.optimizer.lr.fill_(self.check_lr)

    def run(self, step: int, bucket: int, index: torch.Tensor) -> None:
        """Training step number ``step`` by replay: its masks drawn, its index copied in."""
        self.trainer.draw(step, bucket)
        self.index[bucket].copy_(index, non_blocking=True)
        self.graphs[bucket].replay()
