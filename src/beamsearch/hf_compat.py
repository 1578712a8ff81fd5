"""Every use of transformers' private generation API, each with the releases it applies to.

The adapter reproduces ``model.generate`` of the installed transformers release. Its input preparation goes
through ``generate`` itself (public: ``custom_generate=`` takes a callable, 4.57 and every 5.x release), so each
release prepares inputs in its own order with its own helpers; what is left private is the decoding loop's model
calls (the prefill, the next step's inputs, the kwargs update) and a few attributes ``generate`` leaves on the
generation config. Each function below names the releases of each of its branches; a branch is chosen by what the
installed release has (a method, a parameter) where that shows it, else by the release number; the version table in
:data:`BRANCHES` is checked against the installed release by ``tests/test_hf_compat.py``, which ``make
test-transformers`` runs under every tested release (docs/testing.md).

Tested releases: :data:`TESTED_RANGE` (docs/testing.md lists them); importing the adapter under another release
warns once (:func:`warn_if_untested`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch

# the oldest and newest releases the parity and exact-parity tests pass on (make test-transformers)
TESTED_RANGE = ("4.57.0", "5.24.0")

# branch -> the releases that take it (checked by tests/test_hf_compat.py against the installed release)
BRANCHES = {
    "prefill: model._prefill": ">= 5.0",
    "prefill: cache positions + forward (no _prefill)": "4.57",
    # The release's GenerationMixin.prepare_inputs_for_generation decides, never a model's override: Phi3's takes the
    # length through **kwargs, and reading the override's signature (4dcad5c to this fix) gave Phi3 no length on
    # 5.3 - 5.24, so it re-ran its whole sequence on the cache at every step and parted from generate (next_step).
    "next step: prepare_inputs_for_generation(next_sequence_length=)": ">= 5.3",
    "next step: prepare_inputs_for_generation without next_sequence_length": "4.57 - 5.2",
    "beam reorder: every state name (model._reorder_cache, else reorder_cache, else refused)": ">= 5.13",
    "beam reorder: past_key_values only (other states stay in place)": "4.57 - 5.12",
    "Mamba state: MambaCache under cache_params (conv_states, ssm_states)": "4.57 - 5.4",
    "LFM2 cache: lists with empty placeholders (Lfm2HybridConvCache.key_cache)": "4.57 - 5.4",
    "cache keyword: cache": ">= 5.24",
    "cache keyword: past_key_values": "4.57 - 5.23",
    "beam sampling: sampled candidates sorted by score": ">= 5.24",
    "prefix_allowed_tokens_fn: batch_id = row // max(num_beams, num_return_sequences)": ">= 5.24",
    "generation config: use_model_defaults parameter": "4.57",
    "T5 position bias of one query: compute_bias(past_seen_tokens=)": ">= 5.4",
    "T5 position bias of one query: compute_bias(cache_position=)": "4.57 - 5.3",
    "GPT-2 attention scale: attention.scaling": ">= 5.4",
    "GPT-2 attention scale: from config.scale_attn_weights": "4.57 - 5.3",
    "sdpa grouped-query attention: use_gqa_in_sdpa(mask, key, value), else the query packed (pack_gqa)": ">= 5.23",
    "sdpa grouped-query attention: use_gqa_in_sdpa(mask, key, value), else keys and values repeated": "5.13 - 5.22",
    "sdpa grouped-query attention: use_gqa_in_sdpa(mask, key), else keys and values repeated": "4.57 - 5.12",
}


def version() -> tuple[int, ...]:
    """The installed transformers release as integers, e.g. (5, 24, 0)."""
    import transformers

    return _parse(transformers.__version__)


def _parse(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = piece[: len(piece) - len(piece.lstrip("0123456789"))]  # 5.25.0rc1: the leading digits, 0
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def untested_message(installed: str) -> str | None:
    """Why a transformers release is not known to work (outside :data:`TESTED_RANGE`), or None."""
    low, high = (_parse(v) for v in TESTED_RANGE)
    if low[:2] <= _parse(installed)[:2] <= high[:2]:  # patch releases of a tested minor release count as tested
        return None
    return (f"beamsearch's Hugging Face adapter is tested with transformers {TESTED_RANGE[0]} to {TESTED_RANGE[1]} "
            f"(patch releases of those minor releases included); transformers {installed} is installed: generate() "
            f"may fail or differ from model.generate")


@functools.lru_cache(maxsize=1)
def warn_if_untested() -> None:
    """Warn once when the installed transformers is outside :data:`TESTED_RANGE` (the adapter's modules call it as
    they are imported; without transformers it says nothing: the adapter names what is missing when it is used)."""
    try:
        import transformers
    except ImportError:
        return

    message = untested_message(transformers.__version__)
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------- preparation


class _Prepared(Exception):
    """Raised by the capturing decoding method to leave ``generate`` with what it prepared (nothing decoded)."""

    def __init__(self, captured: dict[str, Any]):
        super().__init__("prepared")
        self.captured = captured


def prepare_with_generate(model: Any, inputs: Any, generation_config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the installed release's ``generate`` prepares before it decodes, from ``generate`` itself.

    ``custom_generate=`` given a callable (public API, 4.57 and every 5.x) makes ``generate`` run its whole
    preparation (generation config, special tokens, masks, positions, the encoder, decoder start tokens, lengths,
    the cache, the expansion to beams) and then call it as the decoding method; ours records its arguments and
    leaves. Returns ``input_ids`` ``[B*E, t]``, ``inputs_tensor`` (the encoder's or prompt's ids ``[B, S]``),
    ``generation_config`` and ``model_kwargs`` (expanded to ``E`` rows per example, as ``generate`` expands them).
    """
    from transformers import GenerationMixin

    # generate drops a tokenizer given with custom_generate, so it would refuse stop strings: they are ours to apply
    stop_strings = kwargs.get("stop_strings")
    if stop_strings is None and any(getattr(c, "stop_strings", None) is not None
                                    for c in (generation_config, model.generation_config) if c is not None):
        probe = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor) and k != "encoder_outputs"}
        stop_strings = generation_config_for(model, generation_config, probe).stop_strings
    if stop_strings is not None:
        kwargs = dict(kwargs, stop_strings=None)

    def capture(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                inputs_tensor=None, **model_kwargs):
        raise _Prepared({"input_ids": input_ids, "inputs_tensor": inputs_tensor,
                         "generation_config": generation_config, "model_kwargs": model_kwargs})

    # GenerationMixin's generate, not a model class's override of it (Whisper, MusicGen: another algorithm)
    try:
        GenerationMixin.generate(model, inputs, generation_config=generation_config, custom_generate=capture,
                                 **kwargs)
    except _Prepared as prepared:
        if stop_strings is not None:
            prepared.captured["generation_config"].stop_strings = stop_strings
        return prepared.captured
    raise RuntimeError("transformers' generate returned without calling its decoding method")


