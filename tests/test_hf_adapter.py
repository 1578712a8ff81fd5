"""The Hugging Face adapter beyond the random grid: model defaults, rejected arguments, output types."""

from __future__ import annotations

import copy

import pytest
import torch
from numerics import assert_scores_close
from parity_grid import assert_equivalent_output
from tiny_hf import random_inputs, reference_generate, tiny_model

import beamsearch

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_model_generation_config_defaults_apply(name):
    model = copy.deepcopy(tiny_model(name))
    model.generation_config.num_beams = 3
    model.generation_config.no_repeat_ngram_size = 2
    model.generation_config.max_new_tokens = 7
    model.generation_config.length_penalty = 0.5
    ids, mask = random_inputs(model, 2, torch.Generator().manual_seed(3))
    kwargs = {"return_dict_in_generate": True, "output_scores": True}
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    actual = beamsearch.generate(model, input_ids=ids, attention_mask=mask, **kwargs)
    assert expected.beam_indices.shape[0] == 2  # the model's num_beams=3 was used, one sequence each
    assert_equivalent_output(expected, actual)


def test_explicit_generation_config_object_is_honoured():
    model = tiny_model("bart")
    ids, mask = random_inputs(model, 2, torch.Generator().manual_seed(4))
    config = transformers.GenerationConfig(num_beams=4, num_return_sequences=2, max_new_tokens=6,
                                           early_stopping=True, eos_token_id=2, pad_token_id=1,
                                           decoder_start_token_id=2, return_dict_in_generate=True,
                                           output_scores=True)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    actual = beamsearch.generate(model, input_ids=ids, attention_mask=mask, generation_config=config)
    assert_equivalent_output(expected, actual)


def test_user_processor_and_criterion_are_used_like_transformers():
    model = tiny_model("llama")
    ids, mask = random_inputs(model, 2, torch.Generator().manual_seed(5))

    def ban_token_seven(input_ids, scores):
        scores = scores.clone()
        scores[:, 7] = -float("inf")
        return scores

    def stop_after_token_nine(input_ids, scores):
        return input_ids[:, -1] == 9

    for kwargs in ({"num_beams": 3}, {}):
        common = dict(max_new_tokens=8, return_dict_in_generate=True, output_scores=True, **kwargs)
        expected = model.generate(input_ids=ids, attention_mask=mask, logits_processor=[ban_token_seven],
                                  stopping_criteria=[stop_after_token_nine], **common)
        actual = beamsearch.generate(model, input_ids=ids, attention_mask=mask, logits_processor=[ban_token_seven],
                                     stopping_criteria=[stop_after_token_nine], **common)
        assert_equivalent_output(expected, actual)
        assert not (actual.sequences[:, ids.shape[1]:] == 7).any()


@pytest.mark.parametrize("kwargs, name", [
    ({"assistant_model": object()}, "assistant_model"),
    ({"num_beams": 2, "constraints": [object()]}, "constraints"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
    ({"sequence_bias": {(4,): 1.0}}, "sequence_bias"),
    ({"trust_remote_code": True}, "trust_remote_code"),
])
def test_unsupported_generate_arguments_are_rejected_by_name(kwargs, name):
    model = tiny_model("t5")
    ids, mask = random_inputs(model, 1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=name):
        beamsearch.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=3, **kwargs)


def test_a_search_argument_in_a_generation_config_is_refused_not_ignored():
    """force_words_ids is read from generate()'s arguments; set in a generation config it would be ignored."""
    model = tiny_model("t5")
    ids, mask = random_inputs(model, 1, torch.Generator().manual_seed(0))
    config = copy.deepcopy(model.generation_config)
    config.force_words_ids = [[5]]
    with pytest.raises(ValueError, match="force_words_ids.*generate\\(\\)'s arguments only"):
        beamsearch.generate(model, input_ids=ids, attention_mask=mask, generation_config=config, num_beams=2,
                            max_new_tokens=3)


def test_max_time_stops_and_labels_the_reason():
    import time

    def slow_step(tokens, state):
        time.sleep(0.002)
        return torch.zeros(tokens.shape[0], 5), state

    result = beamsearch.search(slow_step, torch.tensor([[1]]), num_beams=2, max_new_tokens=2000, eos_token_id=0,
                               max_time=0.05)
    assert result.sequences.shape[-1] < 1000
    assert {int(r) for r in result.finish_reason.reshape(-1)} <= {int(beamsearch.FinishReason.STOP_CRITERION)}


def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' 40 ids: specials, 26 letters and 11 digraphs."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<pad>", "</s>", "<unk>"] + list("abcdefghijklmnopqrstuvwxyz")
    pieces += ["th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti"]
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")


@pytest.mark.parametrize("name", ["t5", "gpt2", "llama"])
@pytest.mark.parametrize("search", [{}, {"num_beams": 4, "num_return_sequences": 2}, {"num_beams": 3}])
def test_stop_strings_match_transformers(name, search):
    model = tiny_model(name)
    tokenizer = tiny_tokenizer()
    ids, mask = random_inputs(model, 3, torch.Generator().manual_seed(11))
    common = dict(max_new_tokens=10, return_dict_in_generate=True, output_scores=True,
                  stop_strings=["he", "q", "nd"], tokenizer=tokenizer, **search)
    expected = reference_generate(model, input_ids=ids, attention_mask=mask, **common)
    actual = beamsearch.generate(model, input_ids=ids, attention_mask=mask, **common)
    assert_equivalent_output(expected, actual)


@pytest.mark.parametrize("name", ["bart", "gpt2"])
def test_search_model_returns_the_full_result_of_the_same_search(name):
    from beamsearch.adapters.hf import search_model

    model = tiny_model(name)
    ids, mask = random_inputs(model, 3, torch.Generator().manual_seed(8))
    common = dict(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=2, max_new_tokens=9,
                  length_penalty=1.0, return_dict_in_generate=True, output_scores=True)
    expected = model.generate(**common)
    result = search_model(model, **common)
    assert torch.equal(result.sequences.reshape(6, -1), expected.sequences)
    generated = (result.lengths - result.prompt_length).to(torch.float32)
    assert_scores_close(result.sum_log_probs / generated, result.sequences_scores)
    assert_scores_close(result.sequences_scores.reshape(-1), expected.sequences_scores)
    eos = model.config.eos_token_id
    for b, j in ((b, j) for b in range(3) for j in range(2)):
        last = int(result.sequences[b, j, int(result.lengths[b, j]) - 1])
        reason = beamsearch.FinishReason(int(result.finish_reason[b, j]))
        assert reason is (beamsearch.FinishReason.EOS if last == eos else beamsearch.FinishReason.MAX_LENGTH)
