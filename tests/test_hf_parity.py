"""Parity of the fast default with the installed transformers ``generate`` on tiny random models of five families.

A seeded random grid of configurations (``BEAMSEARCH_PARITY_CASES`` cases, 240 by default, drawn by
``parity_grid.random_case``): greedy, sampling, beam search and beam sampling, with the processors, several EOS ids
and padded batches. The fast default runs the prompt once per example where transformers runs it on every beam's
row, so results agree to float precision, not bit for bit (docs/testing.md): sequences are equal unless
transformers' own decision nearly tied where they part (the margin is checked), scores agree within the score
tolerance, and sampling under the same torch seed draws the same tokens. ``test_exact_parity.py`` checks the
bitwise mode.
"""

from __future__ import annotations

import os

import pytest
import torch
from parity_grid import assert_case_equivalent, random_case, run_both
from tiny_hf import MODEL_NAMES, random_inputs, tiny_model

import beamsearch

transformers = pytest.importorskip("transformers")

CASES = int(os.environ.get("BEAMSEARCH_PARITY_CASES", "240"))


@pytest.mark.parametrize("seed", range(CASES))
def test_random_configuration_matches_transformers(seed):
    name, kwargs = random_case(seed)
    expected, actual = run_both(name, kwargs, seed)
    assert_case_equivalent(expected, actual, name, kwargs, seed)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_plain_tensor_return_matches(name):
    model = tiny_model(name)
    ids, mask = random_inputs(model, 3, torch.Generator().manual_seed(7))
    for kwargs in ({"num_beams": 4, "num_return_sequences": 2}, {}):
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **kwargs)
        actual = beamsearch.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, **kwargs)
        assert torch.equal(actual, expected)  # tokens: compared exactly


def test_grid_reaches_varied_finishing_steps():
    """The grid is only meaningful if hypotheses end at different steps (EOS is likely enough)."""
    lengths = set()
    for seed in range(40):
        name, kwargs = random_case(seed)
        if kwargs.get("num_beams", 1) > 1:
            _, actual = run_both(name, kwargs, seed)
            pad = -1
            lengths.update(((actual.beam_indices != pad).sum(dim=1)).tolist())
    assert len(lengths) >= 5, lengths


def test_grid_exercises_the_encoder_processors():
    drawn = [random_case(seed)[1] for seed in range(CASES)]
    assert sum("encoder_no_repeat_ngram_size" in kwargs for kwargs in drawn) >= 5
    assert sum("encoder_repetition_penalty" in kwargs for kwargs in drawn) >= 5
