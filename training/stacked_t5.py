"""K T5 encoder-decoders of one shape run as one set of tensors: the GPU trainer's model.

Every weight carries a leading member axis K, so one batched matrix product (``torch.bmm``) serves all K models: a
step of K small models costs about the kernel launches of one, which is what bounds these models on a GPU. The
weights live in two flat float32 tensors per stack, ``matrices`` [K, Pm] (weight decay) and ``vectors`` [K, Pv]
(layer norms and relative position biases, no decay); the forward takes named views of them through
:class:`_Unflatten`, whose backward is one concatenation, so the gradient is flat too and the optimizer, the
per-member clipping and checkpoint averaging are a few kernels over [K, P].

The computation is Hugging Face's ``T5ForConditionalGeneration`` (T5 v1.0 layout: ReLU feed-forward, pre-norm RMS
layer norms without bias, attention without 1/sqrt(d) scaling, relative position buckets shared by the layers of a
stack, tied embeddings with the decoder output scaled by d_model^-0.5), with the same dropout sites and the same
initialisation; :func:`hf_state_dict` gives a member's weights under transformers' names, and
``training/test_stacked_t5.py`` checks the logits against transformers on the CPU.

Legend: K members, B batch, S source length, T target length, V vocabulary, H heads, d d_model, P flat parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAD, EOS, UNK = 0, 1, 2
NEG = -1e9  # additive mask: large and finite (scores are float32)


@dataclass(frozen=True)
class T5Shape:
    vocab_size: int = 101
    d_model: int = 256
    d_ff: int = 1024
    layers: int = 4
    heads: int = 4
    d_kv: int = 64
    buckets: int = 32
    max_distance: int = 64
    eps: float = 1e-6

    @property
    def inner(self) -> int:
        return self.heads * self.d_kv

    def hf_config(self) -> dict:
        """The ``T5Config`` fields of the exported model (the shipped model's conventions)."""
        return dict(
            vocab_size=self.vocab_size, d_model=self.d_model, d_kv=self.d_kv, d_ff=self.d_ff, num_layers=self.layers,
            num_decoder_layers=self.layers, num_heads=self.heads, relative_attention_num_buckets=self.buckets,
            relative_attention_max_distance=self.max_distance, layer_norm_epsilon=self.eps,
            feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS,
            decoder_start_token_id=PAD, use_cache=True,
        )


@dataclass(frozen=True)
class Entry:
    """One weight of a member: its shape (matrices as [in, out], so ``x @ w``), its initial standard deviations
    (one per equal block of the last axis; empty: ones) and whether it is decayed."""

    name: str
    shape: tuple[int, ...]
    stds: tuple[float, ...]
    matrix: bool


def entries(s: T5Shape) -> list[Entry]:
    """Every weight of one member, in flat order; initialised as transformers' ``T5PreTrainedModel._init_weights``."""
    d, i = s.d_model, s.inner
    q, kv, o = (d * s.d_kv) ** -0.5, d**-0.5, i**-0.5
    out = [Entry("shared", (s.vocab_size, d), (1.0,), True)]
    for stack in ("encoder", "decoder"):
        out.append(Entry(f"{stack}.rel", (s.buckets, s.heads), (d**-0.5,), False))
        for n in range(s.layers):
            p = f"{stack}.{n}."
            out += [Entry(p + "ln0", (d,), (), False), Entry(p + "qkv", (d, 3 * i), (q, kv, kv), True),
                    Entry(p + "o", (i, d), (o,), True)]
            if stack == "decoder":
                out += [Entry(p + "ln_x", (d,), (), False), Entry(p + "xq", (d, i), (q,), True),
                        Entry(p + "xkv", (d, 2 * i), (kv, kv), True), Entry(p + "xo", (i, d), (o,), True)]
            out += [Entry(p + "ln_ff", (d,), (), False), Entry(p + "wi", (d, s.d_ff), (d**-0.5,), True),
                    Entry(p + "wo", (s.d_ff, d), (s.d_ff**-0.5,), True)]
        out.append(Entry(f"{stack}.final_ln", (d,), (), False))
    return out


def group_sizes(s: T5Shape) -> tuple[int, int]:
    """Flat sizes of one member's matrices and vectors."""
    m = sum(math.prod(e.shape) for e in entries(s) if e.matrix)
    return m, sum(math.prod(e.shape) for e in entries(s) if not e.matrix)


def init_flat(s: T5Shape, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Freshly initialised ``(matrices [K, Pm], vectors [K, Pv])`` in float32 on the CPU, one seed per member."""
    rows_m, rows_v = [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        parts: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for e in entries(s):
            if not e.stds:
                w = torch.ones(e.shape)
            else:
                blocks = [torch.randn(*e.shape[:-1], e.shape[-1] // len(e.stds), generator=g) * std for std in e.stds]
                w = torch.cat(blocks, dim=-1)
            parts[e.matrix].append(w.reshape(-1))
        rows_m.append(torch.cat(parts[True]))
        rows_v.append(torch.cat(parts[False]))
    return torch.stack(rows_m), torch.stack(rows_v)


class _Unflatten(torch.autograd.Function):
    """Named views of a flat [K, P] tensor; the backward concatenates their gradients (zeros for unused ones)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, shapes: tuple[tuple[int, ...], ...]):  # type: ignore[override]
        ctx.sizes = [math.prod(shape) for shape in shapes]
        ctx.flat_shape, ctx.flat_dtype = flat.shape, flat.dtype
        parts = flat.split(ctx.sizes, dim=1)
        return tuple(part.view(flat.shape[0], *shape) for part, shape in zip(parts, shapes, strict=True))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        k = ctx.flat_shape[0]
        parts = [
            g.reshape(k, n) if g is not None else torch.zeros(k, n, dtype=ctx.flat_dtype, device=grads[0].device)
            for g, n in zip(grads, ctx.sizes, strict=True)
        ]
        return torch.cat(parts, dim=1), None


def relative_buckets(length: int, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """T5's relative position bucket of every (query, key) pair up to ``length``: [length, length] int64.

    The relative position is key - query. Bidirectional: half the buckets for keys after the query. Then distances
    below half the buckets are exact, longer ones share log-spaced buckets up to ``max_distance`` (Raffel et al.
    2020, section 2.1; the arithmetic, float32 log included, follows Mesh TensorFlow so the buckets are the same).
    """
    position = torch.arange(length)
    relative = position[None, :] - position[:, None]  # [query, key]
    bucket = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        bucket += (relative > 0).long() * buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = buckets // 2
    scaled = torch.log(distance.float() / exact) / math.log(max_distance / exact) * (buckets - exact)
    large = (exact + scaled.to(torch.long)).clamp(max=buckets - 1)
    return bucket + torch.where(distance < exact, distance, large)


def dropout(x: torch.Tensor, p: float | torch.Tensor, training: bool) -> torch.Tensor:
    """Inverted dropout. ``p`` a float: torch's fused kernel; a 0-dim tensor: a mask from ``rand_like`` (a CUDA graph
    captures the tensor, so its rate can change between replays, 0 included)."""
    if not training:
        return x
    if isinstance(p, torch.Tensor):
        keep = (torch.rand_like(x, dtype=torch.float32) >= p).to(x.dtype)
        return x * keep / (1 - p).to(x.dtype)
    return F.dropout(x, p, True) if p > 0 else x


class StackedT5:
    """The forward of K T5 models of one :class:`T5Shape` over flat weights (holds no weights itself).

    Args:
        shape: the model's dimensions.
        compute_dtype: the dtype of the matrix products (bfloat16 on a GPU, float32 on the CPU); the residual
            stream, layer norms, softmax and logits stay float32.
        device: where the position-bucket tables live.
    """

    def __init__(self, shape: T5Shape, compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.shape = shape
        self.dtype = compute_dtype
        layout = entries(shape)
        self.matrix_entries = [e for e in layout if e.matrix]
        self.vector_entries = [e for e in layout if not e.matrix]
        self.max_length = 128
        self.enc_buckets = relative_buckets(self.max_length, True, shape.buckets, shape.max_distance).to(device)
        self.dec_buckets = relative_buckets(self.max_length, False, shape.buckets, shape.max_distance).to(device)
        causal = torch.ones(self.max_length, self.max_length, dtype=torch.bool).triu(1)
        self.causal_mask = (causal.float() * NEG).to(device)  # [T, T]
        self._one_hot: dict[tuple[int, int], torch.Tensor] = {}  # (bucket table, length) -> [length^2, buckets]

    def weights(self, matrices: torch.Tensor, vectors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views [K, ...] of the flat weights; matrices cast to the compute dtype (a differentiable cast)."""
        named = _Unflatten.apply(matrices.to(self.dtype), tuple(e.shape for e in self.matrix_entries))
        vecs = _Unflatten.apply(vectors, tuple(e.shape for e in self.vector_entries))
        out = {e.name: w for e, w in zip(self.matrix_entries, named, strict=True)}
        out.update({e.name: w for e, w in zip(self.vector_entries, vecs, strict=True)})
        return out

    # ------------------------------------------------------------------------------------------- pieces

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMS layer norm (float32), scaled by ``weight`` [K, d], cast to the compute dtype. x: [K, B, T, d]."""
        return (F.rms_norm(x, (x.shape[-1],), eps=self.shape.eps) * weight[:, None, None, :]).to(self.dtype)

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [K, ..., in] @ w [K, in, out] -> [K, ..., out]."""
        k = x.shape[0]
        return torch.bmm(x.reshape(k, -1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[-1])

    def _heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        """[K, B, T, parts * H * dk] -> ``parts`` tensors [K, B, H, T, dk]."""
        k, b, t, _ = x.shape
        return x.view(k, b, t, parts, self.shape.heads, self.shape.d_kv).permute(3, 0, 1, 4, 2, 5).unbind(0)

    def _attend(self, q, k, v, bias, p, training: bool) -> torch.Tensor:
        """Unscaled dot-product attention; bias broadcasts to [K, B, H, Tq, Tk] (float32). Returns [K, B, Tq, H*dk]."""
        scores = torch.matmul(q, k.transpose(-1, -2)).float() + bias
        probs = dropout(scores.softmax(-1), p, training).to(v.dtype)
        out = torch.matmul(probs, v)  # [K, B, H, Tq, dk]
        kk, b, h, t, dk = out.shape
        return out.transpose(2, 3).reshape(kk, b, t, h * dk)

    def _position_bias(self, table: torch.Tensor, rel: torch.Tensor, length: int) -> torch.Tensor:
        """rel [K, buckets, H] looked up for [length, length] -> [K, 1, H, length, length] float32 (as a product with
        a cached one-hot table: no index kernels, whose backward scatters)."""
        cache_key = (table.data_ptr(), length)
        if cache_key not in self._one_hot:
            buckets = table[:length, :length].reshape(-1)
            self._one_hot[cache_key] = (buckets[:, None] == torch.arange(rel.shape[1], device=table.device)).float()
        bias = torch.matmul(self._one_hot[cache_key], rel.float())  # [K, length * length, H]
        return bias.view(rel.shape[0], length, length, -1).permute(0, 3, 1, 2).unsqueeze(1)

    def _embed(self, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """ids [K, B, T] -> [K, B, T, d] float32, each member its own table (a one-hot product, for the same reason)."""
        table = w["shared"]
        one_hot = (ids[..., None] == torch.arange(table.shape[1], device=ids.device)).to(table.dtype)
        return self._linear(one_hot, table).float()

    def _feed_forward(self, w, prefix: str, x, p, training: bool) -> torch.Tensor:
        h = torch.relu(self._linear(self._norm(x, w[prefix + "ln_ff"]), w[prefix + "wi"]))
        h = self._linear(dropout(h, p, training), w[prefix + "wo"])
        return x + dropout(h, p, training)

    def _self_attention(self, w, prefix: str, x, bias, p, training: bool) -> torch.Tensor:
        q, k, v = self._heads(self._linear(self._norm(x, w[prefix + "ln0"]), w[prefix + "qkv"]), 3)
        out = self._linear(self._attend(q, k, v, bias, p, training), w[prefix + "o"])
        return x + dropout(out, p, training)

    # --------------------------------------------------------------------------------------------- stacks

    def encode(self, w: dict[str, torch.Tensor], src: torch.Tensor, p: float | torch.Tensor = 0.0,
               training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """src [K, B, S] (PAD-padded) -> (encoder output [K, B, S, d] float32, source mask [K, B, 1, 1, S])."""
        s = src.shape[-1]
        mask = (src == PAD).float()[:, :, None, None, :] * NEG
        bias = self._position_bias(self.enc_buckets, w["encoder.rel"], s) + mask  # [K, B, H, S, S]
        x = dropout(self._embed(w, src), p, training)
        for n in range(self.shape.layers):
            x = self._self_attention(w, f"encoder.{n}.", x, bias, p, training)
            x = self._feed_forward(w, f"encoder.{n}.", x, p, training)
        x = F.rms_norm(x, (x.shape[-1],), eps=self.shape.eps) * w["encoder.final_ln"][:, None, None, :]
        return dropout(x, p, training), mask

    def decode(self, w: dict[str, torch.Tensor], dec: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor,
               p: float | torch.Tensor = 0.0, training: bool = False) -> torch.Tensor:
        """Teacher-forced decoder: dec [K, B, T] (start token first) -> logits [K, B, T, V] float32."""
        t = dec.shape[-1]
        bias = self._position_bias(self.dec_buckets, w["decoder.rel"], t) + self.causal_mask[:t, :t]
        memory = enc.to(self.dtype)
        x = dropout(self._embed(w, dec), p, training)
        for n in range(self.shape.layers):
            prefix = f"decoder.{n}."
            x = self._self_attention(w, prefix, x, bias, p, training)
            q = self._heads(self._linear(self._norm(x, w[prefix + "ln_x"]), w[prefix + "xq"]), 1)[0]
            k, v = self._heads(self._linear(memory, w[prefix + "xkv"]), 2)
            x = x + dropout(self._linear(self._attend(q, k, v, mask, p, training), w[prefix + "xo"]), p, training)
            x = self._feed_forward(w, prefix, x, p, training)
        x = F.rms_norm(x, (x.shape[-1],), eps=self.shape.eps) * w["decoder.final_ln"][:, None, None, :]
        x = dropout(x, p, training) * self.shape.d_model**-0.5
        logits = self._linear(x.to(self.dtype), w["shared"].transpose(1, 2))
        return logits.float()


# ------------------------------------------------------------------------------------------------- export


def hf_state_dict(shape: T5Shape, matrices: torch.Tensor, vectors: torch.Tensor) -> dict[str, torch.Tensor]:
    """One member's weights (``matrices`` [Pm], ``vectors`` [Pv]) under ``T5ForConditionalGeneration``'s names,
    contiguous copies in the dtype given (the tied ``lm_head`` and ``embed_tokens`` are left to ``shared``)."""
    return {name: w.contiguous() for name, w in hf_state_dict_views(shape, matrices, vectors).items()}


def flat_from_hf(shape: T5Shape, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`hf_state_dict`: ``(matrices [Pm], vectors [Pv])`` float32 from transformers' names."""
    sizes = group_sizes(shape)
    flat_m, flat_v = torch.zeros(sizes[0]), torch.zeros(sizes[1])
    for name, view in hf_state_dict_views(shape, flat_m, flat_v).items():
        view.copy_(state[name].float())
    return flat_m, flat_v


def hf_state_dict_views(shape: T5Shape, matrices: torch.Tensor, vectors: torch.Tensor) -> dict[str, torch.Tensor]:
    """As :func:`hf_state_dict` but views into the flat tensors (writable), not contiguous copies."""
    layout = entries(shape)
    flat = {True: matrices, False: vectors}
    offsets = {True: 0, False: 0}
    named: dict[str, torch.Tensor] = {}
    for e in layout:
        n = math.prod(e.shape)
        named[e.name] = flat[e.matrix][offsets[e.matrix] : offsets[e.matrix] + n].view(e.shape)
        offsets[e.matrix] += n
    out = {"shared.weight": named["shared"]}
    for stack in ("encoder", "decoder"):
        out[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = named[f"{stack}.rel"]
        out[f"{stack}.final_layer_norm.weight"] = named[f"{stack}.final_ln"]
        for n in range(shape.layers):
            src, dst = f"{stack}.{n}.", f"{stack}.block.{n}.layer."
            q, k, v = named[src + "qkv"].chunk(3, dim=1)
            ff = 2 if stack == "decoder" else 1
            out.update({
                dst + "0.layer_norm.weight": named[src + "ln0"],
                dst + "0.SelfAttention.q.weight": q.t(), dst + "0.SelfAttention.k.weight": k.t(),
                dst + "0.SelfAttention.v.weight": v.t(), dst + "0.SelfAttention.o.weight": named[src + "o"].t(),
                dst + f"{ff}.layer_norm.weight": named[src + "ln_ff"],
                dst + f"{ff}.DenseReluDense.wi.weight": named[src + "wi"].t(),
                dst + f"{ff}.DenseReluDense.wo.weight": named[src + "wo"].t(),
            })
            if stack == "decoder":
                xk, xv = named[src + "xkv"].chunk(2, dim=1)
                out.update({
                    dst + "1.layer_norm.weight": named[src + "ln_x"],
                    dst + "1.EncDecAttention.q.weight": named[src + "xq"].t(),
                    dst + "1.EncDecAttention.k.weight": xk.t(), dst + "1.EncDecAttention.v.weight": xv.t(),
                    dst + "1.EncDecAttention.o.weight": named[src + "xo"].t(),
                })
    return out
