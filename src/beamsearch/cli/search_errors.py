"""``beamsearch eval --search-errors``: beam search against exact search, word by word, per beam size.

For each input, exact search (``strategies/exact.py``) finds the best output under the same score as beam search
(``sum_log_probs / length ** length_penalty``, with every processor of the search: length limits, loop guard). Then,
per beam size:

- a *search error*: exact search found an output that scores higher than beam search's best (beam search missed
  it); where the exact output is also right and the beam output wrong, the search error cost a word;
- a *model error*: the model's own best output (exact search's) is wrong, whatever the search;
- the rate of *empty* (no token before the end) and *degenerate* exact outputs (cut at the length limit, or holding
  three back-to-back copies of an n-gram), the failure modes exact search exposes in translation models
  (Stahlberg & Byrne, 2019).

A word counts as right under the WER rule of ``evaluation.py`` with stress digits removed. Scores are compared with
a relative tolerance of 1e-4 (the searches run in different batch shapes).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..evaluation import right_without_stress as right
from .decoding import Model, decode_lines
from .inputs import CLIError, Line

TOLERANCE = 1.0e-4


def looping(tokens: list[str], copies: int = 3, longest: int = 4) -> bool:
    """Whether ``tokens`` hold ``copies`` back-to-back copies of some n-gram, n <= ``longest``."""
    return any(tokens[i : i + copies * n] == tokens[i : i + n] * copies
               for n in range(1, longest + 1) for i in range(len(tokens) - copies * n + 1))


def best(m: Model, lines: list[Line], options: dict[str, Any], args: argparse.Namespace, limit: Any) -> list[Any]:
    """Each line's best hypothesis (a ``to_dicts`` record; None for an empty line), in input order."""
    decoded = decode_lines(m, lines, options, args.batch_size, args.batch_type == "tokens", limit, args.on_long)
    return [hyps[0] if hyps else None for _, hyps in decoded]


def report(m: Model, lines: list[Line], refs: list[Any], options: dict[str, Any], args: argparse.Namespace,
           limit: Any) -> list[dict[str, Any]]:
    """One row per beam size: the counts described in the module docstring."""
    m.unfinished_last = False  # the searches' own rankings, under the same score
    beams = sorted(set(args.beams))
    exact = best(m, lines, {**options, "exact_search": True, "num_beams": max(beams)}, args, limit)
    if any(e is None for e in exact):
        raise CLIError("--search-errors: every input needs at least one token")
    n = len(lines)
    exact_right = [right(e["text"].split(), r) for e, r in zip(exact, refs, strict=True)]
    common = {
        "exact WER %": 100.0 * (n - sum(exact_right)) / n,
        "unproven %": 100.0 * sum(not e["proven"] for e in exact) / n,
        "empty %": 100.0 * sum(not e["text"] for e in exact) / n,
        "degenerate %": 100.0 * sum(e["finish_reason"] != "eos" or looping(e["text"].split()) for e in exact) / n,
    }
    rows = []
    for width in beams:
        found = best(m, lines, {**options, "num_beams": width}, args, limit)
        errors = cost = 0
        for b, e, r, e_right in zip(found, exact, refs, exact_right, strict=True):
            if e["score"] > b["score"] + TOLERANCE * max(1.0, abs(b["score"])):
                errors += 1
                cost += e_right and not right(b["text"].split(), r)
        wrong = sum(not right(b["text"].split(), r) for b, r in zip(found, refs, strict=True))
        rows.append({"beam": width, "search errors %": 100.0 * errors / n, "words lost to them %": 100.0 * cost / n,
                     "beam WER %": 100.0 * wrong / n, **common})
    return rows


def print_table(rows: list[dict[str, Any]], n: int, path: Path) -> None:
    columns = list(rows[0])
    print(f"{n} examples from {path}: beam search against exact search (the model's best output)\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---:|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) if c == "beam" else f"{row[c]:.2f}" for c in columns) + " |")
    print("\nsearch error: exact search found a higher-scoring output than beam search; words lost to them: of")
    print("those, the exact output is right and the beam output wrong; exact WER: model errors (the model's best is")
    print("wrong); unproven: exact search stopped at --max-nodes; degenerate: cut at the length limit, or 3 copies")
    print("of an n-gram.")


def plot(rows: list[dict[str, Any]], path: str) -> str:
    """Search errors and WER against the beam size, as a PNG; returns what was written (or why not)."""
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'beamsearch[plot]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    beams = [r["beam"] for r in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    for column in ("search errors %", "words lost to them %", "beam WER %", "exact WER %"):
        axis.plot(beams, [r[column] for r in rows], marker="o", label=column)
    axis.set_xlabel("beam size")
    axis.set_ylabel("% of words")
    axis.set_xticks(beams)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"plot written to {path}"
