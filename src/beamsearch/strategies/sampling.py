"""Greedy search and multinomial sampling: each row extends independently, with no competition.

Semantics are those of Hugging Face ``_sample``: processors act on raw logits, the token is the
argmax (greedy) or one multinomial draw from ``softmax(scores)`` (sampling), finished rows are
padded, and the search stops when every row has hit a stopping criterion.

Legend: B batch, K rows per example (``num_return_sequences`` samples), N = B*K, V vocabulary,
L = max_length, t tokens so far, t0 start tokens.
"""

from __future__ import annotations

import torch

from ..beams import unflatten_beams
from ..compaction import ActiveExamples
from ..processors.pipeline import run_processors
from ..results import FinishReason, SearchResult
from ..scoring import hf_length_normalised
from ..stopping import classify_stop
from .base import StepTrace
from .score_checks import ScoreWatch, sample

# [N, ...] row tensors; all make up the result and all are compacted when examples leave.
_RESULTS = ("sequences", "unfinished", "lengths", "token_log_probs", "finish_reason")


class SamplingSearch:
    """One row per hypothesis; ``do_sample=False`` is greedy search."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        rows_per_example: int,
        max_length: int,
        processors,
        criteria,
        *,
        do_sample: bool,
        eos_token_id: tuple[int, ...] | None,
        pad_token_id: int,
        length_penalty: float,
        trace: StepTrace,
        remove_finished: bool = False,
        output_alignments: bool = False,
    ):
        batch_size, prompt_length = input_ids.shape
        rows = input_ids.repeat_interleave(rows_per_example, dim=0)  # [N, t0]
        device = input_ids.device
        self.rows_per_example = rows_per_example
        self.batch_size = batch_size
        self.prompt_length = prompt_length
        self.max_length = max_length
        self.processors = processors
        self.criteria = criteria
        self.do_sample = do_sample
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.length_penalty = length_penalty
        self.trace = trace
        n = rows.shape[0]
        self.sequences = torch.full((n, max(max_length, prompt_length)), pad_token_id, dtype=torch.long, device=device)
        self.sequences[:, :prompt_length] = rows  # [N, L]
        self.length = prompt_length
        self.unfinished = torch.ones(n, dtype=torch.bool, device=device)  # [N]
        self.lengths = torch.full((n,), prompt_length, dtype=torch.long, device=device)  # [N]
        self.token_log_probs = torch.zeros(n, max(max_length - prompt_length, 0), device=device)  # [N, L-t0]
        self.finish_reason = torch.zeros(n, dtype=torch.long, device=device)  # [N]
        self._done = max_length <= prompt_length
        # examples whose rows all finished leave the batch (greedy only: sampling would draw differently)
        removal = remove_finished and not do_sample
        self.keep_alignments = output_alignments
        self.alignments: torch.Tensor | None = None  # [N, L - t0, S], allocated at the first step
        names = _RESULTS + (("alignments",) if output_alignments else ())
        self.active = ActiveExamples(batch_size, device, names, names, rows_per_example) if removal else None
        self.watch = ScoreWatch()  # NaN in the chosen tokens' log-probs, read with the step's host sync

    def tokens(self) -> torch.Tensor:
        return self.sequences[:, : self.length]  # [N, t]

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> None:
        """One step: process, pick a token per row, pad finished rows, update stopping state."""
        tokens = self.tokens()
        # owned logits are masked in place, unless the trace keeps them (it records them after processing)
        scores = run_processors(self.processors, tokens, logits, owned and self.trace.logits is None)  # [N, V]
        self.trace.record(scores, logits)
        position = self.length - self.prompt_length
        self.watch.start(position, logits, scores, None if self.active is None else self.active.ids)
        if self.do_sample:
            next_tokens, invalid = sample(torch.softmax(scores, dim=-1), 1)  # [N, 1], [N]: rows with no distribution
            next_tokens = next_tokens.squeeze(1)  # [N]
        else:
            # the argmax, through max: the same first index on ties and NaNs, several times faster on CPU
            best, next_tokens = scores.max(dim=-1)  # [N]
        if self.eos_token_id is not None:
            next_tokens = torch.where(self.unfinished, next_tokens, self.pad_token_id)
        log_probs = torch.log_softmax(scores, dim=-1).gather(1, next_tokens[:, None]).squeeze(1)  # [N]
        if not self.do_sample:  # every token masked: token 0, as transformers' argmax, and log-prob -inf (not NaN)
            log_probs.masked_fill_(best == float("-inf"), float("-inf"))
        self.token_log_probs[:, position] = torch.where(self.unfinished, log_probs, 0.0)
        if not self.do_sample:  # any NaN left is a NaN or +inf in the row (see score_checks), fatal in a running row
            invalid = torch.isnan(self.token_log_probs[:, position])  # [N]
        k = self.rows_per_example
        self.watch.flag(invalid if k == 1 else invalid.reshape(-1, k).any(dim=1))  # [B']
        if self.keep_alignments:
            self._record_alignments(attention, position)
        self.sequences[:, self.length] = next_tokens
        self.length += 1
        self.lengths += self.unfinished.long()
        stopped = self.criteria(self.tokens(), self.trace.scores)  # [N]
        reasons = classify_stop(self.tokens(), stopped & self.unfinished, self.eos_token_id, self.max_length)
        self.finish_reason = torch.where(stopped & self.unfinished, reasons, self.finish_reason)
        self.unfinished = self.unfinished & ~stopped
        return None if self.active is None else self._remove_done()

    def _record_alignments(self, attention: torch.Tensor | None, position: int) -> None:
        if attention is None:
            raise ValueError("output_alignments needs the step function to return (logits, state, attention [N, S])")
        attention = attention.float()
        if self.alignments is None:
            self.alignments = attention.new_zeros(attention.shape[0], self.token_log_probs.shape[1], attention.shape[1])
        self.alignments[:, position] = torch.where(self.unfinished[:, None], attention, 0.0)

    def _remove_done(self) -> torch.Tensor | None:
        """Drop the examples whose rows all finished (the step's one host sync); their rows' results are final."""
        k = self.rows_per_example
        done = self.watch.read(~self.unfinished.reshape(-1, k).any(dim=1))  # [B']
        self._done = self._done or all(done)
        if self._done or not any(done):
            return None
        keep = self.active.drop(self, done)
        rows = self.active.entries(keep)  # [N'']
        self.processors = self.processors.select_rows(rows)
        return rows

    def is_done(self) -> bool:
        if self.active is not None or self._done:  # advance() decided
            return self._done
        return not self.watch.read(self.unfinished.any().reshape(1))[0]

    def result(self) -> SearchResult:
        self.watch.close()
        if self.active is not None:
            self.active.finish(self)
        b, k = self.batch_size, self.rows_per_example
        sum_log_probs = self.token_log_probs.sum(dim=1)  # [N]
        generated = (self.lengths - self.prompt_length).clamp(min=1).to(sum_log_probs.dtype)
        scores, logits = self.trace.as_tuples()
        finish_reason = torch.where(self.unfinished, int(FinishReason.NONE), self.finish_reason)
        return SearchResult(
            sequences=unflatten_beams(self.tokens(), b),
            sequences_scores=unflatten_beams(hf_length_normalised(sum_log_probs, generated, self.length_penalty), b),
            sum_log_probs=unflatten_beams(sum_log_probs, b),
            token_log_probs=unflatten_beams(self.token_log_probs[:, : self.length - self.prompt_length], b),
            lengths=unflatten_beams(self.lengths, b),
            finish_reason=unflatten_beams(finish_reason, b).reshape(b, k),
            prompt_length=self.prompt_length,
            scores=scores,
            logits=logits,
            alignments=None if self.alignments is None else unflatten_beams(
                self.alignments[:, : self.length - self.prompt_length], b),
        )