def unexpand(model_kwargs: dict[str, Any], examples: int, rows: int) -> dict[str, Any]:
    """``model_kwargs`` with one row per example again: ``generate`` repeats every row-indexed tensor (and the
    encoder outputs) ``rows // examples`` times (``repeat_interleave``), so every ``E``-th row is the example's."""
    if rows == examples:
        return model_kwargs
    every = rows // examples

    def one_per_example(value: Any, key: str = "") -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        dim = 1 if key == "position_ids" and value.dim() == 3 and value.shape[1] == rows else 0
        if value.shape[dim] != rows:
            return value
        return value.index_select(dim, torch.arange(0, rows, every, device=value.device))

    out = {}
    for key, value in model_kwargs.items():
        if key == "encoder_outputs" and value is not None and hasattr(value, "items"):
            for name, tensor in list(value.items()):
                value[name] = one_per_example(tensor)
            out[key] = value
        else:
            out[key] = one_per_example(value, key)
    return out


def generation_config_for(model: Any, generation_config: Any, kwargs: dict[str, Any]) -> Any:
    """The merged generation config ``generate`` would use (without preparing inputs), for ``max_rows``'s probe.

    ``_prepare_generation_config(generation_config, **kwargs)`` (5.0 and later); 4.57 takes ``use_model_defaults``
    as its second parameter.
    """
    parameters = inspect.signature(model._prepare_generation_config).parameters
    if "use_model_defaults" in parameters:  # 4.57
        return model._prepare_generation_config(generation_config, None, **kwargs)[0]
    return model._prepare_generation_config(generation_config, **kwargs)[0]


