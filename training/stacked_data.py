"""The GPU trainer's data: the pairs of ``runs/g2p_data/`` (``training/g2p_pairs.py``) as device tensors in length
buckets, every member's batch order, the dev set, and the teachers' distributions for distillation.

A batch is ``B`` pairs of one bucket, source and target both padded to the bucket's length L, so a run has only a
few shapes (one CUDA graph each). Every member draws its own batches of the same bucket at each step (its own
permutation per epoch), so the K members see the data in different orders.

Legend: K members, B batch, L bucket length, V vocabulary, N pairs of a bucket.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from stacked_t5 import EOS, PAD, UNK


def _load_scoring():
    """``beamsearch/evaluation.py`` (standard library only) loaded by itself: the GPU run does not depend on the
    library's package imports, which other work may be changing."""
    path = Path(__file__).resolve().parent.parent / "src" / "beamsearch" / "evaluation.py"
    spec = importlib.util.spec_from_file_location("g2p_scoring", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["g2p_scoring"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


scoring = _load_scoring()
Entry, read_references, score = scoring.Entry, scoring.read_references, scoring.score

BUCKET_LENGTHS = (6, 7, 8, 9, 10, 12, 15, 64)  # by max(source, target) tokens; the last takes the rest


def read_vocab(folder: Path) -> list[str]:
    return json.loads((folder / "vocab.json").read_text(encoding="utf-8"))


def tokenizer_vocab(path: Path) -> list[str]:
    """The tokens of a ``tokenizer.json`` (a word-level vocabulary) in id order, as ``vocab.json`` lists them."""
    vocab = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
    return sorted(vocab, key=vocab.get)


def encode_word(word: str, index: dict[str, int]) -> list[int]:
    return [index.get(c, UNK) for c in word] + [EOS]


def read_pairs(folder: Path, vocab: Sequence[str], limit: int = 0) -> list[tuple[list[int], list[int]]]:
    """``train.tsv`` as (source ids, target ids) with EOS; ``limit`` > 0 keeps every n-th pair to about that many."""
    index = {t: i for i, t in enumerate(vocab)}
    lines = (folder / "train.tsv").read_text(encoding="utf-8").splitlines()
    if limit:
        lines = lines[:: max(1, len(lines) // limit)]
    out = []
    for line in lines:
        word, phones = line.split("\t")
        out.append((encode_word(word, index), [index[p] for p in phones.split()] + [EOS]))
    return out


@dataclass
class Bucket:
    """N pairs padded to length L: src [N, L], dec [N, L] (start token then the target shifted), labels [N, L]
    (-100 on padding), and for distillation the teachers' distribution [N, L, V] (bfloat16 or float32)."""

    length: int
    src: torch.Tensor
    dec: torch.Tensor
    labels: torch.Tensor
    target: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.src.shape[0]


class BucketedData:
    """The training pairs on ``device`` in length buckets of at least ``batch_size`` pairs each."""

    def __init__(self, pairs: Sequence[tuple[list[int], list[int]]], batch_size: int, device: torch.device,
                 lengths: Sequence[int] = BUCKET_LENGTHS):
        self.batch_size = batch_size
        groups: dict[int, list[int]] = {}
        for i, (s, t) in enumerate(pairs):
            need = max(len(s), len(t))
            groups.setdefault(next((b for b in lengths if b >= need), lengths[-1]), []).append(i)
        merged: list[list[int]] = []
        for length in sorted(groups):  # too small for a batch: joins the next longer bucket
            if merged and len(merged[-1]) < batch_size:
                merged[-1].extend(groups[length])
            else:
                merged.append(list(groups[length]))
        if len(merged) > 1 and len(merged[-1]) < batch_size:
            tail = merged.pop()
            merged[-1].extend(tail)
        if not merged or len(merged[0]) < batch_size:
            raise ValueError(f"{len(pairs)} training pairs: fewer than one batch of {batch_size}")
        self.buckets = [self._bucket([pairs[i] for i in rows], device) for rows in merged]

    @staticmethod
    def _bucket(pairs: Sequence[tuple[list[int], list[int]]], device: torch.device) -> Bucket:
        length = max(max(len(s), len(t)) for s, t in pairs)
        src = [s + [PAD] * (length - len(s)) for s, _ in pairs]
        labels = [t + [-100] * (length - len(t)) for _, t in pairs]
        dec = [[PAD] + t[:-1] + [PAD] * (length - len(t)) for _, t in pairs]
        return Bucket(length, *(torch.tensor(rows, dtype=torch.long, device=device) for rows in (src, dec, labels)))

    def describe(self) -> str:
        return ", ".join(f"L{b.length}: {b.size}" for b in self.buckets)

    def gather(self, bucket: int, index: torch.Tensor):
        """index [K, B] rows of ``bucket`` -> src, dec, labels [K, B, L] and the target [K, B, L, V] or None."""
        b = self.buckets[bucket]
        target = b.target[index] if b.target is not None else None
        return b.src[index], b.dec[index], b.labels[index], target

    def steps_per_epoch(self) -> int:
        return sum(b.size // self.batch_size for b in self.buckets)

    def epoch(self, epoch: int, seeds: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
        """The epoch's steps: (bucket, index [K, B] on the device). The bucket order is shared by the members (one
        shape per step); the rows are each member's own shuffle of the bucket (the remainder left out)."""
        plans = []
        order: list[int] = []
        for number, b in enumerate(self.buckets):
            batches = b.size // self.batch_size
            rows = []
            for seed in seeds:
                g = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 101 + number)
                rows.append(torch.randperm(b.size, generator=g)[: batches * self.batch_size].view(batches, -1))
            plans.append(torch.stack(rows).to(b.src.device))  # [K, batches, B]
            order += [number] * batches
        g = torch.Generator().manual_seed(seeds[0] * 7919 + epoch)
        order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
        seen = [0] * len(self.buckets)
        steps = []
        for number in order:
            steps.append((number, plans[number][:, seen[number]]))
            seen[number] += 1
        return steps

    @torch.no_grad()
    def add_targets(self, teacher_distribution, chunk: int = 2048, dtype: torch.dtype = torch.bfloat16) -> None:
        """Store ``teacher_distribution(src [n, L], dec [n, L]) -> [n, L, V]`` for every pair (distillation)."""
        for b in self.buckets:
            parts = [teacher_distribution(b.src[i : i + chunk], b.dec[i : i + chunk]).to(dtype)
                     for i in range(0, b.size, chunk)]
            b.target = torch.cat(parts)


@dataclass
class DevSet:
    """The dev words as src [B, S] on the device, with their references for scoring."""

    entries: list[Entry]
    src: torch.Tensor

    @property
    def max_new(self) -> int:
        return self.src.shape[1] + 3  # the shipped generation config's limit: source tokens + 3


def read_dev(folder: Path, vocab: Sequence[str], device: torch.device, limit: int = 0) -> DevSet:
    entries = read_references(folder / "dev.tsv")
    entries = entries[:limit] if limit else entries
    index = {t: i for i, t in enumerate(vocab)}
    ids = [encode_word(word, index) for word, _ in entries]
    src = torch.full((len(ids), max(map(len, ids))), PAD, dtype=torch.long)
    for row, s in enumerate(ids):
        src[row, : len(s)] = torch.tensor(s)
    return DevSet(entries, src.to(device))
