"""The fast T5 step's weights (``fast.py``): folded, stacked, packed once per model, and the products that run them.

Legend: M rows of a product (tokens or decoder rows), D model width, F feed-forward width.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..gate import WeightStamp
from .lean import _output_scale


class PackedLinear:
    """``x @ W.T`` for a weight made here (folded, stacked), in float or dynamic int8 like the model's layers, with the
    ReLU after it or a residual added to it in the same call where the backend fuses them.

    float32 on the CPU: the weight is also reordered once into oneDNN's blocked layout, and a product runs through
    oneDNN when it is large enough to repay oneDNN's call overhead (about 20 us): a weight of 512k values or more,
    or 4M multiply-adds; oneDNN then applies the ReLU or the residual addition as post-ops of the product. Measured
    on this project's 2-core AMD machine, one thread: oneDNN 25-30% faster than MKL's ``sgemm`` (which re-packs the
    weight at every call) at 64-900 rows of G2P-sized weights, 2x on a t5-small output layer at 1-16 rows; MKL
    faster for small weights at few rows (192 x 101 below 128 rows), where the residual goes through ``addmm``."""

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
            self.int8_weight = quantized.int_repr()  # [out, in]: the native step's copy (native.py)
            self.int8_scales = quantized.q_per_channel_scales().float()  # [out]
            return
        self.weight = weight.contiguous()  # [out, in]
        self.weight_t = self.weight.t()  # [in, out], a view (addmm's transposed operand)
        self.work = self.weight.shape[0]  # multiply-adds per input value
        self.onednn_wanted = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32 \
            and _onednn_available()
        if self.onednn_wanted and self.weight.numel() >= self.ONEDNN_MIN_WEIGHT:
            self.work = self.ONEDNN_MIN_WORK  # oneDNN at every row count

    def _use_onednn(self, x: torch.Tensor) -> bool:
        """Whether this product goes to oneDNN; never under ``torch.compile`` (inductor cannot lower the reordered
        weight's call; it picks its own kernels for ``F.linear`` and ``addmm``). The weight is reordered into
        oneDNN's layout at its first such product (the native step, ``native.py``, never makes one: its copy of the
        weights is its own)."""
        if not self.onednn_wanted or x.numel() * self.work < self.ONEDNN_MIN_WORK or torch.compiler.is_compiling():
            return False
        if self.onednn is None:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        return True

    def __call__(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """``x [M, in]`` -> ``[M, out]``, with ``relu`` the ReLU of it."""
        if self.int8:
            if relu:
                return torch.ops.quantized.linear_relu_dynamic(x, self.packed, True)
            return torch.ops.quantized.linear_dynamic(x, self.packed, True)
        if self._use_onednn(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, None, "relu" if relu else "none", [], "")
        out = F.linear(x, self.weight)
        return out.relu_() if relu else out

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T`` (a new tensor): ``x [M, in]``, ``residual [M, out]`` contiguous."""
        if self.int8:
            return torch.ops.quantized.linear_dynamic(x, self.packed, True).add_(residual)
        if self._use_onednn(x):
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.onednn, None, "add")
        return torch.addmm(residual, x, self.weight_t)


def _onednn_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
                and hasattr(mkldnn, "_linear_pointwise"))


def is_int8(linear: Any) -> bool:
    """Whether a linear layer is torch.ao's dynamic int8 Linear (its ``weight()`` is the quantized tensor)."""
    return callable(linear.weight)


def _weight(linear: Any) -> tuple[torch.Tensor, bool]:
    """A linear layer's float weight ``[out, in]`` and whether the layer is dynamic int8 (dequantized then)."""
    if is_int8(linear):
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


def _self_attention(sublayer: Any) -> dict[str, PackedLinear]:
    """A self-attention sublayer's products: query, key and value stacked after its norm, and its output."""
    attention = sublayer.SelfAttention
    return {"qkv": _packed([attention.q, attention.k, attention.v], sublayer.layer_norm.weight),
            "self_out": _packed([attention.o])}


def _feed_forward(sublayer: Any) -> dict[str, Any]:
    dense = sublayer.DenseReluDense
    gated = hasattr(dense, "wi_0")
    return {"inner": _packed([dense.wi_0, dense.wi_1] if gated else [dense.wi], sublayer.layer_norm.weight),
            "gated": gated, "act": dense.act, "relu": type(dense.act) is torch.nn.ReLU, "outer": _packed([dense.wo])}