def special_token(config: Any, name: str) -> torch.Tensor | None:
    """``generate``'s resolved special token tensor (``eos``, ``pad``, ``bos``, ``decoder_start``): the private
    attribute ``_{name}_token_tensor`` its ``_prepare_special_tokens`` sets (4.57 and every 5.x)."""
    return getattr(config, f"_{name}_token_tensor", None)


# ---------------------------------------------------------------------------------------------- the decoding loop


def cache_keyword(model_kwargs: dict[str, Any] | None = None) -> str:
    """The name of the cache among the model kwargs and outputs: ``cache`` (5.24 and later; ``past_key_values``
    deprecated), ``past_key_values`` before."""
    from transformers import GenerationMixin

    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters:
        return "cache"
    return "past_key_values"


def output_cache(outputs: Any) -> Any:
    """The cache a forward returned (``outputs.cache`` from 5.24, ``outputs.past_key_values`` before)."""
    return outputs.get(cache_keyword()) if hasattr(outputs, "get") else getattr(outputs, cache_keyword())


def prefill(model: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict[str, Any]) -> Any:
    """The first forward of the decoding loop, on the whole prompt, as the installed release runs it.

    5.0 and later: ``model._prefill(input_ids, generation_config, model_kwargs)``. 4.57 (no ``_prefill``): the
    loop's ``_get_initial_cache_position`` (it sets ``model_kwargs["cache_position"]`` in place), then the model on
    ``prepare_inputs_for_generation``'s inputs.
    """
    if hasattr(model, "_prefill"):
        return model._prefill(input_ids, generation_config, model_kwargs)
    model._get_initial_cache_position(input_ids.shape[1], input_ids.device, model_kwargs)
    inputs = model.prepare_inputs_for_generation(input_ids, **model_kwargs)
    return model(**inputs, return_dict=True)


def next_step(model: Any, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> Any:
    """A later forward of the decoding loop (one new token per row with the cache).

    5.3 and later: ``prepare_inputs_for_generation(input_ids, next_sequence_length=1 or None, ...)``; before, the
    method derives the new positions from the cache position itself.

    The branch is the release's (:func:`_passes_next_sequence_length`), not the model's: a family's override may take
    the length through ``**kwargs`` (Phi3's does, and forwards it to ``GenerationMixin``'s, which slices the ids with
    it). Read from the override's own signature (as from 4dcad5c, the input-preparation rework), such a model was
    given no length on 5.3 and later: its whole sequence ran again at every step on top of the cache (``[N, t]`` ids
    after ``t - 1`` cached positions, at positions past them, with a mask shorter than the keys), so Phi3 parted from
    ``generate`` from the first steps after the prompt, left-padded rows at once; 4.57 to 5.2 have no such length.
    """
    if _passes_next_sequence_length():
        length = 1 if model_kwargs.get("use_cache", True) else None
        inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=length, **model_kwargs)
    else:
        inputs = model.prepare_inputs_for_generation(input_ids, **model_kwargs)
    return model(**inputs, return_dict=True)


@functools.cache
def _passes_next_sequence_length() -> bool:
    """Whether the installed release's decoding loop passes ``next_sequence_length=`` to every
    ``prepare_inputs_for_generation`` (5.3 and later): ``GenerationMixin``'s own method takes it."""
    from transformers import GenerationMixin

    return "next_sequence_length" in _parameters(GenerationMixin.prepare_inputs_for_generation)


