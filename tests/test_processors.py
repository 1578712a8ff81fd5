"""Processors: exact parity with the transformers classes, hand-made cases, argument checks, pipeline order.

Shape legend: N rows, V vocabulary, t tokens so far.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from beamsearch import processors as bp
from beamsearch.options import SearchOptions

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("transformers.generation.logits_process")

INF = math.inf

# (rows N, vocabulary V, tokens so far t); token ids are drawn from a small alphabet so n-grams repeat.
SHAPES = [(1, 5, 1), (3, 7, 4), (4, 50, 9), (6, 12, 12)]
SEEDS = [0, 1, 2]
KINDS = ["normal", "ties", "neg_inf", "wide"]


def make_case(seed: int, shape: tuple[int, int, int], kind: str, dtype=torch.float32):
    """Random (input_ids [N, t], scores [N, V]) with rows of different histories."""
    rows, vocab, length = shape
    gen = torch.Generator().manual_seed(seed * 1000 + rows * 100 + vocab + length)
    input_ids = torch.randint(0, min(vocab, 5), (rows, length), generator=gen)
    if kind == "ties":  # few distinct values: ties everywhere, including at every cutoff
        scores = torch.randint(-3, 3, (rows, vocab), generator=gen).float()
    else:
        scores = torch.randn(rows, vocab, generator=gen) * (
            60 if kind == "wide" else 3
        )  # wide: probs underflow
        if kind == "neg_inf":  # masked entries, as left by earlier processors
            scores = scores.masked_fill(torch.rand(rows, vocab, generator=gen) < 0.3, -INF)
            scores[:, 0] = scores[:, 0].clamp(min=-5.0)  # keep one finite entry per row
    return input_ids, scores.to(dtype)


CASES = [(seed, shape, kind) for seed in SEEDS for shape in SHAPES for kind in KINDS]


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bit-for-bit equality (nan where nan), same dtype and shape: each processor runs the same elementwise and
    per-row operations as transformers' on the same tensor (the design that makes ``exact_parity`` bitwise)."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def compare(ours, theirs, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Apply both processors; check equal outputs and untouched inputs. Returns ours."""
    ids_before, scores_before = input_ids.clone(), scores.clone()
    expected = theirs(input_ids.clone(), scores.clone())
    got = ours(input_ids, scores)
    assert torch.equal(input_ids, ids_before)
    assert_same(scores, scores_before)
    assert_same(got, expected)
    return got


def compare_on_cases(make_ours, make_theirs, kinds=KINDS) -> None:
    """Compare ``make_ours(shape)`` and ``make_theirs(shape)`` on every random case."""
    for seed, shape, kind in CASES:
        if kind in kinds:
            input_ids, scores = make_case(seed, shape, kind)
            compare(make_ours(shape), make_theirs(shape), input_ids, scores)


# --- parity, one test per processor family -----------------------------------------------------


@pytest.mark.parametrize("min_length", [0, 3, 6, 100])
@pytest.mark.parametrize("eos", [0, [1, 3], [2, 60]])
def test_min_length(min_length, eos):
    compare_on_cases(
        lambda s: bp.MinLengthLogitsProcessor(min_length, eos),
        lambda s: hf.MinLengthLogitsProcessor(min_length, eos),
    )


@pytest.mark.parametrize("min_new", [0, 2, 8])
@pytest.mark.parametrize("eos", [4, [1, 3]])
def test_min_new_tokens(min_new, eos):
    compare_on_cases(
        lambda s: bp.MinNewTokensLengthLogitsProcessor(2, min_new, eos),
        lambda s: hf.MinNewTokensLengthLogitsProcessor(2, min_new, eos),
    )


@pytest.mark.parametrize("n", [1, 2, 3, 4, 13])
def test_no_repeat_ngram(n):
    compare_on_cases(
        lambda s: bp.NoRepeatNGramLogitsProcessor(n), lambda s: hf.NoRepeatNGramLogitsProcessor(n)
    )


@pytest.mark.parametrize("penalty", [0.5, 1.5])
@pytest.mark.parametrize("ignore", [None, 0, 2, "per_row"])
def test_repetition_penalty(penalty, ignore):
    def length(shape):
        rows, _, t = shape
        return (torch.arange(rows) * 2) % (t + 2) if ignore == "per_row" else ignore

    compare_on_cases(
        lambda s: bp.RepetitionPenaltyLogitsProcessor(penalty, length(s)),
        lambda s: hf.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=length(s)),
    )


