"""The gate every specialized model step passes before it runs: the step computes what the model's own modules compute.

A specialized step (the lean, fast and graph-safe steps of T5, GPT-2 and Llama-like models) is an optimisation of
the model's computation, never a second model. It runs some of the model's modules as modules (their own forward,
hooks and all: whatever the user changed in them, a LoRA layer, a hook, a quantized replacement, is honoured) and
computes the others itself from their weights. Its :class:`Plan` says which is which, for every module of the model;
:func:`refusal` checks, at every call and before the step is chosen, that

- the model is one of the classes the step was written for, and every module the step computes itself (and every
  module inside one, which the step reads or skips) is exactly the class it was written for: no subclass, no
  wrapper (PEFT's layers), no replaced or quantized module, no ``forward`` overridden on the instance or patched on
  the class, and no unknown child;
- none of those modules carries a forward hook or pre-hook, and no global module hook is registered
  (``torch.nn.modules.module.register_module_forward_hook`` and its pre-hook: they would not run on the modules the
  step computes itself);
- with ``strict`` (a captured CUDA graph, which replays what it recorded once), the modules the step calls are
  plain too: no hooks and no class from outside ``torch`` and ``transformers`` anywhere in the model.

Where it refuses, the caller runs the step that honours the change: the lean step where it calls the changed module
as a module, else the generic step that calls ``model(...)``.

What a step copies, folds or packs from the model's weights (the fast T5 step's packed products, a kept CUDA graph's
addresses) is tied to a :class:`WeightStamp`: the same tensor objects, version counters, storages, dtypes and
devices, and the same module objects; where the stamp is stale the copy is made again or not used.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping
from typing import Any

import torch

# A module the step computes itself may be given as a class, as the name of a class of the model's own modeling
# module (``"{}Attention"``: ``{}`` is the family's prefix, ``T5`` for T5ForConditionalGeneration, ``MT5`` for mT5),
# or as ACTIVATION: any activation module of transformers or torch (T5's ``act``, which the fast step calls on
# inputs of other shapes than the model's own).
ACTIVATION = "activation"
_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")


def _int8_linear() -> tuple[type, ...]:
    """torch.ao's dynamic int8 Linear (``beamsearch.quantize_int8``), where this torch has it."""
    dynamic = getattr(getattr(getattr(getattr(torch, "ao", None), "nn", None), "quantized", None), "dynamic", None)
    linear = getattr(dynamic, "Linear", None)
    return (linear,) if isinstance(linear, type) else ()


# a computed module of one of these classes is read as a whole (its weight): what it holds is not walked (the int8
# Linear's packed parameters)
LEAVES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Dropout, *_int8_linear())
INT8_LINEAR = _int8_linear()


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: plans are constants
class Plan:
    """How a step runs a model, module by module.

    Paths are module names as ``model.named_modules()`` gives them, with ``*`` for the items of a :attr:`repeated`
    list (``decoder.block.*.layer.0.SelfAttention``); ``""`` is the model itself.

    Attributes:
        step: the step's name, for messages (``"the lean T5 step"``).
        roots: the model classes the step was written for (names in ``transformers``).
        suffix: a root's name minus this is the family's prefix (``{}`` in class names).
        computed: path -> the classes the step was written for, at the modules it computes itself.
        called: paths of the modules the step calls as modules, on the inputs the model's forward gives them.
        repeated: paths of the lists whose items are alike (layers).
        strict: a captured step: hooks and foreign classes are refused in the called modules too.
    """

    step: str
    roots: tuple[str, ...]
    suffix: str
    computed: Mapping[str, tuple[Any, ...]]
    called: frozenset[str]
    repeated: frozenset[str]
    strict: bool = False

    def captured(self, step: str) -> Plan:
        """The same plan for a step replayed from a CUDA graph (:attr:`strict`)."""
        return dataclasses.replace(self, step=step, strict=True)


