"""The fast T5 decoder step (``lean_step="fast"``): the lean step's cache and reorders, with packed weights and an
attention written for one query over a short, time-major cache.

Where the lean step (``hf_t5.py``) calls the model's own modules so that its logits equal ``model(...)`` bit for
bit, this step trades that equality for fewer, larger kernels per step (the profile of a G2P decode,
``benchmarks/profile_g2p.py``, shows a third of the lean step's time in attention kernels built for long queries
and in the small operations around the matrix products):

- each layer norm's gain is folded into the weights of the products that follow it (``W diag(g)``), so a norm
  is one ``rms_norm`` without a weight; the final norm's gain and T5's output scale fold into the output layer;
- the self-attention's query, key and value products are one product with the three weights stacked;
- attention over the cache is elementwise: scores ``[t, N, H]`` as a product summed over the head size, a
  softmax over the positions, the values summed with those weights, reading the time-major cache as it lies
  (one query per row, a few dozen positions: a matrix-product kernel per row and head costs more than the
  arithmetic); cross-attention reads the example's keys ``[S, B, H, d]`` in the same way for its K rows;
- the relative position bias of every position is computed once per decode, the model's own ``compute_bias``;
- the weights are packed once per model (and again only when its parameters change), the cross-attention keys
  and values of all layers are one product over the encoder output, and the encoder runs the same way
  (:func:`fast_t5_encode`: stacked query/key/value, folded norms, ``scaled_dot_product_attention`` over the
  whole source).

Results: the same computation in another order of float operations, so scores equal the lean step's to float
rounding (about 1e-5 on logits of the G2P model) and tokens equal wherever no near-tie flips. int8 models
(:func:`beamsearch.quantize_int8`) run their folded, stacked weights through the same dynamic int8 product,
quantized per output row. ``benchmarks/g2p_speed.py`` measures both against CTranslate2 and counts the words
whose best output changes.

Legend: B batch, K rows per example, N = B*K, H heads, d head size, D = H*d, S source length, t positions filled,
T cache capacity.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from .hf_t5 import LeanT5State, _output_scale


class PackedLinear:
    """``x @ W.T`` for a weight made here (folded, stacked), in float or dynamic int8 like the model's layers.

    float32 on the CPU: the weight is also reordered once into oneDNN's blocked layout, and a product runs through
    oneDNN when it is large enough to repay oneDNN's call overhead (about 20 us): a weight of 512k values or more,
    or 4M multiply-adds. Measured on this project's 2-core AMD machine, one thread: oneDNN 25-30% faster than
    MKL's ``sgemm`` (which re-packs the weight at every call) at 64-900 rows of G2P-sized weights, 2x on a
    t5-small output layer at 1-16 rows; MKL faster for small weights at few rows (192 x 101 below 128 rows)."""

    ONEDNN_MIN_WEIGHT = 1 << 19
    ONEDNN_MIN_WORK = 1 << 22

    def __init__(self, weight: torch.Tensor, int8: bool):
        self.int8 = int8
        self.onednn = None
        if int8:  # per output row (folding a gain into a per-tensor int8 weight would widen its grid)
            scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the deprecation notice of torch's quantized tensors (quantize.py)
                quantized = torch.quantize_per_channel(weight.float().contiguous(), scales.double(), zero_points, 0,
                                                       torch.qint8)
                self.packed = torch.ops.quantized.linear_prepack(quantized, None)
            return
        self.weight = weight.contiguous()
        if self.weight.device.type == "cpu" and self.weight.dtype == torch.float32 and _onednn_available():
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8:
            return torch.ops.quantized.linear_dynamic(x, self.packed, True)
        if self.onednn is not None and (self.weight.numel() >= self.ONEDNN_MIN_WEIGHT
                                        or x.numel() * self.weight.shape[0] >= self.ONEDNN_MIN_WORK):
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, None, "none", [], "")
        return F.linear(x, self.weight)


def _onednn_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
                and hasattr(mkldnn, "_linear_pointwise"))


def _is_int8(linear: Any) -> bool:
    """Whether a linear layer is torch.ao's dynamic int8 Linear (its ``weight()`` is the quantized tensor)."""
    return callable(linear.weight)


def _weight(linear: Any) -> tuple[torch.Tensor, bool]:
    """A linear layer's float weight ``[out, in]`` and whether the layer is dynamic int8 (dequantized then)."""
    if _is_int8(linear):
        return linear.weight().dequantize(), True
    return linear.weight.detach(), False


def _packed(linears: list[Any], gain: torch.Tensor | None = None, scale: float | None = None) -> PackedLinear:
    """The layers' weights stacked by output (one product), each multiplied by the norm ``gain`` of its input."""
    weights, int8 = zip(*(_weight(linear) for linear in linears), strict=True)
    weight = torch.cat(weights, dim=0)
    if gain is not None:
        weight = weight * gain.detach()[None, :].to(weight.dtype)
    if scale is not None:
        weight = weight * scale
    return PackedLinear(weight, int8=all(int8))


