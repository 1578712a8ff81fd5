"""Stochastic beam search: K sequences sampled without replacement (Kool, van Hoof & Welling, 2019).

"Stochastic Beams and Where to Find Them: The Gumbel-Top-k Trick for Sampling Sequences Without Replacement",
ICML 2019. Give every complete sequence y an independent key ``G_y ~ Gumbel(phi(y))``, ``phi(y) = log p(y)``;
the K sequences with the largest keys are K samples without replacement from p (the Gumbel-top-k trick).
Stochastic beam search draws those keys top-down, so that only the K best need to be expanded:

- a partial hypothesis (node) y carries ``phi(y)``, the sum of its tokens' log-probs, and ``G(y)``, the largest
  key of the complete sequences below it, which is ``Gumbel(phi(y))``; the root has ``phi = 0`` and
  ``G ~ Gumbel(0)`` (a fresh draw per example, as in the paper; the keys of the returned sequences are then true
  sequence-level Gumbel keys, which the importance-weighted estimator needs);
- expanding y with token log-probs ``log p(c | y)`` (which sum to one over c), each child c gets
  ``G_phi(c) = phi(y) + log p(c | y) + Gumbel(0)``, ``Z = max_c G_phi(c)``, and its key conditioned on the maximum
  being ``T = G(y)``: ``G(c) = -log(exp(-T) - exp(-Z) + exp(-G_phi(c)))`` (the best child gets T exactly),
  computed in the numerically stable form of the paper's appendix (:func:`conditional_keys`);
- each step keeps the K best of all children of an example's live beams and of its finished hypotheses, by key.
  A hypothesis that ends (EOS, the length limit, a stopping criterion) is a complete sequence; it stays in its
  slot with its key fixed and competes with the live beams at every later step.

Why the result is exact: a dropped node's key is the largest key of the complete sequences below it, and K kept
nodes each carry a complete sequence with a larger key; so every one of the K largest sequence keys lies below
a kept node, at every step, and when all K slots are complete sequences they are the sequence-level top K.
The same argument gives the (K+1)-th largest sequence key kappa (the estimator's threshold) as the largest key
ever dropped, tracked with a top-(K+1) per step.

The token log-probs are those of the distribution actually sampled: the processors applied to the model's
log-probs, divided by ``temperature``, renormalized per step (with no processor and temperature 1, the model's
own log-probs).

Legend: B batch, K beams, N = B*K, V vocabulary, L = max_length, t tokens so far, t0 start tokens,
G = L - t0 generated positions.
"""

from __future__ import annotations

import dataclasses

import torch

from ..beams import flat_parent_rows, flatten_beams, unflatten_beams
from ..processors.pipeline import run_processors
from ..results import FinishReason, SearchResult
from ..stopping import classify_stop
from .base import StepTrace
from .pool import Hypotheses, PoolSearch

NEG_INF = float("-inf")  # the key of an empty slot or an impossible child (only compared, never multiplied)


