"""The beam and greedy search steps' bookkeeping in one C++ call (``strategies/native_search.py``) against the
Python steps.

The reference is the same search with the native bookkeeping turned off (``BeamSearch`` and ``SamplingSearch``
then run their Python steps): the same shapes, the same float32 operations in the same order, so results are
compared bit for bit, on random searches with ties, masked tokens, several end tokens, every early-stopping mode and
length penalties of both signs. The Python steps are checked against transformers by the parity tests, which now run
the native bookkeeping wherever it applies, so they check it against transformers too.
"""

from __future__ import annotations

import random

import pytest
import torch
from fakes import PrefixModel

from beamsearch import search
from beamsearch.errors import SearchError
from beamsearch.extension import extension_reason
from beamsearch.strategies import beam, native_search, sampling

pytestmark = pytest.mark.skipif(extension_reason() is not None, reason="the native extension is not built here")


class TiedModel(PrefixModel):
    """Prefix-hashed logits rounded to quarters (many exact ties among the totals), some tokens masked at -inf."""

    def __init__(self, vocab_size: int, seed: int, masked: int = 0):
        super().__init__(vocab_size, seed=seed, sharpness=1.5)
        self.table = (self.table * 4).round() / 4
        if masked:
            self.table[:, vocab_size - masked:] = float("-inf")


def count_calls(monkeypatch) -> dict[str, list[int]]:
    """The native bookkeeping calls of beam search ("beam") and greedy search ("greedy"), one entry per call: the
    rows of its last argument (beam: the examples; greedy: the rows)."""
    calls: dict[str, list[int]] = {"beam": [], "greedy": []}
    for module, name, kind in ((beam, "native_beam_update", "beam"), (sampling, "native_greedy_update", "greedy")):
        real = getattr(native_search, name)

        def counted(*args, real=real, kind=kind):
            calls[kind].append(args[-1].shape[0])
            return real(*args)

        monkeypatch.setattr(module, name, counted)
    return calls


def python_steps(monkeypatch):
    monkeypatch.setattr(beam, "native_beam_reason", lambda search_: "turned off by the test")
    monkeypatch.setattr(sampling, "native_greedy_reason", lambda search_: "turned off by the test")


def both_ways(monkeypatch, run, kind: str):
    """``run()`` with the native bookkeeping (checked to run), then with the Python steps: both results, and the
    native calls of ``kind`` ("beam" or "greedy")."""
    calls = count_calls(monkeypatch)
    native = run()
    assert calls[kind], "the native bookkeeping did not run"
    monkeypatch.undo()
    python_steps(monkeypatch)
    python_calls = count_calls(monkeypatch)
    python = run()
    assert not python_calls[kind]
    monkeypatch.undo()
    return native, python, calls[kind]


def assert_identical(got, want):
    for field in ("sequences", "sequences_scores", "token_log_probs", "beam_indices", "finish_reason", "lengths",
                  "sum_log_probs"):
        a, b = getattr(got, field), getattr(want, field)
        if a is None or b is None:  # greedy results have no beam indices
            assert a is None and b is None, field
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), \
            field


def random_case(seed: int) -> tuple[PrefixModel, torch.Tensor, dict]:
    rng = random.Random(seed)
    vocab = rng.choice((6, 9, 23, 50, 3000))  # 3000: top_totals chooses from chunk maxima
    model = TiedModel(vocab, seed, masked=rng.choice((0, 0, 2)))
    beams = rng.randint(2, 6)
    eos = rng.choice(((), (1,), (1, 4), (2,)))
    options = dict(num_beams=beams, num_return_sequences=rng.randint(1, beams), max_new_tokens=rng.randint(1, 9),
                   length_penalty=rng.choice((1.0, 0.0, -0.5, 0.7, 2.0)),
                   early_stopping=rng.choice((False, True, "never")), pad_token_id=0)
    if eos:
        options["eos_token_id"] = list(eos)
    batch, prompt = rng.randint(1, 6), rng.randint(1, 3)
    input_ids = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(seed))
    if eos and rng.random() < 0.3:
        options["min_new_tokens"] = rng.randint(1, 3)
    if rng.random() < 0.3:
        options["no_repeat_ngram_size"] = 2
    return model, input_ids, options


