"""search(): a plain PyTorch model through the step protocol, state handling, and option errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fakes import GRUDecoder, PrefixModel, count_host_conversions
from numerics import assert_bitwise, assert_scores_close

import beamsearch

SEARCHES = [
    {"num_beams": 1},
    {"num_beams": 4, "num_return_sequences": 3},
    {"num_beams": 3, "length_penalty": 0.0, "early_stopping": True},
    {"num_beams": 5, "early_stopping": "never", "length_penalty": 2.0},
    {"do_sample": True, "num_return_sequences": 2, "top_k": 5},
    {"do_sample": True, "num_beams": 3, "temperature": 0.7},
]


@pytest.mark.parametrize("kwargs", SEARCHES)
def test_gru_with_nested_dict_state_cached_equals_uncached(kwargs):
    model = GRUDecoder()
    source = torch.randint(3, 12, (3, 5), generator=torch.Generator().manual_seed(1))
    results = []
    for step in (model.step_cached, model.step_uncached):
        torch.manual_seed(0)
        results.append(beamsearch.search(step, torch.full((3, 1), 2), model.initial_state(source),
                                         max_new_tokens=7, eos_token_id=1, pad_token_id=0, **kwargs))
    cached, uncached = results
    assert torch.equal(cached.sequences, uncached.sequences)
    assert_scores_close(cached.sequences_scores, uncached.sequences_scores)
    assert cached.finish_reason.tolist() == uncached.finish_reason.tolist()


@dataclasses.dataclass
class DataclassState:
    rows: torch.Tensor
    pair: tuple


class ReorderableState:
    def __init__(self, rows):
        self.rows = rows
        self.calls = 0

    def reorder(self, index):
        self.rows = self.rows.index_select(0, index)
        self.calls += 1


def row_tracking_step(states_seen):
    """A step whose logits ignore the state but which checks that state rows follow their beams."""
    model = PrefixModel(vocab_size=7, seed=3)

    def step(tokens, state):
        rows = state.rows if not isinstance(state, dict) else state["rows"]
        # each row of the state holds the example index; it must still match after every reorder
        states_seen.append(rows.clone())
        return model.logits_for(tokens), state

    return step


@pytest.mark.parametrize("make_state", [
    lambda rows: {"rows": rows, "other": [rows * 2, (rows, None)]},
    lambda rows: DataclassState(rows, (rows, "label")),
    ReorderableState,
])
def test_state_rows_follow_their_example(make_state):
    seen = []
    batch = 3
    state = make_state(torch.arange(batch))
    beamsearch.search(row_tracking_step(seen), torch.tensor([[1], [2], [3]]), state, num_beams=4,
                      max_new_tokens=5, eos_token_id=0)
    for rows in seen:
        assert rows.tolist() == torch.arange(batch).repeat_interleave(4).tolist()


def test_greedy_picks_argmax_every_step():
    model = PrefixModel(vocab_size=9, seed=5)
    result = beamsearch.search(model, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=6)
    for b in range(2):
        sequence = result.sequences[b, 0].tolist()
        for position in range(2, len(sequence)):
            logits = model.logits_for(torch.tensor([sequence[:position]]))
            assert sequence[position] == int(logits.argmax())


@pytest.mark.parametrize("kwargs", [{"num_beams": 1}, {"num_beams": 3, "semantics": "ct2"}])
def test_fresh_logits_are_masked_in_place_and_others_never_change(kwargs):
    """A step may say its logits are its own new tensor (``fresh_logits``): the masks then work in place, with
    the same result; without it, the tensors a step returns (here rows of its own table) are never changed."""
    model = PrefixModel(vocab_size=9, seed=5)
    table = model.table.clone()
    options = dict(max_new_tokens=5, min_new_tokens=3, eos_token_id=1, suppress_tokens=[4], **kwargs)
    start = torch.tensor([[2], [3]])
    plain = beamsearch.search(model, start, **options)
    assert torch.equal(model.table, table)
    returned = []

    def fresh(tokens, state):
        returned.append(model.logits_for(tokens).clone())
        return returned[-1], state

    fresh.fresh_logits = True
    owned = beamsearch.search(fresh, start, **options)
    assert torch.equal(owned.sequences, plain.sequences)
    assert_bitwise(owned.sequences_scores, plain.sequences_scores, "the same table rows, masks and shapes")
    assert all(torch.isinf(logits[:, 4]).all() for logits in returned)  # masked in place: no copy was made
    logged = beamsearch.search(fresh, start, output_logits=True, **options)
    assert not any(torch.isinf(logits).any() for logits in logged.logits)  # the trace keeps them unprocessed


@pytest.mark.parametrize("kwargs, name", [
    ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
    ({"do_sample": True, "top_p": 0.0}, "top_p"),
    ({"do_sample": True, "top_p": 1.5}, "top_p"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"num_beams": 0}, "num_beams"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"temperature": 0.0}, "temperature"),
    ({"min_new_tokens": 2}, "min_new_tokens"),
    ({"bogus_option": 1}, "bogus_option"),
    ({"num_beam_groups": 2}, "num_beam_groups"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"stop_strings": ["x"]}, "tokenizer"),
])
def test_invalid_options_raise_value_error_naming_the_option(kwargs, name):
    with pytest.raises(ValueError, match=name):
        beamsearch.search(PrefixModel(5), torch.tensor([[1]]), **kwargs)


@pytest.mark.parametrize("input_ids", [torch.tensor([1, 2]), torch.zeros(2, 0, dtype=torch.long),
                                       torch.tensor([[0.5]])])
def test_bad_input_ids_raise(input_ids):
    with pytest.raises(ValueError, match="input_ids"):
        beamsearch.search(PrefixModel(5), input_ids)


def test_bad_logits_shape_is_named():
    with pytest.raises(ValueError, match="logits"):
        beamsearch.search(lambda tokens, state: (torch.zeros(1, 5), state), torch.tensor([[1], [2]]))


def test_core_imports_and_searches_without_transformers():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import torch, beamsearch\n"
        "step = lambda tokens, state: (torch.log_softmax(torch.arange(5.0).repeat(tokens.shape[0], 1), -1), state)\n"
        "r = beamsearch.search(step, torch.tensor([[1]]), num_beams=2, max_new_tokens=3, eos_token_id=0)\n"
        "print(r.sequences[0, 0].tolist())\n"
    )
    src = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src},
                         check=True)
    assert out.stdout.strip() == "[1, 4, 4, 4]"


@pytest.mark.parametrize("kwargs", [
    {"num_beams": 4, "num_return_sequences": 2, "no_repeat_ngram_size": 2, "repetition_penalty": 1.2},
    {"num_beams": 3, "do_sample": True, "top_p": 0.9, "min_new_tokens": 2},
    {"do_sample": True, "num_return_sequences": 2, "temperature": 0.7, "bad_words_ids": [[3, 4]]},
    {"suppress_tokens": [5], "forced_eos_token_id": 0},
])
def test_at_most_one_host_synchronisation_per_step(monkeypatch, kwargs):
    """Count the tensor -> Python conversions during a search: one per step (the 'all done?' check)."""
    model = PrefixModel(vocab_size=9, seed=2)
    steps = []

    def step(tokens, state):
        steps.append(tokens.shape[1])
        return model.logits_for(tokens), state

    conversions = count_host_conversions(monkeypatch)
    result = beamsearch.search(step, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=8, eos_token_id=0, **kwargs)
    monkeypatch.undo()
    assert len(steps) >= 2
    # one check per step, one before the first step, and the final crop of the result
    assert len(conversions) <= len(steps) + 2, (len(conversions), len(steps))
    assert result.sequences.shape[0] == 2


def test_identity_reorders_are_skipped():
    """When every beam continues from its own row, the state is not reordered (the check rides on the step's one
    host transfer); results equal a search that reorders at every step (remove_finished=False)."""
    vocab = 12

    def step(tokens, state):  # each row repeats its last token; everything else is far behind, more so each step
        logits = torch.full((tokens.shape[0], vocab), -30.0 * tokens.shape[1]) - 0.01 * torch.arange(vocab)
        logits[torch.arange(tokens.shape[0]), tokens[:, -1]] = 0.0
        return logits, state

    class Recorder:
        def __init__(self):
            self.calls = []

        def reorder(self, index):
            self.calls.append(index.clone())

    results = {}
    for remove in (True, False):
        state = Recorder()
        results[remove] = beamsearch.search(step, torch.tensor([[1], [5]]), state, num_beams=3, max_new_tokens=6,
                                            eos_token_id=None, remove_finished=remove)
        identity = [bool(torch.equal(c, torch.arange(c.shape[0]))) for c in state.calls]
        if remove:  # the expansion to beams, then step 0's reorder (every beam from beam 0); none after
            assert len(state.calls) == 2 and not any(identity)
        else:  # the expansion, then one reorder per step: steps 1-4 by the identity, the last one after the end
            assert len(state.calls) == 7 and all(identity[2:6])
    assert torch.equal(results[True].sequences, results[False].sequences)
    assert_bitwise(results[True].sequences_scores, results[False].sequences_scores,
                   "no hypothesis ends (eos None), so both searches keep every row: the same shapes")
    assert results[True].sequences[0, 0].tolist() == [1] * 7
