"""The lean GPT-2 step (``steps/gpt2/lean.py``): logits those of the model's forward with its cache, generate()
equal to transformers and to the generic step, finished examples leaving, and clear refusals. The lean cache has
other shapes than transformers', so scores are compared within the score tolerance (docs/testing.md)."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_scores_close
from tiny_hf import (
    assert_alone_equals_in_batch,
    assert_finished_examples_leave,
    assert_generate_equivalent,
    assert_lean_generate_equivalent,
    compare_lean_steps,
    left_padded_inputs,
)

import beamsearch
from beamsearch.adapters import hf as hf_adapter
from beamsearch.steps import chooser

transformers = pytest.importorskip("transformers")

VOCAB = 50
PAD, EOS = 2, 1


def gpt2(implementation: str = "sdpa", seed: int = 0, eos: float = 1.3, **overrides):
    """A small random GPT-2 (weights of std 0.4, an untied output layer of std 0.8 with its EOS row scaled by
    ``eos``): peaked, input-dependent next-token distributions."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=96, bos_token_id=0,
                                     eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
                                     initializer_range=0.4, **overrides)
    config._attn_implementation = implementation
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.8)
        model.lm_head.weight[EOS] *= eos
    return model


def inputs(batch: int, seed: int = 0, length: int = 9, padded: bool = True):
    return left_padded_inputs(VOCAB, PAD, batch, seed, length, padded)


CASES = [
    dict(num_beams=1),
    dict(num_beams=1, do_sample=True, top_k=5, num_return_sequences=2),
    dict(num_beams=3, early_stopping=True, length_penalty=0.5),
    dict(num_beams=4, num_return_sequences=2, early_stopping=False),
    dict(num_beams=4, early_stopping="never", length_penalty=2.0),
]


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_lean_step_equals_transformers(case: int, implementation: str, padded: bool) -> None:
    """Tokens, sequence scores and per-step scores those of ``model.generate``."""
    model = gpt2(implementation, seed=case)
    ids, mask = inputs(5, seed=case, padded=padded)
    kwargs = dict(CASES[case], max_new_tokens=10, return_dict_in_generate=True, output_scores=True)
    kwargs.setdefault("do_sample", False)
    assert_generate_equivalent(model, {"lean_step": True}, input_ids=ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_step_logits_are_those_of_the_model_forward(implementation: str, padded: bool) -> None:
    """Each step's logits equal the model's forward with its cache (within the tolerance), rows reordered within their
    examples between steps; the state starts with room for the prompt and one position and grows past them."""
    from beamsearch.steps.gpt2.lean import LeanGPT2State, lean_gpt2_step

    ids, mask = inputs(3, seed=11, length=7, padded=padded)
    logits, expected, state = compare_lean_steps(gpt2(implementation, seed=11), LeanGPT2State, lean_gpt2_step, ids,
                                                 mask, VOCAB, padded, prompt_per_example=False)
    assert state.cache.capacity == 16  # the prompt's 7 positions + 1, doubled once
    assert (state.mask is not None) == padded
    assert_scores_close(logits, expected)


def test_lean_step_is_the_default_and_equals_the_generic_step(monkeypatch) -> None:
    """A long prompt and several beams: the reorders within examples skip the prompt positions, and the results
    equal the generic step's (``lean_step=False``), which does not run the lean step."""
    from beamsearch.steps.gpt2.lean import LeanGPT2State

    model = gpt2(seed=3)
    ids, mask = inputs(4, seed=3, length=30)
    calls, within = [], []
    original_step, original_within = chooser.lean_gpt2_step, LeanGPT2State._within_examples

    def counting(tokens, state):
        calls.append(tokens.shape)
        return original_step(tokens, state)

    def recording(state, index):
        within.append(original_within(state, index))
        return within[-1]

    monkeypatch.setattr(chooser, "lean_gpt2_step", counting)
    monkeypatch.setattr(LeanGPT2State, "_within_examples", recording)
    kwargs = dict(num_beams=4, max_new_tokens=12)
    lean = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, **kwargs)
    assert calls, "the default did not use the lean step"
    assert within and all(within), "no reorder skipped the prompt positions"
    calls.clear()
    generic = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, lean_step=False, **kwargs)
    assert not calls
    assert torch.equal(lean.sequences, generic.sequences)
    assert_scores_close(lean.sequences_scores, generic.sequences_scores)
    assert_scores_close(lean.token_log_probs, generic.token_log_probs)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("early_stopping", [True, False])
def test_finished_examples_leave_the_lean_state(monkeypatch, implementation: str, early_stopping: bool) -> None:
    """EOS made likely: examples (the padded ones among them) finish at different steps and leave the batch,
    their cache rows too; the results equal transformers'."""
    ids, mask = inputs(8, seed=6)
    assert_finished_examples_leave(monkeypatch, gpt2(implementation, seed=6, eos=2.0), ids, mask, early_stopping)


def test_lean_step_refusals() -> None:
    ids, mask = inputs(2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2)
    for flag in ("reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx"):
        model = gpt2("eager", **{flag: True})
        with pytest.raises(ValueError, match=f"lean_step=True cannot run this call: config.{flag} is set"):
            beamsearch.generate(model, lean_step=True, **kwargs)
        assert torch.equal(beamsearch.generate(model, **kwargs), model.generate(**kwargs))  # the generic step
    model = gpt2()
    with pytest.raises(ValueError, match="lean_step=True cannot run this call: token_type_ids is given"):
        beamsearch.generate(model, lean_step=True, token_type_ids=torch.zeros_like(ids), **kwargs)
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        beamsearch.generate(model, lean_step=True, **kwargs)
    model.eval()
    with pytest.raises(ValueError, match="share_encoder_state=True .* model_type 'gpt2' is not T5"):
        beamsearch.generate(model, share_encoder_state=True, **kwargs)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=PAD, eos_token_id=EOS,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0})).eval()  # a Llama the lean Llama step refuses
    with pytest.raises(ValueError, match="lean_step=True cannot run this call: rotary embedding type 'dynamic'"):
        beamsearch.generate(llama, lean_step=True, **kwargs)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("beams", [1, 3])
def test_an_example_decodes_the_same_alone_and_in_a_padded_batch(implementation: str, beams: int) -> None:
    """Batch invariance through the lean step: each example alone (no padding) and in a left-padded batch with
    others, where examples also finish and leave at different steps: the same tokens, scores within the
    tolerance."""
    ids, mask = inputs(6, seed=4)
    assert_alone_equals_in_batch(gpt2(implementation, seed=4, eos=2.0), ids, mask, num_beams=beams,
                                 max_new_tokens=12, do_sample=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_half_precision_equals_transformers(dtype: torch.dtype, implementation: str) -> None:
    """float16 / bfloat16 weights: tokens and per-step scores those of ``model.generate`` (the half-precision
    tolerance)."""
    ids, mask = inputs(4, seed=3)
    assert_lean_generate_equivalent(gpt2(implementation, seed=3).to(dtype), ids, mask)
