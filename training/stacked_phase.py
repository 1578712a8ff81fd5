"""One time-budgeted training phase of a stacked trainer (the teachers, or the students) and each member's choice of
weights on the dev set.

A phase steps by CUDA graph replays where the graphs pass their check (``stacked_graphs.py``), else eagerly; it ends
at a deadline, or earlier once it has made ``Settings.max_steps`` steps, with the learning rate cooled down linearly
over the last ``cooldown`` share of its (planned) time. Each member then keeps, by greedy dev WER, its best evaluated
weights, its last, or the mean of its last 2..``snaps`` cool-down snapshots.

Legend: K members, P flat parameters.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from stacked_data import BucketedData, DevSet, score
from stacked_graphs import GraphedSteps
from stacked_step import StackTrainer, greedy, snapshot, to_phones
from stacked_t5 import StackedT5

STOP = {"flag": False}  # set by a signal handler: the phase stops at its next step and still chooses and returns
Log = Callable[[str], None]


def learning_rate(step: int, fraction: float, peak: float, warmup: int, cooldown: float) -> float:
    """Linear warmup, inverse square root decay (Vaswani et al. 2017), then a linear cool-down to 0 over the last
    ``cooldown`` share of the phase's time (``fraction`` in [0, 1])."""
    n = step + 1
    lr = peak * min(n / warmup, (warmup / n) ** 0.5)
    if cooldown > 0 and fraction > 1 - cooldown:
        lr *= max(0.0, (1 - fraction) / cooldown)
    return lr


def dev_keys(model: StackedT5, matrices, vectors, dev: DevSet, vocab, ensemble: bool = False) -> list[dict]:
    """Greedy dev scores of every member (or of the ensemble: one entry)."""
    tokens = greedy(model, matrices, vectors, dev.src, dev.max_new, ensemble)
    hyps = to_phones(tokens[:1] if ensemble else tokens, vocab)
    return [score(h, [r for _, r in dev.entries]).as_dict() for h in hyps]


def key(s: dict) -> tuple:
    return (s["wer"], s["wer_stress"], s["per"])


@dataclass
class Settings:
    """A phase's schedule: peak learning rate, warmup steps, dropout rate, member seeds (data order; the first also
    seeds the dropout masks) and a step limit (0: none, the deadline only)."""

    peak: float
    warmup: int
    rate: float
    seeds: list[int]
    max_steps: int = 0


class Curve:
    """``curve.tsv``: phase, step, epoch, seconds, lr, metric (loss or dev_wer), one value per member."""

    def __init__(self, path: Path):
        self.path = path
        if not path.exists():
            path.write_text("phase\tstep\tepoch\tseconds\tlr\tmetric\tvalues\n")

    def add(self, phase: str, step: int, epoch: float, seconds: float, lr: float, metric: str, values) -> None:
        with self.path.open("a") as f:
            f.write(f"{phase}\t{step}\t{epoch:.2f}\t{seconds:.1f}\t{lr:.3e}\t{metric}\t"
                    + ",".join(f"{v:.4f}" for v in values) + "\n")


def stepper(trainer: StackTrainer, data: BucketedData, s: Settings, use_graphs: bool, log: Log):
    """``(run(step, bucket, index), graphed)``: replays of checked CUDA graphs, or the eager step."""
    if use_graphs:
        graphs = GraphedSteps(trainer, log, check_lr=s.peak)
        first: dict[int, torch.Tensor] = {}
        for bucket, index in data.epoch(0, s.seeds):
            first.setdefault(bucket, index)
        if graphs.capture(first):
            return graphs.run, True
    return trainer.run, False


