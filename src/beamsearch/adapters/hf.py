"""Hugging Face transformers models: a drop-in ``generate(model, **same kwargs as model.generate)``.

This module runs a call: :mod:`.hf_inputs` prepares the inputs as ``model.generate`` does (the model's own
preparation methods, in its order), :mod:`.hf_options` translates the generation config and the call's
arguments into search options, :mod:`beamsearch.steps.chooser` picks the step (the fast T5 step, a lean T5 / GPT-2
/ Llama step, or the generic one), and :func:`beamsearch.search` decodes; ``max_rows`` splits the batch into
sub-batches here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..engine import search
from ..errors import SearchError
from ..graphs.driver import captures, graph_search
from ..hf_compat import generate_rows_reason, generation_config_for, warn_if_untested
from ..options import MAX_NODES, TOOLKIT_OPTIONS
from ..results import SearchResult, concatenate
from ..steps.chooser import check_graph_call, fast_call_reason, fast_refusal, graph_call_reason, model_step
from ..steps.t5.fast import fast_encoder
from ..steps.t5.packed import one_check_per_call
from ..streaming import streamer_listener
from .hf_inputs import REJECTED_ARGUMENTS, encode_as_generate, prepare
from .hf_options import fill_token, options_from_config, pop_search_arguments
from .hf_outputs import to_hf_output
from .hf_peft import base_model

LOG = logging.getLogger("beamsearch")

warn_if_untested()  # once, naming the tested releases, where another is installed


@torch.no_grad()
def generate(
    model: Any,
    inputs: torch.Tensor | None = None,
    generation_config: Any = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    **kwargs: Any,
):
    """Generate like ``model.generate(...)`` with the same arguments, returning the same types.

    Returns the sequences tensor ``[B*n, T]``, or with ``return_dict_in_generate=True`` the same
    output class as transformers (``sequences``, ``sequences_scores``, ``scores``, ``logits``,
    ``beam_indices``).

    By default the prompt and encoder run once per example, lean steps keep their own caches and finished
    examples leave the batch: tokens are transformers' (but where its own choice is a near tie), scores equal to
    float precision. ``exact_parity=True`` runs every forward on transformers' rows and shapes instead, so that
    on the same machine (and thread count, torch and transformers versions) every output is bit for bit
    transformers'; it cannot be combined with ``lean_step``, ``compile_step``, ``share_encoder_state``,
    ``max_rows`` or ``remove_finished=True``.

    ``streamer=`` (transformers' ``TextStreamer``, ``TextIteratorStreamer``, or any object with ``put`` and ``end``)
    works with beam search too: after the start tokens it is given the best hypothesis' committed prefix as it
    becomes final (:mod:`beamsearch.streaming`); one example per call, as in transformers.

    Raises:
        ValueError: an argument or generation option we do not implement (named in the message).
    """
    model = base_model(model, kwargs)  # a PeftModel: its base model with the adapter layers
    with one_check_per_call():
        result, config, options = _run(model, inputs, generation_config, logits_processor, stopping_criteria, kwargs)
    return to_hf_output(model, config, options, result)


@torch.no_grad()
def search_model(
    model: Any,
    inputs: torch.Tensor | None = None,
    generation_config: Any = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    **kwargs: Any,
) -> SearchResult:
    """Like :func:`generate` (same arguments and semantics), but returns the full :class:`SearchResult`.

    The result carries per-token log-probs, lengths and finish reasons. For encoder-decoder models
    its sequences start with the decoder start token; for decoder-only models, with the prompt.
    """
    model = base_model(model, kwargs)
    with one_check_per_call():
        return _run(model, inputs, generation_config, logits_processor, stopping_criteria, kwargs)[0]


def _run(model, inputs, generation_config, logits_processor, stopping_criteria, kwargs):
    max_rows = kwargs.pop("max_rows", None)
    if max_rows is not None and kwargs.get("exact_parity"):
        raise ValueError("exact_parity=True cannot be combined with max_rows: sub-batches run on other row counts "
                         "than transformers")
    streamer = kwargs.pop("streamer", None)
    if max_rows is not None and streamer is not None:
        raise ValueError("streamer cannot be combined with max_rows (a streamer takes one example)")
    if max_rows is not None:
        return _run_in_sub_batches(model, inputs, generation_config, logits_processor, stopping_criteria, kwargs,
                                   max_rows)
    for name in REJECTED_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise ValueError(f"generate() argument {name!r} is not supported by beamsearch")
    if kwargs.pop("trust_remote_code", None):
        raise ValueError("beamsearch never enables trust_remote_code")
    search_arguments, lean, toolkit = pop_search_arguments(kwargs)
    search_arguments["trace"] = kwargs.pop("trace", False)  # the search trace (beamsearch.trace), beam search only
    cuda_graphs = lean.pop("cuda_graphs")  # the graph path's own driver (beamsearch.graphs), chosen here
    exact = lean["exact_parity"]
    if exact:
        if toolkit.get("remove_finished"):
            raise ValueError("exact_parity=True keeps every row to the end: it cannot be combined with "
                             "remove_finished=True")
        toolkit["remove_finished"] = False
    rows_reason = generate_rows_reason(model)
    if rows_reason is not None and not exact:  # decoded on generate's rows, as exact_parity=True decodes
        if toolkit.get("remove_finished"):
            raise ValueError(f"remove_finished=True cannot decode {type(model).__name__}: {rows_reason}")
        toolkit["remove_finished"] = False
        if not (lean["lean_step"] or lean["compile_step"] or lean["share_encoder_state"]):
            lean["exact_parity"] = True  # (a lean option given names its own refusal)
    # the fast T5 step (and so its encoder) where the options and the model (its gate) allow it: decided once
    fast_reason = "cuda_graphs=True" if cuda_graphs else fast_refusal(model, **lean)
    if lean["lean_step"] == "fast" and fast_reason is not None and not cuda_graphs:  # the graph path refuses it
        raise ValueError(f"lean_step='fast' cannot run this call: {fast_reason}")
    setup = prepare(model, inputs, generation_config, kwargs, encode=None if fast_reason else fast_encoder(model))
    config = setup["generation_config"]
    options = options_from_config(config, toolkit, setup["has_default_max_length"])
    needs_attention = options.coverage_penalty != "none" or search_arguments["output_alignments"]
    if fast_reason is None:
        fast_reason = fast_call_reason(model, setup["model_kwargs"], needs_attention, gated=True)
        if setup["fast_encoded"] and lean["lean_step"] is None and fast_reason is not None:
            encode_as_generate(model, setup)  # the step falls back to one that takes the model's own encoder output
    graph_arguments = {**search_arguments, "stream_to": streamer}
    if cuda_graphs:  # what a captured step cannot run is refused before anything is decoded
        check_graph_call(options, graph_arguments, lean, logits_processor, stopping_criteria)
    elif cuda_graphs is None:  # the default: the graph path on CUDA where the call and the model allow it
        cuda_graphs = fast_reason is not None and _graphs_by_default(model, setup, options, graph_arguments, lean,
                                                                     logits_processor, stopping_criteria)

    def run(run_options: Any, arguments: dict[str, Any]) -> SearchResult:
        if cuda_graphs:
            return graph_search(model, setup, config, run_options, fill_token(config, run_options),
                                logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                arguments=arguments, step_options=lean)
        step, state = model_step(model, setup["model_kwargs"], config, run_options, needs_attention, **lean,
                                 fast=fast_reason is None)
        return search(
            step,
            setup["input_ids"],
            state,
            logits_processor=list(logits_processor or ()),
            stopping_criteria=list(stopping_criteria or ()),
            padding_lengths=setup["padding_lengths"],
            source_lengths=setup["source_lengths"],
            encoder_input_ids=setup["encoder_input_ids"],
            options=run_options,
            fill_token_id=fill_token(config, run_options),
            **arguments,
        )

    if streamer is not None:
        streamer.put(setup["input_ids"].cpu())  # the start tokens first, as transformers does
        search_arguments["stream_to"] = streamer_listener(streamer)
    if options.exact_search and search_arguments.get("incumbent") is None:
        # exact search starts from the best of a search with the same options (num_beams as given), its threshold
        beam = dataclasses.replace(options, exact_search=False, max_nodes=MAX_NODES)
        search_arguments["incumbent"] = run(beam, {**search_arguments, "incumbent": None, "stream_to": None,
                                                       "trace": False})
    result = run(options, search_arguments)
    if streamer is not None:
        streamer.end()
    return result, config, options


def _graphs_by_default(model, setup, options, arguments, lean, logits_processor, stopping_criteria) -> bool:
    """Whether a call without ``cuda_graphs`` runs the graph path: on CUDA, where it can run the call
    (``steps/chooser.graph_call_reason``); else the eager path, saying why at debug level."""
    if not captures(setup["input_ids"].device):
        return False
    reason = graph_call_reason(model, setup, options, arguments, lean, logits_processor, stopping_criteria)
    if reason is not None:
        LOG.debug("beamsearch.generate: the graph path (CUDA graphs) does not run this call: %s", reason)
    return reason is None


def _run_in_sub_batches(model, inputs, generation_config, logits_processor, stopping_criteria, kwargs, max_rows):
    """The memory cap: decode consecutive sub-batches of whole examples with at most ``max_rows`` rows each.

    Examples do not depend on their batch-mates (tested), so the results equal one run over the batch:
    tokens equal, scores to float precision; sampling draws from the random stream sub-batch by sub-batch.
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be an integer >= 1, got {max_rows!r}")
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("max_rows needs input_ids as a [B, t] tensor")
    per_example = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in ("input_ids",)}
    if set(per_example) - {"attention_mask"}:
        raise ValueError(f"max_rows supports input_ids and attention_mask, not {sorted(set(per_example))}")
    probe = {k: v for k, v in kwargs.items() if k not in TOOLKIT_OPTIONS and not isinstance(v, torch.Tensor)}
    config = generation_config_for(model, generation_config, probe)
    if config.return_dict_in_generate and (config.output_scores or config.output_logits):
        raise ValueError("max_rows cannot be combined with output_scores / output_logits (per-step tensors)")
    semantics = kwargs.get("semantics") or "hf"
    beams = config.num_beams or (2 if semantics == "ct2" else 5 if semantics == "onmt" else 1)
    rows = beams if beams > 1 else (config.num_return_sequences or 1)
    step = max(1, max_rows // rows)
    outputs = []
    for start in range(0, ids.shape[0], step):
        chunk = dict(kwargs)
        chunk.pop("input_ids", None)
        if "attention_mask" in chunk:
            chunk["attention_mask"] = kwargs["attention_mask"][start : start + step]
        if chunk.get("prefix_allowed_tokens_fn") is not None:  # batch ids of the whole batch, not of the chunk
            first = start * rows // beams  # batch_id is row // num_beams, as in transformers
            chunk["prefix_allowed_tokens_fn"] = _shift_batch_ids(kwargs["prefix_allowed_tokens_fn"], first)
        if chunk.get("target_prefix") is not None:
            chunk["target_prefix"] = kwargs["target_prefix"][start : start + step]
        try:
            with one_check_per_call():  # each sub-batch checks the weights again (the user's code ran between)
                outputs.append(_run(model, ids[start : start + step], generation_config, logits_processor,
                                    stopping_criteria, chunk))
        except SearchError as e:  # name the example by its index in the whole batch
            raise e.shifted(start) from None
    _, config, options = outputs[-1]
    result = concatenate([r for r, _, _ in outputs], fill_token(config, options), rows)
    return result, config, options


def _shift_batch_ids(fn: Any, first: int) -> Any:
    """``prefix_allowed_tokens_fn`` for a sub-batch whose first ``batch_id`` is ``first`` in the whole batch."""

    def shifted(batch_id: int, tokens: torch.Tensor) -> Any:
        return fn(batch_id + first, tokens)

    return shifted
