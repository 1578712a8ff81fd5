"""Hugging Face transformers models: a drop-in ``generate(model, **same kwargs as model.generate)``.

The model's own preparation methods (generation config merging, special tokens, attention masks,
encoder run, decoder start tokens, cache creation, ``prepare_inputs_for_generation``) are called
in the order ``model.generate`` calls them, so every model family keeps its quirks; the search
itself (processors, strategy, stopping) is ours. The encoder runs once per example; the KV cache
is reused across steps and reordered through the cache's own ``reorder_cache``.

Legend: B batch, K rows per example, N = B*K, V vocabulary, t tokens so far.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

import torch

from ..engine import search
from ..errors import SearchError
from ..options import TOOLKIT_OPTIONS, UNSUPPORTED_OPTIONS, SearchOptions, apply_preset, is_neutral
from ..results import SearchResult, concatenate
from .hf_gpt2 import LeanGPT2State, lean_gpt2_reason, lean_gpt2_step
from .hf_llama import LeanLlamaState, lean_llama_reason, lean_llama_step
from .hf_outputs import to_hf_output
from .hf_t5 import LeanT5State, lean_t5_reason, lean_t5_step

# generate() arguments that change results and that we do not implement.
_REJECTED_ARGUMENTS = (
    "assistant_model",
    "assistant_tokenizer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "synced_gpus",
    "streamer",
)
_SEARCH_FIELDS = tuple(f.name for f in dataclasses.fields(SearchOptions))


class HFState:
    """The model kwargs of a Hugging Face model between steps: cache, masks, encoder outputs.

    The first ``reorder(index)`` (the expansion of the B examples to their beams) is deferred until
    the prefill has run once per example; then the cache and every row-indexed tensor (rows first;
    3-d ``position_ids`` on dim 1) are expanded. Every later reorder only permutes rows within an
    example, so what is equal across an example's beams (encoder outputs, its mask, the
    cross-attention keys and values) keeps its order and only the self-attention cache and the
    decoder-side tensors are gathered, unless the index has fewer rows (finished examples left the
    batch): then everything row-indexed is gathered.
    """

    def __init__(self, model: Any, model_kwargs: dict[str, Any], generation_config: Any, exact: bool = False):
        self.model = model
        self.model_kwargs = model_kwargs
        self.generation_config = generation_config
        self.exact = exact  # exact_parity: every row computed as transformers computes it (see generate)
        self.prefilled = False
        self.expansion: torch.Tensor | None = None  # [N] example of each row, until the prefill applies it
        self.rows: int | None = None  # rows in the cache and tensors, once prefilled
        self.return_attention = False  # coverage penalties: also return the last layer's cross-attention

    def reorder(self, index: torch.Tensor) -> HFState:
        if not self.prefilled and not self.exact:
            self.expansion = index if self.expansion is None else self.expansion.index_select(0, index)
            return self
        within_examples = index.shape[0] == self.rows and not self.exact
        self.rows = index.shape[0]
        self._gather(index, within_examples=within_examples)
        return self

    def _gather(self, index: torch.Tensor, within_examples: bool) -> None:
        for key, value in list(self.model_kwargs.items()):
            if key == "cache_position" or value is None:
                continue
            if hasattr(value, "reorder_cache"):
                if value.get_seq_length() > 0:
                    if within_examples and hasattr(value, "self_attention_cache"):
                        value.self_attention_cache.reorder_cache(index)
                    else:
                        value.reorder_cache(index)
            elif key == "encoder_outputs":
                if within_examples or (self.exact and self.prefilled):  # the cross-attention cache holds them
                    continue
                for name, tensor in list(value.items()):
                    if isinstance(tensor, torch.Tensor):
                        value[name] = tensor.index_select(0, index)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                if within_examples and key == "attention_mask" and self.model.config.is_encoder_decoder:
                    continue
                dim = 1 if key == "position_ids" and value.dim() == 3 else 0
                self.model_kwargs[key] = value.index_select(dim, index)


def hf_step(tokens: torch.Tensor, state: HFState) -> tuple[torch.Tensor, HFState]:
    """One forward of the model on the new tokens (the whole prompt first, then one token with the cache).

    The prompt is run once per example (its beams' rows are identical then), and the results are
    expanded to the beams afterwards; with ``exact_parity`` the state is expanded first and the prompt runs on
    every row, as in transformers.
    """
    model, kwargs = state.model, state.model_kwargs
    expansion = None
    if not state.prefilled:
        expansion = state.expansion
        if expansion is not None:
            first = torch.searchsorted(expansion, torch.arange(int(expansion.max()) + 1, device=expansion.device))
            tokens = tokens.index_select(0, first)  # one row per example
        outputs = model._prefill(tokens, state.generation_config, kwargs)
        state.prefilled = True
    else:
        next_length = 1 if kwargs.get("use_cache", True) else None
        inputs = model.prepare_inputs_for_generation(tokens, next_sequence_length=next_length, **kwargs)
        outputs = model(**inputs, return_dict=True)
    state.model_kwargs = model._update_model_kwargs_for_generation(
        outputs, kwargs, is_encoder_decoder=model.config.is_encoder_decoder
    )
    logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32, device=tokens.device)  # [rows, V]
    attention = None
    if state.return_attention:
        attention = outputs.cross_attentions[-1][:, :, -1, :].mean(dim=1).float()  # [rows, S], heads averaged
    if expansion is not None:
        state._gather(expansion, within_examples=False)
        logits = logits.index_select(0, expansion.to(logits.device))  # [N, V]
        attention = None if attention is None else attention.index_select(0, expansion.to(attention.device))
    state.rows = logits.shape[0]
    return (logits, state) if attention is None else (logits, state, attention)


hf_step.fresh_logits = True  # a copy of the model's output (see loop.decode)


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

    Raises:
        ValueError: an argument or generation option we do not implement (named in the message).
    """
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
    return _run(model, inputs, generation_config, logits_processor, stopping_criteria, kwargs)[0]


def _run(model, inputs, generation_config, logits_processor, stopping_criteria, kwargs):
    max_rows = kwargs.pop("max_rows", None)
    if max_rows is not None and kwargs.get("exact_parity"):
        raise ValueError("exact_parity=True cannot be combined with max_rows: sub-batches run on other row counts "
                         "than transformers")
    if max_rows is not None:
        return _run_in_sub_batches(model, inputs, generation_config, logits_processor, stopping_criteria, kwargs,
                                   max_rows)
    for name in _REJECTED_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise ValueError(f"generate() argument {name!r} is not supported by beamsearch")
    if kwargs.pop("trust_remote_code", None):
        raise ValueError("beamsearch never enables trust_remote_code")
    search_arguments, lean, toolkit = _pop_search_arguments(kwargs)
    exact = lean["exact_parity"]
    if exact:
        if toolkit.get("remove_finished"):
            raise ValueError("exact_parity=True keeps every row to the end: it cannot be combined with "
                             "remove_finished=True")
        toolkit["remove_finished"] = False
    setup = _prepare(model, inputs, generation_config, kwargs)
    config = setup["generation_config"]
    options = _options_from_config(config, toolkit, setup["has_default_max_length"])
    needs_attention = options.coverage_penalty != "none" or search_arguments["output_alignments"]
    step, state = _model_step(model, setup["model_kwargs"], config, options, needs_attention, **lean)
    result = search(
        step,
        setup["input_ids"],
        state,
        logits_processor=list(logits_processor or ()),
        stopping_criteria=list(stopping_criteria or ()),
        padding_lengths=setup["padding_lengths"],
        source_lengths=setup["source_lengths"],
        encoder_input_ids=setup["encoder_input_ids"],
        options=options,
        fill_token_id=_fill_token(config, options),
        **search_arguments,
    )
    return result, config, options


def _compile_options() -> dict[str, Any]:
    """Inductor options for ``compile_step``: its C++ kernels use the vector width ``ATEN_CPU_CAPABILITY`` asks
    ATen for. Inductor picks the CPU's widest ISA on its own while its vector headers follow ATen's capability;
    with torch 2.13 the mismatch fails to compile (``default``: ``at::vec`` not declared) or, worse, computes
    garbage (``avx2`` on an AVX-512 CPU: scores off by 1e24)."""
    width = {"default": 1, "avx2": 256, "avx512": 512}.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    return {"options": {"cpp.simdlen": width}} if width else {}


def _pop_search_arguments(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Take the arguments that are ours, not transformers', out of ``kwargs``.

    Returns the keyword arguments for :func:`beamsearch.search`, those for the model step (``lean_step``,
    ``share_encoder_state``, ``compile_step``, ``exact_parity``) and the other toolkits' options.
    """
    exact = kwargs.pop("exact_parity", False)
    if not isinstance(exact, bool):
        raise ValueError(f"exact_parity must be True or False, got {exact!r}")
    search_arguments = {
        "tokenizer": kwargs.pop("tokenizer", None),
        "prefix_allowed_tokens_fn": kwargs.pop("prefix_allowed_tokens_fn", None),
        "target_prefix": kwargs.pop("target_prefix", None),
        "prefix_bias_beta": kwargs.pop("prefix_bias_beta", 0.0),
        "output_alignments": bool(kwargs.pop("output_alignments", False)),
        "force_words_ids": kwargs.pop("force_words_ids", None),
        **{name: kwargs.pop(name) for name in ("sequence_scorer", "unique") if name in kwargs},
    }
    lean = {"lean_step": kwargs.pop("lean_step", None),
            "share_encoder_state": kwargs.pop("share_encoder_state", False),
            "compile_step": kwargs.pop("compile_step", False), "exact_parity": exact}
    toolkit = {name: kwargs.pop(name) for name in TOOLKIT_OPTIONS if name in kwargs}
    return search_arguments, lean, toolkit


def _model_step(model, model_kwargs, config, options, needs_attention, lean_step=None, share_encoder_state=False,
                compile_step=False, exact_parity=False):
    """The step function and state: a lean step (T5, GPT-2, Llama) where one applies (``lean_step`` None or True),
    else the generic one that calls ``model(...)``. ``share_encoder_state`` (lean T5 step only): an example's beams
    attend to its cross-attention keys and values in one kernel call (not bitwise). ``compile_step``: the lean
    step's decoder runs under ``torch.compile`` (``True``: dynamic shapes; ``"static"``: the fixed-shape step, the
    same shapes at every step). ``exact_parity``: the generic step on transformers' rows (prompt and cache on every
    beam's row, the whole cache reordered), so that each forward has the shapes of ``model.generate``'s."""
    if lean_step is not None and not isinstance(lean_step, bool):
        raise ValueError(f"lean_step must be None, True or False, got {lean_step!r}")
    if not isinstance(share_encoder_state, bool):
        raise ValueError(f"share_encoder_state must be True or False, got {share_encoder_state!r}")
    if not isinstance(compile_step, bool) and compile_step != "static":
        raise ValueError(f"compile_step must be True, False or 'static', got {compile_step!r}")
    fixed_shape = compile_step == "static"
    if exact_parity:
        for name, value in (("lean_step", lean_step), ("share_encoder_state", share_encoder_state),
                            ("compile_step", compile_step)):
            if value:
                raise ValueError(f"exact_parity=True runs the generic step as transformers does: it cannot be "
                                 f"combined with {name}={value!r}")
        lean_step = False
    if lean_step is False:
        reason = "lean_step=False was given"
    else:
        step, state, reason = _lean_step(model, model_kwargs, config, options, needs_attention, share_encoder_state,
                                         fixed_shape)
        if reason is None:
            if compile_step:
                state.decode = torch.compile(state.decode, dynamic=None if fixed_shape else True,
                                             **_compile_options())
            return step, state
    if share_encoder_state:
        raise ValueError(f"share_encoder_state=True needs the lean T5 step, which cannot run this call: {reason}")
    if compile_step:
        raise ValueError(f"compile_step={compile_step!r} needs a lean step (T5, GPT-2, Llama), which cannot run this "
                         f"call: {reason}")
    if lean_step:
        raise ValueError(f"lean_step=True cannot run this call: {reason}")
    state = HFState(model, model_kwargs, config, exact=exact_parity)
    if needs_attention:
        _request_cross_attention(model, state)
    return hf_step, state


def _lean_step(model, model_kwargs, config, options, needs_attention, share_encoder_state, fixed_shape=False):
    """The lean step and its state for this model and call: ``(step, state, None)``, or ``(None, None, why not)``.
    ``fixed_shape``: the state's ``decode`` takes the position as a tensor (``compile_step="static"``)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type == "gpt2" and not share_encoder_state:
        reason = lean_gpt2_reason(model, model_kwargs, needs_attention)
        if reason is None:
            state = LeanGPT2State(model, model_kwargs, config, options.max_length, fixed_shape=fixed_shape)
            return lean_gpt2_step, state, None
    elif model_type == "llama" and not share_encoder_state:
        reason = lean_llama_reason(model, model_kwargs, needs_attention)
        if reason is None:
            state = LeanLlamaState(model, model_kwargs, config, options.max_length, fixed_shape=fixed_shape)
            return lean_llama_step, state, None
    else:
        reason = lean_t5_reason(model, model_kwargs, needs_attention)
        if reason is None:
            encoded = model_kwargs["encoder_outputs"].last_hidden_state
            state = LeanT5State(model, encoded, model_kwargs.get("attention_mask"), options.max_length,
                                share_encoder_state=share_encoder_state, fixed_shape=fixed_shape)
            return lean_t5_step, state, None
    return None, None, reason


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
    config, _ = model._prepare_generation_config(generation_config, **probe)
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
            outputs.append(_run(model, ids[start : start + step], generation_config, logits_processor,
                                stopping_criteria, chunk))
        except SearchError as e:  # name the example by its index in the whole batch
            raise e.shifted(start) from None
    _, config, options = outputs[-1]
    result = concatenate([r for r, _, _ in outputs], _fill_token(config, options), rows)
    return result, config, options


def _shift_batch_ids(fn: Any, first: int) -> Any:
    """``prefix_allowed_tokens_fn`` for a sub-batch whose first ``batch_id`` is ``first`` in the whole batch."""

    def shifted(batch_id: int, tokens: torch.Tensor) -> Any:
        return fn(batch_id + first, tokens)

    return shifted


def _prepare(model: Any, inputs: Any, generation_config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Everything ``model.generate`` does before its decoding loop, except expanding to beams."""
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _check_config(config)
    model._validate_model_kwargs(model_kwargs.copy())
    kwargs_has_attention_mask = model_kwargs.get("attention_mask", None) is not None
    inputs_tensor, input_name, model_kwargs = model._prepare_model_inputs(inputs, config.bos_token_id, model_kwargs)
    if input_name != "input_ids":
        raise ValueError(f"beamsearch.generate needs token ids as input, got {input_name!r}")
    batch_size = inputs_tensor.shape[0]
    model._prepare_special_tokens(config, kwargs_has_attention_mask, device=inputs_tensor.device, batch_size=batch_size)
    is_encoder_decoder = model.config.is_encoder_decoder
    forward_args = set(inspect.signature(model.forward).parameters)
    if not kwargs_has_attention_mask and not is_encoder_decoder and "attention_mask" in forward_args:
        model_kwargs["attention_mask"] = model._prepare_attention_mask_for_generation(
            inputs_tensor, config, model_kwargs
        )
    if model_kwargs.get("position_ids") is None and "position_ids" in forward_args and not is_encoder_decoder:
        model_kwargs["position_ids"] = model._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)
    source_mask = model_kwargs.get("attention_mask")
    if source_mask is not None:
        source_lengths = (source_mask != 0).sum(dim=1)
    else:
        source_lengths = torch.full((batch_size,), inputs_tensor.shape[1], device=inputs_tensor.device)
    mask = model_kwargs.get("decoder_attention_mask" if is_encoder_decoder else "attention_mask")
    padding_lengths = (mask != 0).int().argmax(dim=1) if mask is not None else None
    if not is_encoder_decoder and "attention_mask" in forward_args and (model_kwargs["attention_mask"] == 1).all():
        config._mask_length = model_kwargs["attention_mask"].shape[1]
        model_kwargs["attention_mask"] = None
    if model_kwargs.get("encoder_outputs") is None:
        model_kwargs = model._maybe_prepare_encoder_kwargs_for_generation(
            inputs_tensor, model_kwargs, input_name, config
        )
    if is_encoder_decoder:
        input_ids, model_kwargs = model._prepare_decoder_input_ids_for_generation(
            batch_size=batch_size,
            model_input_name=input_name,
            model_kwargs=model_kwargs,
            decoder_start_token_id=config._decoder_start_token_tensor,
            device=inputs_tensor.device,
        )
    else:
        input_ids = inputs_tensor
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name=input_name,
        inputs_tensor=inputs_tensor,
        input_ids_length=input_ids.shape[1],
    )
    if model._supports_logits_to_keep() and "logits_to_keep" not in model_kwargs:
        model_kwargs["logits_to_keep"] = 1
    model._validate_generated_length(config, input_ids.shape[1], has_default_max_length)
    mode = config.get_generation_mode()
    model._prepare_cache_for_generation(config, model_kwargs, mode, batch_size, config.max_length - 1)
    model_kwargs["use_cache"] = config.use_cache
    return {
        "generation_config": config,
        "model_kwargs": model_kwargs,
        "input_ids": input_ids,
        "padding_lengths": padding_lengths,
        "source_lengths": source_lengths,
        "encoder_input_ids": inputs_tensor if inputs_tensor.dim() == 2 and not (inputs_tensor < 0).any() else None,
        "has_default_max_length": has_default_max_length,
    }


def _request_cross_attention(model: Any, state: HFState) -> None:
    """Coverage penalties and alignments need the decoder's attention over the source at every step."""
    if not model.config.is_encoder_decoder:
        raise ValueError("coverage_penalty / output_alignments need an encoder-decoder model (attention over a "
                         "source)")
    implementation = getattr(model.config, "_attn_implementation", "eager")
    if implementation != "eager":
        raise ValueError(
            f"coverage_penalty / output_alignments need attention weights, which {implementation!r} attention "
            "does not return: "
            "load the model with attn_implementation='eager'"
        )
    state.model_kwargs["output_attentions"] = True
    state.return_attention = True


def _check_config(config: Any) -> None:
    """Reject any generation option that would change results and that we do not implement."""
    for name in UNSUPPORTED_OPTIONS:
        if not is_neutral(name, getattr(config, name, None)):
            raise ValueError(f"generation option {name!r} is not supported by beamsearch (it would change results)")
    if getattr(config, "cache_implementation", None) not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={config.cache_implementation!r} is not supported by beamsearch")


def _options_from_config(
    config: Any, toolkit: dict[str, Any] | None = None, default_max_length: bool = False
) -> SearchOptions:
    values = {name: getattr(config, name) for name in _SEARCH_FIELDS if hasattr(config, name)}
    values.update(toolkit or {})
    if default_max_length and values.get("max_new_tokens") is None and values.get("semantics") not in (None, "hf"):
        values["max_length"] = None  # transformers' default limit gives way to the toolkit preset's
    values["eos_token_id"] = _token_list(config._eos_token_tensor)
    values["pad_token_id"] = _token_int(config._pad_token_tensor)
    values["bos_token_id"] = _token_int(config._bos_token_tensor)
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


def _fill_token(config: Any, options: SearchOptions) -> int:
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
