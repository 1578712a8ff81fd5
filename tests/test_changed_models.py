"""``beamsearch.generate`` returns ``model.generate``'s tokens for models their users changed: hooks and pre-hooks on
every kind of module, PEFT adapters (as the PeftModel and as its inner model, merged and unmerged), weights replaced
and updated between calls. Each compares with ``model.generate`` of the same object, and checks that the step that
honours the change ran (the gate, steps/gate.py): the lean step where it calls the changed module as a module, else
the generic step; where nothing the specialized steps compute changed, the fast T5 step keeps running."""

from __future__ import annotations

import pytest
import torch
from parity_grid import assert_case_equivalent, random_case, run_both
from tiny_hf import assert_equals_generate, fresh, inputs, tiny_model

import beamsearch
from beamsearch.steps.gpt2.lean import LEAN_GPT2
from beamsearch.steps.llama.lean import LEAN_LLAMA
from beamsearch.steps.t5.fast import FAST_T5
from beamsearch.steps.t5.lean import LEAN_T5

LEAN = {"t5": LEAN_T5, "gpt2": LEAN_GPT2, "llama": LEAN_LLAMA, "qwen2": LEAN_LLAMA, "mistral": LEAN_LLAMA}
STATES = {"t5": "LeanT5State", "gpt2": "LeanGPT2State", "llama": "LeanLlamaState", "qwen2": "LeanLlamaState",
          "mistral": "LeanLlamaState"}
DEFAULT = dict(STATES, t5="FastT5State")  # what an unchanged model runs by default (float32 on the CPU)

# ------------------------------------------------------------------ hooks


def pattern_of(path: str, name: str) -> str:
    """A module's path in the plans (``*`` for the item of a repeated list: a layer)."""
    repeated = LEAN[name].repeated | (FAST_T5.repeated if name == "t5" else frozenset())
    pattern: list[str] = []
    for part in path.split(".") if path else []:
        pattern.append("*" if ".".join(pattern) in repeated else part)
    return ".".join(pattern)


def module_kinds(name: str) -> list[str]:
    """One module of each kind of the model (the last of a repeated list), by path: every module the lean, fast or
    graph-safe steps compute or call, the model itself included."""
    kinds = {pattern_of(path, name): path for path, _ in fresh(name).named_modules(remove_duplicate=False)}
    return sorted(kinds.values())  # per kind the last: the last layer's module


def expected_state(name: str, path: str) -> str:
    """The step that honours a hook on ``path``: the lean step where it calls the module (or one it lies in) as a
    module, else the generic step (HFState); the fast T5 step computes every module of the model itself."""
    pattern = pattern_of(path, name)
    plan = LEAN[name]
    called = any(pattern == c or pattern.startswith(c + ".") for c in plan.called)
    return STATES[name] if called else "HFState"


def perturbed(value, module):
    """A changed copy of a module's input or output: floats scaled and shifted, token ids moved by one."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return value * 1.25 + 0.05
        if isinstance(module, torch.nn.Embedding):
            return (value + 1) % module.num_embeddings
        return value
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        return (perturbed(value[0], module), *value[1:])
    if hasattr(value, "last_hidden_state"):
        value.last_hidden_state = perturbed(value.last_hidden_state, module)
        return value
    return value


def forward_hook(module, args, output):
    return perturbed(output, module)


def pre_hook(module, args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return (perturbed(args[0], module), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, dict(kwargs, hidden_states=perturbed(kwargs["hidden_states"], module))
    return args, kwargs


HOOK_CASES = [(name, path) for name in LEAN for path in module_kinds(name)]


@pytest.mark.parametrize("kind", ["forward hook", "pre-hook"])
@pytest.mark.parametrize(("name", "path"), HOOK_CASES, ids=[f"{n}:{p or 'model'}" for n, p in HOOK_CASES])
def test_a_hooked_module_decodes_as_generate(steps_run, name: str, path: str, kind: str) -> None:
    model = fresh(name)
    module = model.get_submodule(path)
    if kind == "forward hook":
        module.register_forward_hook(forward_hook)
    else:
        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    # beam search (its reorders too), one call: the step's choice and computation do not depend on the search
    assert_equals_generate(model, steps_run, expected_state(name, path), searches=[dict(num_beams=2)],
                           **inputs(model, batch=2))


@pytest.mark.parametrize("name", sorted(LEAN))
def test_the_hooks_change_what_generate_returns(name: str) -> None:
    """What makes the hook cases mean something: a hook on the final norm changes ``model.generate``'s tokens."""
    model = fresh(name)
    kwargs = inputs(model)
    before = model.generate(**kwargs).sequences
    norm = {"t5": "decoder.final_layer_norm", "gpt2": "transformer.ln_f"}.get(name, "model.norm")
    model.get_submodule(norm).register_forward_hook(lambda module, args, output: output.flip(-1))
    assert not torch.equal(model.generate(**kwargs).sequences, before)


@pytest.mark.parametrize("name", ["t5", "gpt2", "llama"])
def test_the_graph_path_refuses_a_hooked_model_with_the_gates_reason(name: str) -> None:
    model = fresh(name)
    head = model.get_output_embeddings()
    head.register_forward_hook(forward_hook)
    step = {"t5": "T5", "gpt2": "GPT-2", "llama": "Llama"}[name]
    with pytest.raises(ValueError, match=rf"cuda_graphs=True .* cannot run this call: lm_head has a forward hook, "
                                         rf"which the graph-safe {step} step would not run"):
        beamsearch.generate(model, **dict(inputs(model), output_scores=False), cuda_graphs=True)


