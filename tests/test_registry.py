"""The strategy registry (strategies/registry.py) and the table of refused combinations (strategies/validation.py),
entry by entry: every row refused with its message (and its near miss running), every strategy selected by its
rule, and every strategy option accepted where declared and refused elsewhere."""

from __future__ import annotations

import pytest
import torch

import beamsearch
from beamsearch import engine
from beamsearch import options as options_module
from beamsearch.options import SEARCH_ARGUMENTS, UNSUPPORTED_OPTIONS, SearchOptions
from beamsearch.ranking import check_ranking
from beamsearch.strategies import registry
from beamsearch.strategies.base import StepTrace
from beamsearch.strategies.constrained import parse_constraints
from beamsearch.strategies.registry import REGISTRY, STRATEGY_OPTIONS, Request, check, select
from beamsearch.strategies.validation import COMBINATIONS, TOOLKIT_ONLY, first_refused

VOCAB = 6
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))


def step(tokens, state):
    return TABLE[tokens[:, -1]], state


def aligned_step(tokens, state):
    return TABLE[tokens[:, -1]], state, torch.ones(tokens.shape[0], 3) / 3


START = torch.tensor([[1], [2]])
SL = [1, 1]  # source lengths, for OpenNMT's max_length_ratio (its preset: 1.25) and ratio, and max_len_a / max_len_b
ON = dict(semantics="onmt", num_beams=2, eos_token_id=0)  # OpenNMT's beam search
ARGUMENTS = ("target_prefix", "prefix_bias_beta", "output_alignments", "unique", "sequence_scorer",
             "force_words_ids", "source_lengths", "stopping_criteria", "incumbent")


def stop_at_three(input_ids, scores):
    """A stopping criterion of the caller's: rows stop once they hold three tokens."""
    return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 3, dtype=torch.bool)


def run(kwargs):
    """``beamsearch.search`` over the table model, 3 new tokens; the step returns attention where it is needed."""
    kwargs = {"max_new_tokens": 3, **kwargs}
    if "source_lengths" in kwargs:
        kwargs["source_lengths"] = torch.tensor(kwargs["source_lengths"])
    aligned = kwargs.get("output_alignments") or kwargs.get("coverage_penalty", "none") != "none"
    return beamsearch.search(aligned_step if aligned else step, START, **kwargs)


def request_for(kwargs, monkeypatch) -> Request:
    """The request ``search`` would check, with options whose combinations were not checked when built."""
    monkeypatch.setattr(options_module, "check_combinations", lambda *args: None)
    kwargs = {"max_new_tokens": 3, **kwargs}
    arguments = {name: kwargs.pop(name) for name in ARGUMENTS if name in kwargs}
    options = SearchOptions.create(**kwargs)
    words = arguments.get("force_words_ids")
    lengths = arguments.get("source_lengths")
    criteria = list(arguments.get("stopping_criteria", []))
    return Request(START, options, 4, processors=[], criteria=criteria, fill=0, trace=StepTrace(False, False),
                   rows=max(options.num_beams, options.num_return_sequences), removal=False,
                   source_lengths=None if lengths is None else torch.tensor(lengths),
                   constraints=None if words is None else parse_constraints(words),
                   sequence_scorer=arguments.get("sequence_scorer"),
                   unique_key=check_ranking(None, arguments.get("unique")),
                   output_alignments=arguments.get("output_alignments", False),
                   target_prefix=arguments.get("target_prefix"), prefix_bias_beta=arguments.get("prefix_bias_beta", 0),
                   incumbent=arguments.get("incumbent"))


