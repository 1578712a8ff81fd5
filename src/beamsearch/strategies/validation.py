"""The one table of option combinations that no strategy runs, each row with its rule and its message.

:data:`COMBINATIONS` lists every refused combination of two or more options, or of options and the arguments of
``beamsearch.search``; :func:`check_combinations` walks it and raises the message of the first row that holds.
A row with ``options_only`` reads only the :class:`~beamsearch.options.SearchOptions`: ``SearchOptions.validate``
checks those rows (after its single-value checks), so that a bad combination fails when the options are built, as
the command line expects. The other rows read the search request (``strategies/registry.py``'s ``Request``: the
options and the arguments of ``search``); ``registry.check`` walks the whole table before any strategy is built.
The tests enumerate the rows (``tests/test_registry.py``).

This module imports nothing from the package: ``options.py`` imports it, and ``registry.py`` imports both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

# Options that only one toolkit's beam search reads: (the semantics that reads it, the value that changes nothing).
TOOLKIT_ONLY: dict[str, tuple[str, Any]] = {
    "coverage_penalty": ("onmt", "none"),
    "stepwise_penalty": ("onmt", False),
    "ratio": ("onmt", 0.0),
    "max_length_ratio": ("onmt", 0.0),
    "coverage_beta": ("onmt", 0.0),
    "block_ngram_repeat": ("onmt", 0),
    "ignore_when_blocking": ("onmt", ()),
    "patience": ("ct2", 1.0),
}
LENGTH_PENALTY_TYPES_BY_SEMANTICS = {
    "hf": ("hf",),
    "t2t": ("wu", "gnmt"),
    "ct2": ("hf", "none"),
    "onmt": ("avg", "wu", "gnmt", "none"),
}


def ct2_max_hypotheses(num_beams: int, patience: float) -> int:
    """How many hypotheses end the search of an example: ``round(K * patience)`` (half away from zero)."""
    return int(math.floor(num_beams * patience + 0.5))


@dataclasses.dataclass(frozen=True)
class Combination:
    """One refused combination: a search whose subject satisfies ``rule`` is refused with ``message``.

    The subject is the :class:`~beamsearch.options.SearchOptions` when ``options_only``, else the search request.
    ``message`` is a string, or a function of the subject for the messages that print values.
    """

    name: str
    rule: Callable[[Any], bool]
    message: str | Callable[[Any], str]
    options_only: bool = True

    def explain(self, subject: Any) -> str:
        return self.message if isinstance(self.message, str) else self.message(subject)


def _of_request(name: str, rule: Callable[[Any], bool], message: str | Callable[[Any], str]) -> Combination:
    return Combination(name, rule, message, options_only=False)


_STOCHASTIC = "stochastic_beam_search=True (num_beams samples without replacement)"


def _groups(o: Any) -> str:
    return f"num_beam_groups={o.num_beam_groups} (diverse beam search)"


def toolkit_beams(semantics: str) -> Callable[[Any], bool]:
    """Whether that toolkit's beam search would run on these options (``num_beams=1`` runs greedy search)."""
    return lambda o: o.semantics == semantics and o.num_beams > 1


def _needs_eos(name: str, used: Callable[[Any], bool]) -> Combination:
    return Combination(f"{name} without eos_token_id", lambda o: used(o) and not o.eos_token_id,
                       f"{name} needs eos_token_id (it works by masking the end-of-sequence token)")


def _toolkit_only(name: str, owner: str, neutral: Any) -> list[Combination]:
    """An option of one toolkit's beam search, set under another semantics or without beams."""
    def used(o: Any) -> bool:
        return getattr(o, name) != neutral

    return [
        Combination(f"{name} outside semantics={owner!r}", lambda o: used(o) and o.semantics != owner,
                    lambda o: f"{name}={getattr(o, name)!r} needs semantics={owner!r} (it has no effect under "
                              f"{o.semantics!r})"),
        Combination(f"{name} without beams", lambda o: used(o) and o.num_beams < 2,
                    lambda o: f"{name}={getattr(o, name)!r} needs beam search (num_beams > 1)"),
    ]


def _wrong_length_penalty(o: Any) -> bool:
    allowed = LENGTH_PENALTY_TYPES_BY_SEMANTICS.get(o.semantics, ())
    return o.length_penalty_type is not None and o.length_penalty_type not in allowed


_CT2, _ONMT, _T2T = toolkit_beams("ct2"), toolkit_beams("onmt"), toolkit_beams("t2t")

