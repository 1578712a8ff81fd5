"""A custom sequence scorer and a de-duplicated n-best (``unique=``), against brute force on a tiny vocabulary.

With a beam wide enough to hold every hypothesis (``early_stopping="never"``), the finished pool must be exactly
the best hypotheses of the enumeration under the scorer, one per key.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fakes import PrefixModel

from beamsearch import search

EOS, VOCAB, NEW = 1, 4, 3  # tokens 0, 2, 3 continue; at most 3 generated tokens


def every_hypothesis(model: PrefixModel, start: int) -> list[tuple[list[int], list[float]]]:
    """All complete outputs (ending in EOS, or at the length limit), with teacher-forced log-probs."""
    out = []
    for length in range(1, NEW + 1):
        for body in itertools.product([0, 2, 3], repeat=length - 1):
            for last in ([EOS] if length < NEW else [EOS, 0, 2, 3]):
                tokens = [*body, last]
                out.append((tokens, model.log_probs_of([start, *tokens], 1)))
    return out


def length_bonus(tokens: torch.Tensor, log_probs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """An unusual ranking: log-prob plus 0.7 per generated token (prefers long outputs)."""
    return log_probs.sum(dim=1) + 0.7 * lengths


def no_threes(tokens: list[int]) -> tuple[int, ...]:
    """A key under which 2 and 3 are the same token."""
    return tuple(2 if t == 3 else t for t in tokens)


def expected(model, start, n, scorer=None, key=None):
    scored = []
    for tokens, log_probs in every_hypothesis(model, start):
        t = torch.tensor([tokens])
        lp = torch.tensor([log_probs])
        score = float(scorer(t, lp, torch.tensor([len(tokens)]))) if scorer else sum(log_probs) / len(tokens)
        scored.append((score, tokens))
    scored.sort(key=lambda x: -x[0])
    best, seen = [], set()
    for score, tokens in scored:
        k = key(tokens) if key else tuple(tokens)
        if k in seen:
            continue
        seen.add(k)
        best.append((tokens, score))
    return best[:n]


def got(result, b: int) -> list[tuple[list[int], float]]:
    out = []
    for j in range(result.sequences.shape[1]):
        length = int(result.lengths[b, j])
        out.append((result.sequences[b, j, 1:length].tolist(), float(result.sequences_scores[b, j])))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("scorer", "key"), [(length_bonus, None), (None, no_threes), (length_bonus, no_threes)])
def test_pool_is_the_brute_force_best(seed, scorer, key):
    model = PrefixModel(VOCAB, seed=seed)
    starts = torch.tensor([[0], [2], [3]])
    n = 5
    result = search(model, starts, num_beams=40, num_return_sequences=n, max_new_tokens=NEW, eos_token_id=EOS,
                    early_stopping="never", sequence_scorer=scorer, unique=key)
    for b, start in enumerate(starts[:, 0].tolist()):
        want = expected(model, start, n, scorer, key)
        have = got(result, b)
        assert [t for t, _ in have] == [t for t, _ in want]
        for (_, s), (_, w) in zip(have, want, strict=True):
            assert s == pytest.approx(w, abs=1e-5)


def test_unique_true_changes_nothing_in_plain_beam_search():
    model = PrefixModel(VOCAB, seed=1)
    starts = torch.tensor([[0], [2]])
    options = dict(num_beams=4, num_return_sequences=4, max_new_tokens=NEW, eos_token_id=EOS)
    plain, unique = search(model, starts, **options), search(model, starts, unique=True, **options)
    assert torch.equal(plain.sequences, unique.sequences)  # beam search never finishes a sequence twice


def test_g2p_nbest_distinct_without_stress():
    pytest.importorskip("transformers")
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from beamsearch.adapters.hf import search_model
    from beamsearch.cli.decoding import EMBEDDED_MODEL

    model = AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval()
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    vocab = tok.get_vocab()
    unstressed = {i: vocab.get(t.rstrip("012") + "0", i) for t, i in vocab.items()}  # EH1, EH2 -> EH0

    def without_stress(tokens):
        return tuple(unstressed[t] for t in tokens)

    words = ["hello", "tomato", "record"]
    enc = tok(words, return_tensors="pt", padding=True)
    plain = search_model(model, **enc, num_beams=8, num_return_sequences=3)
    result = search_model(model, **enc, num_beams=8, num_return_sequences=3, unique=without_stress)
    duplicated = 0
    for b in range(len(words)):
        keys = [without_stress(plain.sequences[b, j, 1 : int(plain.lengths[b, j])].tolist()) for j in range(3)]
        duplicated += len(set(keys)) < 3
        keys = [without_stress(result.sequences[b, j, 1 : int(result.lengths[b, j])].tolist()) for j in range(3)]
        assert len(set(keys)) == 3
        assert torch.equal(result.sequences[b, 0], plain.sequences[b, 0])  # the best is the same
    assert duplicated >= 2  # measured (stage-9 weights): "hello" and "tomato" differ only in stress in the plain 3-best


def test_bad_ranking_options_are_named():
    model = PrefixModel(VOCAB)
    starts = torch.tensor([[0]])
    with pytest.raises(ValueError, match="sequence_scorer must be callable"):
        search(model, starts, num_beams=2, max_new_tokens=2, sequence_scorer=3)
    with pytest.raises(ValueError, match="unique must be True, False or a key function"):
        search(model, starts, num_beams=2, max_new_tokens=2, unique="yes")
    with pytest.raises(ValueError, match="need beam search"):
        search(model, starts, num_beams=1, max_new_tokens=2, unique=True)
    with pytest.raises(ValueError, match="one score per hypothesis"):
        search(model, starts, num_beams=2, max_new_tokens=2, eos_token_id=EOS,
               sequence_scorer=lambda t, lp, n: lp.sum())
