"""The strategy registry and the table of refused combinations (strategies/registry.py), entry by entry."""

from __future__ import annotations

import re

import pytest
import torch

import beamsearch
from beamsearch import engine
from beamsearch.strategies.registry import INCOMPATIBLE, REGISTRY

VOCAB = 6
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))


def step(tokens, state):
    return TABLE[tokens[:, -1]], state


def aligned_step(tokens, state):
    return TABLE[tokens[:, -1]], state, torch.ones(tokens.shape[0], 3) / 3


START = torch.tensor([[1], [2]])
COMMON = dict(max_new_tokens=3, eos_token_id=0)

# one search per refused combination, named as in INCOMPATIBLE
REFUSED = {
    "ct2 prefix with beams": dict(semantics="ct2", num_beams=2, target_prefix=[[3], [4]]),
    "alignments outside hf beams": dict(semantics="onmt", num_beams=2, output_alignments=True),
    "ranking outside hf beams": dict(num_beams=1, unique=True),
    "constraints outside hf beams": dict(num_beams=1, force_words_ids=[[3]]),
    "stochastic with pool options": dict(num_beams=2, stochastic_beam_search=True, output_alignments=True),
}


def test_every_refused_combination_has_a_case():
    assert [name for name, _, _ in INCOMPATIBLE] == list(REFUSED)


@pytest.mark.parametrize(("name", "applies", "message"), INCOMPATIBLE, ids=[name for name, _, _ in INCOMPATIBLE])
def test_refused_combination_raises_its_message(name, applies, message):
    kwargs = dict(COMMON, **REFUSED[name])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        beamsearch.search(aligned_step if kwargs.get("output_alignments") else step, START, **kwargs)


# one search per strategy, named as in REGISTRY, and the class it must build
CHOSEN = {
    "stochastic beam search": (dict(num_beams=2, stochastic_beam_search=True), "StochasticBeamSearch"),
    "another toolkit's beam search": (dict(num_beams=2, semantics="t2t"), "T2TBeamSearch"),
    "diverse (group) beam search": (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), "GroupBeamSearch"),
    "constrained beam search": (dict(num_beams=3, force_words_ids=[[3]]), "ConstrainedBeamSearch"),
    "beam search and beam sampling": (dict(num_beams=2, do_sample=True), "BeamSearch"),
    "greedy search and sampling": (dict(), "SamplingSearch"),
}


def test_every_strategy_has_a_case():
    assert [name for name, _, _ in REGISTRY] == list(CHOSEN)


@pytest.mark.parametrize("name", list(CHOSEN))
def test_the_rule_selects_the_strategy(name, monkeypatch):
    built = []
    original = engine.decode

    def recording(step_fn, state, strategy, batch_size):
        built.append(type(strategy).__name__)
        return original(step_fn, state, strategy, batch_size)

    monkeypatch.setattr(engine, "decode", recording)
    kwargs, cls = CHOSEN[name]
    result = beamsearch.search(step, START, **dict(COMMON, **kwargs))
    assert built == [cls] and result.sequences.shape[0] == 2
