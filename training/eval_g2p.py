"""Evaluate a saved G2P model directory on the CMUdict test (or dev) split.

    .venv/bin/python training/eval_g2p.py src/beamsearch/models/g2p_cmudict [--split test] [--beams 1 5]

Prints WER with stress removed (the headline number), WER with stress and PER for each beam width, using
``model.generate`` (greedy for 1 beam). A word counts as right if the output matches ANY of its reference
pronunciations; PER is measured against the closest reference. Offline: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from g2p_data import DATA_DIR, Scores, read_tsv, score  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def generate_phones(
    model, tokenizer, words: Sequence[str], num_beams: int = 1, batch_size: int = 200, max_new_tokens: int = 32
) -> list[list[str]]:
    """Phones (lists of ARPAbet tokens) for each of ``words`` (lowercased), batched by length."""
    import torch

    order = sorted(range(len(words)), key=lambda i: (len(words[i]), i))
    out: list[list[str]] = [[] for _ in words]
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = tokenizer([words[i].lower() for i in idx], return_tensors="pt", padding=True).to(model.device)
            gen = model.generate(
                **enc,
                num_beams=num_beams,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                early_stopping=True if num_beams > 1 else False,
            )
            texts = tokenizer.batch_decode(gen, skip_special_tokens=True)
            for i, t in zip(idx, texts, strict=True):
                out[i] = t.split()
    model.train(was_training)
    return out


def evaluate_entries(model, tokenizer, entries, num_beams: int = 1, batch_size: int = 200) -> Scores:
    words = [w for w, _ in entries]
    hyps = generate_phones(model, tokenizer, words, num_beams=num_beams, batch_size=batch_size)
    return score(hyps, [p for _, p in entries])


def evaluate_dir(
    model_dir: Path | str, split: str = "test", beams: Sequence[int] = (1, 5), threads: int = 1, device: str = "cpu"
) -> dict[str, dict[str, float]]:
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).to(device)
    model.eval()
    entries = read_tsv(DATA_DIR / f"{split}.tsv")
    results: dict[str, dict[str, float]] = {}
    for nb in beams:
        t0 = time.time()
        s = evaluate_entries(model, tok, entries, num_beams=nb, batch_size=200 if nb == 1 else 50)
        results[f"beam{nb}"] = {**s.as_dict(), "seconds": round(time.time() - t0, 1)}
    return results


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--split", default="test", choices=["test", "dev"])
    ap.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    res = evaluate_dir(args.model_dir, args.split, args.beams, args.threads)
    for name, r in res.items():
        print(
            f"{args.split} {name}: WER {r['wer']:.2f}%  WER(stress) {r['wer_stress']:.2f}%  PER {r['per']:.2f}%"
            f"  ({r['n']} words, {r['seconds']}s)"
        )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
