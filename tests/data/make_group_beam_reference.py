"""Write ``group_beam_reference.json``: diverse (group) beam search outputs of transformers 4.x, for the tests.

transformers 5.x moved group beam search out of its core, so the reference is transformers 4.x's own
``model.generate(num_beam_groups=..., diversity_penalty=...)``, run by hand in a separate virtual environment
(never in CI, where only transformers 5.x is installed)::

    python3 -m venv /tmp/hf4 && /tmp/hf4/bin/pip install torch==2.13.0 "transformers==4.46.3"
    OMP_NUM_THREADS=1 /tmp/hf4/bin/python tests/data/make_group_beam_reference.py

Two models, both loaded from files in this repository so that both transformers versions see the same
weights: the embedded G2P T5 (``src/beamsearch/models/g2p_cmudict``) on words of the CMUdict test split, and a
tiny random GPT-2 (``tests/data/tiny_gpt2_group/``, written by this script on its first run from a fixed seed)
on random left-padded prompts. For each configuration the JSON keeps the inputs, the generate kwargs and 4.x's
``sequences``, ``sequences_scores`` and ``beam_indices``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, GPT2Config, GPT2LMHeadModel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
G2P = ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict"
WORDS_FILE = ROOT / "src" / "beamsearch" / "data" / "cmudict" / "test.tsv"
TINY_GPT2 = HERE / "tiny_gpt2_group"
OUTPUT = HERE / "group_beam_reference.json"
GPT2_VOCAB = 40
# (num_beams, num_beam_groups): every valid pairing of groups 2/3/4 with beams 2-12 that the tests cover
SHAPES = [(2, 2), (4, 2), (6, 2), (8, 2), (3, 3), (6, 3), (9, 3), (4, 4), (8, 4), (12, 4)]


def make_tiny_gpt2() -> None:
    """A 2-layer GPT-2 (vocab 40) with an untied, peaked output head and a likely EOS, saved as safetensors."""
    config = GPT2Config(vocab_size=GPT2_VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                        eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(20240611)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.8)
        model.lm_head.weight[1] *= 1.3
    model.save_pretrained(TINY_GPT2, safe_serialization=True)


def g2p_inputs(words: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(G2P / "tokenizer.json"))
    ids = [tokenizer.encode(w).ids for w in words]
    width = max(len(x) for x in ids)
    return [x + [0] * (width - len(x)) for x in ids], [[1] * len(x) + [0] * (width - len(x)) for x in ids]


def gpt2_inputs(rng: random.Random, batch_size: int) -> tuple[list[list[int]], list[list[int]]]:
    lengths = [rng.randint(1, 6) for _ in range(batch_size)]
    width = max(lengths)
    ids = [[2] * (width - n) + [rng.randrange(3, GPT2_VOCAB) for _ in range(n)] for n in lengths]
    return ids, [[0] * (width - n) + [1] * n for n in lengths]


def g2p_cases(words: list[str]) -> list[dict]:
    """A fixed grid over shapes, penalties and stopping rules, then seeded random configurations."""
    cases = []
    for i, (beams, groups) in enumerate(SHAPES):
        for j, diversity in enumerate((0.5, 1.5, 5.0)):
            k = 3 * i + j
            cases.append({"words": [words[k % len(words)]], "num_beams": beams, "num_beam_groups": groups,
                          "diversity_penalty": diversity, "num_return_sequences": min(beams, 1 + k % 4),
                          "early_stopping": (True, False, "never")[k % 3], "length_penalty": 1.0,
                          "max_new_tokens": 32})
    rng = random.Random(7)
    for _ in range(30):
        beams, groups = rng.choice(SHAPES)
        size = rng.randint(1, 4)
        case = {"words": rng.sample(words, size), "num_beams": beams, "num_beam_groups": groups,
                "diversity_penalty": rng.choice([0.25, 0.5, 1.0, 1.5, 5.0]),
                "num_return_sequences": rng.randint(1, beams), "early_stopping": rng.choice([True, False, "never"]),
                "length_penalty": rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0]),
                "max_new_tokens": rng.choice([2, 4, 6, 10, 32])}
        if rng.random() < 0.2:
            case["no_repeat_ngram_size"] = rng.randint(1, 2)
        if rng.random() < 0.2:
            case["repetition_penalty"] = rng.choice([0.8, 1.5])
        if rng.random() < 0.2:
            case["min_new_tokens"] = rng.randint(1, 4)
        cases.append(case)
    return cases


def gpt2_cases() -> list[dict]:
    rng = random.Random(11)
    cases = []
    for n in range(20):
        beams, groups = rng.choice(SHAPES)
        ids, mask = gpt2_inputs(rng, rng.randint(1, 4))
        case = {"input_ids": ids, "attention_mask": mask, "num_beams": beams, "num_beam_groups": groups,
                "diversity_penalty": rng.choice([0.25, 0.5, 1.0, 1.5, 5.0]),
                "num_return_sequences": rng.randint(1, beams), "early_stopping": rng.choice([True, False, "never"]),
                "length_penalty": rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0]), "max_new_tokens": rng.randint(1, 10)}
        if n % 5 == 4:
            case["eos_token_id"] = [1, rng.randrange(3, GPT2_VOCAB)]  # several EOS ids (see the test module)
        cases.append(case)
    return cases


def run(model, case: dict) -> dict:
    kwargs = {k: v for k, v in case.items() if k not in ("words", "input_ids", "attention_mask")}
    out = model.generate(input_ids=torch.tensor(case["input_ids"]), attention_mask=torch.tensor(case["attention_mask"]),
                         output_scores=True, return_dict_in_generate=True, **kwargs)
    return {"sequences": out.sequences.tolist(), "sequences_scores": out.sequences_scores.tolist(),
            "beam_indices": out.beam_indices.tolist()}


def main() -> None:
    torch.set_num_threads(1)
    if not (TINY_GPT2 / "model.safetensors").exists():
        make_tiny_gpt2()
    lines = WORDS_FILE.read_text(encoding="utf-8").splitlines()
    words = [line.split("\t")[0] for line in lines[::97] if line.split("\t")[0].isalpha()][:20]
    records = []
    g2p = AutoModelForSeq2SeqLM.from_pretrained(G2P).eval()
    for case in g2p_cases(words):
        case["input_ids"], case["attention_mask"] = g2p_inputs(case["words"])
        records.append({"model": "g2p", "case": case, "expected": run(g2p, case)})
    gpt2 = AutoModelForCausalLM.from_pretrained(TINY_GPT2).eval()
    for case in gpt2_cases():
        records.append({"model": "tiny_gpt2", "case": case, "expected": run(gpt2, case)})
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
            "command": "OMP_NUM_THREADS=1 /tmp/hf4/bin/python tests/data/make_group_beam_reference.py"}
    OUTPUT.write_text(json.dumps({"meta": meta, "records": records}, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {len(records)} configurations to {OUTPUT}")


if __name__ == "__main__":
    main()
