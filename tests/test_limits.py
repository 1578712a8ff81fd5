"""Source-tied length limits (fairseq's max_len_a / max_len_b) and the semantics presets' defaults."""

from __future__ import annotations

import math

import pytest
import torch
from fakes import PrefixModel

import beamsearch
from beamsearch.options import PRESETS, SearchOptions

EOS = 0


def no_eos_model(vocab: int = 9, seed: int = 0):
    """A prefix-dependent model that never chooses EOS on its own (its logit is far below the rest)."""
    model = PrefixModel(vocab, seed=seed)

    def step(tokens, state):
        logits, state = model(tokens, state)
        logits = logits.clone()
        logits[:, EOS] = -1e4
        return logits, state

    return step


@pytest.mark.parametrize(("num_beams", "do_sample"), [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize(("a", "b"), [(0.0, 3), (1.0, 0), (0.5, 2), (1.5, 1)])
def test_each_example_stops_at_its_own_limit(num_beams, do_sample, a, b):
    """Greedy, beam search and beam sampling: each example's own limit (the embedded model's case of an example
    left without a live beam while others go on is tests/test_compaction.py's beam sampling run)."""
    source_lengths = torch.tensor([1, 4, 7])
    start = torch.tensor([[5], [6], [7]])
    torch.manual_seed(0)
    result = beamsearch.search(
        no_eos_model(),
        start,
        num_beams=num_beams,
        do_sample=do_sample,
        eos_token_id=EOS,
        pad_token_id=EOS,
        max_new_tokens=40,
        max_len_a=a,
        max_len_b=b,
        source_lengths=source_lengths,
    )
    for i, n in enumerate(source_lengths.tolist()):
        limit = math.floor(a * n + b)
        generated = result.sequences[i, 0, 1 : int(result.lengths[i, 0])]
        # fairseq: `limit` free tokens, then EOS is forced
        assert len(generated) == limit + 1, (i, generated)
        assert generated[-1] == EOS and (generated[:-1] != EOS).all()
        assert result.finish_reason[i, 0] == beamsearch.FinishReason.EOS


def test_the_global_limit_still_applies():
    result = beamsearch.search(
        no_eos_model(),
        torch.tensor([[5]]),
        eos_token_id=EOS,
        max_new_tokens=4,
        max_len_a=2.0,
        max_len_b=5,
        source_lengths=torch.tensor([10]),
    )
    assert int(result.lengths[0, 0]) == 1 + 4
    assert result.finish_reason[0, 0] == beamsearch.FinishReason.MAX_LENGTH


def test_forced_eos_scores_are_the_model_log_probs():
    model = PrefixModel(9, seed=3)
    step = no_eos_model(seed=3)
    result = beamsearch.search(
        step,
        torch.tensor([[2]]),
        num_beams=2,
        eos_token_id=EOS,
        max_new_tokens=10,
        max_len_b=2,
        source_lengths=torch.tensor([5]),
        length_penalty=0.0,
    )
    seq = result.sequences[0, 0, : int(result.lengths[0, 0])].tolist()
    # the last token was forced: its log-prob is the model's (shifted EOS logit) log-prob, not 0
    logits = step(torch.tensor([seq[:-1]]), None)[0]
    assert float(result.token_log_probs[0, 0, -1]) == pytest.approx(
        float(torch.log_softmax(logits, -1)[0, EOS]), abs=1e-4
    )
    assert len(seq) == 1 + 2 + 1 and model is not None


def test_bad_source_limit_options():
    with pytest.raises(ValueError, match="max_len_b needs eos_token_id"):
        SearchOptions.create(max_len_b=3)
    with pytest.raises(ValueError, match="max_len_a must be >= 0"):
        SearchOptions.create(max_len_a=-1.0, eos_token_id=0)
    with pytest.raises(ValueError, match="need the source lengths"):
        beamsearch.search(no_eos_model(), torch.tensor([[1]]), eos_token_id=EOS, max_len_b=2)
    with pytest.raises(ValueError, match="source_lengths must have shape"):
        beamsearch.search(
            no_eos_model(), torch.tensor([[1]]), eos_token_id=EOS, max_len_b=2, source_lengths=torch.tensor([1, 2])
        )
    with pytest.raises(ValueError, match="semantics must be one of"):
        SearchOptions.create(semantics="fairseq")


def test_hf_adapter_ties_the_limit_to_the_unpadded_source():
    pytest.importorskip("transformers")
    from tiny_hf import tiny_model

    model = tiny_model("t5")
    source = torch.randint(2, 40, (2, 6))
    mask = torch.ones_like(source)
    mask[1, 3:] = 0  # the second source is 3 tokens long
    from beamsearch.adapters.hf import search_model

    def no_natural_eos(ids, scores):  # runs after the limit: EOS stays the only finite choice there
        return scores - 1e4 * torch.nn.functional.one_hot(torch.tensor(1), scores.shape[1])

    result = search_model(
        model,
        input_ids=source,
        attention_mask=mask,
        num_beams=2,
        max_new_tokens=30,
        max_len_a=1.0,
        max_len_b=1,
        logits_processor=[no_natural_eos],
    )
    assert result.lengths[:, 0].tolist() == [1 + 7 + 1, 1 + 4 + 1]


def test_presets_fill_only_unset_options():
    t2t = SearchOptions.create(semantics="t2t")
    assert (t2t.length_penalty, t2t.early_stopping) == (PRESETS["t2t"]["length_penalty"], True)
    mine = SearchOptions.create(semantics="t2t", length_penalty=1.0, early_stopping=False)
    assert (mine.length_penalty, mine.early_stopping) == (1.0, False)
    assert SearchOptions.create().length_penalty == 1.0


def test_ct2_preset_defaults():
    o = SearchOptions.create(semantics="ct2", eos_token_id=1)
    assert (o.num_beams, o.length_penalty, o.patience, o.max_new_tokens, o.min_new_tokens) == (2, 1.0, 1.0, 256, 1)
    assert SearchOptions.create(semantics="ct2").min_new_tokens is None  # needs an eos token
    assert SearchOptions.create(semantics="ct2", max_length=30).max_new_tokens is None
    assert (
        SearchOptions.create(semantics="ct2", num_beams=2, patience=2.0, num_return_sequences=4).num_return_sequences
        == 4
    )


def test_hf_adapter_applies_the_preset_only_to_unset_options():
    pytest.importorskip("transformers")
    from tiny_hf import tiny_model

    from beamsearch.adapters.hf_inputs import prepare as _prepare
    from beamsearch.adapters.hf_options import options_from_config as _options_from_config

    model = tiny_model("t5")
    source = torch.randint(2, 40, (1, 5))
    setup = _prepare(model, source, None, {})
    o = _options_from_config(setup["generation_config"], {"semantics": "ct2"}, setup["has_default_max_length"])
    assert (o.max_new_tokens, o.patience, o.min_new_tokens) == (256, 1.0, 1)
    setup = _prepare(model, source, None, {"max_length": 7, "num_beams": 3})
    o = _options_from_config(setup["generation_config"], {"semantics": "ct2"}, setup["has_default_max_length"])
    assert (o.num_beams, o.max_new_tokens, o.max_length) == (3, None, 7)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_ngram_repeat": 2}, "block_ngram_repeat=2 needs semantics='onmt'"),
        ({"coverage_penalty": "wu", "semantics": "t2t"}, "coverage_penalty='wu' needs semantics='onmt'"),
        ({"patience": 2.0, "semantics": "onmt"}, "patience=2.0 needs semantics='ct2'"),
        ({"ratio": 1.5}, "ratio=1.5 needs semantics='onmt'"),
        ({"stepwise_penalty": True, "semantics": "onmt", "num_beams": 1}, "needs beam search"),
        ({"length_penalty_type": "wu"}, "not available with semantics='hf'"),
        ({"length_penalty_type": "avg", "semantics": "t2t"}, "not available with semantics='t2t'"),
    ],
)
def test_toolkit_options_are_never_silently_ignored(options, message):
    with pytest.raises(ValueError, match=message):
        SearchOptions.create(num_beams=options.pop("num_beams", 3), eos_token_id=0, **options)


