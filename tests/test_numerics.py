"""The comparison helpers themselves (numerics.py, parity_grid.py): what they accept and what they refuse."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_bitwise, assert_scores_close, near_tie, smallest_gap, top2_margin
from parity_grid import assert_case_equivalent, random_case, run_both


def test_scores_close_scales_with_magnitude_and_keeps_infinities_exact():
    eps = torch.finfo(torch.float32).eps
    expected = torch.tensor([0.5, -100.0, -float("inf")])
    assert_scores_close(expected + torch.tensor([1000 * eps, -100 * 1000 * eps, 0.0]), expected)
    with pytest.raises(AssertionError, match="tolerance"):
        assert_scores_close(expected + torch.tensor([2000 * eps, 0.0, 0.0]), expected)
    with pytest.raises(AssertionError, match="infinities"):
        assert_scores_close(torch.tensor([0.5, -100.0, -1e30]), expected)


def test_bitwise_needs_a_reason():
    with pytest.raises(AssertionError, match="say why"):
        assert_bitwise(torch.zeros(2), torch.zeros(2), "")
    with pytest.raises(AssertionError, match="not bitwise"):
        assert_bitwise(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]), "same shapes")


def test_margins_by_hand():
    assert top2_margin(torch.tensor([[0.0, -1.0, -0.25]])).tolist() == [0.25]
    # the 3 largest finite values 3, 2.5, 1 have gaps 0.5 and 1.5; -1e9 stands for a masked candidate
    assert smallest_gap(torch.tensor([1.0, 3.0, -1e9, 2.5, -float("inf"), 0.9]), 3) == 0.5
    assert near_tie(1e-5, 1.0) and not near_tie(1e-3, 1.0) and near_tie(1e-3, 10.0)
    assert near_tie(1e-2, 1.0, torch.float16) and not near_tie(0.1, 1.0, torch.bfloat16)


def _greedy_case() -> tuple[str, dict, int]:
    for seed in range(100):
        name, kwargs = random_case(seed)
        if kwargs.get("num_beams", 1) == 1 and not kwargs["do_sample"] and kwargs["max_new_tokens"] >= 3:
            return name, kwargs, seed
    raise AssertionError("no greedy case in the grid's first 100")


def test_a_token_mismatch_without_a_near_tie_is_refused():
    name, kwargs, seed = _greedy_case()
    expected, actual = run_both(name, kwargs, seed)
    actual.sequences[0, -1] = (actual.sequences[0, -1] + 1) % 40  # a token transformers did not nearly choose
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_case_equivalent(expected, actual, name, kwargs, seed)


def test_a_token_mismatch_at_an_exact_tie_of_the_reference_is_accepted():
    from parity_grid import assert_equivalent_output, case_inputs
    from transformers import LogitsProcessorList

    def tie(input_ids, scores):  # tokens 5 and 6 tie at the top: argmax keeps 5, rounding could give 6
        scores = scores.clone()
        scores[:, 5] = scores[:, 6] = scores.max() + 1.0
        return scores

    model, inputs = case_inputs("gpt2", {"batch_size": 1, "max_new_tokens": 1, "do_sample": False,
                                         "return_dict_in_generate": True}, 0)

    def rerun(processors):
        return model.generate(**inputs, logits_processor=LogitsProcessorList([tie, *processors]))

    expected = rerun([])
    assert int(expected.sequences[0, -1]) == 5
    actual = type(expected)(sequences=expected.sequences.clone())
    actual.sequences[0, -1] = 6
    assert_equivalent_output(expected, actual, rerun, {})
    with pytest.raises(AssertionError, match="sequences differ"):
        assert_equivalent_output(expected, actual)  # without a way to check the margin: tokens must be equal
