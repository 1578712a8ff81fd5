"""What the gate of issue 35 costs per call (docs/usage.md, "Models you changed"): the walk over the model's modules
for the lean and fast T5 plans, and the fast step's weight check (stamp identities and the checksum of the values it
copied), on the embedded G2P model and on a t5-small-shaped random T5. One thread; median of 50 calls.

    .venv/bin/python benchmarks/gate_cost.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

from beamsearch.steps.gate import refusal
from beamsearch.steps.t5.fast import FAST_T5
from beamsearch.steps.t5.lean import LEAN_T5
from beamsearch.steps.t5.packed import fast_weights

G2P_DIR = Path(__file__).resolve().parents[1] / "src" / "beamsearch" / "models" / "g2p_cmudict"


def median_ms(function, calls: int = 50) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    models = {
        "embedded G2P": AutoModelForSeq2SeqLM.from_pretrained(G2P_DIR, dtype=torch.float32).eval(),
        "t5-small shape": T5ForConditionalGeneration(T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048,
                                                              num_layers=6, num_heads=8)).eval(),
    }
    print("| model | parameters | lean plan walk ms | fast plan walk ms | weight check ms |")
    print("|---|---:|---:|---:|---:|")
    for name, model in models.items():
        fast_weights(model)  # packed once; each later call checks the model's weights against its stamp
        assert refusal(model, LEAN_T5) is None and refusal(model, FAST_T5) is None
        lean = median_ms(lambda: refusal(model, LEAN_T5))  # noqa: B023
        fast = median_ms(lambda: refusal(model, FAST_T5))  # noqa: B023
        check = median_ms(lambda: fast_weights(model))  # noqa: B023
        count = sum(p.numel() for p in model.parameters())
        print(f"| {name} | {count / 1e6:.1f}M | {lean:.2f} | {fast:.2f} | {check:.2f} |")


if __name__ == "__main__":
    main()
