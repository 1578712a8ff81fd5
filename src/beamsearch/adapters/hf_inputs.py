"""Input preparation for the Hugging Face adapter: everything ``model.generate`` does before its decoding loop.

The model's own preparation methods are called in the order ``model.generate`` calls them, so every model
family keeps its quirks. transformers has no public API for these steps of ``generate`` (only ``generate``
itself, which also decodes), so the private ``GenerationMixin`` methods are used, each for one step:

- ``_prepare_generation_config``: the model's generation config, the one passed and the kwargs merged with
  generate's precedence and model defaults (also used by ``max_rows`` in ``hf.py``);
- ``_validate_model_kwargs``: kwargs the model does not take refused with transformers' messages;
- ``_prepare_model_inputs``: input_ids, inputs_embeds or the encoder's main input, per model;
- ``_prepare_special_tokens``: bos / eos / pad / decoder start tensors with generate's fallbacks (read back
  as ``config._*_token_tensor`` in ``hf_options.py``);
- ``_prepare_attention_mask_for_generation``, ``_prepare_position_ids_for_generation``: the default mask and
  positions generate derives;
- ``_maybe_prepare_encoder_kwargs_for_generation``: the encoder run as generate runs it;
- ``_prepare_decoder_input_ids_for_generation``: the decoder start tokens;
- ``_prepare_generated_length``, ``_validate_generated_length``: max / min length resolution and its checks;
- ``_supports_logits_to_keep``, ``_prepare_cache_for_generation``: the cache and logits slicing generate sets
  up. (``hf_steps.py`` calls ``_update_model_kwargs_for_generation`` after each generic step, for the same
  reason.)
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

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
    """Everything ``model.generate`` does before its decoding loop, except expanding to beams.

    ``encode(input_ids, attention_mask)``: the encoder's last hidden state ``[B, S, D]`` computed another way
    (``lean_step="fast"``), instead of the model's encoder; called only where generate would run the encoder."""
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
    check_config(config)
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
    if model_kwargs.get("encoder_outputs") is None and encode is not None and _plain_encoder_call(model_kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        hidden = encode(inputs_tensor, model_kwargs.get("attention_mask"))
        model_kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
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
    if encode is None:  # the fast step keeps its own cache: transformers' would be made and dropped
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


def _plain_encoder_call(model_kwargs: dict[str, Any]) -> bool:
    """Whether the encoder would see nothing but the token ids and their padding mask (then ``encode`` may run
    it); anything else for the encoder (embeddings, head masks, output requests) leaves it to the model."""
    for name, value in model_kwargs.items():
        if name.startswith("decoder_") or name in ("attention_mask", "use_cache", "past_key_values"):
            continue
        if value is not None and value is not False:
            return False
    return True


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
