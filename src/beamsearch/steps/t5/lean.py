"""A lean decoder step for T5 (and mT5): the model's own modules, our attention and a preallocated cache.

The generic Hugging Face step calls ``model(...)`` once per step; for T5 on CPU a fifth of that time goes to
growing the self-attention cache with ``torch.cat`` (one copy of the whole cache per layer and step, then the
beam reorder copies it again) and to attention kernels built for long queries. This step calls the decoder's
layer norms, projections and feed-forward blocks directly and does the rest itself:

- the self-attention cache is preallocated time-major (``[T, N, H, d]`` per layer): a step writes one slice,
  and the beam reorder gathers only the filled part into a second buffer (one copy, no ``cat``);
- the cross-attention keys and values are computed once per example and stay one copy per example (encoder
  memory flat in K), never reordered: transformers copies them to every row, and as the attention kernel
  computes each (batch row, head) on its own, one call per row slot (the j-th row of every example) runs the
  same kernel on each (row, head); with ``share_encoder_state`` an example's K queries attend in one batched
  call (other rounding);
- the relative position bias is the model's own ``compute_bias`` for the new position;
- attention is computed as the model's attention implementation computes it (``sdpa``: the same
  ``scaled_dot_product_attention`` call with the bias as its mask; ``eager``: matmul, bias, softmax, matmul),
  so the logits are those of ``model(...)``, not merely close to them.

With ``fixed_shape`` (``compile_step="static"``) every step has the same shapes, for ``torch.compile``: the
position is a 0-d tensor, self-attention reads all T cache positions (zero-filled until written) under a
precomputed ``[H, T, T]`` position-bias table with the future masked (T*T*H values: sized by ``max_length``).
Tokens equal transformers'; scores to float rounding (the kernel sums the masked zeros in another order).

The default step's results equal ``model.generate`` (the parity tests run this path). It is used by
:func:`beamsearch.generate` for eligible models (``lean_step=None``, the default); ``False`` forces the generic
step. Eligible: T5-layout encoder-decoder models (``t5``, ``mt5``) in eval mode with ``eager`` or ``sdpa``
attention, decoding with the cache, without a decoder attention mask and without attention outputs (coverage
penalties, alignments).

Legend: B batch, K rows per example, N = B*K, H heads, d head size, S source length, T cache length.
"""

from __future__ import annotations

from typing import Any

import torch

from ...hf_compat import t5_position_bias
from ..caches import TimeMajorCache
from ..gate import Plan, refusal

_DROPOUT = (torch.nn.Dropout,)
_LIST = (torch.nn.ModuleList,)

# The modules the lean T5 step computes itself (the decoder's blocks, attention sub-layers and attention, whose
# dropouts it skips in eval mode) and those it calls as modules on the inputs the model's forward gives them: the
# encoder (transformers runs it), the embedding, norms, products, the relative position bias, the feed-forward
# sub-layer, the output layer. ``{}`` is ``T5`` or ``MT5``.
LEAN_T5 = Plan(
    step="the lean T5 step",
    roots=("T5ForConditionalGeneration", "MT5ForConditionalGeneration"),
    suffix="ForConditionalGeneration",
    computed={
        "decoder": ("{}Stack",), "decoder.block": _LIST, "decoder.block.*": ("{}Block",),
        "decoder.block.*.layer": _LIST, "decoder.dropout": _DROPOUT,
        "decoder.block.*.layer.0": ("{}LayerSelfAttention",), "decoder.block.*.layer.0.SelfAttention": ("{}Attention",),
        "decoder.block.*.layer.0.dropout": _DROPOUT,
        "decoder.block.*.layer.1": ("{}LayerCrossAttention",),
        "decoder.block.*.layer.1.EncDecAttention": ("{}Attention",), "decoder.block.*.layer.1.dropout": _DROPOUT,
    },
    called=frozenset({
        "shared", "encoder", "lm_head", "decoder.embed_tokens", "decoder.final_layer_norm", "decoder.block.*.layer.2",
        *(f"decoder.block.*.layer.{i}.layer_norm" for i in (0, 1)),
        *(f"decoder.block.*.layer.{path}.{name}" for path in ("0.SelfAttention", "1.EncDecAttention")
          for name in ("q", "k", "v", "o", "relative_attention_bias")),
    }),
    repeated=frozenset({"decoder.block"}),
)


