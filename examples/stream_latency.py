"""Latency to the first committed token when streaming beam search, on CMUdict words with the embedded G2P model.

Each word is decoded alone (batch 1) through ``beamsearch.generate(..., streamer=...)``; the streamer notes when the
first generated token arrives. Printed: medians per beam width of the time to the first committed token, of the
whole search, and of their ratio (greedy search commits a token at every step: the reference).

    .venv/bin/python examples/stream_latency.py --words 200 --beams 1 4 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import beamsearch
from beamsearch.cli.decoding import EMBEDDED_MODEL, load_model

DEV = EMBEDDED_MODEL.parent.parent / "data" / "cmudict" / "dev.tsv"


class FirstTokenClock:
    """A streamer that notes when the first generated token arrives (the start tokens come first, as [1, t])."""

    def __init__(self) -> None:
        self.prompt_seen, self.first = False, None

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
        elif self.first is None and value.numel():
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def timings(m, word: str, beams: int) -> tuple[float, float]:
    """Seconds to the first committed token and for the whole search."""
    ids = torch.tensor([m.tokenizer(word)["input_ids"]])
    clock = FirstTokenClock()
    start = time.perf_counter()
    beamsearch.generate(m.model, input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=beams, streamer=clock)
    end = time.perf_counter()
    return (clock.first or end) - start, end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=200)
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m = load_model(None, "cpu", None)
    words = [line.split("\t")[0] for line in DEV.read_text().splitlines()[: args.words]]
    timings(m, words[0], 1)  # warm up
    print(f"{len(words)} CMUdict dev words, batch 1, {args.threads} thread(s), torch {torch.__version__}")
    print("| beams | first committed token (median ms) | whole search (median ms) | first / whole (median) |")
    print("|---|---|---|---|")
    for beams in args.beams:
        pairs = [timings(m, word, beams) for word in words]
        first = statistics.median(f for f, _ in pairs)
        whole = statistics.median(w for _, w in pairs)
        ratio = statistics.median(f / w for f, w in pairs)
        print(f"| {beams} | {1000 * first:.1f} | {1000 * whole:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
