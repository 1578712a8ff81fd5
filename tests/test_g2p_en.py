"""g2p-en's trained GRU (weights from the g2p-en package) decoded through beamsearch.search."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

if importlib.util.find_spec("g2p_en") is None:  # installed by the Makefile with --no-deps
    pytest.skip("g2p-en is not installed", allow_module_level=True)

from g2p_en_gru import END, GRAPHEMES, PHONEMES, START, G2pEnGRU, checkpoint_path, phones  # noqa: E402


def numpy_greedy(weights, word: str, max_steps: int = 20) -> list[str]:
    """An independent greedy decoder in NumPy, written from the model's description."""

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    def cell(x, h, prefix):
        gates_x = x @ weights[f"{prefix}_w_ih"].T + weights[f"{prefix}_b_ih"]
        gates_h = h @ weights[f"{prefix}_w_hh"].T + weights[f"{prefix}_b_hh"]
        size = h.shape[-1]
        reset = sigmoid(gates_x[:size] + gates_h[:size])
        update = sigmoid(gates_x[size:2 * size] + gates_h[size:2 * size])
        new = np.tanh(gates_x[2 * size:] + reset * gates_h[2 * size:])
        return (1.0 - update) * new + update * h

    h = np.zeros(weights["enc_w_hh"].shape[1], np.float32)
    for char in list(word) + ["</s>"]:
        h = cell(weights["enc_emb"][GRAPHEMES.index(char)], h, "enc")
    token, out = START, []
    for _ in range(max_steps):
        h = cell(weights["dec_emb"][token], h, "dec")
        token = int(np.argmax(weights["fc_w"] @ h + weights["fc_b"]))
        if token == END:
            break
        out.append(PHONEMES[token])
    return out


def cmudict_test_rows(limit: int):
    rows = [line.split("\t") for line in (ROOT / "src/beamsearch/data/cmudict/test.tsv").read_text().splitlines()]
    rows = [(r[0], [p.split() for p in r[1:]]) for r in rows if set(r[0]) <= set(GRAPHEMES[3:])]
    return rows[:limit]


def test_greedy_search_equals_an_independent_numpy_decoder():
    weights = np.load(checkpoint_path())
    words = [w for w, _ in cmudict_test_rows(60)]
    result = G2pEnGRU().pronounce(words)
    for b, word in enumerate(words):
        assert phones(result, b) == numpy_greedy(weights, word), word


def test_beam_search_is_not_worse_than_greedy_on_cmudict_cmudict_test_rows():
    rows = cmudict_test_rows(300)
    model = G2pEnGRU()
    words = [w for w, _ in rows]
    errors = {}
    for num_beams in (1, 5):
        result = model.pronounce(words, num_beams=num_beams)
        errors[num_beams] = sum(phones(result, b) not in refs for b, (_, refs) in enumerate(rows)) / len(rows)
        scores = result.sequences_scores[:, 0]
        assert torch.all(torch.isfinite(scores))
    assert errors[5] <= errors[1]
    assert errors[1] < 0.5, errors  # a trained model, not noise
