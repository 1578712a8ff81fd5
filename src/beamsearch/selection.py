"""The beam search's candidate selection, ``topk(log_probs + beam_scores)`` over ``[B, K*V]``, without the sums.

Every beam search step of transformers (and CTranslate2) adds each beam's score to its ``V`` log-probabilities
and takes the top C of the ``K*V`` sums per example. On a CPU ``torch.topk`` over such long rows costs more
than the log-softmax itself, and the sum is one more pass over ``[N, V]``. :func:`top_totals` returns the
same values and positions from a pass of chunk maxima instead:

- the rows are cut into chunks of ``CHUNK`` tokens and each chunk's maximum taken (vectorized);
- adding a beam's score is monotone in floating point (``a <= b`` gives ``fl(a + s) <= fl(b + s)``), so a
  chunk's maximum plus the beam score is the maximum of the chunk's sums;
- the C best chunks by that maximum hold the C best sums: another chunk's elements are all below the C-th best
  chunk maximum, and the C best chunk maxima are C distinct elements at least that large;
- the sums of those C chunks' elements, computed as transformers computes them (``log_prob + score`` in
  float32), and their top C are the result.

Where a tie could make ``torch.topk``'s unspecified order matter (equal chunk maxima at the cut, equal values
among the C + 1 best) or a NaN is present, the step computes the sums and ``torch.topk`` as before. Used on
the CPU only: on a GPU ``torch.topk`` is fast and the check would add a host sync.

Legend: B batch, K beams, V vocabulary, C candidates kept per example.
"""

from __future__ import annotations

import torch

CHUNK = 128  # tokens per chunk
MIN_CHUNKS_PER_CANDIDATE = 8  # shorter rows (small vocabularies) use torch.topk directly


def top_totals(log_probs: torch.Tensor, beam_scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk((log_probs + beam_scores[:, :, None]).reshape(B, K*V), count)``, computed from chunk maxima.

    Args:
        log_probs: FloatTensor ``[B, K, V]`` (each row of V contiguous, e.g. a slice of beams).
        beam_scores: FloatTensor ``[B, K]``, the same dtype.
        count: C, at most ``K*V``.

    Returns:
        ``(values [B, C], positions [B, C])``, best first; a position ``p`` is beam ``p // V``, token ``p % V``.
    """
    b, k, vocab = log_probs.shape
    chunks = vocab // CHUNK
    if log_probs.device.type != "cpu" or k * chunks < MIN_CHUNKS_PER_CANDIDATE * count:
        return _top_of_sums(log_probs, beam_scores, count)
    whole = chunks * CHUNK
    maxima = log_probs[:, :, :whole].reshape(b, k, chunks, CHUNK).amax(dim=-1)  # [B, K, q]
    if whole < vocab:
        maxima = torch.cat((maxima, log_probs[:, :, whole:].amax(dim=-1, keepdim=True)), dim=-1)  # [B, K, q + 1]
    per_beam = maxima.shape[-1]
    best_maxima, best_chunks = torch.topk((maxima + beam_scores[:, :, None]).reshape(b, -1), count + 1)  # [B, C+1]
    chosen = best_chunks[:, :count]  # [B, C] chunk ids: beam * per_beam + chunk
    beams, starts = chosen // per_beam, (chosen % per_beam) * CHUNK
    offsets = torch.arange(CHUNK, device=log_probs.device)
    tokens = starts[:, :, None] + offsets  # [B, C, CHUNK]
    outside = tokens >= vocab  # the last, shorter chunk's overhang
    tokens = tokens.clamp(max=vocab - 1)
    rows = torch.arange(b, device=log_probs.device)[:, None, None]
    sums = (log_probs[rows, beams[:, :, None], tokens]  # [B, C, CHUNK], no copy of a strided log_probs
            + torch.gather(beam_scores, 1, beams)[:, :, None]).reshape(b, -1)  # as transformers adds them
    sums.masked_fill_(outside.reshape(b, -1), float("-inf"))
    positions = (beams[:, :, None] * vocab + tokens).reshape(b, -1)  # [B, C*CHUNK]
    values, picked = torch.topk(sums, count + 1)  # [B, C+1]
    ambiguous = (
        torch.isnan(best_maxima).any()
        | (best_maxima[:, count - 1] == best_maxima[:, count]).any()
        | (values[:, 1:] == values[:, :-1]).any()
    )
    if bool(ambiguous):
        return _top_of_sums(log_probs, beam_scores, count)
    return values[:, :count], torch.gather(positions, 1, picked[:, :count])


def _top_of_sums(log_probs: torch.Tensor, beam_scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, k, vocab = log_probs.shape
    return torch.topk((log_probs + beam_scores[:, :, None]).reshape(b, k * vocab), count)
