"""A deliberately simple tensor2tensor beam search, for tests: one example at a time, Python lists and floats.

Written from the algorithm of ``tensor2tensor.utils.beam_search.beam_search`` (alive / finished pools,
``grow_topk`` / ``grow_alive`` / ``grow_finished``, the ``_is_finished`` bound), not from
``beamsearch.strategies.t2t``; it shares no code with it. Scores are float64 here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

INF = 1.0e7  # t2t's finite "infinity"


@dataclasses.dataclass
class Hypothesis:
    tokens: tuple[int, ...]  # start tokens included
    score: float  # penalised score (candidates, finished pool) or log-prob (returned alive beams)
    log_prob: float  # t2t's alive log-prob: the generated tokens' log-probs summed (dummy beams start at -INF)
    finished: bool
    token_log_probs: tuple[float, ...] = ()  # each generated token's log-prob


def gnmt_penalty(length: int, alpha: float) -> float:
    return ((5.0 + length) / 6.0) ** alpha


def log_softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    total = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - total for x in logits]


def ranked(entries: list[tuple[float, Hypothesis]], count: int) -> list[tuple[float, Hypothesis]]:
    """The ``count`` best by key, ties in list order (TF's top_k)."""
    order = sorted(range(len(entries)), key=lambda i: (-entries[i][0], i))
    return [entries[i] for i in order[:count]]


def reference_t2t_search(
    logits_fn: Callable[[tuple[int, ...]], Sequence[float]],
    prompts: Sequence[Sequence[int]],
    *,
    beam_size: int,
    decode_length: int,
    alpha: float,
    stop_early: bool,
    eos_ids: Sequence[int],
) -> tuple[list[list[Hypothesis]], int]:
    """Run t2t's beam search on every prompt in lockstep (the stop test is over the whole batch).

    Args:
        logits_fn: prefix (start tokens included) -> raw logits over the vocabulary.
        prompts: each example's start tokens.
        beam_size: K.
        decode_length: G, the number of steps at most (generated tokens, end token included).
        alpha: GNMT length penalty exponent.
        stop_early: t2t's stop_early.
        eos_ids: tokens that end a hypothesis (t2t has one; with E of them, (1 + E) K candidates per step).

    Returns:
        Per example, K hypotheses best first (the finished pool if anything finished, else the alive
        beams with their log-probs as scores), and the number of steps run.
    """
    k = beam_size
    num_candidates = (1 + max(len(eos_ids), 1)) * k
    alive = [[Hypothesis(tuple(p), 0.0 if j == 0 else -INF, 0.0 if j == 0 else -INF, False) for j in range(k)]
             for p in prompts]
    finished = [[Hypothesis(tuple(p), -INF, 0.0, False) for _ in range(k)] for p in prompts]
    step = 0
    while step < decode_length and not bound_is_met(alive, finished, decode_length, alpha, stop_early):
        for example in range(len(prompts)):
            candidates = grow_topk(logits_fn, alive[example], step, alpha, num_candidates, eos_ids)
            alive[example] = [hyp for _, hyp in ranked(
                [(hyp.score - INF * hyp.finished, hyp) for hyp in candidates], k)]
            pool = [(hyp.score, hyp) for hyp in finished[example]]
            pool += [(hyp.score - INF * (not hyp.finished), hyp) for hyp in candidates]
            finished[example] = [dataclasses.replace(hyp, score=score) for score, hyp in ranked(pool, k)]
        step += 1
    results = []
    for example in range(len(prompts)):
        if any(hyp.finished for hyp in finished[example]):
            results.append(finished[example])
        else:
            results.append([dataclasses.replace(hyp, score=hyp.log_prob) for hyp in alive[example]])
    return results, step


def grow_topk(logits_fn, beams: list[Hypothesis], step: int, alpha: float, count: int,
              eos_ids: Sequence[int]) -> list[Hypothesis]:
    """The ``count`` best one-token extensions of the alive beams by penalised score."""
    penalty = gnmt_penalty(step + 1, alpha)
    entries = []
    for beam in beams:
        for token, token_log_prob in enumerate(log_softmax(logits_fn(beam.tokens))):
            log_prob = beam.log_prob + token_log_prob
            hyp = Hypothesis(beam.tokens + (token,), log_prob / penalty, log_prob, token in eos_ids,
                             beam.token_log_probs + (token_log_prob,))
            entries.append((hyp.score, hyp))
    return [hyp for _, hyp in ranked(entries, count)]


def bound_is_met(alive, finished, decode_length: int, alpha: float, stop_early: bool) -> bool:
    """t2t's stop test: no alive beam can beat the finished ones, for every example."""
    lower_bounds = [beams[0].log_prob / gnmt_penalty(decode_length, alpha) for beams in alive]
    if stop_early:
        bests = [max(hyp.score for hyp in pool) for pool in finished]
        return all(best > bound for best, bound in zip(bests, lower_bounds, strict=True))
    worst = min(hyp.score for pool in finished for hyp in pool)  # over the whole batch, as t2t's reduce_min
    return all(worst > bound for bound in lower_bounds)
