"""The gate of the specialized steps (steps/gate.py): what it lets through, what it refuses and why, and the weight
stamp that ties a copy of the weights to the tensors it was made from."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import fresh, random_t5

from beamsearch.steps.gate import WeightStamp, checksum, refusal
from beamsearch.steps.gpt2.graph import GRAPH_GPT2
from beamsearch.steps.gpt2.lean import LEAN_GPT2
from beamsearch.steps.llama.graph import GRAPH_LLAMA
from beamsearch.steps.llama.lean import LEAN_LLAMA
from beamsearch.steps.t5.fast import FAST_T5
from beamsearch.steps.t5.graph import GRAPH_T5
from beamsearch.steps.t5.lean import LEAN_T5

PLANS = {"t5": (LEAN_T5, FAST_T5, GRAPH_T5), "gpt2": (LEAN_GPT2, GRAPH_GPT2),
         "llama": (LEAN_LLAMA, GRAPH_LLAMA), "qwen2": (LEAN_LLAMA, GRAPH_LLAMA), "mistral": (LEAN_LLAMA, GRAPH_LLAMA)}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_models_own_modules_pass_every_plan_of_their_family(name: str) -> None:
    model = fresh(name)
    for plan in PLANS[name]:
        assert refusal(model, plan) is None, plan.step


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
@pytest.mark.parametrize("gated", [False, True])
def test_t5_variants_pass(model_type: str, gated: bool) -> None:
    """mT5's classes are its own (MT5Attention, ...): the plan's names resolve in the model's modeling module."""
    model = random_t5(gated=gated, model_type=model_type)
    assert refusal(model, LEAN_T5) is None and refusal(model, FAST_T5) is None


def test_an_int8_model_passes_the_fast_plan() -> None:
    from beamsearch import quantize_int8

    assert refusal(quantize_int8(random_t5()), FAST_T5) is None


def test_another_family_or_a_subclass_is_refused() -> None:
    assert "GPT2LMHeadModel is not T5ForConditionalGeneration" in refusal(fresh("gpt2"), LEAN_T5)
    model = fresh("gpt2")
    model.__class__ = type("MyGPT2", (type(model),), {})
    assert refusal(model, LEAN_GPT2) == ("MyGPT2 is not GPT2LMHeadModel, which the lean GPT-2 step was written for")


@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook"])
def test_a_hook_on_a_computed_module_is_refused_and_on_a_called_one_only_by_the_steps_that_compute_it(kind) -> None:
    model = random_t5()
    attention = model.decoder.block[1].layer[0].SelfAttention
    register = attention.register_forward_hook if kind == "forward hook" else attention.register_forward_pre_hook
    handle = register(lambda *args: None)
    assert refusal(model, LEAN_T5) == f"decoder.block.1.layer.0.SelfAttention has a {kind}, which the lean T5 step " \
                                      f"would not run"
    handle.remove()
    head = model.lm_head
    handle = (head.register_forward_hook if kind == "forward hook" else head.register_forward_pre_hook)(
        lambda *args: None)
    assert refusal(model, LEAN_T5) is None  # the lean step calls the output layer as a module
    assert refusal(model, FAST_T5) == f"lm_head has a {kind}, which the fast T5 step would not run"
    assert refusal(model, GRAPH_T5) == f"lm_head has a {kind}, which the graph-safe T5 step would not run"
    handle.remove()
    assert refusal(model, FAST_T5) is None


def test_a_hook_inside_a_computed_module_is_refused() -> None:
    """A dropout the step skips (identity in eval mode) would not run its hook either."""
    model = fresh("gpt2")
    model.transformer.h[0].attn.resid_dropout.register_forward_hook(lambda *args: None)
    assert refusal(model, LEAN_GPT2).startswith("transformer.h.0.attn.resid_dropout has a forward hook")


def test_global_module_hooks_are_refused() -> None:
    model = fresh("llama")
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert "a global module forward hook is registered" in refusal(model, LEAN_LLAMA)
    finally:
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert "a global module forward hook is registered" in refusal(model, LEAN_LLAMA)
    finally:
        handle.remove()
    assert refusal(model, LEAN_LLAMA) is None


