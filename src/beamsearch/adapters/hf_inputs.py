"""Input preparation for the Hugging Face adapter: everything ``model.generate`` does before its decoding loop.

The installed release's own ``generate`` prepares the inputs (``hf_compat.prepare_with_generate``: its public
``custom_generate=`` hook receives what it prepared), so every release and model family keeps its order and its
quirks: the generation config merged with generate's precedence and model defaults, kwargs the model does not take
refused with transformers' messages, special tokens with generate's fallbacks, the default attention mask and
positions, the encoder run as generate runs it, the decoder start tokens, the length resolution and its checks, and
the cache. What it expanded to beams is taken back to one row per example here: our steps expand it themselves.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..hf_compat import prepare_with_generate, unexpand
from ..options import SEARCH_ARGUMENTS, UNSUPPORTED_OPTIONS, is_neutral

# generate() arguments that change results and that we do not implement.
REJECTED_ARGUMENTS = (
    "assistant_model",
    "assistant_tokenizer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "synced_gpus",
)




def prepare(model: Any, inputs: Any, generation_config: Any, kwargs: dict[str, Any],
            encode: Any = None) -> dict[str, Any]:
    """Everything ``model.generate`` does before its decoding loop, with one row per example.

    ``encode(input_ids, attention_mask)``: the encoder's last hidden state ``[B, S, D]`` computed another way
    (``lean_step="fast"``), instead of the model's encoder; used only where generate would run the encoder on the
    token ids and a padding mask the caller gave (or ids without padding), nothing else."""
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    fast_encoded = False
    if encode is not None and model.config.is_encoder_decoder \
            and _plain_encoder_call(model, inputs, generation_config, kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        ids = inputs if inputs is not None else kwargs["input_ids"]
        kwargs = dict(kwargs, encoder_outputs=BaseModelOutput(last_hidden_state=encode(ids, kwargs.get(
            "attention_mask"))))
        fast_encoded = True
    prepared = prepare_with_generate(model, inputs, generation_config, kwargs)
    config, inputs_tensor = prepared["generation_config"], prepared["inputs_tensor"]
    check_config(config)
    batch_size = inputs_tensor.shape[0]
    rows = prepared["input_ids"].shape[0]
    every = rows // batch_size
    input_ids = prepared["input_ids"][::every]
    model_kwargs = unexpand(prepared["model_kwargs"], batch_size, rows)
    if not torch.is_tensor(inputs_tensor) or inputs_tensor.dim() != 2 or inputs_tensor.is_floating_point():
        raise ValueError("beamsearch.generate needs token ids as input (input_ids [B, S]), not embeddings")
    is_encoder_decoder = model.config.is_encoder_decoder
    source_mask = model_kwargs.get("attention_mask")
    if source_mask is not None:
        source_lengths = (source_mask != 0).sum(dim=1)
    else:
        source_lengths = torch.full((batch_size,), inputs_tensor.shape[1], device=inputs_tensor.device)
    mask = model_kwargs.get("decoder_attention_mask" if is_encoder_decoder else "attention_mask")
    padding_lengths = (mask != 0).int().argmax(dim=1) if mask is not None else None
    return {
        "generation_config": config,
        "model_kwargs": model_kwargs,
        "input_ids": input_ids,
        "padding_lengths": padding_lengths,
        "source_lengths": source_lengths,
        "encoder_input_ids": inputs_tensor if not (inputs_tensor < 0).any() else None,
        "has_default_max_length": has_default_max_length,
        "fast_encoded": fast_encoded,  # the encoder output is ``encode``'s
    }


def encode_as_generate(model: Any, setup: dict[str, Any]) -> None:
    """Replace an encoder output that ``encode`` made by the model's own encoder run as ``generate`` runs it on a
    plain call (the token ids and the padding mask, nothing else): for a step that needs the model's own output."""
    mask = setup["model_kwargs"].get("attention_mask")
    setup["model_kwargs"]["encoder_outputs"] = model.get_encoder()(
        input_ids=setup["encoder_input_ids"], attention_mask=mask, return_dict=True)
    setup["fast_encoded"] = False


def _plain_encoder_call(model: Any, inputs: Any, generation_config: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the encoder would see nothing but the token ids and the padding mask the caller gave (then ``encode``
    may run it). Generation options (``num_beams``, ``max_new_tokens``, ...) go to the generation config, not to the
    encoder; anything else for the encoder (embeddings, head masks, attention or hidden-state outputs, encoder
    outputs) leaves it to the model, and so do ids holding the pad token without a mask: releases differ in the mask
    they derive."""
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.is_floating_point():
        return False
    outputs = ("output_attentions", "output_hidden_states")
    for config in (generation_config, model.generation_config):
        if config is not None and any(getattr(config, name, None) for name in outputs):
            return False
    options = _generation_option_names()
    for name, value in kwargs.items():
        if name.startswith("decoder_") or name in ("input_ids", "attention_mask", "use_cache", "past_key_values",
                                                   "cache", "generation_config"):
            continue
        if name in options and name not in outputs:
            continue
        if value is not None and value is not False:
            return False
    if kwargs.get("attention_mask") is None:
        pad = model.generation_config.pad_token_id
        return pad is None or not bool((ids == pad).any())
    return True


@functools.cache
def _generation_option_names() -> frozenset[str]:
    """The attributes of transformers' ``GenerationConfig``: the keyword arguments ``generate`` keeps for itself."""
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def check_config(config: Any) -> None:
    """Reject any generation option that would change results and that we do not implement."""
    for name in UNSUPPORTED_OPTIONS:
        if not is_neutral(name, getattr(config, name, None)):
            raise ValueError(f"generation option {name!r} is not supported by beamsearch (it would change results)")
    for name in SEARCH_ARGUMENTS:  # read from generate()'s arguments only, never from a generation config
        if getattr(config, name, None) is not None:
            raise ValueError(f"generation option {name!r} is read from generate()'s arguments only: pass it as "
                             f"beamsearch.generate(..., {name}=...)")
    if getattr(config, "cache_implementation", None) not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={config.cache_implementation!r} is not supported by beamsearch")
