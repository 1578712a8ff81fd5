"""The fixed-shape lean steps (``compile_step="static"``) run uncompiled (``torch.compile`` patched to the
identity): the position a tensor, attention over all T positions of the preallocated cache with the unfilled ones
masked. Tokens equal transformers' and scores agree within the score tolerance (docs/testing.md: the masked
positions add exact zeros, but the attention kernels sum in another order); every step reads the same shape;
examples leaving and the cache growing keep it so. ``tests/test_compile_step.py`` compiles it."""

from __future__ import annotations

import functools

import pytest
import torch
from numerics import assert_scores_close
from test_lean_gpt2 import CASES as DECODER_CASES
from test_lean_gpt2 import gpt2
from test_lean_llama import llama
from test_lean_t5 import CASES as T5_CASES
from test_lean_t5 import inputs as t5_inputs
from test_lean_t5 import t5
from tiny_hf import assert_generate_equivalent, compare_lean_steps, left_padded_inputs

import beamsearch
from beamsearch.steps import chooser

transformers = pytest.importorskip("transformers")

DECODER_VOCAB, DECODER_PAD = 50, 2  # test_lean_gpt2's and test_lean_llama's


@pytest.fixture
def attended(monkeypatch) -> list[tuple[int, ...]]:
    """``compile_step="static"`` runs uncompiled; returns the shapes ``[N, heads, T, d]`` of the keys every
    self-attention read."""
    from beamsearch.steps.caches import TimeMajorCache

    read = []
    original = TimeMajorCache.write

    def recording(cache, layer, position, key, value):
        keys, values = original(cache, layer, position, key, value)
        read.append(tuple(keys.shape))
        return keys, values

    monkeypatch.setattr(TimeMajorCache, "write", recording)
    monkeypatch.setattr(chooser.torch, "compile", lambda function, **kwargs: function)
    return read


def _assert_like_transformers(model, ids, mask, case: dict, read: list, new_tokens: int) -> None:
    kwargs = dict(case, max_new_tokens=new_tokens, return_dict_in_generate=True, output_scores=True)
    kwargs.setdefault("do_sample", False)
    assert_generate_equivalent(model, {"compile_step": "static"}, input_ids=ids, attention_mask=mask, **kwargs)
    assert read and len({shape[2] for shape in read}) == 1  # T at every step


@pytest.mark.parametrize("case", range(len(T5_CASES)))
def test_t5_equals_transformers(case: int, attended) -> None:
    model = t5(gated=case % 2 == 1, tied=case % 3 == 0, seed=case)
    ids, mask = t5_inputs(5, seed=case)
    _assert_like_transformers(model, ids, mask, T5_CASES[case], attended, new_tokens=14)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("case", range(len(DECODER_CASES)))
def test_decoder_only_equals_transformers(case: int, name: str, implementation: str, attended) -> None:
    """Left-padded prompts (a boolean sdpa mask or an additive eager one, the future blocked too)."""
    model = (gpt2 if name == "gpt2" else llama)(implementation, seed=case)
    ids, mask = left_padded_inputs(DECODER_VOCAB, DECODER_PAD, 4, seed=case, padded=case % 2 == 0)
    _assert_like_transformers(model, ids, mask, DECODER_CASES[case], attended, new_tokens=10)