@pytest.mark.parametrize("seed", range(60))
def test_native_bookkeeping_equals_the_python_step_bit_for_bit(monkeypatch, seed):
    model, input_ids, options = random_case(seed)
    got, want, _ = both_ways(monkeypatch, lambda: search(model, input_ids, **options), "beam")
    assert_identical(got, want)


def test_finished_examples_leave_the_batch_as_in_python(monkeypatch):
    """Examples of very different lengths: they finish at different steps and leave, on both paths alike."""
    model = TiedModel(12, seed=3)
    input_ids = torch.randint(3, 12, (8, 2), generator=torch.Generator().manual_seed(1))
    options = dict(num_beams=4, num_return_sequences=2, max_new_tokens=12, eos_token_id=[1, 2], pad_token_id=0)
    got, want, calls = both_ways(monkeypatch, lambda: search(model, input_ids, **options), "beam")
    assert calls[0] == 8 and calls[-1] < 8, calls  # examples left the batch
    assert_identical(got, want)


def test_early_stopping_is_read_as_the_python_step_reads_it(monkeypatch):
    """The Python step tests ``early_stopping is True``: an integer 1 (which option validation lets through, as it
    equals True) searches as False there, and so natively (on a model where True and False give other results)."""
    model = TiedModel(12, seed=0)
    input_ids = torch.randint(3, 12, (4, 1), generator=torch.Generator().manual_seed(0))
    runs = []
    for value in (1, False, True):
        options = dict(num_beams=3, max_new_tokens=8, eos_token_id=[1, 2], pad_token_id=0, early_stopping=value)
        got, want, _ = both_ways(monkeypatch, lambda options=options: search(model, input_ids, **options), "beam")
        assert_identical(got, want)
        runs.append(got)
    assert_identical(runs[0], runs[1])
    assert not torch.equal(runs[1].sequences_scores, runs[2].sequences_scores)


def test_a_nan_is_named_as_in_python(monkeypatch):
    def step(tokens, state):
        logits = torch.zeros(tokens.shape[0], 5)
        if tokens.shape[1] == 3:
            logits[-1, 2] = float("nan")
        return logits, state

    input_ids = torch.ones(2, 1, dtype=torch.long)
    with pytest.raises(SearchError) as native_error:
        search(step, input_ids, num_beams=2, max_new_tokens=4, eos_token_id=4)
    python_steps(monkeypatch)
    with pytest.raises(SearchError) as python_error:
        search(step, input_ids, num_beams=2, max_new_tokens=4, eos_token_id=4)
    assert str(native_error.value) == str(python_error.value)


@pytest.mark.parametrize("beams, options, why", [
    (3, {"do_sample": True}, "beam sampling"),
    (3, {"sequence_scorer": lambda tokens, log_probs, lengths: log_probs.sum(dim=-1)}, "a sequence scorer"),
    (3, {"unique": True}, "unique outputs"),
    (3, {"output_scores": True}, "per-step scores"),
    (3, {"max_time": 100.0}, "a stopping criterion other than"),
    (3, {"stopping_criteria": [lambda ids, scores: ids[:, -1] == 3]}, "finished examples kept in the batch"),
    (3, {"trace": True}, "a trace"),
    (1, {"do_sample": True}, "sampling"),
    (1, {"output_scores": True}, "per-step scores"),
    (1, {"max_time": 100.0}, "a stopping criterion other than"),
    (1, {"stopping_criteria": [lambda ids, scores: ids[:, -1] == 3]}, "finished examples kept in the batch"),
])
def test_what_it_does_not_run_is_left_to_python_with_a_reason(monkeypatch, beams, options, why):
    module, kind = (beam, "beam") if beams > 1 else (sampling, "greedy")
    name = f"native_{kind}_reason"
    reasons: list[str | None] = []
    real = getattr(native_search, name)

    def recorded(search_):
        reasons.append(real(search_))
        return reasons[-1]

    monkeypatch.setattr(module, name, recorded)
    calls = count_calls(monkeypatch)
    model = TiedModel(9, seed=2)
    search(model, torch.full((2, 1), 3), num_beams=beams, max_new_tokens=4, eos_token_id=1, pad_token_id=0, **options)
    assert not calls[kind]
    assert reasons and why in reasons[0], reasons


