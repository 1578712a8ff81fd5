"""Greedy search as a graph-safe step: ``strategies/sampling.py``'s greedy search at a tensor length.

The arithmetic and its order are those of :class:`~beamsearch.strategies.sampling.SamplingSearch` without sampling
(transformers' ``_sample`` with ``do_sample=False``): the processors on the raw logits, the argmax through ``max``,
finished rows fed the pad token with log-prob 0, the search stopped by the end token or the length limit. What
changes is how: the length is a 0-d tensor, every write goes to a fixed column through ``index_copy_``, every state
tensor is updated in place (a captured step holds their addresses), and nothing is read on the host. Finished
examples stay in the batch (their rows no longer run, so their results are final), and the padding examples of the
bucket start finished.

Legend: B examples (a bucket), K rows per example, N = B*K, V vocabulary, L = max_length, t0 start tokens,
G = L - t0 generated positions.
"""

from __future__ import annotations

import torch

from ..beams import flatten_beams
from ..results import FinishReason, SearchResult
from ..scoring import hf_length_normalised
from ..strategies.pool import Hypotheses
from .processors import GraphProcessor, processor_tensors, run_graph_processors
from .search_state import SearchFlags, stop_reasons


class GraphGreedy:
    """Greedy search over fixed shapes.

    Args:
        input_ids: ``[B, t0]`` LongTensor, the start tokens (a bucket: padding examples included).
        rows_per_example: K (``num_return_sequences``: identical rows, as in transformers).
        max_length: L.
        processors: graph-safe processors (:func:`.processors.graph_processors`).
        eos_token_id: the end ids, or None.
        pad_token_id: what finished rows are fed and returned sequences are filled with.
        length_penalty: for ``sequences_scores``, as the eager search computes them.
        real: ``[B]`` BoolTensor, the call's own examples (the others start finished).
    """

    def __init__(self, input_ids: torch.Tensor, rows_per_example: int, max_length: int,
                 processors: list[GraphProcessor], *, eos_token_id: tuple[int, ...] | None, pad_token_id: int,
                 length_penalty: float, real: torch.Tensor):
        (b, t0), k, device = input_ids.shape, rows_per_example, input_ids.device
        self.prompt_length, self.max_length, self.rows_per_example = t0, max_length, k
        self.processors, self.pad_token_id, self.length_penalty = processors, pad_token_id, length_penalty
        self.eos = None if eos_token_id is None else torch.tensor(eos_token_id, dtype=torch.long, device=device)
        self.live = Hypotheses.start(
            input_ids, k, max_length, pad_token_id, running=real[:, None].repeat(1, k),
            lengths=torch.full((b, k), t0, dtype=torch.long, device=device),
            reasons=torch.zeros(b, k, dtype=torch.long, device=device)).replace(beam_indices=None)
        self.length = torch.tensor(t0, dtype=torch.long, device=device)  # t: tokens so far
        self.flags = SearchFlags(b, device)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor the step reads or writes, in a fixed order (``reuse.py`` loads a call into kept ones)."""
        return [*self.live.fields.values(), self.length, *self.flags.static_tensors(),
                *processor_tensors(self.processors), *([] if self.eos is None else [self.eos])]

    def last_tokens(self) -> torch.Tensor:
        """``[N]``: each row's last token, what the model is fed next."""
        return self.live.tokens.index_select(2, (self.length - 1).view(1)).reshape(-1)

    def select(self, logits: torch.Tensor) -> None:
        """One step on the step's logits ``[N, V]`` (float32, owned: masked in place); greedy rows keep their
        parents, so nothing is returned."""
        rows, length = self.live, self.length
        b = rows.running.shape[0]
        running = rows.running.reshape(-1)  # [N]
        scores = run_graph_processors(self.processors, logits, flatten_beams(rows.tokens), length)  # [N, V]
        best, next_tokens = scores.max(dim=-1)  # [N], the argmax as the eager search takes it
        if self.eos is not None:
            next_tokens = torch.where(running, next_tokens, self.pad_token_id)
        log_probs = torch.log_softmax(scores, dim=-1).gather(1, next_tokens[:, None]).squeeze(1)  # [N]
        log_probs.masked_fill_(best == float("-inf"), float("-inf"))  # every token masked: -inf, not NaN
        chosen = torch.where(running, log_probs, 0.0)  # [N]
        flatten_beams(rows.token_log_probs).index_copy_(1, (length - self.prompt_length).view(1), chosen[:, None])
        self.flags.flag(torch.isnan(chosen).view(b, -1).any(dim=1), length - self.prompt_length)
        flatten_beams(rows.tokens).index_copy_(1, length.view(1), next_tokens[:, None])
        length.add_(1)
        rows.lengths.add_(rows.running.long())
        at_max = length >= self.max_length  # 0-d: the length limit stops every row
        is_eos = self._is_eos(next_tokens)  # [N]
        stopped = at_max | is_eos
        reasons = stop_reasons(is_eos, at_max)
        rows.reasons.copy_(torch.where(stopped & running, reasons, rows.reasons.reshape(-1)).view(b, -1))
        rows.running.copy_((running & ~stopped).view(b, -1))
        self.flags.set_going(rows.running.any())

    def _is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.eos is None:
            return torch.zeros_like(tokens, dtype=torch.bool)
        return (tokens[:, None] == self.eos).any(dim=1)

    def result(self, examples: int) -> SearchResult:
        """The first ``examples`` examples' result, as the eager search returns it (one host read: the width)."""
        rows = self.live.take(torch.arange(examples, device=self.length.device))
        t0 = self.prompt_length
        length = max(int(rows.lengths.max()), t0)  # where the eager search stopped: the last row's end
        sum_log_probs = rows.token_log_probs.sum(dim=-1)  # [B, K]
        lengths = (rows.lengths - t0).clamp(min=1).to(sum_log_probs.dtype)
        return SearchResult(
            sequences=rows.tokens[:, :, :length],
            sequences_scores=hf_length_normalised(sum_log_probs, lengths, self.length_penalty),
            sum_log_probs=sum_log_probs,
            token_log_probs=rows.token_log_probs[:, :, : length - t0],
            lengths=rows.lengths,
            finish_reason=torch.where(rows.running, int(FinishReason.NONE), rows.reasons),
            prompt_length=t0,
        )
