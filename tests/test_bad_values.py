"""Bad values: non-finite options, NaN / +-inf / huge logits and fully masked rows, more beams than hypotheses.

The rule under test: a search either returns scores without NaN, or raises ValueError (SearchError for what the
model returned, naming the step and the example); never a raw torch error, never NaN. Where transformers gives a
defined result for a fully masked row, the search gives the same (checked against ``model.generate`` below).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import beamsearch
from beamsearch import SearchError, SearchOptions

NAN, INF = float("nan"), float("inf")
# every float option of SearchOptions, written out (the test below checks that no float field is missing)
FLOAT_OPTIONS = (
    "max_time", "length_penalty", "diversity_penalty", "repetition_penalty", "encoder_repetition_penalty",
    "temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "coverage_beta", "patience", "ratio",
    "max_length_ratio", "max_len_a",
)


# ---------------------------------------------------------------------------------------------- non-finite options


def test_every_float_option_is_covered():
    floats = {f.name for f in dataclasses.fields(SearchOptions) if "float" in str(f.type)}
    assert floats == set(FLOAT_OPTIONS)


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("name", FLOAT_OPTIONS)
def test_non_finite_float_options_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number, got {value}$"):
        SearchOptions.create(**{name: value})


def test_non_finite_options_are_refused_by_search_before_any_step():
    calls = []

    def step(tokens, state):
        calls.append(1)
        return torch.zeros(tokens.shape[0], 5), state

    with pytest.raises(ValueError, match="^length_penalty must be a finite number, got nan$"):
        beamsearch.search(step, torch.ones(1, 1, dtype=torch.long), num_beams=2, length_penalty=NAN)
    with pytest.raises(ValueError, match="prefix_bias_beta"):
        beamsearch.search(step, torch.ones(1, 1, dtype=torch.long), target_prefix=[[2]], prefix_bias_beta=NAN)
    assert calls == []


def test_finite_values_keep_their_own_messages():
    with pytest.raises(ValueError, match=r"^temperature must be > 0, got -1.0$"):
        SearchOptions.create(temperature=-1.0)
    SearchOptions.create(length_penalty=-1e30, max_time=1e300)  # huge but finite: allowed


# ---------------------------------------------------------------------------------------------- NaN at a known place


@pytest.mark.parametrize("normalise", [torch.softmax, torch.log_softmax])
@pytest.mark.parametrize("vocab", [2, 5, 130, 4099])  # short rows and rows longer than a vector or a chunk
def test_a_row_with_nan_inf_or_nothing_finite_normalises_to_nan_throughout(normalise, vocab):
    """The premise of the cheap check (strategies/score_checks.py): one entry of a normalised row tells."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator) * 30
    position = int(torch.randint(vocab, (1,), generator=generator))
    logits[1, position] = NAN
    logits[2, position] = INF
    logits[3] = -INF
    logits[4, position] = -INF  # one masked token: still a distribution
    logits[5] = 3e38  # huge but finite
    out = normalise(logits, dim=-1)
    bad = torch.tensor([False, True, True, True, False, False])
    assert torch.equal(torch.isnan(out).all(dim=-1), bad)
    assert not torch.isnan(out[~bad]).any()

VOCAB = 7
EOS = 6  # an end token the table below makes unlikely, so that the searches run to the corrupted step
MODES = {
    "greedy": {},
    "sample": {"do_sample": True, "num_return_sequences": 2},
    "beam": {"num_beams": 3},
    "beam sample": {"num_beams": 3, "do_sample": True},
    "group": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
    "constrained": {"num_beams": 3, "force_words_ids": [[4]]},
    "onmt": {"num_beams": 3, "semantics": "onmt", "max_length_ratio": 0, "eos_token_id": EOS},
    "t2t": {"num_beams": 3, "semantics": "t2t", "eos_token_id": EOS},
    "ct2": {"num_beams": 3, "semantics": "ct2", "eos_token_id": EOS},
}


