"""An example's output does not depend on the examples it is batched with, nor on its padding."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

from beamsearch.adapters.hf import search_model  # noqa: E402
from beamsearch.cli.decoding import EMBEDDED_MODEL  # noqa: E402
from beamsearch.cli.evaluate import CMUDICT_TEST  # noqa: E402
from beamsearch.evaluation import read_references  # noqa: E402


@pytest.fixture(scope="module")
def g2p():
    return AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval(), AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


@pytest.mark.parametrize(
    "options",
    [
        {"num_beams": 1},
        {"num_beams": 4, "num_return_sequences": 2},
        {"num_beams": 3, "semantics": "onmt", "max_length_ratio": 0},
        {"num_beams": 3, "semantics": "t2t"},
        {"num_beams": 3, "semantics": "ct2"},
    ],
)
def test_batched_equals_alone(g2p, options):
    model, tok = g2p
    words = [w for w, _ in read_references(CMUDICT_TEST)[:40]]
    random.Random(0).shuffle(words)
    alone = [search_model(model, **tok([w], return_tensors="pt"), **options) for w in words[:12]]
    batch = search_model(model, **tok(words[:12], return_tensors="pt", padding=True), **options)
    for i, one in enumerate(alone):
        n = one.sequences.shape[1]
        for j in range(n):
            length = int(one.lengths[0, j])
            assert int(batch.lengths[i, j]) == length
            assert torch.equal(batch.sequences[i, j, :length], one.sequences[0, j, :length])
            assert float(batch.sequences_scores[i, j]) == pytest.approx(float(one.sequences_scores[0, j]), abs=1e-5)
