"""The chooser: which step runs a call, the gate (``gate.py``) asked first.

Eager calls (:func:`model_step`): the fast T5 step where it applies, else the lean T5 / GPT-2 / Llama / Qwen2 /
Mistral step, else the generic step (``generic.py``) that calls ``model(...)`` with the cache transformers made.
Captured calls (``cuda_graphs=True``; :func:`check_graph_call`, then :func:`graph_state`): the graph-safe T5, GPT-2
or Llama step, or a refusal that names why. docs/steps.md has the whole table (architecture x device x dtype x
options -> step) and how to add an architecture.

Legend: B batch, K rows per example, N = B*K, V vocabulary, t tokens so far.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..options import SearchOptions
from .gate import refusal
from .generic import HFState, hf_step, request_cross_attention
from .gpt2.graph import GRAPH_GPT2, GraphGPT2
from .gpt2.lean import LeanGPT2State, lean_gpt2_reason, lean_gpt2_step
from .llama.graph import GRAPH_LLAMA, GraphLlama
from .llama.lean import MODELS as LLAMA_LIKE
from .llama.lean import LeanLlamaState, lean_llama_reason, lean_llama_step
from .padding import pad_examples
from .t5.fast import FAST_T5, FastT5State, fast_t5_reason, is_int8
from .t5.graph import GRAPH_T5, GraphT5
from .t5.lean import LeanT5State, lean_t5_reason, lean_t5_step
from .t5.native import native_reason

LOG = logging.getLogger("beamsearch")


def model_step(model, model_kwargs, config, options, needs_attention, lean_step=None, share_encoder_state=False,
               compile_step=False, exact_parity=False, fast=None):
    """The step function and state.

    ``lean_step=None`` (the default): the fast T5 step where it can run (a float32 T5 model and call: packed weights,
    fused products, its own attention; equal to float rounding, ``t5/fast.py``), else a lean step (T5, GPT-2, Llama,
    Qwen2, Mistral; the model's own kernels) where one applies, else the generic one that calls ``model(...)``.
    ``True``: a lean step or an error; ``"fast"``: the fast T5 step (int8 models too) or an error; ``False``: the
    generic step. Every specialized step runs only where the model passes its gate (``steps/gate.py``: the modules it
    computes itself are the model's own, unhooked; else the step that calls them runs, and ``lean_step=True`` or
    ``"fast"`` raise with the gate's reason).
    ``share_encoder_state`` (lean T5 step only): an example's beams attend to its cross-attention keys and values in
    one kernel call (not bitwise). ``compile_step``: the step's decoder runs under ``torch.compile`` (``True``:
    dynamic shapes, the lean step unless ``lean_step="fast"``; ``"static"``: the lean fixed-shape step, the same
    shapes at every step). ``exact_parity``: the generic step on transformers' rows (prompt and cache on every
    beam's row, the whole cache reordered), so that each forward has the shapes of ``model.generate``'s.
    ``fast``: whether the caller found the fast step can run this call (:func:`fast_refusal` and
    :func:`fast_call_reason`, once per call); None: found here."""
    if lean_step is not None and not isinstance(lean_step, bool) and lean_step != "fast":
        raise ValueError(f"lean_step must be None, True, False or 'fast', got {lean_step!r}")
    if not isinstance(share_encoder_state, bool):
        raise ValueError(f"share_encoder_state must be True or False, got {share_encoder_state!r}")
    if not isinstance(compile_step, bool) and compile_step != "static":
        raise ValueError(f"compile_step must be True, False or 'static', got {compile_step!r}")
    fixed_shape = compile_step == "static"
    if exact_parity:
        for name, value in (("lean_step", lean_step), ("share_encoder_state", share_encoder_state),
                            ("compile_step", compile_step)):
            if value:
                raise ValueError(f"exact_parity=True runs the generic step as transformers does: it cannot be "
                                 f"combined with {name}={value!r}")
        lean_step = False
    if lean_step == "fast" or (lean_step is None and fast is not False):
        reason = None if fast else fast_refusal(model, lean_step, share_encoder_state, compile_step) \
            or fast_call_reason(model, model_kwargs, needs_attention, gated=True)
        if lean_step == "fast" and reason is not None:
            raise ValueError(f"lean_step='fast' cannot run this call: {reason}")
        if reason is None:
            lean_step = "fast"
        else:
            _explain("the fast T5 step", reason)
    if lean_step is False:
        reason = "lean_step=False was given"
    else:
        if lean_step == "fast":
            step, state = _fast_step(model, model_kwargs, options, share_encoder_state, compile_step)
            reason = None
        else:
            step, state, reason = _lean_step(model, model_kwargs, config, options, needs_attention,
                                             share_encoder_state, fixed_shape)
        if reason is None:
            if compile_step:
                state.decode = torch.compile(state.decode, dynamic=None if fixed_shape else True,
                                             **compile_options())
            return step, state
        _explain("a lean step", reason)
    if share_encoder_state:
        raise ValueError(f"share_encoder_state=True needs the lean T5 step, which cannot run this call: {reason}")
    if compile_step:
        raise ValueError(f"compile_step={compile_step!r} needs a lean step (T5, GPT-2, Llama, Qwen2, Mistral), which "
                         f"cannot run this call: {reason}")
    if lean_step:
        raise ValueError(f"lean_step=True cannot run this call: {reason}")
    state = HFState(model, model_kwargs, config, exact=exact_parity)
    if needs_attention:
        request_cross_attention(model, state)
    return hf_step, state


def _explain(step: str, reason: str) -> None:
    """Say at debug level why the default choice passed over ``step`` (``logging.getLogger("beamsearch")``)."""
    LOG.debug("beamsearch.generate: %s does not run this call: %s", step, reason)


def fast_model_reason(model: Any) -> str | None:
    """Why the fast T5 step cannot run this model whatever the call (None: it can): a T5 / mT5 model in eval mode,
    float32 or int8, passing the fast step's gate (``FAST_T5``: every module the model's own, unhooked); a call may
    still refuse it (:func:`fast_call_reason`)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ("t5", "mt5"):
        return f"model_type {model_type!r} is not T5"
    if model.training:
        return "the model is in training mode (dropout)"
    return lean_t5_reason(model, {"encoder_outputs": True}, False, plan=None) or fast_t5_reason(model) \
        or refusal(model, FAST_T5)


