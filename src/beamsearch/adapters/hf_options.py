"""Option translation for the Hugging Face adapter: a merged ``GenerationConfig`` and the call's own keyword
arguments to :class:`beamsearch.SearchOptions` and :func:`beamsearch.search` arguments."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..hf_compat import special_token, version
from ..options import TOOLKIT_OPTIONS, SearchOptions, apply_preset

_SEARCH_FIELDS = tuple(f.name for f in dataclasses.fields(SearchOptions))




def pop_search_arguments(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Take the arguments that are ours, not transformers', out of ``kwargs``.

    Returns the keyword arguments for :func:`beamsearch.search`, those for the model step (``lean_step``,
    ``share_encoder_state``, ``compile_step``, ``exact_parity``, ``cuda_graphs``) and the other toolkits' options.
    """
    exact, graphs = kwargs.pop("exact_parity", False), kwargs.pop("cuda_graphs", None)
    if not isinstance(exact, bool):
        raise ValueError(f"exact_parity must be True or False, got {exact!r}")
    if graphs is not None and not isinstance(graphs, bool):  # None: the graph path where it can run, on CUDA
        raise ValueError(f"cuda_graphs must be None, True or False, got {graphs!r}")
    search_arguments = {
        "tokenizer": kwargs.pop("tokenizer", None),
        "prefix_allowed_tokens_fn": kwargs.pop("prefix_allowed_tokens_fn", None),
        "target_prefix": kwargs.pop("target_prefix", None),
        "prefix_bias_beta": kwargs.pop("prefix_bias_beta", 0.0),
        "output_alignments": bool(kwargs.pop("output_alignments", False)),
        "force_words_ids": kwargs.pop("force_words_ids", None),
        **{name: kwargs.pop(name) for name in ("sequence_scorer", "unique", "incumbent") if name in kwargs},
    }
    lean = {"lean_step": kwargs.pop("lean_step", None),
            "share_encoder_state": kwargs.pop("share_encoder_state", False),
            "compile_step": kwargs.pop("compile_step", False), "exact_parity": exact, "cuda_graphs": graphs}
    toolkit = {name: kwargs.pop(name) for name in TOOLKIT_OPTIONS if name in kwargs}
    return search_arguments, lean, toolkit


def options_from_config(
    config: Any, toolkit: dict[str, Any] | None = None, default_max_length: bool = False
) -> SearchOptions:
    values = {name: getattr(config, name) for name in _SEARCH_FIELDS if hasattr(config, name)}
    values.update(toolkit or {})
    if default_max_length and values.get("max_new_tokens") is None and values.get("semantics") not in (None, "hf"):
        values["max_length"] = None  # transformers' default limit gives way to the toolkit preset's
    values["eos_token_id"] = _token_list(special_token(config, "eos"))
    values["pad_token_id"] = _token_int(special_token(config, "pad"))
    values["bos_token_id"] = _token_int(special_token(config, "bos"))
    if values.get("hf_release") is None:
        values["hf_release"] = version()[:2]  # the installed release's semantics where releases differ
    apply_preset(values)
    if values.get("max_length") is None:
        values["max_length"] = config.max_length
    values["output_scores"] = bool(config.return_dict_in_generate and config.output_scores)
    values["output_logits"] = bool(config.return_dict_in_generate and config.output_logits)
    for name, default in (("min_length", 0), ("top_p", 1.0), ("typical_p", 1.0), ("temperature", 1.0),
                          ("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("epsilon_cutoff", 0.0),
                          ("eta_cutoff", 0.0), ("length_penalty", 1.0), ("early_stopping", False),
                          ("num_beams", 1), ("num_return_sequences", 1), ("do_sample", False),
                          ("renormalize_logits", False), ("remove_invalid_values", False)):
        if values.get(name) is None:
            values[name] = default
    if not values["eos_token_id"]:
        values["min_length"] = 0  # transformers ignores min_length without an eos token
        values["min_new_tokens"] = None
    return SearchOptions.create(**values)


def fill_token(config: Any, options: SearchOptions) -> int:
    """transformers' fill value: pad (or the first eos when pad is 0 or unset) for beams; -1 without eos.

    Diverse beam search fills as transformers 4.x did: with the pad token (the first eos when unset).
    """
    if options.num_beam_groups > 1:
        return options.output_fill_token
    if options.num_beams > 1:
        if not options.eos_token_id:
            return -1
        return options.pad_token_id or options.eos_token_id[0]
    return options.pad_token_id if options.pad_token_id is not None else 0


def _token_list(tensor: Any) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(int(t) for t in tensor.reshape(-1).tolist())


def _token_int(tensor: Any) -> int | None:
    return None if tensor is None else int(tensor.reshape(-1)[0])