def lean_t5_reason(model: Any, model_kwargs: dict[str, Any], needs_attention: bool,
                   plan: Plan | None = LEAN_T5) -> str | None:
    """Why the lean step cannot run this model and call (None: it can). ``plan``: the gate to pass last (the fast
    and graph-safe steps pass their own; None where the caller has passed it)."""
    config = model.config
    if getattr(config, "model_type", None) not in ("t5", "mt5"):
        return f"model_type {getattr(config, 'model_type', None)!r} is not T5"
    decoder = getattr(model, "decoder", None)
    blocks = getattr(decoder, "block", None)
    if blocks is None or not all(len(b.layer) == 3 and hasattr(b.layer[0], "SelfAttention") for b in blocks):
        return "the decoder does not have the T5 layout"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("eager", "sdpa"):
        return f"attention implementation {implementation!r} (the lean step computes 'eager' and 'sdpa')"
    if model.training:
        return "the model is in training mode (dropout)"
    if needs_attention:
        return "attention outputs are requested"
    if not model_kwargs.get("use_cache", True):
        return "use_cache=False"
    for name in ("decoder_attention_mask", "decoder_inputs_embeds", "output_attentions", "output_hidden_states"):
        value = model_kwargs.get(name)
        if value is not None and value is not False:
            return f"{name} is given"
    if model_kwargs.get("encoder_outputs") is None:
        return "no encoder outputs"
    return None if plan is None else refusal(model, plan)


def _output_scale(model: Any) -> float | None:
    """T5 scales the decoder output by ``d_model ** -0.5`` before the output layer (``scale_decoder_outputs``,
    on for tied embeddings); mT5 never does."""
    config = model.config
    if config.model_type == "mt5":
        return None
    return model.model_dim**-0.5 if getattr(config, "scale_decoder_outputs", config.tie_word_embeddings) else None


def _clamp_float16(hidden: torch.Tensor) -> torch.Tensor:
    """T5's guard after each sub-layer in float16: clamp to the finite range (a little inside it after an inf)."""
    if hidden.dtype != torch.float16:
        return hidden
    top = torch.finfo(hidden.dtype).max
    bound = torch.where(torch.isinf(hidden).any(), top - 1000, top)
    return torch.clamp(hidden, min=-bound, max=bound)


