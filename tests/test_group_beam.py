"""Diverse (group) beam search (``num_beam_groups``, ``diversity_penalty``) against transformers 4.x.

transformers 5.x no longer ships group beam search, so the reference outputs were produced once with
transformers 4.46.3 and torch 2.13.0 (CPU, Python 3.11) by ``tests/data/make_group_beam_reference.py``::

    python3 -m venv /tmp/hf4 && /tmp/hf4/bin/pip install torch==2.13.0 "transformers==4.46.3"
    OMP_NUM_THREADS=1 /tmp/hf4/bin/python tests/data/make_group_beam_reference.py

which decoded with 4.x's ``model.generate(num_beams=, num_beam_groups=, diversity_penalty=,
num_return_sequences=, length_penalty=, early_stopping=, max_new_tokens=, output_scores=True,
return_dict_in_generate=True)`` and wrote ``tests/data/group_beam_reference.json``: 60 configurations of the
embedded G2P T5 on CMUdict test words (batches of 1-4 padded words; groups 2/3/4 with 2-12 beams, diversity
0.25-5, every ``early_stopping``, ``length_penalty`` in {-1, 0, 0.5, 1, 2}, some with n-gram blocking,
repetition penalty or ``min_new_tokens``) and 20 of a tiny random GPT-2 saved in ``tests/data/tiny_gpt2_group``
(left-padded prompts, four with two EOS ids). Both models are loaded from this repository's files by both
transformers versions; their logits agree to about 3e-6.

What is compared:

- ``sequences``: identical, token for token. Where several EOS ids are given, 4.x writes the first EOS id after
  a finished hypothesis whatever EOS token ended it; we keep the token that was chosen (mapped back for the
  comparison).
- ``sequences_scores``: within 1e-5, relative for scores beyond 1 in magnitude (with ``length_penalty=-1`` a
  score is the sum of log-probs times the length, so the 3e-6 logit differences between the two versions add
  up to ~1e-5 on scores near -100).
- ``beam_indices``: ours are the rows of the flat ``[B*K]`` batch (5.x's meaning, checked below against the
  per-step scores). 4.x numbered rows within the group (``b*S + j``) and, for hypotheses of groups after the
  first, looked their history up in the first group's records (and, with B > 1, finalized beams in another
  example's), so they are compared where 4.x's own bookkeeping is consistent: hypotheses of the first group of
  a batch of one, EOS-ended hypotheses of the first group, and beams finalized at the length limit in a batch
  of one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fakes import count_host_conversions
from numerics import assert_scores_close

import beamsearch
from beamsearch import SearchOptions, selection

DATA = Path(__file__).resolve().parent / "data"
REFERENCE = json.loads((DATA / "group_beam_reference.json").read_text(encoding="utf-8"))
RECORDS = REFERENCE["records"]


def test_reference_provenance():
    meta = REFERENCE["meta"]
    assert meta["transformers"].startswith("4.") and meta["torch"].startswith("2.13.0")
    assert len(RECORDS) >= 80
    shapes = {(r["case"]["num_beams"], r["case"]["num_beam_groups"]) for r in RECORDS}
    assert {g for _, g in shapes} == {2, 3, 4} and {4, 6, 8, 9} <= {k for k, _ in shapes}
    assert {r["case"]["early_stopping"] for r in RECORDS} == {True, False, "never"}
    assert any(len(r["case"]["input_ids"]) > 1 for r in RECORDS)


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    from beamsearch.cli.decoding import EMBEDDED_MODEL

    g2p = transformers.AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval()
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(DATA / "tiny_gpt2_group").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    return {"g2p": g2p, "tiny_gpt2": gpt2, "tokenizer": tokenizer}


def test_reference_inputs_are_the_tokenizers(models):
    for record in RECORDS:
        if record["model"] == "g2p":
            encoded = models["tokenizer"](record["case"]["words"], padding=True)
            assert encoded["input_ids"] == record["case"]["input_ids"]
            assert encoded["attention_mask"] == record["case"]["attention_mask"]


def _generate(models, record):
    case = {k: v for k, v in record["case"].items() if k not in ("words", "input_ids", "attention_mask")}
    inputs = torch.tensor(record["case"]["input_ids"])
    mask = torch.tensor(record["case"]["attention_mask"])
    # transformers 4.x knows nothing of the embedded model's loop guard and source-tied length limit (its
    # generation_config's beamsearch keys), so they are off here as they were for the reference
    out = beamsearch.generate(models[record["model"]], input_ids=inputs, attention_mask=mask, output_scores=True,
                              return_dict_in_generate=True, loop_guard=0, max_len_a=0.0, max_len_b=None, **case)
    return case, inputs, out


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("index", range(len(RECORDS)))
def test_matches_transformers_4(models, index, chunked, monkeypatch):
    """``chunked``: candidates chosen from 2-token chunk maxima (selection.py), the path large vocabularies take."""
    if chunked:
        monkeypatch.setattr(selection, "CHUNK", 2)
        monkeypatch.setattr(selection, "MIN_CHUNKS_PER_CANDIDATE", 1)
    record = RECORDS[index]
    case, inputs, out = _generate(models, record)
    expected = record["expected"]
    eos = case.get("eos_token_id", 1)
    eos = [eos] if isinstance(eos, int) else eos
    prompt = inputs.shape[1] if record["model"] == "tiny_gpt2" else 1
    generated = (out.beam_indices >= 0).sum(dim=1)  # [B*n]
    sequences = out.sequences.clone()
    ended = torch.zeros(len(sequences), dtype=torch.bool)
    for row, length in enumerate(generated.tolist()):
        last = prompt + length - 1
        ended[row] = int(sequences[row, last]) in eos
        if ended[row]:
            sequences[row, last] = eos[0]  # 4.x writes the first EOS id (see the module docstring)
    assert sequences.tolist() == expected["sequences"]
    assert_scores_close(out.sequences_scores, torch.tensor(expected["sequences_scores"]))
    # beam indices where 4.x's own bookkeeping is consistent, in its numbering within the group
    k, s = case["num_beams"], case["num_beams"] // case["num_beam_groups"]
    batch_size, compared = inputs.shape[0], 0
    for row, length in enumerate(generated.tolist()):
        ours = out.beam_indices[row, :length].tolist()
        first_group = (ours[-1] % k) // s == 0
        if (first_group and (ended[row] or batch_size == 1)) or (batch_size == 1 and not ended[row]):
            theirs = expected["beam_indices"][row]
            assert theirs[:length] == [(i // k) * s + i % s for i in ours]
            assert set(theirs[length:]) <= {-1}
            compared += 1
    assert compared >= 1 or batch_size > 1


@pytest.mark.parametrize("index", [0, 25, 41, 60, 75])
def test_beam_indices_point_at_the_scored_rows(models, index):
    """HF's transition scores: per-step scores at (beam index, token) sum to the hypothesis' score."""
    record = RECORDS[index]
    case, inputs, out = _generate(models, record)
    prompt = inputs.shape[1] if record["model"] == "tiny_gpt2" else 1
    k, n = case["num_beams"], case.get("num_return_sequences", 1)
    for row in range(out.sequences.shape[0]):
        indices = out.beam_indices[row]
        length = int((indices >= 0).sum())
        assert torch.all(indices[:length] // k == row // n)  # rows of the hypothesis' own example
        steps = [out.scores[t][indices[t], out.sequences[row, prompt + t]] for t in range(length)]
        penalised = torch.stack(steps).sum() / length ** case["length_penalty"]
        assert_scores_close(penalised, out.sequences_scores[row])


# ---- the model-agnostic core against an independent per-example reference ------------------------------------


def _reference(table, start, num_beams, groups, penalty, max_new_tokens, eos, length_penalty, early_stopping, n):
    """Group beam search for one example, written from the paper and 4.x's documented rules: plain lists.

    ``table`` ``[V, V, V]``: logits of the next token given the last two.
    """
    size, pad, vocab = num_beams // groups, eos, table.shape[-1]
    log_probs = torch.log_softmax(table, dim=-1)
    live = [[(list(start), 0.0 if j == 0 else -1.0e9) for j in range(size)] for _ in range(groups)]
    pools: list[list[tuple[float, list[int]]]] = [[] for _ in range(groups)]
    done = [False] * groups
    max_length = len(start) + max_new_tokens

    def add(pool, tokens, total):
        score = total / ((len(tokens) - len(start)) ** length_penalty)
        if len(pool) < size or score > min(p[0] for p in pool):
            pool.append((score, tokens))
            if len(pool) > size:
                pool.remove(min(pool, key=lambda p: p[0]))

    for length in range(len(start) + 1, max_length + 1):
        counts = torch.zeros(vocab)
        for g in range(groups):
            if done[g]:
                counts[pad] += size
                continue
            candidates = []
            for j, (tokens, total) in enumerate(live[g]):
                scores = log_probs[tokens[-2], tokens[-1]] - penalty * counts
                sums = (torch.tensor(total, dtype=torch.float32) + scores).tolist()
                candidates += [(sums[v], j * vocab + v, tokens + [v]) for v in range(vocab)]
            candidates.sort(key=lambda c: (-c[0], c[1]))
            candidates = candidates[: 2 * size]
            live[g] = []
            for rank, (total, _, tokens) in enumerate(candidates):
                if tokens[-1] == eos:
                    if rank < size:
                        add(pools[g], tokens, total)
                elif len(live[g]) < size:
                    live[g].append((tokens, total))
            for tokens, _ in live[g]:
                counts[tokens[-1]] += 1
            if len(pools[g]) >= size:
                if early_stopping is True:
                    done[g] = True
                else:
                    best_length = length - len(start)
                    if early_stopping == "never" and length_penalty > 0:
                        best_length = max_length - len(start)
                    done[g] = min(p[0] for p in pools[g]) >= candidates[0][0] / best_length**length_penalty
        if all(done):
            break
    for g in range(groups):
        if not done[g]:
            for tokens, total in live[g]:
                add(pools[g], tokens, total)
    ranked = sorted((p for pool in pools for p in pool), key=lambda p: -p[0])
    return ranked[:n]


@pytest.mark.parametrize("seed", range(24))
def test_search_core_matches_independent_reference(seed):
    """``search()`` with a plain step function (a second-order Markov table) against ``_reference``.

    Hypotheses with equal scores (a Markov table gives some) may come in either order, so each example's
    n-best list is compared as (score, tokens) pairs sorted by score, then tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = 7
    table = torch.randn(vocab, vocab, vocab, generator=generator) * 2.0
    groups = [2, 3, 2, 4][seed % 4]
    num_beams = groups * (1 + seed % 3)
    options = dict(num_beams=num_beams, num_beam_groups=groups, diversity_penalty=[0.5, 1.5, 5.0][seed % 3],
                   max_new_tokens=2 + seed % 6, eos_token_id=0, length_penalty=[1.0, 0.5, -1.0, 2.0][seed % 4],
                   early_stopping=[True, False, "never"][seed % 3], num_return_sequences=1 + seed % num_beams)
    starts = [[1 + (seed + i) % (vocab - 1), 1 + (seed * i) % (vocab - 1)] for i in range(3)]

    def step(tokens, state):
        return table[tokens[:, -2], tokens[:, -1]], state

    result = beamsearch.search(step, torch.tensor(starts), **options)
    for example, start in enumerate(starts):
        expected = _reference(table, start, num_beams, groups, options["diversity_penalty"],
                              options["max_new_tokens"], 0, options["length_penalty"], options["early_stopping"],
                              options["num_return_sequences"])
        ours = []
        for rank in range(options["num_return_sequences"]):
            length = int(result.lengths[example, rank])
            score = float(result.sequences_scores[example, rank])
            penalised = float(result.sum_log_probs[example, rank]) / (length - 2) ** options["length_penalty"]
            assert math.isclose(penalised, score, rel_tol=1e-5, abs_tol=1e-5)
            ours.append((round(score, 4), result.sequences[example, rank, :length].tolist()))
        assert sorted(ours) == sorted((round(score, 4), tokens) for score, tokens in expected)


