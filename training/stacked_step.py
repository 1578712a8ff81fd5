"""One training step of a :class:`~stacked_t5.StackedT5` stack, its optimizer, and greedy decoding.

Everything in a step is tensors on the device: the batch is gathered from the bucketed data by an index tensor, the
learning rate and Adam's step count are 0-dim tensors, the dropout masks come from a byte buffer drawn before the step
(``stacked_dropout.py``), and the loss is accumulated in place. So a step never waits for the device, runs no random
number kernel, and can be captured as a CUDA graph (``stacked_graphs.py``).

Legend: K members, B batch, L bucket length, V vocabulary, P flat parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from stacked_dropout import NO_DROPOUT, Dropout, MaskBuffer, mask_elements
from stacked_t5 import EOS, PAD, StackedT5


def reference_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Label-smoothed cross entropy per member: logits [K, B, L, V], labels [K, B, L] (-100 ignored) -> [K]
    (``F.cross_entropy(..., label_smoothing=smoothing)`` of each member's tokens)."""
    log_probs = logits.log_softmax(-1)
    valid = labels != -100
    nll = -log_probs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    per_token = (1 - smoothing) * nll - smoothing * log_probs.mean(-1)
    return (per_token * valid).sum((1, 2)) / valid.sum((1, 2)).clamp(min=1)


def distillation_loss(logits: torch.Tensor, target: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-level distillation per member: cross entropy of the student's logits [K, B, L, V] against the teachers'
    distribution ``target`` [K, B, L, V] (any float dtype), on the reference's positions (labels != -100) -> [K]."""
    valid = labels != -100
    per_token = -(target.float() * logits.log_softmax(-1)).sum(-1)
    return (per_token * valid).sum((1, 2)) / valid.sum((1, 2)).clamp(min=1)


def clip_per_member(grads: Sequence[torch.Tensor], max_norm: float) -> None:
    """Scale each member's gradient (row k of every [K, P] tensor) to at most ``max_norm`` in place, as
    ``clip_grad_norm_`` would for that member alone; no host synchronisation."""
    squares = sum(g.square().sum(1) for g in grads)
    coef = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)[:, None]  # [K, 1]
    for g in grads:
        g.mul_(coef)


class AdamW:
    """Decoupled-weight-decay Adam (Loshchilov and Hutter 2019) on a few flat tensors, all state on the device.

    The learning rate ``lr`` and step count are 0-dim tensors (set ``lr`` with ``fill_`` before a step), so a step can
    be replayed from a CUDA graph; the moments are updated with ``torch._foreach_*`` ops (one dispatch for all
    tensors). Matches ``torch.optim.AdamW`` (``training/test_stacked_t5.py``).
    """

    def __init__(self, params: Sequence[torch.Tensor], weight_decays: Sequence[float],
                 betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8):
        self.params = list(params)
        self.weight_decays = list(weight_decays)
        self.betas, self.eps = betas, eps
        device = self.params[0].device
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.count = torch.zeros((), device=device)
        self.lr = torch.zeros((), device=device)

    def state(self) -> list[torch.Tensor]:
        """Every tensor a step changes (for snapshots that must restore them in place)."""
        return [*self.params, *self.exp_avg, *self.exp_avg_sq, self.count]

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor]) -> None:
        beta1, beta2 = self.betas
        self.count.add_(1)
        step_size = self.lr / (1 - beta1**self.count)
        root_correction = (1 - beta2**self.count).sqrt()
        for p, decay in zip(self.params, self.weight_decays, strict=True):
            if decay:
                p.mul_(1 - self.lr * decay)
        grads = list(grads)
        torch._foreach_lerp_(self.exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(self.exp_avg_sq, beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, value=1 - beta2)
        denominators = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denominators, root_correction)
        torch._foreach_add_(denominators, self.eps)
        updates = torch._foreach_div(self.exp_avg, denominators)
        torch._foreach_mul_(updates, step_size)
        torch._foreach_sub_(self.params, updates)


@dataclass(frozen=True)
class Objective:
    """What a batch is scored against: the reference (label smoothing ``smoothing``), and with ``alpha`` [K] the
    teachers' distribution too, ``alpha * distillation + (1 - alpha) * reference`` per member."""

    smoothing: float = 0.1
    alpha: torch.Tensor | None = None


