"""How large is issue 39's half-precision rule's measure when nothing is wrong? A CPU calibration.

The H200 run of 2026-11-28 (README.md beside this) found the 1B Llama shape's bfloat16 beam-4 row failing the rule:
the graph path's best hypotheses differ from transformers' on 16 of 16 examples, and scored by one teacher-forced
forward in float32 the worst of them loses 0.063 nats per token to transformers'. The rule allows 0.01. The H100
follow-up (``../2026-11-27-h100/bf16_beam_check.py``) showed that the graph step's log-probabilities are as close to
float64 as transformers' own; so is 0.063 a loss, or what any second bfloat16 computation of the same model scores?

Here the same measure is taken between transformers and transformers: its ``generate`` with its default attention
(``sdpa``) is the reference; against it, each of

- transformers with ``attn_implementation="eager"`` (its own other attention: another order of the same sums),
- transformers with ``cache_implementation="static"`` (its own fixed-shape cache, the analogue of our graph path),
- ours eager (``cuda_graphs=False``: the lean Llama step) and ours' graph-safe step (``cuda_graphs=True``, uncaptured
  on a CPU),

on a small random Llama shaped like the 1B one (``bf16_beam_check.build``), batch 16, beam 4, 48 new tokens, EOS
suppressed. For each: how many best hypotheses differ, and the per-token deficit (transformers' float32 score minus
the other's; positive: the other's is worse) of every differing row, sorted, with their mean. If transformers
against itself shows deficits as large as ours, the rule's threshold lies below bfloat16's own spread on this model
and only a bit-identical computation can pass it.

Run from the repository root, one thread (a few minutes on the 2-core machine)::

    .venv/bin/python benchmarks/gpu_results/2026-11-28-h200/rule_calibration.py [--vocab 32000 --hidden 512]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-11-27-h100"))
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/

import bf16_beam_check as check  # noqa: E402
from suite_graphs import teacher_forced  # noqa: E402

import beamsearch  # noqa: E402


def deficits(scorer, call: dict, expected: torch.Tensor, actual: torch.Tensor) -> tuple[int, list[float]]:
    """Rows whose best hypothesis differs, and each such row's per-token deficit in float32 (sorted)."""
    width = max(expected.shape[1], actual.shape[1])
    want = torch.nn.functional.pad(expected, (0, width - expected.shape[1]), value=check.PAD)
    got = torch.nn.functional.pad(actual, (0, width - actual.shape[1]), value=check.PAD)
    differing = (want != got).any(dim=1).nonzero().flatten()
    if differing.numel() == 0:
        return 0, []
    inputs = {"input_ids": call["input_ids"][differing], "attention_mask": call["attention_mask"][differing]}
    gap = teacher_forced(scorer, inputs, want[differing]) - teacher_forced(scorer, inputs, got[differing])
    return int(differing.numel()), sorted(float(g) for g in gap)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, call = check.build(args, getattr(torch, args.dtype))
    scorer = copy.deepcopy(model).float()
    print(f"== {args.dtype}: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
          f"{args.kv_heads} key/value heads; batch {args.batch}, beam {args.beams}, {args.new_tokens} new tokens, "
          f"seed {args.seed}; torch {torch.__version__}")
    with torch.no_grad():
        reference = model.generate(**call)
        others = {}
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        others["transformers, eager attention"] = eager.generate(**call)
        others["transformers, static cache"] = model.generate(**call, cache_implementation="static")
        others["ours eager (lean step)"] = beamsearch.generate(model, **call, cuda_graphs=False)
        others["ours graph-safe step (uncaptured)"] = beamsearch.generate(model, **call, cuda_graphs=True)
    for name, sequences in others.items():
        count, gaps = deficits(scorer, call, reference, sequences)
        if not gaps:
            print(f"{name}: best hypotheses equal transformers' on {args.batch}/{args.batch}")
            continue
        print(f"{name}: {count}/{args.batch} differ; deficit per token (positive: worse than transformers'): "
              f"worst {gaps[-1]:+.4f}, best {gaps[0]:+.4f}, mean {sum(gaps) / len(gaps):+.4f}; "
              f"over 0.01: {sum(g > 0.01 for g in gaps)}; all: {' '.join(f'{g:+.3f}' for g in gaps)}")


if __name__ == "__main__":
    main()
