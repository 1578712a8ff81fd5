"""Ensemble folders (``--model DIR`` whose ``ensemble.json`` lists model directories): decoded as
``search_ensemble`` decodes the members, the file's mode unless ``--ensemble-mode`` says otherwise, and every
malformed folder refused by name before a model is loaded."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

from beamsearch.adapters.hf_ensemble import search_ensemble  # noqa: E402
from beamsearch.cli import main  # noqa: E402
from beamsearch.cli.decoding import EMBEDDED_MODEL, add_ensemble, load_model  # noqa: E402

WORDS = ["hello", "ensemble", "quixotic", "phonetisaurus"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """ens/ with members a (the embedded model) and b (a perturbed copy), in probability mode."""
    root = tmp_path_factory.mktemp("ens")
    shutil.copytree(EMBEDDED_MODEL, root / "a")
    other = AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    other.save_pretrained(root / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, root / "b" / name)
    (root / "ensemble.json").write_text(json.dumps({"members": ["a", "b"], "mode": "prob"}))
    return root


def reference(folder, mode: str, num_beams: int) -> tuple[list[str], list[float]]:
    """search_ensemble on the members: each word's best text and score (one word at a time, as the CLI's batches
    of words of one length may differ in padding)."""
    tok = AutoTokenizer.from_pretrained(folder / "a")
    models = [AutoModelForSeq2SeqLM.from_pretrained(folder / name).eval() for name in ("a", "b")]
    texts, scores = [], []
    for word in WORDS:
        result = search_ensemble(models, **tok([word], return_tensors="pt"), num_beams=num_beams, mode=mode)
        texts.append(tok.decode(result.sequences[0, 0, : int(result.lengths[0, 0])], skip_special_tokens=True))
        scores.append(float(result.sequences_scores[0, 0]))
    return texts, scores


def decoded(tmp_path, capsys, *flags: str) -> tuple[list[str], list[float]]:
    source = tmp_path / "in.txt"
    source.write_text("".join(w + "\n" for w in WORDS))
    assert main(["decode", str(source), "--quiet", "--format", "jsonl", "--batch-size", "1", *flags]) == 0
    best = [json.loads(line)["hypotheses"][0] for line in capsys.readouterr().out.splitlines()]
    return [h["text"] for h in best], [h["score"] for h in best]


@pytest.mark.parametrize(("flags", "mode"), [((), "prob"), (("--ensemble-mode", "log"), "log")])
def test_an_ensemble_folder_decodes_its_members_together(folder, tmp_path, capsys, flags, mode):
    """The file's mode (prob), or --ensemble-mode's: what search_ensemble gives for the members (the two modes give
    other scores, so the score tells which one ran), and what --model a --ensemble b gives."""
    texts, scores = decoded(tmp_path, capsys, "--model", str(folder), "--num-beams", "3", *flags)
    want_texts, want_scores = reference(folder, mode, 3)
    assert texts == [t.strip() for t in want_texts]
    assert scores == pytest.approx(want_scores, rel=1e-5, abs=1e-6)
    other_texts, other_scores = reference(folder, {"prob": "log", "log": "prob"}[mode], 3)
    assert max(abs(a - b) for a, b in zip(scores, other_scores, strict=True)) > 1e-3  # 0.018 here, the mode's mark
    assert (texts, scores) == decoded(tmp_path, capsys, "--model", str(folder / "a"), "--ensemble",
                                      str(folder / "b"), "--ensemble-mode", mode, "--num-beams", "3")


def test_the_folder_sets_the_mode_and_the_flag_overrides_it(folder):
    m = load_model(str(folder), "cpu", None)
    assert (len(m.ensemble), m.ensemble_mode, m.lowercase) == (1, "prob", False)
    add_ensemble(m, argparse.Namespace(ensemble=[], ensemble_mode=None, device="cpu", int8=False))
    assert m.ensemble_mode == "prob"
    add_ensemble(m, argparse.Namespace(ensemble=[], ensemble_mode="log", device="cpu", int8=False))
    assert m.ensemble_mode == "log"
    plain = load_model(str(folder / "a"), "cpu", None)
    assert (plain.ensemble, plain.ensemble_mode) == ([], "log")


def test_eval_takes_an_ensemble_folder(folder, capsys):
    def rows(*flags: str) -> list[str]:
        assert main(["eval", "--limit", "30", "--beams", "1", "3", "--lowercase", "--quiet", *flags]) == 0
        return [line.split("|")[1:5] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]

    together = rows("--model", str(folder))
    assert together == rows("--model", str(folder / "a"), "--ensemble", str(folder / "b"), "--ensemble-mode", "prob")
    assert len(together) == 2


BAD_FILES = [
    ("not json", "ensemble.json cannot be read (JSONDecodeError"),
    ("[]", "ensemble.json must be a JSON object"),
    ('{"members": []}', "'members' must be a non-empty list of model folders, got []"),
    ('{"members": ["a", 3]}', "'members' must be a non-empty list of model folders, got ['a', 3]"),
    ('{"members": ["a"], "mode": "mean"}', "'mode' must be 'log' or 'prob', got 'mean'"),
    ('{"members": ["a"], "weights": [1]}', "unknown key 'weights' (it takes 'members' and 'mode')"),
    ('{"members": ["missing"]}', "its member {root}/missing: not a directory"),
    ('{"members": ["inner"]}', "the member 'inner' is an ensemble folder itself"),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
def test_a_malformed_ensemble_folder_is_refused_by_name(tmp_path, capsys, text, message):
    root = tmp_path / "ens"
    (root / "inner").mkdir(parents=True)
    (root / "inner" / "ensemble.json").write_text('{"members": ["x"]}')
    (root / "ensemble.json").write_text(text)
    source = tmp_path / "in.txt"
    source.write_text("hello\n")
    assert main(["decode", str(source), "--model", str(root)]) == 2
    err = capsys.readouterr().err
    assert f"--model {root}" in err and message.format(root=root) in err


def test_a_folder_that_is_a_model_and_an_ensemble_is_refused(tmp_path, capsys):
    root = tmp_path / "both"
    shutil.copytree(EMBEDDED_MODEL, root)
    (root / "ensemble.json").write_text('{"members": ["."]}')
    assert main(["decode", "-", "--model", str(root)]) == 2
    assert "holds both config.json and ensemble.json" in capsys.readouterr().err


def test_a_member_with_another_vocabulary_is_refused(folder, tmp_path, capsys):
    from tokenizers import Tokenizer, models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    root = tmp_path / "mixed"
    root.mkdir()
    GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=16, n_layer=1, n_head=2)).save_pretrained(root / "lm")
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<pad>": 1}, unk_token="a")),
                            pad_token="<pad>").save_pretrained(root / "lm")
    (root / "ensemble.json").write_text(json.dumps({"members": [str(folder / "a"), "lm"]}))
    assert main(["decode", "-", "--model", str(root)]) == 2
    assert f"--model {root}: its member {root / 'lm'}: its tokenizer differs" in capsys.readouterr().err


def test_an_ensemble_folder_is_not_an_ensemble_member_or_a_trace(folder, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("hello\n")
    assert main(["decode", str(source), "--ensemble", str(folder)]) == 2
    assert f"--ensemble {folder}: an ensemble folder (ensemble.json); give it as --model" in capsys.readouterr().err
    assert main(["trace", "hello", "--model", str(folder)]) == 2
    assert f"--model {folder} is an ensemble of 2 (trace one of its members)" in capsys.readouterr().err


def test_ensemble_members_load_with_the_attention_that_alignments_need(folder, tmp_path, capsys):
    """--alignments (and coverage penalties) average every member's attention, so --ensemble members load with eager
    attention as the main model does: the alignment is search_ensemble's on eagerly loaded members."""
    source = tmp_path / "in.txt"
    source.write_text("hello\n")
    flags = ["--model", str(folder / "a"), "--ensemble", str(folder / "b"), "--num-beams", "3"]
    assert main(["decode", str(source), "--quiet", "--format", "jsonl", "--alignments", *flags]) == 0
    best = json.loads(capsys.readouterr().out)["hypotheses"][0]
    tok = AutoTokenizer.from_pretrained(folder / "a")
    models = [AutoModelForSeq2SeqLM.from_pretrained(folder / name, attn_implementation="eager").eval()
              for name in ("a", "b")]
    result = search_ensemble(models, **tok(["hello"], return_tensors="pt"), num_beams=3, output_alignments=True)
    generated = result.sequences[0, 0, 1 : int(result.lengths[0, 0])].tolist()  # after the decoder start token
    assert best["tokens"] == generated
    expected = result.alignments[0, 0, : len(generated)]
    assert torch.allclose(torch.tensor(best["alignment"]), expected, atol=1e-5)
    assert torch.allclose(expected.sum(-1), torch.ones(len(generated)), atol=1e-4)  # rows sum to 1 over the source