def test_repetition_penalty_ignores_ids_beyond_vocab():
    input_ids = torch.tensor([[0, 7, 9, 2], [8, 8, 1, 1]])
    scores = torch.randn(2, 6)
    compare(
        bp.RepetitionPenaltyLogitsProcessor(2.0), hf.RepetitionPenaltyLogitsProcessor(2.0), input_ids, scores
    )


BAD_WORDS = [[1], [2, 3], [2, 3], [0, 1, 2], [4, 4], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]]


@pytest.mark.parametrize("eos", [None, 1, [1, 0], [3]])
@pytest.mark.parametrize("words", [BAD_WORDS, [[4]], [[2, 2], [0, 2], [1, 2, 2]]])
def test_bad_words(eos, words):
    compare_on_cases(
        lambda s: bp.NoBadWordsLogitsProcessor(words, eos), lambda s: hf.NoBadWordsLogitsProcessor(words, eos)
    )


def test_bad_words_plus_inf_becomes_nan_as_in_hf():
    input_ids, scores = torch.tensor([[2]]), torch.tensor([[0.0, INF, 1.0, INF, 2.0]])
    got = compare(
        bp.NoBadWordsLogitsProcessor([[1], [2, 3]]),
        hf.NoBadWordsLogitsProcessor([[1], [2, 3]]),
        input_ids,
        scores,
    )
    assert got[0, 1].isnan() and got[0, 3].isnan() and got[0, 4] == 2.0


def test_bad_words_only_eos_is_a_no_op():
    # Hugging Face raises here (its filtered list is empty); banning nothing is the consistent reading.
    scores = torch.randn(2, 5)
    assert torch.equal(
        bp.NoBadWordsLogitsProcessor([[1]], [1, 2])(torch.zeros(2, 3, dtype=torch.long), scores), scores
    )


def test_bad_words_id_beyond_vocab_raises_at_call():
    processor = bp.NoBadWordsLogitsProcessor([[1], [2, 9]])
    with pytest.raises(ValueError, match="bad_words_ids"):
        processor(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 5))


@pytest.mark.parametrize("tokens", [[0, 3, 70], [], [4]])
def test_suppress(tokens):
    compare_on_cases(
        lambda s: bp.SuppressTokensLogitsProcessor(tokens), lambda s: hf.SuppressTokensLogitsProcessor(tokens)
    )


@pytest.mark.parametrize("offset", [0, 1, -1])
def test_begin_suppress(offset):
    compare_on_cases(
        lambda s: bp.SuppressTokensAtBeginLogitsProcessor([0, 2, 99], s[2] + offset),
        lambda s: hf.SuppressTokensAtBeginLogitsProcessor([0, 2, 99], s[2] + offset),
    )


@pytest.mark.parametrize("bos", [0, 3])
def test_forced_bos(bos):
    compare_on_cases(
        lambda s: bp.ForcedBOSTokenLogitsProcessor(bos), lambda s: hf.ForcedBOSTokenLogitsProcessor(bos)
    )