# one refused search per row of COMBINATIONS, by name, with the message it must raise (the messages as they were
# before the table gathered them; no eos_token_id unless given)
REFUSED = {
    "stochastic with do_sample": (
        dict(stochastic_beam_search=True, num_beams=2, do_sample=True),
        "stochastic_beam_search=True (num_beams samples without replacement) cannot be combined with do_sample=True "
        "(it draws its own Gumbel noise)"),
    "stochastic with more sequences than beams": (
        dict(stochastic_beam_search=True, num_beams=2, num_return_sequences=3),
        "stochastic_beam_search=True (num_beams samples without replacement) returns at most num_beams sequences: "
        "num_return_sequences (3) must be <= num_beams (2)"),
    "stochastic with beam groups": (
        dict(stochastic_beam_search=True, num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
        "stochastic_beam_search=True (num_beams samples without replacement) cannot be combined with "
        "num_beam_groups > 1"),
    "stochastic outside semantics='hf'": (
        dict(stochastic_beam_search=True, num_beams=2, semantics="t2t"),
        "stochastic_beam_search=True (num_beams samples without replacement) needs semantics='hf', got 't2t'"),
    "more sequences than beams": (
        dict(num_beams=2, num_return_sequences=3), "num_return_sequences (3) must be <= num_beams (2)"),
    "several sequences from greedy search": (
        dict(num_return_sequences=2),
        "num_return_sequences > 1 needs num_beams > 1 or do_sample=True (greedy returns one)"),
    "min_length without eos_token_id": (
        dict(min_length=2), "min_length needs eos_token_id (it works by masking the end-of-sequence token)"),
    "min_new_tokens without eos_token_id": (
        dict(min_new_tokens=2), "min_new_tokens needs eos_token_id (it works by masking the end-of-sequence token)"),
    "max_len_a without eos_token_id": (
        dict(max_len_a=1.0), "max_len_a needs eos_token_id (it works by masking the end-of-sequence token)"),
    "max_len_b without eos_token_id": (
        dict(max_len_b=2), "max_len_b needs eos_token_id (it works by masking the end-of-sequence token)"),
    "coverage_penalty outside semantics='onmt'": (
        dict(num_beams=2, coverage_penalty="wu"),
        "coverage_penalty='wu' needs semantics='onmt' (it has no effect under 'hf')"),
    "coverage_penalty without beams": (
        dict(ON, num_beams=1, coverage_penalty="wu"), "coverage_penalty='wu' needs beam search (num_beams > 1)"),
    "stepwise_penalty outside semantics='onmt'": (
        dict(num_beams=2, stepwise_penalty=True),
        "stepwise_penalty=True needs semantics='onmt' (it has no effect under 'hf')"),
    "stepwise_penalty without beams": (
        dict(ON, num_beams=1, stepwise_penalty=True), "stepwise_penalty=True needs beam search (num_beams > 1)"),
    "ratio outside semantics='onmt'": (
        dict(num_beams=2, ratio=1.5), "ratio=1.5 needs semantics='onmt' (it has no effect under 'hf')"),
    "ratio without beams": (dict(ON, num_beams=1, ratio=1.5), "ratio=1.5 needs beam search (num_beams > 1)"),
    "max_length_ratio outside semantics='onmt'": (
        dict(num_beams=2, semantics="ct2", max_length_ratio=2.0),
        "max_length_ratio=2.0 needs semantics='onmt' (it has no effect under 'ct2')"),
    "max_length_ratio without beams": (  # the OpenNMT preset's 1.25
        dict(ON, num_beams=1), "max_length_ratio=1.25 needs beam search (num_beams > 1)"),
    "coverage_beta outside semantics='onmt'": (
        dict(num_beams=2, semantics="t2t", coverage_beta=0.5),
        "coverage_beta=0.5 needs semantics='onmt' (it has no effect under 't2t')"),
    "coverage_beta without beams": (
        dict(ON, num_beams=1, max_length_ratio=0.0, coverage_beta=0.5),
        "coverage_beta=0.5 needs beam search (num_beams > 1)"),
    "block_ngram_repeat outside semantics='onmt'": (
        dict(num_beams=2, block_ngram_repeat=2),
        "block_ngram_repeat=2 needs semantics='onmt' (it has no effect under 'hf')"),
    "block_ngram_repeat without beams": (
        dict(ON, num_beams=1, max_length_ratio=0.0, block_ngram_repeat=2),
        "block_ngram_repeat=2 needs beam search (num_beams > 1)"),
    "ignore_when_blocking outside semantics='onmt'": (
        dict(num_beams=2, ignore_when_blocking=[3]),
        "ignore_when_blocking=(3,) needs semantics='onmt' (it has no effect under 'hf')"),
    "ignore_when_blocking without beams": (
        dict(ON, num_beams=1, max_length_ratio=0.0, ignore_when_blocking=[3]),
        "ignore_when_blocking=(3,) needs beam search (num_beams > 1)"),
    "patience outside semantics='ct2'": (
        dict(ON, patience=2.0), "patience=2.0 needs semantics='ct2' (it has no effect under 'onmt')"),
    "patience without beams": (
        dict(semantics="ct2", num_beams=1, patience=2.0), "patience=2.0 needs beam search (num_beams > 1)"),
    "length_penalty_type of another semantics": (
        dict(num_beams=2, length_penalty_type="wu"),
        "length_penalty_type='wu' is not available with semantics='hf' (choose from ['hf'])"),
    "diversity_penalty without beam groups": (
        dict(num_beams=4, diversity_penalty=1.0),
        "diversity_penalty=1.0 needs num_beam_groups > 1 (diverse beam search; with one group it would change "
        "nothing)"),
    "beam groups that do not divide the beams": (
        dict(num_beams=6, num_beam_groups=4, diversity_penalty=1.0),
        "num_beam_groups=4 (diverse beam search) needs num_beams divisible by num_beam_groups, got num_beams=6"),
    "beam groups with do_sample": (
        dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, do_sample=True),
        "num_beam_groups=2 (diverse beam search) cannot be combined with do_sample=True"),
    "beam groups without diversity_penalty": (
        dict(num_beams=4, num_beam_groups=2),
        "num_beam_groups=2 (diverse beam search) needs diversity_penalty > 0 (otherwise all groups are identical)"),
    "beam groups outside semantics='hf'": (
        dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, semantics="t2t"),
        "num_beam_groups=2 (diverse beam search) needs semantics='hf', got 't2t'"),
    "ct2 beams with do_sample": (
        dict(semantics="ct2", num_beams=2, do_sample=True),
        "semantics='ct2' beam search does not sample (CTranslate2's random beam sampler is not reproduced); use "
        "do_sample=False"),
    "ct2 beams with more sequences than hypotheses": (
        dict(semantics="ct2", num_beams=2, patience=0.5, num_return_sequences=2),
        "num_return_sequences (2) cannot be greater than round(num_beams * patience) = 1"),
    "onmt beams with do_sample": (
        dict(ON, do_sample=True, source_lengths=SL),
        "semantics='onmt' is beam search: do_sample=True is not supported with it"),
    "onmt beams without eos_token_id": (
        dict(ON, eos_token_id=None, source_lengths=SL),
        "semantics='onmt' needs eos_token_id (hypotheses finish on the end token)"),
    "t2t beams with do_sample": (
        dict(semantics="t2t", num_beams=2, do_sample=True),
        "semantics='t2t' is a deterministic beam search: do_sample=True is not supported"),
    "t2t beams with early_stopping='never'": (
        dict(semantics="t2t", num_beams=2, early_stopping="never"),
        "early_stopping is t2t's stop_early under semantics='t2t': True or False, got 'never'"),
    "exact search with do_sample": (
        dict(exact_search=True, do_sample=True),
        "exact_search=True finds the best hypothesis: it cannot be combined with do_sample=True"),
    "exact search with several sequences": (
        dict(exact_search=True, num_beams=2, num_return_sequences=2),
        "exact_search=True returns one hypothesis per example: num_return_sequences must be 1"),
    "exact search outside semantics='hf'": (
        dict(exact_search=True, semantics="t2t"),
        "exact_search=True scores as transformers' beam search: it needs semantics='hf', got 't2t'"),
    "exact search with per-step outputs": (
        dict(exact_search=True, output_scores=True),
        "exact_search=True keeps no per-step scores or logits (its rows change at every step)"),
    "exact search with stop strings or a time limit": (
        dict(exact_search=True, max_time=10.0),
        "exact_search=True ends hypotheses only at an end token or the length limit: stop_strings and max_time are "
        "not supported with it"),
    "prefix_bias_beta without target_prefix": (
        dict(prefix_bias_beta=0.5), "prefix_bias_beta needs a target_prefix to bias toward"),
    "ct2 prefix with beams": (
        dict(semantics="ct2", num_beams=2, target_prefix=[[3], [4]]),
        "target_prefix with semantics='ct2' and num_beams > 1 is not supported: CTranslate2's beam search after a "
        "prefix is not reproduced yet (greedy is)"),
    "alignments outside hf beams": (
        dict(ON, output_alignments=True, source_lengths=SL),
        "output_alignments needs semantics='hf' and no beam groups"),
    "ranking outside hf beams": (
        dict(unique=True),
        "sequence_scorer and unique need beam search (num_beams > 1) with semantics='hf' and no beam groups"),
    "constraints outside hf beams": (
        dict(force_words_ids=[[3]]),
        "force_words_ids needs beam search (num_beams > 1, do_sample=False) with semantics='hf' and no beam groups"),
    "stochastic with pool options": (
        dict(num_beams=2, stochastic_beam_search=True, output_alignments=True),
        "stochastic_beam_search cannot be combined with sequence_scorer, unique, output_alignments or "
        "force_words_ids"),
    "exact search with other stopping criteria": (
        dict(exact_search=True, stopping_criteria=[stop_at_three]),
        "exact_search=True ends hypotheses only at an end token or the length limit: a stopping criterion of the "
        "caller's is not supported with it"),
    "incumbent without exact search": (
        dict(num_beams=2, incumbent=object()),
        "incumbent is a threshold for exact_search=True; pass exact_search=True or no incumbent"),
    "onmt ratio without source lengths": (
        dict(ON, ratio=1.5, max_length_ratio=0.0), "ratio needs the source lengths (search(..., source_lengths=))"),
    "onmt max_length_ratio without source lengths": (
        dict(ON),
        "max_length_ratio needs the source lengths (search(..., source_lengths=)); pass max_length_ratio=0 to turn "
        "OpenNMT's default limit off"),
}

