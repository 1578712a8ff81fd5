"""The generic step: ``model(...)`` with the cache transformers made, reordered through its own API, for any
Hugging Face model (the specialized steps, :mod:`.chooser`, run only where they compute what this one computes).

Legend: B batch, K rows per example, N = B*K, V vocabulary, t tokens so far.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hf_compat import STATE_NAMES, next_step, prefill, reorder_beam_state, select_state_rows, update_kwargs


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
            if key in STATE_NAMES:  # the model's state: moved as the installed release's loop moves it
                if beam_step:
                    value = reorder_beam_state(self.model, key, value, index, self_attention_only=within_examples)
                else:
                    value = select_state_rows(value, index)
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
        outputs = prefill(model, tokens, state.generation_config, kwargs)
        state.prefilled = True
    else:
        outputs = next_step(model, tokens, kwargs)
    state.model_kwargs = update_kwargs(model, outputs, kwargs)
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
