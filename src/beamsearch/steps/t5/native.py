"""The fast T5 step as one C++ call per decoding step (``native.cpp``), the default for float32 T5 models on the CPU
where a C++ compiler is available.

The eager fast step (``fast.py``) runs about 270 PyTorch operator calls per step, 1.5-2 ms before any arithmetic on
the embedded G2P model. This step computes the same thing, from the same packed weights, in one call: its products
through ATen from C++ (19 per step on a 2-layer model, no Python, no autograd), everything else (norms, attention
over the cache and over the encoder output, ReLU) in plain vectorized loops. The encoder runs the same way
(:func:`native_t5_encode`), on the source tokens only.

- **The cache is never copied.** Each step keeps its own product of every layer's queries, keys and values and,
  per row, the row of the step before that it continues; a row's earlier keys are found by walking that chain once
  per step. The engine's reorders (beams, the expansion to beams, finished examples leaving the batch) are recorded
  in the state's place for the cache (:class:`NativeDecoder`) and handed to the next call as its parent rows.
- **Built at first use** with the beam search's native bookkeeping, as one extension
  (:mod:`beamsearch.extension`: compiled once per machine and cached; where it cannot be built, one warning and the
  eager fast step). **Turned off** by ``BEAMSEARCH_NATIVE=0`` (then the eager fast step runs); with
  ``logging.getLogger("beamsearch").setLevel(logging.DEBUG)`` the chooser says why it did not run a call.

What it runs: any T5 / mT5 model the fast step runs (its gate and conditions, asked first by the chooser) with
ReLU feed-forward blocks, float32 or int8, on the CPU; any head size, number of heads and layers, source length and
length. Results equal the eager fast step's to float rounding (another order of float operations, and a polynomial
``exp`` of relative error 1e-7). int8 models (:func:`beamsearch.quantize_int8`, run with ``lean_step="fast"``): the
same int8 weights as the eager fast step (requantized per output row after folding), but each product's input is
quantized once, per row and symmetric (127 levels), and multiplied in one ``at::_int_mm`` (int32 sums), where the
eager step's torch dynamic int8 products quantize the whole input per tensor: other (finer) activation rounding, so
other results than the eager int8 step's, by the quantization error.

Legend: B batch, K rows per example, N = B*K, V vocabulary, S source length, H heads, T positions of the bias table.
"""

from __future__ import annotations

from typing import Any

import torch

from ...extension import disabled_reason, extension, extension_reason, native_disabled
from ...hf_compat import t5_position_bias
from .packed import fast_weights, is_int8

_INT8: list[bool] = []  # [whether torch._int_mm runs on the CPU], once asked


def native_reason(model: Any) -> str | None:
    """Why the native step cannot run this model (None: it can), beyond the fast step's conditions and gate, which
    the chooser has asked first. Builds the extension on the first call that gets that far."""
    if native_disabled():
        return disabled_reason()
    weight = model.decoder.embed_tokens.weight
    if weight.device.type != "cpu":
        return f"the model is on {weight.device.type} (the native step runs on the CPU)"
    if weight.dtype != torch.float32:
        return f"the model's dtype is {weight.dtype} (the native step computes float32)"
    if is_int8(model.decoder.block[0].layer[0].SelfAttention.q) and not _int8_products():
        return f"torch {torch.__version__} has no int8 matrix product on the CPU (torch._int_mm; the eager fast step " \
               "runs int8)"
    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            activation = getattr(block.layer[-1].DenseReluDense, "act", None)
            if type(activation) is not torch.nn.ReLU:
                return f"the feed-forward activation is {type(activation).__name__} (the native step computes ReLU)"
    return extension_reason()


def _int8_products() -> bool:
    """Whether this torch multiplies int8 matrices on the CPU (``torch._int_mm``, which the int8 products call)."""
    if not _INT8:
        try:
            ones = torch.ones(17, 8, dtype=torch.int8)
            _INT8.append(bool(torch._int_mm(ones, ones.t().contiguous()).eq(8).all()))
        except (AttributeError, RuntimeError, NotImplementedError):
            _INT8.append(False)
    return _INT8[0]


# ---------------------------------------------------------------------------------------------------- the model


