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
``training/test_stacked_t5.py`` checks the logits against transformers on the CPU. The masks of the dropout sites come
from ``stacked_dropout.py`` (no random number generator inside a step).

Legend: K members, B batch, S source length, T target length, N = B * T rows, V vocabulary, H heads, d d_model,
P flat parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from stacked_dropout import NO_DROPOUT, Dropout

PAD, EOS, UNK = 0, 1, 2
NEG = -1e9  # additive mask: large and finite (in bfloat16 too)


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
    decoder_layers: int = 0  # 0: as many as the encoder's ``layers`` (the canonical form when they are equal)

    def __post_init__(self):
        if self.decoder_layers == self.layers:
            object.__setattr__(self, "decoder_layers", 0)

    @property
    def inner(self) -> int:
        return self.heads * self.d_kv

    @property
    def dec_layers(self) -> int:
        return self.decoder_layers or self.layers

    def depth(self, stack: str) -> int:
        return self.layers if stack == "encoder" else self.dec_layers

    def hf_config(self) -> dict:
        """The ``T5Config`` fields of the exported model (the shipped model's conventions)."""
        return dict(
            vocab_size=self.vocab_size, d_model=self.d_model, d_kv=self.d_kv, d_ff=self.d_ff, num_layers=self.layers,
            num_decoder_layers=self.dec_layers, num_heads=self.heads, relative_attention_num_buckets=self.buckets,
            relative_attention_max_distance=self.max_distance, layer_norm_epsilon=self.eps,
            feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS,
            decoder_start_token_id=PAD, use_cache=True,
        )

    @classmethod
    def from_hf_config(cls, config: dict) -> T5Shape:
        """The shape of a ``T5Config`` (``config.json``'s fields); KeyError for a field it lacks."""
        return cls(vocab_size=config["vocab_size"], d_model=config["d_model"], d_ff=config["d_ff"],
                   layers=config["num_layers"], heads=config["num_heads"], d_kv=config["d_kv"],
                   buckets=config["relative_attention_num_buckets"],
                   max_distance=config["relative_attention_max_distance"], eps=config["layer_norm_epsilon"],
                   decoder_layers=config.get("num_decoder_layers") or config["num_layers"])


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
        for n in range(s.depth(stack)):
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


