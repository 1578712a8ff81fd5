"""What a captured step cannot do, refused by name before anything runs (``cuda_graphs=True``).

A CUDA graph replays device work only: anything that needs the host at every step (a user's processor or stopping
criterion, stop strings, the clock of ``max_time``, a callback) or a shape that changes with the data (n-gram
tables, constraints) cannot be inside it. The graph path runs greedy search and transformers' beam search with the
processors that depend on the length only (``processors.py``), on the models a lean step runs (T5, GPT-2, Llama).
Each refusal is a ValueError that names the option and says why.
"""

from __future__ import annotations

from typing import Any

from ..options import SearchOptions

_HOST = "it needs the host at every step"
# option -> (the value that changes nothing, why the graph path cannot take another)
OPTIONS: dict[str, tuple[Any, str]] = {
    "do_sample": (False, "sampling is not captured (its random draws); greedy and beam search are"),
    "num_beam_groups": (1, "diverse beam search is not captured"),
    "stochastic_beam_search": (False, "stochastic beam search is not captured"),
    "exact_search": (False, "exact search grows a tree on the host"),
    "semantics": ("hf", "only transformers' beam search is captured"),
    "output_scores": (False, "per-step scores are kept on the host, one tensor per step"),
    "output_logits": (False, "per-step logits are kept on the host, one tensor per step"),
    "max_time": (None, "the clock is read on the host"),
    "stop_strings": (None, f"stop strings are matched on the host ({_HOST})"),
    "repetition_penalty": (1.0, "its processor gathers the tokens so far (a length that grows)"),
    "no_repeat_ngram_size": (0, "its processor builds n-gram tables on the host"),
    "encoder_repetition_penalty": (1.0, "its processor is not captured"),
    "encoder_no_repeat_ngram_size": (0, "its processor builds n-gram tables on the host"),
    "bad_words_ids": (None, "its processor matches token sequences of a growing length"),
    "coverage_penalty": ("none", "attention outputs are not captured"),
}
# search arguments (beamsearch.generate's keywords) -> why
ARGUMENTS: dict[str, str] = {
    "prefix_allowed_tokens_fn": f"the function is called on the host ({_HOST})",
    "target_prefix": "per-example prefixes are not captured",
    "force_words_ids": "constraints (force_words_ids) keep per-hypothesis state of changing size",
    "sequence_scorer": f"the scorer is called on the host ({_HOST})",
    "unique": "the de-duplicated pool compares hypotheses on the host",
    "output_alignments": "attention outputs are not captured",
    "trace": "the search trace is recorded on the host",
    "stream_to": "a streamer is called on the host (streamer=)",
    "incumbent": "exact search grows a tree on the host",
}
# the other step options of beamsearch.generate -> the value that combines with cuda_graphs=True
STEP_OPTIONS: dict[str, Any] = {"lean_step": (None, True), "share_encoder_state": (False,),
                                "compile_step": (False,), "exact_parity": (False,)}


def check_graph_call(options: SearchOptions, arguments: dict[str, Any], step_options: dict[str, Any],
                     logits_processor: Any, stopping_criteria: Any) -> None:
    """Refuse a call the graph path cannot run, naming what.

    Args:
        options: the search options.
        arguments: :func:`beamsearch.search`'s keyword arguments of the call (``target_prefix``, ``trace``, ...).
        step_options: ``lean_step``, ``share_encoder_state``, ``compile_step``, ``exact_parity`` as given.
        logits_processor, stopping_criteria: the caller's own (any is refused).

    Raises:
        ValueError: ``cuda_graphs=True cannot capture NAME: why``.
    """
    if logits_processor:
        raise ValueError(f"cuda_graphs=True cannot capture logits_processor: user processors run on the host "
                         f"({_HOST}); leave cuda_graphs unset for them")
    if stopping_criteria:
        raise ValueError(f"cuda_graphs=True cannot capture stopping_criteria: user criteria run on the host "
                         f"({_HOST}); leave cuda_graphs unset for them")
    for name, (neutral, why) in OPTIONS.items():
        value = getattr(options, name)
        if value != neutral:
            raise ValueError(f"cuda_graphs=True cannot capture {name}={value!r}: {why}")
    for name, why in ARGUMENTS.items():
        value = arguments.get(name)
        if value is not None and value is not False and value != 0.0:
            raise ValueError(f"cuda_graphs=True cannot capture {name}: {why}")
    for name, allowed in STEP_OPTIONS.items():
        value = step_options.get(name, allowed[0])
        if not any(value is a for a in allowed):
            raise ValueError(f"cuda_graphs=True runs its own fixed-shape step: it cannot be combined with "
                             f"{name}={value!r}")
