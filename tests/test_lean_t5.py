"""The lean T5 step (``steps/t5/lean.py``): equal to transformers and to the generic step, encoder state
shared by an example's beams, and a clear refusal where it cannot run."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_scores_close
from tiny_hf import T5_VOCAB, assert_generate_equivalent, record_t5_states
from tiny_hf import random_t5 as t5

import beamsearch
from beamsearch.adapters import hf as hf_adapter
from beamsearch.steps import chooser

transformers = pytest.importorskip("transformers")

VOCAB = T5_VOCAB


def inputs(batch: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, 9), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch):  # right padding of varied length
        cut = row % 5
        if cut:
            ids[row, -cut:], mask[row, -cut:] = 0, 0
    return ids, mask


CASES = [
    dict(num_beams=1),
    dict(num_beams=4, num_return_sequences=2),
    dict(num_beams=5, early_stopping=True, length_penalty=0.5),
    dict(num_beams=3, early_stopping="never", no_repeat_ngram_size=2),
    dict(num_beams=1, do_sample=True, top_k=5, num_return_sequences=2),
    dict(num_beams=3, do_sample=True, temperature=0.7),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("variant", ["relu", "gated-tied", "mt5"])
def test_lean_step_equals_transformers(case: int, variant: str) -> None:
    model = t5(gated=variant != "relu", tied=variant == "gated-tied", seed=case,
               model_type="mt5" if variant == "mt5" else "t5")
    ids, mask = inputs(5, seed=case)
    kwargs = dict(CASES[case], max_new_tokens=14, return_dict_in_generate=True, output_scores=case % 2 == 0)
    kwargs.setdefault("do_sample", False)
    assert_generate_equivalent(model, {"lean_step": True}, input_ids=ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize(("lean_step", "state_type"), [(None, "FastT5State"), (True, "LeanT5State")])
def test_default_and_lean_steps_equal_the_generic_step(monkeypatch, lean_step, state_type) -> None:
    """The default runs the fast T5 step on a float32 T5 model, ``lean_step=True`` the lean step; both decode like the
    generic step (``lean_step=False``), which runs neither."""
    model = t5(seed=3)
    ids, mask = inputs(6, seed=3)
    states = record_t5_states(monkeypatch)
    lean = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=12,
                                   lean_step=lean_step)
    assert states and set(states) == {state_type}
    states.clear()
    generic = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=12,
                                      lean_step=False)
    assert not states
    assert torch.equal(lean.sequences, generic.sequences)
    assert_scores_close(lean.sequences_scores, generic.sequences_scores)
    assert_scores_close(lean.token_log_probs, generic.token_log_probs)


def test_decoder_prompt_of_several_tokens() -> None:
    model = t5(seed=4)
    ids, mask = inputs(3, seed=4)
    start = torch.tensor([[0, 5, 9], [0, 7, 7], [0, 3, 11]])
    kwargs = dict(num_beams=3, max_new_tokens=8, do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=start, **kwargs)
    got = beamsearch.generate(model, input_ids=ids, attention_mask=mask, decoder_input_ids=start, lean_step=True,
                              **kwargs)
    assert torch.equal(got, expected)


def test_finished_examples_leave_the_lean_state() -> None:
    """EOS made likely: examples finish at different steps and leave the batch (their cache rows too)."""
    model = t5(seed=5)
    with torch.no_grad():
        model.lm_head.weight[1] *= 1.6
    ids, mask = inputs(8, seed=5)
    kwargs = dict(num_beams=3, max_new_tokens=20, early_stopping=True, do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = beamsearch.generate(model, input_ids=ids, attention_mask=mask, lean_step=True, **kwargs)
    assert torch.equal(got, expected)
    lengths = (expected != 0).sum(dim=1)
    assert lengths.min() < lengths.max(), "the case does not finish examples at different steps"


def test_lean_step_scores_are_those_of_transformers() -> None:
    """Per-step scores of a 4-beam search within the score tolerance (the encoder runs on 4 rows here, on 16 in
    transformers: float precision, not bits)."""
    model = t5(seed=9)
    ids, mask = inputs(4, seed=9)
    assert_generate_equivalent(model, {"lean_step": True}, input_ids=ids, attention_mask=mask, num_beams=4,
                               max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True)


@pytest.mark.parametrize("early_stopping", [True, False])
def test_encoder_state_is_flat_in_beams(monkeypatch, early_stopping) -> None:
    """Cross-attention keys and values once per example whatever the beam size. ``share_encoder_state=True``
    (one kernel call for an example's rows): results equal transformers' (tokens; scores to float rounding),
    finished examples leaving included; without it (one call per row slot) too. Scores within the tolerance: the
    encoder runs once per example here, on every beam's row in transformers."""
    model = t5(seed=6)
    with torch.no_grad():
        model.lm_head.weight[1] *= 1.5
    ids, mask = inputs(4, seed=6)
    rows = {}
    original = chooser.lean_t5_step

    def recording(tokens, state):
        out = original(tokens, state)
        rows.setdefault(tokens.shape[0], tuple(state.cross_keys[0].shape))  # after the step: expanded or not
        return out

    monkeypatch.setattr(chooser, "lean_t5_step", recording)
    for beams in (1, 6):
        kwargs = dict(num_beams=beams, max_new_tokens=16, do_sample=False, early_stopping=early_stopping,
                      return_dict_in_generate=True, output_scores=beams == 1)
        expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        got = beamsearch.generate(model, input_ids=ids, attention_mask=mask, share_encoder_state=True, **kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        if beams > 1:  # without output_scores, generate returns no sequence scores: search_model's (also removing)
            wanted = model.generate(input_ids=ids, attention_mask=mask, **dict(kwargs, output_scores=True))
            ours = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, share_encoder_state=True,
                                           num_beams=beams, max_new_tokens=16, early_stopping=early_stopping)
            assert_scores_close(ours.sequences_scores.flatten(), wanted.sequences_scores)
    assert rows[4] == rows[24] == (4, 3, 9, 8)  # [B, H, S, d] for 4 rows (greedy) and 24 rows (beam 6)
    rows.clear()
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=6, max_new_tokens=16, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
    got, expected = beamsearch.generate(model, **kwargs, lean_step=True), model.generate(**kwargs)
    assert rows == {24: (4, 3, 9, 8)}  # the lean step too: one copy per example, queried one row slot at a time
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        assert_scores_close(mine, theirs)


def test_cache_grows_past_its_capacity() -> None:
    """A state sized for 2 positions decoding 7 (a caller's stopping rule beyond max_length) doubles its
    buffers and gives the logits of a state sized for all of them (within the tolerance: the attention runs over
    buffers of other sizes)."""
    from beamsearch.steps.t5.lean import LeanT5State

    model = t5(seed=10)
    ids, mask = inputs(3, seed=10)
    with torch.no_grad():
        hidden = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        states = [LeanT5State(model, hidden, mask, capacity) for capacity in (2, 8)]
        rows = torch.arange(3).repeat_interleave(2)  # 2 rows per example
        logits = []
        for state in states:
            state.reorder(rows)
            steps = [state.prefill(torch.zeros(6, 1, dtype=torch.long))]
            for position in range(6):
                state.reorder(torch.tensor([1, 0, 2, 2, 5, 4]))  # rows move within their example
                steps.append(state.forward(torch.full((6,), 3 + position)))
            logits.append(torch.stack(steps))
    assert states[0].cache.capacity == 8
    assert_scores_close(logits[0], logits[1])


def test_quantized_model_runs_the_lean_step() -> None:
    model = beamsearch.quantize_int8(t5(seed=8))
    ids, mask = inputs(3, seed=8)
    kwargs = dict(num_beams=3, max_new_tokens=10, do_sample=False)
    lean = beamsearch.generate(model, input_ids=ids, attention_mask=mask, lean_step=True, **kwargs)
    generic = beamsearch.generate(model, input_ids=ids, attention_mask=mask, lean_step=False, **kwargs)
    assert torch.equal(lean, generic)


def test_lean_step_refusals() -> None:
    model = t5()
    ids, mask = inputs(2)
    with pytest.raises(ValueError, match="lean_step must be None, True, False or 'fast'"):
        beamsearch.generate(model, input_ids=ids, lean_step="yes", max_new_tokens=2)
    with pytest.raises(ValueError, match="lean_step=True cannot run this call: decoder_attention_mask"):
        beamsearch.generate(model, input_ids=ids, attention_mask=mask, decoder_input_ids=torch.zeros(2, 1).long(),
                            decoder_attention_mask=torch.ones(2, 1).long(), lean_step=True, max_new_tokens=2)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2,
                                                                 n_positions=32)).eval()
    with pytest.raises(ValueError, match="lean_step=True cannot run this call: use_cache=False"):  # GPT-2's own reason
        beamsearch.generate(gpt2, input_ids=ids, lean_step=True, use_cache=False, max_new_tokens=2)
    with pytest.raises(ValueError, match="share_encoder_state=True needs the lean T5 step"):
        beamsearch.generate(model, input_ids=ids, lean_step=False, share_encoder_state=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="share_encoder_state=True .* model_type 'gpt2' is not T5"):
        beamsearch.generate(gpt2, input_ids=ids, share_encoder_state=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="share_encoder_state must be True or False"):
        beamsearch.generate(model, input_ids=ids, share_encoder_state=1, max_new_tokens=2)
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        beamsearch.generate(model, input_ids=ids, lean_step=True, max_new_tokens=2)
    model.eval()


def test_float16_model_equals_transformers() -> None:
    """T5 clamps each sub-layer's output in float16; the lean step does the same (tokens, and scores within the
    float16 tolerance; without the clamp they would be inf or nan)."""
    model = t5(seed=11)
    with torch.no_grad():  # the first decoder feed-forward block overflows float16: the clamp decides the result
        model.decoder.block[0].layer[2].DenseReluDense.wo.weight.mul_(30000.0)
    model = model.half()
    ids, mask = inputs(3, seed=11)
    kwargs = dict(num_beams=3, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = beamsearch.generate(model, input_ids=ids, attention_mask=mask, lean_step=True, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores, strict=True):
        assert_scores_close(mine, theirs, dtype=torch.float16)  # the model ran in float16