@pytest.mark.parametrize("offset", [1, 2])
@pytest.mark.parametrize("eos", [0, [1, 4]])
def test_forced_eos(offset, eos):
    compare_on_cases(
        lambda s: bp.ForcedEOSTokenLogitsProcessor(s[2] + offset, eos),
        lambda s: hf.ForcedEOSTokenLogitsProcessor(s[2] + offset, eos),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_inf_nan_remove(dtype):
    scores = torch.tensor([[0.5, INF, -INF, math.nan], [-1.0, 2.0, math.nan, INF]], dtype=dtype)
    compare(
        bp.InfNanRemoveLogitsProcessor(),
        hf.InfNanRemoveLogitsProcessor(),
        torch.zeros(2, 1, dtype=torch.long),
        scores,
    )


def test_logit_normalization():
    compare_on_cases(lambda s: bp.LogitNormalization(), lambda s: hf.LogitNormalization())


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(temperature):
    compare_on_cases(
        lambda s: bp.TemperatureLogitsWarper(temperature), lambda s: hf.TemperatureLogitsWarper(temperature)
    )


@pytest.mark.parametrize("top_k", [1, 3, 100])
@pytest.mark.parametrize("keep", [1, 4])
def test_top_k(top_k, keep):
    compare_on_cases(
        lambda s: bp.TopKLogitsWarper(top_k, min_tokens_to_keep=keep),
        lambda s: hf.TopKLogitsWarper(top_k, min_tokens_to_keep=keep),
    )


@pytest.mark.parametrize("top_p", [0.0, 0.3, 0.8, 0.95, 1.0])
@pytest.mark.parametrize("keep", [1, 3])
def test_top_p(top_p, keep):
    compare_on_cases(
        lambda s: bp.TopPLogitsWarper(top_p, min_tokens_to_keep=keep),
        lambda s: hf.TopPLogitsWarper(top_p, min_tokens_to_keep=keep),
    )


@pytest.mark.parametrize("min_p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("keep", [1, 3])
def test_min_p(min_p, keep):
    compare_on_cases(
        lambda s: bp.MinPLogitsWarper(min_p, min_tokens_to_keep=keep),
        lambda s: hf.MinPLogitsWarper(min_p, min_tokens_to_keep=keep),
    )


@pytest.mark.parametrize("mass", [0.2, 0.7, 0.95])
@pytest.mark.parametrize("keep", [1, 3])
def test_typical(mass, keep):
    compare_on_cases(
        lambda s: bp.TypicalLogitsWarper(mass, min_tokens_to_keep=keep),
        lambda s: hf.TypicalLogitsWarper(mass, min_tokens_to_keep=keep),
    )


@pytest.mark.parametrize("epsilon", [1e-3, 0.05, 0.3])
@pytest.mark.parametrize("keep", [1, 3])
def test_epsilon(epsilon, keep):
    compare_on_cases(
        lambda s: bp.EpsilonLogitsWarper(epsilon, min_tokens_to_keep=keep),
        lambda s: hf.EpsilonLogitsWarper(epsilon, min_tokens_to_keep=keep),
    )


@pytest.mark.parametrize("epsilon", [1e-3, 0.05, 0.3])
@pytest.mark.parametrize("keep", [1, 3])
def test_eta(epsilon, keep):
    compare_on_cases(
        lambda s: bp.EtaLogitsWarper(epsilon, min_tokens_to_keep=keep),
        lambda s: hf.EtaLogitsWarper(epsilon, min_tokens_to_keep=keep),
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "pair",
    [
        (lambda: bp.TopPLogitsWarper(0.8), lambda: hf.TopPLogitsWarper(0.8)),
        (lambda: bp.TypicalLogitsWarper(0.7), lambda: hf.TypicalLogitsWarper(0.7)),
        (lambda: bp.EtaLogitsWarper(0.05), lambda: hf.EtaLogitsWarper(0.05)),
        (lambda: bp.MinPLogitsWarper(0.2), lambda: hf.MinPLogitsWarper(0.2)),
        (lambda: bp.RepetitionPenaltyLogitsProcessor(1.3), lambda: hf.RepetitionPenaltyLogitsProcessor(1.3)),
        (lambda: bp.NoBadWordsLogitsProcessor(BAD_WORDS), lambda: hf.NoBadWordsLogitsProcessor(BAD_WORDS)),
    ],
    ids=["top_p", "typical", "eta", "min_p", "repetition", "bad_words"],
)
def test_other_dtypes(dtype, pair):
    for seed in SEEDS:
        input_ids, scores = make_case(seed, (4, 50, 9), "normal", dtype)
        compare(pair[0](), pair[1](), input_ids, scores)


def test_int32_input_ids():
    input_ids, scores = make_case(0, (4, 50, 9), "normal")
    for ours, theirs in [
        (bp.RepetitionPenaltyLogitsProcessor(1.5), hf.RepetitionPenaltyLogitsProcessor(1.5)),
        (bp.NoRepeatNGramLogitsProcessor(2), hf.NoRepeatNGramLogitsProcessor(2)),
        (bp.NoBadWordsLogitsProcessor(BAD_WORDS), hf.NoBadWordsLogitsProcessor(BAD_WORDS)),
    ]:
        assert_same(ours(input_ids.int(), scores), theirs(input_ids, scores))


# --- hand-made cases: exactly which entries go --------------------------------------------------

PROBS = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()  # one row, already sorted
NO_IDS = torch.zeros(1, 1, dtype=torch.long)


def removed(processor, scores, input_ids=NO_IDS) -> list[int]:
    out = processor(input_ids, scores)
    return torch.nonzero(out[0] == -INF).flatten().tolist()


def test_ramp_top_k_keeps_ties():
    ramp = torch.arange(10.0)[None]
    assert removed(bp.TopKLogitsWarper(3), ramp) == list(range(7))
    assert removed(bp.TopKLogitsWarper(2), torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])) == [0, 4]
    assert removed(bp.TopKLogitsWarper(1, min_tokens_to_keep=4), ramp) == list(range(6))


