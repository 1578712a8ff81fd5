"""Parity with the installed transformers ``generate`` on tiny random models of five families.

A seeded random grid of configurations (``BEAMSEARCH_PARITY_CASES`` cases, 240 by default):
greedy, sampling, beam search and beam sampling, with the processors, several EOS ids and padded
batches. Sequences must be identical; sequences_scores and per-step scores within 1e-5; sampling
under the same torch seed gives the same tokens.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from tiny_hf import MODEL_NAMES, VOCAB, random_inputs, tiny_model

import beamsearch

transformers = pytest.importorskip("transformers")

CASES = int(os.environ.get("BEAMSEARCH_PARITY_CASES", "240"))


def random_case(seed: int) -> tuple[str, dict]:
    """One random (model, generate kwargs) configuration."""
    rng = random.Random(seed)
    name = MODEL_NAMES[seed % len(MODEL_NAMES)]
    mode = rng.choice(["greedy", "sample", "beam", "beam", "beam_sample"])
    # without per-step scores, finished examples leave the batch (remove_finished): half the cases test that
    scores = rng.random() < 0.5
    kwargs: dict = {"max_new_tokens": rng.randint(1, 10), "return_dict_in_generate": True,
                    "output_scores": scores, "output_logits": scores and rng.random() < 0.5}
    if mode in ("beam", "beam_sample"):
        kwargs["num_beams"] = rng.randint(2, 8) if rng.random() < 0.9 else 1
        kwargs["num_return_sequences"] = rng.randint(1, kwargs["num_beams"])
        kwargs["length_penalty"] = rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0])
        kwargs["early_stopping"] = rng.choice([True, False, "never"])
    kwargs["do_sample"] = mode in ("sample", "beam_sample")
    if mode == "sample":
        kwargs["num_return_sequences"] = rng.randint(1, 3)
    if mode == "greedy":
        kwargs["num_beams"] = 1
    eos = tiny_model(name).config.eos_token_id
    if rng.random() < 0.3:
        kwargs["eos_token_id"] = [eos, rng.randrange(3, VOCAB - 1)]
    optional = {
        "min_new_tokens": lambda: rng.randint(1, 4),
        "min_length": lambda: rng.randint(1, 6),
        "no_repeat_ngram_size": lambda: rng.randint(1, 3),
        "repetition_penalty": lambda: rng.choice([0.7, 1.3, 2.0]),
        "bad_words_ids": lambda: [[rng.randrange(3, VOCAB - 1)], [rng.randrange(3, VOCAB - 1), rng.randrange(3, 20)]],
        "suppress_tokens": lambda: rng.sample(range(3, VOCAB - 1), 3),
        "begin_suppress_tokens": lambda: rng.sample(range(3, VOCAB - 1), 2),
        "forced_bos_token_id": lambda: rng.randrange(3, VOCAB - 1),
        "forced_eos_token_id": lambda: eos,
        "renormalize_logits": lambda: True,
        "remove_invalid_values": lambda: True,
    }
    for option, value in optional.items():
        if rng.random() < 0.15:
            kwargs[option] = value()
    if kwargs.get("forced_bos_token_id") in kwargs.get("suppress_tokens", ()):  # transformers rejects the pair
        kwargs["suppress_tokens"].remove(kwargs["forced_bos_token_id"])
    if kwargs["do_sample"]:
        warpers = {
            "temperature": lambda: rng.choice([0.5, 0.8, 1.5]),
            "top_k": lambda: rng.choice([0, 2, 5, 20]),
            "top_p": lambda: rng.choice([0.5, 0.9]),
            "min_p": lambda: rng.choice([0.05, 0.2]),
            "typical_p": lambda: rng.choice([0.5, 0.9]),
            "epsilon_cutoff": lambda: rng.choice([1e-3, 1e-2]),
            "eta_cutoff": lambda: rng.choice([1e-3, 1e-2]),
        }
        for option, value in warpers.items():
            if rng.random() < 0.25:
                kwargs[option] = value()
    kwargs["batch_size"] = rng.randint(1, 4)
    return name, kwargs


def run_both(name: str, kwargs: dict, seed: int):
    model = tiny_model(name)
    kwargs = dict(kwargs)
    generator = torch.Generator().manual_seed(seed)
    ids, mask = random_inputs(model, kwargs.pop("batch_size"), generator)
    torch.manual_seed(seed)
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    torch.manual_seed(seed)
    actual = beamsearch.generate(model, input_ids=ids, attention_mask=mask, **kwargs)
    return expected, actual


def assert_same_output(expected, actual):
    assert type(actual) is type(expected)
    assert torch.equal(actual.sequences, expected.sequences), (actual.sequences, expected.sequences)
    if getattr(expected, "sequences_scores", None) is not None:
        torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, atol=1e-5, rtol=1e-5)
    if getattr(expected, "beam_indices", None) is not None:
        assert torch.equal(actual.beam_indices, expected.beam_indices)
    for field in ("scores", "logits"):
        want, got = getattr(expected, field), getattr(actual, field)
        assert (want is None) == (got is None), field
        if want is not None:
            assert len(got) == len(want), field
            for step_got, step_want in zip(got, want, strict=True):
                torch.testing.assert_close(step_got, step_want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(CASES))
def test_random_configuration_matches_transformers(seed):
    name, kwargs = random_case(seed)
    expected, actual = run_both(name, kwargs, seed)
    assert_same_output(expected, actual)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_plain_tensor_return_matches(name):
    model = tiny_model(name)
    ids, mask = random_inputs(model, 3, torch.Generator().manual_seed(7))
    for kwargs in ({"num_beams": 4, "num_return_sequences": 2}, {}):
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **kwargs)
        actual = beamsearch.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, **kwargs)
        assert torch.equal(actual, expected)


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
