"""One training step of a :class:`~stacked_t5.StackedT5` stack, its optimizer, its CUDA graphs, and greedy decoding.

Everything in a step is tensors on the device: the batch is gathered from the bucketed data by an index tensor, the
learning rate and Adam's step count are 0-dim tensors, and the loss is accumulated in place, so a step never waits for
the device and can be captured as a CUDA graph (:class:`GraphedSteps`: one graph per bucket shape, checked once
against the eager step, which stays the fallback).

Legend: K members, B batch, L bucket length, V vocabulary, P flat parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
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
    """Scale each member's gradient (row k of every [K, ...] tensor) to at most ``max_norm`` in place, as
    ``clip_grad_norm_`` would for that member alone; no host synchronisation."""
    squares = sum(g.float().pow(2).flatten(1).sum(1) for g in grads)
    coef = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)  # [K]
    for g in grads:
        g.mul_(coef.view(-1, *[1] * (g.dim() - 1)).to(g.dtype))


class AdamW:
    """Decoupled-weight-decay Adam (Loshchilov and Hutter 2019) on a few flat tensors, all state on the device.

    The learning rate ``lr`` and step count are 0-dim tensors (set ``lr`` with ``fill_`` before a step), so a step can
    be replayed from a CUDA graph. Matches ``torch.optim.AdamW`` (``training/test_stacked_t5.py``).
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
        for p, g, m, v, decay in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.weight_decays,
                                     strict=True):
            g = g.to(p.dtype)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if decay:
                p.mul_(1 - self.lr * decay)
            p.sub_(m / (v.sqrt() / root_correction + self.eps) * step_size)


@dataclass(frozen=True)
class Objective:
    """What a batch is scored against: the reference (label smoothing ``smoothing``), and with ``alpha`` [K] the
    teachers' distribution too, ``alpha * distillation + (1 - alpha) * reference`` per member."""

    smoothing: float = 0.1
    alpha: torch.Tensor | None = None


class StackTrainer:
    """K members' flat weights, their optimizer and one training step over a bucketed batch.

    Args:
        model: the stacked forward.
        matrices, vectors: the flat float32 weights [K, Pm], [K, Pv] on the device (trained in place).
        data: bucketed training data (``gather(bucket, index) -> (src, dec, labels, target or None)``).
        objective: the loss.
        clip: per-member gradient norm limit.
        weight_decay: on the matrices (the vectors are not decayed).
    """

    def __init__(self, model: StackedT5, matrices: torch.Tensor, vectors: torch.Tensor, data, objective: Objective,
                 clip: float = 1.0, weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.98)):
        self.model, self.data, self.objective, self.clip = model, data, objective, clip
        self.params = [matrices.requires_grad_(), vectors.requires_grad_()]
        self.optimizer = AdamW(self.params, (weight_decay, 0.0), betas)
        self.members = matrices.shape[0]
        self.loss_sum = torch.zeros(self.members, device=matrices.device)  # since the last read
        self.loss_steps = torch.zeros((), device=matrices.device)

    def state(self) -> list[torch.Tensor]:
        return [*self.optimizer.state(), self.loss_sum, self.loss_steps]

    def step(self, bucket: int, index: torch.Tensor, rate: float | torch.Tensor) -> None:
        """One update of every member: index [K, B] rows of ``bucket``; dropout ``rate`` (float or 0-dim tensor)."""
        src, dec, labels, target = self.data.gather(bucket, index)
        w = self.model.weights(*self.params)
        enc, mask = self.model.encode(w, src, rate, training=True)
        logits = self.model.decode(w, dec, enc, mask, rate, training=True)
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


class GraphedSteps:
    """The trainer's step as one CUDA graph per bucket, replayed with a new index and learning rate each step.

    :meth:`capture` warms up, captures and then checks every graph once: from one saved state, a replay without
    dropout must give the eager step's update (same loss, same new weights up to float rounding). Any error or
    mismatch leaves ``ready`` False and the caller steps eagerly. Capturing does not change the trainer's state.
    """

    def __init__(self, trainer: StackTrainer, rate: float, log: Callable[[str], None]):
        self.trainer, self.rate, self.log = trainer, rate, log
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.index: dict[int, torch.Tensor] = {}
        self.rate_tensor = torch.tensor(float(rate), device=trainer.loss_sum.device)
        self.ready = False

    def capture(self, examples: dict[int, torch.Tensor]) -> bool:
        """Capture one graph per bucket of ``examples`` (bucket -> an index [K, B] of that bucket)."""
        t0 = time.time()
        saved = snapshot(self.trainer.state())
        try:
            self._capture(examples)
            worst = max(self._check(bucket, index, saved) for bucket, index in examples.items())
            self.ready = worst < 0.02
            self.log(f"CUDA graphs: {len(self.graphs)} captured and checked in {time.time() - t0:.1f}s; largest "
                     f"relative difference from the eager step {worst:.2e}: {'using them' if self.ready else 'EAGER'}")
        except Exception as e:  # any capture problem: train eagerly
            self.log(f"CUDA graphs unavailable ({type(e).__name__}: {e}); training eagerly")
            self.graphs.clear()
            self.ready = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        restore(self.trainer.state(), saved)
        return self.ready

    def _capture(self, examples: dict[int, torch.Tensor]) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket, index in examples.items():
                self.index[bucket] = index.clone()
                for _ in range(2):
                    self.trainer.step(bucket, self.index[bucket], self.rate_tensor)
        torch.cuda.current_stream().wait_stream(side)
        for bucket in examples:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.trainer.step(bucket, self.index[bucket], self.rate_tensor)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def _check(self, bucket: int, index: torch.Tensor, saved: list[torch.Tensor]) -> float:
        """How far a replay is from the eager step, both without dropout and from ``saved``: the largest relative
        difference of the loss, of Adam's first moment (the clipped gradient) and of the size of the update.
        (Not the update itself: Adam's first step is sign(gradient), which rounding noise can flip.)"""
        trainer = self.trainer
        state, first_moment = trainer.state(), trainer.optimizer.exp_avg
        restore(state, saved)
        self.rate_tensor.fill_(0.0)
        self.index[bucket].copy_(index)
        self.graphs[bucket].replay()
        replayed = snapshot([*trainer.params, *first_moment, trainer.loss_sum])
        restore(state, saved)
        trainer.step(bucket, index, 0.0)
        eager = snapshot([*trainer.params, *first_moment, trainer.loss_sum])
        self.rate_tensor.fill_(self.rate)
        n = len(trainer.params)
        before = saved[:n]

        def relative(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
            diff = sum((x - y).float().norm() ** 2 for x, y in zip(a, b, strict=True)) ** 0.5
            return float(diff / (sum(y.float().norm() ** 2 for y in b) ** 0.5).clamp(min=1e-12))

        def update_size(after: Sequence[torch.Tensor]) -> torch.Tensor:
            return sum((x - y).float().norm() ** 2 for x, y in zip(after, before, strict=True)) ** 0.5

        size_ratio = float(update_size(replayed[:n]) / update_size(eager[:n]).clamp(min=1e-12))
        return max(relative(replayed[-1:], eager[-1:]), relative(replayed[n:-1], eager[n:-1]), abs(1 - size_ratio))

    def step(self, bucket: int, index: torch.Tensor) -> None:
        self.index[bucket].copy_(index, non_blocking=True)
        self.graphs[bucket].replay()


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