def test_top_p_masks_underflowing_tokens_as_hf():
    scores = torch.tensor([[0.0, -200.0, -1.0, -1000.0]])  # exp(-200) underflows to 0 in float32
    assert removed(bp.TopPLogitsWarper(1.0), scores) == [1, 3]
    compare(bp.TopPLogitsWarper(1.0), hf.TopPLogitsWarper(1.0), NO_IDS, scores)


def test_ramp_top_p_min_p_epsilon():
    assert removed(bp.TopPLogitsWarper(0.7), PROBS) == [2, 3]  # cumulative from below: .1, .25 <= .3
    assert removed(bp.TopPLogitsWarper(0.7, min_tokens_to_keep=3), PROBS) == [3]
    assert removed(bp.MinPLogitsWarper(0.4), PROBS) == [2, 3]  # below 0.4 * 0.5
    assert removed(bp.MinPLogitsWarper(1.0, min_tokens_to_keep=2), PROBS) == [2, 3]
    assert removed(bp.EpsilonLogitsWarper(0.12), PROBS) == [3]
    assert removed(bp.EpsilonLogitsWarper(0.9, min_tokens_to_keep=2), PROBS) == [2, 3]


def test_ramp_typical():
    # entropy of (.5, .25, .15, .1) is 1.208 nats; |-log p - H| ranks .25 (0.178), .5 (0.515), .15 ...
    assert removed(bp.TypicalLogitsWarper(0.2), PROBS) == [0, 2, 3]
    assert removed(bp.TypicalLogitsWarper(0.5), PROBS) == [2, 3]


def test_ramp_eta():
    # H = 1.208, sqrt(.3) * exp(-H) = 0.164 < .3: drops .15 and .1
    assert removed(bp.EtaLogitsWarper(0.3), PROBS) == [2, 3]


def test_ramp_masks():
    scores = torch.arange(6.0)[None]
    assert removed(bp.NoRepeatNGramLogitsProcessor(3), scores, torch.tensor([[1, 2, 3, 1, 2]])) == [3]
    assert removed(bp.NoRepeatNGramLogitsProcessor(2), scores, torch.tensor([[1, 2, 1, 4, 1]])) == [2, 4]
    assert removed(bp.NoRepeatNGramLogitsProcessor(1), scores, torch.tensor([[5, 0, 5]])) == [0, 5]
    assert removed(
        bp.NoBadWordsLogitsProcessor([[2, 3], [5], [1, 4]], eos_token_id=5), scores, torch.tensor([[0, 2]])
    ) == [3]
    short, long_enough = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)
    assert removed(bp.MinLengthLogitsProcessor(3, [1, 4]), scores, short) == [1, 4]
    assert removed(bp.MinLengthLogitsProcessor(3, [1, 4]), scores, long_enough) == []
    forced = bp.ForcedEOSTokenLogitsProcessor(4, [1, 4])(torch.zeros(1, 3, dtype=torch.long), scores)
    assert forced.tolist() == [[-INF, 0.0, -INF, -INF, 0.0, -INF]]


def test_ramp_repetition_penalty():
    scores = torch.tensor([[-2.0, -1.0, 1.0, 2.0], [-2.0, -1.0, 1.0, 2.0]])
    input_ids = torch.tensor([[0, 2, 2], [3, 0, 1]])
    out = bp.RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=torch.tensor([0, 2]))(
        input_ids, scores
    )
    assert out.tolist() == [[-4.0, -1.0, 0.5, 2.0], [-2.0, -2.0, 1.0, 2.0]]


