"""Which strategy runs a search, by declared rule, and the options each strategy takes.

:data:`REGISTRY` lists the strategies in order of precedence, each with the rule that selects it and the strategy
options (:data:`STRATEGY_OPTIONS`) it takes; :func:`choose` builds the first whose rule holds (the last one, greedy
search and sampling, always applies). :func:`check` refuses a request, before any strategy is built, by the first
row of the table of refused combinations (``validation.py``) that holds, then by any strategy option set to a value
that changes something that the selected strategy does not declare. The tests enumerate the tables.

Legend: B batch, K beams, t0 prompt length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..options import MAX_NODES, SearchOptions
from ..stopping import EosTokenCriteria, MaxLengthCriteria
from .base import StepTrace
from .validation import TOOLKIT_ONLY, check_combinations, toolkit_beams


@dataclasses.dataclass
class Request:
    """Everything a strategy is built from: the options and the arguments of :func:`beamsearch.search`."""

    input_ids: torch.Tensor  # [B, t0]
    options: SearchOptions
    max_length: int
    processors: Any
    criteria: Any
    fill: int  # the token that pads returned sequences
    trace: StepTrace
    rows: int  # rows per example: K for beams, num_return_sequences otherwise
    removal: bool  # finished examples may leave the batch (see compaction.removal_is_exact)
    source_lengths: torch.Tensor | None = None  # [B]
    constraints: Any = None  # parsed force_words_ids
    sequence_scorer: Any = None
    unique_key: Any = None
    output_alignments: bool = False
    target_prefix: Any = None
    prefix_bias_beta: float = 0.0
    incumbent: Any = None  # exact search: a result over the same inputs whose best scores prune

    @property
    def other_criteria(self) -> bool:
        """A stopping criterion other than the length limit and the end token is among the criteria."""
        return any(not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in self.criteria)

    @property
    def beams(self) -> bool:
        return self.options.num_beams > 1

    @property
    def hf_beams(self) -> bool:
        """transformers' beam search (strategies/beam.py or its constrained variant) would run."""
        return self.options.semantics == "hf" and self.options.num_beam_groups == 1

    @property
    def ranking(self) -> bool:
        return self.sequence_scorer is not None or self.unique_key is not None


def _option(name: str) -> Callable[[Request], Any]:
    return lambda r: getattr(r.options, name)


# The options that only some strategies take: how a request holds each, and the value that changes nothing. The
# others apply to every strategy (length limits, processors, warpers, outputs), or are refused by value in
# validation.py's table (length_penalty_type by semantics, early_stopping='never' under t2t, target_prefix under
# ct2 beams). remove_finished is not one: a strategy that never drops finished examples already does what
# remove_finished=False asks.
STRATEGY_OPTIONS: dict[str, tuple[Callable[[Request], Any], Any]] = {
    "do_sample": (_option("do_sample"), False),
    "exact_search": (_option("exact_search"), False),
    "max_nodes": (_option("max_nodes"), MAX_NODES),
    "stochastic_beam_search": (_option("stochastic_beam_search"), False),
    "num_beam_groups": (_option("num_beam_groups"), 1),
    "diversity_penalty": (_option("diversity_penalty"), 0.0),
    **{name: (_option(name), neutral) for name, (_, neutral) in TOOLKIT_ONLY.items()},
    "force_words_ids": (lambda r: r.constraints, None),
    "sequence_scorer": (lambda r: r.sequence_scorer, None),
    "unique": (lambda r: r.unique_key, None),
    "output_alignments": (lambda r: r.output_alignments, False),
}


def check(request: Request) -> None:
    """Refuse the request before any strategy is built: the first row of ``validation.COMBINATIONS`` that holds,
    then a strategy option that the selected strategy does not declare (``Strategy.supports``).

    Raises:
        ValueError: with the row's message, or naming the option and the strategy.
    """
    check_combinations(request.options, request)
    strategy = select(request)
    for name, (read, neutral) in STRATEGY_OPTIONS.items():
        value = read(request)
        if name not in strategy.supports and not (value is neutral or value == neutral):
            shown = f"{name}={value!r}" if hasattr(request.options, name) else name  # an argument: its name
            raise ValueError(f"{shown} is not supported by {strategy.name} (the strategy options it takes: "
                             f"{sorted(strategy.supports)})")


def _stochastic(r: Request) -> Any:
    from .stochastic import StochasticBeamSearch

    o = r.options
    return StochasticBeamSearch(r.input_ids, o.num_beams, r.max_length, r.processors, r.criteria,
                                eos_token_id=o.eos_token_id, fill_token_id=r.fill, temperature=o.temperature,
                                num_return_sequences=o.num_return_sequences, trace=r.trace)


def _toolkit(strategy: Any, r: Request) -> Any:
    return strategy(r.input_ids, r.max_length, r.processors, r.criteria, options=r.options, fill_token_id=r.fill,
                    trace=r.trace, source_lengths=r.source_lengths)


def _t2t(r: Request) -> Any:
    from .t2t import T2TBeamSearch

    return _toolkit(T2TBeamSearch, r)


def _onmt(r: Request) -> Any:
    from .onmt import ONMTBeamSearch

    return _toolkit(ONMTBeamSearch, r)


