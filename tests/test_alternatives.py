"""``search_alternatives``: the k best tokens after a prefix, each continued, against CTranslate2's
``return_alternatives`` (greedy continuation, ``length_penalty=0``: tokens and scores)."""

from __future__ import annotations

import pytest

pytest.importorskip("ctranslate2")
from test_ct2 import EOS, NAMES, SCORE_TOLERANCE, _our_hypotheses, build_models  # noqa: E402
from test_target_prefix import _case, _padded  # noqa: E402

from beamsearch.adapters.hf_alternatives import search_alternatives  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory)


@pytest.mark.parametrize("seed", range(20))
def test_matches_ctranslate2_return_alternatives(models, seed):
    model, translator = models
    sources, prefixes, case = _case(seed)
    k = 1 + seed % 3
    expected = translator.translate_batch(
        [[NAMES[i] for i in s] for s in sources], target_prefix=[[NAMES[i] for i in p] for p in prefixes],
        return_alternatives=True, num_hypotheses=k, beam_size=1, length_penalty=0.0,
        max_decoding_length=case["max_length"], return_scores=True,
    )
    ids, mask = _padded(sources)
    result = search_alternatives(model, ids, mask, num_alternatives=k, target_prefix=prefixes, semantics="ct2",
                                 num_beams=1, length_penalty=0.0, max_new_tokens=case["max_length"])
    assert result.sequences.shape[:2] == (len(sources), k)
    for b, want in enumerate(expected):
        assert _our_hypotheses(result, b) == want.hypotheses
        for j, score in enumerate(want.scores):
            assert float(result.sequences_scores[b, j]) == pytest.approx(score, abs=SCORE_TOLERANCE)


def test_beam_continuations_start_with_the_alternatives_in_order(models):
    model, _ = models
    ids, mask = _padded([[9, 29, 12], [4, 5, 6, 7]])
    prefixes = [[5], []]
    result = search_alternatives(model, ids, mask, num_alternatives=4, target_prefix=prefixes, num_beams=3,
                                 max_new_tokens=10, eos_token_id=EOS)
    for b, prefix in enumerate(prefixes):
        firsts = [int(result.sequences[b, j, 1 + len(prefix)]) for j in range(4)]
        assert len(set(firsts)) == 4 and EOS not in firsts
        assert all(result.sequences[b, j, 1 : 1 + len(prefix)].tolist() == prefix for j in range(4))
        # in order of the alternative token's log-prob, which beam search keeps in token_log_probs
        first_log_probs = [float(result.token_log_probs[b, j, len(prefix)]) for j in range(4)]
        assert first_log_probs == sorted(first_log_probs, reverse=True)


def test_bad_arguments_are_named(models):
    model, _ = models
    ids, mask = _padded([[9, 29, 12]])
    with pytest.raises(ValueError, match="num_alternatives must be an integer >= 1"):
        search_alternatives(model, ids, mask, num_alternatives=0)
    with pytest.raises(ValueError, match="leave num_return_sequences 1"):
        search_alternatives(model, ids, mask, num_alternatives=2, num_beams=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="one list of token ids per example"):
        search_alternatives(model, ids, mask, num_alternatives=2, target_prefix=[[5], [6]])
    with pytest.raises(ValueError, match="do_sample is not supported"):
        search_alternatives(model, ids, mask, num_alternatives=2, do_sample=True)
    assert search_alternatives(model, ids, mask, num_alternatives=2, max_new_tokens=3).sequences.shape[:2] == (1, 2)
