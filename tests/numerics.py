"""How the tests compare numbers (the rule is written out in docs/testing.md).

- Tokens are compared exactly. A token mismatch against a reference is accepted only where the reference's own
  margin at the step where the outputs part (its top-2 gap, or for beams the gap between neighbouring candidates)
  is below the score tolerance; :func:`reference_margin` and the parity grid check that margin.
- Scores of two computations that differ in shapes, row counts or kernels are compared with
  :func:`assert_scores_close`: a tolerance scaled to the dtype (its machine epsilon) and to the magnitude of
  each value. Matrix products round differently with the row count, the thread count and the instruction set
  (MKL and oneDNN choose kernels by shape and CPU), so such results agree to float precision, not bitwise.
- :func:`assert_bitwise` only where the same kernels run on the same shapes; the caller says why that holds.
"""

from __future__ import annotations

import torch

# Relative tolerance per dtype (and absolute below magnitude 1). Rounding differences of one ulp in a hidden state
# grow through the layers of a model (seen: per-step log-probs 1e-4 apart on a tiny random T5 between 1 and K
# rows), so float32 scores get 1024 ulps of their magnitude (1.2e-4). Half precision keeps fewer bits: its scores
# get about 6% (64 ulps of float16, 8 of bfloat16), still far below the gaps a wrong token or a wrong processor
# makes in these tests' peaked distributions.
ULPS = {torch.float32: 1024, torch.float64: 1024, torch.float16: 64, torch.bfloat16: 8}


def score_tolerance(dtype: torch.dtype = torch.float32) -> float:
    """The relative (and, below magnitude 1, absolute) tolerance for scores computed in ``dtype``."""
    return ULPS[dtype] * torch.finfo(dtype).eps


def assert_scores_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                        tolerance: float | None = None) -> None:
    """``|actual - expected| <= score_tolerance(dtype) * max(1, |expected|)`` elementwise; infinities equal.

    ``dtype``: the precision the two computations ran in (default: the coarser of the two tensors' dtypes).
    ``tolerance``: a relative tolerance of the caller's instead, where it says why.
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if dtype is None:
        dtype = max((actual.dtype, expected.dtype), key=lambda d: torch.finfo(d).eps)
    if tolerance is None:
        tolerance = score_tolerance(dtype)
    actual, expected = actual.double(), expected.double()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), "infinities differ"
    assert torch.equal(actual[~finite], expected[~finite]), "infinities differ"
    bound = tolerance * expected[finite].abs().clamp(min=1.0)
    error = (actual[finite] - expected[finite]).abs()
    if not bool((error <= bound).all()):
        worst = int((error - bound).argmax())
        raise AssertionError(f"scores differ beyond the tolerance ({tolerance:.3g} relative, {dtype}): "
                             f"{float(actual[finite][worst])} vs {float(expected[finite][worst])} "
                             f"(tolerance {float(bound[worst]):.3g})")


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, why: str) -> None:
    """Bit-for-bit equality, for two computations that run the same kernels on the same shapes (``why`` says how)."""
    assert why, "say why the two computations run the same kernels on the same shapes"
    assert torch.equal(actual, expected), f"not bitwise equal although {why}: max difference " \
        f"{float((actual.double() - expected.double()).abs().max()) if actual.shape == expected.shape else 'shape'}"


def top2_margin(scores: torch.Tensor) -> torch.Tensor:
    """``[rows]`` gap between each row's best and second-best score (``scores [rows, V]``)."""
    best = torch.topk(scores.double(), 2, dim=-1).values
    return best[:, 0] - best[:, 1]


def smallest_gap(values: torch.Tensor, count: int) -> float:
    """The smallest gap between neighbours among the ``count`` largest finite ``values`` (1-d), inf if fewer than 2."""
    values = values[torch.isfinite(values) & (values > -1e8)].double()
    top = torch.sort(values, descending=True).values[:count]
    return float((top[:-1] - top[1:]).min()) if top.numel() > 1 else float("inf")


def near_tie(margin: float, magnitude: float, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a reference's margin is below the score tolerance at that magnitude (so rounding may flip it)."""
    return margin <= score_tolerance(dtype) * max(1.0, abs(magnitude))
