"""The calibration baseline: a joint-sequence n-gram G2P model (Phonetisaurus) on our exact split.

Trains Phonetisaurus (EM alignment of letters and phones, a joint n-gram over the aligned "graphone" pairs with
MITLM's Kneser-Ney, the n-gram as a weighted FST) on ``train.tsv`` (every pronunciation of every training word), picks
the n-gram order on the dev set, and scores dev and test the way ``beamsearch eval`` does: a word is right if the
1-best output equals any of its references (stress digits removed, and as it is); PER to the closest reference.

    python3 -m venv runs/ngram_venv && runs/ngram_venv/bin/pip install phonetisaurus   # prebuilt x86_64 binaries
    PYTHONPATH=runs/pydeps .venv/bin/python training/g2p_pairs.py                     # runs/g2p_data/ (once)
    OMP_NUM_THREADS=1 .venv/bin/python training/ngram_baseline.py [--orders 7 8 9] [--work runs/ngram]

Every step's output is kept under ``--work`` and reused when the script is run again. The result table is printed
and written to ``WORK/results.md`` (and ``results.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))

from beamsearch.evaluation import read_references, score  # noqa: E402


def phonetisaurus_dir(venv: Path) -> Path:
    """The ``phonetisaurus`` package folder (with ``bin/x86_64`` and ``lib/x86_64``) inside ``venv``."""
    found = sorted(venv.glob("lib/python*/site-packages/phonetisaurus"))
    if not found:
        raise SystemExit(f"no phonetisaurus package in {venv} (pip install phonetisaurus into it)")
    return found[0]


class Phonetisaurus:
    """Runs the package's binaries with its bundled libraries."""

    def __init__(self, package: Path):
        self.bin = package / "bin" / "x86_64"
        self.env = {**os.environ, "LD_LIBRARY_PATH": str(package / "lib" / "x86_64"), "OMP_NUM_THREADS": "1"}

    def run(self, name: str, *args: str, stdout: Path | None = None) -> None:
        command = [str(self.bin / name), *args]
        print(time.strftime("%H:%M:%S"), " ".join([name, *args]), flush=True)
        with open(stdout, "w") if stdout else open(os.devnull, "w") as out:
            subprocess.run(command, env=self.env, check=True, stdout=out)


def train(tool: Phonetisaurus, lexicon: Path, work: Path, order: int) -> Path:
    """Align once, then a joint n-gram of ``order`` as an FST.

    The alignment is Phonetisaurus' CMUdict recipe (``phonetisaurus-train --seq2_del``): up to 2 letters to up to 2
    phones, and a letter may map to no phone (silent letters: without it ~250 pairs such as "though" fail to align).
    """
    corpus = work / "train.corpus"
    if not corpus.exists():
        tool.run("phonetisaurus-align", f"--input={lexicon}", f"--ofile={corpus}.tmp", "--seq1_del=false",
                 "--seq2_del=true", "--seq1_max=2", "--seq2_max=2", "--grow=false")
        os.replace(f"{corpus}.tmp", corpus)
    arpa, fst = work / f"train.o{order}.arpa", work / f"train.o{order}.fst"
    if not fst.exists():
        tool.run("estimate-ngram", "-o", str(order), "-t", str(corpus), "-wl", str(arpa))
        tool.run("phonetisaurus-arpa2wfst", f"--lm={arpa}", f"--ofile={fst}.tmp")
        os.replace(f"{fst}.tmp", fst)
        arpa.unlink()
    return fst


def decode(tool: Phonetisaurus, fst: Path, words: Sequence[str], out: Path) -> list[list[str]]:
    """1-best phones per word (an empty list where the model gives none)."""
    if not out.exists():
        wordlist = out.with_suffix(".words")
        wordlist.write_text("".join(w + "\n" for w in words), encoding="utf-8")
        tool.run("phonetisaurus-g2pfst", f"--model={fst}", f"--wordlist={wordlist}", "--nbest=1", "--beam=10000",
                 "--thresh=99.0", "--accumulate=false", "--pmass=0.0", "--nlog_probs=true", stdout=Path(f"{out}.tmp"))
        os.replace(f"{out}.tmp", out)
    best: dict[str, list[str]] = {}
    for line in out.read_text(encoding="utf-8").splitlines():
        word, _score, *phones = line.split("\t")
        best.setdefault(word, phones[0].split() if phones else [])
    return [best.get(w, []) for w in words]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=REPO_ROOT / "runs" / "g2p_data", help="train.tsv, dev.tsv, test.tsv")
    ap.add_argument("--venv", type=Path, default=REPO_ROOT / "runs" / "ngram_venv")
    ap.add_argument("--work", type=Path, default=REPO_ROOT / "runs" / "ngram")
    ap.add_argument("--orders", type=int, nargs="+", default=[7, 8, 9], help="n-gram orders tried on dev")
    args = ap.parse_args(argv)

    tool = Phonetisaurus(phonetisaurus_dir(args.venv))
    args.work.mkdir(parents=True, exist_ok=True)
    dev = read_references(args.data / "dev.tsv")
    test = read_references(args.data / "test.tsv")
    rows: dict[str, dict] = {}
    for order in args.orders:
        t0 = time.time()
        fst = train(tool, args.data / "train.tsv", args.work, order)
        hyps = decode(tool, fst, [w for w, _ in dev], args.work / f"dev.o{order}.tsv")
        rows[f"dev o{order}"] = {**score(hyps, [r for _, r in dev]).as_dict(), "seconds": round(time.time() - t0)}
        print(rows[f"dev o{order}"], flush=True)
    best = min(args.orders, key=lambda o: (rows[f"dev o{o}"]["wer"], rows[f"dev o{o}"]["wer_stress"]))
    fst = train(tool, args.data / "train.tsv", args.work, best)
    hyps = decode(tool, fst, [w for w, _ in test], args.work / f"test.o{best}.tsv")
    rows[f"test o{best}"] = score(hyps, [r for _, r in test]).as_dict()
    (args.work / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = ["| set | n-gram order | words | WER % (stress removed) | WER % | PER % |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        split, order = name.split(" o")
        table.append(f"| {split} | {order} | {r['n']} | {r['wer']:.2f} | {r['wer_stress']:.2f} | {r['per']:.2f} |")
    text = "\n".join(table) + f"\n\nOrder {best} chosen on dev (lowest WER without stress), then test decoded once.\n"
    (args.work / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
