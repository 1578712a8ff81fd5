"""Captured steps kept across calls: a later call of the same shapes and options replays the kept graph.

A CUDA graph replays on the addresses it was captured with. A call builds its state as usual (the encoder's keys and
values, the prompt's cache, fresh pools), and when a kept step was captured for everything the graph bakes in
(:func:`reuse_key`: the model, the bucket, the rows, the lengths, the source or prompt length, dtype, device and the
search options), that state is loaded into the kept step's tensors (:func:`load`: one copy of each, in the fixed
order of ``static_tensors()``; the self-attention cache is handed to the new state to fill in place, so it is not
copied) and the kept graph is replayed: no warm-up steps and no capture. That makes the graph path pay its capture
once per shape, not once per call: a server or the command line decoding batches of one bucket, or a benchmark.

At most :data:`MAX_KEPT` steps are kept (least recently used first out); each holds its model (the graph reads its
weights by address), its cache and its graph's memory pool until it leaves or :func:`release` is called. A step is
kept once its first call succeeded; a later call that fails drops it (its cache may hold what made it fail). Not
thread-safe: one decoding thread per process.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch

from ..options import SearchOptions
from ..steps.gate import WeightStamp
from .runner import StepRunner, WholeStep

MAX_KEPT = 8


@dataclasses.dataclass
class KeptStep:
    """A captured step and what it was captured on."""

    model: Any  # held so that its weights stay where the graph reads them
    step: WholeStep
    runner: StepRunner
    stamp: WeightStamp = dataclasses.field(init=False)  # the weights the graph reads, as captured

    def __post_init__(self) -> None:
        self.stamp = WeightStamp(self.model)


_KEPT: OrderedDict[tuple, KeptStep] = OrderedDict()


def reuse_key(model: Any, setup: dict[str, Any], options: SearchOptions, fill_token_id: int, bucket: int,
              rows: int, capacity: int) -> tuple:
    """Everything a captured step bakes in: the model (by identity, held while kept), its dtype and device, the
    shapes (bucket, rows, capacity, the start tokens, the encoder output's or the prompt's length) and the options
    (the processors' and the strategy's constants)."""
    input_ids = setup["input_ids"]
    encoded = setup["model_kwargs"].get("encoder_outputs")
    source = None if encoded is None else tuple(encoded.last_hidden_state.shape[1:])
    parameter = next(model.parameters())
    return (id(model), parameter.dtype, str(parameter.device), bucket, rows, capacity, tuple(input_ids.shape[1:]),
            source, options, fill_token_id)


def kept_step(key: tuple, model: Any) -> KeptStep | None:
    """The kept step for ``key`` (now the most recently used), or None; a kept step whose model no longer holds the
    weights it was captured on (a replaced tensor or module, a move or cast:
    :class:`~beamsearch.steps.gate.WeightStamp`) is dropped (its graph would read the old addresses)."""
    kept = _KEPT.get(key)
    if kept is not None and not kept.stamp.current(model):
        forget(key)
        return None
    if kept is not None:
        _KEPT.move_to_end(key)
    return kept


def keep(key: tuple, kept: KeptStep) -> None:
    """Keep a step for later calls, dropping the least recently used beyond :data:`MAX_KEPT`."""
    _KEPT[key] = kept
    _KEPT.move_to_end(key)
    while len(_KEPT) > MAX_KEPT:
        _KEPT.popitem(last=False)


def forget(key: tuple) -> None:
    _KEPT.pop(key, None)


def release() -> None:
    """Drop every kept step (their caches, graphs and memory pools; ``torch.cuda.empty_cache()`` returns the memory
    to the device)."""
    _KEPT.clear()


def kept_count() -> int:
    return len(_KEPT)


def load(kept: WholeStep, fresh: WholeStep) -> None:
    """The fresh call's state into the kept step's tensors (the same structure: ``static_tensors()`` in the same
    order and shapes); tensors the two share (the cache handed over) are left alone."""
    targets, sources = kept.static_tensors(), fresh.static_tensors()
    if len(targets) != len(sources):
        raise RuntimeError(f"a kept step holds {len(targets)} tensors, the call's state {len(sources)}")
    with torch.no_grad():
        for target, source in zip(targets, sources, strict=True):
            if target.data_ptr() != source.data_ptr():
                target.copy_(source)