# the same searches one step away from each refused combination: they run
PASSES = {
    "stochastic with do_sample": dict(stochastic_beam_search=True, num_beams=2),
    "stochastic with more sequences than beams": dict(stochastic_beam_search=True, num_beams=2,
                                                      num_return_sequences=2),
    "stochastic with beam groups": dict(stochastic_beam_search=True, num_beams=4),
    "stochastic outside semantics='hf'": dict(stochastic_beam_search=True, num_beams=2, semantics="hf"),
    # CTranslate2 returns up to round(num_beams * patience) hypotheses
    "more sequences than beams": dict(semantics="ct2", num_beams=2, patience=1.5, num_return_sequences=3),
    "several sequences from greedy search": dict(num_return_sequences=2, do_sample=True),
    "min_length without eos_token_id": dict(min_length=2, eos_token_id=0),
    "min_new_tokens without eos_token_id": dict(min_new_tokens=2, eos_token_id=0),
    "max_len_a without eos_token_id": dict(max_len_a=1.0, eos_token_id=0, source_lengths=SL),
    "max_len_b without eos_token_id": dict(max_len_b=2, eos_token_id=0, source_lengths=SL),
    "coverage_penalty outside semantics='onmt'": dict(ON, coverage_penalty="wu", source_lengths=SL),
    "coverage_penalty without beams": dict(ON, coverage_penalty="wu", source_lengths=SL),
    "stepwise_penalty outside semantics='onmt'": dict(ON, stepwise_penalty=True, source_lengths=SL),
    "stepwise_penalty without beams": dict(ON, stepwise_penalty=True, source_lengths=SL),
    "ratio outside semantics='onmt'": dict(ON, ratio=1.5, source_lengths=SL),
    "ratio without beams": dict(ON, ratio=1.5, source_lengths=SL),
    "max_length_ratio outside semantics='onmt'": dict(ON, max_length_ratio=2.0, source_lengths=SL),
    "max_length_ratio without beams": dict(ON, num_beams=1, max_length_ratio=0.0),
    "coverage_beta outside semantics='onmt'": dict(ON, coverage_beta=0.5, source_lengths=SL),
    "coverage_beta without beams": dict(ON, coverage_beta=0.5, source_lengths=SL),
    "block_ngram_repeat outside semantics='onmt'": dict(ON, block_ngram_repeat=2, source_lengths=SL),
    "block_ngram_repeat without beams": dict(ON, block_ngram_repeat=2, source_lengths=SL),
    "ignore_when_blocking outside semantics='onmt'": dict(ON, ignore_when_blocking=[3], source_lengths=SL),
    "ignore_when_blocking without beams": dict(ON, ignore_when_blocking=[3], source_lengths=SL),
    "patience outside semantics='ct2'": dict(semantics="ct2", num_beams=2, patience=2.0),
    "patience without beams": dict(semantics="ct2", num_beams=2, patience=2.0),
    "length_penalty_type of another semantics": dict(num_beams=2, length_penalty_type="hf"),
    "diversity_penalty without beam groups": dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
    "beam groups that do not divide the beams": dict(num_beams=8, num_beam_groups=4, diversity_penalty=1.0),
    "beam groups with do_sample": dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
    "beam groups without diversity_penalty": dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
    "beam groups outside semantics='hf'": dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
    "ct2 beams with do_sample": dict(semantics="ct2", num_beams=1, do_sample=True),  # greedy sampling samples
    "ct2 beams with more sequences than hypotheses": dict(semantics="ct2", num_beams=2, patience=1.0,
                                                          num_return_sequences=2),
    "onmt beams with do_sample": dict(ON, source_lengths=SL),
    "onmt beams without eos_token_id": dict(ON, source_lengths=SL),
    "t2t beams with do_sample": dict(semantics="t2t", num_beams=1, do_sample=True),
    "t2t beams with early_stopping='never'": dict(semantics="t2t", num_beams=2, early_stopping=False),
    "exact search with do_sample": dict(exact_search=True),
    "exact search with several sequences": dict(exact_search=True, num_beams=2),
    "exact search outside semantics='hf'": dict(exact_search=True, semantics="hf"),
    "exact search with per-step outputs": dict(exact_search=True, output_scores=False),
    "exact search with stop strings or a time limit": dict(exact_search=True, max_new_tokens=2),
    "prefix_bias_beta without target_prefix": dict(prefix_bias_beta=0.5, target_prefix=[[3], [4]]),
    "ct2 prefix with beams": dict(semantics="ct2", num_beams=2, target_prefix=[[3], [4]], prefix_bias_beta=0.5),
    "alignments outside hf beams": dict(num_beams=2, output_alignments=True),
    "ranking outside hf beams": dict(num_beams=2, unique=True),
    "constraints outside hf beams": dict(num_beams=3, force_words_ids=[[3]]),
    "stochastic with pool options": dict(num_beams=2, output_alignments=True),
    "exact search with other stopping criteria": dict(num_beams=2, stopping_criteria=[stop_at_three]),
    "incumbent without exact search": dict(exact_search=True, incumbent=None),
    "onmt ratio without source lengths": dict(ON, ratio=1.5, max_length_ratio=0.0, source_lengths=SL),
    "onmt max_length_ratio without source lengths": dict(ON, max_length_ratio=0.0),
}
ROWS = {row.name: row for row in COMBINATIONS}


