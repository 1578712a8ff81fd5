"""PEFT models (adapters/hf_peft.py and the gate): LoRA and IA3 on T5, BART, GPT-2, Llama and Qwen2, as the PeftModel
and as its inner model, merged and unmerged, each decoding to ``model.generate``'s tokens of the same object, on the
step that honours the adapter layers; the methods whose generate does more are refused by name."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tiny_hf import assert_equals_generate, inputs, tiny_model

import beamsearch

peft = pytest.importorskip("peft", reason="peft is installed by make test (requirements-dev.txt)")

# the layers LoRA and IA3 adapt: attention products and a feed-forward product of each family (GPT-2's Conv1D
# products store their weight transposed: fan_in_fan_out)
TARGETS = {"t5": (["q", "v", "wo"], ["wo"]), "bart": (["q_proj", "v_proj", "fc1"], ["fc1"]),
           "gpt2": (["c_attn", "c_fc"], ["c_fc"]), "llama": (["q_proj", "v_proj", "down_proj"], ["down_proj"]),
           "qwen2": (["q_proj", "v_proj", "down_proj"], ["down_proj"])}
# the step an adapted (unmerged) model runs: the lean step calls the adapted products as modules (BART has none)
ADAPTED = {"t5": "LeanT5State", "bart": "HFState", "gpt2": "LeanGPT2State", "llama": "LeanLlamaState",
           "qwen2": "LeanLlamaState"}
# the step of the model once the adapter is merged into plain layers (merge_and_unload)
PLAIN = {**ADAPTED, "t5": "FastT5State"}


def adapted(name: str, method: str):
    """A PeftModel of a fresh tiny model, with adapter weights drawn so that they change the outputs."""
    model = copy.deepcopy(tiny_model(name))
    targets, feed_forward = TARGETS[name]
    fan_in_fan_out = name == "gpt2"
    if method == "lora":
        config = peft.LoraConfig(target_modules=targets, r=4, lora_alpha=8, init_lora_weights=False,
                                 fan_in_fan_out=fan_in_fan_out)
    else:
        config = peft.IA3Config(target_modules=targets, feedforward_modules=feed_forward,
                                fan_in_fan_out=fan_in_fan_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note on fan_in_fan_out for Conv1D
        wrapped = peft.get_peft_model(model, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter_name, parameter in wrapped.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_(0.0, 0.3)
            elif "ia3_l" in parameter_name:
                parameter.uniform_(-1.0, 3.0)
    return wrapped.eval()


@pytest.mark.parametrize("method", ["lora", "ia3"])
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_an_adapted_model_decodes_as_generate(steps_run, name: str, method: str) -> None:
    wrapped = adapted(name, method)
    kwargs = inputs(wrapped)
    unadapted = tiny_model(name).generate(**kwargs).scores[0]
    assert not torch.allclose(wrapped.generate(**kwargs).scores[0], unadapted, atol=1e-3)  # the adapter matters
    assert_equals_generate(wrapped, steps_run, ADAPTED[name], **kwargs)
    assert_equals_generate(wrapped.get_base_model(), steps_run, ADAPTED[name], **kwargs)  # the inner model


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_merged_adapter_decodes_as_generate(steps_run, name: str) -> None:
    """``merge_adapter`` changes the base weights in place (the layers stay PEFT's: the lean step); after a first call
    of the unadapted model packed the fast step's weights, ``merge_and_unload`` gives plain layers whose weights
    changed in place: the fast T5 step runs, on weights packed again."""
    wrapped = adapted(name, "lora")
    kwargs = inputs(wrapped)
    wrapped.merge_adapter()
    assert_equals_generate(wrapped, steps_run, ADAPTED[name], **kwargs)
    wrapped.unmerge_adapter()
    with wrapped.disable_adapter():  # the base model alone, through the same (adapted) layers
        assert_equals_generate(wrapped, steps_run, ADAPTED[name], **kwargs)
    inner = wrapped.get_base_model()
    with wrapped.disable_adapter():
        assert_equals_generate(inner, steps_run, ADAPTED[name], **kwargs)
    plain = wrapped.merge_and_unload()
    assert_equals_generate(plain, steps_run, PLAIN[name], **kwargs)


def test_the_fast_step_packs_merged_weights_again(steps_run) -> None:
    model = copy.deepcopy(tiny_model("t5"))
    kwargs = inputs(model)
    assert_equals_generate(model, steps_run, "FastT5State", **kwargs)  # packs the unadapted weights
    config = peft.LoraConfig(target_modules=TARGETS["t5"][0], r=4, init_lora_weights=False)
    plain = peft.get_peft_model(model, config).eval().merge_and_unload()  # the same model object, merged in place
    assert plain is model
    assert_equals_generate(plain, steps_run, "FastT5State", **kwargs)


def test_prompt_learning_and_per_row_adapters_are_refused_by_name() -> None:
    model = copy.deepcopy(tiny_model("gpt2"))
    prompted = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match="a PeftModel with the prompt-learning method PROMPT_TUNING is not supported"):
        beamsearch.generate(prompted, **inputs(model))
    wrapped = adapted("gpt2", "lora")
    with pytest.raises(ValueError, match="PeftModel argument 'adapter_names' .* is not supported"):
        beamsearch.generate(wrapped, **inputs(model), adapter_names=["default"] * 3)