def test_steps_before_the_earliest_limit_are_free_and_change_nothing():
    """Before any row's limit the processor returns the scores as they are (no [N, V] work); from the earliest
    limit on, rows at their limit get only EOS, the others stay; the bound survives rows leaving the batch."""
    from beamsearch.processors.limits import SourceTiedMaxLength

    limit = SourceTiedMaxLength(1.0, 1, torch.tensor([2, 4, 3]), prompt_length=1, eos_token_id=0)
    assert limit.earliest == 3
    scores = torch.randn(3, 5)
    for generated in range(3):
        assert limit(torch.zeros(3, 1 + generated, dtype=torch.long), scores) is scores
    out = limit(torch.zeros(3, 1 + 3, dtype=torch.long), scores)  # limits 3, 5, 4: row 0 is at its limit
    assert out[0, 0] == scores[0, 0] and torch.isinf(out[0, 1:]).all()
    assert torch.equal(out[1:], scores[1:])
    kept = limit.select_rows(torch.tensor([1, 2]))
    assert kept.earliest == 3 and kept(torch.zeros(2, 1 + 3, dtype=torch.long), scores[1:]).equal(scores[1:])
    out = kept(torch.zeros(2, 1 + 4, dtype=torch.long), scores[1:])
    assert torch.equal(out[0], scores[1]) and out[1, 0] == scores[2, 0] and torch.isinf(out[1, 1:]).all()