def _ct2(r: Request) -> Any:
    from .ct2 import CT2BeamSearch

    return _toolkit(CT2BeamSearch, r)


def _group(r: Request) -> Any:
    from .group import GroupBeamSearch

    o = r.options
    return GroupBeamSearch(r.input_ids, o.num_beams, o.num_beam_groups, o.diversity_penalty, r.max_length,
                           r.processors, r.criteria, eos_token_id=o.eos_token_id, pad_token_id=o.output_fill_token,
                           fill_token_id=r.fill, length_penalty=o.length_penalty, early_stopping=o.early_stopping,
                           num_return_sequences=o.num_return_sequences, trace=r.trace)


def _common(r: Request) -> dict[str, Any]:
    o = r.options
    return dict(do_sample=o.do_sample, eos_token_id=o.eos_token_id, length_penalty=o.length_penalty, trace=r.trace)


def _exact(r: Request) -> Any:
    from .exact import ExactSearch

    o = r.options
    return ExactSearch(r.input_ids, r.max_length, r.processors, eos_token_id=o.eos_token_id, fill_token_id=r.fill,
                       length_penalty=o.length_penalty, max_nodes=o.max_nodes, trace=r.trace, incumbent=r.incumbent)


def _constrained(r: Request) -> Any:
    from .constrained import ConstrainedBeamSearch

    o = r.options
    return ConstrainedBeamSearch(r.input_ids, o.num_beams, r.max_length, r.processors, r.criteria,
                                 constraints=r.constraints, fill_token_id=r.fill, early_stopping=o.early_stopping,
                                 num_return_sequences=o.num_return_sequences, sequence_scorer=r.sequence_scorer,
                                 unique_key=r.unique_key, output_alignments=r.output_alignments, **_common(r))


def _beam(r: Request) -> Any:
    from .beam import BeamSearch

    o = r.options
    return BeamSearch(r.input_ids, o.num_beams, r.max_length, r.processors, r.criteria, fill_token_id=r.fill,
                      early_stopping=o.early_stopping, num_return_sequences=o.num_return_sequences,
                      remove_finished=r.removal, sequence_scorer=r.sequence_scorer, unique_key=r.unique_key,
                      output_alignments=r.output_alignments, sort_samples=o.hf_at_least(5, 24), **_common(r))


def _sampling(r: Request) -> Any:
    from .sampling import SamplingSearch

    return SamplingSearch(r.input_ids, r.rows, r.max_length, r.processors, r.criteria, pad_token_id=r.fill,
                          remove_finished=r.removal, output_alignments=r.output_alignments, **_common(r))


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A strategy: its name, the rule that selects it, how it is built, and the :data:`STRATEGY_OPTIONS` it takes
    (the others must keep the value that changes nothing)."""

    name: str
    applies: Callable[[Request], bool]
    make: Callable[[Request], Any]
    supports: frozenset[str] = frozenset()


_HF_POOL = {"sequence_scorer", "unique", "output_alignments"}  # what transformers' beam search pool takes here
_ONMT_OPTIONS = {name for name, (owner, _) in TOOLKIT_ONLY.items() if owner == "onmt"}
_CT2_OPTIONS = {name for name, (owner, _) in TOOLKIT_ONLY.items() if owner == "ct2"}


def _toolkit_beams(semantics: str) -> Callable[[Request], bool]:
    options_rule = toolkit_beams(semantics)  # the table's own rule, on the request's options
    return lambda r: options_rule(r.options)


# In order of precedence: the first strategy whose rule holds runs the search.
REGISTRY: list[Strategy] = [
    Strategy("exact search (branch and bound)", lambda r: r.options.exact_search, _exact,
             frozenset({"exact_search", "max_nodes"})),
    Strategy("stochastic beam search", lambda r: r.options.stochastic_beam_search, _stochastic,
             frozenset({"stochastic_beam_search"})),
    Strategy("tensor2tensor's beam search (semantics='t2t')", _toolkit_beams("t2t"), _t2t),
    Strategy("OpenNMT-py's beam search (semantics='onmt')", _toolkit_beams("onmt"), _onmt, frozenset(_ONMT_OPTIONS)),
    Strategy("CTranslate2's beam search (semantics='ct2')", _toolkit_beams("ct2"), _ct2, frozenset(_CT2_OPTIONS)),
    Strategy("diverse (group) beam search", lambda r: r.options.num_beam_groups > 1, _group,
             frozenset({"num_beam_groups", "diversity_penalty"})),
    Strategy("constrained beam search", lambda r: r.constraints is not None, _constrained,
             frozenset({"force_words_ids", *_HF_POOL})),
    Strategy("beam search and beam sampling", lambda r: r.beams, _beam, frozenset({"do_sample", *_HF_POOL})),
    Strategy("greedy search and sampling", lambda r: True, _sampling, frozenset({"do_sample", "output_alignments"})),
]


def select(request: Request) -> Strategy:
    """The first :data:`REGISTRY` entry whose rule holds."""
    return next(strategy for strategy in REGISTRY if strategy.applies(request))


def choose(request: Request) -> Any:
    """The strategy of the first :data:`REGISTRY` entry whose rule holds, built for ``request``."""
    return select(request).make(request)
