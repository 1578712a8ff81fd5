"""A lean decoder step for GPT-2: the model's own modules, its attention computed as it computes it, and a
preallocated time-major cache.

The generic Hugging Face step calls ``model(...)`` once per step; for GPT-2 on CPU much of the time outside
the matrix products goes to the ``DynamicCache`` (``torch.cat`` copies the whole cache of every layer at every
step) and to the beam reorder (which copies it again, prompt included). This step runs the prompt once per
example through the model's own forward (``model._prefill``, as the generic step does), copies the cache it
leaves into buffers of its own, and from then on calls the blocks' modules directly:

- keys and values are preallocated time-major (``[T, N, H, d]`` per layer): a step writes one slice, and the
  attention reads a strided view of the filled part (no ``cat``);
- the prompt positions are equal across an example's rows (the expansion copied them), so a beam reorder,
  which stays within examples, need not move them: while fewer than half the positions are generated ones, it
  gathers only those into the cache's spare buffer and copies them back (for long prompts the reorder no longer
  grows with the prompt; ``TimeMajorCache.reorder``); when whole examples leave the batch everything is
  gathered into new buffers;
- positions continue from the prompt's last position id (transformers' ``cumsum(mask) - 1``), and the left
  padding of the prompt stays blocked by a per-row mask over the cache;
- attention is computed as the model's attention implementation computes it (``sdpa``: the same
  ``scaled_dot_product_attention`` call, with transformers' boolean mask when the rows hold padding and none
  otherwise; ``eager``: matmul, scale, additive mask, softmax, matmul), so the logits are those of
  ``model(...)`` bit for bit, not merely close to them.

It is used by :func:`beamsearch.generate` for eligible models (``lean_step=None``, the default); ``False``
forces the generic step. Eligible: ``GPT2LMHeadModel`` in eval mode with ``eager`` or ``sdpa`` attention and the
default attention flags, decoding with the cache from token ids with a 2-d attention mask, without attention
outputs or other extra inputs.

Legend: B batch, K rows per example, N = B*K (rows now), H heads, d head size, D = H*d, P prompt length,
T cache length.
"""

from __future__ import annotations

from typing import Any

import torch

from .lean_cache import TimeMajorCache

# model_kwargs the lean step understands (anything else given makes it step aside)
_KNOWN_KWARGS = ("attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep")


def lean_gpt2_reason(model: Any, model_kwargs: dict[str, Any], needs_attention: bool) -> str | None:
    """Why the lean step cannot run this model and call (None: it can)."""
    config = model.config
    if getattr(config, "model_type", None) != "gpt2":
        return f"model_type {getattr(config, 'model_type', None)!r} is not GPT-2"
    if type(model).__name__ != "GPT2LMHeadModel":
        return f"{type(model).__name__} is not GPT2LMHeadModel"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("eager", "sdpa"):
        return f"attention implementation {implementation!r} (the lean step computes 'eager' and 'sdpa')"
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(config, flag, False):
            return f"config.{flag} is set"
    if not getattr(config, "is_causal", True):
        return "config.is_causal is False (bidirectional attention)"
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


