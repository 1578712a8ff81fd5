"""The command line's output length limit: a limit tied to the source decides where the model has one, and a run
ends with one line counting the outputs a limit cut.

Two limits stop an output without its own end: the cap (``max_new_tokens``, or ``max_length``), where the output
is marked ``finish_reason`` ``max_length``, and fairseq's source-tied limit (``max_len_a * source + max_len_b``
tokens), where end-of-sequence is forced (:class:`beamsearch.processors.limits.SourceTiedMaxLength`), so the output
ends with EOS at ``floor(a * source + b) + 1`` tokens; the command line marks it ``finish_reason``
``source_length_limit``. Where the flags or the model's generation_config set a
source-tied limit and no ``--max-new-tokens`` is given, each batch's cap is raised to its longest source's
source-tied length, so that the cap never cuts first (the embedded model's 32 would cut a 45-letter word that
its ``1.0 * source + 3`` lets run to 49).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class CutCount:
    """The outputs a run decoded and those a length limit stopped (its best hypothesis, one per input)."""

    outputs: int = 0
    at_cap: int = 0  # finish_reason max_length
    at_source_limit: int = 0  # EOS forced at the source-tied limit

    def add(self, other: CutCount) -> None:
        """Count ``other``'s outputs too (``decode --ray``: the blocks' counts summed)."""
        self.outputs += other.outputs
        self.at_cap += other.at_cap
        self.at_source_limit += other.at_source_limit


def source_tied_limit(generation_config: Any, options: dict[str, Any]) -> tuple[float, int] | None:
    """``(max_len_a, max_len_b)`` from the flags, else the model's generation_config; None when neither sets one."""
    a = options.get("max_len_a", getattr(generation_config, "max_len_a", None)) or 0.0
    b = options.get("max_len_b", getattr(generation_config, "max_len_b", None))
    return (a, b or 0) if a > 0 or b is not None else None


def source_tied_tokens(limit: tuple[float, int], source_length: int) -> int:
    """The most tokens an output of a ``source_length``-token source has under the limit, its forced EOS included
    (the limit's own arithmetic, in double precision)."""
    a, b = limit
    return max(1, math.floor(a * source_length + b) + 1)


def capped(generation_config: Any, options: dict[str, Any], source_length: int) -> dict[str, Any]:
    """The options of a batch whose longest source has ``source_length`` tokens: without ``--max-new-tokens``,
    the model's ``max_new_tokens`` raised (never lowered) to the source-tied limit's length, where one is set."""
    limit = source_tied_limit(generation_config, options)
    if limit is None or "max_new_tokens" in options:
        return options
    own = getattr(generation_config, "max_new_tokens", None) or 0
    return dict(options, max_new_tokens=max(own, source_tied_tokens(limit, source_length)))


SOURCE_LIMIT = "source_length_limit"  # the finish reason the files give an output ended at the source-tied limit


def mark_source_limit(limit: tuple[float, int] | None, source_lengths: list[int],
                      records: list[list[dict[str, Any]]]) -> None:
    """Mark each hypothesis that ended at the source-tied limit (``records``: per input, its hypotheses): the
    search forced its end-of-sequence token, so it reads ``finish_reason`` ``source_length_limit``, not ``eos``."""
    if limit is None:
        return
    for source_length, hyps in zip(source_lengths, records, strict=True):
        for hyp in hyps:
            if hyp["finish_reason"] == "eos" and len(hyp["tokens"]) == source_tied_tokens(limit, source_length):
                hyp["finish_reason"] = SOURCE_LIMIT


def count_cut(count: CutCount, records: list[list[dict[str, Any]]]) -> None:
    """Count each input's best hypothesis (``records``: per input, its ranked hypotheses) a limit stopped."""
    for hyps in records:
        count.outputs += 1
        reason = hyps[0]["finish_reason"] if hyps else None
        count.at_cap += reason == "max_length"
        count.at_source_limit += reason == SOURCE_LIMIT


def cap_name(generation_config: Any, options: dict[str, Any]) -> str:
    """The cap in force: ``--max-new-tokens``, else the model's ``max_new_tokens`` or ``max_length``."""
    if "max_new_tokens" in options:
        return f"max_new_tokens={options['max_new_tokens']}"
    if getattr(generation_config, "max_new_tokens", None) is not None:
        return f"max_new_tokens={generation_config.max_new_tokens} (the model's generation_config.json)"
    return "the model's max_length (or the --semantics preset's max_new_tokens)"


def limit_names(generation_config: Any, options: dict[str, Any]) -> dict[str, str]:
    """How the summary line names the limits in force: ``cap``, and ``source`` where a source-tied limit is set."""
    names = {"cap": cap_name(generation_config, options)}
    limit = source_tied_limit(generation_config, options)
    if limit is not None:
        names["source"] = f"{limit[0]:g}*source+{limit[1]}"
    return names


def cut_line(count: CutCount, names: dict[str, str]) -> str | None:
    """The summary line: how many outputs a length limit cut, at which limit, and the flag that raises it (None
    when none was cut). ``names``: :func:`limit_names`."""
    parts = []
    if count.at_cap:
        parts.append(f"{count.at_cap} at {names['cap']}, marked finish_reason max_length (--max-new-tokens raises it)")
    if count.at_source_limit:
        parts.append(f"{count.at_source_limit} at the source-tied limit max_len_a*source+max_len_b = "
                     f"{names['source']} tokens, marked finish_reason source_length_limit (--max-len-a and "
                     "--max-len-b raise it)")
    if not parts:
        return None
    return (f"beamsearch: {count.at_cap + count.at_source_limit} of {count.outputs} outputs were cut at a length "
            f"limit: {'; '.join(parts)}")


def report_cut(count: CutCount, generation_config: Any, options: dict[str, Any]) -> None:
    """Print :func:`cut_line` on stderr, if any output was cut."""
    line = cut_line(count, limit_names(generation_config, options))
    if line is not None:
        print(line, file=sys.stderr)