def corrupting_step(bad_step: int, bad_example: int, value: float, whole_row: bool = False, device: str = "cpu"):
    """A step over a fixed random table whose rows of ``bad_example`` get ``value`` at step ``bad_step``.

    The state holds each row's example index (the search reorders and compacts it with the rows); the table lives
    on ``device`` (tests/test_cuda.py runs the same cases on a GPU)."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    table[:, EOS] = -20.0
    table = table.to(device)

    def step(tokens, state):
        logits = table[tokens[:, -1]]
        if tokens.shape[1] - 1 == bad_step:
            rows = state == bad_example  # [N]
            if whole_row:
                logits[rows] = value
            else:
                logits[rows, 3] = value
        return logits, state

    return step


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("bad_step", "bad_example"), [(0, 0), (2, 1), (4, 2)])  # step 4: the last one
def test_nan_logits_name_the_step_and_the_example(mode, bad_step, bad_example):
    step = corrupting_step(bad_step, bad_example, NAN)
    message = rf"^the model's logits hold NaN at step {bad_step} \(example {bad_example}\)$"
    with pytest.raises(SearchError, match=message):
        beamsearch.search(step, torch.ones(3, 1, dtype=torch.long), torch.arange(3), max_new_tokens=5, **MODES[mode])


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam", "beam sample", "t2t"])
def test_positive_infinity_is_named(mode):
    step = corrupting_step(1, 2, INF)
    with pytest.raises(SearchError, match=r"^the model's logits hold \+inf at step 1 \(example 2\)$"):
        beamsearch.search(step, torch.ones(3, 1, dtype=torch.long), torch.arange(3), max_new_tokens=4, **MODES[mode])


def check_examples_keep_their_index(num_beams: int, device: str = "cpu") -> None:
    """Example 0 ends at step 0 and leaves the batch (remove_finished); example 2's NaN at step 2 is named 2.
    tests/test_cuda.py runs it on a GPU."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(4)).to(device)

    def step(tokens, state):
        logits = table[tokens[:, -1]].clone()
        logits[state == 0, 0] = 50.0  # example 0: EOS, surely
        logits[state != 0, 0] = -50.0
        if tokens.shape[1] == 3:
            logits[state == 2, 1] = NAN
        return logits, state

    rows_seen = []

    def counted(tokens, state):
        rows_seen.append(tokens.shape[0])
        return step(tokens, state)

    with pytest.raises(SearchError, match=r"^the model's logits hold NaN at step 2 \(example 2\)$"):
        beamsearch.search(counted, torch.ones(3, 1, dtype=torch.long, device=device),
                          torch.arange(3, device=device), max_new_tokens=5, eos_token_id=0, num_beams=num_beams)
    assert rows_seen[0] == 3 * num_beams and rows_seen[-1] == 2 * num_beams  # example 0 had left


@pytest.mark.parametrize("num_beams", [1, 3])
def test_examples_keep_their_index_after_others_left_the_batch(num_beams):
    check_examples_keep_their_index(num_beams)


def test_nan_in_a_finished_greedy_row_changes_nothing():
    """transformers' greedy search pads finished rows whatever their logits hold: no error, the same result."""
    def step(tokens, state, nan=False):
        logits = torch.full((tokens.shape[0], VOCAB), -5.0)
        logits[:, 0] = torch.where(state == 0, 5.0, -5.0)  # example 0 ends at once
        logits[:, 2] = 0.0
        if nan and tokens.shape[1] > 2:
            logits[state == 0] = NAN
        return logits, state

    clean = beamsearch.search(step, torch.ones(2, 1, dtype=torch.long), torch.arange(2), max_new_tokens=4,
                              eos_token_id=0, remove_finished=False)
    dirty = beamsearch.search(lambda t, s: step(t, s, nan=True), torch.ones(2, 1, dtype=torch.long), torch.arange(2),
                              max_new_tokens=4, eos_token_id=0, remove_finished=False)
    assert torch.equal(clean.sequences, dirty.sequences)
    assert torch.equal(clean.sequences_scores, dirty.sequences_scores)