def refusal(model: Any, plan: Plan) -> str | None:
    """Why ``plan``'s step cannot run ``model`` as the model computes itself (None: it can). Costs one walk over
    the model's modules, no tensor work.

    Examples of reasons: ``decoder.block.0.layer.0.SelfAttention.q is peft...lora.layer.Linear, not the Linear
    the fast T5 step computes itself``; ``lm_head has a forward hook, which the fast T5 step would not run``.
    """
    hooks = torch.nn.modules.module
    if getattr(hooks, "_global_forward_hooks", None) or getattr(hooks, "_global_forward_pre_hooks", None):
        return f"a global module forward hook is registered, which {plan.step} would not run on the modules it " \
               f"computes itself"
    classes = _classes(plan, type(model))
    if classes is None:
        return f"{type(model).__name__} is not {' or '.join(plan.roots)}, which {plan.step} was written for"
    return _walk(model, "", "", plan, classes)


def _walk(module: Any, path: str, pattern: str, plan: Plan, classes: dict[str, tuple[type | str, ...]]) -> str | None:
    """Check ``module`` at ``path`` (``pattern``: its path in the plan) and, unless the step calls it, its children."""
    name = path or "the model"
    if pattern in plan.called:
        return _plain(module, path, plan) if plan.strict else None
    expected = classes.get(pattern)
    if expected is None:
        return f"{name} ({type(module).__name__}) is not a module {plan.step} knows: it was written for the " \
               f"model's own modules"
    reason = _module_reason(module, expected, plan)
    if reason is not None:
        return f"{name} {reason}"
    if isinstance(module, LEAVES):
        return None
    for child_name, child in module._modules.items():
        if child is None:
            continue
        child_pattern = "*" if pattern in plan.repeated else child_name
        child_pattern = f"{pattern}.{child_pattern}" if pattern else child_pattern
        reason = _walk(child, f"{path}.{child_name}" if path else child_name, child_pattern, plan, classes)
        if reason is not None:
            return reason
    return None


def _module_reason(module: Any, expected: tuple[type | str, ...], plan: Plan) -> str | None:
    """Why a module the step computes itself is not the one it was written for (None: it is)."""
    kind = type(module)
    if kind not in expected and not (ACTIVATION in expected and kind.__module__ in _ACTIVATION_MODULES):
        wanted = " or ".join(sorted({getattr(c, "__name__", c) for c in expected}))
        return f"is {kind.__module__}.{kind.__qualname__}, not the {wanted} {plan.step} computes itself"
    return _hook_reason(module, plan) or _forward_reason(module, kind, plan)


def _hook_reason(module: Any, plan: Plan) -> str | None:
    if module._forward_hooks:
        return f"has a forward hook, which {plan.step} would not run"
    if module._forward_pre_hooks:
        return f"has a forward pre-hook, which {plan.step} would not run"
    return None


def _forward_reason(module: Any, kind: type, plan: Plan) -> str | None:
    """An instance ``forward`` (accelerate's hooks, a user's patch) or a class ``forward`` defined outside the
    class's own module (a library's patch)."""
    if "forward" in module.__dict__:
        return f"has its own forward (set on the instance), which {plan.step} would not run"
    for owner in kind.__mro__:
        if "forward" in owner.__dict__:
            function = owner.__dict__["forward"]
            if getattr(function, "__module__", owner.__module__) != owner.__module__:
                return f"has {owner.__name__}.forward replaced by {function.__module__}.{function.__qualname__}, " \
                       f"which {plan.step} would not run"
            return None
    return None


def _plain(module: Any, path: str, plan: Plan) -> str | None:
    """Under a strict plan: a called module and everything in it carry no hook and are torch's or transformers'."""
    for name, inner in module.named_modules(prefix=path):
        kind = type(inner)
        if not kind.__module__.startswith(("torch.", "transformers.")):
            return f"{name} is {kind.__module__}.{kind.__qualname__}, which {plan.step} cannot capture in a graph " \
                   f"(only torch's and transformers' own modules)"
        reason = _hook_reason(inner, plan) or _forward_reason(inner, kind, plan)
        if reason is not None:
            return f"{name} {reason}"
    return None