# Checked in this order: the options-only rows, then the request's.
COMBINATIONS: list[Combination] = [
    # stochastic beam search samples by itself, over the model's distribution, with one beam per sample
    Combination("stochastic with do_sample", lambda o: o.stochastic_beam_search and o.do_sample,
                f"{_STOCHASTIC} cannot be combined with do_sample=True (it draws its own Gumbel noise)"),
    Combination("stochastic with more sequences than beams",
                lambda o: o.stochastic_beam_search and o.num_return_sequences > o.num_beams,
                lambda o: f"{_STOCHASTIC} returns at most num_beams sequences: num_return_sequences "
                          f"({o.num_return_sequences}) must be <= num_beams ({o.num_beams})"),
    Combination("stochastic with beam groups", lambda o: o.stochastic_beam_search and o.num_beam_groups > 1,
                f"{_STOCHASTIC} cannot be combined with num_beam_groups > 1"),
    Combination("stochastic outside semantics='hf'", lambda o: o.stochastic_beam_search and o.semantics != "hf",
                lambda o: f"{_STOCHASTIC} needs semantics='hf', got {o.semantics!r}"),
    # how many sequences a search returns (CTranslate2 returns up to round(num_beams * patience): its row below)
    Combination("more sequences than beams",
                lambda o: o.num_beams > 1 and o.num_return_sequences > o.num_beams and o.semantics != "ct2",
                lambda o: f"num_return_sequences ({o.num_return_sequences}) must be <= num_beams ({o.num_beams})"),
    Combination("several sequences from greedy search",
                lambda o: o.num_beams == 1 and not o.do_sample and o.num_return_sequences > 1,
                "num_return_sequences > 1 needs num_beams > 1 or do_sample=True (greedy returns one)"),
    # limits that work by masking the end token
    _needs_eos("min_length", lambda o: o.min_length > 0),
    _needs_eos("min_new_tokens", lambda o: bool(o.min_new_tokens)),
    _needs_eos("max_len_a", lambda o: o.max_len_a > 0),
    _needs_eos("max_len_b", lambda o: o.max_len_b is not None),
    # other toolkits' options: never silently ignored
    *(row for name, (owner, neutral) in TOOLKIT_ONLY.items() for row in _toolkit_only(name, owner, neutral)),
    Combination("length_penalty_type of another semantics", _wrong_length_penalty,
                lambda o: f"length_penalty_type={o.length_penalty_type!r} is not available with "
                          f"semantics={o.semantics!r} (choose from "
                          f"{list(LENGTH_PENALTY_TYPES_BY_SEMANTICS[o.semantics])})"),
    # diverse beam search: what transformers 4.x validated
    Combination("diversity_penalty without beam groups", lambda o: o.num_beam_groups == 1 and o.diversity_penalty > 0,
                lambda o: f"diversity_penalty={o.diversity_penalty!r} needs num_beam_groups > 1 (diverse beam search; "
                          "with one group it would change nothing)"),
    Combination("beam groups that do not divide the beams",
                lambda o: o.num_beam_groups > 1 and o.num_beams % o.num_beam_groups != 0,
                lambda o: f"{_groups(o)} needs num_beams divisible by num_beam_groups, got num_beams={o.num_beams}"),
    Combination("beam groups with do_sample", lambda o: o.num_beam_groups > 1 and o.do_sample,
                lambda o: f"{_groups(o)} cannot be combined with do_sample=True"),
    Combination("beam groups without diversity_penalty",
                lambda o: o.num_beam_groups > 1 and o.diversity_penalty == 0,
                lambda o: f"{_groups(o)} needs diversity_penalty > 0 (otherwise all groups are identical)"),
    Combination("beam groups outside semantics='hf'", lambda o: o.num_beam_groups > 1 and o.semantics != "hf",
                lambda o: f"{_groups(o)} needs semantics='hf', got {o.semantics!r}"),
    # what the other toolkits' beam searches do not have
    Combination("ct2 beams with do_sample", lambda o: _CT2(o) and o.do_sample,
                "semantics='ct2' beam search does not sample (CTranslate2's random beam sampler is not reproduced); "
                "use do_sample=False"),
    Combination("ct2 beams with more sequences than hypotheses",
                lambda o: _CT2(o) and o.num_return_sequences > ct2_max_hypotheses(o.num_beams, o.patience),
                lambda o: f"num_return_sequences ({o.num_return_sequences}) cannot be greater than "
                          f"round(num_beams * patience) = {ct2_max_hypotheses(o.num_beams, o.patience)}"),
    Combination("onmt beams with do_sample", lambda o: _ONMT(o) and o.do_sample,
                "semantics='onmt' is beam search: do_sample=True is not supported with it"),
    Combination("onmt beams without eos_token_id", lambda o: _ONMT(o) and not o.eos_token_id,
                "semantics='onmt' needs eos_token_id (hypotheses finish on the end token)"),
    Combination("t2t beams with do_sample", lambda o: _T2T(o) and o.do_sample,
                "semantics='t2t' is a deterministic beam search: do_sample=True is not supported"),
    Combination("t2t beams with early_stopping='never'", lambda o: _T2T(o) and o.early_stopping not in (True, False),
                lambda o: f"early_stopping is t2t's stop_early under semantics='t2t': True or False, "
                          f"got {o.early_stopping!r}"),
    # exact search: one hypothesis, the best under transformers' beam score, ended only by an end token or the limit
    Combination("exact search with do_sample", lambda o: o.exact_search and o.do_sample,
                "exact_search=True finds the best hypothesis: it cannot be combined with do_sample=True"),
    Combination("exact search with several sequences", lambda o: o.exact_search and o.num_return_sequences > 1,
                "exact_search=True returns one hypothesis per example: num_return_sequences must be 1"),
    Combination("exact search outside semantics='hf'", lambda o: o.exact_search and o.semantics != "hf",
                lambda o: f"exact_search=True scores as transformers' beam search: it needs semantics='hf', got "
                          f"{o.semantics!r}"),
    Combination("exact search with per-step outputs", lambda o: o.exact_search and (o.output_scores or o.output_logits),
                "exact_search=True keeps no per-step scores or logits (its rows change at every step)"),
    Combination("exact search with stop strings or a time limit",
                lambda o: o.exact_search and (bool(o.stop_strings) or o.max_time is not None),
                "exact_search=True ends hypotheses only at an end token or the length limit: stop_strings and "
                "max_time are not supported with it"),
    # the arguments of search() against the options
    _of_request("prefix_bias_beta without target_prefix",
                lambda r: bool(r.prefix_bias_beta) and r.target_prefix is None,
                "prefix_bias_beta needs a target_prefix to bias toward"),
    _of_request("ct2 prefix with beams",
                lambda r: r.target_prefix is not None and _CT2(r.options) and not r.prefix_bias_beta,
                "target_prefix with semantics='ct2' and num_beams > 1 is not supported: CTranslate2's beam search "
                "after a prefix is not reproduced yet (greedy is)"),
    _of_request("alignments outside hf beams", lambda r: r.output_alignments and r.beams and not r.hf_beams,
                "output_alignments needs semantics='hf' and no beam groups"),
    _of_request("ranking outside hf beams", lambda r: r.ranking and not (r.hf_beams and r.beams),
                "sequence_scorer and unique need beam search (num_beams > 1) with semantics='hf' and no beam groups"),
    _of_request("constraints outside hf beams",
                lambda r: r.constraints is not None and (not (r.hf_beams and r.beams) or r.options.do_sample),
                "force_words_ids needs beam search (num_beams > 1, do_sample=False) with semantics='hf' and no beam "
                "groups"),
    _of_request("stochastic with pool options",
                lambda r: r.options.stochastic_beam_search and (r.ranking or r.output_alignments
                                                                or r.constraints is not None),
                "stochastic_beam_search cannot be combined with sequence_scorer, unique, output_alignments or "
                "force_words_ids"),
    _of_request("exact search with other stopping criteria", lambda r: r.options.exact_search and r.other_criteria,
                "exact_search=True ends hypotheses only at an end token or the length limit: a stopping criterion "
                "of the caller's is not supported with it"),
    _of_request("incumbent without exact search", lambda r: r.incumbent is not None and not r.options.exact_search,
                "incumbent is a threshold for exact_search=True; pass exact_search=True or no incumbent"),
    _of_request("onmt ratio without source lengths",
                lambda r: _ONMT(r.options) and r.options.ratio > 0 and r.source_lengths is None,
                "ratio needs the source lengths (search(..., source_lengths=))"),
    _of_request("onmt max_length_ratio without source lengths",
                lambda r: _ONMT(r.options) and r.options.max_length_ratio > 0 and r.source_lengths is None,
                "max_length_ratio needs the source lengths (search(..., source_lengths=)); pass max_length_ratio=0 "
                "to turn OpenNMT's default limit off"),
]


def first_refused(options: Any, request: Any = None) -> Combination | None:
    """The first row of :data:`COMBINATIONS` that holds, or None.

    Without a request only the options-only rows are checked; with one, every row (the options-only ones on
    ``options``, which should be ``request.options``).
    """
    for row in COMBINATIONS:
        if row.options_only and row.rule(options):
            return row
        if not row.options_only and request is not None and row.rule(request):
            return row
    return None


def check_combinations(options: Any, request: Any = None) -> None:
    """Raise ValueError with the message of :func:`first_refused`'s row, if any."""
    row = first_refused(options, request)
    if row is not None:
        raise ValueError(row.explain(options if row.options_only else request))
