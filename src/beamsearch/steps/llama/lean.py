"""A lean decoder step for Llama, and for the models whose layers are Llama's (Qwen2, Mistral): the model's own
modules, its attention computed as it computes it, and a preallocated time-major cache.

The generic Hugging Face step calls ``model(...)`` once per step; on CPU much of the time outside the matrix
products goes to the ``DynamicCache`` (``torch.cat`` copies the whole cache of every layer at every step), to the
beam reorder (which copies it again, prompt included) and to building the attention mask. This step runs the
prompt once per example through the model's own forward (``hf_compat.prefill``, as the generic step does), copies
the cache it leaves into buffers of its own, and from then on calls the decoder layers' modules directly
(embedding, rotary embedding, RMS norms, projections, ``apply_rotary_pos_emb`` of the model's module, MLP):

- keys and values are preallocated time-major (``[T, N, G, d]`` per layer, G key/value heads): a step writes
  one slice, and the attention reads a strided view of the filled part (no ``cat``);
- the prompt positions are equal across an example's rows, so a beam reorder, which stays within examples,
  need not move them (``TimeMajorCache.reorder`` with ``fixed=prompt_length``); when whole examples leave the
  batch everything is gathered into new buffers;
- positions continue from the prompt's last position id (transformers' ``cumsum(mask) - 1``), and the left
  padding of the prompt stays blocked by a per-row mask over the cache;
- attention is computed as the model's attention implementation computes it for a one-token query, so the
  logits are those of ``model(...)`` to float precision (the cache has other shapes, so not bitwise):

  - ``sdpa``: transformers passes no mask when no row holds padding, else a boolean one ``[N, 1, 1, t]``; with
    grouped-query attention (H > G) it asks ``use_gqa_in_sdpa`` (on CPU and CUDA: only without a mask) and then
    passes ``enable_gqa=True``, or else (5.23 and later) packs the one-token query ``[N, H, 1, d]`` into
    ``[N, G, H/G, d]`` so that each key/value head serves its group's queries, or (before) repeats keys and
    values to H heads (``repeat_kv``); ``hf_compat.sdpa_grouped_query`` names the installed release's path;
    ``is_causal`` is False;
  - ``eager``: keys and values repeated to H heads (``repeat_kv``), matmul, scale, an additive mask in the
    model's dtype (always given, zeros where nothing is blocked), softmax in float32 cast back, matmul.

It is used by :func:`beamsearch.generate` for eligible models (``lean_step=None``, the default); ``False``
forces the generic step. Eligible: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``MistralForCausalLM`` in eval
mode with ``eager`` or ``sdpa`` attention, rotary embeddings of a tested type (``default``, ``linear``, ``llama3``,
``yarn``: frequencies fixed at load time), ``pretraining_tp`` 1, no sliding window (Qwen2's
``use_sliding_window`` off, as its checkpoints ship it; Mistral's ``sliding_window`` null, as from v0.2 on),
decoding with the cache from token ids with a 2-d attention mask, without attention outputs or other extra inputs.
Qwen2's and Mistral's decoder layers are Llama's (Qwen2's query, key and value products have a bias, which their
modules add); the step calls each model's own modules and its module's ``apply_rotary_pos_emb``.

Legend: B batch, K rows per example, N = B*K (rows now), H query heads, G key/value heads, d head size,
D hidden size, P prompt length, T cache length, t positions filled.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...hf_compat import sdpa_grouped_query
from ..gate import Plan, refusal
from ..lean_decoder import LeanDecoderState, call_reason, lean_decoder_step

# rotary embeddings whose frequencies are fixed when the model is built (tested against the model); "dynamic" and
# "longrope" recompute them from the positions seen
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# the causal language models whose decoder layers are Llama's, by model_type
MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}

# The modules the lean step computes itself (the decoder, its layers and their attention) and those it calls as
# modules on the inputs the model's forward gives them (embedding, rotary embedding, norms, the attention's products,
# the MLP, the output layer). ``{}`` is ``Llama``, ``Qwen2`` or ``Mistral``.
LEAN_LLAMA = Plan(
    step="the lean Llama step",
    roots=tuple(MODELS.values()),
    suffix="ForCausalLM",
    computed={"model": ("{}Model",), "model.layers": (torch.nn.ModuleList,), "model.layers.*": ("{}DecoderLayer",),
              "model.layers.*.self_attn": ("{}Attention",)},
    called=frozenset({"lm_head", "model.embed_tokens", "model.rotary_emb", "model.norm",
                      "model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm",
                      "model.layers.*.mlp", *(f"model.layers.*.self_attn.{p}_proj" for p in "qkvo")}),
    repeated=frozenset({"model.layers"}),
)


def lean_llama_reason(model: Any, model_kwargs: dict[str, Any], needs_attention: bool,
                      plan: Plan = LEAN_LLAMA) -> str | None:
    """Why the lean step cannot run this model and call (None: it can); ``plan``: the gate to pass last (the
    graph-safe step passes its own)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODELS:
        return f"model_type {model_type!r} is not Llama, Qwen2 or Mistral"
    import transformers  # only Hugging Face models reach this

    expected = getattr(transformers, MODELS[model_type])
    if type(model) is not expected:
        return f"{type(model).__name__} is not {expected.__name__}"
    return _config_reason(model) or call_reason(model, model_kwargs, needs_attention) or refusal(model, plan)