def gumbel(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Standard Gumbel(0) noise, float32, from torch's global random stream: ``-log(E)``, ``E ~ Exp(1)``."""
    exponential = torch.empty(shape, device=device).exponential_()
    return -torch.log(exponential.clamp_min(torch.finfo(torch.float32).tiny))


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate near 0 and for very negative x (Maechler, 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def conditional_keys(parent_keys: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
    """The children's Gumbel keys conditioned on their maximum being the parent's key.

    ``G(c) = -log(exp(-T) - exp(-Z) + exp(-G_phi(c)))`` with ``Z = max_c G_phi(c)``, computed as
    ``T - softplus(v)``, ``v = T - G_phi(c) + log(1 - exp(G_phi(c) - Z))`` (the paper's appendix B).

    Args:
        parent_keys: ``[..., 1]`` T, the parents' keys (-inf: an empty slot).
        perturbed: ``[..., V]`` ``G_phi(c) = phi(c) + Gumbel(0)`` (-inf: an impossible child).

    Returns:
        ``[..., V]`` float32 keys, -inf where the child or the parent is impossible; the best child's key is T.
    """
    maximum = perturbed.max(dim=-1, keepdim=True)[0]
    v = parent_keys - perturbed + log1mexp(perturbed - maximum)
    keys = parent_keys - v.clamp_min(0.0) - torch.log1p(torch.exp(-v.abs()))
    possible = torch.isfinite(perturbed) & torch.isfinite(parent_keys)
    return torch.where(possible, keys, NEG_INF)


def importance_weights(log_probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """The paper's importance weights ``p(y) / q(y)``, ``q(y) = P(G_y > kappa) = 1 - exp(-exp(phi(y) - kappa))``.

    With the K sampled sequences and kappa the (K+1)-th largest key, ``sum_i w_i f(y_i)`` is an unbiased estimate
    of ``E_p[f(y)]`` and ``sum_i w_i f(y_i) / sum_i w_i`` the (biased, consistent) normalized one. Where kappa is
    -inf (no other sequence exists) q is 1: the sample is the whole support.

    Args:
        log_probs: ``[B, n]`` phi(y) of the sampled sequences (-inf: an empty slot, weight 0).
        threshold: ``[B]`` kappa.

    Returns:
        ``[B, n]`` float32 weights.
    """
    log_q = log1mexp(-torch.exp(log_probs - threshold[:, None]))  # log(1 - exp(-exp(phi - kappa)))
    return torch.where(torch.isfinite(log_probs), torch.exp(log_probs - log_q), 0.0)


@dataclasses.dataclass(frozen=True)
class StochasticBeamResult(SearchResult):
    """A :class:`SearchResult` of stochastic beam search, in the order of the keys (largest first).

    ``sequences_scores`` and ``sum_log_probs`` hold phi(y), the sequence's log-probability under the sampled
    distribution (-inf for an empty slot: fewer complete sequences exist than were asked for).

    Attributes:
        keys: FloatTensor ``[B, n]``: each sequence's Gumbel key ``G_y ~ Gumbel(phi(y))`` (descending).
        threshold: FloatTensor ``[B]``: kappa, the largest key of the sequences not returned (the (n+1)-th largest;
            -inf when every sequence was returned).
    """

    keys: torch.Tensor | None = None
    threshold: torch.Tensor | None = None

    def importance_weights(self) -> torch.Tensor:
        """``[B, n]`` weights ``p(y) / q(y)`` for the paper's estimator (see :func:`importance_weights`)."""
        return importance_weights(self.sum_log_probs, self.threshold)


class StochasticBeamSearch(PoolSearch):
    """Stochastic beam search (``stochastic_beam_search=True``): K samples without replacement per example.

    ``slots``: the K nodes of each example, :class:`Hypotheses` ``[B, K]``, whose ``scores`` are the Gumbel keys
    G (-inf: an empty slot), ``phi`` the float32 sums of their tokens' log-probs, and ``finished`` / ``reasons``
    mark the complete sequences.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        num_beams: int,
        max_length: int,
        processors,
        criteria,
        *,
        eos_token_id: tuple[int, ...] | None,
        fill_token_id: int,
        temperature: float,
        num_return_sequences: int,
        trace: StepTrace,
    ):
        super().__init__(input_ids, num_beams, max_length, processors, criteria, trace)
        b, k, device = input_ids.shape[0], num_beams, input_ids.device
        self.eos_token_id, self.fill_token_id, self.temperature = eos_token_id, fill_token_id, temperature
        self.num_return_sequences = num_return_sequences
        # live: the K slots, scored by their Gumbel keys; "phi" their log-probs; a finished slot stays in place
        keys = torch.full((b, k), NEG_INF, device=device)
        keys[:, 0] = gumbel((b,), device)  # the root: G ~ Gumbel(phi = 0); only the first beam is live
        self.live = Hypotheses.empty(input_ids, k, max_length, fill_token_id, NEG_INF).replace(
            scores=keys, phi=torch.zeros(b, k, device=device))
        self.threshold = torch.full((b,), NEG_INF, device=device)  # [B] kappa: the largest key dropped so far

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """One step: expand the live beams, keep the K best keys; returns the flat parent rows ``[N]``."""
        slots = self.live
        b, k = slots.scores.shape
        scores = run_processors(self.processors, self.tokens(), torch.log_softmax(logits, dim=-1), True)  # [N, V]
        log_probs = torch.log_softmax(scores / self.temperature, dim=-1)  # [N, V] the distribution sampled
        self.trace.record(log_probs, logits)
        vocab = log_probs.shape[-1]
        log_probs = unflatten_beams(log_probs, b)  # [B, K, V]
        # a log-softmax row with a NaN, a +inf or every token masked is NaN throughout (see score_checks); a masked
        # row is a dead end here (its children are impossible), so the watch forgives rows that are all -inf
        self.watch.start(self.length - self.prompt_length, logits, scores, masked_rows_allowed=True)
        live = ~slots.finished & (slots.scores > NEG_INF)  # [B, K]
        self.watch.flag((torch.isnan(log_probs[:, :, 0]) & live).any(dim=1))
        children = self._child_keys(log_probs, live)  # [B, K*V]
        kept = torch.where(slots.finished, slots.scores, NEG_INF)  # [B, K] complete sequences compete as they are
        top_keys, chosen = torch.topk(torch.cat((children, kept), dim=1), k=k + 1)  # [B, K+1], descending
        self.threshold = torch.maximum(self.threshold, top_keys[:, k])
        keys, chosen = top_keys[:, :k], chosen[:, :k]  # [B, K]
        is_child = chosen < k * vocab
        grown = is_child & (keys > NEG_INF)  # [B, K] a live beam's new token (not an empty slot)
        parents = torch.where(is_child, chosen // vocab, chosen - k * vocab)  # [B, K] within the example
        tokens = torch.where(grown, chosen % vocab, self.fill_token_id)
        flat = log_probs.reshape(b, k * vocab)
        token_log_probs = torch.where(grown, torch.gather(flat, 1, chosen.clamp(max=k * vocab - 1)), 0.0)
        rows = torch.where(grown, flat_parent_rows(parents).reshape(b, k), -1)
        # the new slots: gathered from their parents, with this step's token where grown
        self.live = slots = slots.extend(parents, tokens, token_log_probs, rows, self.length)
        slots.phi, slots.scores = slots.phi + token_log_probs, keys
        self.length += 1
        hits = self.criteria(self.tokens(), self.trace.scores).reshape(b, k)  # [B, K]
        just_finished = grown & hits
        reasons = classify_stop(self.tokens(), flatten_beams(just_finished), self.eos_token_id, self.max_length)
        slots.finished = torch.where(is_child, just_finished, slots.finished)
        slots.reasons = torch.where(is_child, reasons.reshape(b, k), slots.reasons)
        return flat_parent_rows(parents)

    def _child_keys(self, log_probs: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Every child's key, ``[B, K*V]``: -inf for the children of finished and empty slots (not ``live [B, K]``)."""
        b, k, vocab = log_probs.shape
        perturbed = self.live.phi[:, :, None] + log_probs + gumbel((b, k, vocab), log_probs.device)  # [B, K, V]
        keys = conditional_keys(self.live.scores[:, :, None], perturbed)
        return torch.where(live[:, :, None], keys, NEG_INF).reshape(b, k * vocab)

    def is_done(self) -> bool:
        if self.length >= self.max_length:
            return True
        done = torch.all(self.live.finished | (self.live.scores == NEG_INF))
        return self.watch.read(done.reshape(1))[0]  # the step's one host synchronisation

    def result(self) -> StochasticBeamResult:
        n, t0, slots = self.num_return_sequences, self.prompt_length, self.live
        empty = slots.scores[:, :n] == NEG_INF  # [B, n]: fewer complete sequences than slots
        beam_indices = torch.where(empty[:, :, None], -1, slots.beam_indices[:, :n])  # [B, n, G]
        generated = (beam_indices >= 0).sum(dim=-1)  # [B, n]
        width = self.watch.read_max(generated)
        token_log_probs = torch.where(empty[:, :, None], 0.0, slots.token_log_probs[:, :n, :width])
        sequences = slots.tokens[:, :n, : t0 + width].clone()
        sequences[:, :, t0:] = torch.where(empty[:, :, None], self.fill_token_id, sequences[:, :, t0:])
        log_probs = torch.where(empty, NEG_INF, token_log_probs.sum(dim=-1))  # [B, n] phi
        reason = torch.where(slots.finished[:, :n], slots.reasons[:, :n], int(FinishReason.NONE))
        threshold = slots.scores[:, n] if n < self.rows_per_example else self.threshold
        scores, logits = self.trace.as_tuples()
        return StochasticBeamResult(
            sequences=sequences, sequences_scores=log_probs, sum_log_probs=log_probs, token_log_probs=token_log_probs,
            lengths=t0 + generated, finish_reason=reason, prompt_length=t0, scores=scores, logits=logits,
            beam_indices=beam_indices[:, :, :width], keys=slots.scores[:, :n].clone(), threshold=threshold.clone())
