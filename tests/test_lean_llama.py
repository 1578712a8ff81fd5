"""The lean Llama step (``steps/llama/lean.py``), on Llama and on the models whose layers are Llama's (Qwen2, with
the biases of its query, key and value products; Mistral without a sliding window): logits those of the model's
forward with its cache (grouped-query, multi-query and multi-head attention; sdpa and eager; the tested rotary
types), generate() equal to transformers and to the generic step, finished examples leaving, batch invariance, half
precision, refusals. The
lean cache has other shapes than transformers', so scores are compared within the score tolerance
(docs/testing.md)."""

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
    draw_attention_biases,
    generate_both,
    left_padded_inputs,
    tiny_model,
)

import beamsearch
from beamsearch import hf_compat
from beamsearch.adapters import hf as hf_adapter
from beamsearch.steps import chooser

transformers = pytest.importorskip("transformers")

VOCAB = 50
PAD, EOS = 2, 1
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},  # refused
}


ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
         "mistral": ("MistralConfig", "MistralForCausalLM")}


def llama(implementation: str = "sdpa", seed: int = 0, heads: int = 4, kv_heads: int = 2, eos: float = 1.3,
          rope: str = "default", arch: str = "llama", **overrides):
    """A small random Llama, Qwen2 or Mistral (``arch``; head size 8, weights of std 0.4, an untied output layer of
    std 0.8 with its EOS row scaled by ``eos``): peaked, input-dependent next-token distributions. Qwen2's query, key
    and value biases (zeros when initialised) are drawn with std 0.4, so that they matter; Mistral has no sliding
    window unless ``overrides`` give one."""
    config_class, model_class = (getattr(transformers, name) for name in ARCHS[arch])
    if arch == "mistral":
        overrides = {"sliding_window": None, **overrides}
    if hf_compat.version() >= (5, 0):
        overrides["rope_parameters"] = ROPES[rope]
    elif ROPES[rope] is not None:  # 4.57: the scaling and the base frequency are two arguments
        scaling = dict(ROPES[rope])
        overrides.update(rope_theta=scaling.pop("rope_theta"), rope_scaling=scaling)
    config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                          max_position_embeddings=128, bos_token_id=0, eos_token_id=EOS, pad_token_id=PAD,
                          tie_word_embeddings=False, initializer_range=0.4, **overrides)
    config._attn_implementation = implementation
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.8)
        model.lm_head.weight[EOS] *= eos
    if arch == "qwen2":
        draw_attention_biases(model, 0.4)
    return model


def inputs(batch: int, seed: int = 0, length: int = 9, padded: bool = True):
    return left_padded_inputs(VOCAB, PAD, batch, seed, length, padded)


def compare_steps(model, padded: bool):
    """Lean and reference logits ``[steps + 1, N, V]`` for 3 examples of 3 rows, and the lean state; the reference
    runs the prompt once per example (see compare_lean_steps)."""
    from beamsearch.steps.llama.lean import LeanLlamaState, lean_llama_step

    ids, mask = inputs(3, seed=11, length=7, padded=padded)
    return compare_lean_steps(model, LeanLlamaState, lean_llama_step, ids, mask, VOCAB, padded,
                              prompt_per_example=True)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_step_logits_are_those_of_the_model_forward(arch: str, implementation: str, padded: bool, heads: int,
                                                    kv_heads: int) -> None:
    """Each step's logits equal the model's forward with its cache (within the tolerance), rows reordered within their
    examples between steps; grouped-query, multi-query and multi-head attention; the state grows past its start.
    (sdpa with grouped queries takes two paths, ``enable_gqa`` without a mask and a packed query with one: taking
    the other one changes the last bits; the padded and unpadded cases run both.)"""
    model = llama(implementation, seed=11, heads=heads, kv_heads=kv_heads, arch=arch)
    got, expected, state = compare_steps(model, padded)
    assert state.cache.capacity == 16  # the prompt's 7 positions + 1, doubled once
    assert state.cache.keys[0].shape[2] == kv_heads  # the cache holds the key/value heads, not repeated ones
    assert (state.mask is not None) == (padded or implementation == "eager")
    assert_scores_close(got, expected)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_half_precision_step_logits_are_those_of_the_model_forward(arch: str, implementation: str, padded: bool,
                                                                   dtype: torch.dtype) -> None:
    """The same in float16 / bfloat16 (eager's mask in the model's dtype, its softmax in float32 cast back)."""
    model = llama(implementation, seed=5, arch=arch).to(dtype)
    got, expected, state = compare_steps(model, padded)
    assert state.cache.keys[0].dtype == dtype
    assert_scores_close(got, expected.float(), dtype)


