"""Train (and export) the small T5 grapheme-to-phoneme model on CMUdict.

Characters in, ARPAbet phones with stress out. A T5 built from a ``T5Config`` with random, seeded
initialisation; one shared WordLevel vocabulary (``<pad>``=0, ``</s>``=1, ``<unk>``=2, input characters,
phones). See ``training/README.md``.

    # train (resumes from runs/g2p/ckpt_last.pt when it exists; --hours is the total budget over restarts)
    .venv/bin/python training/train_g2p.py --hours 2.2
    # throughput of a candidate size for 60 s, nothing written
    .venv/bin/python training/train_g2p.py --bench 60 --d-model 192 --layers 3 --heads 6
    # write src/beamsearch/models/g2p_cmudict/ from the best checkpoint (+ test WER/PER in the model card)
    .venv/bin/python training/train_g2p.py --export
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_g2p import evaluate_entries  # noqa: E402
from g2p_data import REPO_ROOT, alphabet, make_split, training_pairs, write_license  # noqa: E402

SPECIALS = ["<pad>", "</s>", "<unk>"]
PAD, EOS, UNK = 0, 1, 2
DEFAULT_RUN_DIR = REPO_ROOT / "runs" / "g2p"
DEFAULT_EXPORT_DIR = REPO_ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict"
LOG_COLUMNS = ["elapsed_min", "epoch", "train_loss", "dev_wer", "dev_wer_stress", "dev_per", "step", "lr"]

# hyperparameters fixed by the first start of a run (stored in run_dir/args.json); the rest may change on resume
RUN_KEYS = [
    "seed",
    "d_model",
    "d_ff",
    "layers",
    "decoder_layers",
    "heads",
    "d_kv",
    "dropout",
    "ff_dropout",
    "batch_size",
    "lr",
    "warmup",
    "total_steps",
    "min_lr_ratio",
    "label_smoothing",
    "weight_decay",
    "clip",
    "init_from",
    "grow",
    "time_schedule",
    "bf16",
    "extra_pairs",
]


# ------------------------------------------------------------------------------------------- tokenizer


def build_tokenizer(chars: Sequence[str], phones: Sequence[str]):
    """Shared WordLevel tokenizer: specials, then the input characters, then the phones.

    The pre-tokenizer splits on whitespace, then isolates runs of capitals with an optional stress digit
    (phones such as ``AH0``, ``HH``) and any other single character, so a lowercase word becomes one token per
    character. ``</s>`` is appended to every sequence. Decoding joins tokens with single spaces.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars, *phones])}
    assert len(vocab) == len(SPECIALS) + len(chars) + len(phones), "characters and phones must not overlap"
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"[A-Z]+[0-9]*|."), behavior="isolated")]
    )
    tk.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", EOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )


def check_tokenizer(tok, pairs: Sequence[tuple[str, str]]) -> None:
    """Round trips: one id per character + eos for words; phone strings encode and decode unchanged."""
    vocab = tok.get_vocab()
    for word, phones in pairs:
        ids = tok(word)["input_ids"]
        assert ids == [vocab.get(c, UNK) for c in word] + [EOS], (word, ids)
        pids = tok(phones)["input_ids"]
        assert pids == [vocab[p] for p in phones.split()] + [EOS], (phones, pids)
        assert tok.decode([PAD, *pids], skip_special_tokens=True) == phones, (phones, tok.decode(pids))


# ------------------------------------------------------------------------------------------------ model


def make_config(a: argparse.Namespace, vocab_size: int):
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size,
        d_model=a.d_model,
        d_kv=a.d_kv,
        d_ff=a.d_ff,
        num_layers=a.layers,
        num_decoder_layers=a.decoder_layers or a.layers,
        num_heads=a.heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=64,
        dropout_rate=a.dropout,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        use_cache=True,
    )


def make_model(a: argparse.Namespace, vocab_size: int):
    from transformers import GenerationConfig, T5ForConditionalGeneration

    torch.manual_seed(a.seed)
    model = T5ForConditionalGeneration(make_config(a, vocab_size))
    model.generation_config = GenerationConfig(
        decoder_start_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=32, num_beams=1, do_sample=False
    )
    return model


class FastDropout(torch.nn.Module):
    """Inverted dropout drawing its mask with ``rand_like``: on one CPU thread this is ~1.6x faster than
    ``nn.Dropout`` (whose ``bernoulli_`` was ~17% of a training step). Training-time only; no parameters."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return x * (torch.rand_like(x) >= self.p) * (1.0 / (1.0 - self.p))


def set_training_dropout(model, p: float, ff_p: float) -> None:
    """Swap the T5 dropout modules for :class:`FastDropout`: ``p`` on the residual branches and embeddings,
    ``ff_p`` inside the feed-forward blocks (after the ReLU, the largest tensors). Attention-probability dropout
    stays T5's own (``config.dropout_rate``)."""
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Dropout):
                inside_ff = type(mod).__name__.startswith("T5Dense")
                setattr(mod, child_name, FastDropout(ff_p if inside_ff else p))


