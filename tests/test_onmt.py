"""semantics="onmt" against OpenNMT-py's own BeamSearch, fed the same log-probs and attention.

OpenNMT-py 3.5.1 is installed without its dependencies; its package ``__init__`` files import much
more than the beam search needs (spaCy, ...), so the four modules the beam search consists of
(``utils/misc.py``, ``translate/penalties.py``, ``translate/decode_strategy.py``,
``translate/beam_search.py``) are loaded straight from the installed files under bare parent
packages. The code that runs is OpenNMT's, unchanged.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from fakes import PrefixModel
from numerics import assert_scores_close

import beamsearch

EOS, START, SOURCE_LENGTH = 0, 1, 6
pytestmark = pytest.mark.filterwarnings("ignore:Using length penalty with alpha==0")


def load_onmt():
    """OpenNMT-py's beam search modules, and a function that removes them from ``sys.modules`` again."""
    spec = importlib.util.find_spec("onmt")
    if spec is None:
        pytest.skip("opennmt-py is not installed (the Makefile installs it)")
    root = Path(next(iter(spec.submodule_search_locations)))
    saved = {name: sys.modules.get(name) for name in ("onmt", "onmt.utils", "onmt.translate")}
    loaded = []

    def restore():
        for full in loaded:
            sys.modules.pop(full, None)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

    try:
        for name, folder in (("onmt", root), ("onmt.utils", root / "utils"), ("onmt.translate", root / "translate")):
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]
            sys.modules[name] = package
        for name in ("utils.misc", "translate.penalties", "translate.decode_strategy", "translate.beam_search"):
            full = f"onmt.{name}"
            module_spec = importlib.util.spec_from_file_location(full, root / (name.replace(".", "/") + ".py"))
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[full] = module
            loaded.append(full)
            module_spec.loader.exec_module(module)
    except BaseException:
        restore()
        raise
    return sys.modules["onmt.translate.beam_search"], restore


@pytest.fixture(scope="module")
def onmt():
    module, restore = load_onmt()
    yield module
    restore()


class ToyModel:
    """Logits and an attention over SOURCE_LENGTH positions, functions of the example and the whole prefix.

    The state is each row's example number ``{"example": LongTensor [N]}`` (the engine reorders it).
    """

    def __init__(self, vocab: int, seed: int):
        self.logits = PrefixModel(vocab, seed=seed, sharpness=2.5)
        self.attention = PrefixModel(SOURCE_LENGTH, seed=seed + 1000, sharpness=1.5)

    def step(self, tokens, state):
        keyed = torch.cat((50 + state["example"][:, None], tokens), dim=1)
        return self.logits.logits_for(keyed), state, torch.softmax(self.attention.logits_for(keyed), dim=-1)


def run_onmt(onmt, model, case):
    b, k = case["batch"], case["beams"]
    scorer = onmt.GNMTGlobalScorer(case["alpha"], case["beta"], case["lp"], case["cov"])
    max_length = case["max_length"]
    if case["max_length_ratio"] > 0:  # the Translator's source-tied limit (translate_batch)
        max_length = int(min(max_length, SOURCE_LENGTH * case["max_length_ratio"] + 5))
    search = onmt.BeamSearch(
        k,
        b,
        pad=-1,
        bos=START,
        eos=EOS,
        unk=-2,
        start=START,
        n_best=case["n_best"],
        global_scorer=scorer,
        min_length=case["min_length"],
        max_length=max_length,
        return_attention=False,
        block_ngram_repeat=case["ngram"],
        exclusion_tokens=set(case["exclude"]),
        stepwise_penalty=case["stepwise"],
        ratio=case["ratio"],
        ban_unk_token=False,
    )
    search.initialize(torch.zeros(b, SOURCE_LENGTH, 4), torch.full((b,), SOURCE_LENGTH))
    for _ in range(max_length):
        tokens = search.alive_seq
        examples = search._batch_offset.repeat_interleave(k)  # the rows of the examples still searched
        logits, _, attention = model.step(tokens, {"example": examples})
        search.advance(torch.log_softmax(logits, dim=-1), attention[:, None, :])
        if any(any(row) for row in search.is_finished_list):
            search.update_finished()
            if search.done:
                break
    return [[p.tolist() for p in preds] for preds in search.predictions], [
        [float(s) for s in scores] for scores in search.scores
    ]


def run_ours(model, case):
    b = case["batch"]
    options = dict(
        semantics="onmt",
        num_beams=case["beams"],
        num_return_sequences=case["n_best"],
        eos_token_id=EOS,
        max_new_tokens=case["max_length"],
        length_penalty=case["alpha"],
        length_penalty_type=case["lp"],
        coverage_penalty=case["cov"],
        coverage_beta=case["beta"],
        stepwise_penalty=case["stepwise"],
        ratio=case["ratio"],
        block_ngram_repeat=case["ngram"],
        ignore_when_blocking=case["exclude"],
        max_length_ratio=case["max_length_ratio"],
    )
    if case["min_length"]:
        options["min_new_tokens"] = case["min_length"]
    return beamsearch.search(
        model.step,
        torch.full((b, 1), START),
        {"example": torch.arange(b)},
        source_lengths=torch.full((b,), SOURCE_LENGTH),
        **options,
    )


