"""The random grid of ``generate`` configurations, and how an output is compared with transformers'.

:func:`random_case` draws one (model family, generate kwargs) configuration: greedy, sampling, beam search and beam
sampling with the processors, several EOS ids, padded batches and, for encoder-decoder models, the encoder-side
processors. :func:`assert_bitwise_output` is the comparison for ``exact_parity=True`` (the same rows and shapes as
transformers); :func:`assert_equivalent_output` for the fast default (other row counts: tokens exact unless the
reference itself nearly ties there, scores within the tolerance of ``numerics.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from numerics import assert_scores_close, near_tie, smallest_gap, top2_margin
from tiny_hf import MODEL_NAMES, VOCAB, generate_both, random_inputs, tiny_model


def random_case(seed: int) -> tuple[str, dict]:
    """One random (model, generate kwargs) configuration."""
    rng = random.Random(seed)
    name = MODEL_NAMES[seed % len(MODEL_NAMES)]
    mode = rng.choice(["greedy", "sample", "beam", "beam", "beam_sample"])
    # without per-step scores, finished examples leave the batch (remove_finished): half the cases test that
    scores = rng.random() < 0.5
    kwargs: dict = {"max_new_tokens": rng.randint(1, 10), "return_dict_in_generate": True,
                    "output_scores": scores, "output_logits": scores and rng.random() < 0.5}
    if mode in ("beam", "beam_sample"):
        kwargs["num_beams"] = rng.randint(2, 8) if rng.random() < 0.9 else 1
        kwargs["num_return_sequences"] = rng.randint(1, kwargs["num_beams"])
        kwargs["length_penalty"] = rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0])
        kwargs["early_stopping"] = rng.choice([True, False, "never"])
    kwargs["do_sample"] = mode in ("sample", "beam_sample")
    if mode == "sample":
        kwargs["num_return_sequences"] = rng.randint(1, 3)
    if mode == "greedy":
        kwargs["num_beams"] = 1
    model = tiny_model(name)
    eos = model.config.eos_token_id
    if rng.random() < 0.3:
        kwargs["eos_token_id"] = [eos, rng.randrange(3, VOCAB - 1)]
    optional = {
        "min_new_tokens": lambda: rng.randint(1, 4),
        "min_length": lambda: rng.randint(1, 6),
        "no_repeat_ngram_size": lambda: rng.randint(1, 3),
        "repetition_penalty": lambda: rng.choice([0.7, 1.3, 2.0]),
        "bad_words_ids": lambda: [[rng.randrange(3, VOCAB - 1)], [rng.randrange(3, VOCAB - 1), rng.randrange(3, 20)]],
        "suppress_tokens": lambda: rng.sample(range(3, VOCAB - 1), 3),
        "begin_suppress_tokens": lambda: rng.sample(range(3, VOCAB - 1), 2),
        "forced_bos_token_id": lambda: rng.randrange(3, VOCAB - 1),
        "forced_eos_token_id": lambda: eos,
        "renormalize_logits": lambda: True,
        "remove_invalid_values": lambda: True,
    }
    if model.config.is_encoder_decoder:
        optional["encoder_no_repeat_ngram_size"] = lambda: rng.randint(1, 3)
        optional["encoder_repetition_penalty"] = lambda: rng.choice([0.7, 1.3, 2.0])
    for option, value in optional.items():
        if rng.random() < 0.15:
            kwargs[option] = value()
    if kwargs.get("forced_bos_token_id") in kwargs.get("suppress_tokens", ()):  # transformers rejects the pair
        kwargs["suppress_tokens"].remove(kwargs["forced_bos_token_id"])
    if kwargs["do_sample"]:
        warpers = {
            "temperature": lambda: rng.choice([0.5, 0.8, 1.5]),
            "top_k": lambda: rng.choice([0, 2, 5, 20]),
            "top_p": lambda: rng.choice([0.5, 0.9]),
            "min_p": lambda: rng.choice([0.05, 0.2]),
            "typical_p": lambda: rng.choice([0.5, 0.9]),
            "epsilon_cutoff": lambda: rng.choice([1e-3, 1e-2]),
            "eta_cutoff": lambda: rng.choice([1e-3, 1e-2]),
        }
        for option, value in warpers.items():
            if rng.random() < 0.25:
                kwargs[option] = value()
    kwargs["batch_size"] = rng.randint(1, 4)
    return name, kwargs


def case_inputs(name: str, kwargs: dict, seed: int) -> tuple[object, dict]:
    """The model and the generate kwargs with the case's padded inputs in them."""
    model = tiny_model(name)
    kwargs = dict(kwargs)
    ids, mask = random_inputs(model, kwargs.pop("batch_size"), torch.Generator().manual_seed(seed))
    return model, dict(kwargs, input_ids=ids, attention_mask=mask)


