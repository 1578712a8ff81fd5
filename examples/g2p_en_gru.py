"""A real model nobody here trained, decoded through the model-agnostic path: g2p-en's GRU.

The ``g2p-en`` package (Apache-2.0) ships ``checkpoint20.npz``: a GRU encoder-decoder without
attention (29 grapheme ids in, 74 phoneme ids out, hidden size 256). Importing ``g2p_en`` itself
downloads NLTK data, so we only locate the package and load the weights file. The step function
below is a plain PyTorch GRU cell; ``beamsearch.search`` does the rest.

    pip install --no-deps g2p-en
    python examples/g2p_en_gru.py hello beamsearch pronunciation
    python examples/g2p_en_gru.py --eval      # WER / PER on the shipped CMUdict test split
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

import beamsearch

GRAPHEMES = ["<pad>", "<unk>", "</s>"] + list("abcdefghijklmnopqrstuvwxyz")
PHONEMES = ["<pad>", "<unk>", "<s>", "</s>"] + (
    "AA0 AA1 AA2 AE0 AE1 AE2 AH0 AH1 AH2 AO0 AO1 AO2 AW0 AW1 AW2 AY0 AY1 AY2 B CH D DH EH0 EH1 EH2 ER0 ER1 ER2 "
    "EY0 EY1 EY2 F G HH IH0 IH1 IH2 IY0 IY1 IY2 JH K L M N NG OW0 OW1 OW2 OY0 OY1 OY2 P R S SH T TH UH0 UH1 UH2 "
    "UW UW0 UW1 UW2 V W Y Z ZH"
).split()
START, END = PHONEMES.index("<s>"), PHONEMES.index("</s>")


def checkpoint_path() -> Path:
    """Where the installed g2p-en package keeps its weights (found without importing it)."""
    spec = importlib.util.find_spec("g2p_en")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the g2p-en package is not installed: pip install --no-deps g2p-en")
    return Path(next(iter(spec.submodule_search_locations))) / "checkpoint20.npz"


def _gru_cell(weights, prefix: str) -> torch.nn.GRUCell:
    """A torch GRUCell holding g2p-en's weights (same gate layout: reset, update, new)."""
    w_ih = torch.from_numpy(weights[f"{prefix}_w_ih"])
    cell = torch.nn.GRUCell(w_ih.shape[1], w_ih.shape[0] // 3)
    with torch.no_grad():
        for name in ("w_ih", "w_hh", "b_ih", "b_hh"):
            target = {"w_ih": cell.weight_ih, "w_hh": cell.weight_hh, "b_ih": cell.bias_ih, "b_hh": cell.bias_hh}[name]
            target.copy_(torch.from_numpy(weights[f"{prefix}_{name}"]))
    return cell


class G2pEnGRU:
    """g2p-en's encoder-decoder as an encoder function and a step function for ``beamsearch.search``."""

    def __init__(self, path: Path | None = None):
        weights = np.load(path or checkpoint_path())
        self.enc_emb = torch.from_numpy(weights["enc_emb"])  # [29, 256]
        self.dec_emb = torch.from_numpy(weights["dec_emb"])  # [74, 256]
        self.encoder = _gru_cell(weights, "enc")
        self.decoder = _gru_cell(weights, "dec")
        self.fc_w = torch.from_numpy(weights["fc_w"])  # [74, 256]
        self.fc_b = torch.from_numpy(weights["fc_b"])  # [74]

    @torch.no_grad()
    def encode(self, words: list[str]) -> dict:
        """Words -> the decoder's initial state ``{"hidden": [B, H]}`` (last encoder state after </s>)."""
        hidden = []
        for word in words:  # words differ in length; the encoder runs once per word, outside the search
            ids = [GRAPHEMES.index(c) if c in GRAPHEMES else 1 for c in word.lower()] + [2]
            h = torch.zeros(1, self.encoder.hidden_size)
            for token in ids:
                h = self.encoder(self.enc_emb[token][None], h)
            hidden.append(h)
        return {"hidden": torch.cat(hidden)}

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: dict):
        """``tokens [N, t]`` -> logits ``[N, 74]``; the state carries the GRU hidden ``[N, H]``."""
        hidden = self.decoder(self.dec_emb[tokens[:, -1]], state["hidden"])
        return hidden @ self.fc_w.T + self.fc_b, {"hidden": hidden}

    def pronounce(self, words: list[str], **options) -> beamsearch.SearchResult:
        """Decode words to phonemes; options are beamsearch / Hugging Face generation options."""
        start = torch.full((len(words), 1), START)
        options = {"max_new_tokens": 20, "eos_token_id": END, "pad_token_id": 0, **options}
        return beamsearch.search(self.step, start, self.encode(words), **options)


def phones(result: beamsearch.SearchResult, b: int, j: int = 0) -> list[str]:
    """The phonemes of hypothesis ``j`` of example ``b`` (start and end tokens removed)."""
    length = int(result.lengths[b, j])
    return [PHONEMES[t] for t in result.sequences[b, j, 1:length].tolist() if t != END]


def evaluate(beams: tuple[int, ...] = (1, 5)) -> None:
    """WER / PER on the test words made only of a-z (g2p-en's alphabet)."""
    from beamsearch.evaluation import read_references, score

    path = Path(beamsearch.__file__).parent / "data" / "cmudict" / "test.tsv"
    entries = [(w, refs) for w, refs in read_references(path) if w.isalpha() and w.isascii()]
    model = G2pEnGRU()
    for k in beams:
        hyps = []
        for i in range(0, len(entries), 200):
            batch = [w for w, _ in entries[i : i + 200]]
            result = model.pronounce(batch, num_beams=k)
            hyps += [phones(result, b) for b in range(len(batch))]
        s = score(hyps, [r for _, r in entries])
        name = "greedy" if k == 1 else f"beam {k}"
        print(f"{name}: {s.n} words, WER {s.wer:.2f}% (stress removed), {s.wer_stress:.2f}% (with stress), ", end="")
        print(f"PER {s.per:.2f}%")


def main(argv: list[str]) -> None:
    if argv == ["--eval"]:
        evaluate()
        return
    words = argv or ["hello", "beamsearch", "pronunciation", "gnocchi"]
    model = G2pEnGRU()
    result = model.pronounce(words, num_beams=5, num_return_sequences=3)
    for b, word in enumerate(words):
        for j in range(3):
            score = float(result.sequences_scores[b, j])
            print(f"{word:15} #{j + 1} {score:7.3f}  {' '.join(phones(result, b, j))}")


if __name__ == "__main__":
    main(sys.argv[1:])