def test_a_forward_set_on_the_instance_or_patched_on_the_class_is_refused(monkeypatch) -> None:
    model = fresh("llama")
    layer = model.model.layers[1]
    layer.forward = lambda *args, **kwargs: None
    assert refusal(model, LEAN_LLAMA) == ("model.layers.1 has its own forward (set on the instance), which the lean "
                                          "Llama step would not run")
    del layer.forward

    def patched(self, *args, **kwargs):
        return None

    monkeypatch.setattr(type(model.model.layers[0].self_attn), "forward", patched)
    assert "model.layers.0.self_attn has LlamaAttention.forward replaced by test_gate" in refusal(model, LEAN_LLAMA)


def test_a_replaced_or_wrapped_module_is_refused_where_computed() -> None:
    model = random_t5()
    attention = model.decoder.block[0].layer[0].SelfAttention
    attention.q = torch.nn.Sequential(attention.q)  # a wrapper, as PEFT's layers are
    assert refusal(model, LEAN_T5) is None  # called as a module by the lean step
    assert refusal(model, FAST_T5) == ("decoder.block.0.layer.0.SelfAttention.q is torch.nn.modules.container."
                                       "Sequential, not the Linear the fast T5 step computes itself")
    model.decoder.block[0].layer[0].extra = torch.nn.Identity()  # a child no plan knows
    assert refusal(model, LEAN_T5) == ("decoder.block.0.layer.0.extra (Identity) is not a module the lean T5 step "
                                       "knows: it was written for the model's own modules")


def test_the_strict_plan_refuses_foreign_modules_inside_called_ones() -> None:
    model = fresh("gpt2")

    class Wrapper(torch.nn.Module):  # a module of the user's (not torch's or transformers')
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    model.transformer.h[0].mlp.c_fc = Wrapper(model.transformer.h[0].mlp.c_fc)
    assert refusal(model, LEAN_GPT2) is None
    assert refusal(model, GRAPH_GPT2).startswith("transformer.h.0.mlp.c_fc is test_gate.")


def test_the_weight_stamp_sees_every_change_that_makes_a_copy_stale() -> None:
    model = random_t5()
    stamp = WeightStamp(model)
    assert stamp.current(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # in place: the version counter moves
    assert not stamp.current(model)

    changes = {
        "assigned parameter": lambda m: setattr(m.lm_head, "weight", torch.nn.Parameter(m.lm_head.weight.clone())),
        "data replaced": lambda m: setattr(m.lm_head.weight, "data", m.lm_head.weight.data.clone()),
        "replaced module": lambda m: m.set_output_embeddings(torch.nn.Linear(24, 48, bias=False)),
        "load_state_dict(assign=True)": lambda m: m.load_state_dict(
            {k: v.clone() for k, v in m.state_dict().items()}, assign=True),
        "cast": lambda m: m.double(),
        "new buffer": lambda m: m.register_buffer("extra", torch.zeros(1)),
    }
    for name, change in changes.items():
        model = random_t5()
        stamp = WeightStamp(model)
        change(model)
        assert not stamp.current(model), name


def test_the_checksum_sees_a_write_through_data_that_moves_no_version_counter() -> None:
    """PEFT merges adapters with ``weight.data += delta``: same object, storage and version; the values differ."""
    model = random_t5()
    weight = model.decoder.block[0].layer[0].SelfAttention.q.weight
    stamp, without_contents = WeightStamp(model, contents=[weight]), WeightStamp(model)
    version = weight._version
    weight.data[3, 5] += 1e-6  # one element, by far less than its magnitude
    assert weight._version == version and without_contents.current(model)  # what versions and storages miss
    assert not stamp.current(model)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        tensor = torch.randn(7, 3).to(dtype)
        before = checksum(tensor)
        tensor.data[6, 2] = torch.nextafter(tensor[6, 2], torch.tensor(10.0, dtype=dtype))
        assert checksum(tensor) != before, dtype
