"""Length and coverage penalties against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from beamsearch.scoring import coverage_penalty, length_penalty


@pytest.mark.parametrize(
    ("kind", "length", "alpha", "expected"),
    [
        ("hf", 4, 1.0, 4.0),
        ("hf", 4, 0.5, 2.0),
        ("avg", 9, 0.5, 3.0),
        ("hf", 3, 0.0, 1.0),
        ("wu", 1, 1.0, 1.0),  # (5 + 1) / 6
        ("wu", 7, 1.0, 2.0),  # (5 + 7) / 6
        ("gnmt", 7, 2.0, 4.0),
        ("wu", 19, 0.5, 2.0),  # sqrt(24 / 6)
        ("none", 12, 3.0, 1.0),
    ],
)
def test_length_penalties(kind, length, alpha, expected):
    assert length_penalty(kind, length, alpha) == pytest.approx(expected)


def test_coverage_penalties():
    coverage = torch.tensor([[0.5, 1.0, 2.0], [0.25, 0.25, 3.0]])
    # wu: -beta * sum(log(min(c, 1)))
    assert coverage_penalty("wu", coverage, 2.0).tolist() == pytest.approx(
        [-2.0 * math.log(0.5), -2.0 * (2 * math.log(0.25))]
    )
    # summary: beta * sum(max(c, 1) - 1)
    assert coverage_penalty("summary", coverage, 0.5).tolist() == pytest.approx([0.5 * 1.0, 0.5 * 2.0])
    assert coverage_penalty("none", coverage, 1.0).tolist() == [0.0, 0.0]


def test_unknown_penalties():
    with pytest.raises(ValueError, match="unknown length penalty"):
        length_penalty("linear", 3, 1.0)
    with pytest.raises(ValueError, match="unknown coverage penalty"):
        coverage_penalty("gnmt", torch.ones(1, 2), 1.0)