def test_t5_with_finished_examples_and_growth(attended) -> None:
    """Examples leaving the batch (their zeroed cache rows gathered) and a cache doubling past its capacity keep
    the fixed-shape step equal to the lean step (tokens; logits within the tolerance)."""
    from beamsearch.steps.t5.lean import LeanT5State

    model = t5(seed=9)
    with torch.no_grad():
        model.lm_head.weight[1] *= 1.5  # here: 4 of the 8 examples leave before the last step
    ids, mask = t5_inputs(8, seed=9)
    kwargs = dict(num_beams=3, max_new_tokens=20, early_stopping=True, do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = beamsearch.generate(model, input_ids=ids, attention_mask=mask, compile_step="static", **kwargs)
    assert torch.equal(got, expected)
    assert {shape[0] for shape in attended} == {8, 24, 21, 18, 15, 12}  # rows: the prompt, B*K, then fewer
    attended.clear()
    ids, mask = t5_inputs(3, seed=10)
    with torch.no_grad():
        hidden = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        states = [LeanT5State(model, hidden, mask, 2, fixed_shape=True), LeanT5State(model, hidden, mask, 8)]
        logits = []
        for state in states:
            state.reorder(torch.arange(3).repeat_interleave(2))
            steps = [state.prefill(torch.zeros(6, 1, dtype=torch.long))]
            for position in range(6):
                state.reorder(torch.tensor([1, 0, 2, 2, 5, 4]))
                steps.append(state.forward(torch.full((6,), 3 + position)))
            logits.append(torch.stack(steps))
            if state.fixed_shape:
                lengths = {shape[2] for shape in attended}  # T of every read: 2, then 4, then 8 positions
    assert states[0].cache.capacity == 8 and lengths == {2, 4, 8}
    assert_scores_close(logits[0], logits[1])


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoder_only_steps_follow_the_model_forward(name: str, implementation: str, padded: bool,
                                                     attended) -> None:
    """Per-step logits against the model's own forward with its cache, rows reordered within their examples
    between steps, the state started with room for the prompt and one position (so it doubles). In float64: these
    random models amplify float32 rounding to ~1e-5, while a wrong mask or position would move the logits by far
    more than the 1e-6 (relative) allowed here. Llama's eager attention takes its softmax in float32 whatever the
    dtype (as transformers' does; in float64 its padded prompts even give NaN, in the model's forward too), so that
    case runs in float32 within the score tolerance."""
    from beamsearch.steps.gpt2.lean import LeanGPT2State, lean_gpt2_step
    from beamsearch.steps.llama.lean import LeanLlamaState, lean_llama_step

    state_class, step = (LeanGPT2State, lean_gpt2_step) if name == "gpt2" else (LeanLlamaState, lean_llama_step)
    float32 = (name, implementation) == ("llama", "eager")
    model = (gpt2 if name == "gpt2" else llama)(implementation, seed=11).to(torch.float32 if float32 else torch.float64)
    ids, mask = left_padded_inputs(DECODER_VOCAB, DECODER_PAD, 3, seed=11, length=7, padded=padded)
    logits, expected, state = compare_lean_steps(model, functools.partial(state_class, fixed_shape=True), step, ids,
                                                 mask, DECODER_VOCAB, padded, prompt_per_example=True)
    assert state.cache.capacity == 16 and {shape[2] for shape in attended} == {8, 16}
    assert state.cache.keys[0].dtype == model.dtype
    if float32:
        assert_scores_close(logits, expected.float())
    else:  # float64 arithmetic, compared after the steps' float32 logits: a few float32 ulps
        assert_scores_close(logits, expected.float(), tolerance=1e-6)


def test_decoder_only_with_finished_examples(attended) -> None:
    """EOS likely: examples leave the batch (their zeroed cache rows and masks gathered); tokens equal
    transformers', scores within the tolerance."""
    model = gpt2("sdpa", seed=7, eos=2.0)  # here the rows go 24 -> 21 -> 12 -> 9 -> 6
    ids, mask = left_padded_inputs(DECODER_VOCAB, DECODER_PAD, 8, seed=7)
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=20, early_stopping=True,
                  do_sample=False, return_dict_in_generate=True, output_scores=False)  # per-step scores keep rows
    assert_generate_equivalent(model, {"compile_step": "static"}, **kwargs)
    assert {shape[0] for shape in attended} == {24, 21, 12, 9, 6}


@pytest.mark.parametrize("option", [{"share_encoder_state": True}, {"remove_finished": False}, {"max_rows": 8}])
def test_t5_with_the_other_speed_options(option: dict, attended) -> None:
    """The fixed-shape step combines with one cross-attention call per example, finished examples kept, and
    sub-batches of at most 8 rows: tokens equal transformers'."""
    model = t5(seed=2)
    ids, mask = t5_inputs(5, seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=10, do_sample=False)
    expected = model.generate(**kwargs)
    assert torch.equal(beamsearch.generate(model, compile_step="static", **kwargs, **option), expected)
    assert len({shape[2] for shape in attended}) == 1
