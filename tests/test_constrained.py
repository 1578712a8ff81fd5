"""Lexically constrained beam search (``force_words_ids``): against brute force on a tiny vocabulary, and on the
embedded G2P model.

With a beam wide enough to keep every partial hypothesis and every candidate (K >= all continuations), the
search is exhaustive, so its best hypotheses must be the best complete outputs that contain every constraint.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fakes import PrefixModel

from beamsearch import search

EOS, NEW = 1, 3
WORDS = [0, 2, 3, 4]  # the tokens that continue (vocabulary 5)


def contains(tokens: list[int], phrase: list[int]) -> bool:
    return any(tokens[i : i + len(phrase)] == phrase for i in range(len(tokens) - len(phrase) + 1))


def brute_force(model: PrefixModel, start: int, constraints, length_penalty: float) -> list[tuple[list[int], float]]:
    """Every complete output meeting all constraints (each: alternative phrases), best first."""
    out = []
    for length in range(1, NEW + 1):
        for body in itertools.product(WORDS, repeat=length - 1):
            for last in ([EOS] if length < NEW else [EOS, *WORDS]):
                tokens = [*body, last]
                if all(any(contains(tokens, p) for p in alternatives) for alternatives in constraints):
                    score = sum(model.log_probs_of([start, *tokens], 1)) / len(tokens) ** length_penalty
                    out.append((tokens, score))
    return sorted(out, key=lambda x: -x[1])


CASES = [
    [[[3]]],  # one word
    [[[2, 4]]],  # a phrase
    [[[4]], [[2]]],  # two words
    [[[3, 3], [2]]],  # disjunctive: "3 3" or "2"
    [[[0, 2]], [[4]]],  # a phrase and a word
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("constraints", CASES)
def test_exhaustive_beam_finds_the_best_constrained_outputs(seed, constraints):
    model = PrefixModel(5, seed=seed)
    starts = torch.tensor([[0], [2], [3]])
    force = [alternatives if len(alternatives) > 1 else alternatives[0] for alternatives in constraints]
    result = search(model, starts, num_beams=80, num_return_sequences=3, max_new_tokens=NEW, eos_token_id=EOS,
                    length_penalty=1.0, early_stopping="never", force_words_ids=force)
    for b, start in enumerate(starts[:, 0].tolist()):
        want = brute_force(model, start, constraints, 1.0)[:3]
        got = []
        for j in range(len(want)):
            length = int(result.lengths[b, j])
            got.append((result.sequences[b, j, 1:length].tolist(), float(result.sequences_scores[b, j])))
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, s), (_, w) in zip(got, want, strict=True):
            assert s == pytest.approx(w, abs=1e-5)
        assert result.unmet_constraints[b, : len(want)].tolist() == [0] * len(want)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beams", [3, 4, 6, 8])
def test_small_beams_still_meet_constraints(seed, beams):
    """A phrase and a word within four tokens: dynamic beam allocation finds outputs with both (measured: from
    three beams on; with two beams, four banks share two slots and some examples miss one)."""
    model = PrefixModel(5, seed=seed)
    starts = torch.tensor([[0], [2], [3]])
    result = search(model, starts, num_beams=beams, max_new_tokens=4, eos_token_id=EOS, force_words_ids=[[4, 4], [3]])
    for b in range(3):
        tokens = result.sequences[b, 0, 1 : int(result.lengths[b, 0])].tolist()
        assert contains(tokens, [4, 4]) and contains(tokens, [3])
        assert int(result.unmet_constraints[b, 0]) == 0


def test_constraints_that_cannot_fit_are_reported():
    model = PrefixModel(5, seed=1)
    impossible = search(model, torch.tensor([[0], [2]]), num_beams=3, max_new_tokens=2, eos_token_id=EOS,
                        force_words_ids=[[4, 4, 4]])  # three tokens cannot fit in two
    assert impossible.unmet_constraints[:, 0].tolist() == [1, 1]
    assert impossible.to_dicts()[0][0]["unmet_constraints"] == 1


def test_g2p_pronunciations_with_a_forced_phone():
    pytest.importorskip("transformers")
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from beamsearch.adapters.hf import search_model
    from beamsearch.cli.decoding import EMBEDDED_MODEL

    model = AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval()
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    ah, uw = tok.convert_tokens_to_ids("AH0"), tok.convert_tokens_to_ids("UW1")
    enc = tok(["tomato", "route"], return_tensors="pt", padding=True)
    result = search_model(model, **enc, num_beams=6, force_words_ids=[[[ah], [uw]]])  # AH0 or UW1
    for b in range(2):
        tokens = result.sequences[b, 0, 1 : int(result.lengths[b, 0])].tolist()
        assert ah in tokens or uw in tokens
        assert int(result.unmet_constraints[b, 0]) == 0


def test_bad_constraints_are_named():
    model = PrefixModel(5)
    starts = torch.tensor([[0]])
    with pytest.raises(ValueError, match="non-empty list of constraints"):
        search(model, starts, num_beams=2, force_words_ids=[])
    with pytest.raises(ValueError, match="each phrase must be a non-empty list"):
        search(model, starts, num_beams=2, force_words_ids=[[]])
    with pytest.raises(ValueError, match="token ids must be integers"):
        search(model, starts, num_beams=2, force_words_ids=[[-1]])
    with pytest.raises(ValueError, match="needs beam search"):
        search(model, starts, num_beams=1, force_words_ids=[[3]])
    with pytest.raises(ValueError, match="outside the model's 5 logits"):
        search(model, starts, num_beams=2, max_new_tokens=2, force_words_ids=[[7]])


def test_allocation_ranks_by_score_within_each_tier_exactly():
    """Valid entries whose scores differ by far less than float32's spacing at 2e9 are still ranked by score
    (a key of score + 2e9 would tie them and leave the choice to topk's order, which differs between devices)."""
    from beamsearch.strategies.constrained import ConstrainedBeamSearch

    search = ConstrainedBeamSearch.__new__(ConstrainedBeamSearch)
    search.num_banks = 1
    scores = torch.tensor([[-1.0, -0.5, -0.7, -0.6, -0.1]])
    valid = torch.tensor([[True, True, True, True, False]])
    chosen = search._allocate(scores, torch.zeros(1, 5, dtype=torch.long), valid, 3)
    assert chosen.tolist() == [[1, 3, 2]]  # one bank: the three best valid entries, best first
    close = torch.tensor([[-0.9, -0.8, -0.7, -0.6, -0.5]])  # the old key chose [4, 2] here
    assert search._allocate(close, torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.bool),
                            2).tolist() == [[4, 3]]
    search.num_banks = 2  # bank 1 (one constraint token) gets a slot of its own first
    chosen = search._allocate(scores, torch.tensor([[1, 0, 0, 0, 0]]), valid, 2)
    assert chosen.tolist() == [[1, 0]]
