"""Sequence and token error rates against one or more references (the G2P metrics, usable for any output).

WER here is the G2P literature's word error rate: the share of inputs whose output matches none of its
references exactly. PER (phone, or more generally token, error rate) is the edit distance to the closest
reference, summed over inputs, divided by the summed length of those references.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

Entry = tuple[str, list[list[str]]]


def read_references(path: Path | str) -> list[Entry]:
    """Read ``input<TAB>reference<TAB>reference...`` lines; each reference is split on whitespace. A leading UTF-8
    byte-order mark (as Windows editors save text files) is dropped."""
    out: list[Entry] = []
    with Path(path).open(encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line:
                continue
            source, *refs = line.split("\t")
            if not refs:
                raise ValueError(f"{path}:{n}: no reference after the input (expected input<TAB>reference...)")
            out.append((source, [r.split() for r in refs]))
    return out


def strip_stress(phones: Sequence[str]) -> list[str]:
    """ARPAbet phones without their stress digits (``AH0`` -> ``AH``)."""
    return [p.rstrip("012") for p in phones]


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Levenshtein distance between two token sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


@dataclass
class Scores:
    n: int
    wer: float  # percent of outputs matching no reference, with stress removed
    wer_stress: float  # the same, tokens compared as they are
    per: float  # token error rate in percent against the closest reference, tokens as they are

    def as_dict(self) -> dict[str, float]:
        return {"n": self.n, "wer": self.wer, "wer_stress": self.wer_stress, "per": self.per}


def right_without_stress(hyp: Sequence[str], refs: Sequence[Sequence[str]]) -> bool:
    """Whether ``hyp`` equals one of ``refs`` once stress digits are removed (the WER rule)."""
    return strip_stress(hyp) in [strip_stress(r) for r in refs]


def score(hyps: Sequence[Sequence[str]], refs: Sequence[Sequence[Sequence[str]]]) -> Scores:
    """WER with and without stress digits, and PER, of ``hyps`` against ``refs`` (several per input)."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    wrong = wrong_stress = errs = ref_len = 0
    for n, (hyp, rs) in enumerate(zip(hyps, refs, strict=True)):
        if not rs:
            raise ValueError(f"input {n} has no reference to score against")
        hyp = list(hyp)
        wrong_stress += hyp not in [list(r) for r in rs]
        wrong += not right_without_stress(hyp, rs)
        dist, length = min(((edit_distance(hyp, r), len(r)) for r in rs), key=lambda t: (t[0] / max(t[1], 1), t[0]))
        errs += dist
        ref_len += length
    n = max(len(hyps), 1)
    return Scores(len(hyps), 100.0 * wrong / n, 100.0 * wrong_stress / n, 100.0 * errs / max(ref_len, 1))