def run_both(name: str, kwargs: dict, seed: int, **ours):
    """transformers' output and ours (``ours``: beamsearch-only options), each after ``torch.manual_seed(seed)``."""
    model, kwargs = case_inputs(name, kwargs, seed)
    return generate_both(model, ours, seed, **kwargs)


def assert_bitwise_output(expected, actual) -> None:
    """Every field bit for bit (``exact_parity=True``: each forward has the shapes of transformers')."""
    assert type(actual) is type(expected)
    for field in ("sequences", "sequences_scores", "beam_indices"):
        want, got = getattr(expected, field, None), getattr(actual, field, None)
        assert (want is None) == (got is None), field
        assert want is None or torch.equal(got, want), (field, got, want)
    for field in ("scores", "logits"):
        want, got = getattr(expected, field), getattr(actual, field)
        assert (want is None) == (got is None), field
        if want is not None:
            assert len(got) == len(want), field
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), field


def assert_equivalent_output(expected, actual, rerun: Callable | None = None, kwargs: dict | None = None) -> None:
    """Our fast default against transformers: other row counts, so float precision, not bits.

    Sequences are equal, except in an example where transformers' own decision nearly tied at the step where the
    outputs part: ``rerun(processors)`` re-runs transformers with extra logits processors (:func:`reference_margin`
    records its scores with one) and ``kwargs`` are the generate kwargs; without ``rerun`` tokens must be equal.
    Scores and beam indices are compared where the sequences are equal, scores within ``numerics.score_tolerance``.
    """
    assert type(actual) is type(expected)
    same = _same_rows(expected.sequences, actual.sequences)
    if not bool(same.all()):
        assert rerun is not None, ("sequences differ", expected.sequences, actual.sequences)
        margin, magnitude, dtype = reference_margin(expected, actual, rerun, kwargs or {})
        assert near_tie(margin, magnitude, dtype), (f"sequences differ where transformers' margin is {margin:.3g} "
                                                    f"(not a near tie)", expected.sequences, actual.sequences)
    if getattr(expected, "sequences_scores", None) is not None:
        assert_scores_close(actual.sequences_scores[same], expected.sequences_scores[same])
    if getattr(expected, "beam_indices", None) is not None and bool(same.all()):
        assert torch.equal(actual.beam_indices, expected.beam_indices)
    for field in ("scores", "logits"):
        want, got = getattr(expected, field), getattr(actual, field)
        assert (want is None) == (got is None), field
        if want is not None and bool(same.all()):
            assert len(got) == len(want), field
            for step_got, step_want in zip(got, want, strict=True):
                assert_scores_close(step_got, step_want)


