"""Pseudo-labelled training pairs for self-training the G2P model: English words that CMUdict lacks, pronounced
by a model (the shipped one by default), kept where the model is confident.

    PYTHONPATH=runs/pydeps .venv/bin/python training/pseudo_labels.py --top 100000 --min-prob 0.5 \
        --out runs/g2p_pseudo/pairs.tsv

Words: ``wordfreq``'s English list (``large_en``, most frequent first; the package and ``msgpack`` installed with
``pip install --no-deps --target runs/pydeps wordfreq msgpack``; only its data file is read), lowercase, letters
with inner apostrophes, 3-20 characters, and in no part of CMUdict: so no dev or test word, and no training word,
gets a label here. The first ``--top`` such words are decoded at beam ``--beams`` with ``beamsearch decode``; a word
is kept when its best pronunciation's probability (the exponent of its summed token log-probabilities) is at least
``--min-prob``. Output: ``word<TAB>phones<TAB>probability`` per line, which ``train_g2p.py --extra-pairs`` reads.
The word list is data under the licences wordfreq names (CC BY-SA 4.0 among them): it stays in ``runs/``, never in
the repository.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from g2p_data import REPO_ROOT, load_cmudict  # noqa: E402

SHIPPED = REPO_ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict"
WORD = re.compile(r"[a-z][a-z']*[a-z]")


def wordfreq_words() -> list[str]:
    """wordfreq's English words, most frequent first (its ``large_en`` file: a header, then frequency buckets)."""
    import importlib.util

    import msgpack

    spec = importlib.util.find_spec("wordfreq")  # found, not imported: its own dependencies are not needed
    if spec is None or spec.origin is None:
        raise SystemExit("wordfreq not found: pip install --no-deps --target runs/pydeps wordfreq msgpack")
    path = Path(spec.origin).parent / "data" / "large_en.msgpack.gz"
    with gzip.open(path) as f:
        header, *buckets = msgpack.load(f, raw=False)
    if header.get("format") != "cB":
        raise ValueError(f"{path}: unexpected format {header!r}")
    return [w for bucket in buckets for w in bucket]


def unlabelled(words: Iterable[str], known: set[str], top: int) -> list[str]:
    """The first ``top`` of ``words`` that look like plain English words and are not in ``known``."""
    out: list[str] = []
    seen: set[str] = set()
    for w in words:
        if 3 <= len(w) <= 20 and WORD.fullmatch(w) and w not in known and w not in seen:
            seen.add(w)
            out.append(w)
            if len(out) == top:
                break
    return out


def decode(words: Sequence[str], model: Path, beams: int, threads: int, work: Path) -> list[tuple[str, float]]:
    """(best pronunciation, its probability) per word, from ``beamsearch decode --format jsonl``."""
    work.mkdir(parents=True, exist_ok=True)
    inp, out = work / "words.txt", work / "decoded.jsonl"
    inp.write_text("".join(w + "\n" for w in words), encoding="utf-8")
    exe = Path(sys.executable).with_name("beamsearch")
    cmd = [str(exe), "decode", "--model", str(model), "--num-beams", str(beams), "--threads", str(threads),
           "--format", "jsonl", "--output", str(out), "--overwrite", "-q", str(inp)]
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    if len(rows) != len(words):
        raise RuntimeError(f"{out}: {len(rows)} records for {len(words)} words")
    result = []
    for w, r in zip(words, rows, strict=True):
        if r["input"] != w:
            raise RuntimeError(f"{out}: record {r['index']} is {r['input']!r}, expected {w!r}")
        best = r["hypotheses"][0]
        result.append((best["text"], math.exp(best["sum_log_probs"])))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=SHIPPED)
    ap.add_argument("--top", type=int, default=100_000, help="how many unlabelled words to decode")
    ap.add_argument("--min-prob", type=float, default=0.5, help="keep a word when its best output is this likely")
    ap.add_argument("--beams", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "g2p_pseudo" / "pairs.tsv")
    a = ap.parse_args(argv)

    known = set(load_cmudict())
    words = unlabelled(wordfreq_words(), known, a.top)
    decoded = decode(words, a.model, a.beams, a.threads, a.out.parent)
    kept = [(w, phones, p) for w, (phones, p) in zip(words, decoded, strict=True) if p >= a.min_prob and phones]
    a.out.write_text("".join(f"{w}\t{ph}\t{p:.4f}\n" for w, ph, p in kept), encoding="utf-8")
    print(f"{len(words):,} unlabelled words decoded, {len(kept):,} kept (probability >= {a.min_prob}) -> {a.out}")


if __name__ == "__main__":
    main()