def fast_capable(model: Any) -> bool:
    """Whether the fast T5 step can run this model (:func:`fast_model_reason` is None)."""
    return fast_model_reason(model) is None


def default_fast(model: Any, share_encoder_state: bool = False, compile_step: bool | str = False) -> bool:
    """Whether ``lean_step=None`` takes the fast T5 step on this model (:func:`fast_refusal` is None)."""
    return fast_refusal(model, None, share_encoder_state, compile_step) is None


def fast_refusal(model: Any, lean_step: Any = None, share_encoder_state: bool = False,
                 compile_step: bool | str = False, exact_parity: bool = False) -> str | None:
    """Why this call's step options and model do not lead to the fast T5 step (None: they do where the call's inputs
    allow, :func:`fast_call_reason`; then the adapter runs the encoder the fast way too,
    :func:`~.fast_t5.fast_encoder`).

    ``lean_step="fast"`` asks for it on any model it can run (int8 too). ``lean_step=None`` takes it for a float32
    T5 / mT5 model on the CPU that it can run, without an option of the lean step's (``share_encoder_state``,
    ``compile_step``; compiling the fast step is opt-in, ``lean_step="fast"``). int8 models keep the lean step,
    whose products are the quantized model's own (the fast step requantizes per output row: other results); so do
    models on a GPU, where the fast step (built and measured for CPU kernels) has not been measured against the lean
    one."""
    if exact_parity:
        return "exact_parity=True runs the generic step"
    if lean_step == "fast":
        return fast_model_reason(model)
    if lean_step is not None:
        return f"lean_step={lean_step!r} was given"
    if share_encoder_state or compile_step:
        return "share_encoder_state / compile_step ask for the lean step"
    if getattr(model.config, "model_type", None) not in ("t5", "mt5"):
        return "the fast step runs T5 models"
    weight = model.decoder.embed_tokens.weight
    if weight.device.type != "cpu":
        return f"the model is on {weight.device.type} (the fast step is the default on the CPU)"
    if is_int8(model.decoder.block[0].layer[0].SelfAttention.q):
        return "an int8 model keeps the lean step unless lean_step='fast' is given"
    return fast_model_reason(model)


