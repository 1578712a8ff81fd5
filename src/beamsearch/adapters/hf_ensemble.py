"""An ensemble of Hugging Face models decoded as one: ``search_ensemble([model_a, model_b], input_ids, ...)``.

Every model is prepared exactly as :func:`beamsearch.generate` prepares one (its own encoder run, cache and
masks); the generation options and defaults come from the first model's generation config. The models must
share the tokenizer: the same target vocabulary and the same decoder start tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..engine import search
from ..ensemble import ensemble_step
from ..hf_compat import warn_if_untested
from ..results import SearchResult
from ..steps.chooser import model_step
from .hf_inputs import REJECTED_ARGUMENTS, prepare
from .hf_options import fill_token, options_from_config, pop_search_arguments
from .hf_peft import base_model

warn_if_untested()  # once, naming the tested releases, where another is installed


@torch.no_grad()
def search_ensemble(
    models: Sequence[Any],
    inputs: torch.Tensor | None = None,
    generation_config: Any = None,
    *,
    mode: str = "log",
    weights: Sequence[float] | None = None,
    **kwargs: Any,
) -> SearchResult:
    """Decode with several Hugging Face models at once (see :func:`beamsearch.ensemble.ensemble_step`).

    Args:
        models: the models, all encoder-decoder or all decoder-only, with one target vocabulary.
        inputs, generation_config, **kwargs: as for ``model.generate`` (``input_ids``, ``attention_mask``,
            ``num_beams``, ...), applied to every model.
        mode: "log" (mean of log-probabilities, OpenNMT-py) or "prob" (mean of probabilities, fairseq).
        weights: one weight per model; default equal.

    Returns:
        A :class:`~beamsearch.SearchResult`.
    """
    models = [base_model(m, kwargs) for m in models]  # PeftModels: their base models with the adapter layers
    if not models:
        raise ValueError("search_ensemble needs at least one model")
    kinds = {bool(m.config.is_encoder_decoder) for m in models}
    if len(kinds) > 1:
        raise ValueError("an ensemble must be all encoder-decoder or all decoder-only models")
    for name in (*REJECTED_ARGUMENTS, "max_rows"):
        if kwargs.get(name) is not None:
            raise ValueError(f"argument {name!r} is not supported with an ensemble")
    search_arguments, lean, toolkit = pop_search_arguments(kwargs)
    if lean.pop("cuda_graphs"):
        raise ValueError("cuda_graphs=True is not supported with an ensemble")
    setups = [prepare(model, inputs, generation_config, dict(kwargs)) for model in models]
    first = setups[0]
    for i, setup in enumerate(setups[1:], 1):
        if not torch.equal(setup["input_ids"], first["input_ids"]):
            raise ValueError(f"ensemble model {i} starts decoding from other tokens than model 0 (decoder start "
                             "token or prompt): the models must share the tokenizer")
    config = first["generation_config"]
    options = options_from_config(config, toolkit, first["has_default_max_length"])
    if options.coverage_penalty != "none":
        raise ValueError("coverage penalties are not supported with an ensemble")
    members = [model_step(m, s["model_kwargs"], s["generation_config"], options,
                           search_arguments["output_alignments"], **lean) for m, s in zip(models, setups, strict=True)]
    step = ensemble_step([member_step for member_step, _ in members], mode, weights)
    return search(
        step,
        first["input_ids"],
        tuple(state for _, state in members),
        padding_lengths=first["padding_lengths"],
        source_lengths=first["source_lengths"],
        options=options,
        fill_token_id=fill_token(config, options),
        **search_arguments,
    )
