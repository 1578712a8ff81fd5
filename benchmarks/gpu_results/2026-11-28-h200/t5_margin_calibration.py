"""Does the margin check certify the benchmark's random t5-small in float32? A CPU calibration.

The H200 run of 2026-11-28 (README.md beside this) found the graph path's best hypotheses on the suite's random
t5-small (float32) differing from transformers' on 1-3 examples per row where the parity grid's margin check sees
no near tie; the H100 run of 2026-11-27 found the same for the eager path on five rows. On the CPU the fast T5 step
parts from transformers on that model too (docs/performance.md), while on the trained G2P model it does not.

Here transformers is compared with itself: its ``generate`` on the batch is the reference, and against it

- transformers on each example alone (batch 1: other matrix shapes, so other kernels and sums in another order),
- transformers with the model cast to float64 (the answer float32 rounds),
- ours, the lean step (``lean_step=True``: transformers' modules on our rows) and the fast step (``lean_step='fast'``),

each difference classified by the margin check at float32's tolerance (``suite_graphs._margins``,
``numerics.near_tie``).
If transformers against itself shows differences that are "not ties", the margin check cannot certify this model:
its rounding is amplified beyond the tolerance, so the check's "not ties" there say nothing about a step's
correctness. It also prints how far transformers' float32 encoder output is from its float64 one.

Run from the repository root, one thread (a few minutes on the 2-core machine)::

    .venv/bin/python benchmarks/gpu_results/2026-11-28-h200/t5_margin_calibration.py [--beams 4] [--batch 16]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/
sys.path.insert(0, str(HERE.parents[2] / "tests"))

import suite_models as models  # noqa: E402
from numerics import near_tie  # noqa: E402
from suite_graphs import _margins, _recorded_reference  # noqa: E402

import beamsearch  # noqa: E402


def classify(steps, expected, sequences: torch.Tensor, beams: int, kwargs: dict) -> str:
    margins = _margins(steps, expected, types.SimpleNamespace(sequences=sequences.cpu()), beams, kwargs)
    if not margins:
        return "all equal"
    ties = sum(near_tie(margin, magnitude, torch.float32) for margin, magnitude in margins)
    return f"{len(margins)} differ: {ties} near ties, {len(margins) - ties} not ties"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="t5-small", choices=("t5-small", "g2p"))
    parser.add_argument("--beams", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = models.build(args.model, Path(tempfile.mkdtemp()), args.batch)
    model, inputs = workload.model, workload.batch(args.batch, "cpu")
    kwargs = workload.generation_kwargs(args.beams)
    print(f"== {workload.description}; batch {args.batch}, beams {args.beams}; torch {torch.__version__}")
    expected, steps = _recorded_reference(model, inputs, kwargs)
    wide = copy.deepcopy(model).double()
    with torch.no_grad():
        encoded = model.get_encoder()(**inputs).last_hidden_state
        exact = wide.get_encoder()(**inputs).last_hidden_state
        print(f"transformers' encoder output, float32 against float64: max |difference| "
              f"{float((encoded.double() - exact).abs().max()):.3g} (largest |value| {float(exact.abs().max()):.3g})")
        alone = [model.generate(**{k: v[i : i + 1] for k, v in inputs.items()}, **kwargs)[0] for i in range(args.batch)]
        width = max(len(s) for s in alone)
        alone = torch.stack([torch.nn.functional.pad(s, (0, width - len(s)), value=workload.pad_token_id)
                             for s in alone])
        others = {
            "transformers, one example at a time": alone,
            "transformers, float64": wide.generate(**inputs, **kwargs),
            "ours, lean step": beamsearch.generate(model, **inputs, **kwargs, lean_step=True),
            "ours, fast step": beamsearch.generate(model, **inputs, **kwargs, lean_step="fast"),
        }
    for name, sequences in others.items():
        print(f"{name}: {classify(steps, expected, sequences, args.beams, kwargs)}")


if __name__ == "__main__":
    main()