class StackTrainer:
    """K members' flat weights, their optimizer, their dropout masks and one training step over a bucketed batch.

    Args:
        model: the stacked forward.
        matrices, vectors: the flat float32 weights [K, Pm], [K, Pv] on the device (trained in place).
        data: bucketed training data (``gather(bucket, index) -> (src, dec, labels, target or None)``).
        objective: the loss.
        rate: the dropout rate (0: none).
        seed: seeds the dropout masks (with the step number).
        clip: per-member gradient norm limit.
        weight_decay: on the matrices (the vectors are not decayed).
    """

    def __init__(self, model: StackedT5, matrices: torch.Tensor, vectors: torch.Tensor, data, objective: Objective,
                 rate: float = 0.0, seed: int = 0, clip: float = 1.0, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.98)):
        self.model, self.data, self.objective, self.clip = model, data, objective, clip
        self.params = [matrices.requires_grad_(), vectors.requires_grad_()]
        self.optimizer = AdamW(self.params, (weight_decay, 0.0), betas)
        self.members = matrices.shape[0]
        self.loss_sum = torch.zeros(self.members, device=matrices.device)  # since the last read
        self.loss_steps = torch.zeros((), device=matrices.device)
        self.masks = None
        if rate > 0:
            capacity = max(self.mask_size(bucket) for bucket in range(len(data.buckets)))
            self.masks = MaskBuffer(capacity, rate, seed, model.dtype, matrices.device)

    def state(self) -> list[torch.Tensor]:
        return [*self.optimizer.state(), self.loss_sum, self.loss_steps]

    def mask_size(self, bucket: int) -> int:
        """Mask elements of one step on ``bucket``."""
        return mask_elements(self.model.shape, self.members, self.data.batch_size, self.data.buckets[bucket].length)

    def draw(self, step: int, bucket: int) -> None:
        """Draw the dropout masks of step number ``step`` (before the step; nothing without dropout)."""
        if self.masks is not None:
            self.masks.draw(step, self.mask_size(bucket))

    def run(self, step: int, bucket: int, index: torch.Tensor) -> None:
        """Training step number ``step``, eagerly: its masks, then :meth:`step`."""
        self.draw(step, bucket)
        self.step(bucket, index)

    def step(self, bucket: int, index: torch.Tensor) -> None:
        """One update of every member: index [K, B] rows of ``bucket``, with the masks last drawn (the part a CUDA
        graph captures: no host synchronisation, no random number kernel)."""
        src, dec, labels, target = self.data.gather(bucket, index)
        n = self.mask_size(bucket)
        drop = Dropout(self.masks.scaled(n)) if self.masks is not None else NO_DROPOUT
        w = self.model.weights(*self.params)
        enc, mask = self.model.encode(w, src, drop)
        logits = self.model.decode(w, dec, enc, mask, drop)
        if drop.mask is not None and drop.used != n:
            raise RuntimeError(f"the dropout sites used {drop.used} mask elements, mask_elements() gives {n}")
        loss = reference_loss(logits, labels, self.objective.smoothing)
        if target is not None and self.objective.alpha is not None:
            alpha = self.objective.alpha
            loss = alpha * distillation_loss(logits, target, labels) + (1 - alpha) * loss
        grads = list(torch.autograd.grad(loss.sum(), self.params))
        with torch.no_grad():
            clip_per_member(grads, self.clip)
            self.optimizer.step(grads)
            self.loss_sum.add_(loss.detach())
            self.loss_steps.add_(1)

    def read_loss(self) -> list[float]:
        """Mean loss per member since the last read (one host synchronisation)."""
        mean = (self.loss_sum / self.loss_steps.clamp(min=1)).tolist()
        self.loss_sum.zero_()
        self.loss_steps.zero_()
        return mean


def snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


@torch.no_grad()
def restore(tensors: Sequence[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
    for t, s in zip(tensors, saved, strict=True):
        t.copy_(s)


# -------------------------------------------------------------------------------------------- decoding


@torch.no_grad()
def greedy(model: StackedT5, matrices: torch.Tensor, vectors: torch.Tensor, src: torch.Tensor, max_new: int,
           ensemble: bool = False) -> torch.Tensor:
    """Greedy decoding of every member (or, with ``ensemble``, of their mean log-probabilities) without a cache.

    Args:
        src: [K, B, S] or [B, S] (the same sources for every member).
        max_new: tokens generated (no early stop: no host synchronisation).

    Returns:
        [K, B, max_new] int64 (with ``ensemble`` every row k is the same), EOS where a hypothesis ended.
    """
    k = matrices.shape[0]
    if src.dim() == 2:
        src = src.expand(k, -1, -1)
    w = model.weights(matrices, vectors)
    enc, mask = model.encode(w, src)
    out = torch.full((*src.shape[:2], 1), PAD, dtype=torch.long, device=src.device)
    for _ in range(max_new):
        logits = model.decode(w, out, enc, mask)[:, :, -1]  # [K, B, V]
        if ensemble:
            nxt = logits.log_softmax(-1).mean(0).argmax(-1).expand(k, -1)
        else:
            nxt = logits.argmax(-1)
        out = torch.cat([out, nxt[..., None]], dim=-1)
    return out[..., 1:]


def to_phones(tokens: torch.Tensor, vocab: Sequence[str]) -> list[list[list[str]]]:
    """[K, B, T] token ids -> per member, per input, the phones before the first EOS."""
    out = []
    for member in tokens.tolist():
        rows = []
        for ids in member:
            ids = ids[: ids.index(EOS)] if EOS in ids else ids
            rows.append([vocab[i] for i in ids if i > EOS])
        out.append(rows)
    return out