def native_weights(model: Any, packed: Any = None) -> Any:
    """The extension's copy of the fast step's packed weights (made once per packing: replaced or updated weights
    are packed again, :func:`~.packed.fast_weights`, and so copied again here). ``packed``: ``fast_weights(model)``
    where the caller has it (each call of ``fast_weights`` checks the model's weights, about 3 ms on the G2P model)."""
    packed = fast_weights(model) if packed is None else packed
    if packed.native is None:
        decoder = [layer[name] for layer in packed.decoder_layers
                   for name in ("qkv", "self_out", "cross_query", "cross_out", "inner", "outer")]
        decoder += [packed.output, packed.cross_keys_values]
        encoder = [layer[name] for layer in packed.encoder_layers for name in ("qkv", "self_out", "inner", "outer")]
        products = decoder + encoder
        scales = [p.int8_scales if p.int8 else torch.empty(0) for p in products]  # int8: one per output; else empty
        packed.native = extension().T5Weights(
            [_weight(p) for p in decoder], model.decoder.embed_tokens.weight.detach(), [_weight(p) for p in encoder],
            model.encoder.embed_tokens.weight.detach(), model.encoder.final_layer_norm.weight.detach(), scales,
            packed.heads, packed.epsilon, packed.encoder_epsilon)
    return packed.native


def _weight(product: Any) -> torch.Tensor:
    """A packed product's weight ``[out, in]`` for the extension: int8 values, or float32."""
    return product.int8_weight if product.int8 else product.weight


def native_t5_encode(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """T5's encoder in one call: ``input_ids [B, S]`` -> last hidden state ``[B, S, D]`` (float32; equal to the
    model's encoder to float rounding at the source tokens, zeros at the padding)."""
    packed = fast_weights(model)
    native = native_weights(model, packed)
    length = input_ids.shape[1]
    bias = packed.native_bias.get(length)
    if bias is None:  # the model's own relative position bias [H, S, S], once per source length
        bias = packed.encoder_bias_module.compute_bias(length, length, device=input_ids.device)[0].contiguous()
        packed.native_bias[length] = bias
    return native.encode(input_ids, attention_mask, bias)


def native_encoder(model: Any) -> Any:
    """The encode function for :func:`beamsearch.adapters.hf_inputs.prepare` (None where the native step cannot run
    this model)."""
    if native_reason(model) is not None:
        return None
    return lambda input_ids, attention_mask: native_t5_encode(model, input_ids, attention_mask)


def _bias_by_distance(module: Any, capacity: int, device: torch.device) -> torch.Tensor:
    """The decoder's self-attention bias ``[H, T]`` by distance (query position - key position), from the model's
    own ``compute_bias`` for the query at ``T - 1``."""
    bias = t5_position_bias(module, capacity - 1, device)  # [1, H, 1, T]: keys 0..T-1
    return bias[0, :, 0].flip(-1).float().contiguous()


class NativeDecoder:
    """The native step's decoder state, in the place of the fast state's cache (:class:`~.fast.FastT5State` with
    ``native=True``): the extension's decode (the encoder output's cross-attention keys and values, every step's
    products and parent rows) and the reorder to apply at its next step.

    It answers the cache's interface the lean state's rules call (``capacity``, ``rows``, ``grow``, ``reorder``,
    ``gather_rows``), so that the fast state's prefill, reorders and finished examples run as they do for the eager
    fast step; a reorder is recorded, never applied to a tensor.
    """

    def __init__(self, model: Any, encoder_hidden: torch.Tensor, source_mask: torch.Tensor | None, max_length: int,
                 packed: Any = None):
        self.bias_module = model.decoder.block[0].layer[0].SelfAttention
        self.device = encoder_hidden.device
        self.capacity = min(max(int(max_length), 1), 512)  # grows by doubling past it (``grow``)
        bias = _bias_by_distance(self.bias_module, self.capacity, self.device)
        mask = None if source_mask is None or bool(source_mask.all()) else source_mask
        self.decode = extension().T5Decode(native_weights(model, packed), encoder_hidden.float(), mask, bias)
        self.last_rows = encoder_hidden.shape[0]  # the rows of the last step (one per example before the first)
        self.parents: torch.Tensor | None = None  # [N] the rows of the last step each row continues, until applied

    @property
    def rows(self) -> int:
        """The rows the next step computes (before the first: one per example)."""
        return self.last_rows if self.parents is None else self.parents.shape[0]

    def grow(self, length: int) -> None:
        """Room for positions past ``capacity`` (a stopping rule of the caller's went past max_length)."""
        self.capacity = max(2 * self.capacity, length + 1)
        self.decode.set_bias(_bias_by_distance(self.bias_module, self.capacity, self.device))

    def reorder(self, index: torch.Tensor, length: int = 0) -> None:
        """Record a reorder ``index [N']`` of the rows (beams, expansion, finished examples left out): the next
        step applies it, composed with any recorded before."""
        self.parents = index if self.parents is None else self.parents.index_select(0, index)

    gather_rows = reorder

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One position for every row: tokens ``[N]`` -> logits ``[N, V]`` (float32, a new tensor)."""
        logits = self.decode.step(tokens, self.parents)
        self.parents = None
        self.last_rows = tokens.shape[0]
        return logits
