"""Step selection for the Hugging Face adapter: the fast T5 step where it applies, else the lean T5 / GPT-2 / Llama
steps, else the generic step that calls ``model(...)`` with the cache transformers made, reordered through its own
API.

Legend: B batch, K rows per example, N = B*K, V vocabulary, t tokens so far.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..steps.gate import refusal
from . import hf_compat
from .fast_t5 import FAST_T5, FastT5State, fast_t5_reason, is_int8
from .hf_gpt2 import LeanGPT2State, lean_gpt2_reason, lean_gpt2_step
from .hf_llama import MODELS as LLAMA_LIKE
from .hf_llama import LeanLlamaState, lean_llama_reason, lean_llama_step
from .hf_t5 import LeanT5State, lean_t5_reason, lean_t5_step

LOG = logging.getLogger("beamsearch")


class HFState:
    """The model kwargs of a Hugging Face model between steps: cache, masks, encoder outputs.

    The first ``reorder(index)`` (the expansion of the B examples to their beams) is deferred until
    the prefill has run once per example; then the cache and every row-indexed tensor (rows first;
    3-d ``position_ids`` on dim 1) are expanded. Every later reorder only permutes rows within an
    example, so what is equal across an example's beams (encoder outputs, its mask, the
    cross-attention keys and values) keeps its order and only the self-attention cache and the
    decoder-side tensors are gathered, unless the index has fewer rows (finished examples left the
    batch): then everything row-indexed is gathered.
    """

    def __init__(self, model: Any, model_kwargs: dict[str, Any], generation_config: Any, exact: bool = False):
        self.model = model
        self.model_kwargs = model_kwargs
        self.generation_config = generation_config
        self.exact = exact  # exact_parity: every row computed as transformers computes it (see generate)
        self.prefilled = False
        self.expansion: torch.Tensor | None = None  # [N] example of each row, until the prefill applies it
        self.rows: int | None = None  # rows in the cache and tensors, once prefilled
        self.return_attention = False  # coverage penalties: also return the last layer's cross-attention

    def reorder(self, index: torch.Tensor) -> HFState:
        if not self.prefilled and not self.exact:
            self.expansion = index if self.expansion is None else self.expansion.index_select(0, index)
            return self
        beam_step = index.shape[0] == self.rows  # a beam search step's reorder (not an expansion, nor a removal)
        self.rows = index.shape[0]
        self._gather(index, within_examples=beam_step and not self.exact, beam_step=beam_step)
        return self

    def _gather(self, index: torch.Tensor, within_examples: bool, beam_step: bool = False) -> None:
        for key, value in list(self.model_kwargs.items()):
            if key == "cache_position" or value is None:
                continue
            if key in hf_compat.STATE_NAMES:  # the model's state: moved as the installed release's loop moves it
                if beam_step:
                    value = hf_compat.reorder_beam_state(self.model, key, value, index,
                                                         self_attention_only=within_examples)
                else:
                    value = hf_compat.select_state_rows(value, index)
                self.model_kwargs[key] = value
            elif key == "encoder_outputs":
                if within_examples or (self.exact and self.prefilled):  # the cross-attention cache holds them
                    continue
                for name, tensor in list(value.items()):
                    if isinstance(tensor, torch.Tensor):
                        value[name] = tensor.index_select(0, index)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                if within_examples and key == "attention_mask" and self.model.config.is_encoder_decoder:
                    continue
                dim = 1 if key == "position_ids" and value.dim() == 3 else 0
                self.model_kwargs[key] = value.index_select(dim, index)


def hf_step(tokens: torch.Tensor, state: HFState) -> tuple[torch.Tensor, HFState]:
    """One forward of the model on the new tokens (the whole prompt first, then one token with the cache).

    The prompt is run once per example (its beams' rows are identical then), and the results are
    expanded to the beams afterwards; with ``exact_parity`` the state is expanded first and the prompt runs on
    every row, as in transformers.
    """
    model, kwargs = state.model, state.model_kwargs
    expansion = None
    if not state.prefilled:
        expansion = state.expansion
        if expansion is not None:
            first = torch.searchsorted(expansion, torch.arange(int(expansion.max()) + 1, device=expansion.device))
            tokens = tokens.index_select(0, first)  # one row per example
        outputs = hf_compat.prefill(model, tokens, state.generation_config, kwargs)
        state.prefilled = True
    else:
        outputs = hf_compat.next_step(model, tokens, kwargs)
    state.model_kwargs = hf_compat.update_kwargs(model, outputs, kwargs)
    logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32, device=tokens.device)  # [rows, V]
    attention = None
    if state.return_attention:
        attention = outputs.cross_attentions[-1][:, :, -1, :].mean(dim=1).float()  # [rows, S], heads averaged
    if expansion is not None and expansion.shape[0] > outputs.logits.shape[0]:  # (one row per example: nothing)
        state._gather(expansion, within_examples=False)
        logits = logits.index_select(0, expansion.to(logits.device))  # [N, V]
        attention = None if attention is None else attention.index_select(0, expansion.to(attention.device))
    state.rows = logits.shape[0]
    return (logits, state) if attention is None else (logits, state, attention)


hf_step.fresh_logits = True  # a copy of the model's output (see loop.decode)


def model_step(model, model_kwargs, config, options, needs_attention, lean_step=None, share_encoder_state=False,
               compile_step=False, exact_parity=False, fast=None):
    """The step function and state.

    ``lean_step=None`` (the default): the fast T5 step where it can run (a float32 T5 model and call: packed weights,
    fused products, its own attention; equal to float rounding, ``fast_t5.py``), else a lean step (T5, GPT-2, Llama,
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
    """The fast T5 step and its state (the call has passed :func:`fast_call_reason`)."""
    if share_encoder_state:
        raise ValueError("lean_step='fast' already attends to an example's encoder state once for its K rows: "
                         "leave share_encoder_state unset")
    if compile_step == "static":
        raise ValueError("lean_step='fast' has no fixed-shape variant: use compile_step=True or False")
    encoded = model_kwargs["encoder_outputs"].last_hidden_state
    return lean_t5_step, FastT5State(model, encoded, model_kwargs.get("attention_mask"), options.max_length)


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


def request_cross_attention(model: Any, state: HFState) -> None:
    """Coverage penalties and alignments need the decoder's attention over the source at every step."""
    if not model.config.is_encoder_decoder:
        raise ValueError("coverage_penalty / output_alignments need an encoder-decoder model (attention over a "
                         "source)")
    implementation = getattr(model.config, "_attn_implementation", "eager")
    if implementation != "eager":
        raise ValueError(
            f"coverage_penalty / output_alignments need attention weights, which {implementation!r} attention "
            "does not return: "
            "load the model with attn_implementation='eager'"
        )
    state.model_kwargs["output_attentions"] = True
    state.return_attention = True


def compile_options() -> dict[str, Any]:
    """Inductor options for ``compile_step``: its C++ kernels use the vector width ``ATEN_CPU_CAPABILITY`` asks
    ATen for. Inductor picks the CPU's widest ISA on its own while its vector headers follow ATen's capability;
    with torch 2.13 the mismatch fails to compile (``default``: ``at::vec`` not declared) or, worse, computes
    garbage (``avx2`` on an AVX-512 CPU: scores off by 1e24)."""
    width = {"default": 1, "avx2": 256, "avx512": 512}.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    return {"options": {"cpp.simdlen": width}} if width else {}