def test_at_most_one_host_synchronisation_per_step(monkeypatch):
    """Tensor -> Python conversions during a search: one per step, one before the first, the final crop."""
    table = torch.randn(9, 9, generator=torch.Generator().manual_seed(0))
    steps = []

    def step(tokens, state):
        steps.append(tokens.shape[1])
        return table[tokens[:, -1]], state

    conversions = count_host_conversions(monkeypatch)
    beamsearch.search(step, torch.tensor([[1], [2]]), num_beams=6, num_beam_groups=3, diversity_penalty=1.0,
                      max_new_tokens=12, eos_token_id=0, no_repeat_ngram_size=2)
    monkeypatch.undo()
    assert len(steps) >= 2
    assert len(conversions) <= len(steps) + 2, (len(conversions), len(steps))


def test_groups_are_diverse_where_plain_groups_would_repeat():
    """With a large penalty, the first tokens of the groups' best hypotheses all differ."""
    table = torch.randn(12, 12, generator=torch.Generator().manual_seed(3))

    def step(tokens, state):
        return table[tokens[:, -1]], state

    result = beamsearch.search(step, torch.tensor([[5]]), num_beams=4, num_beam_groups=4, diversity_penalty=100.0,
                               num_return_sequences=4, max_new_tokens=3)
    assert len(set(result.sequences[0, :, 1].tolist())) == 4


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(num_beams=6, num_beam_groups=4, diversity_penalty=1.0), "divisible"),
        (dict(num_beams=1, num_beam_groups=2, diversity_penalty=1.0), "divisible"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.0), "diversity_penalty > 0"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=-1.0), "diversity_penalty must be >= 0"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty="1"), "diversity_penalty must be a number"),
        (dict(num_beams=4, diversity_penalty=1.0), "needs num_beam_groups > 1"),
        (dict(num_beams=4, num_beam_groups=0), "num_beam_groups must be an integer >= 1"),
        (dict(num_beams=4, num_beam_groups=2.0, diversity_penalty=1.0), "num_beam_groups must be an integer"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, do_sample=True), "do_sample"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, semantics="t2t"), "semantics='hf'"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, num_return_sequences=5), "num_return_sequences"),
    ],
)
def test_bad_values_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        SearchOptions.create(**options)


def test_hf_adapter_rejects_bad_values(models):
    inputs = torch.tensor(RECORDS[0]["case"]["input_ids"])
    with pytest.raises(ValueError, match="divisible"):
        beamsearch.generate(models["g2p"], input_ids=inputs, num_beams=6, num_beam_groups=4, diversity_penalty=1.0)
    with pytest.raises(ValueError, match="do_sample"):
        beamsearch.generate(models["g2p"], input_ids=inputs, num_beams=4, num_beam_groups=2, diversity_penalty=1.0,
                            do_sample=True)
