"""The search strategies' per-step bookkeeping in one C++ call each (``native_search.cpp``), where the search is plain.

Beam search: after the processors and the choice of the C candidates (:func:`~beamsearch.selection.top_totals`, as
transformers chooses them), :class:`~.beam.BeamSearch` does about 200 small PyTorch operations per step in Python
(the candidates' hypotheses, the stopping verdicts, the finished pool's merge, the next live beams, whether each
example can still improve): about 2 ms a step on the CPU, whatever the model. ``beam_update`` runs the same
arithmetic, in the same float32 operations and order, in one call, its two selections by score through
``at::topk`` as in Python so that ties are ordered alike. Greedy search: ``greedy_update`` does
:class:`~.sampling.SamplingSearch`'s step after the processors (argmax by ``at::max``, the token's log-prob by
``at::log_softmax``, padding, lengths, verdicts and finish reasons: about 25 operations) in one call. Results are bit
for bit those of the Python steps (tested on random searches).

They run when the search is transformers' beam search (not sampling, not a subclass with other rules: CTranslate2's,
OpenNMT's), ranking the pool by ``sum / length ** length_penalty`` (no ``sequence_scorer``, no ``unique``), or greedy
search; keeps no alignments, records no trace or per-step scores, streams nothing, removes finished examples, stops
only at the length limit and the end tokens (no ``max_time``, stop strings or criteria of the caller's), runs on the
CPU, and the native extension is built (:mod:`beamsearch.extension`; ``BEAMSEARCH_NATIVE=0`` turns it off,
``BEAMSEARCH_NATIVE_SEARCH=0`` only this).
Otherwise the Python step runs.

Legend: B active examples, K beams (rows per example), C candidates per example, N = B*K, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from ..extension import disabled_reason, extension, native_disabled
from ..stopping import EosTokenCriteria, MaxLengthCriteria
from .pool import Hypotheses

LIVE = ("tokens", "scores", "token_log_probs", "beam_indices")
FINISHED = (*LIVE, "finished", "reasons")
SWITCH = "BEAMSEARCH_NATIVE_SEARCH"  # =0: the Python steps (the native T5 step still runs)
GREEDY = ("tokens", "token_log_probs", "running", "lengths", "reasons")


def native_beam_reason(search: Any) -> str | None:
    """Why ``search`` (a :class:`~.beam.BeamSearch` itself, not a subclass with rules of its own, before its first
    step) cannot use the native bookkeeping (None: it can)."""
    if search.do_sample or search.scorer is not None or search.pool_keys is not None:
        return "beam sampling, a sequence scorer or unique outputs"
    if set(search.live.fields) != set(LIVE) or set(search.finished.fields) != set(FINISHED) \
            or search.finished.scores.dtype != torch.float32 or search.live.scores.dtype != torch.float32:
        return "hypotheses with other fields or dtypes"
    return _common_reason(search)


def native_greedy_reason(search: Any) -> str | None:
    """Why ``search`` (a :class:`~.sampling.SamplingSearch` before its first step) cannot use the native bookkeeping
    (None: it can)."""
    if search.do_sample:
        return "sampling"
    rows = search.live
    if set(rows.fields) != set(GREEDY) or rows.token_log_probs.dtype != torch.float32:
        return "rows with other fields or dtypes"
    return _common_reason(search)


def _common_reason(search: Any) -> str | None:
    for variable in ("BEAMSEARCH_NATIVE", SWITCH):
        if native_disabled(variable):
            return disabled_reason(variable)
    if search.keep_alignments:
        return "alignments"
    if search.recorder is not None or search.watch.rider is not None or search.trace.scores is not None \
            or search.trace.logits is not None:
        return "a trace, streaming, or per-step scores"
    if search.active is None:
        return "finished examples kept in the batch (per-step scores, or a criterion or processor of the caller's)"
    if search.live.tokens.device.type != "cpu":
        return "not on the CPU"
    if not _plain_criteria(search):
        return "a stopping criterion other than the length limit and the end tokens"
    return None if extension() is not None else "the native extension is not built"


def _plain_criteria(search: Any) -> bool:
    """The criteria are the length limit at ``search.max_length``, then (where the search has end tokens) the
    end-token criterion on exactly those ids."""
    criteria = list(search.criteria)
    eos = sorted(set(search.eos_token_id or ()))
    if not criteria or type(criteria[0]) is not MaxLengthCriteria or criteria[0].max_length != search.max_length:
        return False
    rest = criteria[1:]
    if not eos:
        return not rest
    return len(rest) == 1 and type(rest[0]) is EosTokenCriteria and sorted(set(rest[0].eos_token_id.tolist())) == eos


def native_beam_update(search: Any, log_probs: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, list[int], int, int]:
    """One step's bookkeeping: updates ``search.live``, ``search.finished``, ``search.can_improve`` and
    ``search.length``; flags NaN totals on the search's watch.

    Args:
        log_probs: ``[N, V]`` after the processors.
        values, positions: the C candidates ``[B, C]`` (totals, and beam * V + token), best first.

    Returns:
        ``(rows [N], done, all_hit, identity)``: the new beams' parent rows, whether each example is done (host
        booleans, read with the step's one host sync), whether every candidate hit a criterion, and whether every
        beam continues its own row.
    """
    live, pool = search.live, search.finished
    out = extension().beam_update(
        values, positions, log_probs, [live.fields[name] for name in LIVE], [pool.fields[name] for name in FINISHED],
        search.can_improve[:, 0], search.example_ids, search.length, search.prompt_length, search.max_length,
        list(search.eos_token_id or ()), float(search.length_penalty), _early_stopping(search.early_stopping))
    t0 = search.prompt_length
    search.live = Hypotheses(t0, **dict(zip(LIVE, out[:4], strict=True)))
    search.finished = Hypotheses(t0, **dict(zip(FINISHED, out[4:10], strict=True)))
    search.can_improve = out[10][:, None]
    search.length += 1
    rows, flags, nan = out[11], out[12], out[13]
    search.watch.flag(nan)
    *done, all_hit, identity = search.watch.read(flags)
    return rows, done, all_hit, identity


def _early_stopping(value: Any) -> int:
    """The extension's code for ``early_stopping``, read as :class:`~.beam.BeamSearch` reads it (``is True``,
    ``== "never"``, anything else as False): 1, 2, 0."""
    return 1 if value is True else 2 if value == "never" else 0


def native_greedy_update(search: Any, scores: torch.Tensor) -> list[int]:
    """One greedy step's bookkeeping on ``search.live`` (in place) and ``search.length``; flags NaN log-probs on the
    search's watch. ``scores``: ``[N, V]`` after the processors. Returns whether each example is done (host
    booleans, read with the step's one host sync)."""
    rows = search.live
    pad = search.pad_token_id if search.eos_token_id is not None else -1
    done, nan = extension().greedy_update(
        scores, rows.tokens, rows.token_log_probs, rows.running, rows.lengths, rows.reasons, search.length,
        search.prompt_length, search.max_length, list(search.eos_token_id or ()), pad)
    search.length += 1
    search.watch.flag(nan)
    return search.watch.read(done)
