"""Stochastic beam search (``stochastic_beam_search=True``) against brute force on a tiny vocabulary.

The oracle enumerates every complete sequence of a fixed step function (3 tokens, EOS included, at most 3 new
tokens: 15 sequences) with its exact probability, and computes the exact inclusion probabilities of sampling K
without replacement from the sequential formula ``P(y1, ..., yK) = prod_i p(y_i) / (1 - sum_{j<i} p(y_j))``,
independently of any Gumbel arithmetic. Many identical rows are decoded in one call and the counts are compared
with exact binomial tails: a count fails when its two-sided tail probability is below ``ALPHA / m`` (m counts
checked), so each set of counts fails wrongly with probability at most ``ALPHA`` = 1e-4 (Bonferroni over the m
counts; exact tails, so conservative; the seeds are fixed, so a run is deterministic). Deliberately broken variants
(children's keys not conditioned on the parent's, finished hypotheses handicapped in the ranking) fail them.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from fakes import count_host_conversions
from numerics import assert_bitwise, assert_scores_close

import beamsearch
from beamsearch.strategies.stochastic import conditional_keys, importance_weights

VOCAB, EOS, MAX_NEW = 3, 0, 3
ROWS = 20000  # identical copies of the example, decoded in one call
ALPHA = 1e-4  # the family-wise false-failure rate of each set of counts checked


def _table(seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((VOCAB + 1) ** (MAX_NEW + 1), VOCAB, generator=generator) * 1.5


TABLE = _table()


def step(tokens: torch.Tensor, state):
    """Logits from the whole prefix: its base-(V+1) code (digits token + 1) indexes a fixed random table."""
    powers = (VOCAB + 1) ** torch.arange(tokens.shape[1])
    code = ((tokens % VOCAB + 1) * powers).sum(dim=1)
    return TABLE[code], state


def step_log_probs(prefix: list[int], temperature: float = 1.0, min_new: int = 0, start: int = 1) -> torch.Tensor:
    """The per-step distribution the search samples from, for one prefix: processors, then temperature."""
    log_probs = torch.log_softmax(step(torch.tensor([prefix]), None)[0][0], dim=-1)
    if len(prefix) - start < min_new:
        log_probs = log_probs.clone()
        log_probs[EOS] = float("-inf")
    return torch.log_softmax(log_probs / temperature, dim=-1)


def enumerate_sequences(start: int = 1, **distribution) -> dict[tuple[int, ...], float]:
    """Every complete sequence (generated tokens) -> its exact log-probability (float64)."""
    out: dict[tuple[int, ...], float] = {}

    def grow(generated: tuple[int, ...], log_prob: float) -> None:
        if (generated and generated[-1] == EOS) or len(generated) == MAX_NEW:
            if log_prob > float("-inf"):
                out[generated] = log_prob
            return
        log_probs = step_log_probs([start, *generated], **distribution).double()
        for token in range(VOCAB):
            grow(generated + (token,), log_prob + float(log_probs[token]))

    grow((), 0.0)
    return out


def inclusion_probabilities(probs: dict[tuple[int, ...], float], k: int) -> dict[tuple[int, ...], float]:
    """Exact P(y among the K sampled without replacement), summed over every ordered K-tuple."""
    inclusion = dict.fromkeys(probs, 0.0)
    for ordered in itertools.permutations(probs, k):
        p, left = 1.0, 1.0
        for y in ordered:
            p *= probs[y] / left
            left -= probs[y]
        for y in ordered:
            inclusion[y] += p
    return inclusion


def generated_tokens(result, b: int, j: int) -> tuple[int, ...]:
    return tuple(result.sequences[b, j, result.prompt_length : int(result.lengths[b, j])].tolist())


def two_sided_tail(count: int, trials: int, p: float) -> float:
    """Exact two-sided binomial tail: 2 min(P(X <= count), P(X >= count)), capped at 1."""
    pmf = torch.distributions.Binomial(trials, torch.tensor(p, dtype=torch.float64)).log_prob(
        torch.arange(trials + 1, dtype=torch.float64)).exp()
    lower, upper = float(pmf[: count + 1].sum()), float(pmf[count:].sum())
    return min(1.0, 2 * min(lower, upper))


def assert_counts_match(counts: dict, expected: dict, trials: int) -> None:
    checked = len(expected)
    for y, p in expected.items():
        tail = two_sided_tail(counts.get(y, 0), trials, min(max(p, 0.0), 1.0))
        assert tail >= ALPHA / checked, (y, counts.get(y, 0), trials * p)
    assert set(counts) <= set(expected), set(counts) - set(expected)


def sample(k: int, seed: int, rows: int = ROWS, **options):
    torch.manual_seed(seed)
    return beamsearch.search(step, torch.ones(rows, 1, dtype=torch.long), num_beams=k, num_return_sequences=k,
                             max_new_tokens=MAX_NEW, eos_token_id=EOS, stochastic_beam_search=True, **options)


def test_one_sample_has_the_sequence_distribution():
    exact = {y: math.exp(lp) for y, lp in enumerate_sequences().items()}
    result = sample(1, seed=0)
    counts: dict = {}
    for b in range(ROWS):
        y = generated_tokens(result, b, 0)
        counts[y] = counts.get(y, 0) + 1
    assert_counts_match(counts, exact, ROWS)


@pytest.mark.parametrize("k", [2, 3])
def test_inclusion_frequencies_are_those_of_sampling_without_replacement(k):
    exact = {y: math.exp(lp) for y, lp in enumerate_sequences().items()}
    result = sample(k, seed=k)
    counts: dict = {}
    first: dict = {}
    for b in range(ROWS):
        returned = [generated_tokens(result, b, j) for j in range(k)]
        assert len(set(returned)) == k  # without replacement
        for y in returned:
            counts[y] = counts.get(y, 0) + 1
        first[returned[0]] = first.get(returned[0], 0) + 1
    assert_counts_match(counts, inclusion_probabilities(exact, k), ROWS)
    assert_counts_match(first, exact, ROWS)  # the largest key is a plain sample from p
    assert torch.all(result.keys[:, :-1] >= result.keys[:, 1:])  # returned in the order of the keys
    assert torch.all(result.threshold <= result.keys[:, -1])


def test_returned_log_probs_equal_brute_force_with_processors_and_temperature():
    distribution = {"temperature": 0.7, "min_new": 1}
    exact = enumerate_sequences(**distribution)
    result = sample(3, seed=5, rows=200, temperature=0.7, min_new_tokens=1)
    for b in range(200):
        for j in range(3):
            y = generated_tokens(result, b, j)
            assert y in exact  # min_new_tokens=1: never EOS first
            assert result.sum_log_probs[b, j].item() == pytest.approx(exact[y], abs=1e-5)
            assert result.sequences_scores[b, j].item() == pytest.approx(exact[y], abs=1e-5)
            per_token = step_log_probs([1], **distribution)[y[0]].item()
            assert result.token_log_probs[b, j, 0].item() == pytest.approx(per_token, abs=1e-6)
            finish = beamsearch.FinishReason.EOS if y[-1] == EOS else beamsearch.FinishReason.MAX_LENGTH
            assert result.finish_reason[b, j].item() == finish
    assert_scores_close(result.token_log_probs.sum(dim=-1), result.sum_log_probs)


def test_k_equal_to_the_number_of_sequences_returns_each_once():
    exact = enumerate_sequences()
    k = len(exact)
    result = sample(k, seed=7, rows=50)
    for b in range(50):
        returned = [generated_tokens(result, b, j) for j in range(k)]
        assert sorted(returned) == sorted(exact)
    assert torch.all(torch.isinf(result.threshold))  # nothing left out: kappa = -inf
    weights = result.importance_weights()
    assert_scores_close(weights, result.sum_log_probs.exp())  # q = 1: the estimator is the exact expectation
    # one slot more than there are sequences: an empty slot comes last, with key and log-prob -inf
    wider = sample(k + 1, seed=7, rows=5)
    assert torch.all(wider.keys[:, -1] == float("-inf")) and torch.all(wider.sum_log_probs[:, -1] == float("-inf"))
    assert torch.all(wider.lengths[:, -1] == 1) and torch.all(wider.importance_weights()[:, -1] == 0)


def test_the_estimator_is_unbiased():
    """The importance-weighted estimate of E[len(y)] averages to the exact expectation."""
    exact = enumerate_sequences()
    expectation = sum(math.exp(lp) * len(y) for y, lp in exact.items())
    result = sample(3, seed=11)
    estimates = (result.importance_weights().double() * (result.lengths - 1).double()).sum(dim=1)  # [B]
    standard_error = estimates.std().item() / math.sqrt(ROWS)
    assert abs(estimates.mean().item() - expectation) < 4.5 * standard_error  # false-failure rate ~7e-6


def test_conditional_keys_have_the_parent_key_as_maximum_and_are_stable():
    torch.manual_seed(0)
    perturbed = torch.randn(1000, 5) * 30
    perturbed[:, 3] = float("-inf")
    parent = torch.randn(1000, 1) * 30
    keys = conditional_keys(parent, perturbed)
    assert torch.equal(keys.max(dim=-1, keepdim=True)[0], parent)
    assert torch.all(keys[:, 3] == float("-inf")) and torch.all(torch.isfinite(keys[:, [0, 1, 2, 4]]))
    # the defining formula, in float64 where it is well conditioned
    naive = -torch.log(torch.exp(-parent.double()) - torch.exp(-perturbed.double().max(dim=-1, keepdim=True)[0])
                       + torch.exp(-perturbed.double()))
    close = (parent.abs() < 5).squeeze(1) & (perturbed.abs() < 5).all(dim=1)
    assert torch.allclose(keys[close][:, [0, 1, 2, 4]].double(), naive[close][:, [0, 1, 2, 4]], atol=1e-4)
    assert torch.all(conditional_keys(torch.full((2, 1), float("-inf")), perturbed[:2]) == float("-inf"))
    assert torch.equal(importance_weights(torch.tensor([[0.0]]), torch.tensor([float("-inf")])), torch.ones(1, 1))


def test_hugging_face_generate_is_reproducible_and_scores_are_teacher_forced():
    from tiny_hf import tiny_model

    model = tiny_model("t5")
    source = torch.randint(2, 40, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(source)
    mask[0, 4:] = 0
    kwargs = dict(input_ids=source, attention_mask=mask, num_beams=4, num_return_sequences=4, max_new_tokens=6,
                  stochastic_beam_search=True, return_dict_in_generate=True, output_scores=True)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(beamsearch.generate(model, **kwargs))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert_bitwise(runs[0].sequences_scores, runs[1].sequences_scores, "the same call twice under the same seed")
    assert not torch.equal(runs[0].sequences, runs[2].sequences)
    torch.manual_seed(2)
    from beamsearch.adapters.hf import search_model

    result = search_model(model, **{k: v for k, v in kwargs.items() if k != "return_dict_in_generate"})
    assert torch.all(result.keys[:, :-1] >= result.keys[:, 1:])
    for b in range(3):
        rows = {tuple(result.sequences[b, j, : int(result.lengths[b, j])].tolist()) for j in range(4)}
        assert len(rows) == 4  # without replacement
        for j in range(4):
            length = int(result.lengths[b, j])
            decoder = result.sequences[b, j : j + 1, :length]
            with torch.no_grad():
                logits = model(input_ids=source[b : b + 1], attention_mask=mask[b : b + 1],
                               decoder_input_ids=decoder[:, :-1]).logits
            forced = torch.log_softmax(logits[0], dim=-1).gather(1, decoder[0, 1:, None]).sum()
            assert result.sum_log_probs[b, j].item() == pytest.approx(forced.item(), abs=1e-4)


@pytest.mark.parametrize("options, name", [
    ({"do_sample": True}, "do_sample"),
    ({"num_return_sequences": 5}, "num_return_sequences"),
    ({"num_beam_groups": 2, "diversity_penalty": 1.0}, "num_beam_groups"),
    ({"semantics": "ct2"}, "semantics"),
    ({"stochastic_beam_search": "yes"}, "stochastic_beam_search"),
])
def test_bad_combinations_are_rejected_by_name(options, name):
    from tiny_hf import tiny_model

    values = {"num_beams": 4, "stochastic_beam_search": True, "max_new_tokens": 3, **options}
    with pytest.raises(ValueError, match=name):
        beamsearch.generate(tiny_model("t5"), input_ids=torch.tensor([[5, 6, 1]]), **values)
    with pytest.raises(ValueError, match=name):
        beamsearch.search(step, torch.ones(1, 1, dtype=torch.long), **values)


@pytest.mark.parametrize("extra", [{"unique": True}, {"sequence_scorer": lambda t, lp, n: lp.sum(dim=1)},
                                   {"force_words_ids": [[1]]}, {"output_alignments": True}])
def test_ranking_hooks_and_constraints_are_rejected(extra):
    with pytest.raises(ValueError, match="stochastic_beam_search"):
        beamsearch.search(step, torch.ones(1, 1, dtype=torch.long), num_beams=2, stochastic_beam_search=True,
                          max_new_tokens=2, eos_token_id=EOS, **extra)


def test_at_most_one_host_synchronisation_per_step(monkeypatch):
    """Tensor -> Python conversions during a search: one per step (the "all done?" check), one final crop."""
    calls = []

    def counted_step(tokens, state):
        calls.append(tokens.shape[1])
        return step(tokens, state)

    conversions = count_host_conversions(monkeypatch)
    beamsearch.search(counted_step, torch.ones(4, 1, dtype=torch.long), num_beams=3, max_new_tokens=MAX_NEW,
                      eos_token_id=EOS, stochastic_beam_search=True, min_new_tokens=1)
    monkeypatch.undo()
    assert len(calls) >= 2
    assert len(conversions) <= len(calls) + 1, (conversions, len(calls))
