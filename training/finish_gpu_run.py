"""Turn a GPU run's files into model directories, choose on the dev set, then score the test set.

    .venv/bin/python training/finish_gpu_run.py FILES [--out runs/gpu_g2p] [--threads 1]

FILES is the folder of what ``training/gpu_train_ensemble.sh`` wrote to $OUT: ``teacher{k}.safetensors``,
``student.safetensors`` (when the student phase ran) and ``logs.tgz`` (its ``run.json`` gives the shape and the
vocabulary), or a ``gpu_train.py --out`` folder with ``run.json`` beside the weights (the CPU check). Steps:

1. ``OUT/export/<name>/`` for every weights file: ``config.json`` (``dtype: float32``), ``model.safetensors`` (float16),
   and the shipped model's ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json`` and license
   (the vocabulary is checked against the run's), plus a short ``README.md``. Each directory is loaded back with
   transformers and its logits compared with the trainer's own forward.
2. Dev: ``beamsearch eval --data dev.tsv --beams 1 5`` of every model and of the ensemble of all teachers
   (``--model teacher0 --ensemble teacher1 ...``; with ``--subsets``, of every subset of at least 3 teachers too).
3. Choice, on dev only: the single model and the ensemble with the lowest beam-5 WER without stress (ties: with
   stress, then PER).
4. Test: ``beamsearch eval`` of the two chosen only. Tables in ``OUT/results.md``, numbers in ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stacked_data import encode_word, tokenizer_vocab  # noqa: E402
from stacked_t5 import PAD, StackedT5, T5Shape, flat_from_hf  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED = REPO_ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict"
DATA = REPO_ROOT / "src" / "beamsearch" / "data" / "cmudict"
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "CMUDICT_LICENSE.txt")
ROW = re.compile(r"^\| (greedy|beam \d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$")


def read_run(files: Path, out: Path) -> dict:
    """``run.json`` from beside the weights or from ``logs.tgz`` (unpacked to ``OUT/logs``); failing both, the facts
    every weights file carries (shape, vocabulary, dropout)."""
    if (files / "run.json").exists():
        return json.loads((files / "run.json").read_text())
    if (files / "logs.tgz").exists():
        logs = out / "logs"
        with tarfile.open(files / "logs.tgz") as tar:
            tar.extractall(logs, filter="data")
        if (logs / "run.json").exists():
            return json.loads((logs / "run.json").read_text())
    first = sorted(files.glob("teacher[0-9]*.safetensors"))
    if not first:
        raise SystemExit(f"{files}: no run.json, logs.tgz or teacher*.safetensors")
    facts = stored_facts(first[0])
    print(f"no run.json: the shape and vocabulary come from {first[0]}", flush=True)
    return {"shape": facts["shape"], "hf_config": facts["hf_config"], "vocab": facts["vocab"],
            "args": {"dropout": facts["dropout"]}}


def stored_facts(weights: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        return json.loads((f.metadata() or {}).get("g2p", "{}"))


def export(weights: Path, run: dict, folder: Path) -> dict:
    """One model directory from a weights file; returns the run's facts stored in the file."""
    from safetensors.torch import load_file
    from transformers import T5Config, T5ForConditionalGeneration

    if tokenizer_vocab(SHIPPED / "tokenizer.json") != run["vocab"]:
        raise SystemExit(f"{weights}: the run's vocabulary differs from the shipped tokenizer's")
    state = {name: w.float() for name, w in load_file(str(weights)).items()}
    run = own_shape(weights, run)
    config = T5Config(**run["hf_config"], dropout_rate=float(run["args"]["dropout"]))
    model = T5ForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    if set(missing) - tied or unexpected:
        raise SystemExit(f"{weights}: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    if folder.exists():
        shutil.rmtree(folder)
    model.eval().half().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "float32"  # stored as float16; loaded as float32 for CPU inference
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        shutil.copy(SHIPPED / name, folder / name)
    check_logits(folder, state, run)
    return {k: v for k, v in stored_facts(weights).items() if k not in ("vocab", "hf_config", "shape")}


def own_shape(weights: Path, run: dict) -> dict:
    """``run`` with the shape the weights file states (a student may have another shape than the teachers)."""
    facts = stored_facts(weights)
    return {**run, **{k: facts[k] for k in ("shape", "hf_config") if k in facts}}


def check_logits(folder: Path, state: dict[str, torch.Tensor], run: dict) -> None:
    """The exported directory, loaded by transformers, gives the trainer's logits (float32, a few dev words)."""
    from transformers import AutoModelForSeq2SeqLM

    shape = T5Shape(**run["shape"])
    words = ["hello", "beamsearch", "a", "phonetisaurus's"]
    index = {t: i for i, t in enumerate(run["vocab"])}
    ids = [encode_word(w, index) for w in words]
    src = torch.full((len(ids), max(map(len, ids))), PAD)
    for row, s in enumerate(ids):
        src[row, : len(s)] = torch.tensor(s)
    dec = torch.cat([torch.full((len(ids), 1), PAD), src[:, :-1].clamp(max=len(index) - 1)], dim=1)
    model = StackedT5(shape)
    m, v = flat_from_hf(shape, state)
    with torch.no_grad():
        w = model.weights(m[None], v[None])
        enc, mask = model.encode(w, src[None])
        ours = model.decode(w, dec[None], enc, mask)[0]
        hf = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
        theirs = hf(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=dec).logits
    diff = (ours - theirs).abs().max().item()
    if diff > 1e-3:
        raise SystemExit(f"{folder}: transformers' logits differ from the trainer's by {diff:.2e}")


def model_card(name: str, facts: dict, run: dict) -> str:
    s = run["shape"]
    decoder = s.get("decoder_layers") or s["layers"]
    return (
        f"# {name}: a G2P T5 candidate from a GPU run (not the shipped model)\n\n"
        f"{s['layers']}+{decoder} layers, d_model {s['d_model']}, d_ff {s['d_ff']}, {s['heads']} heads; trained by "
        f"`training/gpu_train.py` on {run.get('gpu') or run.get('device')} (see `training/README.md`).\n\n"
        f"```json\n{json.dumps(facts, indent=1)}\n```\n\n"
        "The license of the data it was trained on is `CMUDICT_LICENSE.txt`.\n"
    )


def beamsearch_eval(model: Path, data: Path | None, beams: Sequence[int], threads: int) -> dict:
    """``beamsearch eval`` of one model or an ensemble folder: {decoding: {wer, wer_stress, per, inputs_per_s}}."""
    command = [sys.executable, "-m", "beamsearch", "eval", "--model", str(model), "--quiet",
               "--threads", str(threads), "--beams", *map(str, beams)]
    if data is not None:
        command += ["--data", str(data)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    rows = {}
    for line in done.stdout.splitlines():
        match = ROW.match(line.strip())
        if match:
            name, *values = match.groups()
            rows[name] = dict(zip(("wer", "wer_stress", "per", "inputs_per_s"), map(float, values), strict=True))
    if len(rows) != len(beams):
        raise SystemExit(f"could not read the table of {' '.join(command)}:\n{done.stdout}\n{done.stderr}")
    return rows


def ensemble_folder(export: Path, members: Sequence[str]) -> Path:
    """``export/ensemble-0-1-3/ensemble.json`` naming the exported members (``--model`` takes it as an ensemble:
    log-probabilities averaged, docs/cli.md), so a chosen ensemble ships as one directory."""
    folder = export / "-".join(["ensemble", *(m.removeprefix("teacher") for m in members)])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ensemble.json").write_text(json.dumps({"members": [f"../{m}" for m in members], "mode": "log"}) + "\n")
    return folder


def rank(result: dict, beam: str) -> tuple:
    r = result[beam]
    return (r["wer"], r["wer_stress"], r["per"])


def table(results: dict[str, dict], title: str) -> str:
    lines = [f"### {title}", "", "| model | decoding | WER % (stress removed) | WER % | PER % | inputs/s |",
             "|---|---|---:|---:|---:|---:|"]
    for name, rows in results.items():
        for decoding, r in rows.items():
            lines.append(f"| {name} | {decoding} | {r['wer']:.2f} | {r['wer_stress']:.2f} | {r['per']:.2f} "
                         f"| {r['inputs_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", type=Path, help="the GPU run's files ($OUT)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu_g2p")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--subsets", action="store_true", help="also every ensemble of at least 3 teachers")
    ap.add_argument("--dev", type=Path, default=DATA / "dev.tsv")
    ap.add_argument("--test", type=Path, default=None, help="default: beamsearch eval's own (the shipped test set)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    args.out.mkdir(parents=True, exist_ok=True)
    run = read_run(args.files, args.out)
    weights = sorted(args.files.glob("teacher[0-9]*.safetensors")) + sorted(args.files.glob("student.safetensors"))
    if not weights:
        raise SystemExit(f"{args.files}: no teacher*.safetensors")
    folders, facts = {}, {}
    for path in weights:
        name = path.stem
        folders[name] = args.out / "export" / name
        facts[name] = export(path, run, folders[name])
        (folders[name] / "README.md").write_text(model_card(name, facts[name], own_shape(path, run)))
        size = (folders[name] / "model.safetensors").stat().st_size / 1e6
        print(f"exported {folders[name]} ({size:.1f} MB); logits equal the trainer's", flush=True)

    beam = f"beam {max(args.beams)}" if max(args.beams) > 1 else "greedy"
    teachers = [n for n in folders if n.startswith("teacher")]
    groups = dict(folders)
    sizes = range(3, len(teachers) + 1) if args.subsets else [len(teachers)]
    for k in sizes:
        for combo in itertools.combinations(teachers, k):
            if k >= 2:
                numbers = [c.removeprefix("teacher") for c in combo]
                groups[f"ensemble({','.join(numbers)})"] = ensemble_folder(args.out / "export", combo)
    dev = {}
    for name, model in groups.items():
        dev[name] = beamsearch_eval(model, args.dev, args.beams, args.threads)
        print(f"dev {name}: {dev[name]}", flush=True)
    singles = [n for n in groups if not n.startswith("ensemble(")]
    ensembles = [n for n in groups if n.startswith("ensemble(")]
    chosen = {"single": min(singles, key=lambda n: rank(dev[n], beam))}
    if ensembles:
        chosen["ensemble"] = min(ensembles, key=lambda n: rank(dev[n], beam))
    print(f"chosen on dev ({beam}): {chosen}", flush=True)
    test = {chosen[role]: beamsearch_eval(groups[chosen[role]], args.test, args.beams, args.threads)
            for role in chosen}
    sizes_mb = {n: round(sum(p.stat().st_size for p in folders[n].iterdir()) / 1e6, 2) for n in folders}
    record = {"chosen": chosen, "dev": dev, "test": test, "disk_mb": sizes_mb, "facts": facts,
              "run": {k: run.get(k) for k in ("gpu", "torch", "teachers", "students", "student_init")}}
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    text = (table(dev, f"Dev ({args.dev})") + "\n" + table(test, "Test (the chosen models only)") + "\n"
            f"Chosen on dev by {beam} WER without stress: {chosen}. Directory sizes (MB): {sizes_mb}.\n")
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