class LeanGPT2State:
    """Decoder state of a GPT-2 model between steps, reordered by the engine like any state.

    Per row: the keys and values of every layer (a :class:`TimeMajorCache`, filled up to ``length``; the first
    ``prompt_length`` positions equal across an example's rows); the next position id ``[N]``; and, when the
    rows hold left padding, the attention mask over the cache ``[N, T]`` (boolean for ``sdpa``, additive for
    ``eager``).

    Before the first step the engine's reorders only compose the expansion index ``[N]`` (the example of each
    row); the prefill runs the prompt for the B examples and then applies it.
    """

    def __init__(self, model: Any, model_kwargs: dict[str, Any], generation_config: Any, max_length: int):
        self.model = model
        self.model_kwargs = model_kwargs  # for the prefill only (model._prefill, as the generic step)
        self.generation_config = generation_config
        self.blocks = list(model.transformer.h)
        attention = self.blocks[0].attn
        self.heads, self.head_size, self.width = attention.num_heads, attention.head_dim, attention.split_size
        self.scaling = attention.scaling
        self.sdpa = model.config._attn_implementation == "sdpa"
        self.dtype = model.transformer.wte.weight.dtype
        self.max_length = max_length
        self.cache: TimeMajorCache | None = None  # made by the prefill
        self.positions: torch.Tensor | None = None  # [N] position id of the next token of each row
        self.mask: torch.Tensor | None = None  # [N, T] over the cache; None when no row holds padding
        self.length = 0
        self.prompt_length = 0
        self.rows_per_example = 1
        self.expansion: torch.Tensor | None = None  # [N] example of each row, until the prefill applies it

    # ------------------------------------------------------------------ reorder

    def reorder(self, index: torch.Tensor) -> LeanGPT2State:
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
                self.mask = None  # transformers skips the sdpa mask when the rows hold no padding

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
        shape = (max(self.max_length, self.prompt_length + 1), rows, self.heads, self.head_size)

        def buffer(prompt: torch.Tensor) -> torch.Tensor:  # [B, H, P, d] -> [T, N, H, d], the prompt filled in
            out = torch.empty(shape, dtype=prompt.dtype, device=prompt.device)
            out[: self.prompt_length] = prompt.index_select(0, expansion).permute(2, 0, 1, 3)
            return out

        self.cache = TimeMajorCache([buffer(layer.keys) for layer in cache.layers],
                                    [buffer(layer.values) for layer in cache.layers])
        self.positions = kwargs["position_ids"].expand(examples, -1)[:, -1].index_select(0, expansion) + 1
        prompt_mask = kwargs.get("attention_mask")
        if prompt_mask is not None and not (self.sdpa and bool(prompt_mask.all())):
            self.mask = self._fresh_mask(rows)
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
        transformer = self.model.transformer
        hidden = transformer.wte(tokens[:, None]) + transformer.wpe(self.positions[:, None])  # [N, 1, D]
        mask = None if self.mask is None else self.mask[:, None, None, : position + 1]  # [N, 1, 1, t]
        for layer, block in enumerate(self.blocks):
            hidden = self._attention(block.attn, block.ln_1(hidden), layer, position, mask) + hidden
            hidden = hidden + block.mlp(block.ln_2(hidden))
        hidden = transformer.ln_f(hidden)
        self.length += 1
        self.positions = self.positions + 1
        return self.model.lm_head(hidden).view(rows, -1).float()

    def _attention(self, attention: Any, normed: torch.Tensor, layer: int, position: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """Self-attention of the new position over the cache: ``[N, 1, D]`` -> ``[N, 1, D]`` (before the residual)."""
        rows, heads, size = normed.shape[0], self.heads, self.head_size
        query, key, value = attention.c_attn(normed).split(self.width, dim=2)  # [N, 1, D] each
        keys, values = self.cache.write(layer, position, key.view(rows, heads, size),
                                        value.view(rows, heads, size))  # [N, H, t, d]
        query = query.view(rows, 1, heads, size).transpose(1, 2)  # [N, H, 1, d]
        if self.sdpa:
            mixed = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                                     dropout_p=0.0, scale=self.scaling)
        else:
            weights = torch.matmul(query, keys.transpose(-1, -2)) * self.scaling
            if mask is not None:
                weights = weights + mask
            weights = torch.nn.functional.softmax(weights, dim=-1).type(values.dtype)
            mixed = torch.matmul(weights, values)
        mixed = mixed.transpose(1, 2).reshape(rows, 1, heads * size)  # [N, 1, D]
        return attention.c_proj(mixed)


def lean_gpt2_step(tokens: torch.Tensor, state: LeanGPT2State) -> tuple[torch.Tensor, LeanGPT2State]:
    """The step function: the whole prompt first (once per example), then the last token of each row."""
    if state.length == 0:
        return state.prefill(tokens), state
    return state.forward(tokens[:, -1]), state


lean_gpt2_step.fresh_logits = True  # the output layer's new tensor (see loop.decode)
