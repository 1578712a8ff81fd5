"""fairseq's diverse siblings search as a processor: against a literal per-beam reference of fairseq's step."""

from __future__ import annotations

import pytest
import torch
from fakes import PrefixModel
from numerics import assert_scores_close

from beamsearch import search
from beamsearch.processors import SiblingDiversityLogitsProcessor

VOCAB = 9


def reference(model: PrefixModel, start: int, beams: int, steps: int, rate: float) -> list[tuple[list[int], float]]:
    """fairseq's DiverseSiblingsSearch step by step (no end token): per beam its 2K best tokens, the r-th losing
    r * rate (not at the first step, which only expands the first beam), then the best K of all."""
    hyps = [([start], 0.0)]
    for step in range(steps):
        candidates = []
        for tokens, score in hyps:
            log_probs = torch.log_softmax(model.logits_for(torch.tensor([tokens])), dim=-1)[0]
            top = torch.topk(log_probs, min(2 * beams, VOCAB))
            for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
                penalty = 0.0 if step == 0 else rank * rate
                candidates.append((tokens + [token], score + value - penalty))
        candidates.sort(key=lambda c: -c[1])
        hyps = candidates[:beams]
    return hyps


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("beams", "rate"), [(2, 0.5), (3, 1.0), (4, 0.3), (3, 0.0)])
def test_matches_a_literal_reference(seed, beams, rate):
    model = PrefixModel(VOCAB, seed=seed)
    starts = torch.tensor([[0], [5]])
    steps = 4
    result = search(model, starts, num_beams=beams, num_return_sequences=beams, max_new_tokens=steps,
                    length_penalty=0.0, logits_processor=[SiblingDiversityLogitsProcessor(rate, beams, 1)])
    for b, start in enumerate(starts[:, 0].tolist()):
        want = reference(model, start, beams, steps, rate)
        got = [(result.sequences[b, j].tolist(), float(result.sequences_scores[b, j])) for j in range(beams)]
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, s), (_, w) in zip(got, want, strict=True):
            assert s == pytest.approx(w, abs=1e-5)


def test_rate_zero_is_plain_beam_search():
    model = PrefixModel(VOCAB, seed=3)
    starts = torch.tensor([[0], [4], [7]])
    options = dict(num_beams=3, num_return_sequences=3, max_new_tokens=6, eos_token_id=1)
    plain = search(model, starts, **options)
    siblings = search(model, starts, logits_processor=[SiblingDiversityLogitsProcessor(0.0, 3, 1)], **options)
    assert torch.equal(plain.sequences, siblings.sequences)
    assert_scores_close(plain.sequences_scores, siblings.sequences_scores)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="diversity_rate"):
        SiblingDiversityLogitsProcessor(-1.0, 2, 1)
    with pytest.raises(ValueError, match="num_beams"):
        SiblingDiversityLogitsProcessor(0.5, 0, 1)
