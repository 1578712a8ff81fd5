"""max_rows: decoding in sub-batches of whole examples gives the results of one batch."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_scores_close

pytest.importorskip("transformers")
from tiny_hf import random_inputs, tiny_model  # noqa: E402

import beamsearch  # noqa: E402
from beamsearch.adapters.hf import search_model  # noqa: E402


@pytest.mark.parametrize("family", ["t5", "bart", "gpt2", "llama"])
@pytest.mark.parametrize(
    "options",
    [
        {"num_beams": 4, "num_return_sequences": 2},
        {"num_beams": 1},
        {"num_beams": 3, "semantics": "onmt", "max_length_ratio": 0},
        {"num_beams": 3, "length_penalty": 0.5, "early_stopping": True},
    ],
)
def test_sub_batches_equal_one_batch(family, options):
    model = tiny_model(family)
    ids, mask = random_inputs(model, 5, torch.Generator().manual_seed(7))
    inputs = {"input_ids": ids, "attention_mask": mask}
    whole = search_model(model, **inputs, max_new_tokens=9, **options)
    capped = search_model(model, **inputs, max_new_tokens=9, max_rows=7, **options)
    assert torch.equal(capped.lengths, whole.lengths)
    for b in range(whole.sequences.shape[0]):
        for j in range(whole.sequences.shape[1]):
            length = int(whole.lengths[b, j])
            assert torch.equal(capped.sequences[b, j, :length], whole.sequences[b, j, :length])
    assert_scores_close(capped.sequences_scores, whole.sequences_scores)
    assert torch.equal(capped.finish_reason, whole.finish_reason)


def test_generate_output_and_beam_indices():
    model = tiny_model("t5")
    ids, mask = random_inputs(model, 4, torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "attention_mask": mask}
    kwargs = dict(num_beams=2, max_new_tokens=6, return_dict_in_generate=True)
    whole = beamsearch.generate(model, **inputs, **kwargs)
    capped = beamsearch.generate(model, **inputs, max_rows=2, **kwargs)
    assert torch.equal(capped.beam_indices, whole.beam_indices)
    assert torch.equal(capped.sequences, whole.sequences) and capped.sequences.shape[0] == 4


def test_bad_memory_cap_options():
    model = tiny_model("t5")
    ids, mask = random_inputs(model, 2, torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": mask}
    with pytest.raises(ValueError, match="max_rows must be an integer >= 1"):
        search_model(model, **inputs, max_rows=0)
    with pytest.raises(ValueError, match="cannot be combined with output_scores"):
        beamsearch.generate(model, **inputs, max_rows=1, return_dict_in_generate=True, output_scores=True)
