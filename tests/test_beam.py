"""Beam search against exhaustive enumeration, and invariants of every returned hypothesis."""

from __future__ import annotations

import itertools
import math

import torch
from fakes import PrefixModel
from hypothesis import given, settings
from hypothesis import strategies as st

import beamsearch
from beamsearch import FinishReason


def enumerate_hypotheses(model: PrefixModel, prompt: list[int], max_new: int, eos: int):
    """Every complete hypothesis (ends with EOS, or reaches max_new tokens) with its log-prob sum."""
    out = []
    for length in range(1, max_new + 1):
        for tail in itertools.product(range(model.vocab_size), repeat=length):
            if eos in tail[:-1]:
                continue
            if length < max_new and tail[-1] != eos:
                continue
            sequence = prompt + list(tail)
            out.append((sequence, sum(model.log_probs_of(sequence, len(prompt)))))
    return out


def test_beam_equals_exhaustive_search_when_wide_enough():
    for seed, length_penalty in itertools.product(range(4), (0.0, 1.0, -1.0, 2.0)):
        model = PrefixModel(vocab_size=3, seed=seed)
        prompt = [1, 2]
        hypotheses = enumerate_hypotheses(model, prompt, max_new=3, eos=0)
        ranked = sorted(hypotheses, key=lambda h: -h[1] / (len(h[0]) - len(prompt)) ** length_penalty)
        num_beams = len(hypotheses)
        result = beamsearch.search(
            model, torch.tensor([prompt]), num_beams=num_beams, num_return_sequences=5, max_new_tokens=3,
            eos_token_id=0, pad_token_id=0, length_penalty=length_penalty, early_stopping="never",
        )
        for j in range(5):
            length = int(result.lengths[0, j])
            assert result.sequences[0, j, :length].tolist() == ranked[j][0]
            penalised = ranked[j][1] / (length - len(prompt)) ** length_penalty
            assert math.isclose(float(result.sequences_scores[0, j]), penalised, abs_tol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_beams=st.integers(1, 6),
    length_penalty=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
    early_stopping=st.sampled_from([True, False, "never"]),
    do_sample=st.booleans(),
    batch_size=st.integers(1, 3),
)
def test_returned_hypotheses_are_consistent(seed, num_beams, length_penalty, early_stopping, do_sample, batch_size):
    """n-best sorted; token log-probs equal teacher-forced model log-probs; sums and penalties agree."""
    model = PrefixModel(vocab_size=6, seed=seed)
    prompts = torch.randint(1, 6, (batch_size, 2), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    result = beamsearch.search(
        model, prompts, num_beams=num_beams, num_return_sequences=num_beams if num_beams > 1 else 1,
        max_new_tokens=6, eos_token_id=0, pad_token_id=0, length_penalty=length_penalty,
        early_stopping=early_stopping, do_sample=do_sample, top_k=0,
    )
    n = result.sequences.shape[1]
    assert result.sequences.shape[:2] == (batch_size, n)
    if num_beams > 1 and not do_sample:
        assert torch.all(result.sequences_scores[:, :-1] >= result.sequences_scores[:, 1:])
    for b, j in itertools.product(range(batch_size), range(n)):
        length = int(result.lengths[b, j])
        generated = length - 2
        sequence = result.sequences[b, j, :length].tolist()
        expected = model.log_probs_of(sequence, 2)
        got = result.token_log_probs[b, j, :generated].tolist()
        assert all(math.isclose(g, e, abs_tol=1e-4) for g, e in zip(got, expected, strict=True))
        assert math.isclose(float(result.sum_log_probs[b, j]), sum(expected), abs_tol=1e-4)
        assert torch.all(result.sequences[b, j, length:] == 0)
        reason = FinishReason(int(result.finish_reason[b, j]))
        if sequence[-1] == 0:
            assert reason is FinishReason.EOS
        else:
            assert reason is FinishReason.MAX_LENGTH and generated == 6
        if num_beams > 1:
            penalised = float(result.sum_log_probs[b, j]) / generated**length_penalty
            assert math.isclose(float(result.sequences_scores[b, j]), penalised, rel_tol=1e-4, abs_tol=1e-4)