class StackedT5:
    """The forward of K T5 models of one :class:`T5Shape` over flat weights (holds no weights itself).

    The residual stream is [K, N, d] (N = B * T rows per member), so every projection is one ``torch.bmm`` with no
    reshape; attention runs over [K * B * H, T, d_kv] with the position bias and mask added by ``torch.baddbmm``.
    Dropout is a :class:`~stacked_dropout.Dropout` (a slice of one precomputed mask per site; none when evaluating).

    Args:
        shape: the model's dimensions.
        compute_dtype: the dtype of the matrix products and attention (bfloat16 on a GPU, float32 on the CPU); the
            residual stream, layer norms and logits stay float32.
        device: where the position-bucket tables live.
    """

    def __init__(self, shape: T5Shape, compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.shape = shape
        self.dtype = compute_dtype
        layout = entries(shape)
        self.matrix_entries = [e for e in layout if e.matrix]
        self.vector_entries = [e for e in layout if not e.matrix]
        # layer norm weights viewed as [1, d] so that they broadcast over [K, N, d]
        self.vector_shapes = tuple((1, *e.shape) if len(e.shape) == 1 else e.shape for e in self.vector_entries)
        self.max_length = 128
        self.enc_buckets = relative_buckets(self.max_length, True, shape.buckets, shape.max_distance).to(device)
        self.dec_buckets = relative_buckets(self.max_length, False, shape.buckets, shape.max_distance).to(device)
        causal = torch.ones(self.max_length, self.max_length, dtype=torch.bool).triu(1)
        self.causal_mask = (causal.float() * NEG).to(device)  # [T, T]
        self.vocab_ids = torch.arange(shape.vocab_size, device=device)
        self._one_hot: dict[tuple[int, int], torch.Tensor] = {}  # (bucket table, length) -> [length^2, buckets]

    def weights(self, matrices: torch.Tensor, vectors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views [K, ...] of the flat weights; matrices cast to the compute dtype (a differentiable cast)."""
        named = _Unflatten.apply(matrices.to(self.dtype), tuple(e.shape for e in self.matrix_entries))
        vecs = _Unflatten.apply(vectors, self.vector_shapes)
        out = {e.name: w for e, w in zip(self.matrix_entries, named, strict=True)}
        out.update({e.name: w for e, w in zip(self.vector_entries, vecs, strict=True)})
        return out

    # ------------------------------------------------------------------------------------------- pieces

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMS layer norm (float32) of x [K, N, d], scaled by ``weight`` [K, 1, d], cast to the compute dtype."""
        return (F.rms_norm(x, (x.shape[-1],), eps=self.shape.eps) * weight).to(self.dtype)

    def _split_heads(self, x: torch.Tensor, batch: int, parts: int) -> tuple[torch.Tensor, ...]:
        """[K, B * T, parts * H * dk] -> ``parts`` contiguous tensors [K * B * H, T, dk]."""
        k, n, _ = x.shape
        h, dk = self.shape.heads, self.shape.d_kv
        t = n // batch
        heads = x.view(k, batch, t, parts, h, dk).permute(3, 0, 1, 4, 2, 5).reshape(parts, k * batch * h, t, dk)
        return heads.unbind(0)

    def _merge_heads(self, x: torch.Tensor, members: int, batch: int) -> torch.Tensor:
        """[K * B * H, T, dk] -> [K, B * T, H * dk]."""
        _, t, dk = x.shape
        h = self.shape.heads
        return x.view(members, batch, h, t, dk).permute(0, 1, 3, 2, 4).reshape(members, batch * t, h * dk)

    @staticmethod
    def _attend(q, k, v, bias: torch.Tensor, drop: Dropout) -> torch.Tensor:
        """Unscaled dot-product attention over [K * B * H, T, dk]; ``bias`` [K * B * H, Tq or 1, Tk] in the compute
        dtype. Returns [K * B * H, Tq, dk]."""
        scores = torch.baddbmm(bias, q, k.transpose(1, 2))
        return torch.bmm(drop(scores.softmax(-1)), v)

    def _position_bias(self, table: torch.Tensor, rel: torch.Tensor, length: int) -> torch.Tensor:
        """rel [K, buckets, H] looked up for [length, length] -> [K, 1, H, length, length] float32 (as one product
        with a cached one-hot table: no index kernels, whose backward scatters)."""
        cache_key = (table.data_ptr(), length)
        if cache_key not in self._one_hot:
            buckets = table[:length, :length].reshape(-1)
            self._one_hot[cache_key] = (buckets[:, None] == torch.arange(rel.shape[1], device=table.device)).float()
        k, n, h = rel.shape
        bias = torch.mm(self._one_hot[cache_key], rel.transpose(0, 1).reshape(n, k * h))  # [length^2, K * H]
        return bias.view(length, length, k, h).permute(2, 3, 0, 1).unsqueeze(1)

    def _flat_bias(self, bias: torch.Tensor, batch: int) -> torch.Tensor:
        """[K, B or 1, H or 1, Tq, Tk] float32 -> [K * B * H, Tq, Tk] in the compute dtype."""
        k, _, _, tq, tk = bias.shape
        h = self.shape.heads
        return bias.expand(k, batch, h, tq, tk).reshape(k * batch * h, tq, tk).to(self.dtype)

    def _embed(self, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """ids [K, B, T] -> [K, B * T, d] float32, each member its own table (a one-hot product: no scatter)."""
        k = ids.shape[0]
        one_hot = (ids.reshape(k, -1, 1) == self.vocab_ids).to(self.dtype)  # [K, B * T, V]
        return torch.bmm(one_hot, w["shared"]).float()

    def _feed_forward(self, w, prefix: str, x: torch.Tensor, drop: Dropout) -> torch.Tensor:
        h = torch.relu(torch.bmm(self._norm(x, w[prefix + "ln_ff"]), w[prefix + "wi"]))
        return x + drop(torch.bmm(drop(h), w[prefix + "wo"]))

    def _self_attention(self, w, prefix: str, x: torch.Tensor, bias: torch.Tensor, batch: int,
                        drop: Dropout) -> torch.Tensor:
        q, k, v = self._split_heads(torch.bmm(self._norm(x, w[prefix + "ln0"]), w[prefix + "qkv"]), batch, 3)
        out = self._merge_heads(self._attend(q, k, v, bias, drop), x.shape[0], batch)
        return x + drop(torch.bmm(out, w[prefix + "o"]))

    # --------------------------------------------------------------------------------------------- stacks

    def encode(self, w: dict[str, torch.Tensor], src: torch.Tensor,
               drop: Dropout = NO_DROPOUT) -> tuple[torch.Tensor, torch.Tensor]:
        """src [K, B, S] (PAD-padded) -> (encoder output [K, B * S, d] float32, key mask [K, B, 1, 1, S] float32)."""
        k, b, s = src.shape
        mask = (src == PAD).float()[:, :, None, None, :] * NEG
        bias = self._flat_bias(self._position_bias(self.enc_buckets, w["encoder.rel"], s) + mask, b)
        x = drop(self._embed(w, src))
        for n in range(self.shape.layers):
            x = self._self_attention(w, f"encoder.{n}.", x, bias, b, drop)
            x = self._feed_forward(w, f"encoder.{n}.", x, drop)
        return drop(F.rms_norm(x, (x.shape[-1],), eps=self.shape.eps) * w["encoder.final_ln"]), mask

    def decode(self, w: dict[str, torch.Tensor], dec: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor,
               drop: Dropout = NO_DROPOUT) -> torch.Tensor:
        """Teacher-forced decoder: dec [K, B, T] (start token first) -> logits [K, B, T, V] float32."""
        k, b, t = dec.shape
        bias = self._flat_bias(self._position_bias(self.dec_buckets, w["decoder.rel"], t) + self.causal_mask[:t, :t], b)
        cross_bias = self._flat_bias(mask, b)  # [K * B * H, 1, S]
        memory = enc.to(self.dtype)
        x = drop(self._embed(w, dec))
        for n in range(self.shape.dec_layers):
            prefix = f"decoder.{n}."
            x = self._self_attention(w, prefix, x, bias, b, drop)
            q = self._split_heads(torch.bmm(self._norm(x, w[prefix + "ln_x"]), w[prefix + "xq"]), b, 1)[0]
            keys, values = self._split_heads(torch.bmm(memory, w[prefix + "xkv"]), b, 2)
            out = self._merge_heads(self._attend(q, keys, values, cross_bias, drop), k, b)
            x = x + drop(torch.bmm(out, w[prefix + "xo"]))
            x = self._feed_forward(w, prefix, x, drop)
        # the tied output's d_model^-0.5 is folded into the final norm's weight (dropout commutes with it)
        scale = w["decoder.final_ln"] * self.shape.d_model**-0.5
        x = drop(F.rms_norm(x, (x.shape[-1],), eps=self.shape.eps) * scale).to(self.dtype)
        logits = torch.bmm(x, w["shared"].transpose(1, 2))  # [K, B * T, V]
        return logits.float().view(k, b, t, -1)


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
        for n in range(shape.depth(stack)):
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
