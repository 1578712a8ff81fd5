"""tensor2tensor beam search (``semantics="t2t"``) against a plain per-example reference (tests/t2t_reference.py)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from numerics import assert_scores_close
from t2t_reference import INF, reference_t2t_search

import beamsearch
from beamsearch.loop import decode
from beamsearch.options import SearchOptions
from beamsearch.processors import build_processors
from beamsearch.results import FinishReason
from beamsearch.scoring import length_penalty
from beamsearch.stopping import build_stopping_criteria
from beamsearch.strategies.base import StepTrace
from beamsearch.strategies.t2t import T2TBeamSearch

VOCAB = 20
PAD = VOCAB - 1  # the fill token of the returned sequences


class HashedPrefixModel:
    """Logits a fixed pseudo-random function of the whole prefix; the end tokens get likelier with length.

    ``step(tokens [N, t], state) -> (logits [N, V], state)``; ``logits(prefix)`` gives the same values as
    Python floats (float32-exact) for the reference. ``calls`` counts steps.
    """

    def __init__(self, eos_ids=(0,), seed=0, eos_bias=-1.5, eos_slope=0.6, scale=2.0):
        self.eos_ids, self.seed = tuple(eos_ids), seed
        self.eos_bias, self.eos_slope, self.scale = eos_bias, eos_slope, scale
        self.cache: dict[tuple[int, ...], list[float]] = {}
        self.calls = 0

    def logits(self, prefix: tuple[int, ...]) -> list[float]:
        if prefix not in self.cache:
            rng = random.Random(f"{self.seed}:{prefix}")
            values = [rng.gauss(0.0, self.scale) for _ in range(VOCAB)]
            for eos in self.eos_ids:
                values[eos] += self.eos_bias + self.eos_slope * len(prefix)
            self.cache[prefix] = torch.tensor(values, dtype=torch.float32).tolist()
        return self.cache[prefix]

    def __call__(self, tokens: torch.Tensor, state):
        self.calls += 1
        return torch.tensor([self.logits(tuple(row)) for row in tokens.tolist()]), state


def run_t2t(model, prompts, *, beams, max_new_tokens, alpha, stop_early, eos_ids, num_return_sequences=1, **extra):
    """``beamsearch.search(..., semantics="t2t")``; with one beam (which the engine sends to greedy search)
    the strategy is driven directly through the same loop, processors and criteria."""
    kwargs = dict(semantics="t2t", num_beams=beams, length_penalty=alpha, early_stopping=stop_early,
                  max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), pad_token_id=PAD,
                  num_return_sequences=num_return_sequences, **extra)
    input_ids = torch.tensor(prompts)
    if beams > 1:
        return beamsearch.search(model, input_ids, **kwargs)
    options = SearchOptions.create(**kwargs)
    t0 = input_ids.shape[1]
    strategy = T2TBeamSearch(input_ids, options.resolved_max_length(t0), build_processors(options, t0),
                             build_stopping_criteria(options, t0), options=options, fill_token_id=PAD,
                             trace=StepTrace(False, False))
    return decode(model, None, strategy, input_ids.shape[0])


def assert_matches_reference(result, expected, steps, model, num_return_sequences):
    assert model.calls == steps
    assert result.sequences.shape[:2] == (len(expected), num_return_sequences)
    for b, hypotheses in enumerate(expected):
        any_finished = any(hyp.finished for hyp in hypotheses)
        for j, hyp in enumerate(hypotheses[:num_return_sequences]):
            where = (b, j)
            length = int(result.lengths[b, j])
            assert result.sequences[b, j, :length].tolist() == list(hyp.tokens), where
            assert (result.sequences[b, j, length:] == PAD).all(), where
            assert float(result.sequences_scores[b, j]) == pytest.approx(hyp.score, rel=1e-6, abs=1e-5), where
            assert float(result.sum_log_probs[b, j]) == pytest.approx(sum(hyp.token_log_probs), abs=1e-5), where
            generated = length - result.prompt_length
            assert result.token_log_probs[b, j, :generated].tolist() == pytest.approx(hyp.token_log_probs, abs=1e-5)
            assert (result.token_log_probs[b, j, generated:] == 0).all(), where
            if hyp.finished:
                reason = FinishReason.EOS
            elif any_finished:
                reason = FinishReason.NONE  # a finished slot never filled (score -INF)
            else:
                reason = FinishReason.MAX_LENGTH
            assert int(result.finish_reason[b, j]) == reason, where


def sweep():
    """alpha x beams x stop_early x end ids; lengths, batch sizes, prompts, seeds and n vary with the index."""
    grid = itertools.product([0.0, 0.6, 1.0, 2.0], range(1, 7), [True, False], [(0,), (0, 7)])
    for index, (alpha, beams, stop_early, eos_ids) in enumerate(grid):
        yield pytest.param(
            dict(alpha=alpha, beams=beams, stop_early=stop_early, eos_ids=eos_ids,
                 max_new_tokens=[1, 2, 4, 7, 10, 13][index % 6], batch=1 + index % 3, prompt_length=1 + index % 2,
                 num_return_sequences=1 + index % beams, seed=index),
            id=f"a{alpha}-k{beams}-early{stop_early}-eos{len(eos_ids)}-{index}",
        )


def run_case(case):
    model = HashedPrefixModel(eos_ids=case["eos_ids"], seed=case["seed"])
    prompts = [[1 + (b + i) % (VOCAB - 2) for i in range(case["prompt_length"])] for b in range(case["batch"])]
    prompts = [[token if token not in case["eos_ids"] else 3 for token in p] for p in prompts]
    expected, steps = reference_t2t_search(
        model.logits, prompts, beam_size=case["beams"], decode_length=case["max_new_tokens"], alpha=case["alpha"],
        stop_early=case["stop_early"], eos_ids=case["eos_ids"])
    result = run_t2t(model, prompts, beams=case["beams"], max_new_tokens=case["max_new_tokens"], alpha=case["alpha"],
                     stop_early=case["stop_early"], eos_ids=case["eos_ids"],
                     num_return_sequences=case["num_return_sequences"])
    return result, expected, steps, model


@pytest.mark.parametrize("case", list(sweep()))
def test_matches_reference(case):
    result, expected, steps, model = run_case(case)
    assert_matches_reference(result, expected, steps, model, case["num_return_sequences"])


def test_the_sweep_finishes_hypotheses_at_varied_steps_and_stops_both_ways():
    finish_lengths, stopped_early, ran_out = set(), 0, 0
    for param in sweep():
        case = param.values[0]
        result, expected, steps, _ = run_case(case)
        finish_lengths |= {len(h.tokens) - case["prompt_length"] for hyps in expected for h in hyps if h.finished}
        stopped_early += steps < case["max_new_tokens"]
        ran_out += steps == case["max_new_tokens"]
    assert finish_lengths >= set(range(1, 11))
    assert stopped_early >= 10 and ran_out >= 10


@pytest.mark.parametrize("stop_early", [True, False])
@pytest.mark.parametrize("beams", [1, 3])
def test_nothing_finishes_returns_alive_beams_with_their_log_probs(stop_early, beams):
    model = HashedPrefixModel(eos_bias=-1.0e4, eos_slope=0.0, seed=5)
    prompts = [[2], [4]]
    expected, steps = reference_t2t_search(model.logits, prompts, beam_size=beams, decode_length=5, alpha=0.6,
                                           stop_early=stop_early, eos_ids=(0,))
    result = run_t2t(model, prompts, beams=beams, max_new_tokens=5, alpha=0.6, stop_early=stop_early,
                     eos_ids=(0,), num_return_sequences=beams)
    assert steps == 5 and not any(h.finished for hyps in expected for h in hyps)
    assert_matches_reference(result, expected, steps, model, beams)
    assert (result.finish_reason == FinishReason.MAX_LENGTH).all()
    assert (result.lengths == 6).all()
    assert_scores_close(result.sequences_scores, result.sum_log_probs)  # log-probs, not penalised


@pytest.mark.parametrize(("length", "alpha", "expected"), [
    (1, 0.6, 1.0),  # (5 + 1) / 6 = 1 whatever alpha
    (7, 0.6, 2.0**0.6),  # (5 + 7) / 6 = 2
    (7, 0.0, 1.0),
    (13, 1.0, 3.0),  # 18 / 6
    (19, 0.5, 2.0),  # sqrt(24 / 6)
    (31, 2.0, 36.0),  # (36 / 6) ** 2
])
def test_gnmt_length_penalty(length, alpha, expected):
    assert length_penalty("wu", length, alpha) == pytest.approx(expected, rel=1e-12)  # as t2t uses it


class ConstantModel:
    """The same next-token distribution after every prefix: EOS (token 0) 0.4, then 0.3, 0.2, 0.1."""

    probs = [0.4, 0.3, 0.2, 0.1]

    def __init__(self):
        self.calls = 0

    def __call__(self, tokens, state):
        self.calls += 1
        return torch.log(torch.tensor([self.probs] * tokens.shape[0])), state


@pytest.mark.parametrize(("stop_early", "steps"), [(True, 2), (False, 3)])
def test_hand_computed_two_beam_search(stop_early, steps):
    """K = 2, alpha = 1, G = 3. Step 1: [EOS] finishes with log 0.4 (penalty 1); alive [1], [2]. Bound:
    log 0.3 / (8/6) = -0.903 > log 0.4 = -0.916, so go on. Step 2: [1, EOS] finishes with
    (log 0.3 + log 0.4) / (7/6) = -1.817; alive [1, 1]: log 0.09 / (8/6) = -1.806. stop_early: the best
    finished, -0.916, beats it: stop. Otherwise the worst finished, -1.817, does not: a third step, whose
    best new ending, [1, 1, EOS] at log 0.036 / (8/6) = -2.493, stays out of the pool."""
    model = ConstantModel()
    result = run_t2t(model, [[3]], beams=2, max_new_tokens=3, alpha=1.0, stop_early=stop_early, eos_ids=(0,),
                     num_return_sequences=2)
    assert model.calls == steps
    assert result.sequences[0, :, :3].tolist() == [[3, 0, PAD], [3, 1, 0]]
    expected = [math.log(0.4), (math.log(0.3) + math.log(0.4)) / (7 / 6)]
    assert result.sequences_scores[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert result.sum_log_probs[0].tolist() == pytest.approx([math.log(0.4), math.log(0.12)], abs=1e-6)
    assert result.lengths[0].tolist() == [2, 3]
    assert (result.finish_reason == FinishReason.EOS).all()


def test_an_unfilled_finished_slot_is_empty_with_minus_inf():
    model = ConstantModel()
    result = run_t2t(model, [[3]], beams=3, max_new_tokens=1, alpha=0.6, stop_early=True, eos_ids=(0,),
                     num_return_sequences=3)
    assert result.sequences[0].tolist() == [[3, 0], [3, PAD], [3, PAD]]
    assert result.sequences_scores[0].tolist() == pytest.approx([math.log(0.4), -INF, -INF])
    assert result.finish_reason[0].tolist() == [FinishReason.EOS, FinishReason.NONE, FinishReason.NONE]
    assert result.lengths[0].tolist() == [2, 1, 1]


def test_a_stopping_criterion_ends_hypotheses_like_an_end_token():
    model = HashedPrefixModel(seed=3)

    def stop_on_five(input_ids, scores):
        return input_ids[:, -1] == 5

    result = beamsearch.search(
        model, torch.tensor([[2], [4]]), semantics="t2t", num_beams=4, length_penalty=0.6, early_stopping=False,
        max_new_tokens=8, eos_token_id=0, pad_token_id=PAD, num_return_sequences=4, stopping_criteria=[stop_on_five])
    last = result.sequences.gather(2, (result.lengths - 1)[:, :, None])[:, :, 0]  # [B, n]
    stopped = result.finish_reason == FinishReason.STOP_CRITERION
    assert stopped.any()
    assert (last[stopped] == 5).all()
    assert (last[result.finish_reason == FinishReason.EOS] == 0).all()


@pytest.mark.parametrize(("option", "value", "message"), [
    ("do_sample", True, "do_sample"),
    ("early_stopping", "never", "stop_early"),
])
def test_rejects_options_t2t_has_no_meaning_for(option, value, message):
    with pytest.raises(ValueError, match=message):
        beamsearch.search(ConstantModel(), torch.tensor([[3]]), semantics="t2t", num_beams=2, max_new_tokens=2,
                          eos_token_id=0, **{option: value})
