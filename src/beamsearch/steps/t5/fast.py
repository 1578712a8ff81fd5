"""The fast T5 step, the default for float32 T5 models on the CPU (``lean_step=None`` or ``"fast"``): the lean
step's reorders, with packed weights, fused products and an attention written for one query over a short,
time-major cache.

Where the lean step (``lean.py``, ``lean_step=True``) calls the model's own modules so that its logits equal
``model(...)`` bit for bit, this step trades that equality for fewer, larger kernels per step (the profile of a
G2P decode, ``benchmarks/profile_g2p.py``, showed a third of the lean step's time in attention kernels built for
long queries and in the small operations around the matrix products):

- each layer norm's gain is folded into the weights of the products that follow it (``W diag(g)``), so a norm
  is one ``rms_norm`` without a weight; the final norm's gain and T5's output scale fold into the output layer;
- the self-attention's query, key and value products are one product with the three weights stacked, and the
  key and value columns go to the cache in one copy (:class:`~..caches.StackedTimeMajorCache`, every layer in
  one buffer, reordered in one gather);
- the residual additions and the feed-forward ReLU run inside the products (oneDNN post-ops, ``addmm``);
- attention over the cache is elementwise: scores ``[t, N, H]`` as a product summed over the head size, a
  softmax over the positions, the values summed with those weights, reading the time-major cache as it lies
  (one query per row, a few dozen positions: a matrix-product kernel per row and head costs more than the
  arithmetic); cross-attention reads the example's keys ``[S, B, H, d]`` in the same way for its K rows;
- the relative position bias of every position is computed once per decode, the model's own ``compute_bias``;
- the weights are packed once per model (and again only when its parameters change); the encoder
  (:func:`fast_t5_encode`) runs its products on the source tokens only, not on the padding (attention alone sees
  the padded ``[B, S]`` layout), and the cross-attention keys and values of all layers are one product over those
  tokens.

Results: the same computation in another order of float operations, so scores equal the lean step's to float
rounding (about 1e-5 on logits of the G2P model) and tokens equal wherever no near-tie flips. int8 models
(:func:`beamsearch.quantize_int8`) run their folded, stacked weights through the same dynamic int8 product,
quantized per output row (opt-in: ``lean_step="fast"``; by default they take the lean step, whose products are
the quantized model's own). ``benchmarks/g2p_speed.py`` measures both against CTranslate2 and counts the words
whose best output changes.

Legend: B batch, K rows per example, N = B*K, H heads, d head size, D = H*d, S source length, M source tokens
(padding left out), t positions filled, T cache capacity, L layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..caches import StackedTimeMajorCache
from ..gate import ACTIVATION, INT8_LINEAR, Plan
from .lean import LEAN_T5, LeanT5State
from .native import NativeDecoder, native_encoder
from .packed import fast_weights, forget_weights, is_int8, run_feed_forward  # noqa: F401 (re-exported)


def _stack_plan(stack: str, feed_forward: int) -> dict[str, tuple]:
    """The fast step's modules of one T5 stack (``encoder``: the feed-forward sub-layer is ``layer.1``; ``decoder``:
    ``layer.2``, after the cross-attention): every one computed from its packed weights."""
    linear, norm, dropout = (torch.nn.Linear, *INT8_LINEAR), ("{}LayerNorm",), (torch.nn.Dropout,)
    block = f"{stack}.block.*.layer"
    dense = f"{block}.{feed_forward}.DenseReluDense"
    plan = {
        stack: ("{}Stack",), f"{stack}.embed_tokens": (torch.nn.Embedding,), f"{stack}.block": (torch.nn.ModuleList,),
        f"{stack}.block.*": ("{}Block",), block: (torch.nn.ModuleList,), f"{stack}.final_layer_norm": norm,
        f"{stack}.dropout": dropout,
        f"{block}.0": ("{}LayerSelfAttention",), f"{block}.0.SelfAttention": ("{}Attention",),
        f"{block}.0.SelfAttention.relative_attention_bias": (torch.nn.Embedding,),
        f"{block}.{feed_forward}": ("{}LayerFF",), dense: ("{}DenseActDense", "{}DenseGatedActDense"),
        f"{dense}.act": (ACTIVATION,), f"{dense}.dropout": dropout,
        **{f"{dense}.{name}": linear for name in ("wi", "wi_0", "wi_1", "wo")},
        **{f"{block}.0.SelfAttention.{name}": linear for name in "qkvo"},
        **{f"{block}.{i}.{name}": kind for i in (0, feed_forward) for name, kind in (("layer_norm", norm),
                                                                                      ("dropout", dropout))},
    }
    if stack == "decoder":
        plan.update({f"{block}.1": ("{}LayerCrossAttention",), f"{block}.1.EncDecAttention": ("{}Attention",),
                     f"{block}.1.layer_norm": norm, f"{block}.1.dropout": dropout,
                     **{f"{block}.1.EncDecAttention.{name}": linear for name in "qkvo"}})
    return plan


# The fast step computes every module of the model itself, from weights packed once (the encoder too: the fast
# encoder); it calls none as a module on the model's own inputs.
FAST_T5 = Plan(
    step="the fast T5 step",
    roots=LEAN_T5.roots,
    suffix=LEAN_T5.suffix,
    computed={"shared": (torch.nn.Embedding,), "lm_head": (torch.nn.Linear, *INT8_LINEAR),
              **_stack_plan("encoder", 1), **_stack_plan("decoder", 2)},
    called=frozenset(),
    repeated=frozenset({"encoder.block", "decoder.block"}),
)


def fast_t5_reason(model: Any) -> str | None:
    """Why the fast step cannot run this T5 model (beyond the lean step's own conditions; None: it can)."""
    dtype = model.decoder.embed_tokens.weight.dtype
    if dtype != torch.float32 and not is_int8(model.decoder.block[0].layer[0].SelfAttention.q):
        return f"the model's dtype is {dtype} (the fast step computes float32 and int8)"
    for stack in (model.encoder, model.decoder):
        if not all(hasattr(block.layer[-1], "DenseReluDense") for block in stack.block):
            return "a feed-forward block is not T5's DenseReluDense"
    return None


def _norm(hidden: torch.Tensor, epsilon: float) -> torch.Tensor:
    return F.rms_norm(hidden, (hidden.shape[-1],), eps=epsilon)


def _token_rows(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The flat positions ``b*S + s`` of the source tokens ``[M]`` (None: no padding, every position)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.reshape(-1).nonzero().squeeze(1)


def fast_t5_encode(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """T5's encoder with the packed weights: ``input_ids [B, S]`` -> last hidden state ``[B, S, D]`` (float32;
    equal to the model's encoder to float rounding at the source tokens, zeros at the padding).

    Norms, products and residuals run on the M source tokens only. Attention scatters each layer's queries, keys
    and values into a zeroed padded buffer (made once per call) and runs two batched products with the position
    bias and the padding mask added in the first (on these short sources 2x faster than
    ``scaled_dot_product_attention``'s CPU kernel), then gathers the tokens' rows back."""
    weights = fast_weights(model)
    encoder = model.encoder
    heads, size, epsilon = weights.heads, weights.head_size, weights.encoder_epsilon
    batch, length = input_ids.shape
    bias = weights.encoder_bias_module.compute_bias(length, length, device=input_ids.device)  # [1, H, S, S]
    if attention_mask is not None and not bool(attention_mask.all()):
        bias = bias.masked_fill((attention_mask == 0)[:, None, None, :], torch.finfo(bias.dtype).min)  # [B, H, S, S]
        examples, positions = attention_mask.nonzero(as_tuple=True)  # [M] each: the source tokens
        ids = input_ids[examples, positions]
    else:
        examples = torch.arange(batch, device=input_ids.device).repeat_interleave(length)
        positions = torch.arange(length, device=input_ids.device).repeat(batch)
        ids = input_ids.reshape(-1)
    # the bias transposed, [B*H, S keys, S queries]: the softmax runs over the middle dimension, vectorized along
    # the queries (along the last dimension, PyTorch's CPU softmax is 2-4x slower on rows of fewer than 16 keys)
    bias = bias.transpose(-1, -2).expand(batch, heads, length, length).reshape(batch * heads, length, length)
    rows = examples * length + positions  # [M]: the tokens' rows of the padded [B*S] layout
    hidden = encoder.embed_tokens(ids)  # [M, D]
    padded = hidden.new_zeros((batch * length, 3 * hidden.shape[1]))  # [B*S, 3D]: the padding stays zero
    for packed in weights.encoder_layers:
        padded.index_copy_(0, rows, packed["qkv"](_norm(hidden, epsilon)))
        spread = padded.view(batch, length, 3, heads, size).permute(2, 0, 3, 1, 4).reshape(3, batch * heads, length,
                                                                                          size)
        query, key, value = spread.unbind(0)  # [B*H, S, d] each
        weights_ = torch.baddbmm(bias, key, query.transpose(1, 2)).softmax(1)  # [B*H, S keys, S queries]
        mixed = torch.bmm(weights_.transpose(1, 2), value).view(batch, heads, length, size)
        mixed = mixed.permute(0, 2, 1, 3)[examples, positions].reshape(-1, heads * size)  # [M, D]
        hidden = packed["self_out"].add_to(mixed, hidden)
        hidden = run_feed_forward(packed, _norm(hidden, epsilon), hidden)
    hidden = encoder.final_layer_norm(hidden)
    out = hidden.new_zeros((batch, length, hidden.shape[1]))
    out[examples, positions] = hidden
    return out


class FastT5State(LeanT5State):
    """The lean T5 state with packed weights and elementwise attention (see the module docstring).

    Eager (``native=False``): its cross-attention keys and values are one time-major buffer ``[S, B, L, 2, H, d]``
    (zeros at the padding), its source bias ``[S, B, 1, 1]`` (None without padding); the self-attention cache is a
    :class:`StackedTimeMajorCache` ``[T, N, L, 2, H, d]``, reordered by the lean state's rules.

    Native (``native=True``, the chooser's default where :func:`~.native.native_reason` allows): the cache's place
    holds a :class:`~.native.NativeDecoder`, which computes each step in one C++ call, keeps the cross-attention
    state itself and records the reorders that the lean state's rules hand it, applying them inside its next call.
    """

    def __init__(self, model: Any, encoder_hidden: torch.Tensor, source_mask: torch.Tensor | None, max_length: int,
                 native: bool = False):
        self._start(model, encoder_hidden, source_mask, max_length, fixed_shape=False)
        self.weights = fast_weights(model)
        self.native = NativeDecoder(model, encoder_hidden, source_mask, max_length, self.weights) if native else None
        if self.native is not None:
            return
        batch, length, width = encoder_hidden.shape
        layers = len(self.blocks)
        # the time-major positions s*B + b and the batch-major rows b*S + s they come from, tokens only: one product
        # over the contiguous gathered rows (a transposed input costs oneDNN twice the time) lands time-major
        sources = torch.arange(batch * length, device=encoder_hidden.device).view(batch, length).t().reshape(-1)
        positions = _token_rows(source_mask.t() if self.padded else None)  # [M] time-major, None: all
        if positions is not None:
            sources = sources.index_select(0, positions)
        tokens = encoder_hidden.reshape(batch * length, width).index_select(0, sources)  # [M, D] time-major
        projected = self.weights.cross_keys_values(tokens)  # [M, 2L*D]
        if positions is not None:
            projected = projected.new_zeros((length * batch, projected.shape[1])).index_copy_(0, positions, projected)
        self.source_bias = None  # [S, B, 1, 1] additive, with padding only
        if self.padded:
            blocked = (source_mask == 0).t()[:, :, None, None]
            self.source_bias = torch.zeros(blocked.shape, dtype=self.dtype, device=blocked.device)
            self.source_bias.masked_fill_(blocked, torch.finfo(self.dtype).min)
        self._set_cross(projected.view(length, batch, layers, 2, self.heads, self.head_size))
        self.position_bias: torch.Tensor | None = None  # [T, T, H]: query position, key position, head

    def _set_cross(self, cross: torch.Tensor) -> None:
        """The cross-attention keys and values ``[S, B, L, 2, H, d]``, and each layer's keys ``[S, B, 1, H, d]``."""
        self.cross = cross
        self.cross_keys = [both[:, :, None, 0] for both in cross.unbind(2)]
        self.cross_rows = cross.view(-1, cross.shape[-1])  # the values' table for embedding_bag: rows of d
        self.cross_values: tuple | None = None  # made by the first step (K known)

    def _cross_value_rows(self, per_example: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The rows of the values (``cross`` as rows of d) for ``embedding_bag``, per layer ``[B*K*H*S]`` ordered by
        bag (example b, its row k, head h) then source position s, and the bags' offsets ``[B*K*H]``."""
        if self.cross_values is None or self.cross_values[0] != per_example:
            length, examples, layers, _, heads, _ = self.cross.shape
            device = self.cross.device
            source = torch.arange(length, device=device) * (examples * layers * 2 * heads)  # [S]
            example = torch.arange(examples, device=device)[:, None, None] * (layers * 2 * heads)  # [B, 1, 1]
            layer = torch.arange(layers, device=device)[:, None, None, None, None] * (2 * heads)
            head = heads + torch.arange(heads, device=device)[:, None]  # [H, 1]: the values' half
            index = (layer + example[:, None] + head + source).expand(layers, examples, per_example, heads, length)
            offsets = torch.arange(0, examples * per_example * heads * length, length, device=device)
            self.cross_values = (per_example, index.reshape(layers, -1).unbind(0), offsets)
        return self.cross_values[1], self.cross_values[2]

    def _empty_cache(self, device: torch.device) -> StackedTimeMajorCache | NativeDecoder:
        if self.native is not None:
            return self.native
        shape = (self.max_length, self.examples, len(self.blocks), 2, self.heads, self.head_size)
        return StackedTimeMajorCache.empty(shape, self.dtype, device)

    def _select_cross(self, index: torch.Tensor) -> None:
        if self.native is not None:  # the native decoder follows each row's example through the parents
            return
        self._set_cross(self.cross.index_select(1, index))
        if self.source_bias is not None:
            self.source_bias = self.source_bias.index_select(1, index)

    def decode(self, tokens: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """The decoder at ``position`` (an int; the fast step has no fixed-shape variant): logits ``[N, V]``."""
        if self.native is not None:
            return self.native.step(tokens)
        capacity = self.cache.capacity
        if self.position_bias is None or self.position_bias.shape[0] != capacity:
            table = self.bias_module.compute_bias(capacity, capacity, device=tokens.device)[0]  # [H, T, T]
            self.position_bias = table.permute(1, 2, 0).contiguous()
        bias = self.position_bias[position, : position + 1, None, :]  # [t, 1, H]
        epsilon = self.weights.epsilon
        values = self.cache.value_rows(position + 1)
        cross_values = self._cross_value_rows(tokens.shape[0] // self.cross.shape[1])
        hidden = self.model.decoder.embed_tokens(tokens)  # [N, D]
        for layer, packed in enumerate(self.weights.decoder_layers):
            hidden = self._self_attention(packed, hidden, bias, layer, position, values)
            hidden = self._cross_attention(packed, hidden, layer, cross_values)
            hidden = run_feed_forward(packed, _norm(hidden, epsilon), hidden)
        return self.weights.output(_norm(hidden, epsilon)).float()

    def _self_attention(self, packed: dict[str, Any], hidden: torch.Tensor, bias: torch.Tensor, layer: int,
                        position: int, values: tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]
                        ) -> torch.Tensor:
        """``hidden [N, D]`` plus the self-attention of its norm over the cache up to ``position``: the scores
        elementwise over the time-major keys, the values summed with their weights by ``embedding_bag`` (a gather
        and a weighted sum in one kernel, no ``[t, N, H, d]`` product in memory)."""
        rows, heads, size = hidden.shape[0], self.heads, self.head_size
        qkv = packed["qkv"](_norm(hidden, self.weights.epsilon)).view(rows, 3, heads, size)  # query, key, value
        keys, _ = self.cache.write(layer, position, qkv[:, 1:])  # [t, N, H, d]
        scores = (keys * qkv[:, 0]).sum(-1).add_(bias)  # [t, N, H]
        weights = scores.softmax(0).permute(1, 2, 0).reshape(-1)  # [N*H*t]: bag (n, h), then position
        table, index, offsets = values
        mixed = F.embedding_bag(index[layer], table, offsets, mode="sum", per_sample_weights=weights)  # [N*H, d]
        return packed["self_out"].add_to(mixed.view(rows, heads * size), hidden)

    def _cross_attention(self, packed: dict[str, Any], hidden: torch.Tensor, layer: int,
                         values: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> torch.Tensor:
        """``hidden [N, D]`` plus each row's attention over its example's encoder state (the values summed by
        ``embedding_bag``, as in self-attention)."""
        rows, heads, size = hidden.shape[0], self.heads, self.head_size
        keys = self.cross_keys[layer]  # [S, B, 1, H, d]
        examples = keys.shape[1]
        query = packed["cross_query"](_norm(hidden, self.weights.epsilon))
        scores = (keys * query.view(examples, rows // examples, heads, size)).sum(-1)  # [S, B, K, H]
        if self.source_bias is not None:
            scores.add_(self.source_bias)  # [S, B, 1, 1]
        weights = scores.softmax(0).permute(1, 2, 3, 0).reshape(-1)  # [B*K*H*S]: bag (b, k, h), then position
        index, offsets = values
        mixed = F.embedding_bag(index[layer], self.cross_rows, offsets, mode="sum",
                                per_sample_weights=weights)  # [B*K*H, d]
        return packed["cross_out"].add_to(mixed.view(rows, heads * size), hidden)


def fast_encoder(model: Any) -> Any:
    """The encode function :func:`beamsearch.adapters.hf_inputs.prepare` takes, for a model the fast step can run
    (None otherwise: the step then names why): the native encoder where the native step can run the model
    (:func:`~.native.native_reason`), else the eager one."""
    if getattr(model.config, "model_type", None) not in ("t5", "mt5") or model.training:
        return None
    if fast_t5_reason(model) is not None:
        return None
    native = native_encoder(model)
    if native is not None:
        return native
    return lambda input_ids, attention_mask: fast_t5_encode(model, input_ids, attention_mask)