def fast_call_reason(model: Any, model_kwargs: dict[str, Any], needs_attention: bool, gated: bool = False
                     ) -> str | None:
    """Why the fast T5 step cannot run this model and call (None: it can); ``gated``: the model has passed
    :func:`fast_model_reason` in this call already (its gate is not walked again)."""
    if gated:
        return lean_t5_reason(model, model_kwargs, needs_attention, plan=None)
    return lean_t5_reason(model, model_kwargs, needs_attention, plan=None) or fast_model_reason(model)


def _fast_step(model, model_kwargs, options, share_encoder_state, compile_step):
    """The fast T5 step and its state (the call has passed :func:`fast_call_reason`): native (one C++ call per
    step, ``t5/native.py``) where the extension is available and runs the model, else eager."""
    if share_encoder_state:
        raise ValueError("lean_step='fast' already attends to an example's encoder state once for its K rows: "
                         "leave share_encoder_state unset")
    if compile_step == "static":
        raise ValueError("lean_step='fast' has no fixed-shape variant: use compile_step=True or False")
    encoded = model_kwargs["encoder_outputs"].last_hidden_state
    native = "compile_step asks for the eager fast step under torch.compile" if compile_step else \
        native_reason(model)
    if native is not None:
        _explain("the native fast T5 step (one C++ call per step)", native)
    return lean_t5_step, FastT5State(model, encoded, model_kwargs.get("attention_mask"), options.max_length,
                                     native=native is None)