# --- argument checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: bp.MinLengthLogitsProcessor(-1, 1), "min_length"),
        (lambda: bp.MinLengthLogitsProcessor(2, [-1]), "eos_token_id"),
        (lambda: bp.MinNewTokensLengthLogitsProcessor(-1, 2, 1), "prompt_length_to_skip"),
        (lambda: bp.MinNewTokensLengthLogitsProcessor(1, 2.5, 1), "min_new_tokens"),
        (lambda: bp.NoRepeatNGramLogitsProcessor(0), "ngram_size"),
        (lambda: bp.RepetitionPenaltyLogitsProcessor(0.0), "penalty"),
        (lambda: bp.RepetitionPenaltyLogitsProcessor(1.2, -1), "prompt_ignore_length"),
        (
            lambda: bp.RepetitionPenaltyLogitsProcessor(1.2, torch.zeros(2, 2, dtype=torch.long)),
            "prompt_ignore_length",
        ),
        (lambda: bp.NoBadWordsLogitsProcessor([]), "bad_words_ids"),
        (lambda: bp.NoBadWordsLogitsProcessor([[1], []]), "bad_words_ids"),
        (lambda: bp.NoBadWordsLogitsProcessor([[1, -2]]), "bad_words_ids"),
        (lambda: bp.NoBadWordsLogitsProcessor("abc"), "bad_words_ids"),
        (lambda: bp.SuppressTokensLogitsProcessor([1.5]), "suppress_tokens"),
        (lambda: bp.SuppressTokensAtBeginLogitsProcessor([1], -1), "begin_index"),
        (lambda: bp.ForcedBOSTokenLogitsProcessor(-1), "bos_token_id"),
        (lambda: bp.ForcedEOSTokenLogitsProcessor(5, []), "eos_token_id"),
        (lambda: bp.TemperatureLogitsWarper(0.0), "temperature"),
        (lambda: bp.TopKLogitsWarper(0), "top_k"),
        (lambda: bp.TopKLogitsWarper(3, min_tokens_to_keep=0), "min_tokens_to_keep"),
        (lambda: bp.TopPLogitsWarper(1.5), "top_p"),
        (lambda: bp.MinPLogitsWarper(-0.1), "min_p"),
        (lambda: bp.TypicalLogitsWarper(1.0), "mass"),
        (lambda: bp.EpsilonLogitsWarper(0.0), "epsilon"),
        (lambda: bp.EtaLogitsWarper(1.0), "epsilon"),
        (lambda: bp.EtaLogitsWarper(0.1, min_tokens_to_keep=0), "min_tokens_to_keep"),
    ],
)
def test_invalid_arguments(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_per_row_ignore_length_must_match_rows():
    processor = bp.RepetitionPenaltyLogitsProcessor(1.2, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="prompt_ignore_length"):
        processor(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 5))


# --- build_processors vs GenerationMixin._get_logits_processor ------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50)
    return transformers.GPT2LMHeadModel(config).eval()


GRID = [
    {},
    {"repetition_penalty": 1.3},
    {
        "repetition_penalty": 0.8,
        "no_repeat_ngram_size": 2,
        "bad_words_ids": [[3], [4, 5], [1]],
        "eos_token_id": [1, 2],
    },
    {"min_length": 5, "min_new_tokens": 2, "eos_token_id": 1, "bad_words_ids": [[7, 8, 9]]},
    {
        "forced_bos_token_id": 0,
        "forced_eos_token_id": [1, 2],
        "max_new_tokens": 4,
        "begin_suppress_tokens": [3, 4],
    },
    {"forced_eos_token_id": 1, "max_length": 9, "suppress_tokens": [], "begin_suppress_tokens": [7]},
    {
        "remove_invalid_values": True,
        "suppress_tokens": [5, 6],
        "begin_suppress_tokens": [7],
        "renormalize_logits": True,
    },
    {"do_sample": True},
    {
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 0,
        "top_p": 0.9,
        "min_p": 0.1,
        "typical_p": 0.8,
        "epsilon_cutoff": 0.01,
        "eta_cutoff": 0.01,
        "renormalize_logits": True,
    },
    {"do_sample": True, "num_beams": 3, "eos_token_id": [1, 2], "top_k": 5, "top_p": 0.9, "typical_p": 0.9},
    {"do_sample": True, "num_beams": 2, "top_p": 0.5, "epsilon_cutoff": 0.02},
    {"do_sample": True, "num_beams": 2, "eos_token_id": 1, "min_p": 0.2, "top_k": None, "eta_cutoff": 0.001},
    {
        "do_sample": True,
        "num_beams": 4,
        "temperature": 1.5,
        "repetition_penalty": 1.2,
        "no_repeat_ngram_size": 3,
        "bad_words_ids": [[3, 3]],
        "min_length": 6,
        "min_new_tokens": 1,
        "eos_token_id": [1, 2, 3],
        "forced_bos_token_id": 5,
        "forced_eos_token_id": [2],
        "max_new_tokens": 3,
        "remove_invalid_values": True,
        "suppress_tokens": [9],
        "begin_suppress_tokens": [10, 11],
        "top_k": 7,
        "top_p": 0.95,
        "min_p": 0.05,
        "typical_p": 0.9,
        "epsilon_cutoff": 0.001,
        "eta_cutoff": 0.002,
        "renormalize_logits": True,
    },
]
HF_ONLY = {"max_new_tokens", "max_time", "stop_strings", "output_scores", "output_logits"}


