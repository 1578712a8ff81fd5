"""The graph path's driver (``beamsearch.generate(..., cuda_graphs=True)``): one whole step per replay.

The eager path is the engine's loop (``loop.py``: step -> strategy -> reorder, one host check per step). This
driver replaces it for a call the graph path can run (``steps/chooser.check_graph_call``):

1. the options become processors and stopping criteria as in the eager search (``build_processors``, the same
   combination checks), then their graph-safe forms (``processors.py``);
2. the batch is padded to a row bucket (``buckets.py``) and the model state is built once, with every tensor a step
   touches: the graph-safe step the chooser picks (``steps/chooser.graph_state``: T5, GPT-2 or Llama; the prompt or
   the decoder's start tokens run here, eagerly), and the strategy's pools (:class:`~.greedy.GraphGreedy`,
   :class:`~.beam.GraphBeamSearch`);
3. :class:`~.runner.StepRunner` runs :class:`~.runner.WholeStep` (model, processors, selection, parent index) up
   to the length limit: on CUDA captured once and replayed; elsewhere eagerly, the same Python. A captured step is
   kept for later calls of the same shapes and options (``reuse.py``): such a call loads its state into the kept
   tensors and replays the kept graph;
4. the host reads the device's ``[going, failed]`` flags every :data:`CHECK_EVERY` steps on CUDA (every step
   elsewhere, where a read costs nothing: :data:`EAGER_CHECK_EVERY`), so a search may run a few steps past its
   end: a finished example's pool and a finished row no longer change, so the result is the same;
5. the result is the eager search's :class:`~beamsearch.SearchResult` for the call's examples.

Legend: B examples of the call, B' the bucket, K rows per example, N = B'*K, t0 start tokens, L = max_length.
"""

from __future__ import annotations

from typing import Any

import torch

from ..options import SearchOptions
from ..processors import build_processors
from ..results import SearchResult
from ..steps.chooser import check_graph_call, graph_state
from ..steps.padding import pad_examples
from ..stopping import build_stopping_criteria
from ..strategies.base import StepTrace
from ..strategies.registry import Request, check
from ..strategies.score_checks import check_enough_hypotheses
from .beam import GraphBeamSearch
from .buckets import bucket_size, real_examples
from .greedy import GraphGreedy
from .processors import graph_processors
from .reuse import KeptStep, forget, keep, kept_step, load, reuse_key
from .runner import StepRunner, WholeStep

CHECK_EVERY = 4  # captured steps between two reads of the device's flags
EAGER_CHECK_EVERY = 1  # uncaptured (a CPU): a read costs nothing there, so every step


def graph_search(model: Any, setup: dict[str, Any], config: Any, options: SearchOptions, fill_token_id: int, *,
                 logits_processor: Any = (), stopping_criteria: Any = (), arguments: dict[str, Any] | None = None,
                 step_options: dict[str, Any] | None = None, capture: bool | None = None) -> SearchResult:
    """Decode one call with the whole step captured (CUDA) or run eagerly (elsewhere).

    Args:
        model: a Hugging Face T5, GPT-2 or Llama model that the lean step runs.
        setup: ``hf_inputs.prepare``'s output (``input_ids [B, t0]``, ``model_kwargs``, ...).
        config: the call's generation config.
        options: the search options.
        fill_token_id: what returned sequences are filled with.
        logits_processor, stopping_criteria, arguments, step_options: the call's other arguments, refused where
            the graph path cannot run them (``steps/chooser.check_graph_call``).
        capture: capture a CUDA graph; default: on a CUDA device.

    Raises:
        ValueError: an option or argument the graph path cannot run, or a model without a lean step (named).
        SearchError: a step's scores held NaN (named by step and example), or too many beams for the vocabulary.
    """
    check_graph_call(options, arguments or {}, step_options or {}, logits_processor, stopping_criteria)
    input_ids = setup["input_ids"]
    examples, t0 = input_ids.shape
    rows = options.num_beams if options.num_beams > 1 else options.num_return_sequences
    max_length = options.resolved_max_length(t0)
    bucket = bucket_size(examples)
    capacity = max(max_length, t0 + 1)  # positions of the cache (the prompt's included)
    processors = _processors(options, setup, rows, max_length, bucket, fill_token_id)
    vocab = model.get_output_embeddings().weight.shape[0]
    if options.num_beams > 1:
        check_enough_hypotheses(rows, options.num_return_sequences, vocab, options.eos_token_id, max_length - t0)
    if capture is None:
        capture = captures(input_ids.device)
    key = reuse_key(model, setup, options, fill_token_id, bucket, rows, capacity) if keeps_steps(capture) else None
    kept = None if key is None else kept_step(key, model)
    state = graph_state(model, setup, config, rows, capacity, bucket, None if kept is None else kept.step.model.cache)
    search = _strategy(options, pad_examples(input_ids, bucket), rows, max_length, fill_token_id,
                       graph_processors(processors, vocab, input_ids.device), real_examples(examples, bucket,
                                                                                            input_ids.device))
    step = WholeStep(state, search)
    if kept is None:
        runner = StepRunner(step, capture)
    else:  # the kept graph replays on the kept tensors: this call's state goes into them
        load(kept.step, step)
        step, runner = kept.step, kept.runner
    try:
        run_steps(step, runner, max_length - t0, CHECK_EVERY if capture else EAGER_CHECK_EVERY,
                  getattr(state, "first_logits", None))
    except BaseException:
        if kept is not None:
            forget(key)  # its cache may hold what went wrong
        raise
    if key is not None and kept is None:
        keep(key, KeptStep(model, step, runner))
    return step.search.result(examples)