def run_phase(name: str, trainer: StackTrainer, data: BucketedData, dev: DevSet, vocab, s: Settings,
              deadline: float, a, curve: Curve, log: Log, use_graphs: bool):
    """Train until ``deadline`` (less the time the final choice takes) or ``s.max_steps``, then choose each member's
    weights by dev. Returns (matrices [K, Pm], vectors [K, Pv], per-member info, the phase's facts)."""
    model, k, params = trainer.model, trainer.members, trainer.params
    run, graphed = stepper(trainer, data, s, use_graphs, log)
    best = snapshot(params)
    best_keys: list[tuple] = [(float("inf"),)] * k
    snaps: deque = deque(maxlen=a.snaps)
    start = time.time()
    step = epoch = last_snap = 0
    lr, warmup = 0.0, s.warmup
    time_limit = deadline - (a.snaps + 2) * 1.0  # the final choice evaluates snaps + 2 candidates (~1 s each)
    stop_at = time_limit
    steps_per_epoch = data.steps_per_epoch()
    t_log, step_log = time.time(), 0
    while True:
        for bucket, index in data.epoch(epoch, s.seeds):
            fraction = (time.time() - start) / max(1e-9, stop_at - start)
            if fraction >= 1 or STOP["flag"]:
                break
            lr = learning_rate(step, fraction, s.peak, warmup, a.cooldown)
            trainer.optimizer.lr.fill_(lr)
            run(step, bucket, index)
            step += 1
            if fraction >= 1 - a.cooldown and step - last_snap >= a.snap_every:
                snaps.append(snapshot(params))
                last_snap = step
            if step % a.log_every == 0:
                losses = trainer.read_loss()  # the one synchronisation
                now = time.time()
                rate = (step - step_log) / (now - t_log)
                if s.max_steps:  # the time the step limit needs at the mean rate so far, if less than the deadline
                    stop_at = min(time_limit, start + s.max_steps * (now - start) / step)
                if step == a.log_every:  # a slow device: keep the warmup under a fifth of the steps it will make
                    expected = rate * (stop_at - start)
                    if warmup > 0.2 * expected:
                        warmup = max(a.log_every, int(0.2 * expected))
                        log(f"{name}: about {expected:.0f} steps expected at {rate:.1f} steps/s: warmup {warmup}")
                t_log, step_log = now, step
                curve.add(name, step, step / steps_per_epoch, now - start, lr, "loss", losses)
                log(f"{name} step {step} epoch {step / steps_per_epoch:.1f} lr {lr:.2e} loss "
                    f"{' '.join(f'{x:.3f}' for x in losses)} {rate:.1f} steps/s "
                    f"({rate * data.batch_size * k:.0f} pairs/s over {k} members)")
                if not any(math.isfinite(x) for x in losses):  # (one member's NaN: the dev choice passes it over)
                    log(f"{name}: every member's loss is not finite: the phase stops and chooses")
                    break
            if step % a.eval_every == 0:
                t0 = time.time()
                scores = dev_keys(model, params[0].detach(), params[1].detach(), dev, vocab)
                eval_seconds = time.time() - t0
                time_limit = deadline - (a.snaps + 2) * eval_seconds
                stop_at = min(stop_at, time_limit)
                for m, sc in enumerate(scores):
                    if key(sc) < best_keys[m]:
                        best_keys[m] = key(sc)
                        best[0][m].copy_(params[0][m])
                        best[1][m].copy_(params[1][m])
                curve.add(name, step, step / steps_per_epoch, time.time() - start, lr, "dev_wer",
                          [sc["wer"] for sc in scores])
                wers = " ".join(f"{sc['wer']:.1f}" for sc in scores)
                log(f"{name} dev WER at step {step}: {wers} ({eval_seconds:.1f}s)")
        else:
            epoch += 1
            continue
        break
    trained = time.time() - start
    snaps.append(snapshot(params))
    return (*choose(model, best, snaps, dev, vocab, name, log), {
        "steps": step, "epochs": round(step / steps_per_epoch, 2), "seconds": round(trained, 1),
        "steps_per_second": round(step / max(trained, 1e-9), 2), "cuda_graphs": graphed,
        "snapshots": len(snaps), "warmup": warmup, "dropout_rate": trainer.masks.rate if trainer.masks else 0.0,
    })


def choose(model: StackedT5, best, snaps, dev: DevSet, vocab, name: str, log: Log):
    """Per member, the candidate with the lowest greedy dev WER: the best evaluated weights, the last, or the mean
    of the last n snapshots (n >= 2). Returns the chosen (matrices, vectors) and what was chosen."""
    candidates = {"last": snaps[-1]}
    for n in range(2, len(snaps) + 1):
        recent = list(snaps)[-n:]
        candidates[f"mean of last {n}"] = [sum(s[i] for s in recent) / n for i in range(2)]
    candidates["best evaluated"] = best
    results = {label: dev_keys(model, c[0], c[1], dev, vocab) for label, c in candidates.items()}
    k = best[0].shape[0]
    chosen_m, chosen_v = best[0].clone(), best[1].clone()
    info = []
    for m in range(k):
        label = min(results, key=lambda lab: key(results[lab][m]))
        chosen_m[m].copy_(candidates[label][0][m])
        chosen_v[m].copy_(candidates[label][1][m])
        info.append({"kept": label, "dev_greedy": results[label][m],
                     "candidates": {lab: results[lab][m]["wer"] for lab in results}})
        log(f"{name} {m}: kept {label}, dev greedy WER {results[label][m]['wer']:.2f} "
            f"(stress {results[label][m]['wer_stress']:.2f}); candidates "
            + ", ".join(f"{lab} {results[lab][m]['wer']:.1f}" for lab in results))
    return chosen_m, chosen_v, info