def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    beams = rng.randint(1, 5)
    cov = rng.choice(["none", "none", "wu", "summary"])
    ngram = rng.choice([0, 0, 2, 3])
    return {
        "seed": seed,
        "vocab": rng.choice([8, 12, 20]),
        # with n-gram blocking OpenNMT mixes up examples of a batch (see strategies/onmt.py): one at a time
        "batch": 1 if ngram or rng.random() < 0.3 else rng.randint(2, 3),
        "beams": max(beams, 2),
        "n_best": rng.randint(1, max(beams, 2)),
        "alpha": rng.choice([0.0, 0.6, 1.0, 2.0]),
        "lp": rng.choice(["avg", "wu", "none"]),
        "cov": cov,
        "beta": rng.choice([0.2, 1.0]) if cov != "none" else 0.0,
        "stepwise": cov != "none" and rng.random() < 0.5,
        "min_length": rng.choice([0, 0, 2]),
        "max_length": rng.randint(3, 12),
        "ngram": ngram,
        "exclude": tuple(rng.sample(range(2, 8), rng.randint(0, 2))) if ngram else (),
        "ratio": rng.choice([0.0, 0.0, 0.0, 1.5]),
        "max_length_ratio": rng.choice([0.0, 0.0, 0.2, 0.5, 1.25]),
    }


@pytest.mark.parametrize("seed", range(120))
def test_matches_opennmt(onmt, seed):
    case = random_case(seed)
    model = ToyModel(case["vocab"], seed)
    preds, scores = run_onmt(onmt, model, case)
    result = run_ours(model, case)
    for b in range(case["batch"]):
        assert len(preds[b]) == case["n_best"]
        for j in range(case["n_best"]):
            length = int(result.lengths[b, j])
            assert result.sequences[b, j, 1:length].tolist() == preds[b][j], (case, b, j)
            assert float(result.sequences_scores[b, j]) == pytest.approx(scores[b][j], rel=1e-5, abs=1e-5)


def test_cases_exercise_every_option(onmt):
    cases = [random_case(s) for s in range(120)]
    assert {c["cov"] for c in cases} == {"none", "wu", "summary"}
    assert {c["lp"] for c in cases} == {"avg", "wu", "none"}
    assert any(c["stepwise"] for c in cases) and any(c["ratio"] for c in cases)
    assert any(c["max_length_ratio"] and SOURCE_LENGTH * c["max_length_ratio"] + 5 < c["max_length"] for c in cases)
    assert any(c["ngram"] and c["exclude"] for c in cases) and any(c["batch"] > 1 for c in cases)
    # blocking changes results in some cases (the comparison above is not vacuous)
    changed = 0
    for c in cases:
        if c["ngram"]:
            model = ToyModel(c["vocab"], c["seed"])
            changed += run_ours(model, c).sequences.tolist() != run_ours(model, {**c, "ngram": 0}).sequences.tolist()
    assert changed >= 3


def test_opennmt_defaults_and_errors():
    o = beamsearch.SearchOptions.create(semantics="onmt", eos_token_id=0)
    assert (o.num_beams, o.length_penalty, o.length_penalty_type, o.max_new_tokens) == (5, 1.0, "avg", 250)
    assert o.max_length_ratio == 1.25
    with pytest.raises(ValueError, match="max_length_ratio needs the source lengths"):
        beamsearch.search(PrefixModel(5), torch.ones(1, 1, dtype=torch.long), semantics="onmt", eos_token_id=0)
    with pytest.raises(ValueError, match="needs eos_token_id"):
        beamsearch.search(PrefixModel(5), torch.ones(1, 1, dtype=torch.long), semantics="onmt", num_beams=2)
    model = ToyModel(6, 0)
    with pytest.raises(ValueError, match="coverage_penalty needs the step function to return"):
        beamsearch.search(
            lambda t, s: model.step(t, s)[:2],
            torch.ones(1, 1, dtype=torch.long),
            {"example": torch.zeros(1, dtype=torch.long)},
            semantics="onmt",
            num_beams=2,
            eos_token_id=0,
            coverage_penalty="wu",
            coverage_beta=1.0,
            max_length_ratio=0,
        )


def test_coverage_through_the_hugging_face_adapter():
    """The adapter hands the last layer's cross-attention (heads averaged) to the coverage penalty."""
    pytest.importorskip("transformers")
    from tiny_hf import tiny_model

    from beamsearch.adapters.hf import search_model

    model = tiny_model("t5")
    source = torch.randint(2, 40, (2, 7))
    common = dict(input_ids=source, semantics="onmt", num_beams=3, max_new_tokens=8, length_penalty_type="none")
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        search_model(model, coverage_penalty="wu", coverage_beta=1.0, **common)
    model.set_attn_implementation("eager")
    plain = search_model(model, **common)
    covered = search_model(model, coverage_penalty="summary", coverage_beta=0.0, stepwise_penalty=True, **common)
    assert torch.equal(plain.sequences, covered.sequences)  # beta 0: the attention plumbing changes nothing
    wu = search_model(model, coverage_penalty="wu", coverage_beta=5.0, **common)
    # no length penalty: score = sum of log-probs - coverage penalty, and wu's penalty is > 0 here
    assert (wu.sequences_scores < wu.sum_log_probs - 1e-3).all()
    assert_scores_close(plain.sequences_scores, plain.sum_log_probs)