def assert_case_equivalent(expected, actual, name: str, kwargs: dict, seed: int) -> None:
    """:func:`assert_equivalent_output` for a grid case (re-run from its name, kwargs and seed)."""

    def rerun(processors):
        model, inputs = case_inputs(name, kwargs, seed)
        torch.manual_seed(seed)
        return model.generate(**inputs, logits_processor=processors)

    assert_equivalent_output(expected, actual, rerun, kwargs)


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[rows]`` whether each returned sequence is the same (sequences of different widths compare as padded)."""
    width = max(a.shape[1], b.shape[1])
    a = torch.nn.functional.pad(a, (0, width - a.shape[1]), value=-7)
    b = torch.nn.functional.pad(b, (0, width - b.shape[1]), value=-7)
    return (a == b).all(dim=1)


class _Recorder:
    """A logits processor (appended after transformers' own) that keeps each step's tokens and final scores."""

    def __init__(self):
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append((input_ids.clone(), scores.clone()))
        return scores


def reference_margin(expected, actual, rerun: Callable, kwargs: dict) -> tuple[float, float, torch.dtype]:
    """transformers' smallest margin at the steps up to where our sequences part from its own: ``(margin,
    magnitude of the scores compared, their dtype)``; margin inf when the mismatch is not of a kind a near tie
    explains.

    Greedy: the top-2 gap of the processed scores of the first differing row at the first differing step.
    Beam search: over the examples whose n-best differ, the smallest gap between neighbouring candidates (running
    score + processed log-prob, transformers' ranking) among the best C + 1 at each step up to the first where
    the n-best prefixes part, and between the finished hypotheses' scores. Sampling: a draw cannot be replayed,
    so no mismatch is accepted.
    """
    from transformers import LogitsProcessorList

    if kwargs.get("do_sample"):
        return float("inf"), 0.0, torch.float32
    recorder = _Recorder()
    again = rerun(LogitsProcessorList([recorder]))
    assert torch.equal(again.sequences, expected.sequences), "the recording run must reproduce transformers' output"
    start = recorder.steps[0][0].shape[1]
    beams = kwargs.get("num_beams", 1)
    if beams == 1:
        same = _same_rows(expected.sequences, actual.sequences)
        row = int((~same).nonzero()[0])
        width = min(expected.sequences.shape[1], actual.sequences.shape[1])
        step = int((expected.sequences[row, :width] != actual.sequences[row, :width]).nonzero()[0]) - start
        scores = recorder.steps[step][1][row : row + 1]
        return float(top2_margin(scores)[0]), float(scores.max()), scores.dtype
    return (*_beam_margin(recorder.steps, expected, actual, beams, start, kwargs), recorder.steps[0][1].dtype)


def _beam_margin(steps, expected, actual, beams: int, start: int, kwargs: dict) -> tuple[float, float]:
    returned = kwargs.get("num_return_sequences", 1)
    eos = kwargs.get("eos_token_id")
    candidates = max(2, 1 + (len(eos) if isinstance(eos, list) else 1)) * beams
    running = _running_scores(steps, beams)
    margin, magnitude = float("inf"), 0.0
    for example in range(expected.sequences.shape[0] // returned):
        rows = slice(example * returned, (example + 1) * returned)
        want, got = expected.sequences[rows], actual.sequences[rows]
        if _same_rows(want, got).all():
            continue
        last = _parting_step(want, got, start)
        for step in range(min(last + 1, len(steps))):
            totals = (running[step][example][:, None] + steps[step][1].double()[example * beams:][:beams]).flatten()
            margin = min(margin, smallest_gap(totals, candidates + 1))
            magnitude = max(magnitude, float(totals.max().abs()))
        finished = expected.sequences_scores[rows].double() if expected.sequences_scores is not None else None
        if finished is not None:
            margin = min(margin, smallest_gap(finished, returned))
            magnitude = max(magnitude, float(finished.abs().max()))
    return margin, magnitude


def _parting_step(want: torch.Tensor, got: torch.Tensor, start: int) -> int:
    """The first generated position at which the multisets of the two n-bests' prefixes differ."""
    width = min(want.shape[1], got.shape[1])
    for end in range(start + 1, width + 1):
        if sorted(map(tuple, want[:, :end].tolist())) != sorted(map(tuple, got[:, :end].tolist())):
            return end - 1 - start
    return width - start


def _running_scores(steps, beams: int) -> list[torch.Tensor]:
    """Each step's running beam scores ``[B, K]``, rebuilt as transformers accumulates them: a beam's score is its
    parent's plus the parent's processed log-prob of the beam's last token (the parent: the best-scored beam of
    the previous step whose tokens are this beam's prefix)."""
    ids, _ = steps[0]
    batch = ids.shape[0] // beams
    first = torch.full((batch, beams), -1e9, dtype=torch.float32)
    first[:, 0] = 0.0
    running = [first]
    for (prev_ids, prev_scores), (ids, _) in zip(steps, steps[1:], strict=False):
        score = torch.full((batch, beams), float("-inf"), dtype=torch.float32)
        for row in range(ids.shape[0]):
            example = row // beams
            for parent in range(example * beams, (example + 1) * beams):
                if torch.equal(prev_ids[parent], ids[row, :-1]):
                    total = running[-1][example, parent % beams] + prev_scores[parent, ids[row, -1]]
                    score[example, row % beams] = torch.maximum(score[example, row % beams], total)
        running.append(score)
    return [r.double() for r in running]