def _processors(options: SearchOptions, setup: dict[str, Any], rows: int, max_length: int, bucket: int,
                fill_token_id: int) -> list:
    """The eager search's processors for the bucket's rows (``build_processors``, its order and merging), after
    the same combination checks as the eager search (``strategies/registry.check``)."""
    input_ids = setup["input_ids"]
    t0 = input_ids.shape[1]
    source_lengths = pad_examples(setup["source_lengths"], bucket).repeat_interleave(rows)  # [N]
    processors = build_processors(options, t0, source_lengths=source_lengths)
    criteria = build_stopping_criteria(options, t0)
    check(Request(input_ids, options, max_length, processors, criteria, fill=fill_token_id,
                  trace=StepTrace(False, False), rows=rows, removal=False))
    return processors


def captures(device: torch.device) -> bool:
    """Whether steps on ``device`` are captured in CUDA graphs (elsewhere they run uncaptured)."""
    return device.type == "cuda"


def keeps_steps(capture: bool) -> bool:
    """Whether a call's step is kept for later calls (``reuse.py``): where it is captured (a kept uncaptured step
    would only save allocations)."""
    return capture


def _strategy(options: SearchOptions, input_ids: torch.Tensor, rows: int, max_length: int, fill: int,
              processors: list, real: torch.Tensor) -> Any:
    if options.num_beams > 1:
        return GraphBeamSearch(input_ids, rows, max_length, processors, eos_token_id=options.eos_token_id,
                               fill_token_id=fill, length_penalty=options.length_penalty,
                               early_stopping=options.early_stopping,
                               num_return_sequences=options.num_return_sequences, real=real)
    return GraphGreedy(input_ids, rows, max_length, processors, eos_token_id=options.eos_token_id,
                       pad_token_id=fill, length_penalty=options.length_penalty, real=real)


def run_steps(step: WholeStep, runner: StepRunner, steps: int, every: int, first_logits: Any = None) -> int:
    """Run up to ``steps`` steps of ``step`` through ``runner`` (the first from the prompt's logits ``[N, V]``,
    eagerly, where given); returns how many ran. Reads the flags every ``every`` steps and after the last.

    Raises:
        SearchError: from the flags (a step's scores held NaN).
    """
    done, going = 0, steps > 0
    if first_logits is not None and going:  # decoder-only: the prompt's logits make the first step
        parents = step.search.select(first_logits)
        if parents is not None:
            step.model.reorder(parents)
        done, going = 1, step.search.flags.read()
    while going and done < steps:
        runner()
        done += 1
        if done % every == 0 or done == steps:
            going = step.search.flags.read()
    return done