def hf_processors(model, options: SearchOptions, prompt_length: int, attention_mask=None, user=()):
    """The list transformers ``generate`` builds for these options."""
    values = {k: v for k, v in dataclasses.asdict(options).items() if k not in HF_ONLY}
    values = {
        k: [list(w) for w in v]
        if k == "bad_words_ids" and v is not None
        else list(v)
        if isinstance(v, tuple)
        else v
        for k, v in values.items()
    }
    values["max_length"] = options.resolved_max_length(prompt_length)
    config = transformers.GenerationConfig(**values)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=attention_mask is not None, device="cpu")
    kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
    return model._get_logits_processor(
        config,
        input_ids_seq_length=prompt_length,
        device="cpu",
        model_kwargs=kwargs,
        logits_processor=list(user),
    )


def names(processors) -> list[str]:
    return [type(p).__name__ for p in processors]


def apply_both(ours, theirs, options, prompt_length, rows, seed):
    """Apply both lists at every length from the prompt to max_length - 1 (conditional ones fire)."""
    gen = torch.Generator().manual_seed(seed)
    max_length = options.resolved_max_length(prompt_length)
    history = torch.randint(0, 12, (rows, max_length), generator=gen)
    for length in range(prompt_length, max_length):
        scores = torch.randn(rows, 50, generator=gen) * 4
        compare(ours, theirs, history[:, :length], scores)


@pytest.mark.parametrize("kwargs", GRID)
@pytest.mark.parametrize("prompt_length", [1, 3])
def test_build_processors_matches_hf(tiny_gpt2, kwargs, prompt_length):
    options = SearchOptions.create(**kwargs)
    ours = bp.build_processors(options, prompt_length)
    theirs = hf_processors(tiny_gpt2, options, prompt_length)
    assert isinstance(ours, list) and len(ours) == len(theirs)
    assert names(ours) == names(theirs)
    for mine, other in zip(ours, theirs, strict=True):  # same parameters where they matter
        for attr in ("min_tokens_to_keep", "top_k", "begin_index", "max_length", "prompt_length_to_skip"):
            if hasattr(other, attr):
                assert getattr(mine, attr) == getattr(other, attr), attr
    apply_both(ours, theirs, options, prompt_length, rows=4, seed=len(kwargs) + prompt_length)


def test_build_processors_padding_lengths(tiny_gpt2):
    options = SearchOptions.create(repetition_penalty=1.7, max_new_tokens=3)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    padding = (mask != 0).int().argmax(dim=1)
    ours = bp.build_processors(options, 4, padding_lengths=padding)
    theirs = hf_processors(tiny_gpt2, options, 4, attention_mask=mask)
    assert names(ours) == names(theirs) == ["RepetitionPenaltyLogitsProcessor"]
    apply_both(ours, theirs, options, 4, rows=3, seed=5)


class Custom:
    def __call__(self, input_ids, scores):
        return scores * 0.5


def test_build_processors_merges_user_processors(tiny_gpt2):
    options = SearchOptions.create(
        repetition_penalty=1.3, no_repeat_ngram_size=2, do_sample=True, top_k=4, max_new_tokens=3
    )
    custom = Custom()
    user_ours = [custom, bp.NoRepeatNGramLogitsProcessor(3), bp.TopKLogitsWarper(2)]
    user_hf = [custom, hf.NoRepeatNGramLogitsProcessor(3), hf.TopKLogitsWarper(2)]
    ours = bp.build_processors(options, 2, user_processors=user_ours)
    theirs = hf_processors(tiny_gpt2, options, 2, user=user_hf)
    assert (
        names(ours)
        == names(theirs)
        == [
            "RepetitionPenaltyLogitsProcessor",
            "NoRepeatNGramLogitsProcessor",
            "Custom",
            "TopKLogitsWarper",
            "TopKLogitsWarper",
        ]
    )
    assert ours[1] is user_ours[1] and ours[2] is custom and ours[3] is user_ours[2]
    apply_both(ours, theirs, options, 2, rows=3, seed=9)


