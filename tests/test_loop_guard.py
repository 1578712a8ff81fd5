"""The loop guard bans exactly the token that would complete the ``repeats``-th back-to-back copy of an n-gram."""

from __future__ import annotations

import itertools

import pytest
import torch

from beamsearch.processors.ngrams import LoopGuardLogitsProcessor


def _banned_by_definition(generated: list[int], vocab: int, repeats: int, max_period: int) -> set[int]:
    """Tokens x such that generated + [x] ends with ``repeats`` copies of some n-gram, n <= max_period."""
    banned = set()
    for x in range(vocab):
        row = generated + [x]
        for period in range(1, max_period + 1):
            tail = row[-repeats * period:]
            if len(tail) == repeats * period and tail == tail[:period] * repeats:
                banned.add(x)
    return banned


@pytest.mark.parametrize("repeats,max_period", [(2, 1), (2, 3), (3, 2), (3, 4)])
def test_the_guard_bans_what_the_definition_bans_on_every_short_row(repeats, max_period):
    vocab, prompt = 3, [7, 7, 7, 7]  # the prompt repeats, and never counts
    guard = LoopGuardLogitsProcessor(repeats, len(prompt), max_period)
    rows = [list(r) for length in range(0, 7) for r in itertools.product(range(vocab), repeat=length)]
    for length in range(0, 7):
        batch = [r for r in rows if len(r) == length]
        ids = torch.tensor([prompt + r for r in batch])
        scores = torch.zeros(len(batch), vocab)
        out = guard(ids, scores)
        for row, got in zip(batch, out, strict=True):
            expected = _banned_by_definition(row, vocab, repeats, max_period)
            assert {x for x in range(vocab) if got[x] == float("-inf")} == expected, row
        assert torch.equal(scores, torch.zeros(len(batch), vocab))  # the input is not changed


def test_a_g2p_loop_is_stopped_at_its_third_copy():
    # after "N AH2 N AH2 N", "AH2" would complete a third "N AH2": banned; nothing else is
    n, ah2 = 5, 6
    guard = LoopGuardLogitsProcessor(3, 1, 4)
    ids = torch.tensor([[0, n, ah2, n, ah2, n]])
    out = guard(ids, torch.zeros(1, 10))
    assert out[0, ah2] == float("-inf") and int((out[0] == float("-inf")).sum()) == 1
    assert guard(torch.tensor([[0, n, ah2, n, ah2]]), torch.zeros(1, 10))[0, n] == 0.0  # two copies: allowed


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="loop_guard"):
        LoopGuardLogitsProcessor(1, 0)


def test_the_loop_guard_option_reaches_every_search():
    """A model that loops "2 3 2 3 ..." never produces a third copy of any n-gram with loop_guard=3."""
    from beamsearch import search

    def looping(tokens, state):
        logits = torch.zeros(tokens.shape[0], 6)
        logits[torch.arange(tokens.shape[0]), 2 + tokens.shape[1] % 2] = 5.0  # loves the loop
        return logits, state

    def has_third_copy(row: list[int]) -> bool:
        return any(row[i:i + 3 * n] == row[i:i + n] * 3 for n in range(1, 5) for i in range(len(row) - 3 * n + 1))

    ids = torch.tensor([[1], [1]])
    torch.manual_seed(0)  # sampling: a fixed draw (the guard holds for any)
    for kwargs in ({}, {"num_beams": 3}, {"do_sample": True}, {"exact_search": True}):
        plain = search(looping, ids, None, max_new_tokens=12, eos_token_id=0, **kwargs)
        assert has_third_copy(plain.sequences[0, 0].tolist())  # the premise: without the guard it loops
        guarded = search(looping, ids, None, max_new_tokens=12, eos_token_id=0, loop_guard=3, **kwargs)
        for row, length in zip(guarded.sequences[:, 0].tolist(), guarded.lengths[:, 0].tolist(), strict=True):
            assert not has_third_copy(row[1:length]), (kwargs, row)  # pad tokens after the end do not count
