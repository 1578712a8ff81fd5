"""Ensembles: the cached, reordered Hugging Face ensemble against an uncached recomputation of every model.

The oracle decodes with ``search()`` and a plain step function that runs each model on the whole prefix
(no cache, nothing reordered but the source rows) and averages the distributions by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from numerics import assert_scores_close

pytest.importorskip("transformers")
from tiny_hf import VOCAB, random_inputs, tiny_model  # noqa: E402

from beamsearch import search  # noqa: E402
from beamsearch.adapters.hf import search_model  # noqa: E402
from beamsearch.adapters.hf_ensemble import search_ensemble  # noqa: E402
from beamsearch.ensemble import ensemble_step  # noqa: E402


def averaged(log_probs: list[torch.Tensor], mode: str, weights: list[float]) -> torch.Tensor:
    share = torch.tensor(weights) / sum(weights)
    stacked = torch.stack(log_probs)
    if mode == "log":
        return (stacked * share[:, None, None]).sum(0)
    return torch.log((stacked.exp() * share[:, None, None]).sum(0))


def oracle_seq2seq(models, ids, mask, mode, weights, **options):
    def step(tokens, state):
        outs = [m(input_ids=state["ids"], attention_mask=state["mask"], decoder_input_ids=tokens).logits[:, -1]
                for m in models]
        return averaged([torch.log_softmax(o.float(), -1) for o in outs], mode, weights), state

    start = torch.full((ids.shape[0], 1), models[0].config.decoder_start_token_id)
    with torch.no_grad():
        return search(step, start, {"ids": ids, "mask": mask}, source_lengths=mask.sum(1), **options)


def oracle_decoder_only(models, ids, mode, weights, **options):
    def step(tokens, state):
        outs = [m(input_ids=tokens).logits[:, -1] for m in models]
        return averaged([torch.log_softmax(o.float(), -1) for o in outs], mode, weights), state

    with torch.no_grad():
        return search(step, ids, None, **options)


def assert_same(got, want):
    """Tokens up to each hypothesis' length (the fill after EOS follows the adapter's pad rule), and scores."""
    assert torch.equal(got.lengths, want.lengths)
    width = torch.arange(got.sequences.shape[-1])
    inside = width < got.lengths[..., None]
    assert torch.equal(got.sequences * inside, want.sequences[..., : got.sequences.shape[-1]] * inside)
    assert_scores_close(got.sequences_scores, want.sequences_scores)


CASES = [
    ({"num_beams": 1}, "log", [1.0, 1.0]),
    ({"num_beams": 3, "num_return_sequences": 2}, "prob", [1.0, 1.0]),
    ({"num_beams": 4, "early_stopping": True, "length_penalty": 0.7}, "log", [2.0, 1.0]),
    ({"num_beams": 3, "no_repeat_ngram_size": 2}, "prob", [0.3, 0.7]),
]


@pytest.mark.parametrize(("options", "mode", "weights"), CASES)
@pytest.mark.parametrize("family", ["t5", "bart"])
def test_seq2seq_ensemble_matches_uncached_oracle(family, options, mode, weights):
    models = [tiny_model(family, seed=0), tiny_model(family, seed=1)]
    ids, mask = random_inputs(models[0], 5, torch.Generator().manual_seed(3))
    eos = models[0].config.eos_token_id
    common = dict(options, max_new_tokens=12, eos_token_id=eos, pad_token_id=models[0].config.pad_token_id)
    got = search_ensemble(models, input_ids=ids, attention_mask=mask, mode=mode, weights=weights, **common)
    assert_same(got, oracle_seq2seq(models, ids, mask, mode, weights, **common))


SEARCH_ARGUMENTS = [
    dict(prefix_allowed_tokens_fn=lambda batch_id, tokens: list(range(1, 25)), unique=True),
    dict(force_words_ids=[[7, 8]]),
]


@pytest.mark.parametrize("lean_step", [None, False])
@pytest.mark.parametrize("case", range(len(SEARCH_ARGUMENTS)))
def test_ensemble_takes_the_search_arguments(lean_step, case):
    """Arguments that are the search's, not transformers' (allowed tokens, a de-duplicated n-best, constraints),
    reach the search for an ensemble as for one model; T5 members run the lean step or the generic one."""
    models = [tiny_model("t5", seed=0), tiny_model("t5", seed=1)]
    ids, mask = random_inputs(models[0], 4, torch.Generator().manual_seed(6))
    common = dict(SEARCH_ARGUMENTS[case], num_beams=4, num_return_sequences=3, max_new_tokens=10, eos_token_id=1,
                  pad_token_id=0)
    got = search_ensemble(models, input_ids=ids, attention_mask=mask, lean_step=lean_step, **common)
    assert_same(got, oracle_seq2seq(models, ids, mask, "log", [1.0, 1.0], **common))
    if case == 0:
        assert int(got.sequences.max()) < 25


@pytest.mark.parametrize(("options", "mode", "weights"), CASES[:3])
def test_decoder_only_ensemble_matches_uncached_oracle(options, mode, weights):
    models = [tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)]
    ids = torch.randint(3, VOCAB, (4, 5), generator=torch.Generator().manual_seed(2))  # no padding
    common = dict(options, max_new_tokens=10, eos_token_id=models[0].config.eos_token_id, pad_token_id=0)
    got = search_ensemble(models, input_ids=ids, mode=mode, weights=weights, **common)
    assert_same(got, oracle_decoder_only(models, ids, mode, weights, **common))


@pytest.mark.parametrize("mode", ["log", "prob"])
def test_an_ensemble_of_one_is_the_model(mode):
    model = tiny_model("t5")
    ids, mask = random_inputs(model, 4, torch.Generator().manual_seed(1))
    got = search_ensemble([model], input_ids=ids, attention_mask=mask, mode=mode, num_beams=3, max_new_tokens=10)
    assert_same(got, search_model(model, input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=10))


def test_prob_mode_is_the_log_of_the_mean_probability():
    a, b = torch.log_softmax(torch.randn(2, 6), -1), torch.log_softmax(torch.randn(2, 6), -1)
    step = ensemble_step([lambda t, s: (a, s), lambda t, s: (b, s)], mode="prob", weights=[1, 3])
    combined, states = step(torch.zeros(2, 1, dtype=torch.long), (None, None))
    assert_scores_close(combined, torch.log(0.25 * a.exp() + 0.75 * b.exp()))
    assert states == (None, None)
    assert math.isclose(float(combined.exp().sum(-1)[0]), 1.0, rel_tol=1e-6)


def test_bad_ensembles_are_named():
    t5 = tiny_model("t5")
    ids, mask = random_inputs(t5, 2, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="mode must be one of"):
        search_ensemble([t5, t5], input_ids=ids, mode="mean")
    with pytest.raises(ValueError, match="weights must be 2 non-negative"):
        search_ensemble([t5, t5], input_ids=ids, weights=[1.0])
    with pytest.raises(ValueError, match="all encoder-decoder or all decoder-only"):
        search_ensemble([t5, tiny_model("gpt2")], input_ids=ids)
    with pytest.raises(ValueError, match="at least one model"):
        search_ensemble([], input_ids=ids)
    wide = lambda t, s: (torch.zeros(t.shape[0], 7), s)  # noqa: E731
    narrow = lambda t, s: (torch.zeros(t.shape[0], 5), s)  # noqa: E731
    with pytest.raises(ValueError, match="must share the target vocabulary"):
        search(ensemble_step([wide, narrow]), torch.zeros(1, 1, dtype=torch.long), (None, None), max_new_tokens=2)
