"""Finished examples leave the batch (``remove_finished``): the model sees fewer rows, results do not change.

The reference is the same search with ``remove_finished=False`` (every row decoded to the end, as in
transformers) and transformers' own ``generate``; each case also checks that rows really left the batch.
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_scores_close

pytest.importorskip("transformers")
from fakes import RowCounter  # noqa: E402
from tiny_hf import random_inputs, tiny_model  # noqa: E402
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

from beamsearch import generate, search  # noqa: E402
from beamsearch.adapters.hf import search_model  # noqa: E402
from beamsearch.cli.decoding import EMBEDDED_MODEL  # noqa: E402
from beamsearch.cli.evaluate import CMUDICT_TEST  # noqa: E402
from beamsearch.evaluation import read_references  # noqa: E402


@pytest.fixture(scope="module")
def g2p():
    return AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval(), AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


def decode_counting(model, inputs, **options):
    counter = RowCounter(model)
    try:
        result = search_model(model, **inputs, **options)
    finally:
        rows = counter.close()
    return result, rows


def assert_same_results(got, want):
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.lengths, want.lengths)
    assert torch.equal(got.finish_reason, want.finish_reason)
    assert_scores_close(got.sequences_scores, want.sequences_scores)
    assert_scores_close(got.token_log_probs, want.token_log_probs)
    if want.beam_indices is not None:
        assert torch.equal(got.beam_indices, want.beam_indices)


@pytest.mark.parametrize(
    "options",
    [
        {"num_beams": 1},
        {"num_beams": 4},
        {"num_beams": 4, "num_return_sequences": 3, "early_stopping": True},
        {"num_beams": 3, "early_stopping": "never", "length_penalty": 0.6},
        {"num_beams": 4, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2},  # per-row processor state
        {"num_beams": 2, "max_len_a": 1.0, "max_len_b": 2},  # source-tied limit: per-row state
    ],
)
def test_removal_changes_no_result_on_the_embedded_model(g2p, options):
    model, tok = g2p
    words = [w for w, _ in read_references(CMUDICT_TEST)[:24]]
    inputs = tok(words, return_tensors="pt", padding=True)
    kept, rows_kept = decode_counting(model, inputs, remove_finished=False, **options)
    removed, rows_removed = decode_counting(model, inputs, **options)
    assert_same_results(removed, kept)
    rows_per_example = options["num_beams"]
    assert rows_kept[1:] == [rows_per_example * len(words)] * (len(rows_kept) - 1)  # all rows, every step
    assert rows_removed[-1] < rows_kept[-1]  # finished examples left
    assert all(a >= b for a, b in zip(rows_removed[1:], rows_removed[2:], strict=False))  # the batch only shrinks


@pytest.mark.parametrize(("name", "seed"), [("t5", 4), ("bart", 0), ("gpt2", 0), ("llama", 4)])  # inputs that finish
@pytest.mark.parametrize("options", [{"num_beams": 1}, {"num_beams": 3, "early_stopping": True},
                                     {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.5}])
def test_removal_matches_transformers_on_tiny_models(name, seed, options):
    model = tiny_model(name)
    ids, mask = random_inputs(model, 8, torch.Generator().manual_seed(seed))
    options = dict(options, max_new_tokens=40, return_dict_in_generate=True)
    want = model.generate(input_ids=ids, attention_mask=mask, **options)
    counter = RowCounter(model)
    try:
        got = generate(model, input_ids=ids, attention_mask=mask, **options)
    finally:
        rows = counter.close()
    assert torch.equal(got.sequences, want.sequences)
    if options["num_beams"] > 1:
        assert torch.equal(got.beam_indices, want.beam_indices)  # rows of the full batch, as transformers
        # without output_scores generate returns no sequence scores; output_scores would keep every row, so
        # transformers' scores come from such a run and ours from search_model (which still removes)
        scored = model.generate(input_ids=ids, attention_mask=mask, **dict(options, output_scores=True))
        ours = search_model(model, input_ids=ids, attention_mask=mask, **options)
        assert_scores_close(ours.sequences_scores.flatten(), scored.sequences_scores)
    assert min(rows[1:]) < 8 * options["num_beams"], f"no example left the batch: {rows}"


def test_plain_state_shrinks_with_the_batch():
    vocab, eos = 7, 1
    seen: list[int] = []

    def step(tokens, state):
        seen.append(tokens.shape[0])
        assert state["example"].shape[0] == tokens.shape[0]
        # example e finishes after e + 1 tokens: eos gets all the mass then
        logits = torch.linspace(0.0, 1.0, vocab).repeat(tokens.shape[0], 1)  # no ties
        logits[torch.arange(tokens.shape[0]), 2 + state["example"] % 4] = 5.0
        logits[(tokens.shape[1] - 1) >= state["example"] + 1, eos] = 10.0
        return logits, state

    input_ids = torch.zeros(5, 1, dtype=torch.long)
    state = {"example": torch.arange(5)}
    kept = search(step, input_ids, state, num_beams=2, eos_token_id=eos, max_new_tokens=10, remove_finished=False)
    seen.clear()
    removed = search(step, input_ids, state, num_beams=2, eos_token_id=eos, max_new_tokens=10)
    assert_same_results(removed, kept)
    assert seen[0] == 10 and seen[-1] < 10
    assert removed.lengths[:, 0].tolist() == [3, 4, 5, 6, 7]  # start token, e + 1 tokens, eos


def test_no_removal_where_it_could_change_results(g2p):
    model, tok = g2p
    inputs = tok(["a", "internationalization"], return_tensors="pt", padding=True)
    _, rows = decode_counting(model, inputs, num_beams=2, output_scores=True, return_dict_in_generate=True)
    assert set(rows[1:]) == {4}  # per-step scores keep every row
    _, rows = decode_counting(model, inputs, num_beams=2, do_sample=True)
    assert set(rows[1:]) == {4}  # sampling would draw differently


def test_remove_finished_must_be_a_bool():
    with pytest.raises(ValueError, match="remove_finished must be True or False"):
        search(lambda t, s: (torch.zeros(t.shape[0], 3), s), torch.zeros(1, 1, dtype=torch.long), remove_finished=1)
