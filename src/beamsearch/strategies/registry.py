"""Which strategy runs a search, by declared rule, and the table of option combinations no strategy runs.

:data:`INCOMPATIBLE` lists every combination of search arguments that is refused, each with its message;
:func:`check` raises the first that applies. :data:`REGISTRY` lists the strategies in order of precedence, each
with the rule that selects it; :func:`choose` builds the first whose rule holds (the last one, greedy search and
sampling, always applies). The tests enumerate both tables.

Legend: B batch, K beams, t0 prompt length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..options import SearchOptions
from .base import StepTrace


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


# (name, rule, message): a search whose request satisfies the rule is refused with the message.
INCOMPATIBLE: list[tuple[str, Callable[[Request], bool], str]] = [
    ("ct2 prefix with beams",
     lambda r: r.target_prefix is not None and r.options.semantics == "ct2" and r.beams and not r.prefix_bias_beta,
     "target_prefix with semantics='ct2' and num_beams > 1 is not supported: CTranslate2's beam search after a "
     "prefix is not reproduced yet (greedy is)"),
    ("alignments outside hf beams",
     lambda r: r.output_alignments and r.beams and not r.hf_beams,
     "output_alignments needs semantics='hf' and no beam groups"),
    ("ranking outside hf beams",
     lambda r: r.ranking and not (r.hf_beams and r.beams),
     "sequence_scorer and unique need beam search (num_beams > 1) with semantics='hf' and no beam groups"),
    ("constraints outside hf beams",
     lambda r: r.constraints is not None and (not (r.hf_beams and r.beams) or r.options.do_sample),
     "force_words_ids needs beam search (num_beams > 1, do_sample=False) with semantics='hf' and no beam groups"),
    ("stochastic with pool options",
     lambda r: r.options.stochastic_beam_search and (r.ranking or r.output_alignments or r.constraints is not None),
     "stochastic_beam_search cannot be combined with sequence_scorer, unique, output_alignments or "
     "force_words_ids"),
]


def check(request: Request) -> None:
    """Raise ValueError with the message of the first combination of :data:`INCOMPATIBLE` the request holds."""
    for _, applies, message in INCOMPATIBLE:
        if applies(request):
            raise ValueError(message)


def _stochastic(r: Request) -> Any:
    from .stochastic import StochasticBeamSearch

    o = r.options
    return StochasticBeamSearch(r.input_ids, o.num_beams, r.max_length, r.processors, r.criteria,
                                eos_token_id=o.eos_token_id, fill_token_id=r.fill, temperature=o.temperature,
                                num_return_sequences=o.num_return_sequences, trace=r.trace)


def _toolkit(r: Request) -> Any:
    if r.options.semantics == "t2t":
        from .t2t import T2TBeamSearch as strategy
    elif r.options.semantics == "onmt":
        from .onmt import ONMTBeamSearch as strategy
    else:
        from .ct2 import CT2BeamSearch as strategy
    return strategy(r.input_ids, r.max_length, r.processors, r.criteria, options=r.options, fill_token_id=r.fill,
                    trace=r.trace, source_lengths=r.source_lengths)


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
                      output_alignments=r.output_alignments, **_common(r))


def _sampling(r: Request) -> Any:
    from .sampling import SamplingSearch

    return SamplingSearch(r.input_ids, r.rows, r.max_length, r.processors, r.criteria, pad_token_id=r.fill,
                          remove_finished=r.removal, output_alignments=r.output_alignments, **_common(r))


# (name, rule, factory), in order of precedence: the first strategy whose rule holds runs the search.
REGISTRY: list[tuple[str, Callable[[Request], bool], Callable[[Request], Any]]] = [
    ("stochastic beam search", lambda r: r.options.stochastic_beam_search, _stochastic),
    ("another toolkit's beam search", lambda r: r.beams and r.options.semantics != "hf", _toolkit),
    ("diverse (group) beam search", lambda r: r.options.num_beam_groups > 1, _group),
    ("constrained beam search", lambda r: r.constraints is not None, _constrained),
    ("beam search and beam sampling", lambda r: r.beams, _beam),
    ("greedy search and sampling", lambda r: True, _sampling),
]


def choose(request: Request) -> Any:
    """The strategy of the first :data:`REGISTRY` entry whose rule holds, built for ``request``."""
    return next(make for _, applies, make in REGISTRY if applies(request))(request)