def fast_t5_reason(model: Any) -> str | None:
    """Why the fast step cannot run this T5 model (beyond the lean step's own conditions; None: it can)."""
    dtype = model.decoder.embed_tokens.weight.dtype
    if dtype != torch.float32 and not _is_int8(model.decoder.block[0].layer[0].SelfAttention.q):
        return f"the model's dtype is {dtype} (the fast step computes float32 and int8)"
    for stack in (model.encoder, model.decoder):
        if not all(hasattr(block.layer[-1], "DenseReluDense") for block in stack.block):
            return "a feed-forward block is not T5's DenseReluDense"
    return None


def _self_attention(sublayer: Any) -> dict[str, PackedLinear]:
    """A self-attention sublayer's products: query, key and value stacked after its norm, and its output."""
    attention = sublayer.SelfAttention
    return {"qkv": _packed([attention.q, attention.k, attention.v], sublayer.layer_norm.weight),
            "self_out": _packed([attention.o])}


def _feed_forward(sublayer: Any) -> dict[str, Any]:
    dense = sublayer.DenseReluDense
    gated = hasattr(dense, "wi_0")
    return {"inner": _packed([dense.wi_0, dense.wi_1] if gated else [dense.wi], sublayer.layer_norm.weight),
            "gated": gated, "act": dense.act, "outer": _packed([dense.wo])}


def _run_feed_forward(packed: dict[str, Any], normed: torch.Tensor) -> torch.Tensor:
    inner = packed["inner"](normed)
    if packed["gated"]:
        gate, linear = inner.chunk(2, dim=-1)
        return packed["outer"](packed["act"](gate) * linear)
    return packed["outer"](packed["act"](inner))


class FastT5Weights:
    """A T5 model's weights packed for the fast step and encoder: made once per model by :func:`fast_weights`."""

    def __init__(self, model: Any):
        decoder, encoder = model.decoder, model.encoder
        self.decoder_layers = []
        for block in decoder.block:
            cross = block.layer[1]
            self.decoder_layers.append({
                **_self_attention(block.layer[0]),
                "cross_query": _packed([cross.EncDecAttention.q], cross.layer_norm.weight),
                "cross_out": _packed([cross.EncDecAttention.o]),
                **_feed_forward(block.layer[2]),
            })
        # every layer's cross-attention keys and values from the encoder output in one product: [2L*D, D]
        self.cross_keys_values = _packed([linear for block in decoder.block
                                          for linear in (block.layer[1].EncDecAttention.k,
                                                         block.layer[1].EncDecAttention.v)])
        self.output = _packed([model.lm_head], decoder.final_layer_norm.weight, _output_scale(model))
        self.encoder_layers = [{**_self_attention(block.layer[0]), **_feed_forward(block.layer[1])}
                               for block in encoder.block]
        self.epsilon = decoder.final_layer_norm.variance_epsilon
        self.encoder_epsilon = encoder.final_layer_norm.variance_epsilon


_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (parameters, versions, weights)


def fast_weights(model: Any) -> FastT5Weights:
    """The packed weights of ``model``, made on the first call and again after any of its parameters is updated
    in place (its version changes: an optimizer step, ``load_state_dict``). A parameter replaced by a new tensor
    object is not seen: call :func:`forget_weights` after such surgery."""
    cached = _WEIGHTS.get(model)
    if cached is not None and all(p._version == v for p, v in zip(cached[0], cached[1], strict=True)):
        return cached[2]
    parameters = list(model.parameters())
    weights = FastT5Weights(model)
    _WEIGHTS[model] = (parameters, [p._version for p in parameters], weights)
    return weights


def forget_weights(model: Any) -> None:
    """Drop the packed weights of ``model`` (the next fast step packs them again)."""
    _WEIGHTS.pop(model, None)


def _norm(hidden: torch.Tensor, epsilon: float) -> torch.Tensor:
    return F.rms_norm(hidden, (hidden.shape[-1],), eps=epsilon)


def fast_t5_encode(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """T5's encoder with the packed weights: ``input_ids [B, S]`` -> last hidden state ``[B, S, D]`` (float32;
    equal to the model's encoder to float rounding)."""
    weights = fast_weights(model)
    encoder = model.encoder
    attention = encoder.block[0].layer[0].SelfAttention
    heads, size = attention.n_heads, attention.key_value_proj_dim
    batch, length = input_ids.shape
    hidden = encoder.embed_tokens(input_ids)  # [B, S, D]
    bias = attention.compute_bias(length, length, device=input_ids.device)  # [1, H, S, S]
    if attention_mask is not None and not bool(attention_mask.all()):
        blocked = attention_mask[:, None, None, :] == 0  # [B, 1, 1, S]
        bias = bias.masked_fill(blocked, torch.finfo(hidden.dtype).min)
    for packed in weights.encoder_layers:
        qkv = packed["qkv"](_norm(hidden, weights.encoder_epsilon)).view(batch, length, 3, heads, size)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, S, d]
        mixed = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=1.0)
        hidden = hidden + packed["self_out"](mixed.transpose(1, 2).reshape(batch, length, heads * size))
        hidden = hidden + _run_feed_forward(packed, _norm(hidden, weights.encoder_epsilon))
    return encoder.final_layer_norm(hidden)


