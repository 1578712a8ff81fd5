"""Build the ordered list of processors for a search, exactly as Hugging Face ``generate`` does.

Shape legend: N rows, V vocabulary, t tokens so far (prompt included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..merging import merge_user_items
from ..options import SearchOptions
from .allowed import AllowedTokensFn, PrefixConstrainedLogitsProcessor
from .encoder import EncoderNoRepeatNGramLogitsProcessor, EncoderRepetitionPenaltyLogitsProcessor
from .limits import SourceTiedMaxLength
from .masks import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from .ngrams import LoopGuardLogitsProcessor, NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor
from .numerics import InfNanRemoveLogitsProcessor, LogitNormalization
from .penalties import RepetitionPenaltyLogitsProcessor
from .prefix import PrefixBiasLogitsProcessor, TargetPrefixLogitsProcessor
from .warpers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ProcessorList(list):
    """A list of processors, itself a processor: applies each in order.

    ``foreign``: the positions of the caller's own processors (:func:`build_processors` records them), after
    which the scores are no longer assumed private (see :func:`run_processors`). A list built elsewhere counts
    every item as foreign.
    """

    def __init__(self, items: Iterable[Processor] = (), foreign: Iterable[int] | None = None):
        super().__init__(items)
        self.foreign = frozenset(range(len(self)) if foreign is None else foreign)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Args: input_ids ``[N, t]``, scores ``[N, V]``. Returns: scores ``[N, V]``."""
        for processor in self:
            scores = processor(input_ids, scores)
        return scores

    def select_rows(self, index: torch.Tensor) -> ProcessorList:
        """The processors for the rows ``index`` only (see :func:`beamsearch.compaction.removal_is_exact`)."""
        return ProcessorList((processor.select_rows(index) for processor in self), self.foreign)


def run_processors(processors: Processor, input_ids: torch.Tensor, scores: torch.Tensor, owned: bool) -> torch.Tensor:
    """Apply ``processors``; ``owned``: no one else holds ``scores`` (a fresh tensor of the caller's own).

    On owned scores our fixed-token masks (min length, suppression) mask in place instead of copying
    ``[N, V]``; the result is the same. After a processor from outside this package the scores are no longer
    assumed private.
    """
    if not owned or not isinstance(processors, ProcessorList):
        return processors(input_ids, scores)
    owned = True
    for position, processor in enumerate(processors):
        if owned and hasattr(processor, "mask_"):
            scores = processor.mask_(input_ids, scores)
        else:
            scores = processor(input_ids, scores)
            owned = owned and position not in processors.foreign
    return scores


class SkipLeadingTokens:
    """A processor that sees each row's tokens without the first ``count`` (CTranslate2's n-gram blocking)."""

    def __init__(self, processor: Processor, count: int):
        self.processor, self.count = processor, count

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.processor(input_ids[:, self.count :], scores)

    def select_rows(self, index: torch.Tensor) -> SkipLeadingTokens:
        return SkipLeadingTokens(self.processor.select_rows(index), self.count)


def _encoder_repetition_penalty(options: SearchOptions, encoder_input_ids: torch.Tensor,
                                rows_per_example: int) -> EncoderRepetitionPenaltyLogitsProcessor:
    """transformers 5.19 and later: each row its example's source; before, row r < B example r's and the other rows
    none (its processor gathered ``[B, S]`` ids from ``[B*K, V]`` scores)."""
    if options.hf_at_least(5, 19) or rows_per_example == 1:
        return EncoderRepetitionPenaltyLogitsProcessor(options.encoder_repetition_penalty, encoder_input_ids)
    examples = encoder_input_ids[::rows_per_example]  # [B, S]
    rows = encoder_input_ids.shape[0]
    ids = torch.cat([examples, encoder_input_ids[examples.shape[0] :]])  # [N, S]: row r < B example r's
    applies = torch.arange(rows, device=encoder_input_ids.device) < examples.shape[0]
    return EncoderRepetitionPenaltyLogitsProcessor(options.encoder_repetition_penalty, ids, applies)