def test_every_refused_combination_has_a_case_and_a_near_miss():
    assert len(ROWS) == len(COMBINATIONS)  # names are unique
    assert list(ROWS) == list(REFUSED) == list(PASSES)


@pytest.mark.parametrize("name", list(REFUSED))
def test_the_row_refuses_with_its_message(name, monkeypatch):
    kwargs, message = REFUSED[name]
    row = ROWS[name]
    options_part = {k: v for k, v in kwargs.items() if k not in ARGUMENTS}
    if row.options_only:  # refused as soon as the options are built (the command line counts on that)
        with pytest.raises(ValueError) as error:
            SearchOptions.create(**options_part)
        assert str(error.value) == message
    else:  # the options alone are fine: the search's arguments make the combination
        SearchOptions.create(**options_part)
    with pytest.raises(ValueError) as error:
        run(dict(kwargs))
    assert str(error.value) == message
    # the search-time walk finds the same row first, options-only rows included (options built unchecked)
    request = request_for(dict(kwargs), monkeypatch)
    assert first_refused(request.options, request) is row
    with pytest.raises(ValueError) as error:
        check(request)
    assert str(error.value) == message


@pytest.mark.parametrize("name", list(PASSES))
def test_the_near_miss_runs(name, monkeypatch):
    result = run(dict(PASSES[name]))
    assert result.sequences.shape[0] == 2
    request = request_for(dict(PASSES[name]), monkeypatch)
    assert first_refused(request.options, request) is None