def _config_reason(model: Any) -> str | None:
    """Why the model's configuration is not one the lean step reproduces (None: it is)."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("eager", "sdpa"):
        return f"attention implementation {implementation!r} (the lean step computes 'eager' and 'sdpa')"
    if not getattr(config, "is_causal", True):
        return "config.is_causal is False (bidirectional attention)"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"config.pretraining_tp={config.pretraining_tp} (the lean step takes 1)"
    if getattr(config, "sliding_window", None) is not None:
        return "config.sliding_window is set (the lean step attends to the whole cache)"
    rope_type = getattr(model.model.rotary_emb, "rope_type", None)
    if rope_type not in _ROPE_TYPES:
        return f"rotary embedding type {rope_type!r} (the lean step is tested with {', '.join(_ROPE_TYPES)})"
    if getattr(model, "_use_kernels", False):
        return "hub kernels replace the model's modules"
    return None


class LeanLlamaState(LeanDecoderState):
    """Decoder state of a Llama model between steps (see :class:`LeanDecoderState`); the cache holds the G
    key/value heads, and eager attention always gets a mask, as transformers makes it."""

    eager_mask_always = True

    def __init__(self, model: Any, model_kwargs: dict[str, Any], generation_config: Any, max_length: int,
                 fixed_shape: bool = False):
        config = model.config
        self.layers = list(model.model.layers[: config.num_hidden_layers])
        attention = self.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = attention.scaling
        self.groups = attention.num_key_value_groups  # H / G query heads per key/value head
        self.apply_rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb  # the one the model calls
        super().__init__(model, model_kwargs, generation_config, max_length, cache_heads=self.kv_heads,
                         head_size=attention.head_dim, dtype=model.model.embed_tokens.weight.dtype,
                         fixed_shape=fixed_shape)

    def decode(self, tokens: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """The decoder at ``position`` for every row: tokens ``[N]`` -> logits ``[N, V]`` (float32)."""
        rows = tokens.shape[0]
        decoder = self.model.model
        hidden = decoder.embed_tokens(tokens[:, None])  # [N, 1, D]
        rotary = decoder.rotary_emb(hidden, self.positions[:, None])  # cos, sin [N, 1, d]
        mask = self.step_mask(position)  # [N, 1, 1, t] (fixed shape: T)
        for index, layer in enumerate(self.layers):
            hidden = hidden + self._attention(layer.self_attn, layer.input_layernorm(hidden), index, position,
                                              rotary, mask)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = decoder.norm(hidden)
        return self.model.lm_head(hidden).view(rows, -1).float()

    def _attention(self, attention: Any, normed: torch.Tensor, layer: int, position: int | torch.Tensor,
                   rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """Self-attention of the new position over the cache: ``[N, 1, D]`` -> ``[N, 1, D]`` (before the residual)."""
        rows, size = normed.shape[0], self.head_size
        query = attention.q_proj(normed).view(rows, 1, self.heads, size).transpose(1, 2)  # [N, H, 1, d]
        key = attention.k_proj(normed).view(rows, 1, self.kv_heads, size).transpose(1, 2)  # [N, G, 1, d]
        value = attention.v_proj(normed).view(rows, 1, self.kv_heads, size)  # [N, 1, G, d]
        query, key = self.apply_rotary(query, key, *rotary)
        keys, values = self.cache.write(layer, position, key[:, :, 0], value[:, 0])  # [N, G, t, d]
        if self.sdpa:
            mixed = self._sdpa(query, keys, values, mask)
        else:
            mixed = self._eager(query, keys, values, mask)
        return attention.o_proj(mixed.reshape(rows, 1, self.heads * size))

    def _sdpa(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """transformers' ``sdpa_attention_forward`` for one query position: query ``[N, H, 1, d]``, keys and values
        ``[N, G, t, d]`` -> ``[N, 1, H, d]``."""
        rows, size = query.shape[0], self.head_size
        options = {}
        if self.groups > 1:
            path = sdpa_grouped_query(mask, keys, values)  # the installed release's choice
            if path == "enable_gqa":
                options["enable_gqa"] = True
            elif path == "pack":  # pack_gqa: the group's H/G queries become query positions of its key/value head
                query = query.reshape(rows, self.kv_heads, self.groups, size)  # [N, G, H/G, d]
            else:  # repeat_kv: [N, G, t, d] -> [N, H, t, d]
                keys, values = self._repeat_kv(keys), self._repeat_kv(values)
        mixed = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=0.0,
                                                                 scale=self.scaling, is_causal=False, **options)
        return mixed.reshape(rows, self.heads, 1, size).transpose(1, 2)  # [N, 1, H, d]

    def _eager(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """transformers' ``eager_attention_forward`` for one query position: query ``[N, H, 1, d]``, keys and values
        ``[N, G, t, d]``, additive mask ``[N, 1, 1, t]`` -> ``[N, 1, H, d]``."""
        if self.groups > 1:  # repeat_kv: [N, G, t, d] -> [N, H, t, d]
            keys, values = self._repeat_kv(keys), self._repeat_kv(values)
        weights = torch.matmul(query, keys.transpose(2, 3)) * self.scaling + mask  # [N, H, 1, t]
        weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(weights, values).transpose(1, 2)  # [N, 1, H, d]

    def _repeat_kv(self, states: torch.Tensor) -> torch.Tensor:
        """Each key/value head for each query head of its group: ``[N, G, t, d]`` -> ``[N, H, t, d]`` (a copy)."""
        rows, _, length, size = states.shape
        expanded = states[:, :, None].expand(rows, self.kv_heads, self.groups, length, size)
        return expanded.reshape(rows, self.heads, length, size)


lean_llama_step = lean_decoder_step  # the step function (its own name, as the adapter and tests refer to it)