@pytest.mark.parametrize("variable", ["BEAMSEARCH_NATIVE", "BEAMSEARCH_NATIVE_SEARCH"])
def test_the_environment_turns_it_off(monkeypatch, variable):
    monkeypatch.setenv(variable, "0")
    calls = count_calls(monkeypatch)
    for beams in (1, 3):
        search(TiedModel(9, seed=2), torch.full((2, 1), 3), num_beams=beams, max_new_tokens=4, eos_token_id=1)
    assert not calls["beam"] and not calls["greedy"]
    monkeypatch.delenv(variable)
    for beams in (1, 3):
        search(TiedModel(9, seed=2), torch.full((2, 1), 3), num_beams=beams, max_new_tokens=4, eos_token_id=1)
    assert calls["beam"] and calls["greedy"]


def test_other_beam_rules_keep_their_own_step(monkeypatch):
    """CTranslate2's and OpenNMT's beam searches subclass BeamSearch with rules of their own: never native."""
    calls = count_calls(monkeypatch)
    for semantics in ("ct2", "onmt", "t2t"):
        search(TiedModel(9, seed=2), torch.full((2, 1), 3), num_beams=3, max_new_tokens=4, eos_token_id=1,
               semantics=semantics, source_lengths=torch.tensor([5, 6]))
    assert not calls["beam"]


def test_the_main_job_is_unchanged(monkeypatch):
    """The embedded model on 64 test words, greedy and at beam 5 (what `beamsearch decode` runs), both paths bit for
    bit."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from beamsearch.adapters.hf import search_model
    from beamsearch.cli.decoding import EMBEDDED_MODEL
    from beamsearch.cli.evaluate import CMUDICT_TEST
    from beamsearch.evaluation import read_references

    model = AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval()
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    words = [source.lower() for source, _ in read_references(CMUDICT_TEST)[:64]]
    inputs = tokenizer(words, return_tensors="pt", padding=True)
    for beams, kind in ((1, "greedy"), (5, "beam")):
        got, want, _ = both_ways(monkeypatch, lambda beams=beams: search_model(model, **inputs, num_beams=beams), kind)
        assert_identical(got, want)


# ---------------------------------------------------------------------------------------------------- greedy search


@pytest.mark.parametrize("seed", range(30))
def test_native_greedy_equals_the_python_step_bit_for_bit(monkeypatch, seed):
    model, input_ids, options = random_case(seed)
    options.update(num_beams=1, num_return_sequences=1)
    for name in ("early_stopping", "length_penalty"):
        options.pop(name)
    if seed % 3 == 0:  # a pad token that is also the end token, as many decoder-only models have it
        options["pad_token_id"] = options.get("eos_token_id", [0])[0]
    got, want, _ = both_ways(monkeypatch, lambda: search(model, input_ids, **options), "greedy")
    assert_identical(got, want)


def test_greedy_rows_with_every_token_masked_and_nan(monkeypatch):
    """A row with every token masked takes token 0 at log-prob -inf, as transformers' argmax; a NaN is named."""
    def masked(tokens, state):
        logits = torch.zeros(tokens.shape[0], 6)
        logits[0] = float("-inf")
        return logits, state

    def with_nan(tokens, state):
        logits = torch.zeros(tokens.shape[0], 6)
        if tokens.shape[1] == 2:
            logits[1, 3] = float("nan")
        return logits, state

    input_ids = torch.full((2, 1), 2)
    got = search(masked, input_ids, max_new_tokens=3, eos_token_id=5, pad_token_id=0)
    with pytest.raises(SearchError) as native_error:
        search(with_nan, input_ids, max_new_tokens=3, eos_token_id=5, pad_token_id=0)
    python_steps(monkeypatch)
    assert_identical(got, search(masked, input_ids, max_new_tokens=3, eos_token_id=5, pad_token_id=0))
    with pytest.raises(SearchError) as python_error:
        search(with_nan, input_ids, max_new_tokens=3, eos_token_id=5, pad_token_id=0)
    assert str(native_error.value) == str(python_error.value)
