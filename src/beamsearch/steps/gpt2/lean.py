"""A lean decoder step for GPT-2: the model's own modules, its attention computed as it computes it, and a
preallocated time-major cache.

The generic Hugging Face step calls ``model(...)`` once per step; for GPT-2 on CPU much of the time outside
the matrix products goes to the ``DynamicCache`` (``torch.cat`` copies the whole cache of every layer at every
step) and to the beam reorder (which copies it again, prompt included). This step runs the prompt once per
example through the model's own forward (``hf_compat.prefill``, as the generic step does), copies the cache it
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
  ``model(...)`` to float precision (the cache has other shapes, so not bitwise; ``exact_parity=True`` in
  :func:`beamsearch.generate` is the bitwise mode).

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

from ...hf_compat import gpt2_attention_scaling
from ..gate import Plan, refusal
from ..lean_decoder import LeanDecoderState, call_reason, lean_decoder_step

# The modules the lean GPT-2 step computes itself (the model's stack, blocks and attention, whose dropouts it skips in
# eval mode) and those it calls as modules on the inputs the model's forward gives them (embeddings, norms, the
# attention's products, the MLP, the output layer).
LEAN_GPT2 = Plan(
    step="the lean GPT-2 step",
    roots=("GPT2LMHeadModel",),
    suffix="LMHeadModel",
    computed={"transformer": ("{}Model",), "transformer.drop": (torch.nn.Dropout,),
              "transformer.h": (torch.nn.ModuleList,), "transformer.h.*": ("{}Block",),
              "transformer.h.*.attn": ("{}Attention",), "transformer.h.*.attn.attn_dropout": (torch.nn.Dropout,),
              "transformer.h.*.attn.resid_dropout": (torch.nn.Dropout,)},
    called=frozenset({"lm_head", "transformer.wte", "transformer.wpe", "transformer.ln_f", "transformer.h.*.ln_1",
                      "transformer.h.*.ln_2", "transformer.h.*.mlp", "transformer.h.*.attn.c_attn",
                      "transformer.h.*.attn.c_proj"}),
    repeated=frozenset({"transformer.h"}),
)


def lean_gpt2_reason(model: Any, model_kwargs: dict[str, Any], needs_attention: bool,
                     plan: Plan = LEAN_GPT2) -> str | None:
    """Why the lean step cannot run this model and call (None: it can); ``plan``: the gate to pass last (the
    graph-safe step passes its own)."""
    config = model.config
    if getattr(config, "model_type", None) != "gpt2":
        return f"model_type {getattr(config, 'model_type', None)!r} is not GPT-2"
    from transformers import GPT2LMHeadModel  # only Hugging Face models reach this

    if type(model) is not GPT2LMHeadModel:
        return f"{type(model).__name__} is not GPT2LMHeadModel"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("eager", "sdpa"):
        return f"attention implementation {implementation!r} (the lean step computes 'eager' and 'sdpa')"
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(config, flag, False):
            return f"config.{flag} is set"
    if not getattr(config, "is_causal", True):
        return "config.is_causal is False (bidirectional attention)"
    return call_reason(model, model_kwargs, needs_attention) or refusal(model, plan)


class LeanGPT2State(LeanDecoderState):
    """Decoder state of a GPT-2 model between steps (see :class:`LeanDecoderState`); the cache holds the H heads."""

    def __init__(self, model: Any, model_kwargs: dict[str, Any], generation_config: Any, max_length: int,
                 fixed_shape: bool = False):
        self.blocks = list(model.transformer.h)
        attention = self.blocks[0].attn
        self.heads, self.width = attention.num_heads, attention.split_size
        self.scaling = gpt2_attention_scaling(attention)
        super().__init__(model, model_kwargs, generation_config, max_length, cache_heads=self.heads,
                         head_size=attention.head_dim, dtype=model.transformer.wte.weight.dtype,
                         fixed_shape=fixed_shape)

    def decode(self, tokens: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """The decoder at ``position`` for every row: tokens ``[N]`` -> logits ``[N, V]`` (float32)."""
        rows = tokens.shape[0]
        transformer = self.model.transformer
        hidden = transformer.wte(tokens[:, None]) + transformer.wpe(self.positions[:, None])  # [N, 1, D]
        mask = self.step_mask(position)  # [N, 1, 1, t] (fixed shape: T)
        for layer, block in enumerate(self.blocks):
            hidden = self._attention(block.attn, block.ln_1(hidden), layer, position, mask) + hidden
            hidden = hidden + block.mlp(block.ln_2(hidden))
        hidden = transformer.ln_f(hidden)
        return self.model.lm_head(hidden).view(rows, -1).float()

    def _attention(self, attention: Any, normed: torch.Tensor, layer: int, position: int | torch.Tensor,
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


lean_gpt2_step = lean_decoder_step  # the step function (its own name, as the adapter and tests refer to it)