def test_sampling_a_fully_masked_row_is_a_search_error_not_a_torch_error():
    step = corrupting_step(1, 0, -INF, whole_row=True)
    for options in (MODES["sample"], MODES["beam sample"]):
        message = r"^the model's logits are -inf for every token .* at step 1 \(example 0\)$"
        with pytest.raises(SearchError, match=message):
            beamsearch.search(step, torch.ones(2, 1, dtype=torch.long), torch.arange(2), max_new_tokens=3, **options)


class MaskEverything:
    """A logits processor that sets every score of the rows ``rows`` to -inf at step ``at``."""

    def __init__(self, at: int, rows: list[int], prompt_length: int):
        self.at, self.rows, self.prompt_length = at, rows, prompt_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_length == self.at:
            scores = scores.clone()
            scores[self.rows] = -INF
        return scores


def test_processed_scores_that_mask_everything_are_named_when_sampling():
    step = corrupting_step(99, 0, 0.0)
    with pytest.raises(SearchError, match=r"^the processed scores are -inf for every token .* at step 2 \(example 1\)"):
        beamsearch.search(step, torch.ones(2, 1, dtype=torch.long), torch.arange(2), max_new_tokens=4, do_sample=True,
                          logits_processor=[MaskEverything(2, [1], 1)])


def test_greedy_fully_masked_row_takes_token_zero_with_log_prob_minus_infinity():
    step = corrupting_step(99, 0, 0.0)
    result = beamsearch.search(step, torch.ones(2, 1, dtype=torch.long), torch.arange(2), max_new_tokens=3,
                               logits_processor=[MaskEverything(1, [0], 1)])
    assert int(result.sequences[0, 0, 2]) == 0
    assert result.token_log_probs[0, 0].tolist()[1] == -INF
    assert math.isinf(float(result.sequences_scores[0, 0])) and float(result.sequences_scores[1, 0]) > -INF
    assert not result.token_log_probs.isnan().any()


# ---------------------------------------------------------------------------------------------- fully masked rows
# against transformers


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers")
    from tiny_hf import tiny_model

    return tiny_model("gpt2")


def hf_processor(at: int, rows: list[int], prompt_length: int):
    from transformers import LogitsProcessor

    class Masking(MaskEverything, LogitsProcessor):
        pass

    return Masking(at, rows, prompt_length)


@pytest.mark.parametrize(("options", "rows"), [
    ({}, [1]),  # greedy: argmax takes token 0
    ({"num_beams": 3}, [0, 1, 2]),  # every beam of example 0: it stops, placeholders scored -1e9
    ({"num_beams": 3}, [4]),  # one beam of example 1: the others fill in
    ({"num_beams": 3, "num_return_sequences": 3}, [0, 1, 2]),
    ({"num_beams": 3, "do_sample": True, "top_k": 0}, [1]),  # beam sampling, one beam masked
])
def test_fully_masked_rows_give_what_transformers_gives(gpt2, options, rows):
    ids = torch.tensor([[0, 5, 7], [0, 9, 3]])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, pad_token_id=1, output_scores=True,
                  return_dict_in_generate=True, **options)
    outputs = []
    for generate in (gpt2.generate, lambda *a, **k: beamsearch.generate(gpt2, *a, **k)):
        torch.manual_seed(0)
        outputs.append(generate(ids, logits_processor=[hf_processor(2, rows, 3)], **kwargs))
    theirs, ours = outputs
    assert torch.equal(ours.sequences, theirs.sequences)
    if "num_beams" in options:
        assert torch.allclose(ours.sequences_scores, theirs.sequences_scores, rtol=1e-4)
        assert not ours.sequences_scores.isnan().any()


@pytest.mark.parametrize("options", [{"do_sample": True, "top_k": 0}, {"num_beams": 3, "do_sample": True, "top_k": 0}])
def test_where_transformers_fails_on_a_fully_masked_example_we_raise_a_search_error(gpt2, options):
    ids = torch.tensor([[0, 5, 7], [0, 9, 3]])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, pad_token_id=1, **options)
    rows = [0, 1, 2] if "num_beams" in options else [0]
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        gpt2.generate(ids, logits_processor=[hf_processor(2, rows, 3)], **kwargs)
    with pytest.raises(SearchError, match=r"at step 2 \(example 0\)$"):
        beamsearch.generate(gpt2, ids, logits_processor=[hf_processor(2, rows, 3)], **kwargs)


