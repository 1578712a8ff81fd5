"""``semantics="ct2"`` beam search against the real CTranslate2 (its ``Translator.translate_batch``).

A tiny random-weight BART is saved with ``save_pretrained`` (plus a word-level tokenizer built with
``tokenizers``), converted offline with ``ctranslate2.converters.TransformersConverter``, and both
decode the same random sources: tokens must agree, and scores up to CTranslate2's float32 kernels.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_hf import VOCAB, _configs

from beamsearch import selection
from beamsearch.adapters.hf import search_model
from beamsearch.scoring import ct2_length_normalised
from beamsearch.strategies.ct2 import ct2_max_hypotheses

ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("tokenizers")

PAD, EOS = 1, 2
SECOND_END = 33  # the model's most frequent token: more than K candidates can end, so some stay live
NAMES = ["<s>", "<pad>", "</s>", "<unk>"] + [f"t{i}" for i in range(4, VOCAB)]
SCORE_TOLERANCE = 1e-4  # CTranslate2 CPU kernels vs PyTorch, float32 (measured: below 7e-5)


def _bart():
    """Input-dependent, peaked, with an end-token bias so that hypotheses end at varied steps."""
    from transformers import AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(_configs()["bart"]).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed_positions" not in name:
                parameter.normal_(0.0, 0.3)
        model.lm_head.weight.normal_(0.0, 0.8)
        model.final_logits_bias[0, EOS] = 7.0  # CTranslate2 converts it as the output projection's bias
    return model


def _save_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(NAMES)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The Hugging Face model and its CTranslate2 conversion (a ``Translator`` on one CPU thread)."""
    return build_models(tmp_path_factory)


def build_models(tmp_path_factory):
    model = _bart()
    hf_dir, ct2_dir = tmp_path_factory.mktemp("bart_hf"), tmp_path_factory.mktemp("bart_ct2")
    model.save_pretrained(hf_dir)
    _save_tokenizer(hf_dir)
    # The converter reads `normalize_before`, which BART checkpoints carry but transformers 5's BartConfig
    # no longer defines; BART is post-norm.
    config = json.loads((hf_dir / "config.json").read_text())
    config["normalize_before"] = False
    (hf_dir / "config.json").write_text(json.dumps(config))
    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(ct2_dir), force=True)
    return model, ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=1)


def _random_case(generator: torch.Generator) -> dict:
    def pick(values):
        return values[int(torch.randint(len(values), (1,), generator=generator))]

    beams = pick([2, 3, 4])
    patience = pick([0.5, 1.0, 1.5, 2.0, 3.0])
    most = min(beams, ct2_max_hypotheses(beams, patience))  # num_return_sequences <= num_beams (options.py)
    case = dict(
        beams=beams, patience=patience, hypotheses=pick(list(range(1, most + 1))),
        length_penalty=pick([0.0, 0.6, 1.0, 1.5, -0.5]), max_length=pick(list(range(1, 15))),
        min_length=pick([0, 0, 1, 2, 3]), no_repeat_ngram_size=pick([0, 0, 0, 2, 3]),
        end_tokens=pick([(EOS,), (EOS,), (EOS,), (EOS, SECOND_END)]),
    )
    return case


def _sources(generator: torch.Generator, batch_size: int) -> list[list[int]]:
    lengths = torch.randint(1, 8, (batch_size,), generator=generator).tolist()
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _decode_both(models, sources: list[list[int]], case: dict):
    """CTranslate2's results and ours (a SearchResult) for the same sources and options."""
    model, translator = models
    case = dict(case)
    case["min_length"] = min(case["min_length"], case["max_length"])
    expected = translator.translate_batch(
        [[NAMES[i] for i in source] for source in sources], beam_size=case["beams"], patience=case["patience"],
        num_hypotheses=case["hypotheses"], length_penalty=case["length_penalty"], return_scores=True,
        max_decoding_length=case["max_length"], min_decoding_length=case["min_length"],
        no_repeat_ngram_size=case["no_repeat_ngram_size"], end_token=[NAMES[i] for i in case["end_tokens"]],
    )
    width = max(map(len, sources))
    input_ids = torch.tensor([source + [PAD] * (width - len(source)) for source in sources])
    mask = torch.tensor([[1] * len(source) + [0] * (width - len(source)) for source in sources])
    result = search_model(
        model, input_ids=input_ids, attention_mask=mask, semantics="ct2", num_beams=case["beams"],
        patience=case["patience"], num_return_sequences=case["hypotheses"], length_penalty=case["length_penalty"],
        max_new_tokens=case["max_length"], min_new_tokens=case["min_length"],
        no_repeat_ngram_size=case["no_repeat_ngram_size"], eos_token_id=list(case["end_tokens"]),
    )
    return expected, result


def _our_hypotheses(result, example: int, ends=(EOS,)) -> list[list[str]]:
    """Our hypotheses as CTranslate2 returns them: no start token, trailing end tokens stripped."""
    hypotheses = []
    for j in range(result.sequences.shape[1]):
        tokens = result.sequences[example, j, result.prompt_length : int(result.lengths[example, j])].tolist()
        while tokens and tokens[-1] in ends:
            tokens.pop()
        hypotheses.append([NAMES[i] for i in tokens])
    return hypotheses