def test_hf_processor_replaces_ours_by_name():
    options = SearchOptions.create(no_repeat_ngram_size=2, suppress_tokens=[1])
    theirs = hf.NoRepeatNGramLogitsProcessor(3)
    ours = bp.build_processors(options, 2, user_processors=[theirs])
    assert list(ours)[0] is theirs and names(ours) == [
        "NoRepeatNGramLogitsProcessor",
        "SuppressTokensLogitsProcessor",
    ]


def test_processor_list_is_a_callable_list():
    chain = bp.ProcessorList([bp.TemperatureLogitsWarper(2.0), bp.LogitNormalization()])
    scores = torch.randn(3, 7)
    assert len(chain) == 2 and [type(p) for p in chain] == [bp.TemperatureLogitsWarper, bp.LogitNormalization]
    assert_same(chain(NO_IDS.expand(3, 1), scores), (scores / 2.0).log_softmax(-1))


def test_owned_scores_are_masked_in_place_with_the_same_result():
    from beamsearch.processors.pipeline import ProcessorList, run_processors

    ids = torch.zeros(3, 2, dtype=torch.long)
    processors = ProcessorList([bp.MinLengthLogitsProcessor(5, [1]), bp.MinNewTokensLengthLogitsProcessor(0, 4, [2]),
                                bp.SuppressTokensLogitsProcessor([4]), bp.SuppressTokensAtBeginLogitsProcessor([6], 2)])
    scores = torch.randn(3, 10)
    want = processors(ids, scores.clone())
    assert torch.isinf(want[:, [1, 2, 4, 6]]).all() and torch.isfinite(want[:, [0, 3, 5, 7, 8, 9]]).all()
    owned = scores.clone()
    got = run_processors(processors, ids, owned, owned=True)
    assert torch.equal(got, want)
    assert got.data_ptr() == owned.data_ptr()  # masked in place, no [N, V] copy
    assert torch.equal(processors(ids, scores), want) and not torch.isinf(scores).any()  # __call__ still copies
    assert torch.equal(run_processors(processors, ids, scores, owned=False), want) and not torch.isinf(scores).any()
    # ids beyond the vocabulary are ignored, as transformers' isin over the vocabulary does
    wide = ProcessorList([bp.SuppressTokensLogitsProcessor([4, 12, 4])])
    assert torch.equal(run_processors(wide, ids, scores.clone(), owned=True), scores.index_fill(1, torch.tensor([4]),
                                                                                              float("-inf")))


def test_owned_scores_are_not_changed_in_place_after_a_user_processor():
    from beamsearch.processors.pipeline import ProcessorList, run_processors

    kept = []

    def user(input_ids, scores):  # keeps a reference to what it returns
        kept.append(scores)
        return scores

    ids = torch.zeros(2, 1, dtype=torch.long)
    scores = torch.randn(2, 8)
    before = scores.clone()
    got = run_processors(ProcessorList([user, bp.SuppressTokensLogitsProcessor([3])]), ids, scores, owned=True)
    assert torch.equal(kept[0], before)
    assert torch.isinf(got[:, 3]).all()


def test_the_pipeline_records_which_processors_are_the_callers():
    """build_processors marks the caller's processors (by position, kept by select_rows): after one of them the
    scores are no longer assumed private; the built-ins around them are ours."""
    from beamsearch.options import SearchOptions
    from beamsearch.processors.pipeline import build_processors

    def user(input_ids, scores):
        return scores

    options = SearchOptions.create(max_new_tokens=4, min_new_tokens=2, eos_token_id=1, suppress_tokens=[4],
                                   do_sample=True, top_k=3, temperature=0.5)
    processors = build_processors(options, prompt_length=1, user_processors=[user])
    assert [i for i, p in enumerate(processors) if p is user] == sorted(processors.foreign) == [2]
    from beamsearch.processors.pipeline import ProcessorList

    kept = ProcessorList([bp.SuppressTokensLogitsProcessor([4]), bp.SuppressTokensLogitsProcessor([5])], foreign=[1])
    assert kept.select_rows(torch.tensor([0])).foreign == {1}