class FastT5State(LeanT5State):
    """The lean T5 state with packed weights and elementwise attention (see the module docstring).

    Its cross-attention keys and values are kept time-major ``[S, B, H, d]`` per layer, its source bias
    ``[S, B, 1, 1]`` (None without padding); the cache and its reorders are the lean state's.
    """

    def __init__(self, model: Any, encoder_hidden: torch.Tensor, source_mask: torch.Tensor | None, max_length: int):
        self._start(model, encoder_hidden, source_mask, max_length, fixed_shape=False)
        self.weights = fast_weights(model)
        length = encoder_hidden.shape[1]
        # one product over the contiguous [B, S, D] (a transposed input costs oneDNN twice the time), then
        # each layer's keys and values made time-major [S, B, H, d]
        projected = self.weights.cross_keys_values(encoder_hidden)  # [B, S, 2L*D]
        split = projected.view(self.examples, length, 2 * len(self.blocks), self.heads, self.head_size)
        self.cross_keys = [split[:, :, 2 * layer].transpose(0, 1).contiguous() for layer in range(len(self.blocks))]
        self.cross_values = [split[:, :, 2 * layer + 1].transpose(0, 1).contiguous()
                             for layer in range(len(self.blocks))]
        self.source_bias = None  # [S, B, 1, 1] additive, with padding only
        if self.padded:
            blocked = (source_mask == 0).t()[:, :, None, None]
            self.source_bias = torch.zeros(blocked.shape, dtype=self.dtype, device=blocked.device)
            self.source_bias.masked_fill_(blocked, torch.finfo(self.dtype).min)
        self.position_bias: torch.Tensor | None = None  # [T, T, H]: query position, key position, head

    def _select_cross(self, index: torch.Tensor) -> None:
        self.cross_keys = [keys.index_select(1, index) for keys in self.cross_keys]
        self.cross_values = [values.index_select(1, index) for values in self.cross_values]
        if self.source_bias is not None:
            self.source_bias = self.source_bias.index_select(1, index)

    def decode(self, tokens: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """The decoder at ``position`` (an int; the fast step has no fixed-shape variant): logits ``[N, V]``."""
        capacity = self.cache.capacity
        if self.position_bias is None or self.position_bias.shape[0] != capacity:
            table = self.bias_module.compute_bias(capacity, capacity, device=tokens.device)[0]  # [H, T, T]
            self.position_bias = table.permute(1, 2, 0).contiguous()
        bias = self.position_bias[position, : position + 1, None, :]  # [t, 1, H]
        epsilon = self.weights.epsilon
        hidden = self.model.decoder.embed_tokens(tokens)  # [N, D]
        for layer, packed in enumerate(self.weights.decoder_layers):
            hidden = hidden + self._self_attention(packed, _norm(hidden, epsilon), bias, layer, position)
            hidden = hidden + self._cross_attention(packed, _norm(hidden, epsilon), layer)
            hidden = hidden + _run_feed_forward(packed, _norm(hidden, epsilon))
        return self.weights.output(_norm(hidden, epsilon)).float()

    def _self_attention(self, packed: dict[str, Any], normed: torch.Tensor, bias: torch.Tensor, layer: int,
                        position: int) -> torch.Tensor:
        rows, heads, size = normed.shape[0], self.heads, self.head_size
        query, key, value = packed["qkv"](normed).view(rows, 3, heads, size).unbind(1)  # [N, H, d]
        keys, values = self.cache.keys[layer], self.cache.values[layer]  # [T, N, H, d]
        keys[position], values[position] = key, value
        keys, values = keys[: position + 1], values[: position + 1]  # [t, N, H, d]
        scores = (keys * query).sum(-1) + bias  # [t, N, H]
        mixed = (scores.softmax(0).unsqueeze(-1) * values).sum(0)  # [N, H, d]
        return packed["self_out"](mixed.view(rows, heads * size))

    def _cross_attention(self, packed: dict[str, Any], normed: torch.Tensor, layer: int) -> torch.Tensor:
        rows, heads, size = normed.shape[0], self.heads, self.head_size
        keys, values = self.cross_keys[layer], self.cross_values[layer]  # [S, B, H, d]
        examples = keys.shape[1]
        query = packed["cross_query"](normed).view(examples, rows // examples, heads, size)  # [B, K, H, d]
        scores = (keys[:, :, None] * query).sum(-1)  # [S, B, K, H]
        if self.source_bias is not None:
            scores = scores + self.source_bias  # [S, B, 1, 1]
        mixed = (scores.softmax(0).unsqueeze(-1) * values[:, :, None]).sum(0)  # [B, K, H, d]
        return packed["cross_out"](mixed.reshape(rows, heads * size))


def fast_encoder(model: Any) -> Any:
    """The encode function :func:`beamsearch.adapters.hf_inputs.prepare` takes, for a model the fast step can run
    (None otherwise: the step then names why)."""
    if getattr(model.config, "model_type", None) not in ("t5", "mt5") or model.training:
        return None
    if fast_t5_reason(model) is not None:
        return None
    return lambda input_ids, attention_mask: fast_t5_encode(model, input_ids, attention_mask)
