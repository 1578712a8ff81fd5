"""A lean decoder step for Llama: the model's own modules, its attention computed as it computes it, and a
preallocated time-major cache.

The generic Hugging Face step calls ``model(...)`` once per step; on CPU much of the time outside the matrix
products goes to the ``DynamicCache`` (``torch.cat`` copies the whole cache of every layer at every step), to the
beam reorder (which copies it again, prompt included) and to building the attention mask. This step runs the
prompt once per example through the model's own forward (``model._prefill``, as the generic step does), copies
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
  logits are those of ``model(...)`` bit for bit:

  - ``sdpa``: transformers passes no mask when no row holds padding, else a boolean one ``[N, 1, 1, t]``; with
    grouped-query attention (H > G) it asks ``use_gqa_in_sdpa`` (on CPU and CUDA: only without a mask) and then
    passes ``enable_gqa=True``, or else packs the one-token query ``[N, H, 1, d]`` into ``[N, G, H/G, d]`` so
    that each key/value head serves its group's queries without ``repeat_kv``; ``is_causal`` is False;
  - ``eager``: keys and values repeated to H heads (``repeat_kv``), matmul, scale, an additive mask in the
    model's dtype (always given, zeros where nothing is blocked), softmax in float32 cast back, matmul.

It is used by :func:`beamsearch.generate` for eligible models (``lean_step=None``, the default); ``False``
forces the generic step. Eligible: ``LlamaForCausalLM`` in eval mode with ``eager`` or ``sdpa`` attention,
rotary embeddings of a tested type (``default``, ``linear``, ``llama3``, ``yarn``: frequencies fixed at load
time), ``pretraining_tp`` 1, decoding with the cache from token ids with a 2-d attention mask, without attention
outputs or other extra inputs.

Legend: B batch, K rows per example, N = B*K (rows now), H query heads, G key/value heads, d head size,
D hidden size, P prompt length, T cache length, t positions filled.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .lean_cache import TimeMajorCache

# model_kwargs the lean step understands (anything else given makes it step aside)
_KNOWN_KWARGS = ("attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep")
# rotary embeddings whose frequencies are fixed when the model is built (tested bit for bit); "dynamic" and
# "longrope" recompute them from the positions seen
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def lean_llama_reason(model: Any, model_kwargs: dict[str, Any], needs_attention: bool) -> str | None:
    """Why the lean step cannot run this model and call (None: it can)."""
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        return f"model_type {getattr(config, 'model_type', None)!r} is not Llama"
    if type(model).__name__ != "LlamaForCausalLM":
        return f"{type(model).__name__} is not LlamaForCausalLM"
    reason = _config_reason(model)
    if reason is not None:
        return reason
    if model.training:
        return "the model is in training mode (dropout)"
    if needs_attention:
        return "attention outputs are requested"
    if not model_kwargs.get("use_cache", True):
        return "use_cache=False"
    for name, value in model_kwargs.items():
        if name not in _KNOWN_KWARGS and value is not None and value is not False:
            return f"{name} is given"
    if model_kwargs.get("logits_to_keep", 1) != 1:
        return f"logits_to_keep={model_kwargs['logits_to_keep']!r}"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return f"a {mask.dim()}-d attention_mask (the lean step takes a 2-d padding mask)"
    cache = model_kwargs.get("past_key_values")
    if cache is not None and (type(cache).__name__ != "DynamicCache" or cache.get_seq_length() > 0):
        return "past_key_values holds a cache to continue from"
    return None


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
        return "config.sliding_window is set"
    rope_type = getattr(model.model.rotary_emb, "rope_type", None)
    if rope_type not in _ROPE_TYPES:
        return f"rotary embedding type {rope_type!r} (the lean step is tested with {', '.join(_ROPE_TYPES)})"
    if getattr(model, "_use_kernels", False):
        return "hub kernels replace the model's modules"
    if implementation == "sdpa" and config.num_attention_heads != config.num_key_value_heads:
        from transformers.integrations import sdpa_attention

        if not all(hasattr(sdpa_attention, name) for name in ("use_gqa_in_sdpa", "pack_gqa")):
            return "this transformers version's sdpa grouped-query path is not the one the lean step reproduces"
    return None


class LeanLlamaState:
    """Decoder state of a Llama model between steps, reordered by the engine like any state.

    Per row: the keys and values of every layer (a :class:`TimeMajorCache` ``[T, N, G, d]``, filled up to
    ``length``; the first ``prompt_length`` positions equal across an example's rows); the next position id
    ``[N]``; and the attention mask over the cache ``[N, T]`` (``sdpa``: boolean, None when no row holds padding;
    ``eager``: additive in the model's dtype, always present, as transformers makes them).

    Before the first step the engine's reorders only compose the expansion index ``[N]`` (the example of each
    row); the prefill runs the prompt for the B examples and then applies it.
    """

    def __init__(self, model: Any, model_kwargs: dict[str, Any], generation_config: Any, max_length: int):
        self.model = model
        self.model_kwargs = model_kwargs  # for the prefill only (model._prefill, as the generic step)
        self.generation_config = generation_config
        config = model.config
        self.layers = list(model.model.layers[: config.num_hidden_layers])
        attention = self.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size, self.scaling = attention.head_dim, attention.scaling
        self.groups = attention.num_key_value_groups  # H / G query heads per key/value head
        self.apply_rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb  # the one the model calls
        self.sdpa = config._attn_implementation == "sdpa"
        self.use_gqa_in_sdpa = None  # transformers' choice between enable_gqa and packing the query
        if self.sdpa and self.groups > 1:
            from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

            self.use_gqa_in_sdpa = use_gqa_in_sdpa
        self.dtype = model.model.embed_tokens.weight.dtype
        self.max_length = max_length
        self.cache: TimeMajorCache | None = None  # made by the prefill
        self.positions: torch.Tensor | None = None  # [N] position id of the next token of each row
        self.mask: torch.Tensor | None = None  # [N, T] over the cache
        self.length = 0
        self.prompt_length = 0
        self.rows_per_example = 1
        self.expansion: torch.Tensor | None = None  # [N] example of each row, until the prefill applies it

    # ------------------------------------------------------------------ reorder

    def reorder(self, index: torch.Tensor) -> LeanLlamaState:
        if self.length == 0:
            self.expansion = index if self.expansion is None else self.expansion.index_select(0, index)
            return self
        if index.shape[0] != self.cache.rows:  # whole examples left the batch
            self.cache.gather_rows(index, self.length)
            self._select_row_state(index)
        elif self._within_examples(index):
            self.cache.reorder(index, self.length, fixed=self.prompt_length)
        else:  # rows moved across examples (not done by the engine): the per-row state moves too
            self.cache.reorder(index, self.length)
            self._select_row_state(index)
        return self

    def _within_examples(self, index: torch.Tensor) -> bool:
        """Whether every row's parent is a row of the same example (then the prompt positions need no gather)."""
        per_example = self.rows_per_example
        rows = torch.arange(index.shape[0], device=index.device)
        return bool(torch.equal(index // per_example, rows // per_example))

    def _select_row_state(self, index: torch.Tensor) -> None:
        self.positions = self.positions.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
            if self.sdpa and bool(self.mask[:, : self.prompt_length].all()):
                self.mask = None  # transformers passes no sdpa mask when the rows hold no padding

    def _grow(self) -> None:
        """More positions than ``max_length`` (a stopping rule of the caller's): double the buffers."""
        self.cache.grow(self.length)
        if self.mask is not None:
            mask = self._fresh_mask(self.mask.shape[0])
            mask[:, : self.length] = self.mask[:, : self.length]
            self.mask = mask

    def _fresh_mask(self, rows: int) -> torch.Tensor:
        """A mask ``[rows, T]`` that lets every position through (positions past the prompt are never padding)."""
        if self.sdpa:
            return torch.ones((rows, self.cache.capacity), dtype=torch.bool, device=self.positions.device)
        return torch.zeros((rows, self.cache.capacity), dtype=self.dtype, device=self.positions.device)

    # ------------------------------------------------------------------ steps

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first call: the prompt ``[N, P]`` of each example once (the model's own forward and cache), then its
        keys, values, positions and mask copied to the example's rows. Returns the logits ``[N, V]`` (float32)."""
        rows = tokens.shape[0]
        expansion = self.expansion if self.expansion is not None else torch.arange(rows, device=tokens.device)
        examples = int(expansion.max()) + 1
        first = torch.searchsorted(expansion, torch.arange(examples, device=expansion.device))
        kwargs = self.model_kwargs
        outputs = self.model._prefill(tokens.index_select(0, first), self.generation_config, kwargs)
        cache = outputs.past_key_values
        self.prompt_length = tokens.shape[1]
        shape = (max(self.max_length, self.prompt_length + 1), rows, self.kv_heads, self.head_size)

        def buffer(prompt: torch.Tensor) -> torch.Tensor:  # [B, G, P, d] -> [T, N, G, d], the prompt filled in
            out = torch.empty(shape, dtype=prompt.dtype, device=prompt.device)
            out[: self.prompt_length] = prompt.index_select(0, expansion).permute(2, 0, 1, 3)
            return out

        self.cache = TimeMajorCache([buffer(layer.keys) for layer in cache.layers],
                                    [buffer(layer.values) for layer in cache.layers])
        self.positions = kwargs["position_ids"].expand(examples, -1)[:, -1].index_select(0, expansion) + 1
        prompt_mask = kwargs.get("attention_mask")
        padded = prompt_mask is not None and not bool(prompt_mask.all())
        if padded or not self.sdpa:
            self.mask = self._fresh_mask(rows)
        if padded:
            blocked = prompt_mask.index_select(0, expansion) == 0  # [N, P]
            blocked_value = False if self.sdpa else torch.finfo(self.dtype).min
            self.mask[:, : self.prompt_length].masked_fill_(blocked, blocked_value)
        self.model_kwargs = None  # the DynamicCache is not needed any more
        self.rows_per_example = rows // examples
        self.expansion = None
        self.length = self.prompt_length
        return outputs.logits[:, -1, :].to(dtype=torch.float32).index_select(0, expansion)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """One position for every row: tokens ``[N]`` -> logits ``[N, V]`` (float32); the cache grows by one."""
        if self.length == self.cache.capacity:
            self._grow()
        position, rows = self.length, tokens.shape[0]
        decoder = self.model.model
        hidden = decoder.embed_tokens(tokens[:, None])  # [N, 1, D]
        rotary = decoder.rotary_emb(hidden, self.positions[:, None])  # cos, sin [N, 1, d]
        mask = None if self.mask is None else self.mask[:, None, None, : position + 1]  # [N, 1, 1, t]
        for index, layer in enumerate(self.layers):
            hidden = hidden + self._attention(layer.self_attn, layer.input_layernorm(hidden), index, position,
                                              rotary, mask)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = decoder.norm(hidden)
        self.length += 1
        self.positions = self.positions + 1
        return self.model.lm_head(hidden).view(rows, -1).float()

    def _attention(self, attention: Any, normed: torch.Tensor, layer: int, position: int,
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
            if self.use_gqa_in_sdpa(mask, keys, values):
                options["enable_gqa"] = True
            else:  # pack_gqa: the group's H/G queries become query positions of its key/value head
                query = query.reshape(rows, self.kv_heads, self.groups, size)  # [N, G, H/G, d]
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


def lean_llama_step(tokens: torch.Tensor, state: LeanLlamaState) -> tuple[torch.Tensor, LeanLlamaState]:
    """The step function: the whole prompt first (once per example), then the last token of each row."""
    if state.length == 0:
        return state.prefill(tokens), state
    return state.forward(tokens[:, -1]), state


lean_llama_step.fresh_logits = True  # the output layer's new tensor (see loop.decode)
