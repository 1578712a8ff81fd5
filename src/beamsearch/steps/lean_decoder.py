"""What the lean decoder-only steps (``gpt2/lean.py``, ``llama/lean.py``) share: the prompt once per example, its cache
copied to the rows, per-row positions and padding mask, and the beam reorder that leaves the prompt in place.

Legend: B batch, K rows per example, N = B*K (rows now), G cached heads, d head size, P prompt length,
T cache length.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hf_compat import cache_keyword, output_cache, prefill
from .caches import TimeMajorCache

# model_kwargs the lean decoder-only steps understand (anything else given makes them step aside)
KNOWN_KWARGS = ("attention_mask", "position_ids", "past_key_values", "cache", "use_cache", "logits_to_keep")


def call_reason(model: Any, model_kwargs: dict[str, Any], needs_attention: bool) -> str | None:
    """Why a lean decoder-only step cannot run this call, whatever the architecture (None: it can)."""
    from transformers import DynamicCache  # only Hugging Face models reach this

    if model.training:
        return "the model is in training mode (dropout)"
    if needs_attention:
        return "attention outputs are requested"
    if not model_kwargs.get("use_cache", True):
        return "use_cache=False"
    for name, value in model_kwargs.items():
        if name not in KNOWN_KWARGS and value is not None and value is not False:
            return f"{name} is given"
    if model_kwargs.get("logits_to_keep", 1) != 1:
        return f"logits_to_keep={model_kwargs['logits_to_keep']!r}"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return f"a {mask.dim()}-d attention_mask (the lean step takes a 2-d padding mask)"
    cache = model_kwargs.get(cache_keyword())
    if cache is not None and (type(cache) is not DynamicCache or cache.get_seq_length() > 0):
        return "past_key_values holds a cache to continue from"
    return None


class LeanDecoderState:
    """Decoder state of a decoder-only model between steps, reordered by the engine like any state.

    Per row: the keys and values of every layer (a :class:`TimeMajorCache` ``[T, N, G, d]``, filled up to
    ``length``; the first ``prompt_length`` positions equal across an example's rows); the next position id
    ``[N]``; and the attention mask over the cache ``[N, T]`` (boolean for ``sdpa``, None when no row holds
    padding; additive in the model's dtype for ``eager``), as the model's own forward makes it.

    Before the first step the engine's reorders only compose the expansion index ``[N]`` (the example of each
    row); the prefill runs the prompt for the B examples and then applies it. Subclasses compute ``decode``.
    """

    eager_mask_always = False  # eager attention gets a mask even without an attention_mask (Llama: zeros)

    def __init__(self, model: Any, model_kwargs: dict[str, Any], generation_config: Any, max_length: int, *,
                 cache_heads: int, head_size: int, dtype: torch.dtype, fixed_shape: bool = False):
        self.model = model
        self.model_kwargs = model_kwargs  # for the prefill only (hf_compat.prefill, as the generic step)
        self.generation_config = generation_config
        self.cache_heads, self.head_size, self.dtype = cache_heads, head_size, dtype
        self.sdpa = model.config._attn_implementation == "sdpa"
        self.max_length = max_length
        self.fixed_shape = fixed_shape  # decode at a tensor position over all T positions (compile_step="static")
        self.cache: TimeMajorCache | None = None  # made by the prefill
        self.positions: torch.Tensor | None = None  # [N] position id of the next token of each row
        self.mask: torch.Tensor | None = None  # [N, T] over the cache
        self.length = 0
        self.prompt_length = 0
        self.rows_per_example = 1
        self.expansion: torch.Tensor | None = None  # [N] example of each row, until the prefill applies it

    # ------------------------------------------------------------------ reorder

    def reorder(self, index: torch.Tensor) -> LeanDecoderState:
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

    # ------------------------------------------------------------------ the prompt

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first call: the prompt ``[N, P]`` of each example once (the model's own forward and cache), then its
        keys, values, positions and mask copied to the example's rows. Returns the logits ``[N, V]`` (float32)."""
        rows = tokens.shape[0]
        expansion = self.expansion if self.expansion is not None else torch.arange(rows, device=tokens.device)
        examples = int(expansion.max()) + 1
        first = torch.searchsorted(expansion, torch.arange(examples, device=expansion.device))
        kwargs = self.model_kwargs
        outputs = prefill(self.model, tokens.index_select(0, first), self.generation_config, kwargs)
        cache = output_cache(outputs)
        self.prompt_length = tokens.shape[1]
        shape = (max(self.max_length, self.prompt_length + 1), rows, self.cache_heads, self.head_size)

        first_keys = cache.layers[0].keys
        self.cache = TimeMajorCache.empty(len(cache.layers), shape, first_keys.dtype, first_keys.device,
                                          zeroed=self.fixed_shape)
        for layer, past in enumerate(cache.layers):  # the prompt's [B, G, P, d] into [T, N, G, d]
            for buffer, prompt in ((self.cache.keys[layer], past.keys), (self.cache.values[layer], past.values)):
                buffer[: self.prompt_length] = prompt.index_select(0, expansion).permute(2, 0, 1, 3)
        prompt_mask = kwargs.get("attention_mask")
        self.positions = _next_positions(kwargs.get("position_ids"), prompt_mask, examples, self.prompt_length,
                                         tokens.device).index_select(0, expansion)
        padded = prompt_mask is not None and not bool(prompt_mask.all())
        if padded or (not self.sdpa and (prompt_mask is not None or self.eager_mask_always)):
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
        position = torch.tensor(self.length, device=tokens.device) if self.fixed_shape else self.length
        logits = self.decode(tokens, position)
        self.length += 1
        self.positions = self.positions + 1
        return logits

    def decode(self, tokens: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """The model at ``position`` (what ``compile_step`` compiles); subclasses compute it."""
        raise NotImplementedError

    def step_mask(self, position: int | torch.Tensor) -> torch.Tensor | None:
        """The attention mask of a step over the cache, as transformers makes it: ``[N, 1, 1, t]`` (None under
        sdpa when no row holds padding). Fixed shape (``position`` a 0-d tensor): ``[N or 1, 1, 1, T]`` over all
        T positions, those after ``position`` blocked too."""
        if not isinstance(position, torch.Tensor):
            return None if self.mask is None else self.mask[:, None, None, : position + 1]
        capacity = self.cache.capacity
        future = torch.arange(capacity, device=position.device) > position  # [T]
        if self.sdpa:
            allowed = ~future if self.mask is None else self.mask & ~future
            return allowed.view(-1, 1, 1, capacity)
        mask = self.mask if self.mask is not None else torch.zeros(capacity, dtype=self.dtype, device=future.device)
        return mask.masked_fill(future, torch.finfo(self.dtype).min).view(-1, 1, 1, capacity)


def _next_positions(position_ids: torch.Tensor | None, mask: torch.Tensor | None, examples: int,
                    prompt_length: int, device: torch.device) -> torch.Tensor:
    """The position id of each example's next token ``[B]``: one past the prompt's last (transformers 5.17 and later
    prepare ``position_ids`` in generate); else, as the model derives them, the count of the prompt's unmasked
    tokens (``cumsum(mask) - 1`` at the last, left-padded, position, plus one), or the prompt length."""
    if position_ids is not None:
        return position_ids.expand(examples, -1)[:, -1] + 1
    if mask is not None:
        return mask.long().sum(dim=-1)
    return torch.full((examples,), prompt_length, dtype=torch.long, device=device)


def lean_decoder_step(tokens: torch.Tensor, state: LeanDecoderState) -> tuple[torch.Tensor, LeanDecoderState]:
    """The step function: the whole prompt first (once per example), then the last token of each row."""
    if state.length == 0:
        return state.prefill(tokens), state
    return state.forward(tokens[:, -1]), state


lean_decoder_step.fresh_logits = True  # the output layer's new tensor (see loop.decode)
