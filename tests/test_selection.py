"""The chunk-maxima candidate selection equals ``torch.topk`` over the ``[B, K*V]`` sums (selection.py)."""

from __future__ import annotations

import pytest
import torch
from parity_grid import assert_case_equivalent, random_case, run_both

from beamsearch import selection
from beamsearch.selection import top_totals


def reference(log_probs: torch.Tensor, beam_scores: torch.Tensor, count: int):
    b, k, vocab = log_probs.shape
    return torch.topk((log_probs + beam_scores[:, :, None]).reshape(b, k * vocab), count)


def count_calls(monkeypatch, module, name: str) -> dict:
    """Replaces ``module.name`` with a wrapper that counts its calls in the returned ``{"calls": n}``."""
    calls = {"calls": 0}
    original = getattr(module, name)

    def counting(*args):
        calls["calls"] += 1
        return original(*args)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def fallbacks(monkeypatch):
    """Counts the calls that fell back to the sums and ``torch.topk``."""
    return count_calls(monkeypatch, selection, "_top_of_sums")


@pytest.mark.parametrize("vocab", [32128, 5 * selection.CHUNK, 3000, 50257])
@pytest.mark.parametrize("beams", [1, 4, 8])
def test_equals_topk_of_sums(vocab, beams, fallbacks):
    generator = torch.Generator().manual_seed(vocab + beams)
    for batch in (1, 3):
        logits = torch.randn(batch * beams, vocab, generator=generator) * 4
        log_probs = torch.log_softmax(logits, dim=-1).reshape(batch, beams, vocab)
        beam_scores = torch.randn(batch, beams, generator=generator) * 3
        count = 2 * beams
        values, positions = top_totals(log_probs, beam_scores, count)
        want_values, want_positions = reference(log_probs, beam_scores, count)
        assert torch.equal(values, want_values)
        assert torch.equal(positions, want_positions)
    chunk_path = beams * (vocab // selection.CHUNK) >= selection.MIN_CHUNKS_PER_CANDIDATE * 2 * beams
    assert fallbacks["calls"] == (0 if chunk_path else 2)  # no ties here: only short rows use torch.topk


def test_first_step_masked_beams_and_masked_tokens(fallbacks):
    """Step 0 (only the first beam lives, the others at -1e9) and -inf tokens (suppressed, banned)."""
    generator = torch.Generator().manual_seed(3)
    log_probs = torch.log_softmax(torch.randn(2 * 4, 32128, generator=generator), dim=-1).reshape(2, 4, 32128)
    log_probs[:, :, 1000:9000] = float("-inf")
    beam_scores = torch.tensor([[0.0, -1e9, -1e9, -1e9]] * 2)
    values, positions = top_totals(log_probs, beam_scores, 8)
    want_values, want_positions = reference(log_probs, beam_scores, 8)
    assert torch.equal(values, want_values) and torch.equal(positions, want_positions)
    assert bool((positions < 32128).all())  # all from the live beam
    assert fallbacks["calls"] == 0


def test_ties_fall_back_to_topk(fallbacks):
    """Equal sums among the best, or equal chunk maxima at the cut: torch.topk decides, as in transformers."""
    generator = torch.Generator().manual_seed(5)
    log_probs = torch.log_softmax(torch.randn(4, 32128, generator=generator), dim=-1).reshape(1, 4, 32128)
    beam_scores = torch.zeros(1, 4)
    best = log_probs.max()
    log_probs[0, 2, 7] = best  # ties the best sum of another beam
    values, positions = top_totals(log_probs, beam_scores, 8)
    want_values, want_positions = reference(log_probs, beam_scores, 8)
    assert torch.equal(values, want_values) and torch.equal(positions, want_positions)
    assert fallbacks["calls"] == 1


def test_nan_falls_back_to_topk(fallbacks):
    log_probs = torch.log_softmax(torch.randn(8, 32128), dim=-1).reshape(2, 4, 32128)
    log_probs[1, 3, 100] = float("nan")
    beam_scores = torch.zeros(2, 4)
    values, positions = top_totals(log_probs, beam_scores, 8)
    want_values, want_positions = reference(log_probs, beam_scores, 8)
    assert torch.equal(positions, want_positions)
    assert torch.equal(values.isnan(), want_values.isnan())
    assert fallbacks["calls"] == 1


def test_small_vocabularies_use_topk(fallbacks):
    log_probs = torch.log_softmax(torch.randn(4, 40), dim=-1).reshape(1, 4, 40)
    top_totals(log_probs, torch.zeros(1, 4), 8)
    assert fallbacks["calls"] == 1


def _is_beam_search(seed: int) -> bool:
    kwargs = random_case(seed)[1]
    return not kwargs["do_sample"] and kwargs.get("num_beams", 1) >= 2


BEAM_SEEDS = [seed for seed in range(200) if _is_beam_search(seed)][:60]


@pytest.mark.parametrize("seed", BEAM_SEEDS)
def test_parity_grid_with_tiny_chunks(seed, monkeypatch):
    """The parity grid's beam search cases with chunks of two tokens, so that the tiny models' vocabulary of 40
    runs the chunk path: outputs still equal transformers'."""
    monkeypatch.setattr(selection, "CHUNK", 2)
    monkeypatch.setattr(selection, "MIN_CHUNKS_PER_CANDIDATE", 1)
    name, kwargs = random_case(seed)
    expected, actual = run_both(name, kwargs, seed)
    assert_case_equivalent(expected, actual, name, kwargs, seed)


def test_parity_grid_takes_the_chunk_path(fallbacks, monkeypatch):
    """The grid above really runs the chunk path: most steps of its beam cases do not fall back."""
    monkeypatch.setattr(selection, "CHUNK", 2)
    monkeypatch.setattr(selection, "MIN_CHUNKS_PER_CANDIDATE", 1)
    import beamsearch.strategies.beam as beam_module

    steps = count_calls(monkeypatch, beam_module, "top_totals")
    for seed in BEAM_SEEDS:
        run_both(*random_case(seed), seed)
    assert steps["calls"] > 100
    assert fallbacks["calls"] < steps["calls"] // 2, (fallbacks["calls"], steps)
