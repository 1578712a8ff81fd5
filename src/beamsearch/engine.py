"""``search()``: options -> processors, stopping criteria and a strategy -> the decode loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .compaction import removal_is_exact
from .loop import StepFn, decode
from .options import SearchOptions
from .prefix_watch import Listener, PrefixWatch
from .processors import build_processors
from .ranking import check_ranking
from .results import SearchResult
from .stopping import build_stopping_criteria
from .strategies.base import StepTrace
from .strategies.constrained import parse_constraints
from .strategies.registry import Request, check, choose
from .trace import TraceLimits, attach


def search(
    step: StepFn,
    input_ids: torch.Tensor,
    state: Any = None,
    *,
    logits_processor: Sequence[Any] = (),
    stopping_criteria: Sequence[Any] = (),
    tokenizer: Any = None,
    padding_lengths: torch.Tensor | None = None,
    source_lengths: torch.Tensor | None = None,
    options: SearchOptions | None = None,
    fill_token_id: int | None = None,
    prefix_allowed_tokens_fn: Any = None,
    target_prefix: Sequence[Sequence[int]] | None = None,
    prefix_bias_beta: float = 0.0,
    sequence_scorer: Any = None,
    unique: Any = None,
    output_alignments: bool = False,
    force_words_ids: Any = None,
    incumbent: Any = None,
    encoder_input_ids: torch.Tensor | None = None,
    stream_to: Listener | None = None,
    provisional: bool = False,
    trace: bool | TraceLimits = False,
    **kwargs: Any,
) -> SearchResult:
    """Decode with any model through one step function.

    Args:
        step: ``(tokens: LongTensor [N, t], state) -> (logits: FloatTensor [N, V], state)``, where N is
            the number of rows being decoded (batch x beams). The state is any nesting of dicts, lists,
            tuples and dataclasses of tensors whose first dimension is N, or an object with a
            ``reorder(index)`` method; the engine expands it to beams once and reorders it by parent
            rows after each step.
        input_ids: LongTensor ``[B, t0]`` of start tokens, ``t0 >= 1``.
        state: the model state for the B examples (row dimension first), or None.
        logits_processor: extra processors ``(input_ids [N, t], scores [N, V]) -> scores``, merged
            after the built-in ones as in Hugging Face (one of the same type replaces the built-in).
        stopping_criteria: extra criteria ``(input_ids [N, t], scores) -> BoolTensor [N]``.
        tokenizer: needed for ``stop_strings``.
        padding_lengths: LongTensor ``[B]`` of left-padding positions per example (for
            ``repetition_penalty``, which ignores them as Hugging Face does).
        source_lengths: LongTensor ``[B]`` of source lengths, for limits tied to them (``max_len_a`` /
            ``max_len_b``, OpenNMT's ``ratio``); the Hugging Face adapter passes the encoder input lengths.
        options: a prepared :class:`SearchOptions`; otherwise built from ``kwargs``.
        fill_token_id: the token that pads returned sequences (default: pad, else first eos, else 0).
        prefix_allowed_tokens_fn: ``(batch_id, tokens [t]) -> allowed token ids`` for the next position, as in
            ``generate`` (``batch_id`` is ``row // num_beams``); everything else is masked.
        target_prefix: per example, token ids its output must start with (after the start tokens; ``[]``: none),
            as CTranslate2's ``target_prefix``: forced one by one, then the search goes on freely.
        prefix_bias_beta: in (0, 1): bias toward ``target_prefix`` instead of forcing it, as CTranslate2's
            ``prefix_bias_beta`` (while a hypothesis follows its prefix, ``(1 - beta) p + beta onehot``).
        sequence_scorer: beam search only: ``(tokens [M, g], token_log_probs [M, g], lengths [M]) -> scores [M]``,
            the score that ranks finished hypotheses (instead of ``sum / length ** length_penalty``).
        unique: beam search only: True, or a key function of a hypothesis' generated token list; the finished
            pool then holds at most one hypothesis per key (the best), while it fills.
        force_words_ids: beam search only: words or phrases that must appear in the output, each a list of
            token ids, or a list of alternative phrases (disjunctive), as transformers 4.x; decoded with dynamic
            beam allocation (``strategies/constrained.py``).
        incumbent: with ``exact_search=True``: a result of a search over the same inputs (a beam search with the
            same options); its best scores prune the exact search (``strategies/exact.py``), which then needs far
            fewer nodes. Without one, exact search starts from nothing and may stop at ``max_nodes`` unproven.
        encoder_input_ids: LongTensor ``[B, S]``, each example's source ids (padding included), for
            ``encoder_repetition_penalty`` and ``encoder_no_repeat_ngram_size``; the Hugging Face adapter passes the
            encoder's input (for decoder-only models, the prompt), as ``generate`` does.
        output_alignments: keep, for each generated token, the attention over the source of the step that chose
            it (``result.alignments [B, n, T', S]``); the step must return ``(logits, state, attention [N, S])``.
        stream_to: a callable given each :class:`~beamsearch.prefix_watch.StreamEvent` while the search runs: the
            committed prefix of the best hypothesis as it becomes final (``prefix_watch.py`` says when); one example
            only (B = 1). :func:`beamsearch.stream` wraps it as an iterator.
        provisional: with ``stream_to``: stream the current best with corrections instead.
        trace: record what beam search considered, kept and dropped at each step (``result.search_trace``, a
            :class:`~beamsearch.trace.SearchTrace`); a :class:`~beamsearch.trace.TraceLimits` bounds it. Off, it
            costs nothing.
        **kwargs: Hugging Face-named generation options (``num_beams``, ``max_new_tokens``,
            ``eos_token_id``, ``do_sample``, ``temperature``, ...). Unknown ones raise ValueError.

    Returns:
        A :class:`SearchResult` with ``sequences`` ``[B, n, T]``.

    Raises:
        ValueError: a bad option or combination (named), before the first step.
        SearchError: a ValueError raised during the search: a step's scores hold NaN (from NaN or +inf logits, a
            row of logits that is -inf throughout, or a row to sample from with every token masked), named by step
            and example; or more beams than the vocabulary allows hypotheses to return (``num_beams``, V).
    """
    if options is None:
        options = SearchOptions.create(**kwargs)
    elif kwargs:
        raise ValueError(f"pass options either as `options` or as keywords, not both: {sorted(kwargs)}")
    _check_input_ids(input_ids)
    batch_size, prompt_length = input_ids.shape
    rows = 1 if options.exact_search else options.num_beams if options.num_beams > 1 else options.num_return_sequences
    per_row = _per_row(batch_size, rows, input_ids.device, padding_lengths, source_lengths, target_prefix,
                       encoder_input_ids)
    processors = build_processors(
        options, prompt_length, per_row["padding_lengths"], list(logits_processor),
        source_lengths=per_row["source_lengths"], prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        target_prefix=per_row["target_prefix"], prefix_bias_beta=_check_bias(prefix_bias_beta),
        encoder_input_ids=per_row["encoder_input_ids"], rows_per_example=rows,
    )
    criteria = build_stopping_criteria(options, prompt_length, tokenizer, list(stopping_criteria))
    request = Request(
        input_ids, options, options.resolved_max_length(prompt_length), processors, criteria,
        fill=options.output_fill_token if fill_token_id is None else fill_token_id,
        trace=StepTrace(options.output_scores, options.output_logits), rows=rows, removal=False,
        source_lengths=None if source_lengths is None else per_row["examples_source_lengths"],
        constraints=None if force_words_ids is None else parse_constraints(force_words_ids),
        incumbent=incumbent,
        sequence_scorer=sequence_scorer, unique_key=check_ranking(sequence_scorer, unique),
        output_alignments=output_alignments, target_prefix=target_prefix, prefix_bias_beta=prefix_bias_beta,
    )
    check(request)
    # finished examples leave the batch when that cannot change a result (sampling would draw differently,
    # per-step scores would miss rows, a constrained or de-duplicated pool keeps state of its own)
    request.removal = (options.remove_finished and not options.do_sample and not options.output_scores
                       and not options.output_logits and request.constraints is None and request.unique_key is None
                       and removal_is_exact(processors, criteria))
    strategy = choose(request)
    if stream_to is None and not trace:
        return decode(step, state, strategy, batch_size)
    if stream_to is not None and batch_size != 1:
        raise ValueError(f"streaming decodes one example at a time (input_ids [1, t0]), got a batch of {batch_size}")
    watch = None if stream_to is None else PrefixWatch(strategy, stream_to, provisional)
    recorder = None if not trace else attach(strategy, trace if isinstance(trace, TraceLimits) else TraceLimits(),
                                              prompt_length)
    result = decode(step, state, strategy, batch_size)
    if watch is not None:
        watch.finish(result)
    return result if recorder is None else dataclasses.replace(result, search_trace=recorder.build(result))


def _per_row(batch_size: int, rows: int, device: torch.device, padding_lengths: Any, source_lengths: Any,
             target_prefix: Any, encoder_input_ids: Any) -> dict[str, Any]:
    """The per-example arguments checked and repeated for each of an example's ``rows`` rows."""
    out: dict[str, Any] = {"padding_lengths": None if padding_lengths is None
                           else padding_lengths.repeat_interleave(rows),
                           "source_lengths": None, "examples_source_lengths": None, "target_prefix": None,
                           "encoder_input_ids": None}
    if source_lengths is not None:
        source_lengths = torch.as_tensor(source_lengths, dtype=torch.long, device=device)
        if source_lengths.shape != (batch_size,):
            raise ValueError(f"source_lengths must have shape [B={batch_size}], got {tuple(source_lengths.shape)}")
        out["examples_source_lengths"] = source_lengths
        out["source_lengths"] = source_lengths.repeat_interleave(rows)
    if target_prefix is not None:
        if len(target_prefix) != batch_size or any(isinstance(p, (str, int)) for p in target_prefix):
            raise ValueError(f"target_prefix must hold one list of token ids per example ({batch_size})")
        out["target_prefix"] = [list(p) for p in target_prefix for _ in range(rows)]
    if encoder_input_ids is not None:
        if not isinstance(encoder_input_ids, torch.Tensor) or encoder_input_ids.dim() != 2 \
                or encoder_input_ids.shape[0] != batch_size:
            raise ValueError(f"encoder_input_ids must be a LongTensor of shape [B={batch_size}, S]")
        out["encoder_input_ids"] = encoder_input_ids.repeat_interleave(rows, dim=0)
    return out


def _check_bias(beta: float) -> float:
    """The value alone; that it needs a target_prefix is a row of the combinations table (``check``)."""
    if not beta:
        return 0.0
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta < 1.0:
        raise ValueError(f"prefix_bias_beta must be a number in (0, 1), got {beta!r}")
    return float(beta)


def _check_input_ids(input_ids: Any) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a LongTensor of shape [B, t0] with t0 >= 1, got {shape}")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] < 1:
        raise ValueError("input_ids must hold at least one example (B >= 1)")
