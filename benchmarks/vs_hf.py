"""Wall time and tokens/s of beamsearch.generate against transformers' model.generate.

Same random-weight model, same inputs, one process; medians over repeats, each engine warmed up
first. Prints a Markdown table. Example:

    .venv/bin/python benchmarks/vs_hf.py --shape t5-small --batch-size 16 --threads 2
    .venv/bin/python benchmarks/vs_hf.py --shape gpt2-small --source-length 160   # decoder-only, prompts
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import beamsearch

SHAPES = {
    # d_model, d_ff, layers (encoder = decoder), heads, vocabulary
    "tiny": (64, 256, 2, 4, 1000),
    "small": (256, 1024, 4, 4, 8000),
    "t5-small": (512, 2048, 6, 8, 32128),
    # decoder-only GPT-2 (the source is the prompt)
    "gpt2-small": (256, 1024, 4, 4, 8000),
}


def build_model(shape: str):
    from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    d_model, d_ff, layers, heads, vocab = SHAPES[shape]
    if shape.startswith("gpt2"):
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=vocab, n_embd=d_model, n_inner=d_ff, n_layer=layers, n_head=heads,
                            n_positions=1024, eos_token_id=1, pad_token_id=0)
        return GPT2LMHeadModel(config).eval()
    config = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // heads, d_ff=d_ff, num_layers=layers,
                      num_decoder_layers=layers, num_heads=heads, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config).eval()


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--source-length", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eos", action="store_true", help="let EOS end hypotheses (default: never, fixed length)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.shape)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(2, vocab, (args.batch_size, args.source_length), generator=generator)
    common = {"max_new_tokens": args.new_tokens, "min_new_tokens": 0 if args.eos else args.new_tokens}
    rows = []
    for label, kwargs in (("greedy", {"num_beams": 1}), ("beam 4", {"num_beams": 4}), ("beam 8", {"num_beams": 8})):
        with torch.no_grad():
            hf_time, hf_out = timed(lambda kw=kwargs: model.generate(input_ids=inputs, **common, **kw), args.repeats)
            bs_time, bs_out = timed(
                lambda kw=kwargs: beamsearch.generate(model, input_ids=inputs, **common, **kw), args.repeats
            )
        same = 0
        if hf_out.shape == bs_out.shape:
            same = int(sum(torch.equal(a, b) for a, b in zip(hf_out, bs_out, strict=True)))
        tokens = args.batch_size * args.new_tokens
        rows.append((label, hf_time, bs_time, tokens / hf_time, tokens / bs_time, same, hf_out.shape[0]))
    family = "GPT-2" if args.shape.startswith("gpt2") else "T5"
    print(f"model: random {family} '{args.shape}' {SHAPES[args.shape]}, batch {args.batch_size},"
          f" source {args.source_length}, {args.new_tokens} new tokens, eos {'on' if args.eos else 'off'},"
          f" {args.threads} threads,"
          f" median of {args.repeats}, torch {torch.__version__}")
    print()
    print("| search | transformers | beamsearch | speed-up | HF tokens/s | ours tokens/s | identical |")
    print("|---|---|---|---|---|---|---|")
    for label, hf_time, bs_time, hf_tps, bs_tps, same, total in rows:
        print(f"| {label} | {hf_time:.3f} s | {bs_time:.3f} s | {hf_time / bs_time:.2f}x | {hf_tps:.0f} |"
              f" {bs_tps:.0f} | {same}/{total} |")


if __name__ == "__main__":
    main()
