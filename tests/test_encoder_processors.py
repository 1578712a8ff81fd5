"""The source-side processors (``encoder_repetition_penalty``, ``encoder_no_repeat_ngram_size``): transformers'
classes on random cases, hand-made cases, and a stock-config Blenderbot through ``generate``."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import assert_scores_close
from parity_grid import assert_bitwise_output
from test_processors import CASES, compare, make_case
from tiny_hf import generate_both

from beamsearch import processors as bp

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("transformers.generation.logits_process")


def _sources(rows: int, vocab: int, length: int, seed: int) -> torch.Tensor:
    """Source ids ``[rows, length]`` from a small alphabet, so that their n-grams meet the histories'."""
    return torch.randint(0, min(vocab, 5), (rows, length), generator=torch.Generator().manual_seed(seed))


ENCODER_CASES = [*(("EncoderNoRepeatNGramLogitsProcessor", n) for n in (1, 2, 3, 4)),
                 *(("EncoderRepetitionPenaltyLogitsProcessor", p) for p in (0.5, 1.3, 2.0))]


@pytest.mark.parametrize(("name", "argument"), ENCODER_CASES)
def test_encoder_processors_equal_transformers(name, argument):
    """Same elementwise masking and scaling on the same tensors: bit for bit (``compare``)."""
    for seed, (rows, vocab, length), kind in CASES:
        ids, scores = make_case(seed, (rows, vocab, length), kind)
        source = _sources(rows, vocab, 6, seed)
        compare(getattr(bp, name)(argument, source), getattr(hf, name)(argument, source), ids, scores)


def test_encoder_no_repeat_ngram_by_hand():
    """Source 5 6 7 5 8; bigrams (5,6) (6,7) (7,5) (5,8). A row ending in 5 may not continue with 6 or 8; a row
    ending in 7 not with 5; a row ending in 9 is free. Trigrams: a row ending in 6 7 may not continue with 5."""
    source = torch.tensor([[5, 6, 7, 5, 8]] * 3)
    scores = torch.zeros(3, 10)
    ids = torch.tensor([[0, 5], [0, 7], [0, 9]])
    out = bp.EncoderNoRepeatNGramLogitsProcessor(2, source)(ids, scores)
    assert torch.isinf(out).nonzero().tolist() == [[0, 6], [0, 8], [1, 5]]
    trigram = bp.EncoderNoRepeatNGramLogitsProcessor(3, source[:1])
    assert torch.isinf(trigram(torch.tensor([[6, 7]]), torch.zeros(1, 10))).nonzero().tolist() == [[0, 5]]
    assert not torch.isinf(trigram(torch.tensor([[7]]), torch.zeros(1, 10))).any()  # fewer than n - 1 tokens
    unigram = bp.EncoderNoRepeatNGramLogitsProcessor(1, source[:1])(torch.tensor([[0]]), torch.zeros(1, 10))
    assert torch.isinf(unigram[0]).nonzero().flatten().tolist() == [5, 6, 7, 8]


def test_encoder_repetition_penalty_by_hand():
    """Penalty 2 on source tokens {1, 3}: a positive score is multiplied by 2, a negative one halved (the opposite
    of the repetition penalty: the source's tokens are encouraged); the others are untouched."""
    scores = torch.tensor([[1.0, 2.0, -3.0, -4.0]])
    out = bp.EncoderRepetitionPenaltyLogitsProcessor(2.0, torch.tensor([[1, 3, 3]]))(torch.tensor([[0]]), scores)
    assert out.tolist() == [[1.0, 4.0, -3.0, -2.0]]
    assert scores.tolist() == [[1.0, 2.0, -3.0, -4.0]]  # not in place


def test_select_rows_keeps_each_rows_source():
    source = torch.tensor([[1, 2], [3, 4], [5, 6]])
    kept = bp.EncoderNoRepeatNGramLogitsProcessor(1, source).select_rows(torch.tensor([2, 0]))
    out = kept(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 8))
    assert torch.isinf(out).nonzero().tolist() == [[0, 5], [0, 6], [1, 1], [1, 2]]
    penalty = bp.EncoderRepetitionPenaltyLogitsProcessor(3.0, source).select_rows(torch.tensor([1]))
    assert torch.equal(penalty.encoder_input_ids, source[1:2]) and math.isclose(penalty.penalty, 1 / 3)


def test_options_need_the_source_ids():
    import beamsearch

    def step(tokens, state):
        return torch.zeros(tokens.shape[0], 5), state

    for option in ({"encoder_no_repeat_ngram_size": 2}, {"encoder_repetition_penalty": 1.5}):
        with pytest.raises(ValueError, match="needs the source ids"):
            beamsearch.search(step, torch.zeros(1, 1, dtype=torch.long), max_new_tokens=2, **option)
    with pytest.raises(ValueError, match="encoder_repetition_penalty must be > 0"):
        beamsearch.search(step, torch.zeros(1, 1, dtype=torch.long), encoder_repetition_penalty=0.0)
    out = beamsearch.search(step, torch.zeros(2, 1, dtype=torch.long), max_new_tokens=2, eos_token_id=9,
                            encoder_no_repeat_ngram_size=1, encoder_input_ids=torch.tensor([[0, 1, 2], [0, 3, 4]]))
    assert out.sequences[:, 0, 1:].tolist() == [[3, 3], [1, 1]]  # the first token not in the source


@pytest.fixture(scope="module")
def blenderbot():
    """A tiny random Blenderbot built from its stock config: ``encoder_no_repeat_ngram_size=3`` and
    ``forced_eos_token_id`` come with it."""
    config = transformers.BlenderbotConfig(vocab_size=30, d_model=16, encoder_layers=1, decoder_layers=2,
                                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                           decoder_ffn_dim=32, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BlenderbotForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.8)
    assert model.generation_config.encoder_no_repeat_ngram_size == 3
    return model


@pytest.mark.parametrize("beams", [1, 4])
def test_stock_blenderbot_generates_as_transformers(blenderbot, beams):
    # this random model repeats token 1 (its decoder start) forever; sources holding the trigram 1 1 1 ban that
    # repetition after two steps, so the stock constraint changes the output (checked below)
    ids = torch.tensor([[5, 1, 1, 1, 6, 8, 2], [9, 1, 1, 1, 29, 29, 29]])
    mask = torch.ones_like(ids)
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=beams, max_new_tokens=12, return_dict_in_generate=True,
                  output_scores=True)
    want, exact = generate_both(blenderbot, {"exact_parity": True}, **kwargs)
    assert_bitwise_output(want, exact)  # exact_parity: the same rows and shapes as transformers
    _, fast = generate_both(blenderbot, **kwargs)  # the prompt once per example: float precision, not bits
    assert torch.equal(fast.sequences, want.sequences)
    for got, expected in zip(fast.scores, want.scores, strict=True):
        assert_scores_close(got, expected)
    if beams > 1:
        assert_scores_close(fast.sequences_scores, want.sequences_scores)
    free = blenderbot.generate(**kwargs, encoder_no_repeat_ngram_size=0)
    assert not torch.equal(free.sequences, want.sequences), "the case must exercise the stock constraint"
