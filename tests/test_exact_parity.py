"""``exact_parity=True``: bit-for-bit transformers' ``generate`` on the same machine.

In this mode every forward runs on transformers' rows and shapes (the prompt and the encoder on every beam's row,
the whole cache reordered, no finished examples removed, the generic step), so the same kernels see the same
shapes and every output field must be bitwise equal (docs/testing.md). The grid is the parity grid's
(``parity_grid.random_case``) over the five families, ``BEAMSEARCH_EXACT_CASES`` cases (500 by default).
"""

from __future__ import annotations

import os

import pytest
import torch
from parity_grid import assert_bitwise_output, case_inputs, random_case, run_both
from test_hf_adapter import tiny_tokenizer
from tiny_hf import MODEL_NAMES, random_inputs, reference_generate, tiny_model

import beamsearch

transformers = pytest.importorskip("transformers")

CASES = int(os.environ.get("BEAMSEARCH_EXACT_CASES", "500"))


@pytest.mark.parametrize("seed", range(CASES))
def test_random_configuration_is_bitwise_transformers(seed):
    name, kwargs = random_case(seed)
    expected, actual = run_both(name, kwargs, seed, exact_parity=True)
    assert_bitwise_output(expected, actual)


def test_grid_covers_every_family_and_mode():
    drawn = [random_case(seed) for seed in range(CASES)]
    assert {name for name, _ in drawn} == set(MODEL_NAMES)
    modes = {(kwargs.get("num_beams", 1) > 1, kwargs["do_sample"]) for _, kwargs in drawn}
    assert modes == {(False, False), (False, True), (True, False), (True, True)}


@pytest.mark.parametrize("name", ["t5", "gpt2", "llama"])
def test_stop_strings_user_processors_and_allowed_tokens_are_bitwise(name):
    model = tiny_model(name)
    ids, mask = random_inputs(model, 3, torch.Generator().manual_seed(11))

    def ban_token_seven(input_ids, scores):
        return scores.masked_fill(torch.arange(scores.shape[-1]) == 7, -float("inf"))

    def allowed(batch_id, tokens):  # transformers' prefix_allowed_tokens_fn: per example and prefix
        return [t for t in range(40) if (t + batch_id + tokens.shape[-1]) % 3 != 0 or t == model.config.eos_token_id]

    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, return_dict_in_generate=True,
                  output_scores=True, output_logits=True, num_beams=4, num_return_sequences=2,
                  stop_strings=["he", "q"], tokenizer=tiny_tokenizer(), logits_processor=[ban_token_seven],
                  prefix_allowed_tokens_fn=allowed)
    expected = reference_generate(model, **common)
    actual = beamsearch.generate(model, **common, exact_parity=True)
    assert_bitwise_output(expected, actual)


def test_fast_default_is_not_bitwise_on_some_case():
    """Why the mode exists: on the grid's T5 beam cases the default differs from transformers in the last bits
    (the prompt runs once per example), while exact_parity does not. Observed on every CPU tried; it is a property
    of float rounding, so the test only needs one such case among the first 200."""
    for seed in range(200):
        name, kwargs = random_case(seed)
        if name != "t5" or kwargs.get("num_beams", 1) < 2 or not kwargs["output_scores"] or kwargs["do_sample"]:
            continue
        expected, actual = run_both(name, kwargs, seed)
        if torch.equal(actual.sequences, expected.sequences) and not all(
                torch.equal(a, b) for a, b in zip(actual.scores, expected.scores, strict=True)):
            return
    pytest.fail("no T5 beam case of the first 200 differed in its last bits; exact_parity would be moot here")


@pytest.mark.parametrize("ours, wrong", [
    ({"exact_parity": "yes"}, "exact_parity must be True or False"),
    ({"exact_parity": True, "lean_step": True}, "lean_step"),
    ({"exact_parity": True, "compile_step": True}, "compile_step"),
    ({"exact_parity": True, "share_encoder_state": True}, "share_encoder_state"),
    ({"exact_parity": True, "remove_finished": True}, "remove_finished"),
    ({"exact_parity": True, "max_rows": 4}, "max_rows"),
])
def test_exact_parity_refuses_what_would_change_the_shapes(ours, wrong):
    model, inputs = case_inputs("t5", {"batch_size": 2, "num_beams": 3, "max_new_tokens": 4}, 0)
    with pytest.raises(ValueError, match=wrong):
        beamsearch.generate(model, **inputs, **ours)