@pytest.mark.parametrize("chunked", [False, True])
def test_matches_ctranslate2_on_random_cases(models, chunked, monkeypatch):
    """``chunked``: candidates chosen from 2-token chunk maxima (selection.py), the path large vocabularies take."""
    if chunked:
        monkeypatch.setattr(selection, "CHUNK", 2)
        monkeypatch.setattr(selection, "MIN_CHUNKS_PER_CANDIDATE", 1)
    generator = torch.Generator().manual_seed(2024)
    agreed, total, worst_score_gap, patience_mattered, continued_after_end = 0, 0, 0.0, 0, 0
    for _ in range(150):
        case = _random_case(generator)
        sources = _sources(generator, int(torch.randint(1, 4, (1,), generator=generator)))
        expected, result = _decode_both(models, sources, case)
        if case["patience"] != 1.0 and case["length_penalty"] != 0.0:
            impatient = _decode_both(models, sources, dict(case, patience=1.0, hypotheses=1))[0]
            pairs = zip(expected, impatient, strict=True)
            patience_mattered += any(a.hypotheses[0] != b.hypotheses[0] for a, b in pairs)
        for example, reference in enumerate(expected):
            total += 1
            if _our_hypotheses(result, example, case["end_tokens"]) != reference.hypotheses:
                continue
            agreed += 1
            generated = result.sequences[example, :, result.prompt_length :]  # [n, T']
            last = result.lengths[example, :, None] - result.prompt_length - 1  # [n, 1]
            before_last = torch.arange(generated.shape[1] - 1) < last
            inner = generated[:, :-1][before_last]
            continued_after_end += bool(torch.isin(inner, torch.tensor(case["end_tokens"])).any())
            ours = result.sequences_scores[example].tolist()
            worst_score_gap = max(worst_score_gap, *(abs(a - b) for a, b in zip(ours, reference.scores, strict=True)))
    # Measured over 1,000 such cases (1,981 examples): 100% agree token for token, scores within 7e-5.
    assert agreed / total >= 0.98, f"{agreed}/{total} examples agree with CTranslate2"
    assert worst_score_gap < SCORE_TOLERANCE
    assert patience_mattered > 0  # the cases exercise patience
    assert continued_after_end > 0  # and ended beams that stay live (no unended candidate to replace them)


def test_patience_searches_until_k_times_patience_hypotheses(models):
    """Under a length penalty, more patience finds hypotheses at least as good, as CTranslate2 does."""
    sources = _sources(torch.Generator().manual_seed(7), 3)
    for patience in (1.0, 2.0, 4.0):
        case = dict(beams=2, patience=patience, hypotheses=2, length_penalty=1.0, max_length=14, min_length=0,
                    no_repeat_ngram_size=0, end_tokens=(EOS,))
        expected, result = _decode_both(models, sources, case)
        for example, reference in enumerate(expected):
            assert _our_hypotheses(result, example) == reference.hypotheses
            assert torch.allclose(result.sequences_scores[example], torch.tensor(reference.scores),
                                  atol=SCORE_TOLERANCE)


def test_scores_are_length_normalised_sums_including_the_end_token(models):
    generator = torch.Generator().manual_seed(3)
    for _ in range(10):
        case = dict(_random_case(generator), no_repeat_ngram_size=0)
        result = _decode_both(models, _sources(generator, 2), case)[1]
        generated = result.lengths - result.prompt_length  # the end token counted
        expected = ct2_length_normalised(result.token_log_probs.sum(-1), generated, case["length_penalty"])
        assert torch.allclose(result.sequences_scores, expected, atol=1e-5)
        assert torch.all(result.sequences_scores[:, :-1] >= result.sequences_scores[:, 1:])


def test_length_normalisation_formula():
    scores = torch.tensor([-6.0, -6.0, -1.0])
    lengths = torch.tensor([3, 4, 0])
    assert torch.allclose(ct2_length_normalised(scores, lengths, 1.0)[:2], torch.tensor([-2.0, -1.5]))
    assert ct2_length_normalised(scores, lengths, 1.0)[2] == -math.inf  # CTranslate2: score / pow(0, lp)
    assert torch.equal(ct2_length_normalised(scores, lengths, 0.0), scores)
    assert [ct2_max_hypotheses(4, p) for p in (0.5, 0.625, 1.0, 1.5)] == [2, 3, 4, 6]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_beams=2, patience=0.5, num_return_sequences=2), "round"),
        (dict(num_beams=2, do_sample=True), "sample"),
        (dict(num_beams=2, length_penalty_type="wu"), "length_penalty_type"),
    ],
)
def test_rejects_what_ctranslate2_does_not_do(models, options, message):
    model = models[0]
    with pytest.raises(ValueError, match=message):
        search_model(model, input_ids=torch.tensor([[5, 6]]), semantics="ct2", max_new_tokens=3, **options)


def test_repetition_penalty_applies_to_logits_before_the_softmax(models):
    """CTranslate2 penalises the logits of the tokens after the start token, then takes the log-softmax.

    Under semantics="ct2" the history processors skip the start token too (for BART it is the end token).
    """
    model, translator = models
    generator = torch.Generator().manual_seed(5)
    for _ in range(40):
        sources = _sources(generator, 1)
        beams = int(torch.randint(2, 5, (1,), generator=generator))
        expected = translator.translate_batch([[NAMES[i] for i in sources[0]]], beam_size=beams,
                                              repetition_penalty=1.3, max_decoding_length=12, return_scores=True)
        result = search_model(model, input_ids=torch.tensor(sources), semantics="ct2", num_beams=beams,
                              max_new_tokens=12, min_new_tokens=1, repetition_penalty=1.3)
        assert _our_hypotheses(result, 0) == expected[0].hypotheses
        assert torch.allclose(result.sequences_scores[0], torch.tensor(expected[0].scores), atol=SCORE_TOLERANCE)