@pytest.mark.parametrize("rope", ["linear", "llama3", "yarn"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_rotary_types_are_those_of_the_model_forward(implementation: str, rope: str) -> None:
    """Scaled rotary embeddings (frequencies fixed at load time; positions past the original context of 8)."""
    model = llama(implementation, seed=2, rope=rope)
    assert model.model.rotary_emb.rope_type == rope
    got, expected, _ = compare_steps(model, padded=True)
    assert_scores_close(got, expected)
    plain, _, _ = compare_steps(llama(implementation, seed=2), padded=True)
    assert (got - plain).abs().max() > 0.1  # the scaling is in effect


CASES = [
    dict(num_beams=1),
    dict(num_beams=1, do_sample=True, top_k=5, num_return_sequences=2),
    dict(num_beams=3, early_stopping=True, length_penalty=0.5),
    dict(num_beams=4, num_return_sequences=2, early_stopping=False),
    dict(num_beams=4, early_stopping="never", length_penalty=2.0),
    dict(num_beams=2, length_penalty=-1.0, num_return_sequences=2),
]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_lean_step_equals_transformers(arch: str, case: int, implementation: str, padded: bool) -> None:
    """Tokens, sequence and per-step scores those of ``model.generate``."""
    model = llama(implementation, seed=case, kv_heads=(2, 1, 4)[case % 3], arch=arch)
    ids, mask = inputs(5, seed=case, padded=padded)
    kwargs = dict(CASES[case], max_new_tokens=10, return_dict_in_generate=True, output_scores=True)
    kwargs.setdefault("do_sample", False)
    assert_generate_equivalent(model, {"lean_step": True}, input_ids=ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_lean_step_is_the_default_and_equals_the_generic_step(arch: str, monkeypatch) -> None:
    """A long prompt and several beams: the default runs the lean step, whose reorders within examples skip the
    prompt positions; the results equal the generic step's (``lean_step=False``), which does not run it."""
    from beamsearch.steps.llama.lean import LeanLlamaState

    model = llama(seed=3, arch=arch)
    ids, mask = inputs(4, seed=3, length=30)
    calls, within = [], []
    original_step, original_within = chooser.lean_llama_step, LeanLlamaState._within_examples

    def counting(tokens, state):
        assert isinstance(state, LeanLlamaState)
        calls.append(tokens.shape)
        return original_step(tokens, state)

    def recording(state, index):
        within.append(original_within(state, index))
        return within[-1]

    monkeypatch.setattr(chooser, "lean_llama_step", counting)
    monkeypatch.setattr(LeanLlamaState, "_within_examples", recording)
    kwargs = dict(num_beams=4, max_new_tokens=12)
    lean = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, **kwargs)
    assert len(calls) == 12, "the default did not use the lean step"
    assert within and all(within), "no reorder skipped the prompt positions"
    calls.clear()
    generic = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, lean_step=False, **kwargs)
    assert not calls
    assert torch.equal(lean.sequences, generic.sequences)
    assert_scores_close(lean.sequences_scores, generic.sequences_scores)
    assert_scores_close(lean.token_log_probs, generic.token_log_probs)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("early_stopping", [True, False])
def test_finished_examples_leave_the_lean_state(arch: str, monkeypatch, implementation: str,
                                                early_stopping: bool) -> None:
    """EOS made likely: examples (the padded ones among them) finish at different steps and leave the batch,
    their cache rows too; tokens equal transformers' and the generic step's, scores within the tolerance."""
    ids, mask = inputs(8, seed=6)
    assert_finished_examples_leave(monkeypatch, llama(implementation, seed=6, eos=2.0, arch=arch), ids, mask,
                                   early_stopping)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("beams", [1, 3])
def test_an_example_decodes_the_same_alone_and_in_a_padded_batch(arch: str, implementation: str, beams: int) -> None:
    """Batch invariance through the lean step: each example alone (no padding) and in a left-padded batch with
    others, where examples also finish and leave at different steps: the same tokens, scores within the
    tolerance."""
    ids, mask = inputs(6, seed=4)
    assert_alone_equals_in_batch(llama(implementation, seed=4, eos=2.0, arch=arch), ids, mask, num_beams=beams,
                                 max_new_tokens=12, do_sample=False)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_half_precision_equals_transformers(arch: str, dtype: torch.dtype, implementation: str) -> None:
    """float16 / bfloat16 weights: tokens and per-step scores those of ``model.generate`` (the half-precision
    tolerance)."""
    ids, mask = inputs(4, seed=3)
    assert_lean_generate_equivalent(llama(implementation, seed=3, arch=arch).to(dtype), ids, mask)


def test_the_tiny_shared_model_runs_the_lean_step() -> None:
    """``tiny_model("llama")`` (2 heads sharing 1 key/value head, the other test modules' model) is eligible."""
    from beamsearch.steps.llama.lean import lean_llama_reason

    model = tiny_model("llama")
    assert lean_llama_reason(model, {}, needs_attention=False) is None
    ids, mask = inputs(3, seed=1)
    ids = ids % 40  # the tiny model's vocabulary
    ids[mask == 0] = model.config.pad_token_id
    expected, got = generate_both(model, {"lean_step": True}, input_ids=ids, attention_mask=mask, num_beams=3,
                                  max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


def test_lean_step_refusals() -> None:
    """Each ineligible model or call: the reason (``lean_step=True`` raises with it), and the default falls back to
    the generic step, which still equals transformers."""
    from beamsearch.steps.llama.lean import lean_llama_reason

    ids, mask = inputs(2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    models = {
        "rotary embedding type 'dynamic'": llama(rope="dynamic"),
        "config.pretraining_tp=2": llama(pretraining_tp=2),
        "MyLlama is not LlamaForCausalLM": type("MyLlama", (transformers.LlamaForCausalLM,), {})(llama().config),
        "MyQwen2 is not Qwen2ForCausalLM": type("MyQwen2", (transformers.Qwen2ForCausalLM,), {})(
            llama(arch="qwen2").config),
        # Mistral v0.1's window (its configuration's default) and Qwen2's, where a checkpoint turns it on
        r"config.sliding_window is set \(the lean step attends to the whole cache\)": llama(
            arch="mistral", sliding_window=4096),
        r"config.sliding_window is set \(the lean step": llama(arch="qwen2", use_sliding_window=True,
                                                               sliding_window=4, max_window_layers=0),
    }
    for reason, model in models.items():
        model.eval()
        with pytest.raises(ValueError, match=f"lean_step=True cannot run this call: {reason}"):
            beamsearch.generate(model, lean_step=True, **kwargs)
        assert torch.equal(beamsearch.generate(model, **kwargs), model.generate(**kwargs))  # the generic step
    model = llama()
    with pytest.raises(ValueError, match="lean_step=True cannot run this call: use_cache=False"):
        beamsearch.generate(model, lean_step=True, use_cache=False, **kwargs)
    with pytest.raises(ValueError, match="share_encoder_state=True .* model_type 'llama' is not T5"):
        beamsearch.generate(model, share_encoder_state=True, **kwargs)
    assert lean_llama_reason(model, {"token_type_ids": ids}, needs_attention=False) == "token_type_ids is given"
    assert lean_llama_reason(model, {}, needs_attention=True) == "attention outputs are requested"
    assert "3-d attention_mask" in lean_llama_reason(model, {"attention_mask": mask[:, None]}, needs_attention=False)
    assert "is not Llama, Qwen2 or Mistral" in lean_llama_reason(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB)), {}, needs_attention=False)
    model.config._attn_implementation = "flash_attention_2"
    assert "attention implementation 'flash_attention_2'" in lean_llama_reason(model, {}, needs_attention=False)
    model.config._attn_implementation = "sdpa"
    model.config.sliding_window = 4
    assert lean_llama_reason(model, {}, needs_attention=False) == ("config.sliding_window is set (the lean step "
                                                                   "attends to the whole cache)")
    model.config.sliding_window = None
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        beamsearch.generate(model, lean_step=True, **kwargs)