# one search per strategy, named as in REGISTRY, and the class it must build
CHOSEN = {
    "exact search (branch and bound)": (dict(exact_search=True), "ExactSearch"),
    "stochastic beam search": (dict(num_beams=2, stochastic_beam_search=True), "StochasticBeamSearch"),
    "tensor2tensor's beam search (semantics='t2t')": (dict(num_beams=2, semantics="t2t"), "T2TBeamSearch"),
    "OpenNMT-py's beam search (semantics='onmt')": (dict(ON, source_lengths=SL), "ONMTBeamSearch"),
    "CTranslate2's beam search (semantics='ct2')": (dict(num_beams=2, semantics="ct2"), "CT2BeamSearch"),
    "diverse (group) beam search": (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), "GroupBeamSearch"),
    "constrained beam search": (dict(num_beams=3, force_words_ids=[[3]]), "ConstrainedBeamSearch"),
    "beam search and beam sampling": (dict(num_beams=2), "BeamSearch"),
    "greedy search and sampling": (dict(), "SamplingSearch"),
}


def test_every_strategy_has_a_case():
    assert [strategy.name for strategy in REGISTRY] == list(CHOSEN)


def built_by(kwargs, monkeypatch):
    """The class of the strategy the search built, and its result."""
    built = []
    original = engine.decode

    def recording(step_fn, state, strategy, batch_size):
        built.append(type(strategy).__name__)
        return original(step_fn, state, strategy, batch_size)

    monkeypatch.setattr(engine, "decode", recording)
    result = run(dict(kwargs, eos_token_id=0))
    assert len(built) == 1 and result.sequences.shape[0] == 2
    return built[0]


