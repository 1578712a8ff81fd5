"""Greedy search and multinomial sampling: each row extends independently, with no competition.

Semantics are those of Hugging Face ``_sample``: processors act on raw logits, the token is the
argmax (greedy) or one multinomial draw from ``softmax(scores)`` (sampling), finished rows are
padded, and the search stops when every row has hit a stopping criterion.

Legend: B batch, K rows per example (``num_return_sequences`` samples), N = B*K, V vocabulary,
L = max_length, t tokens so far, t0 start tokens.
"""

from __future__ import annotations

import torch

from ..beams import example_rows, flatten_beams
from ..compaction import ActiveExamples
from ..processors.pipeline import run_processors
from ..results import FinishReason, SearchResult
from ..scoring import hf_length_normalised
from ..stopping import classify_stop
from .base import StepTrace
from .native_search import native_greedy_reason, native_greedy_update
from .pool import Hypotheses, PoolSearch
from .score_checks import sample


class SamplingSearch(PoolSearch):
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
        super().__init__(input_ids, rows_per_example, max_length, processors, criteria, trace)
        (b, prompt_length), k, device = input_ids.shape, rows_per_example, input_ids.device
        self.do_sample, self.eos_token_id, self.pad_token_id = do_sample, eos_token_id, pad_token_id
        self.length_penalty = length_penalty
        # the K rows of each example; "lengths" [B, K] counts the tokens of a row until it finished, "running"
        # [B, K] says which rows have not (the tokens after the end are pad tokens, their log-probs 0)
        self.live = Hypotheses.start(
            input_ids, k, max_length, pad_token_id,
            running=torch.ones(b, k, dtype=torch.bool, device=device),
            lengths=torch.full((b, k), prompt_length, dtype=torch.long, device=device),
            reasons=torch.zeros(b, k, dtype=torch.long, device=device)).replace(beam_indices=None)
        self._done = max_length <= prompt_length
        # examples whose rows all finished leave the batch (greedy only: sampling would draw differently)
        removal = remove_finished and not do_sample
        self.keep_alignments = output_alignments  # the field "alignments" [B, K, G, S], added at the first step
        self.active = ActiveExamples(b, device) if removal else None
        self.native: bool | None = None  # the bookkeeping in one C++ call (native_search.py), decided at the first step

    def advance(self, logits: torch.Tensor, attention: torch.Tensor | None = None, owned: bool = False) -> None:
        """One step: process, pick a token per row, pad finished rows, update stopping state."""
        rows, tokens = self.live, self.tokens()
        b = rows.running.shape[0]  # B': the active examples
        running = rows.running.reshape(-1)  # [N]
        # owned logits are masked in place, unless the trace keeps them (it records them after processing)
        scores = run_processors(self.processors, tokens, logits, owned and self.trace.logits is None)  # [N, V]
        self.trace.record(scores, logits)
        position = self.length - self.prompt_length
        self.watch.start(position, logits, scores, None if self.active is None else self.active.ids)
        if self.native is None:
            self.native = native_greedy_reason(self) is None
        if self.native:
            return self._leave(native_greedy_update(self, scores))
        if self.do_sample:
            next_tokens, invalid = sample(torch.softmax(scores, dim=-1), 1)  # [N, 1], [N]: rows with no distribution
            next_tokens = next_tokens.squeeze(1)  # [N]
        else:
            # the argmax, through max: the same first index on ties and NaNs, several times faster on CPU
            best, next_tokens = scores.max(dim=-1)  # [N]
        if self.eos_token_id is not None:
            next_tokens = torch.where(running, next_tokens, self.pad_token_id)
        log_probs = torch.log_softmax(scores, dim=-1).gather(1, next_tokens[:, None]).squeeze(1)  # [N]
        if not self.do_sample:  # every token masked: token 0, as transformers' argmax, and log-prob -inf (not NaN)
            log_probs.masked_fill_(best == float("-inf"), float("-inf"))
        token_log_probs = flatten_beams(rows.token_log_probs)  # [N, G], a view
        token_log_probs[:, position] = torch.where(running, log_probs, 0.0)
        if not self.do_sample:  # any NaN left is a NaN or +inf in the row (see score_checks), fatal in a running row
            invalid = torch.isnan(token_log_probs[:, position])  # [N]
        self.watch.flag(invalid.reshape(b, -1).any(dim=1))  # [B']
        if self.keep_alignments:
            self._record_alignments(attention, position, running)
        flatten_beams(rows.tokens)[:, self.length] = next_tokens
        self.length += 1
        rows.lengths += rows.running.long()
        stopped = self.criteria(self.tokens(), self.trace.scores)  # [N]
        finishing = stopped & running
        reasons = classify_stop(self.tokens(), finishing, self.eos_token_id, self.max_length)
        rows.reasons = torch.where(finishing, reasons, rows.reasons.reshape(-1)).reshape(b, -1)
        rows.running = (running & ~stopped).reshape(b, -1)
        return None if self.active is None else self._remove_done()

    def _record_alignments(self, attention: torch.Tensor | None, position: int, running: torch.Tensor) -> None:
        if attention is None:
            raise ValueError("output_alignments needs the step function to return (logits, state, attention [N, S])")
        attention = attention.float()  # [N, S]
        if "alignments" not in self.live:
            b, k, g = self.live.token_log_probs.shape
            self.live.alignments = attention.new_zeros(b, k, g, attention.shape[1])
        flatten_beams(self.live.alignments)[:, position] = torch.where(running[:, None], attention, 0.0)

    def _remove_done(self) -> torch.Tensor | None:
        """Drop the examples whose rows all finished (the step's one host sync); their rows' results are final."""
        return self._leave(self.watch.read(~self.live.running.any(dim=1)))  # [B']

    def _leave(self, done: list) -> torch.Tensor | None:
        """Act on whether each example is done (host booleans): end the search, or drop those examples."""
        k = self.rows_per_example
        self._done = self._done or all(done)
        if self._done or not any(done):
            return None
        keep, self.live, _ = self.active.drop(done, self.live, ())
        kept_rows = example_rows(keep, k)  # [N'']
        self.processors = self.processors.select_rows(kept_rows)
        return kept_rows

    def could_win(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What streaming reads: the first row of each example is the one returned first, and its tokens so far
        stay (``tokens [B, K, L]``, ``lengths [B, K]``, ``eligible [B, K]`` the first row, ``leader [B]`` zeros);
        see :meth:`BeamSearch.could_win`."""
        rows = self.live
        eligible = torch.zeros_like(rows.running)
        eligible[:, 0] = True
        return rows.tokens, rows.lengths, eligible, torch.zeros_like(rows.lengths[:, 0])

    def is_done(self) -> bool:
        if self.active is not None or self._done:  # advance() decided
            return self._done
        return not self.watch.read(self.live.running.any().reshape(1))[0]

    def result(self) -> SearchResult:
        self.watch.close()
        if self.active is not None:
            self.live = self.active.finish(self.live)
        rows, generated = self.live, self.length - self.prompt_length
        sum_log_probs = rows.token_log_probs.sum(dim=-1)  # [B, K]
        lengths = (rows.lengths - self.prompt_length).clamp(min=1).to(sum_log_probs.dtype)
        scores, logits = self.trace.as_tuples()
        return SearchResult(
            sequences=rows.tokens[:, :, : self.length],
            sequences_scores=hf_length_normalised(sum_log_probs, lengths, self.length_penalty),
            sum_log_probs=sum_log_probs,
            token_log_probs=rows.token_log_probs[:, :, :generated],
            lengths=rows.lengths,
            finish_reason=torch.where(rows.running, int(FinishReason.NONE), rows.reasons),
            prompt_length=self.prompt_length,
            scores=scores,
            logits=logits,
            alignments=rows.alignments[:, :, :generated] if "alignments" in rows else None,
        )