@functools.lru_cache(maxsize=64)
def _classes(plan: Plan, root: type) -> dict[str, tuple[type | str, ...]] | None:
    """The plan's computed paths with their classes resolved for a model of class ``root`` (None: ``root`` is not
    one of the plan's classes)."""
    import transformers

    if not any(getattr(transformers, name, None) is root for name in plan.roots):
        return None
    prefix = root.__name__.removesuffix(plan.suffix)
    modeling = sys.modules[root.__module__]
    resolved = {"": (root,)}
    for path, specs in plan.computed.items():
        found: list[type | str] = []
        for spec in specs:
            if spec == ACTIVATION:
                found.append(ACTIVATION)
            elif isinstance(spec, str):
                named = getattr(modeling, spec.format(prefix), None)
                found.extend([named] if isinstance(named, type) else [])
            else:
                found.append(spec)
        resolved[path] = tuple(found)
    return resolved


class WeightStamp:
    """What a copy of a model's weights was made from: every parameter and buffer (the object, its version counter,
    storage, dtype and device), every module object (a replaced module, an int8 layer's packed weights), and a
    checksum of the values of the tensors copied (``contents``).

    :meth:`current` is False after any in-place update (an optimizer step, ``load_state_dict``), a replaced tensor
    (``load_state_dict(assign=True)``, ``module.weight = nn.Parameter(...)``, ``param.data = ...``), a replaced module
    (``set_output_embeddings``), a move or a cast; the copy must then be made again. A write through ``.data``
    (``weight.data += delta``, as PEFT's ``merge_adapter`` and ``merge_and_unload`` do) moves no version counter: the
    checksum of ``contents`` sees it (:func:`checksum`). Holds the objects it stamps, so that an identity cannot be
    reused while the stamp lives.
    """

    def __init__(self, model: Any, contents: Any = ()):
        modules, tensors = _inventory(model)
        self.tensors = [(t, t._version, t.data_ptr(), t.dtype, t.device) for t in tensors]
        self.modules = [(m, getattr(m, "_packed_params", None)) for m in modules]
        with torch.no_grad():  # bit views of the contents: they share the storage, so they see writes through .data
            self.words = [_words(t) for t in contents]
            self.sums = self._sums()

    def _sums(self) -> torch.Tensor | None:
        return torch.stack([_sum(words) for words in self.words]) if self.words else None

    def current(self, model: Any) -> bool:
        """Whether ``model`` still holds exactly what this stamp was made from."""
        modules, tensors = _inventory(model)
        if len(tensors) != len(self.tensors) or len(modules) != len(self.modules):
            return False
        for (tensor, version, pointer, dtype, device), now in zip(self.tensors, tensors, strict=True):
            if now is not tensor or now._version != version or now.data_ptr() != pointer or now.dtype != dtype \
                    or now.device != device:
                return False
        if not all(now is module and getattr(now, "_packed_params", None) is packed
                   for (module, packed), now in zip(self.modules, modules, strict=True)):
            return False
        with torch.no_grad():
            return self.sums is None or torch.equal(self._sums(), self.sums)


def checksum(tensor: torch.Tensor) -> int:
    """The sum of a tensor's elements' bit patterns, wrapping (mod 2**32 or 2**64): any one changed element changes
    it, as does any change but one whose differences cancel exactly (a swap of two elements). One read of the
    tensor (on the CPU about 25 ms for 60M float32 values, memory-bound)."""
    with torch.no_grad():
        return int(_sum(_words(tensor)))


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their width ``[numel]`` (a view: the same storage)."""
    flat = tensor.detach().reshape(-1)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])


def _sum(words: torch.Tensor) -> torch.Tensor:
    return words.sum(dtype=torch.int64 if words.dtype is torch.int64 else torch.int32)


def _inventory(model: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """Every module of ``model`` (depth first, a shared one at each place) and every parameter and buffer of them."""
    modules: list[Any] = []
    tensors: list[torch.Tensor] = []
    pending = [model]
    while pending:
        module = pending.pop()
        modules.append(module)
        tensors.extend(t for t in module._parameters.values() if t is not None)
        tensors.extend(t for t in module._buffers.values() if t is not None)
        pending.extend(reversed([child for child in module._modules.values() if child is not None]))
    return modules, tensors