def _lean_step(model, model_kwargs, config, options, needs_attention, share_encoder_state, fixed_shape=False):
    """The lean step and its state for this model and call: ``(step, state, None)``, or ``(None, None, why not)``.
    ``fixed_shape``: the state's ``decode`` takes the position as a tensor (``compile_step="static"``)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type == "gpt2" and not share_encoder_state:
        reason = lean_gpt2_reason(model, model_kwargs, needs_attention)
        if reason is None:
            state = LeanGPT2State(model, model_kwargs, config, options.max_length, fixed_shape=fixed_shape)
            return lean_gpt2_step, state, None
    elif model_type in LLAMA_LIKE and not share_encoder_state:
        reason = lean_llama_reason(model, model_kwargs, needs_attention)
        if reason is None:
            state = LeanLlamaState(model, model_kwargs, config, options.max_length, fixed_shape=fixed_shape)
            return lean_llama_step, state, None
    else:
        reason = lean_t5_reason(model, model_kwargs, needs_attention)
        if reason is None:
            encoded = model_kwargs["encoder_outputs"].last_hidden_state
            state = LeanT5State(model, encoded, model_kwargs.get("attention_mask"), options.max_length,
                                share_encoder_state=share_encoder_state, fixed_shape=fixed_shape)
            return lean_t5_step, state, None
    return None, None, reason


def compile_options() -> dict[str, Any]:
    """Inductor options for ``compile_step``: its C++ kernels use the vector width ``ATEN_CPU_CAPABILITY`` asks
    ATen for. Inductor picks the CPU's widest ISA on its own while its vector headers follow ATen's capability;
    with torch 2.13 the mismatch fails to compile (``default``: ``at::vec`` not declared) or, worse, computes
    garbage (``avx2`` on an AVX-512 CPU: scores off by 1e24)."""
    width = {"default": 1, "avx2": 256, "avx512": 512}.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    return {"options": {"cpp.simdlen": width}} if width else {}


# the captured path (cuda_graphs=True): what a captured step cannot do, refused by name before anything runs.
# A CUDA graph replays device work only: anything that needs the host at every step (a user's processor or stopping
# criterion, stop strings, the clock of max_time, a callback) or a shape that changes with the data (n-gram tables,
# constraints) cannot be inside it. The graph path runs greedy search and transformers' beam search with the
# processors that depend on the length only (graphs/processors.py), on the models a graph-safe step runs.
_HOST = "it needs the host at every step"
# option -> (the value that changes nothing, why the graph path cannot take another)
OPTIONS: dict[str, tuple[Any, str]] = {
    "do_sample": (False, "sampling is not captured (its random draws); greedy and beam search are"),
    "num_beam_groups": (1, "diverse beam search is not captured"),
    "stochastic_beam_search": (False, "stochastic beam search is not captured"),
    "exact_search": (False, "exact search grows a tree on the host"),
    "semantics": ("hf", "only transformers' beam search is captured"),
    "output_scores": (False, "per-step scores are kept on the host, one tensor per step"),
    "output_logits": (False, "per-step logits are kept on the host, one tensor per step"),
    "max_time": (None, "the clock is read on the host"),
    "stop_strings": (None, f"stop strings are matched on the host ({_HOST})"),
    "repetition_penalty": (1.0, "its processor gathers the tokens so far (a length that grows)"),
    "no_repeat_ngram_size": (0, "its processor builds n-gram tables on the host"),
    "encoder_repetition_penalty": (1.0, "its processor is not captured"),
    "encoder_no_repeat_ngram_size": (0, "its processor builds n-gram tables on the host"),
    "bad_words_ids": (None, "its processor matches token sequences of a growing length"),
    "coverage_penalty": ("none", "attention outputs are not captured"),
}
# search arguments (beamsearch.generate's keywords) -> why
ARGUMENTS: dict[str, str] = {
    "prefix_allowed_tokens_fn": f"the function is called on the host ({_HOST})",
    "target_prefix": "per-example prefixes are not captured",
    "force_words_ids": "constraints (force_words_ids) keep per-hypothesis state of changing size",
    "sequence_scorer": f"the scorer is called on the host ({_HOST})",
    "unique": "the de-duplicated pool compares hypotheses on the host",
    "output_alignments": "attention outputs are not captured",
    "trace": "the search trace is recorded on the host",
    "stream_to": "a streamer is called on the host (streamer=)",
    "incumbent": "exact search grows a tree on the host",
}
# the other step options of beamsearch.generate -> the value that combines with cuda_graphs=True
STEP_OPTIONS: dict[str, Any] = {"lean_step": (None, True), "share_encoder_state": (False,),
                                "compile_step": (False,), "exact_parity": (False,)}


def check_graph_call(options: SearchOptions, arguments: dict[str, Any], step_options: dict[str, Any],
                     logits_processor: Any, stopping_criteria: Any) -> None:
    """Refuse a call the graph path cannot run, naming what (:func:`graph_options_reason`).

    Raises:
        ValueError: ``cuda_graphs=True cannot capture NAME: why``.
    """
    reason = graph_options_reason(options, arguments, step_options, logits_processor, stopping_criteria)
    if reason is not None:
        raise ValueError(f"cuda_graphs=True {reason}")


def graph_options_reason(options: SearchOptions, arguments: dict[str, Any], step_options: dict[str, Any],
                         logits_processor: Any, stopping_criteria: Any) -> str | None:
    """What in a call the graph path cannot run (``cannot capture NAME: why``), or None.

    Args:
        options: the search options.
        arguments: :func:`beamsearch.search`'s keyword arguments of the call (``target_prefix``, ``trace``, ...).
        step_options: ``lean_step``, ``share_encoder_state``, ``compile_step``, ``exact_parity`` as given.
        logits_processor, stopping_criteria: the caller's own (any is refused).
    """
    if logits_processor:
        return f"cannot capture logits_processor: user processors run on the host ({_HOST}); leave cuda_graphs " \
               f"unset for them"
    if stopping_criteria:
        return f"cannot capture stopping_criteria: user criteria run on the host ({_HOST}); leave cuda_graphs " \
               f"unset for them"
    for name, (neutral, why) in OPTIONS.items():
        value = getattr(options, name)
        if value != neutral:
            return f"cannot capture {name}={value!r}: {why}"
    for name, why in ARGUMENTS.items():
        value = arguments.get(name)
        if value is not None and value is not False and value != 0.0:
            return f"cannot capture {name}: {why}"
    for name, allowed in STEP_OPTIONS.items():
        value = step_options.get(name, allowed[0])
        if not any(value is a for a in allowed):
            return f"runs its own fixed-shape step: it cannot be combined with {name}={value!r}"
    return None


def graph_model_reason(model: Any, model_kwargs: dict[str, Any]) -> str | None:
    """Why no graph-safe step runs this model and call (None: one does): the family's lean step must take the call,
    and the model pass the graph-safe step's gate (strict: no hook, nothing from outside torch and transformers)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type == "gpt2":
        return lean_gpt2_reason(model, model_kwargs, False, plan=GRAPH_GPT2)
    if model_type in LLAMA_LIKE:  # Llama, Qwen2, Mistral (without a sliding window): Llama's layers
        return lean_llama_reason(model, model_kwargs, False, plan=GRAPH_LLAMA)
    return lean_t5_reason(model, model_kwargs, False, plan=GRAPH_T5)


