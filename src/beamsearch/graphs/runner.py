"""One whole decoding step, run eagerly or captured once in a CUDA graph and replayed.

:class:`WholeStep` is the step: the model at the tensor position on the last tokens, the processors and the
strategy's selection, and the parents applied to the model state's parent index. It reads and writes only tensors
allocated before it first runs, changes them in place, has no data-dependent shape and reads nothing on the host:
so the same Python can be recorded by ``torch.cuda.graph`` and replayed (one ``replay()`` per step on the host).

:class:`StepRunner` runs it. On a CPU (or with ``capture=False``) it calls the step. On CUDA, as torch's CUDA graph
notes ask: the first steps run eagerly on a side stream (warm-up: cuBLAS handles, workspaces and kernel choices are
made outside the capture), then one step is captured (``torch.cuda.graph``: capture does not run the kernels) and
replayed for that step and every later one. The warm-up steps are real steps of the search, so nothing is undone.

Legend: N rows, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

WARMUP_STEPS = 2  # eager steps on a side stream before the capture


class WholeStep:
    """The step: ``model.decode`` -> ``search.select`` -> ``model.reorder`` (graph-safe, see the module docstring).

    ``model``: ``decode(tokens [N], position 0-d) -> logits [N, V]`` and ``reorder(parents [N])``; ``search``:
    ``last_tokens() -> [N]``, ``length`` (0-d, tokens so far) and ``select(logits) -> parents [N] or None``.
    """

    def __init__(self, model: Any, search: Any):
        self.model, self.search = model, search

    def __call__(self) -> None:
        search = self.search
        logits = self.model.decode(search.last_tokens(), search.length - 1)  # the last token's position
        parents = search.select(logits)
        if parents is not None:
            self.model.reorder(parents)

    def static_tensors(self) -> list[torch.Tensor]:
        return [*self.model.static_tensors(), *self.search.static_tensors()]


class StepRunner:
    """Runs a step function each call: eagerly, or (``capture``, CUDA only) warmed up, captured and replayed.

    Args:
        step: a graph-safe step (no arguments, no result).
        capture: capture it in a CUDA graph after :data:`WARMUP_STEPS` eager steps.
        pool: a graph memory pool to share (``torch.cuda.graph_pool_handle()``), or None for the graph's own.
    """

    def __init__(self, step: Any, capture: bool, pool: Any = None):
        self.step, self.capture, self.pool = step, capture, pool
        self.graph: Any = None
        self.steps = 0  # steps run so far
        self.side_stream: Any = None  # made by the first warm-up step

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif not self.capture:
            self.step()
        elif self.steps < WARMUP_STEPS:
            self._warm_up()
        else:
            self.graph = self._record()
            self.graph.replay()
        self.steps += 1

    def _warm_up(self) -> None:
        """One eager step on a side stream, ordered after everything before it and before everything after it."""
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self.side_stream.wait_stream(current)
        with torch.cuda.stream(self.side_stream):
            self.step()
        current.wait_stream(self.side_stream)

    def _record(self) -> Any:
        """The step captured (not run) in a new CUDA graph."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step()
        return graph