@pytest.mark.parametrize("name", list(CHOSEN))
def test_the_rule_selects_the_strategy(name, monkeypatch):
    kwargs, cls = CHOSEN[name]
    assert built_by(kwargs, monkeypatch) == cls


# a value of each strategy option that changes something
SET = {
    "do_sample": True,
    "exact_search": True,
    "max_nodes": 50,
    "stochastic_beam_search": True,
    "num_beam_groups": 2,
    "diversity_penalty": 1.0,
    "coverage_penalty": "wu",
    "stepwise_penalty": True,
    "ratio": 1.5,
    "max_length_ratio": 2.0,
    "coverage_beta": 0.5,
    "block_ngram_repeat": 2,
    "ignore_when_blocking": [3],
    "patience": 2.0,
    "force_words_ids": [[3]],
    "sequence_scorer": lambda tokens, log_probs, lengths: log_probs.sum(dim=1),
    "unique": True,
    "output_alignments": True,
}
DECLARED = [(s.name, option) for s in REGISTRY for option in sorted(s.supports)]
UNDECLARED = [(s.name, option) for s in REGISTRY for option in STRATEGY_OPTIONS if option not in s.supports]


def test_every_strategy_option_has_a_value_and_a_strategy():
    assert list(SET) == list(STRATEGY_OPTIONS)
    assert {option for s in REGISTRY for option in s.supports} == set(STRATEGY_OPTIONS)


def test_each_toolkit_option_is_declared_by_its_toolkit_only():
    """validation.py's "needs semantics=..." rows and the declarations agree."""
    for option, (owner, _) in TOOLKIT_ONLY.items():
        request = Request(START, SearchOptions.create(semantics=owner, num_beams=2, eos_token_id=0), 4, [], [], 0,
                          StepTrace(False, False), 2, False)
        assert [s.name for s in REGISTRY if option in s.supports] == [select(request).name]


@pytest.mark.parametrize(("name", "option"), DECLARED)
def test_a_declared_option_is_accepted(name, option, monkeypatch):
    kwargs = dict(CHOSEN[name][0], **{option: SET[option]})
    assert built_by(kwargs, monkeypatch) == CHOSEN[name][1]


@pytest.mark.parametrize(("name", "option"), UNDECLARED)
def test_an_undeclared_option_is_refused(name, option, monkeypatch):
    """Refused by a row of the table, and by the declarations alone; unless the option selects another strategy."""
    extra = {option: SET[option], **({"diversity_penalty": 1.0} if option == "num_beam_groups" else {})}
    request = request_for(dict(CHOSEN[name][0], **extra), monkeypatch)
    if select(request).name != name:
        assert option in {"exact_search", "stochastic_beam_search", "num_beam_groups", "force_words_ids"}  # selecting
        return
    with pytest.raises(ValueError):
        check(request)
    monkeypatch.setattr(registry, "check_combinations", lambda *args: None)
    with pytest.raises(ValueError) as error:
        check(request)
    assert str(error.value).startswith(f"{option}")
    assert f" is not supported by {name} (the strategy options it takes: " in str(error.value)


def test_the_undeclared_option_message(monkeypatch):
    request = request_for(dict(num_beams=2, semantics="t2t", coverage_beta=0.5), monkeypatch)
    monkeypatch.setattr(registry, "check_combinations", lambda *args: None)
    with pytest.raises(ValueError) as error:
        check(request)
    assert str(error.value) == ("coverage_beta=0.5 is not supported by tensor2tensor's beam search "
                                "(semantics='t2t') (the strategy options it takes: [])")


@pytest.mark.parametrize("name", SEARCH_ARGUMENTS)
def test_search_arguments_are_not_options_and_say_where_they_go(name):
    assert name not in UNSUPPORTED_OPTIONS
    with pytest.raises(ValueError) as error:
        SearchOptions.create(**{name: [[3]]})
    assert str(error.value) == (f"{name!r} is an argument of beamsearch.search and beamsearch.generate, not a "
                                f"SearchOptions field: pass it to them as {name}=...")
    SearchOptions.create(**{name: None})  # unset