def test_asking_for_a_step_the_gate_refuses_raises_its_reason() -> None:
    model = fresh("t5")
    model.lm_head.register_forward_hook(forward_hook)
    with pytest.raises(ValueError, match="lean_step='fast' cannot run this call: lm_head has a forward hook, which "
                                         "the fast T5 step would not run"):
        beamsearch.generate(model, **inputs(model), lean_step="fast")
    model.decoder.block[0].layer[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    with pytest.raises(ValueError, match=r"lean_step=True cannot run this call: decoder.block.0.layer.0 has a "
                                         r"forward pre-hook, which the lean T5 step would not run"):
        beamsearch.generate(model, **inputs(model), lean_step=True)


def test_the_default_says_why_at_debug_level(caplog) -> None:
    model = fresh("gpt2")
    model.transformer.h[0].attn.register_forward_hook(forward_hook)
    with caplog.at_level("DEBUG", logger="beamsearch"):
        beamsearch.generate(model, **inputs(model))
    assert "a lean step does not run this call: transformer.h.0.attn has a forward hook" in caplog.text


@pytest.mark.parametrize("seed", range(48))
def test_random_configurations_of_a_model_whose_output_layer_is_capped_by_a_hook(seed: int) -> None:
    """The parity grid's configurations (greedy, sampling, beam search and beam sampling with the processors) on the
    grid's models with a logit soft-cap hooked on the output layer, as users cap logits: ``model.generate``'s tokens
    but at its own near ties, its scores to float precision (the T5 default leaves the fast step for the lean one)."""
    name, kwargs = random_case(seed)
    head = tiny_model(name).get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, output: torch.tanh(output / 3.0) * 3.0)
    try:
        expected, actual = run_both(name, kwargs, seed)
        assert_case_equivalent(expected, actual, name, kwargs, seed)
    finally:
        handle.remove()


# ------------------------------------------------------------------ weights replaced and updated between calls


def other_weights(model, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(tensor.shape, generator=generator) * tensor.std() for name, tensor in
            model.state_dict().items()}


def head_like(model, seed: int) -> torch.Tensor:
    head = model.get_output_embeddings().weight
    return torch.randn(head.shape, generator=torch.Generator().manual_seed(seed)) * 0.8


REPLACEMENTS = {
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(other_weights(m, 11), assign=True),
    "set_output_embeddings": lambda m: m.set_output_embeddings(torch.nn.Linear(*reversed(head_like(m, 12).shape),
                                                                               bias=False)),
    "lm_head.weight = Parameter": lambda m: setattr(m.get_output_embeddings(), "weight",
                                                    torch.nn.Parameter(head_like(m, 13))),
    "weight.data =": lambda m: setattr(m.get_output_embeddings().weight, "data", head_like(m, 14)),
}


@pytest.mark.parametrize("name", ["t5", "gpt2", "llama"])
@pytest.mark.parametrize("replace", sorted(REPLACEMENTS))
def test_weights_replaced_then_updated_between_calls(steps_run, name: str, replace: str) -> None:
    """A first call (the fast T5 step packs its weights), the weights replaced, then updated in place by an optimizer
    step and through ``.data``: every call decodes with the model's weights of that moment, on the default step."""
    model = fresh(name)
    kwargs = inputs(model)
    before = model.generate(**kwargs).sequences
    assert_equals_generate(model, steps_run, DEFAULT[name], **kwargs)
    REPLACEMENTS[replace](model)
    model.eval()
    assert not torch.equal(model.generate(**kwargs).sequences, before)  # the replacement matters
    assert_equals_generate(model, steps_run, DEFAULT[name], **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.enable_grad():
        model(input_ids=kwargs["input_ids"], labels=kwargs["input_ids"]).loss.backward()
    optimizer.step()
    assert_equals_generate(model, steps_run, DEFAULT[name], **kwargs)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.data += torch.randn(head.shape, generator=torch.Generator().manual_seed(15)) * 0.5
    assert_equals_generate(model, steps_run, DEFAULT[name], **kwargs)


def test_a_kept_graph_is_dropped_when_the_weights_it_reads_are_replaced(monkeypatch) -> None:
    """A captured graph reads the weights by address: a kept step (reuse.py) serves a later call only while the model
    holds the tensors it was captured on (here uncaptured, kept as on CUDA)."""
    from beamsearch.graphs import driver, reuse

    monkeypatch.setattr(driver, "keeps_steps", lambda capture: True)
    reuse.release()
    try:
        model = fresh("gpt2")
        kwargs = dict(inputs(model), return_dict_in_generate=False, output_scores=False)
        beamsearch.generate(model, **kwargs, cuda_graphs=True)
        (first,) = reuse._KEPT.values()
        beamsearch.generate(model, **kwargs, cuda_graphs=True)
        assert list(reuse._KEPT.values()) == [first]  # served the second call
        REPLACEMENTS["lm_head.weight = Parameter"](model)
        ours = beamsearch.generate(model, **kwargs, cuda_graphs=True)
        (second,) = reuse._KEPT.values()
        assert second is not first
        assert torch.equal(ours, model.generate(**kwargs))
    finally:
        reuse.release()