def run_feed_forward(packed: dict[str, Any], normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual`` plus the feed-forward block of its norm ``normed [M, D]``."""
    if packed["gated"]:
        gate, linear = packed["inner"](normed).chunk(2, dim=-1)  # [M, F] each
        return packed["outer"].add_to(packed["act"](gate) * linear, residual)
    if packed["relu"]:
        return packed["outer"].add_to(packed["inner"](normed, relu=True), residual)
    return packed["outer"].add_to(packed["act"](packed["inner"](normed)), residual)


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
        # every layer's cross-attention keys and values from the encoder output in one product: [2L*D, D], ordered
        # (layer, key or value, head, position in head) as the fast state's [S, B, L, 2, H, d] buffer
        self.cross_keys_values = _packed([linear for block in decoder.block
                                          for linear in (block.layer[1].EncDecAttention.k,
                                                         block.layer[1].EncDecAttention.v)])
        self.output = _packed([model.lm_head], decoder.final_layer_norm.weight, _output_scale(model))
        self.encoder_layers = [{**_self_attention(block.layer[0]), **_feed_forward(block.layer[1])}
                               for block in encoder.block]
        self.epsilon = decoder.final_layer_norm.variance_epsilon
        self.encoder_epsilon = encoder.final_layer_norm.variance_epsilon
        self.encoder_bias_module = encoder.block[0].layer[0].SelfAttention  # its relative position bias
        self.heads = self.encoder_bias_module.n_heads
        self.head_size = self.encoder_bias_module.key_value_proj_dim
        self.native: Any = None  # the native step's copy of these weights (native.py), made at its first use
        self.native_bias: dict[int, torch.Tensor] = {}  # the native encoder's position bias [H, S, S] by length S


_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (stamp, weights)


# model id -> the packed weights checked in this generate call (set by one_check_per_call; None: outside one)
_CHECKED: contextvars.ContextVar[dict[int, FastT5Weights] | None] = contextvars.ContextVar("checked", default=None)


@contextlib.contextmanager
def one_check_per_call() -> Iterator[None]:
    """Within it, :func:`fast_weights` checks a model's weights once: the encoder and the decoder state of one
    ``generate`` call are made one after the other with no code of the user's between them, and the check reads every
    copied weight (about 3 ms on the G2P model, 30 ms on t5-small's shape). Each call (each sub-batch of
    ``max_rows``) opens its own."""
    token = _CHECKED.set({})
    try:
        yield
    finally:
        _CHECKED.reset(token)


def fast_weights(model: Any) -> FastT5Weights:
    """The packed weights of ``model``, made on the first call and again whenever the model no longer holds what
    they were packed from (:class:`~beamsearch.steps.gate.WeightStamp`: a parameter updated in place, as by an
    optimizer step or ``load_state_dict``, or through ``.data`` as by PEFT's merges; a parameter or module replaced, as
    by ``load_state_dict(assign=True)`` or ``set_output_embeddings``; a move or a cast); checked once per call inside
    :func:`one_check_per_call`."""
    checked = _CHECKED.get()
    if checked is not None and id(model) in checked:
        return checked[id(model)]
    cached = _WEIGHTS.get(model)
    if cached is not None and cached[0].current(model):
        weights = cached[1]
    else:
        weights = FastT5Weights(model)
        _WEIGHTS[model] = (WeightStamp(model, contents=_copied(model)), weights)
    if checked is not None:
        checked[id(model)] = weights
    return weights


def _copied(model: Any) -> list[torch.Tensor]:
    """The float tensors the packed weights are copies of: every parameter but the embeddings, which the fast step
    reads from the model as they are (token embeddings, relative position biases); int8 layers' weights are packed
    objects of their modules (the stamp holds those)."""
    seen: set[int] = set()
    copied = []
    for name, parameter in model.named_parameters(remove_duplicate=False):  # a tied output layer by its own name
        if name.endswith(("shared.weight", "embed_tokens.weight", "relative_attention_bias.weight")):
            continue
        if id(parameter) not in seen:
            seen.add(id(parameter))
            copied.append(parameter)
    return copied


def forget_weights(model: Any) -> None:
    """Drop the packed weights of ``model`` (the next fast step packs them again)."""
    _WEIGHTS.pop(model, None)
