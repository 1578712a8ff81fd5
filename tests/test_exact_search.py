"""Exact search against brute force: every hypothesis of tiny vocabularies enumerated and scored by hand.

The brute force scores each sequence from the model's teacher-forced log-probs (the processors applied to the
log-softmax, as beam search applies them) with transformers' beam score ``sum / generated ** length_penalty``,
over every sequence that ends with the end token or reaches the length limit.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from fakes import GRUDecoder, PrefixModel
from numerics import assert_scores_close

from beamsearch import search
from beamsearch.loop import decode
from beamsearch.options import SearchOptions
from beamsearch.processors.pipeline import ProcessorList, build_processors
from beamsearch.strategies.base import StepTrace
from beamsearch.strategies.exact import ExactSearch

EOS = 0


def _brute_force(model: PrefixModel, prompt: list[int], generated: int, length_penalty: float,
                 min_new_tokens: int = 0) -> tuple[float, list[int]]:
    """The best (score, generated tokens) over all sequences, by enumeration."""
    best = (-math.inf, [])
    vocab = model.vocab_size
    for length in range(1, generated + 1):
        for tail in itertools.product(range(vocab), repeat=length):
            if EOS in tail[:-1] or (length < generated and tail[-1] != EOS):
                continue  # ends at its first end token, or runs to the limit
            total, tokens = 0.0, list(prompt)
            for position, token in enumerate(tail):
                log_probs = torch.log_softmax(model.logits_for(torch.tensor([tokens])), dim=-1)[0]
                if position < min_new_tokens:
                    log_probs[EOS] = -math.inf
                total += float(log_probs[token])
                tokens.append(token)
            score = total / length**length_penalty
            if score > best[0]:
                best = (score, list(tail))
    return best


def _exact(step, state, input_ids, max_new_tokens, length_penalty, min_new_tokens=0, max_nodes=100_000,
           incumbent=None):
    options = SearchOptions.create(eos_token_id=EOS, min_new_tokens=min_new_tokens, max_new_tokens=max_new_tokens)
    t0 = input_ids.shape[1]
    strategy = ExactSearch(input_ids, t0 + max_new_tokens, build_processors(options, t0), eos_token_id=(EOS,),
                           fill_token_id=EOS, length_penalty=length_penalty, max_nodes=max_nodes,
                           trace=StepTrace(False, False), incumbent=incumbent)
    return decode(step, state, strategy, input_ids.shape[0])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -0.5])
def test_exact_search_finds_the_brute_force_best(seed, length_penalty):
    vocab, generated = 4, 5
    model = PrefixModel(vocab, seed=seed, sharpness=1.0 + seed % 3)
    prompts = torch.tensor([[1, 2], [3, 1], [2, 2]])
    result = _exact(model, None, prompts, generated, length_penalty, min_new_tokens=seed % 2)
    assert bool(result.proven.all())
    for b, prompt in enumerate(prompts.tolist()):
        score, tokens = _brute_force(model, prompt, generated, length_penalty, min_new_tokens=seed % 2)
        length = int(result.lengths[b, 0])
        assert result.sequences[b, 0, 2:length].tolist() == tokens
        assert_scores_close(result.sequences_scores[b, 0], torch.tensor(score, dtype=torch.float32))
        # min_new_tokens masks the end token without renormalising: the chosen tokens' log-probs are the model's
        teacher = model.log_probs_of(result.sequences[b, 0, :length].tolist(), 2)
        assert_scores_close(result.token_log_probs[b, 0, : length - 2], torch.tensor(teacher))


@pytest.mark.parametrize("num_beams", [1, 2, 3])
def test_beam_search_never_beats_exact_search(num_beams):
    vocab, generated = 5, 5
    for seed in range(4):
        model = PrefixModel(vocab, seed=10 + seed, sharpness=1.5)
        prompts = torch.tensor([[1], [2], [3], [4]])
        exact = _exact(model, None, prompts, generated, 1.0)
        beam = search(model, prompts, None, num_beams=max(num_beams, 2), max_new_tokens=generated,
                      eos_token_id=EOS, length_penalty=1.0, early_stopping="never")
        assert bool((beam.sequences_scores[:, 0] <= exact.sequences_scores[:, 0] + 1e-5).all())
        assert bool(exact.proven.all())


def test_an_incumbent_prunes_without_changing_the_answer():
    model = PrefixModel(5, seed=3, sharpness=2.0)
    prompts = torch.tensor([[1], [2], [3]])
    plain = _exact(model, None, prompts, 5, 1.0)
    beam = search(model, prompts, None, num_beams=3, max_new_tokens=5, eos_token_id=EOS, length_penalty=1.0)
    pruned = _exact(model, None, prompts, 5, 1.0, incumbent=beam)
    assert torch.equal(pruned.sequences, plain.sequences)
    assert bool(pruned.proven.all()) and bool((pruned.nodes <= plain.nodes).all())
    assert int(pruned.nodes.sum()) < int(plain.nodes.sum())


def test_an_overstated_incumbent_is_not_reported_proven():
    model = PrefixModel(4, seed=1)
    prompts = torch.tensor([[1], [2]])
    beam = search(model, prompts, None, num_beams=2, max_new_tokens=4, eos_token_id=EOS, length_penalty=1.0)
    fake = type(beam)(**{**beam.__dict__, "sequences_scores": beam.sequences_scores + 5.0})  # a score no one has
    result = _exact(model, None, prompts, 4, 1.0, incumbent=fake)
    assert not bool(result.proven.any())
    assert bool((result.upper_bound >= beam.sequences_scores[:, 0] + 4.9).all())


def test_the_node_budget_stops_an_example_and_reports_a_valid_bound():
    model = PrefixModel(4, seed=5, sharpness=0.3)  # flat distributions: many hypotheses compete
    prompts = torch.tensor([[1, 2]])
    assert int(_exact(model, None, prompts, 5, 1.0).nodes[0]) > 20  # unbounded, it expands more than 20
    result = _exact(model, None, prompts, 5, 1.0, max_nodes=20)
    best, _ = _brute_force(model, [1, 2], 5, 1.0)
    assert not bool(result.proven[0]) and int(result.nodes[0]) <= 20
    assert float(result.upper_bound[0]) >= best - 1e-5  # nothing unexplored beats the bound
    assert float(result.sequences_scores[0, 0]) <= best + 1e-5


def test_exact_search_with_a_cached_state_matches_the_uncached_model():
    model = GRUDecoder(vocab_size=6, hidden=8, seed=4)
    source = torch.tensor([[1, 2, 3], [4, 5, 1]])
    prompts = torch.tensor([[1], [1]])
    cached = _exact(model.step_cached, model.initial_state(source), prompts, 6, 1.0)
    uncached = _exact(model.step_uncached, model.initial_state(source), prompts, 6, 1.0)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert_scores_close(cached.sequences_scores, uncached.sequences_scores)
    assert bool(cached.proven.all())


def test_a_processor_that_raises_log_probs_above_zero_is_refused():
    class Bonus:
        def __call__(self, input_ids, scores):
            return scores + 1.0

        def select_rows(self, index):
            return self

    strategy = ExactSearch(torch.tensor([[1]]), 4, ProcessorList([Bonus()]), eos_token_id=(EOS,), fill_token_id=EOS,
                           length_penalty=1.0, max_nodes=100, trace=StepTrace(False, False))
    with pytest.raises(ValueError, match="log-probs <= 0"):
        decode(PrefixModel(4), None, strategy, 1)


def _enumerated_best(model, ids, mask, generated: int, length_penalty: float) -> tuple[float, list[int]]:
    """The best (score, decoder tokens after the start token) of a T5 over every output up to ``generated`` tokens,
    by scoring all of them with full forward passes (one per depth, every prefix at once)."""
    eos, start = model.config.eos_token_id, model.config.decoder_start_token_id
    encoded = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state  # [1, S, d]
    prefixes, totals, best = [[start]], [0.0], (-math.inf, [])
    for depth in range(1, generated + 1):
        rows = len(prefixes)
        logits = model(encoder_outputs=(encoded.expand(rows, -1, -1),), attention_mask=mask.expand(rows, -1),
                       decoder_input_ids=torch.tensor(prefixes)).logits[:, -1].float()
        log_probs = torch.log_softmax(logits, dim=-1).tolist()
        extended, extended_totals = [], []
        for prefix, total, row in zip(prefixes, totals, log_probs, strict=True):
            for token, log_prob in enumerate(row):
                if token == eos or depth == generated:
                    score = (total + log_prob) / depth**length_penalty
                    if score > best[0]:
                        best = (score, prefix[1:] + [token])
                else:
                    extended.append(prefix + [token])
                    extended_totals.append(total + log_prob)
        prefixes, totals = extended, extended_totals
    return best


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_exact_search_through_the_adapter_matches_enumeration_on_a_tiny_t5(length_penalty):
    from tiny_hf import random_inputs, tiny_model

    from beamsearch.adapters.hf import search_model

    model = tiny_model("t5", seed=1)
    ids, mask = random_inputs(model, 2, torch.Generator().manual_seed(3))
    with torch.no_grad():
        result = search_model(model, input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=3,
                              exact_search=True, length_penalty=length_penalty)
        assert bool(result.proven.all())
        for b in range(2):
            score, tokens = _enumerated_best(model, ids[b : b + 1], mask[b : b + 1], 3, length_penalty)
            length = int(result.lengths[b, 0])
            assert result.sequences[b, 0, 1:length].tolist() == tokens
            assert_scores_close(result.sequences_scores[b, 0], torch.tensor(score, dtype=torch.float32))


def test_exact_search_options_are_validated_by_name():
    model = PrefixModel(4)
    ids = torch.tensor([[1]])
    for kwargs, message in [({"do_sample": True}, "do_sample"), ({"num_return_sequences": 2, "num_beams": 2},
                            "num_return_sequences must be 1"), ({"semantics": "ct2", "num_beams": 2}, "semantics='hf'"),
                            ({"output_scores": True}, "per-step scores"), ({"max_time": 1.0}, "max_time"),
                            ({"max_nodes": 0}, "max_nodes")]:
        with pytest.raises(ValueError, match=message):
            search(model, ids, None, exact_search=True, eos_token_id=EOS, max_new_tokens=3, **kwargs)
    with pytest.raises(ValueError, match="incumbent is a threshold for exact_search"):
        search(model, ids, None, eos_token_id=EOS, max_new_tokens=3, incumbent=object())
    with pytest.raises(ValueError, match="max_nodes=5 is not supported by beam search"):
        search(model, ids, None, num_beams=2, eos_token_id=EOS, max_new_tokens=3, max_nodes=5)


def test_search_with_exact_search_equals_the_strategy_and_uses_the_incumbent():
    model = PrefixModel(5, seed=3, sharpness=2.0)
    prompts = torch.tensor([[1], [2], [3]])
    beam = search(model, prompts, None, num_beams=3, max_new_tokens=5, eos_token_id=EOS)
    via_search = search(model, prompts, None, exact_search=True, max_new_tokens=5, eos_token_id=EOS, incumbent=beam)
    direct = _exact(model, None, prompts, 5, 1.0, incumbent=beam)
    assert torch.equal(via_search.sequences, direct.sequences) and torch.equal(via_search.nodes, direct.nodes)
