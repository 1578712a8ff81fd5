"""The result of a search: tensors, with views for Hugging Face output classes and JSON.

Legend: B batch, n returned hypotheses per example, T total length (start tokens included),
T' = T - prompt_length generated positions, N rows decoded per step, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch


class FinishReason(enum.IntEnum):
    """Why a hypothesis ended; stored as integer codes in :attr:`SearchResult.finish_reason`."""

    NONE = 0  # still running when the search stopped (e.g. another example hit max_time)
    EOS = 1  # it produced an end-of-sequence token
    MAX_LENGTH = 2  # it reached max_length / max_new_tokens
    STOP_CRITERION = 3  # a stop string, max_time or a user stopping criterion


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """Everything a search returns.

    Attributes:
        sequences: LongTensor ``[B, n, T]``, start tokens included, padded with the fill token.
        sequences_scores: FloatTensor ``[B, n]``: the score used for ranking (for beam search,
            the sum of log-probs divided by ``generated_length ** length_penalty``).
        sum_log_probs: FloatTensor ``[B, n]``: the raw sum of the chosen tokens' log-probs.
        token_log_probs: FloatTensor ``[B, n, T']``: each chosen token's log-prob, 0 after the end.
        lengths: LongTensor ``[B, n]``: total length of each hypothesis (start tokens and EOS included).
        finish_reason: LongTensor ``[B, n]`` of :class:`FinishReason` codes.
        prompt_length: number of start tokens.
        scores: per step, the processed scores ``[N, V]`` (only with ``output_scores``).
        logits: per step, the raw logits ``[N, V]`` (only with ``output_logits``).
        beam_indices: LongTensor ``[B, n, T']`` of the flat row each token was chosen from (beam
            search only), -1 after the end.
        alignments: FloatTensor ``[B, n, T', S]`` (only with ``output_alignments``): for each generated token,
            the attention over the S source positions of the step that chose it, along the hypothesis' own beam
            history; 0 after the end.
        unmet_constraints: LongTensor ``[B, n]`` (only with ``force_words_ids``): how many constraints each
            hypothesis misses (0 unless it reached the length limit first).
        search_trace: the :class:`~beamsearch.trace.SearchTrace` (only with ``trace=True``).
    """

    sequences: torch.Tensor
    sequences_scores: torch.Tensor
    sum_log_probs: torch.Tensor
    token_log_probs: torch.Tensor
    lengths: torch.Tensor
    finish_reason: torch.Tensor
    prompt_length: int
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.Tensor | None = None
    alignments: torch.Tensor | None = None
    unmet_constraints: torch.Tensor | None = None
    search_trace: Any = None

    @property
    def best(self) -> torch.Tensor:
        """LongTensor ``[B, T]``: the best hypothesis of each example."""
        return self.sequences[:, 0]

    def to_dicts(self, decode: Any = None) -> list[list[dict[str, Any]]]:
        """A JSON-ready view: per example, per hypothesis, its tokens, score, log-probs and finish reason.

        Args:
            decode: optional callable turning a list of generated token ids into text.
        """
        out = []
        for b in range(self.sequences.shape[0]):
            hyps = []
            for j in range(self.sequences.shape[1]):
                length = int(self.lengths[b, j])
                generated = self.sequences[b, j, self.prompt_length : length].tolist()
                hyp = {
                    "tokens": generated,
                    "score": float(self.sequences_scores[b, j]),
                    "sum_log_probs": float(self.sum_log_probs[b, j]),
                    "token_log_probs": self.token_log_probs[b, j, : len(generated)].tolist(),
                    "finish_reason": FinishReason(int(self.finish_reason[b, j])).name.lower(),
                }
                if self.unmet_constraints is not None:
                    hyp["unmet_constraints"] = int(self.unmet_constraints[b, j])
                if self.alignments is not None:  # per generated token, its attention over the source
                    hyp["alignment"] = self.alignments[b, j, : len(generated)].tolist()
                if decode is not None:
                    hyp["text"] = decode(generated)
                hyps.append(hyp)
            out.append(hyps)
        return out


def concatenate(results: list[SearchResult], fill_token_id: int, rows_per_example: int) -> SearchResult:
    """One result from the results of consecutive sub-batches (same start-token width), in order.

    Sequences and per-token tensors are padded to the longest; ``beam_indices`` rows are shifted by the
    rows of the sub-batches before. Per-step ``scores`` / ``logits`` cannot be joined (the sub-batches
    ran different numbers of steps), so they must be absent.
    """
    if any(r.scores is not None or r.logits is not None for r in results):
        raise ValueError("per-step scores or logits cannot be joined across sub-batches")
    width = max(r.sequences.shape[-1] for r in results)
    generated = width - results[0].prompt_length

    def pad(tensor: torch.Tensor, size: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, size - tensor.shape[-1]), value=value)

    beam_indices = None
    if results[0].beam_indices is not None:
        shifted, offset = [], 0
        for r in results:
            shifted.append(pad(torch.where(r.beam_indices >= 0, r.beam_indices + offset, -1), generated, -1))
            offset += r.sequences.shape[0] * rows_per_example
        beam_indices = torch.cat(shifted)
    alignments = None
    if results[0].alignments is not None:  # [b, n, T', S]: pad the generated and the source positions
        source = max(r.alignments.shape[-1] for r in results)
        alignments = torch.cat([torch.nn.functional.pad(
            r.alignments, (0, source - r.alignments.shape[-1], 0, generated - r.alignments.shape[-2]))
            for r in results])
    return SearchResult(
        sequences=torch.cat([pad(r.sequences, width, fill_token_id) for r in results]),
        sequences_scores=torch.cat([r.sequences_scores for r in results]),
        sum_log_probs=torch.cat([r.sum_log_probs for r in results]),
        token_log_probs=torch.cat([pad(r.token_log_probs, generated, 0.0) for r in results]),
        lengths=torch.cat([r.lengths for r in results]),
        finish_reason=torch.cat([r.finish_reason for r in results]),
        prompt_length=results[0].prompt_length,
        beam_indices=beam_indices,
        alignments=alignments,
        unmet_constraints=None if results[0].unmet_constraints is None else torch.cat(
            [r.unmet_constraints for r in results]),
    )