def build_processors(
    options: SearchOptions,
    prompt_length: int,
    padding_lengths: torch.Tensor | None = None,
    user_processors: Iterable[Processor] = (),
    source_lengths: torch.Tensor | None = None,
    prefix_allowed_tokens_fn: AllowedTokensFn | None = None,
    target_prefix: list[list[int]] | None = None,
    prefix_bias_beta: float = 0.0,
    encoder_input_ids: torch.Tensor | None = None,
    rows_per_example: int = 1,
) -> ProcessorList:
    """The processors of a search, in the order of Hugging Face ``_get_logits_processor``.

    Processors first, then the user's merged in (one of the same type as a built-in replaces it in
    place, the others follow), then the sampling warpers (only with ``do_sample``), then the
    log-softmax renormalization.

    Args:
        options: the search options.
        prompt_length: ``t0``, the length of the start tokens.
        padding_lengths: LongTensor ``[N]`` of leading pad positions per row, ignored by the
            repetition penalty (as transformers 5.23 and later); None if there is no padding.
        user_processors: extra processors ``(input_ids [N, t], scores [N, V]) -> scores [N, V]``.
        source_lengths: LongTensor ``[N]`` of each row's source length (for ``max_len_a`` / ``max_len_b``).
        prefix_allowed_tokens_fn: ``(batch_id, tokens [t]) -> allowed token ids``, as in ``generate``.
        target_prefix: the forced first generated tokens of each row (after every other built-in processor).
        prefix_bias_beta: > 0: bias toward ``target_prefix`` instead of forcing it (the last processor).
        encoder_input_ids: LongTensor ``[N, S]``, each row's source ids (``encoder_repetition_penalty``,
            ``encoder_no_repeat_ngram_size``).
        rows_per_example: K, the rows of an example (``encoder_input_ids`` repeats each example's ids K times).

    Returns:
        A :class:`ProcessorList`.
    """
    eos = options.eos_token_id
    defaults: list[Processor] = []
    skip = 1 if options.semantics == "ct2" else 0  # CTranslate2's history penalties skip the start token
    encoder_options = {"encoder_repetition_penalty": options.encoder_repetition_penalty != 1.0,
                       "encoder_no_repeat_ngram_size": options.encoder_no_repeat_ngram_size > 0}
    for name, used in encoder_options.items():
        if used and encoder_input_ids is None:
            raise ValueError(f"{name} needs the source ids: search(..., encoder_input_ids=[B, S] LongTensor)")
    if encoder_options["encoder_repetition_penalty"]:
        defaults.append(_encoder_repetition_penalty(options, encoder_input_ids, rows_per_example))
    if options.repetition_penalty != 1.0:
        if not options.hf_at_least(5, 23):  # transformers ignores the left padding from 5.23 on
            padding_lengths = None
        ignore = padding_lengths + skip if padding_lengths is not None else (skip or None)
        defaults.append(RepetitionPenaltyLogitsProcessor(options.repetition_penalty, ignore))
    if options.no_repeat_ngram_size > 0:
        ngrams = NoRepeatNGramLogitsProcessor(options.no_repeat_ngram_size)
        defaults.append(SkipLeadingTokens(ngrams, skip) if skip else ngrams)
    if options.loop_guard:
        defaults.append(LoopGuardLogitsProcessor(options.loop_guard, prompt_length))
    if encoder_options["encoder_no_repeat_ngram_size"]:
        defaults.append(EncoderNoRepeatNGramLogitsProcessor(options.encoder_no_repeat_ngram_size, encoder_input_ids))
    if options.bad_words_ids is not None:
        defaults.append(NoBadWordsLogitsProcessor(options.bad_words_ids, eos))
    if eos is not None and options.min_length > 0:
        defaults.append(MinLengthLogitsProcessor(options.min_length, eos))
    if eos is not None and options.min_new_tokens is not None and options.min_new_tokens > 0:
        defaults.append(MinNewTokensLengthLogitsProcessor(prompt_length, options.min_new_tokens, eos))
    if prefix_allowed_tokens_fn is not None:
        # transformers 5.24 counts batch ids per example when sampling several sequences; 5.18 added the fallback
        rows = max(options.num_beams, options.num_return_sequences) if options.hf_at_least(5, 24) else options.num_beams
        defaults.append(PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn, rows,
                                                         unsatisfiable_fallback=options.hf_at_least(5, 18)))
    if options.forced_bos_token_id is not None:
        defaults.append(ForcedBOSTokenLogitsProcessor(options.forced_bos_token_id))
    if options.forced_eos_token_id is not None:
        max_length = options.resolved_max_length(prompt_length)
        defaults.append(ForcedEOSTokenLogitsProcessor(max_length, options.forced_eos_token_id))
    if options.remove_invalid_values:
        defaults.append(InfNanRemoveLogitsProcessor())
    if options.suppress_tokens is not None:
        defaults.append(SuppressTokensLogitsProcessor(options.suppress_tokens))
    if options.begin_suppress_tokens is not None:
        shifted = prompt_length <= 1 and options.forced_bos_token_id is not None  # the forced bos comes first
        begin_index = prompt_length + 1 if shifted else prompt_length
        defaults.append(SuppressTokensAtBeginLogitsProcessor(options.begin_suppress_tokens, begin_index))

    if options.max_len_b is not None or options.max_len_a > 0:
        if source_lengths is None:
            raise ValueError("max_len_a / max_len_b need the source lengths (search(..., source_lengths=))")
        a, b = options.max_len_a, options.max_len_b or 0
        defaults.append(SourceTiedMaxLength(a, b, source_lengths, prompt_length, eos[0]))

    if target_prefix is not None and not prefix_bias_beta:
        defaults.append(TargetPrefixLogitsProcessor(target_prefix, prompt_length))

    user_processors = list(user_processors)
    merged = merge_user_items(defaults, user_processors)
    processors = ProcessorList(merged, [i for i, p in enumerate(merged) if any(p is u for u in user_processors)])
    if options.do_sample:
        processors.extend(_warpers(options))
    if options.renormalize_logits:
        processors.append(LogitNormalization())
    if target_prefix is not None and prefix_bias_beta:
        processors.append(PrefixBiasLogitsProcessor(target_prefix, prefix_bias_beta, prompt_length))
    return processors


def _warpers(options: SearchOptions) -> list[Processor]:
    """The sampling warpers, in Hugging Face's order."""
    if options.num_beams > 1:  # beams must keep a non-eos continuation
        keep = len(options.eos_token_id) + 1 if options.eos_token_id is not None else 2
    else:
        keep = 1
    warpers: list[Processor] = []
    if options.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(options.temperature))
    if options.top_k is not None and options.top_k != 0:
        warpers.append(TopKLogitsWarper(options.top_k, min_tokens_to_keep=keep))
    if options.top_p < 1.0:
        warpers.append(TopPLogitsWarper(options.top_p, min_tokens_to_keep=keep))
    if options.min_p is not None:
        warpers.append(MinPLogitsWarper(options.min_p, min_tokens_to_keep=keep))
    if options.typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(options.typical_p, min_tokens_to_keep=keep))
    if 0.0 < options.epsilon_cutoff < 1.0:
        warpers.append(EpsilonLogitsWarper(options.epsilon_cutoff, min_tokens_to_keep=keep))
    if 0.0 < options.eta_cutoff < 1.0:
        warpers.append(EtaLogitsWarper(options.eta_cutoff, min_tokens_to_keep=keep))
    return warpers
