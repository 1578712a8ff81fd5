"""Write a training run's candidate models as model directories, to be compared on dev with ``beamsearch eval``.

    .venv/bin/python training/candidates.py runs/g2p_stage6 runs/g2p_stage6/cands --average 4 2
    .venv/bin/beamsearch eval --model runs/g2p_stage6/cands/best --data src/beamsearch/data/cmudict/dev.tsv --beams 1 5

Candidates: ``best`` (``best.pt``, the best greedy dev WER during training), ``last`` (``ckpt_last.pt``) and, for each
``--average N``, ``avgN``: the mean of the weights of the last N snapshots in ``run/snap`` (``snap_checkpoints.sh``;
a step copied twice counts once);
with ``--soup OTHER_RUN ...``, ``soup``: the mean of the best checkpoints of this run and the other runs (a "model
soup": runs warm-started from one model, so their weights lie in one basin; all must have this run's shape).
Each directory holds the weights in float16 and a ``config.json`` from the checkpoint's own configuration (so a grown
model keeps its depth) that loads as float32, with the shipped model's tokenizer and generation config (its loop
guard and source-tied length limit), so ``beamsearch eval`` scores each as the shipped model would be scored.
Unlike ``train_g2p.py --export``, nothing is decoded here and the test set is never touched.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_g2p import mean_weights, snapshots  # noqa: E402

SHIPPED = Path(__file__).resolve().parent.parent / "src" / "beamsearch" / "models" / "g2p_cmudict"
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "CMUDICT_LICENSE.txt")


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def shapes(state: dict) -> dict:
    return {name: tuple(w.shape) for name, w in state.items()}


def write(state: dict, config: dict, out: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config.from_dict(config))
    model.load_state_dict(state)
    out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"  # stored as float16, loaded as float32, as the shipped model
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        shutil.copy(SHIPPED / name, out / name)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a train_g2p.py run directory")
    parser.add_argument("out", type=Path, help="where the candidate directories go")
    parser.add_argument("--average", type=int, nargs="*", default=[], help="also the mean of the last N snapshots")
    parser.add_argument("--soup", type=Path, nargs="+", default=[],
                        help="also the mean of the best checkpoints of this run and these runs")
    args = parser.parse_args(argv)
    best = load(args.run / "best.pt")
    candidates = {"best": best["model"], "last": load(args.run / "ckpt_last.pt")["model"]}
    snaps = snapshots(args.run)  # each step once
    for n in args.average:
        if not 2 <= n <= len(snaps):
            parser.error(f"--average {n}: {len(snaps)} snapshots in {args.run / 'snap'}")
        states = [load(path) for path in snaps[-n:]]
        candidates[f"avg{n}"] = mean_weights(states)
        print(f"avg{n}: the mean of steps {[s['state']['step'] for s in states]}")
    if args.soup:
        others = [load(run / "best.pt") for run in args.soup]
        for run, other in zip(args.soup, others, strict=True):
            if shapes(other["model"]) != shapes(best["model"]):
                parser.error(f"--soup {run}: its weights' names or shapes differ from {args.run}'s; "
                             "only models of one shape can be averaged")
        candidates["soup"] = mean_weights([best, *others])
        print(f"soup: the mean of the best checkpoints of {[str(r) for r in (args.run, *args.soup)]}")
    for name, state in candidates.items():
        write(state, best["config"], args.out / name)
        print(f"{name} -> {args.out / name}")


if __name__ == "__main__":
    main()