def graph_call_reason(model: Any, setup: dict[str, Any], options: SearchOptions, arguments: dict[str, Any],
                      step_options: dict[str, Any], logits_processor: Any, stopping_criteria: Any) -> str | None:
    """Why the graph path cannot run this call (None: it can), for the automatic choice on CUDA
    (``cuda_graphs=None``): :func:`graph_options_reason`, else :func:`graph_model_reason`."""
    return graph_options_reason(options, arguments, step_options, logits_processor, stopping_criteria) \
        or graph_model_reason(model, setup["model_kwargs"])


def graph_state(model: Any, setup: dict[str, Any], config: Any, rows: int, capacity: int, bucket: int,
                cache: Any = None) -> Any:
    """The graph-safe model state of the call, for a bucket of ``bucket`` examples of ``rows`` rows each, its cache
    of ``capacity`` positions (``cache``: a kept one to fill, or None for a new one).

    Raises:
        ValueError: the model is not one the graph path runs, or this call is not one its lean step takes, or the
            model does not pass the graph-safe step's gate (why).
    """
    kwargs, input_ids = setup["model_kwargs"], setup["input_ids"]
    reason = graph_model_reason(model, kwargs)
    if reason is not None:
        raise ValueError("cuda_graphs=True runs T5, GPT-2, Llama, Qwen2 and Mistral models through a graph-safe "
                         f"step, which cannot run this call: {reason}")
    model_type = getattr(model.config, "model_type", None)
    if model_type == "gpt2":
        return GraphGPT2(LeanGPT2State(model, kwargs, config, input_ids.shape[1] + 1), input_ids, bucket, rows,
                         capacity, cache)
    if model_type in LLAMA_LIKE:
        return GraphLlama(LeanLlamaState(model, kwargs, config, input_ids.shape[1] + 1), input_ids, bucket, rows,
                          capacity, cache)
    hidden = pad_examples(kwargs["encoder_outputs"].last_hidden_state, bucket)
    state = GraphT5(model, hidden, pad_examples(kwargs.get("attention_mask"), bucket), rows, capacity, cache)
    state.prime(pad_examples(input_ids, bucket))
    return state
