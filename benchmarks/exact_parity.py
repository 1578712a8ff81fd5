"""What ``exact_parity=True`` costs: time of ``model.generate``, of the fast default and of exact_parity on the same
random-weight models and inputs, in one process (best of ``--repeats``), and the ratios to transformers.

    python benchmarks/exact_parity.py [--threads 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

import beamsearch


def models():
    torch.manual_seed(0)
    yield "t5-small shape", T5ForConditionalGeneration(T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048,
                                                                num_layers=6, num_heads=8,
                                                                decoder_start_token_id=0)).eval()
    yield "gpt2 124M shape", GPT2LMHeadModel(GPT2Config()).eval()


def best_time(function, kwargs: dict, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            function(**kwargs)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | transformers s | default s | exact_parity s | default/hf | exact/hf |")
    print("|---|---|---|---|---|---|")
    for name, model in models():
        ids = torch.randint(5, 1000, (8, 24), generator=torch.Generator().manual_seed(1))
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=4, max_new_tokens=24,
                      min_new_tokens=24)
        hf = best_time(model.generate, kwargs, args.repeats)
        fast = best_time(beamsearch.generate, dict(kwargs, model=model), args.repeats)
        exact = best_time(beamsearch.generate, dict(kwargs, model=model, exact_parity=True), args.repeats)
        print(f"| {name} | {hf:.2f} | {fast:.2f} | {exact:.2f} | {fast / hf:.2f}x | {exact / hf:.2f}x |")


if __name__ == "__main__":
    main()