def update_kwargs(model: Any, outputs: Any, model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The loop's model kwargs after a forward (cache, masks, cache positions): ``_update_model_kwargs_for_generation``
    (4.57 and every 5.x)."""
    return model._update_model_kwargs_for_generation(outputs, model_kwargs,
                                                     is_encoder_decoder=model.config.is_encoder_decoder)


# the model kwargs under which the decoding loop keeps a model's state between steps (generate's ALL_CACHE_NAMES, and
# the cache keyword of 5.24)
STATE_NAMES = ("past_key_values", "cache", "cache_params", "state", "mems", "past_buckets_states")

# families whose forwards must see the rows generate gives them (each example's prompt on all its beams' rows, and
# every row to the end): the default runs them as exact_parity=True does
GENERATE_ROWS = {
    "recurrent_gemma": "it keeps its recurrent and convolution states in its modules, sized by the rows of the call's "
                       "prompt, where no reorder reaches them",
    "rwkv": "its one-token step mixes the rows of a batch (its [N, C] state meets [N, 1, C] hidden states), so each "
            "row's logits depend on the others'",
}


def generate_rows_reason(model: Any) -> str | None:
    """Why ``model`` must be decoded on generate's rows (:data:`GENERATE_ROWS`; every release), or None."""
    return GENERATE_ROWS.get(getattr(model.config, "model_type", None))


def select_state_rows(value: Any, index: torch.Tensor) -> Any:
    """A decoding state with the rows ``index`` (the prompt's rows expanded to the beams, or examples leaving the
    batch), whatever holds it:

    - a ``Cache`` (every release): its ``reorder_cache``, plus MiniMax's linear-attention states, which its cache keeps
      beside its layers where ``reorder_cache`` does not reach (``linear_cache``; every release);
    - Mamba's and FalconMamba's ``MambaCache`` under ``cache_params`` (4.57 - 5.4; a ``Cache`` from 5.5): its lists of
      convolution and SSM states, and its batch size;
    - LFM2's hybrid cache of 4.57 - 5.4: its lists of keys, values and convolution states but the empty placeholders
      (4.57's ``reorder_cache`` selects those too, and fails);
    - tensors, and lists and tuples of them (RWKV's ``state``).
    """
    if isinstance(getattr(value, "conv_cache", None), list) and isinstance(getattr(value, "key_cache", None), list):
        for name in ("key_cache", "value_cache", "conv_cache"):  # Lfm2HybridConvCache (4.57 - 5.4): 4.57's
            setattr(value, name, [_rows(state, index) if state.numel() else state  # reorder_cache selects the empty
                                  for state in getattr(value, name)])  # placeholders of other layers too, and fails
        return value
    if hasattr(value, "reorder_cache"):
        value.reorder_cache(index)
        linear = getattr(value, "linear_cache", None)
        if isinstance(linear, list):
            value.linear_cache = [_rows(state, index) for state in linear]
        return value
    if isinstance(getattr(value, "conv_states", None), list) and isinstance(getattr(value, "ssm_states", None), list):
        value.conv_states = _rows(value.conv_states, index)
        value.ssm_states = _rows(value.ssm_states, index)
        value.max_batch_size = index.shape[0]
        return value
    return _rows(value, index)


@functools.cache
def _reorders_every_state() -> bool:
    return version()[:2] >= (5, 13)


def _rows(value: Any, index: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, (list, tuple)):
        return type(value)(_rows(item, index) for item in value)
    return value


def reorder_beam_state(model: Any, name: str, value: Any, index: torch.Tensor, self_attention_only: bool) -> Any:
    """A beam search step's reorder of the state under ``name`` (rows within examples), as the installed release's
    beam search does it: 5.13 and later, under any state name, the model's ``_reorder_cache`` where it has one, else
    the state's ``reorder_cache``, else ``ValueError`` (transformers' own message); before, ``past_key_values`` only
    (``_reorder_cache`` first), other states left in place. ``self_attention_only``: an encoder-decoder cache's
    cross-attention part is equal across an example's beams, so only its self-attention part need move."""
    if name not in ("past_key_values", "cache") and not _reorders_every_state():
        return value
    if hasattr(model, "_reorder_cache"):
        return model._reorder_cache(value, index)
    if hasattr(value, "reorder_cache"):
        part = value.self_attention_cache if self_attention_only and hasattr(value, "self_attention_cache") else value
        part.reorder_cache(index)
        return value
    raise ValueError(f"{type(model).__name__} cannot use beam search with a cache currently, as the cache cannot be "
                     f"reordered")


def _parameters(function: Any) -> Any:
    return inspect.signature(function).parameters


def t5_position_bias(attention: Any, position: int, device: torch.device) -> torch.Tensor:
    """The relative position bias ``[1, H, 1, position + 1]`` of the decoder query at ``position`` over every key up
    to it: T5Attention's own ``compute_bias``, which takes the query's offset as ``past_seen_tokens`` (5.4 and
    later) or as ``cache_position`` (a tensor of the query positions, before)."""
    if "past_seen_tokens" in _parameters(attention.compute_bias):
        return attention.compute_bias(1, position + 1, device=device, past_seen_tokens=position)
    query = torch.tensor([position], dtype=torch.long, device=device)
    return attention.compute_bias(1, position + 1, device=device, cache_position=query)


def gpt2_attention_scaling(attention: Any) -> float:
    """What GPT2Attention multiplies the query-key products by: its ``scaling`` attribute (5.4 and later); before,
    the attention divided by ``sqrt(head_dim)`` when ``scale_attn_weights`` (the same factor up to rounding)."""
    if hasattr(attention, "scaling"):
        return attention.scaling
    return attention.head_dim**-0.5 if attention.scale_attn_weights else 1.0


def sdpa_grouped_query(mask: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor) -> str:
    """How transformers' ``sdpa_attention_forward`` attends with grouped queries (fewer key/value heads than query
    heads) for these keys and values ``[N, G, t, d]`` and this mask: ``"enable_gqa"`` (the kernel maps query heads
    to key/value heads), ``"pack"`` (5.23 and later: ``pack_gqa`` makes a one-token query's heads of a group query
    positions of its key/value head) or ``"repeat"`` (before 5.23: ``repeat_kv`` copies keys and values to every
    query head). The choice is the release's own ``use_gqa_in_sdpa``, which takes the values too from 5.13."""
    ask, takes_values, otherwise = _sdpa_grouped_query_rule()
    return "enable_gqa" if (ask(mask, keys, values) if takes_values else ask(mask, keys)) else otherwise


@functools.cache
def _sdpa_grouped_query_rule() -> tuple[Any, bool, str]:
    """The installed release's ``use_gqa_in_sdpa``, whether it takes the values, and its path when it declines:
    read once, not at every layer of every step."""
    from transformers.integrations import sdpa_attention

    ask = sdpa_attention.use_gqa_in_sdpa
    return ask, len(_parameters(ask)) == 3, "pack" if hasattr(sdpa_attention, "pack_gqa") else "repeat"


# ---------------------------------------------------------------------------------------------- search semantics


def sorts_sampled_beams() -> bool:
    """Whether beam sampling orders its sampled candidates by score before choosing the next beams (5.24 and later:
    ``_get_top_k_continuations`` sorts them; before, they kept the order they were drawn in)."""
    return version() >= (5, 24)


def prefix_fn_rows_per_batch_id(num_beams: int, num_return_sequences: int) -> int:
    """Rows per ``batch_id`` of ``prefix_allowed_tokens_fn``: ``max(num_beams, num_return_sequences)`` from 5.24 (one
    batch id per example when sampling several sequences), ``num_beams`` before."""
    return max(num_beams, num_return_sequences) if version() >= (5, 24) else num_beams