# ---------------------------------------------------------------------------------------------- more beams than tokens


def test_more_beams_than_hypotheses_is_refused_at_the_first_step():
    calls = []

    def step(tokens, state):
        calls.append(tokens.shape[1])
        return torch.randn(tokens.shape[0], 4, generator=torch.Generator().manual_seed(len(calls))), state

    message = r"^num_beams \(5\) is larger than the vocabulary size \(4\), and only 4 distinct hypotheses .*"
    for options in ({}, {"do_sample": True}, {"semantics": "ct2"}):
        calls.clear()
        with pytest.raises(SearchError, match=message):
            beamsearch.search(step, torch.ones(2, 1, dtype=torch.long), num_beams=5, num_return_sequences=5,
                              max_new_tokens=1, eos_token_id=0, **options)
        assert calls == [1]


def test_more_beams_than_tokens_is_allowed_while_enough_hypotheses_exist():
    """Five beams over four tokens, two new tokens: 16 hypotheses, five returned, none a placeholder."""
    table = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    result = beamsearch.search(lambda t, s: (table[t[:, -1]], s), torch.ones(1, 1, dtype=torch.long), num_beams=5,
                               num_return_sequences=5, max_new_tokens=2)
    assert bool((result.sequences_scores > -100).all())


def test_transformers_returns_placeholders_with_more_beams_than_tokens(gpt2):
    """The case refused above: transformers returns a hypothesis scored -1e9 (41 beams, 40 tokens, one step)."""
    ids = torch.tensor([[0, 5, 7]])
    out = gpt2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, num_beams=41,
                        num_return_sequences=41, pad_token_id=1, output_scores=True, return_dict_in_generate=True)
    assert float(out.sequences_scores.min()) == -1e9
    with pytest.raises(SearchError, match=r"num_beams \(41\) is larger than the vocabulary size \(40\)"):
        beamsearch.generate(gpt2, ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, num_beams=41,
                            num_return_sequences=41, pad_token_id=1)


# ---------------------------------------------------------------------------------------------- property


@st.composite
def search_options(draw):
    mode = draw(st.sampled_from(["greedy", "sample", "beam", "beam sample"]))
    options = {"max_new_tokens": draw(st.integers(1, 4))}
    if mode in ("beam", "beam sample"):
        options["num_beams"] = draw(st.integers(2, 4))
        options["num_return_sequences"] = draw(st.integers(1, options["num_beams"]))
        options["early_stopping"] = draw(st.sampled_from([True, False, "never"]))
        options["length_penalty"] = draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]))
    if mode in ("sample", "beam sample"):
        options["do_sample"] = True
        options["temperature"] = draw(st.sampled_from([0.3, 1.0, 2.0]))
        options["top_k"] = draw(st.sampled_from([0, 1, 2, 50]))
        options["top_p"] = draw(st.sampled_from([1.0, 0.9, 0.3]))
        options["min_p"] = draw(st.sampled_from([None, 0.1]))
        options["typical_p"] = draw(st.sampled_from([1.0, 0.8]))
        options["epsilon_cutoff"] = draw(st.sampled_from([0.0, 0.05]))
        if mode == "sample":
            options["num_return_sequences"] = draw(st.integers(1, 3))
    options["eos_token_id"] = draw(st.sampled_from([None, 0]))
    if options["eos_token_id"] is not None:
        options["min_new_tokens"] = draw(st.integers(0, 2))
    options["repetition_penalty"] = draw(st.sampled_from([1.0, 1.3, 0.7]))
    options["no_repeat_ngram_size"] = draw(st.sampled_from([0, 2]))
    options["suppress_tokens"] = draw(st.sampled_from([None, [2]]))
    options["remove_invalid_values"] = draw(st.booleans())
    options["renormalize_logits"] = draw(st.booleans())
    options["output_scores"] = draw(st.booleans())
    return options