def init_weights(model, tok, model_dir: Path, grow: bool = False) -> None:
    """Warm start: load the weights of an exported model directory (same tokenizer and architecture).

    With ``grow``, the model may have more encoder or decoder layers than the saved one, or a larger ``d_ff``: the
    saved layers fill the first positions and each extra layer keeps its fresh initialisation except its output
    projections (attention ``o``, feed-forward ``wo``), which start at zero, so every extra layer adds nothing to the
    residual stream; extra feed-forward units get zero output weights alike. The grown model computes what the saved
    one computes (bit for bit with extra layers only; to float rounding with extra units, whose products are longer)
    until training moves them.
    """
    from safetensors.torch import load_file

    saved_vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    if saved_vocab != tok.get_vocab():
        raise SystemExit(f"--init-from {model_dir}: its tokenizer differs from the one built from the data")
    weights = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    if grow:
        weights = grown_weights(model, weights, model_dir)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = ("lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise SystemExit(f"--init-from {model_dir}: missing {missing}, unexpected {unexpected}")
    log(f"initialised from {model_dir}" + (" (grown: extra layers start as the identity)" if grow else ""))


def grown_weights(model, weights: dict, model_dir: Path) -> dict:
    """``weights`` completed for a deeper or wider-feed-forward ``model``: identity layers for the blocks beyond the
    saved ones, and for a larger ``d_ff`` the saved units first, the new ones with fresh input weights (``wi``) and
    zero output weights (``wo``), so that they add nothing until training moves them."""
    own = model.state_dict()
    out = dict(weights)
    for stack in ("encoder", "decoder"):
        saved = len({k.split(".")[2] for k in weights if k.startswith(f"{stack}.block.")})
        wanted = len(getattr(model, stack).block)
        if saved > wanted:
            raise SystemExit(f"--init-from {model_dir}: its {stack} has {saved} layers, more than the {wanted} asked")
        for i in range(saved, wanted):
            prefix = f"{stack}.block.{i}."
            for k, v in own.items():
                if k.startswith(prefix):
                    zero = k.endswith((".o.weight", ".wo.weight"))
                    out[k] = torch.zeros_like(v) if zero else v.clone()
    for k, v in weights.items():
        if k not in own or own[k].shape == v.shape:
            continue
        axis = {".wi.weight": 0, ".wo.weight": 1}.get(k[k.rindex(".", 0, k.rindex(".")) :])
        if axis is None or v.shape[axis] > own[k].shape[axis] or v.shape[1 - axis] != own[k].shape[1 - axis]:
            raise SystemExit(f"--init-from {model_dir}: {k} is {tuple(v.shape)}, the model's {tuple(own[k].shape)}; "
                             "--grow adds layers and feed-forward units only")
        grown = own[k].clone() if axis == 0 else torch.zeros_like(own[k])
        grown.narrow(axis, 0, v.shape[axis]).copy_(v)
        out[k] = grown
    return out


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------- data


def encode_pairs(tok, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    vocab = tok.get_vocab()
    return [([vocab.get(c, UNK) for c in w] + [EOS], [vocab[p] for p in ph.split()] + [EOS]) for w, ph in pairs]


def epoch_batches(n_items: int, lengths: Sequence[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Deterministic length-bucketed batches for one epoch: shuffle, sort within pools of 50 batches, shuffle."""
    rng = random.Random(seed * 100_003 + epoch)
    idx = list(range(n_items))
    rng.shuffle(idx)
    pool = batch_size * 50
    batches: list[list[int]] = []
    for s in range(0, n_items, pool):
        chunk = sorted(idx[s : s + pool], key=lambda i: lengths[i])
        batches.extend(chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def collate(data: Sequence[tuple[list[int], list[int]]], batch: Sequence[int]):
    srcs = [data[i][0] for i in batch]
    tgts = [data[i][1] for i in batch]
    ls, lt = max(map(len, srcs)), max(map(len, tgts))
    inp = torch.full((len(batch), ls), PAD, dtype=torch.long)
    lab = torch.full((len(batch), lt), -100, dtype=torch.long)
    dec = torch.full((len(batch), lt), PAD, dtype=torch.long)  # decoder input = labels shifted right, start=pad
    for r, (s, t) in enumerate(zip(srcs, tgts, strict=True)):
        inp[r, : len(s)] = torch.tensor(s)
        lab[r, : len(t)] = torch.tensor(t)
        dec[r, 1 : len(t)] = torch.tensor(t[:-1])
    return inp, (inp != PAD).long(), dec, lab


def lr_progress(step: int, seconds: float, a) -> float:
    """How far along the decay is, in [0, 1]: by steps, or with ``--time-schedule`` by the time budget."""
    if a.time_schedule:
        return min(1.0, seconds / (a.hours * 3600))
    return min(1.0, (step - a.warmup) / max(1, a.total_steps - a.warmup))


# ---------------------------------------------------------------------------------------------- schedule


def lr_at(step: int, a, seconds: float = 0.0) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps`` (held after that); with
    ``--time-schedule`` the decay follows the elapsed share of ``--hours`` instead (for a GPU run of fixed time)."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = lr_progress(step, seconds, a)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


# ------------------------------------------------------------------------------------------ checkpoints


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def read_log(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if not lines:
        return []
    head = lines[0].split("\t")
    return [dict(zip(head, ln.split("\t"), strict=False)) for ln in lines[1:] if ln.strip()]


def append_log(path: Path, row: dict) -> None:
    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write("\t".join(LOG_COLUMNS) + "\n")
        f.write("\t".join(str(row[c]) for c in LOG_COLUMNS) + "\n")


def truncate_log(path: Path, max_step: int) -> None:
    """Drop log rows written after the checkpoint we resume from (a crash between logging and saving)."""
    rows = read_log(path)
    keep = [r for r in rows if int(r["step"]) <= max_step]
    if len(keep) != len(rows):
        body = "".join("\t".join(r[c] for c in LOG_COLUMNS) + "\n" for r in keep)
        path.write_text("\t".join(LOG_COLUMNS) + "\n" + body)


# ---------------------------------------------------------------------------------------------- training


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def read_extra_pairs(path: Path, split, chars: Sequence[str], phones: Sequence[str]) -> list[tuple[str, str]]:
    """``word<TAB>phones[<TAB>...]`` lines (``pseudo_labels.py``'s output): pairs for words in no part of the split,
    in the split's alphabet."""
    known = {w for part in (split.train, split.dev, split.test) for w, _ in part}
    char_set, phone_set = set(chars), set(phones)
    pairs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        fields = line.split("\t")
        if len(fields) < 2:
            raise ValueError(f"{path}:{n}: {line!r} is not word<TAB>phones")
        word, pron = fields[:2]
        if word in known:
            raise ValueError(f"{path}:{n}: {word!r} is a CMUdict word; extra pairs must come from outside the split")
        if not set(word) <= char_set or not pron or not set(pron.split(" ")) <= phone_set:
            raise ValueError(f"{path}:{n}: {line!r} has a character or phone the model does not know")
        pairs.append((word, pron))
    return pairs


def prepare(extra_pairs: str = ""):
    """The split, the tokenizer, and the encoded training pairs: CMUdict's, then those of ``extra_pairs`` (a path)."""
    split = make_split()
    chars, phones = alphabet(split.train + split.dev + split.test)
    train_chars, train_phones = alphabet(split.train)
    assert train_chars == chars and train_phones == phones, "dev/test symbols missing from train"
    tok = build_tokenizer(chars, phones)
    pairs = training_pairs(split.train)
    if extra_pairs:
        pairs += read_extra_pairs(extra_pairs, split, chars, phones)
    check_tokenizer(tok, pairs[:: max(1, len(pairs) // 3000)] + [("hello", "HH AH0 L OW1")])
    data = encode_pairs(tok, pairs)
    return split, tok, data


def train(a) -> None:
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    device = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 training on every device
    run_dir: Path = a.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, best_path, log_path = run_dir / "ckpt_last.pt", run_dir / "best.pt", run_dir / "log.tsv"
    args_path = run_dir / "args.json"

    resume = ckpt_path.exists() and not a.bench
    if resume:
        saved = json.loads(args_path.read_text())
        changed = {k: (saved.get(k), getattr(a, k)) for k in RUN_KEYS if saved.get(k, getattr(a, k)) != getattr(a, k)}
        if changed:
            log(f"resuming: keeping the run's stored hyperparameters, ignoring command-line {changed}")
        for k in RUN_KEYS:
            setattr(a, k, saved.get(k, getattr(a, k)))

    split, tok, data = prepare(a.extra_pairs)
    lengths = [len(s) + len(t) for s, t in data]
    model = make_model(a, len(tok))
    if a.init_from and not resume:
        init_weights(model, tok, Path(a.init_from), grow=a.grow)
    set_training_dropout(model, a.dropout, a.ff_dropout)
    model.to(device)
    n_par = n_params(model)
    steps_per_epoch = math.ceil(len(data) / a.batch_size)
    log(
        f"T5 d_model={a.d_model} d_ff={a.d_ff} layers={a.layers}+{a.decoder_layers or a.layers} heads={a.heads} "
        f"d_kv={a.d_kv} "
        f"vocab={len(tok)} params={n_par:,}; {len(data):,} train pairs, {steps_per_epoch} steps/epoch "
        f"(batch {a.batch_size}); total_steps={a.total_steps}; threads={torch.get_num_threads()}; device={device}"
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "relative_attention_bias" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "relative_attention_bias" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "elapsed": 0.0, "loss_sum": 0.0, "loss_n": 0, "best": None}
    if resume:
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        torch.set_rng_state(ck["torch_rng"])
        random.setstate(ck["py_rng"])
        state = ck["state"]
        truncate_log(log_path, state["step"])
        log(
            f"resumed from {ckpt_path}: step {state['step']}, epoch {state['epoch']} batch {state['batch_in_epoch']}, "
            f"elapsed {state['elapsed'] / 60:.1f} min, best {state['best']}"
        )
    elif not a.bench:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        extra = {"device": a.device, "gpu": gpu, "hours": a.hours}
        args_path.write_text(json.dumps({**{k: getattr(a, k) for k in RUN_KEYS}, **extra}, indent=1) + "\n")
        tok.save_pretrained(run_dir / "tokenizer")
        torch.manual_seed(a.seed + 1)  # dropout stream
        random.seed(a.seed)

    budget = a.bench if a.bench else a.hours * 3600
    stop = {"flag": False}

    def on_signal(signum, _frame):
        log(f"signal {signum}: saving a checkpoint and stopping")
        stop["flag"] = True

    if not a.bench:
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def save_ckpt() -> None:
        atomic_save(
            {
                "model": model.state_dict(),
                "optim": opt.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate(),
                "state": state,
                "config": model.config.to_dict(),
            },
            ckpt_path,
        )

    def evaluate_and_log(epoch_label: float) -> None:
        t0 = time.time()
        s = evaluate_entries(model, tok, split.dev, num_beams=1, batch_size=250)
        train_loss = state["loss_sum"] / max(1, state["loss_n"])
        row = {
            "elapsed_min": f"{(state['elapsed'] + time.time() - t_start) / 60:.1f}",
            "epoch": f"{epoch_label:g}",
            "train_loss": f"{train_loss:.4f}",
            "dev_wer": f"{s.wer:.2f}",
            "dev_wer_stress": f"{s.wer_stress:.2f}",
            "dev_per": f"{s.per:.2f}",
            "step": state["step"],
            "lr": f"{lr_at(state['step'], a, state['elapsed'] + time.time() - t_start):.2e}",
        }
        append_log(log_path, row)
        key = (s.wer, s.wer_stress, s.per)
        best = state["best"]
        improved = best is None or key < (best["dev_wer"], best["dev_wer_stress"], best["dev_per"])
        log(
            f"eval epoch {epoch_label:g}: dev WER {s.wer:.2f}% (stress {s.wer_stress:.2f}%) PER {s.per:.2f}% "
            f"train loss {train_loss:.4f} [{time.time() - t0:.0f}s]{' *best*' if improved else ''}"
        )
        if improved:
            state["best"] = {
                "dev_wer": s.wer,
                "dev_wer_stress": s.wer_stress,
                "dev_per": s.per,
                "step": state["step"],
                "epoch": epoch_label,
                "elapsed_min": float(row["elapsed_min"]),
            }
            atomic_save(
                {"model": model.state_dict(), "config": model.config.to_dict(), "best": state["best"]}, best_path
            )
        state["loss_sum"], state["loss_n"] = 0.0, 0

    model.train()
    t_start = time.time()
    last_ckpt = time.time()
    win_t, win_pairs, win_loss, win_n = time.time(), 0, 0.0, 0
    bench_t0, bench_pairs = None, 0
    done = False
    while not done:
        batches = epoch_batches(len(data), lengths, a.batch_size, a.seed, state["epoch"])
        while state["batch_in_epoch"] < len(batches):
            batch = batches[state["batch_in_epoch"]]
            inp, att, dec, lab = (t.to(device, non_blocking=True) for t in collate(data, batch))
            for g in opt.param_groups:
                g["lr"] = lr_at(state["step"], a, state["elapsed"] + time.time() - t_start)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
                logits = model(input_ids=inp, attention_mask=att, decoder_input_ids=dec, use_cache=False).logits
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), lab.view(-1), ignore_index=-100,
                label_smoothing=a.label_smoothing,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            opt.step()
            state["step"] += 1
            state["batch_in_epoch"] += 1
            lv = loss.item()
            state["loss_sum"] += lv
            state["loss_n"] += 1
            win_pairs += len(batch)
            win_loss += lv
            win_n += 1
            if a.bench:
                if state["step"] == 5:  # skip warm-up steps
                    bench_t0, bench_pairs = time.time(), 0
                elif bench_t0 is not None:
                    bench_pairs += len(batch)
            now = time.time()
            if state["step"] % a.log_every == 0:
                log(
                    f"step {state['step']} epoch {state['epoch']} ({state['batch_in_epoch']}/{len(batches)}) "
                    f"loss {win_loss / win_n:.4f} lr {lr_at(state['step'], a, state['elapsed'] + now - t_start):.2e} "
                    f"{win_pairs / (now - win_t):.0f} pairs/s elapsed {(state['elapsed'] + now - t_start) / 60:.1f} min"
                )
                win_t, win_pairs, win_loss, win_n = now, 0, 0.0, 0
            out_of_time = state["elapsed"] + now - t_start >= budget
            if a.bench and out_of_time:
                rate = bench_pairs / (now - bench_t0)
                log(f"BENCH params={n_par:,} {rate:.0f} pairs/s ({rate * 3600 / len(data):.2f} epochs/h)")
                return
            if out_of_time or stop["flag"] or state["step"] >= a.total_steps + a.extra_steps:
                done = True
                break
            if now - last_ckpt >= a.ckpt_minutes * 60:
                state["elapsed"] += now - t_start
                t_start = now
                save_ckpt()
                last_ckpt = now
                log(f"checkpoint saved at step {state['step']}")
        if state["batch_in_epoch"] >= len(batches):
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
            evaluate_and_log(state["epoch"])
            state["elapsed"] += time.time() - t_start
            t_start = time.time()
            save_ckpt()
            last_ckpt = time.time()
            if state["elapsed"] >= budget or stop["flag"] or state["step"] >= a.total_steps + a.extra_steps:
                done = True

    # stopped mid-epoch: evaluate the partial epoch too (unless stopped by a signal), then save
    if state["batch_in_epoch"] > 0 and not stop["flag"]:
        evaluate_and_log(round(state["epoch"] + state["batch_in_epoch"] / steps_per_epoch, 2))
    state["elapsed"] += time.time() - t_start
    t_start = time.time()
    save_ckpt()
    log(f"stopped at step {state['step']}, elapsed {state['elapsed'] / 60:.1f} min; best {state['best']}")
    if a.export_at_end and not stop["flag"]:
        export(a)


# ------------------------------------------------------------------------------------------------ export


LOG_DIR = Path(__file__).resolve().parent / "logs"
# The shipped model's earlier stages, oldest first: their dev curves are kept in training/logs/, and a run that
# warm-starts from the shipped model (--init-from) prepends them to its model card's curve.
PREVIOUS_STAGES = [*(LOG_DIR / f"g2p_stage{n}.tsv" for n in (1, 2, 3, 4, 5, 6, 7)),
                   LOG_DIR / "g2p_stage9a.tsv",  # shipped stage 8 is README.md's run 9a (its stage 8 was not shipped)
                   LOG_DIR / "g2p_stage12a_swa.tsv"]  # shipped stage 9 is README.md's run 12a
STAGES_NOTE = """Trained in {count} stages. Stage 1 trained from random initialisation (seed 1234, peak learning
rate 0.0015, 1000 warmup steps, cosine decay over 15000 steps) for 103 minutes, reaching a dev WER of 35.20% (the
model shipped in commit c15c488). Each later stage warm-started from the model shipped before it (`--init-from`,
fresh optimizer, 300 warmup steps, cosine decay over its own time budget, one CPU thread): stage 2 (seed 1235, peak
learning rate 0.001, 120 minutes) was shipped with a best dev WER of 33.00% (commit e2c12df; test WER 33.45% at
beam 5); stage 3 (seed 1236, peak 0.0007, 132 minutes) with 29.60% (commit 48fa54c; test WER 30.55% at beam 5);
stage 4 (seed 1237, peak 0.0005, 132 minutes) with 28.00% (commit 44e2984; test WER 29.60% at beam 5); stage 5
(seed 2001, peak 0.0005, batches of 256, 6 minutes on one H200 GPU) with 27.30% (commit 2bbb0b2; test WER 28.45% at
beam 5 with the shipped generation config); stage 6 (seed 1241, peak 0.0004, 132 minutes on one CPU thread, bfloat16
autocast) with 25.90% (shipped 2026-11-28; test WER 28.10% at beam 5); stage 7 (seed 1243, peak 0.0005, its
feed-forward blocks grown from 768 to 1536 units, 132 minutes on one CPU thread, bfloat16 autocast) with 25.40%
(shipped 2026-11-28; test WER 27.65% at beam 5); stage 8 (seed 1247, peak 0.0003, label smoothing off, 93 minutes
on one CPU thread, bfloat16 autocast; training/README.md's run 9a) with 24.20% (shipped 2026-11-29; test WER 26.00%
at beam 5); stage 9 (seed 1253, a constant 0.0002 after warmup, label smoothing off, 87 minutes on one CPU thread,
bfloat16 autocast, the mean of its 30 snapshots; training/README.md's run 12a) with 24.30% (shipped 2026-11-29; test
WER 25.25% at beam 5). Stage {count} is described here.

"""

MODEL_CARD = """---
license: other
license_name: cmudict
license_link: CMUDICT_LICENSE.txt
library_name: transformers
pipeline_tag: text2text-generation
tags: [g2p, grapheme-to-phoneme, cmudict, arpabet, t5]
---

# g2p_cmudict: a small T5 grapheme-to-phoneme model for English

Lowercase English word in, ARPAbet phones with stress digits out (`hello` -> `HH AH0 L OW1`). Trained from
scratch on the CMU Pronouncing Dictionary; shipped with `beamsearch` as a small, offline, real seq2seq model
for examples, tests and benchmarks.

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(path)          # path = this directory
model = AutoModelForSeq2SeqLM.from_pretrained(path)
ids = model.generate(**tok(["hello", "beamsearch"], return_tensors="pt", padding=True), num_beams=5)
print(tok.batch_decode(ids, skip_special_tokens=True))
```

Inputs must be lowercase (the alphabet is `a-z`, apostrophe, hyphen, period; any other character becomes
`<unk>`, and an uppercase run is read as a single unknown token). Outputs are phones separated by single spaces.

## Model

* Architecture: T5 encoder-decoder (`T5ForConditionalGeneration`), {layers} encoder + {dec_layers} decoder layers,
  d_model {d_model}, d_ff {d_ff} (ReLU), {heads} heads of d_kv {d_kv}, relative position buckets 32
  (max distance 64), tied input/output embeddings. Training dropout: {dropout} on embeddings, residual branches
  and attention probabilities, {ff_dropout} inside the feed-forward blocks.
* Parameters: {n_params:,} ({n_params_m:.2f}M); weights stored in float16 (`model.safetensors`, {size_mb:.1f} MB);
  `config.json` says `dtype: float32`, so `from_pretrained` loads them as float32 by default.
* Vocabulary ({vocab} tokens, shared by encoder and decoder; `tokenizers` WordLevel): `<pad>`=0, `</s>`=1,
  `<unk>`=2, then {n_chars} input characters, then {n_phones} ARPAbet phones with stress. A word encodes as one
  id per character followed by `</s>`. `decoder_start_token_id` = 0 (`<pad>`), `eos_token_id` = 1.
* `generation_config.json`: greedy (num_beams 1), max_new_tokens 32.

## Data and split

CMU Pronouncing Dictionary via `cmudict.dict()` (cmudict package; data license in `CMUDICT_LICENSE.txt`,
which must stay with these files): 126,052 words, 135,164 distinct pronunciations. Split by word with a fixed
seed (`training/g2p_data.py`, seed {split_seed}): 2,000 test words, 1,000 dev words, the rest ({n_train_words:,}
words, {n_train_pairs:,} word/pronunciation pairs) for training, so the variants of a word never cross the split.
No word was dropped. The test and dev lists are `src/beamsearch/data/cmudict/test.tsv` and `dev.tsv`
in the repository.{extra}

## Training

{stages}`training/train_g2p.py` (seed {seed}): one (word, pronunciation) pair per training example, length-bucketed
batches of {batch_size}, AdamW (betas 0.9/0.98, weight decay {weight_decay}), peak learning rate {lr} with
{warmup} warmup steps and {schedule}, label smoothing
{label_smoothing}, gradient clipping {clip}. {hardware}
Trained for {train_min:.0f} minutes ({steps} steps, {epochs} epochs); the checkpoint with the best dev WER (stress
removed) is step {best_step}, epoch {best_epoch}, after {best_min:.0f} minutes. {averaged}

Learning curve (dev set, greedy decoding; WER with stress digits removed, WER with stress, PER with stress):

| stage | minutes | epoch | train loss | dev WER % | dev WER (stress) % | dev PER % |
|---:|---:|---:|---:|---:|---:|---:|
{curve}

## Results (test set, 2,000 words)

A word is right if the output equals ANY of its reference pronunciations; PER is the phone edit distance to the
closest reference divided by that reference's length (with stress).

| decoding | WER % (no stress) | WER % (with stress) | PER % |
|---|---:|---:|---:|
{results}

For reference (different splits, larger models): Sequitur G2P 24.5% WER, a Transformer G2P 22.1% WER on CMUdict.
Reproduce: `.venv/bin/python training/eval_g2p.py src/beamsearch/models/g2p_cmudict`.
"""


def extra_pairs_words(n: int) -> str:
    """The model card's sentence on ``--extra-pairs``, if the run had any."""
    if not n:
        return ""
    return (
        f"\nThe last stage also trained on {n:,} pseudo-labelled pairs (`--extra-pairs`, `training/pseudo_labels.py`):"
        " English words from the `wordfreq` package's list that are in no part of CMUdict (so none of dev or test),"
        " pronounced by the model that stage started from, kept where its output was likely."
    )


def schedule_words(saved: dict) -> str:
    """The learning-rate schedule after warmup, for the model card."""
    if saved["min_lr_ratio"] >= 1:
        return "a constant rate after them (`--min-lr-ratio 1`)"
    over = f"{saved['hours'] * 60:.0f} minutes" if saved.get("time_schedule") else f"{saved['total_steps']} steps"
    return f"cosine decay to {saved['min_lr_ratio']}x over {over}"


def snapshots(run_dir: Path) -> list[Path]:
    """The run's snapshots (``snap/ckpt_*.pt``, named by time) in order, each step once: a run stopped right after a
    periodic checkpoint writes the same step again at the stop, and ``snap_checkpoints.sh`` copies both (run 15a's
    step 3,639), which would count those weights twice in a mean."""
    kept, steps = [], set()
    for path in sorted((run_dir / "snap").glob("ckpt_*.pt")):
        # mapped, not read: only the step is needed here, and the callers load the snapshots they average
        step = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["state"]["step"]
        if step not in steps:
            steps.add(step)
            kept.append(path)
    return kept


def mean_weights(checkpoints: list[dict]) -> dict:
    """The mean of the checkpoints' model weights, in float32."""
    return {k: sum(c["model"][k].float() for c in checkpoints) / len(checkpoints) for k in checkpoints[0]["model"]}


def choose_average(model, ck: dict, tok, split, paths: list[Path]) -> str:
    """Average the weights of the last checkpoints; keep the average if its dev WER beats the best checkpoint's.

    Returns a sentence for the model card ("" when the best single checkpoint stays).
    """
    if len(paths) < 2:
        log(f"--average: only {len(paths)} snapshots in run_dir/snap; keeping the best checkpoint")
        return ""
    states = [torch.load(p, map_location="cpu", weights_only=False) for p in paths]
    mean = mean_weights(states)
    best = ck["best"]
    model.load_state_dict(mean)
    model.eval()
    s = evaluate_entries(model, tok, split.dev, num_beams=1, batch_size=250)
    steps = [st["state"]["step"] for st in states]
    log(f"average of steps {steps}: dev WER {s.wer:.2f} (stress {s.wer_stress:.2f}) PER {s.per:.2f}; best {best}")
    if (s.wer, s.wer_stress, s.per) < (best["dev_wer"], best["dev_wer_stress"], best["dev_per"]):
        return (
            f"The exported weights are not that checkpoint but the mean of the last {len(states)} snapshots "
            f"(steps {', '.join(map(str, steps))}): dev WER {s.wer:.2f}% (stress {s.wer_stress:.2f}%, "
            f"PER {s.per:.2f}%) against {best['dev_wer']:.2f}% for the best single checkpoint."
        )
    model.load_state_dict(ck["model"])
    return ""


def export(a) -> None:
    """Write the shipped model directory from the best checkpoint and evaluate it on the test set."""
    from eval_g2p import evaluate_dir
    from transformers import T5Config, T5ForConditionalGeneration

    torch.set_num_threads(a.threads)
    run_dir: Path = a.run_dir
    out: Path = a.export_dir
    ck = torch.load(run_dir / "best.pt", map_location="cpu", weights_only=False)
    saved = json.loads((run_dir / "args.json").read_text())
    last = torch.load(run_dir / "ckpt_last.pt", map_location="cpu", weights_only=False)["state"]
    # the run's own pairs (with its --extra-pairs, if any), so the card's epoch count is the run's
    split, tok, data = prepare(saved.get("extra_pairs", ""))
    n_cmudict_pairs = len(training_pairs(split.train))

    config = T5Config.from_dict(ck["config"])
    model = T5ForConditionalGeneration(config)
    model.load_state_dict(ck["model"])
    averaged = "It is the exported one."
    if a.average > 1:
        snaps = snapshots(run_dir)[-a.average :]
        averaged = choose_average(model, ck, tok, split, snaps) or averaged
    template = make_model(argparse.Namespace(**{**vars(a), **saved}), len(tok))
    model.generation_config = template.generation_config
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file() and stale.name != "README.md":
            stale.unlink()
    model.half().save_pretrained(out)
    tok.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float32"  # stored as float16 to keep the file small; load as float32 for CPU inference
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_license(out)

    results = evaluate_dir(out, "test", beams=(1, 5), threads=a.threads, device=a.device)
    log(f"test results: {results}")
    (run_dir / "test_results.json").write_text(json.dumps(results, indent=1) + "\n")

    rows = read_log(run_dir / "log.tsv")
    stages = ""
    if saved.get("init_from"):
        earlier = [[{**r, "stage": n} for r in read_log(path)] for n, path in enumerate(PREVIOUS_STAGES, 1)]
        count = len(PREVIOUS_STAGES) + 1
        stages = STAGES_NOTE.format(count=count)
        if saved.get("grow"):
            stages = stages.rstrip() + (
                " It grew the model it started from (`--grow`): the layers and feed-forward units beyond that"
                f" model's started with zero output weights, so stage {count} began computing what that model"
                " computes.\n\n"
            )
        rows = [r for stage in earlier for r in stage] + [{**r, "stage": count} for r in rows]
    else:
        rows = [{**r, "stage": 1} for r in rows]
    curve = "\n".join(
        f"| {r['stage']} | {r['elapsed_min']} | {r['epoch']} | {r['train_loss']} | {r['dev_wer']} "
        f"| {r['dev_wer_stress']} | {r['dev_per']} |"
        for r in rows
    )
    res_rows = "\n".join(
        f"| {'greedy' if k == 'beam1' else k.replace('beam', 'beam ')} | {r['wer']:.2f} | {r['wer_stress']:.2f} "
        f"| {r['per']:.2f} |"
        for k, r in results.items()
    )
    from g2p_data import SEED as SPLIT_SEED

    chars = [t for t in tok.get_vocab() if len(t) == 1 and not t.isupper()]
    best = ck["best"]
    n_par = n_params(model)
    card = MODEL_CARD.format(
        **saved,
        dec_layers=saved.get("decoder_layers") or saved["layers"],
        n_params=n_par,
        n_params_m=n_par / 1e6,
        size_mb=(out / "model.safetensors").stat().st_size / 1e6,
        vocab=len(tok),
        n_chars=len(chars),
        n_phones=len(tok) - len(SPECIALS) - len(chars),
        split_seed=SPLIT_SEED,
        n_train_words=len(split.train),
        n_train_pairs=n_cmudict_pairs,
        extra=extra_pairs_words(len(data) - n_cmudict_pairs),
        train_min=last["elapsed"] / 60,
        steps=last["step"],
        epochs=f"{last['epoch'] + last['batch_in_epoch'] / math.ceil(len(data) / saved['batch_size']):.1f}",
        best_step=best["step"],
        best_epoch=best["epoch"],
        best_min=best["elapsed_min"],
        curve=curve,
        results=res_rows,
        stages=stages,
        averaged=averaged,
        schedule=schedule_words(saved),
        hardware=(
            f"One {saved['gpu']} GPU" if saved.get("gpu") else "One CPU thread (`torch.set_num_threads(1)`)"
        ) + (", bfloat16 autocast for the forward products." if saved.get("bf16")
             else (", float32 (TF32 off)." if saved.get("gpu") else ", float32.")),
    )
    (out / "README.md").write_text(card)
    log(f"exported to {out}: {sorted(p.name for p in out.iterdir())}")


# -------------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=2.2, help="training time budget, summed over restarts")
    ap.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    ap.add_argument("--export-dir", type=Path, default=DEFAULT_EXPORT_DIR)
    ap.add_argument("--export", action="store_true", help="only write --export-dir from run-dir/best.pt")
    ap.add_argument("--average", type=int, default=0, help="with --export: try the mean of the last N snapshots")
    ap.add_argument("--no-export-at-end", dest="export_at_end", action="store_false")
    ap.add_argument("--bench", type=float, default=0, help="measure pairs/s for this many seconds, write nothing")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (training; export and test evaluation run on CPU)")
    ap.add_argument("--time-schedule", action="store_true", help="decay the learning rate over --hours, not steps")
    ap.add_argument("--bf16", action="store_true",
                    help="bfloat16 autocast for the forward products (float32 weights, loss and AdamW); on a CPU with "
                         "AMX about 1.4x the pairs/s (training/README.md)")
    ap.add_argument("--ckpt-minutes", type=float, default=10)
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--extra-steps", type=int, default=0, help="train this many steps past --total-steps")
    # run hyperparameters (fixed by the first start; see RUN_KEYS)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--d-ff", type=int, default=768)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--decoder-layers", type=int, default=0, help="the decoder's depth (0: --layers)")
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--d-kv", type=int, default=32)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--ff-dropout", type=float, default=0.0, help="dropout inside the feed-forward blocks")
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=1500)
    ap.add_argument("--total-steps", type=int, default=30000, help="end of the cosine decay")
    ap.add_argument("--min-lr-ratio", type=float, default=0.02)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--init-from", default="", help="warm start from an exported model directory")
    ap.add_argument("--extra-pairs", default="",
                    help="train also on these pairs (word<TAB>phones lines, e.g. pseudo_labels.py's), after CMUdict's")
    ap.add_argument("--grow", action="store_true",
                    help="with --init-from: the model may be deeper or have a larger d_ff than the saved one; extra "
                         "layers and units start with zero output weights, so training starts from the saved model's "
                         "function")
    a = ap.parse_args(argv)
    if a.extra_pairs:
        a.extra_pairs = str(Path(a.extra_pairs).resolve())  # stored in args.json: an export may run from elsewhere
    if a.grow and not a.init_from:
        ap.error("--grow needs --init-from")
    if a.export:
        export(a)
    else:
        train(a)


if __name__ == "__main__":
    main()