class LeanT5State:
    """Decoder state of a T5 model between steps, reordered by the engine like any state.

    Per example: the cross-attention keys and values ``[B, H, S, d]`` of every layer and the additive source mask
    ``[B, 1, 1, S]`` (an example's K rows query one copy). Per row: the self-attention keys and values of every
    layer, filled up to ``length`` (a :class:`TimeMajorCache`).
    """

    def __init__(self, model: Any, encoder_hidden: torch.Tensor, source_mask: torch.Tensor | None, max_length: int,
                 share_encoder_state: bool = False, fixed_shape: bool = False):
        self._start(model, encoder_hidden, source_mask, max_length, fixed_shape)
        self.scale = _output_scale(model)
        self.sdpa = model.config._attn_implementation == "sdpa"
        self.share_encoder_state = share_encoder_state
        self.bias_table: torch.Tensor | None = None  # fixed shape: [H, T, T] position bias, future masked
        self.cross_keys = [self._heads(b.layer[1].EncDecAttention.k(encoder_hidden)) for b in self.blocks]
        self.cross_values = [self._heads(b.layer[1].EncDecAttention.v(encoder_hidden)) for b in self.blocks]
        if self.padded:
            blocked = source_mask[:, None, None, :] == 0  # [B, 1, 1, S]
            self.source_bias = torch.zeros(blocked.shape, dtype=self.dtype, device=blocked.device)
            self.source_bias.masked_fill_(blocked, torch.finfo(self.dtype).min)
        else:  # transformers' cross-attention bias without padding: zeros
            self.source_bias = torch.zeros((1, self.heads, 1, encoder_hidden.shape[1]), dtype=self.dtype,
                                           device=encoder_hidden.device)

    def _start(self, model: Any, encoder_hidden: torch.Tensor, source_mask: torch.Tensor | None, max_length: int,
               fixed_shape: bool) -> None:
        """What every T5 state holds before its cross-attention state (this one's and the fast step's): the
        decoder's shape, the examples, whether the source is padded, and an empty cache."""
        self.model = model
        self.blocks = list(model.decoder.block)
        attention = self.blocks[0].layer[0].SelfAttention
        self.heads, self.head_size = attention.n_heads, attention.key_value_proj_dim
        self.bias_module = attention
        self.max_length = max_length  # the cache's first capacity
        self.dtype = encoder_hidden.dtype
        self.fixed_shape = fixed_shape
        self.examples = encoder_hidden.shape[0]
        self.padded = source_mask is not None and not bool(source_mask.all())
        self.cache: TimeMajorCache | None = None  # allocated by the first step
        self.length = 0
        self.rows_per_example = 1
        self.expansion: torch.Tensor | None = None  # [N] example of each row, until the first step applies it

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Unscaled attention with an additive bias, computed as the model's attention implementation computes it:
        query ``[R, H, q, d]``, keys and values ``[R, H, t, d]``, bias broadcast to ``[R, H, q, t]``."""
        if self.sdpa:
            return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=1.0)
        weights = (torch.matmul(query, keys.transpose(2, 3)) + bias).softmax(dim=-1)
        return torch.matmul(weights, values)

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """``[B, S, H*d]`` -> ``[B, H, S, d]`` (contiguous, as the attention kernels see transformers' keys)."""
        batch, length = projected.shape[:2]
        return projected.view(batch, length, self.heads, self.head_size).transpose(1, 2).contiguous()

    def _select_cross(self, index: torch.Tensor) -> None:
        """Keep the cross-attention rows ``index`` (in that order)."""
        self.cross_keys = [keys.index_select(0, index) for keys in self.cross_keys]
        self.cross_values = [values.index_select(0, index) for values in self.cross_values]
        if self.padded:
            self.source_bias = self.source_bias.index_select(0, index)

    # ------------------------------------------------------------------ reorder

    def reorder(self, index: torch.Tensor) -> LeanT5State:
        if self.length == 0:
            self.expansion = index if self.expansion is None else self.expansion.index_select(0, index)
            return self
        if index.shape[0] != self.cache.rows:  # whole examples left the batch
            self._drop_examples(index)
        else:
            self.cache.reorder(index, self.length)
        return self

    def _drop_examples(self, index: torch.Tensor) -> None:
        per_example = self.rows_per_example
        self._select_cross(index[::per_example] // per_example)  # [B'] examples in their new order
        self.examples = index.shape[0] // per_example
        self.cache.gather_rows(index, self.length)

    # ------------------------------------------------------------------ step

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """One position for every row: tokens ``[R]`` -> logits ``[R, V]`` (float32); the cache grows by one."""
        if self.length == self.cache.capacity:  # a stopping rule of the caller's went past max_length
            self.cache.grow(self.length)
        if self.fixed_shape:
            if self.bias_table is None or self.bias_table.shape[-1] != self.cache.capacity:
                self.bias_table = self._bias_table(self.cache.capacity, tokens.device)
            position = torch.tensor(self.length, device=tokens.device)
        else:
            position = self.length
        logits = self.decode(tokens, position)
        self.length += 1
        return logits

    def decode(self, tokens: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """The decoder at ``position`` (an int: attention over the filled positions; a 0-d tensor: the fixed-shape
        step, attention over all T positions with the unfilled ones masked, the same shapes at every step)."""
        rows = tokens.shape[0]
        queries_per_key = rows // self.cross_keys[0].shape[0]  # K: an example's rows share its encoder state
        # the modules the step calls get the inputs the model's forward gives them: [R, 1, D], one position per row
        hidden = self.model.decoder.embed_tokens(tokens[:, None])  # [R, 1, D]
        if isinstance(position, torch.Tensor):
            bias = self.bias_table.index_select(1, position.view(1))[None]  # [1, H, 1, T]
        else:
            bias = t5_position_bias(self.bias_module, position, tokens.device)
            bias = bias.view(1, self.heads, 1, position + 1)  # [1, H, 1, t]
        for layer, block in enumerate(self.blocks):
            hidden = _clamp_float16(self._self_attention(block.layer[0], hidden, bias, layer, position))
            hidden = _clamp_float16(self._cross_attention(block.layer[1], hidden, layer, queries_per_key))
            hidden = _clamp_float16(block.layer[2](hidden))
        hidden = self.model.decoder.final_layer_norm(hidden)
        if self.scale is not None:
            hidden = hidden * self.scale
        return self.model.lm_head(hidden).view(rows, -1).float()

    def _bias_table(self, capacity: int, device: torch.device) -> torch.Tensor:
        """The position bias of every query position over every key position ``[H, T, T]``, the model's own
        ``compute_bias`` (the same buckets, so the same values, as one position at a time), future positions
        masked with the dtype's minimum as transformers masks them."""
        table = self.bias_module.compute_bias(capacity, capacity, device=device)[0]
        future = torch.ones((capacity, capacity), dtype=torch.bool, device=device).triu(1)
        return table.masked_fill(future, torch.finfo(table.dtype).min)

    def _self_attention(self, sublayer: Any, hidden: torch.Tensor, bias: torch.Tensor, layer: int,
                        position: int | torch.Tensor) -> torch.Tensor:
        attention = sublayer.SelfAttention
        normed = sublayer.layer_norm(hidden)
        rows, heads, size = hidden.shape[0], self.heads, self.head_size
        keys, values = self.cache.write(layer, position, attention.k(normed).view(rows, heads, size),
                                        attention.v(normed).view(rows, heads, size))  # [N, H, t, d]
        query = attention.q(normed).view(rows, 1, heads, size).transpose(1, 2)  # [N, H, 1, d]
        mixed = self.attend(query, keys, values, bias).view(rows, 1, heads * size)
        return hidden + attention.o(mixed)

    def _cross_attention(self, sublayer: Any, hidden: torch.Tensor, layer: int, queries_per_key: int) -> torch.Tensor:
        """Each row attends to its example's keys and values ``[B, H, S, d]``. By default one kernel call per row
        slot (the j-th row of every example): each (example, head) is then computed by the kernel transformers
        calls over keys copied to every row (on other row counts, so equal to float precision, not bitwise).
        With ``share_encoder_state`` one call takes an example's K rows as K query positions (faster, other
        rounding)."""
        attention = sublayer.EncDecAttention
        normed = sublayer.layer_norm(hidden)
        keys, values = self.cross_keys[layer], self.cross_values[layer]  # [B, H, S, d]
        examples, heads, size = keys.shape[0], self.heads, self.head_size
        query = attention.q(normed).view(examples, queries_per_key, heads, size)  # [B, K, H, d]
        if self.share_encoder_state or queries_per_key == 1:
            mixed = self.attend(query.transpose(1, 2), keys, values, self.source_bias).transpose(1, 2)  # [B, K, H, d]
        else:
            slots = [self.attend(query[:, j, :, None], keys, values, self.source_bias)  # [B, H, 1, d]
                     for j in range(queries_per_key)]
            mixed = torch.stack(slots, dim=1)  # [B, K, H, 1, d]
        return hidden + attention.o(mixed.reshape(-1, 1, heads * size))

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first call: the given tokens ``[N, t0]`` of each example once, then the cache copied to its rows."""
        expansion = self.expansion
        rows = tokens.shape[0]
        if expansion is None:
            expansion = torch.arange(rows, device=tokens.device)
        first = torch.searchsorted(expansion, torch.arange(self.examples, device=expansion.device))
        tokens = tokens.index_select(0, first)  # [B, t0]: one row per example
        self.cache = self._empty_cache(tokens.device)
        for column in range(tokens.shape[1]):
            logits = self.forward(tokens[:, column])
        self.rows_per_example = rows // self.examples
        self.expansion = None
        if rows == self.examples:  # one row per example (greedy): the sorted expansion is the identity
            return logits
        self.cache.gather_rows(expansion, self.length)
        return logits.index_select(0, expansion)

    def _empty_cache(self, device: torch.device) -> TimeMajorCache:
        """The self-attention cache for one row per example, ``max_length`` positions."""
        shape = (self.max_length, self.examples, self.heads, self.head_size)
        return TimeMajorCache.empty(len(self.blocks), shape, self.dtype, device, zeroed=self.fixed_shape)


def lean_t5_step(tokens: torch.Tensor, state: LeanT5State) -> tuple[torch.Tensor, LeanT5State]:
    """The step function: the whole decoder prompt first (once per example), then the last token of each row."""
    if state.length == 0:
        return state.prefill(tokens), state
    return state.forward(tokens[:, -1]), state


lean_t5_step.fresh_logits = True  # the output layer's new tensor (see loop.decode)