# what a step may put into a row: (entry or whole row, value)
CORRUPTIONS = st.tuples(
    st.integers(0, 3),  # step
    st.integers(0, 63),  # row (modulo the rows)
    st.integers(0, 5),  # token (modulo the vocabulary)
    st.sampled_from(["nan", "inf", "-inf", "-inf row", "huge", "max"]),
)


def build_step(seed: int, vocab: int, scale: float, corruptions):
    def step(tokens, state):
        t = tokens.shape[1] - 2
        generator = torch.Generator().manual_seed(seed * 31 + t)
        logits = torch.randn(tokens.shape[0], vocab, generator=generator) * scale
        for at, row, token, kind in corruptions:
            if at != t:
                continue
            row, token = row % tokens.shape[0], token % vocab
            if kind == "-inf row":
                logits[row] = -INF
            else:
                value = {"nan": NAN, "inf": INF, "-inf": -INF, "huge": -1e30, "max": 3e38}[kind]
                logits[row, token] = value
        return logits, state

    return step


@settings(max_examples=200, deadline=None)
@given(
    options=search_options(),
    seed=st.integers(0, 1000),
    vocab=st.integers(2, 6),
    batch_size=st.integers(1, 3),
    scale=st.sampled_from([1.0, 5.0, 1e30]),
    corruptions=st.lists(CORRUPTIONS, max_size=3),
)
def test_scores_are_never_nan(options, seed, vocab, batch_size, scale, corruptions):
    """Any options, any logits: a result without NaN scores, or a ValueError; never a torch error.

    With clean logits (finite, moderate) an error can only be a row with every token masked."""
    step = build_step(seed, vocab, scale, corruptions)
    input_ids = torch.randint(1, vocab, (batch_size, 2), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    try:
        result = beamsearch.search(step, input_ids, **options)
    except ValueError as error:
        event(f"{type(error).__name__}: {str(error).split(' at step')[0][:40]}")
        if not corruptions:  # then only masking can leave a row without a distribution, not the model
            assert isinstance(error, SearchError) and "model's logits" not in str(error), str(error)
        return
    event("a result" + (" (logits corrupted)" if corruptions else ""))
    assert not result.sequences_scores.isnan().any()
    assert not result.sum_log_probs.isnan().any()
    generated = result.lengths - result.prompt_length  # [B, n]
    positions = torch.arange(result.token_log_probs.shape[-1])
    assert not result.token_log_probs[positions < generated[:, :, None]].isnan().any()


def test_max_rows_names_the_example_by_its_index_in_the_whole_batch():
    """Sub-batches of 2 examples: NaN in example 3 (the second of the second sub-batch) is named 3, not 1."""
    from tiny_hf import tiny_model

    model = tiny_model("gpt2")
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13], [30, 6, 7], [14, 15, 16]])

    def poison(input_ids, scores):  # the prompt starting with 30 marks example 3, wherever its row is
        return scores.masked_fill((input_ids[:, :1] == 30), float("nan"))

    with pytest.raises(SearchError, match=r"at step 0 \(example 3\)$"):
        beamsearch.generate(model, input_ids=ids, max_new_tokens=3, num_beams=2, max_rows=4,
                            logits_processor=[poison])
    with pytest.raises(SearchError, match=r"at step 0 \(example 3\)$"):
        beamsearch.generate(model, input_ids=ids, max_new_tokens=3, num_beams=2, logits_processor=[poison])


def test_beam_sampling_names_a_nan_beside_very_negative_live_scores():
    """Found by test_scores_are_never_nan: logits of 1e30 leave live beam scores far below MASK; a NaN logit at
    the next step must still be named, not sampled past into a NaN-scored result."""
    step = build_step(0, 2, 1e30, [(1, 0, 0, "nan")])
    input_ids = torch.randint(1, 2, (3, 2), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    with pytest.raises(SearchError, match="the model's logits hold NaN at step 1"):
        beamsearch.search(step, input_ids, max_new_tokens=2, num_beams=2, do_sample=True, temperature=0.3,
                          early_stopping=True, length_penalty=-1.0, eos_token_id=0)
