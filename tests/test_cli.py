"""The command line: decode and eval through main(argv), once as a subprocess.

References come from transformers' own ``model.generate`` on the same embedded model.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import assert_scores_close, score_tolerance

import beamsearch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

from beamsearch.cli import main  # noqa: E402
from beamsearch.cli.decoding import EMBEDDED_MODEL  # noqa: E402
from beamsearch.evaluation import read_references  # noqa: E402

WORDS = ["hello", "beam", "search", "a", "pronunciation", "internationalization", "cat", "dog's"]


@pytest.fixture(scope="module")
def g2p():
    return AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval(), AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


def hf_nbest(g2p, words, **kwargs):
    """(text, score) n-best lists from model.generate, one input at a time."""
    model, tok = g2p
    out = []
    for w in words:
        enc = tok([w], return_tensors="pt")
        gen = model.generate(**enc, return_dict_in_generate=True, output_scores=True, **kwargs)
        texts = [tok.decode(s, skip_special_tokens=True).strip() for s in gen.sequences]
        out.append((texts, getattr(gen, "sequences_scores", None)))
    return out


def write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(p)


def test_decode_text_matches_generate_in_input_order(g2p, tmp_path, capsys):
    f = write(tmp_path, "in.txt", WORDS)
    assert main(["decode", f, "--batch-size", "3", "--num-beams", "4", "-q"]) == 0
    got = capsys.readouterr().out.splitlines()
    want = [texts[0] for texts, _ in hf_nbest(g2p, WORDS, num_beams=4)]
    assert got == want


def test_decode_tsv_nbest_scores_match_generate(g2p, tmp_path, capsys):
    f = write(tmp_path, "in.txt", WORDS[:4])
    args = [
        "decode",
        f,
        "--num-beams",
        "5",
        "--num-return-sequences",
        "3",
        "--length-penalty",
        "0.5",
        "--format",
        "tsv",
    ]
    assert main(args) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    ref = hf_nbest(g2p, WORDS[:4], num_beams=5, num_return_sequences=3, length_penalty=0.5)
    assert len(rows) == 12
    for i, (texts, scores) in enumerate(ref):
        for r in range(3):
            index, word, rank, sc, text, finish = rows[3 * i + r]
            assert (int(index), word, int(rank), text, finish) == (i + 1, WORDS[i], r + 1, texts[r], "eos")
            assert float(sc) == pytest.approx(float(scores[r]), abs=1e-5)


def test_decode_jsonl_fields(g2p, tmp_path, capsys):
    f = write(tmp_path, "in.txt", ["cat", "", "dog"])
    assert main(["decode", f, "--format", "jsonl", "--num-beams", "2", "--num-return-sequences", "2"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in recs] == [1, 2, 3]
    assert recs[1] == {"index": 2, "source": f + ":2", "input": "", "hypotheses": []}
    model, tok = g2p
    for rec in (recs[0], recs[2]):
        assert len(rec["hypotheses"]) == 2
        for h in rec["hypotheses"]:
            assert h["finish_reason"] == "eos" and h["tokens"][-1] == tok.eos_token_id
            assert len(h["token_log_probs"]) == len(h["tokens"])
            assert sum(h["token_log_probs"]) == pytest.approx(h["sum_log_probs"], abs=1e-4)
            assert h["text"] == tok.decode(h["tokens"], skip_special_tokens=True).strip()
            # default length_penalty 1.0: score = sum of log-probs / generated length (HF beam scoring)
            assert h["score"] == pytest.approx(h["sum_log_probs"] / len(h["tokens"]), abs=1e-5)


def test_empty_lines_unknown_characters_and_uppercase(tmp_path, capsys):
    f = write(tmp_path, "in.txt", ["", "HELLO", "héllo", "   "])
    assert main(["decode", f]) == 0
    cap = capsys.readouterr()
    out = cap.out.splitlines()
    assert len(out) == 4 and out[0] == "" and out[3] == ""
    assert out[1] != ""  # lowercased for the embedded model
    assert f"{f}:3: 'é' not in the model's vocabulary; encoded as <unk>" in cap.err
    assert cap.err.count("warning") == 1


def test_overlong_inputs(tmp_path, capsys):
    f = write(tmp_path, "in.txt", ["cat", "pronunciation", "antidisestablishmentarianism"])
    assert main(["decode", f, "--max-input-length", "6"]) == 0
    cap = capsys.readouterr()
    # one warning counts them: "pronunciation" is 13 letters + EOS, the long word 28 + EOS
    assert cap.err.count("warning") == 1
    assert f"2 input(s) over 6 tokens truncated (first: {f}:2, 14 tokens)" in cap.err
    assert len(cap.out.splitlines()) == 3
    assert main(["decode", f, "--max-input-length", "6", "--on-long", "skip"]) == 0
    cap = capsys.readouterr()
    assert cap.out.splitlines()[1:] == ["", ""] and "2 input(s) over 6 tokens left empty" in cap.err
    assert main(["decode", f, "--max-input-length", "6", "--on-long", "error"]) == 2
    assert f"{f}:2: 14 tokens, over the input limit of 6" in capsys.readouterr().err
    # the model's own limit (64 tokens) bounds the flag, so a huge line cannot take unbounded memory
    assert main(["decode", f, "--max-input-length", "100000"]) == 2
    assert "--max-input-length 100000 is over the model's limit of 64 tokens" in capsys.readouterr().err
    huge = write(tmp_path, "huge.txt", ["a" * 1_000_000, "cat"])
    assert main(["decode", huge, "--quiet"]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.splitlines()) == 2 and "1 input(s) over 64 tokens truncated" in cap.err


def test_invalid_utf8_keeps_what_was_written(tmp_path, capsys):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"cat\ndog\nca\xfft\nbird\n")
    out = tmp_path / "out.txt"
    assert main(["decode", str(p), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{p}:3: invalid UTF-8" in err
    assert not out.exists()  # incomplete: the records so far stay in the partial file, for --resume
    assert len((tmp_path / "out.txt.partial").read_text().splitlines()) == 2


def test_file_errors_lose_nothing(tmp_path, capsys):
    out = tmp_path / "out.txt"
    out.write_text("precious\n")
    f = write(tmp_path, "in.txt", ["cat"])
    assert main(["decode", str(tmp_path / "missing.txt"), "--output", str(out), "--overwrite"]) == 2
    assert "missing.txt: no such file" in capsys.readouterr().err
    assert main(["decode", str(tmp_path), "-q"]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["decode", f, "--output", str(out)]) == 2
    assert "exists; use --overwrite" in capsys.readouterr().err
    assert out.read_text() == "precious\n"
    assert main(["decode", f, "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["decode", f, "--num-beams", "2", "--num-return-sequences", "3"]) == 2
    assert "num_return_sequences" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]


def interrupted_run(monkeypatch, args: list[str], after_batches: int) -> None:
    """Run ``main(args)`` and interrupt it (Ctrl-C) when a batch starts after ``after_batches`` batches."""
    from beamsearch.cli import decoding

    original, calls = decoding.decode_batch, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) > after_batches:
            raise KeyboardInterrupt
        return original(*a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(decoding, "decode_batch", failing)
        assert main(args) == 130


@pytest.mark.parametrize("fmt", ["text", "tsv", "jsonl"])
def test_resume_after_interruption(tmp_path, fmt, capsys, monkeypatch):
    f = write(tmp_path, "in.txt", WORDS)
    full = tmp_path / "full"
    args = ["decode", f, "--format", fmt, "--num-beams", "3", "--num-return-sequences", "2", "--batch-size", "2"]
    assert main([*args, "--output", str(full)]) == 0
    data = full.read_bytes()
    part = tmp_path / "part"
    interrupted_run(monkeypatch, [*args, "--output", str(part)], after_batches=2)
    partial = tmp_path / "part.partial"
    assert not part.exists() and (tmp_path / "part.resume.json").exists()
    written = partial.read_bytes()
    assert 0 < len(written) < len(data) and data.startswith(written[: len(written) // 2])
    # as if killed in the middle of writing a record: half of the last line
    partial.write_bytes(written[: -max(1, len(written.splitlines()[-1]) // 2)])
    assert main([*args, "--output", str(part), "--resume"]) == 0
    assert not partial.exists() and (tmp_path / "part.resume.json").exists()  # the complete output's fingerprint
    # the resumed inputs are batched differently: scores may differ in the last float digits
    assert_same_records(part.read_text(), data.decode(), fmt)
    # resuming a finished output changes nothing
    before = part.read_text()
    assert main([*args, "--output", str(part), "--resume"]) == 0
    assert part.read_text() == before and "nothing to resume" in capsys.readouterr().err


def assert_same_records(got: str, want: str, fmt: str) -> None:
    if fmt == "text":
        assert got == want
    elif fmt == "tsv":
        g, w = [r.split("\t") for r in got.splitlines()], [r.split("\t") for r in want.splitlines()]
        assert [r[:3] + r[4:] for r in g] == [r[:3] + r[4:] for r in w]
        assert [float(r[3]) for r in g] == pytest.approx([float(r[3]) for r in w], abs=1e-5)
    else:
        g, w = [json.loads(r) for r in got.splitlines()], [json.loads(r) for r in want.splitlines()]
        assert len(g) == len(w)
        for a, b in zip(g, w, strict=True):
            assert [(h["text"], h["tokens"], h["finish_reason"]) for h in a["hypotheses"]] == [
                (h["text"], h["tokens"], h["finish_reason"]) for h in b["hypotheses"]
            ]
            for ha, hb in zip(a["hypotheses"], b["hypotheses"], strict=True):
                assert ha["score"] == pytest.approx(hb["score"], abs=1e-5)
                assert ha["token_log_probs"] == pytest.approx(hb["token_log_probs"], abs=1e-5)


def test_resume_refuses_another_input_or_options(tmp_path, capsys, monkeypatch):
    f = write(tmp_path, "in.txt", WORDS)
    out = str(tmp_path / "out.tsv")
    args = ["decode", f, "--format", "tsv", "--batch-size", "2", "--output", out]
    interrupted_run(monkeypatch, args, after_batches=1)
    capsys.readouterr()
    before = (tmp_path / "out.tsv.partial").read_bytes()
    other = write(tmp_path, "in.txt", [*WORDS, "extra"])  # the same file name, other contents
    assert main([*args, "--resume"]) == 2
    assert "the input files differ from the interrupted run's" in capsys.readouterr().err
    write(tmp_path, "in.txt", WORDS)
    assert main([*args, "--num-beams", "4", "--resume"]) == 2
    assert "options differ from the interrupted run's (--num-beams None -> 4)" in capsys.readouterr().err
    assert main(["decode", f, "--format", "jsonl", "--batch-size", "2", "--output", out, "--resume"]) == 2
    assert "--format 'tsv' -> 'jsonl'" in capsys.readouterr().err
    assert (tmp_path / "out.tsv.partial").read_bytes() == before  # refused: nothing touched
    assert main(args) == 2
    assert "an interrupted run left out.tsv.partial" in capsys.readouterr().err
    (tmp_path / "out.tsv.partial").write_text("not a record\n")
    assert main([*args, "--resume"]) == 2
    assert "is not a line of --format tsv output" in capsys.readouterr().err
    (tmp_path / "out.tsv.resume.json").unlink()
    assert main([*args, "--resume"]) == 2
    assert "cannot be checked against this run" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    assert len(Path(out).read_text().splitlines()) == len(WORDS) and other


def test_overwrite_keeps_the_old_file_until_the_new_one_is_complete(tmp_path, capsys, monkeypatch):
    f = write(tmp_path, "in.txt", WORDS)
    out = tmp_path / "out.txt"
    out.write_text("precious\n" * 15000)
    interrupted_run(monkeypatch, ["decode", f, "--batch-size", "2", "--output", str(out), "--overwrite"], 1)
    assert out.read_text() == "precious\n" * 15000
    assert main(["decode", f, "--output", str(out), "--overwrite", "--model", str(tmp_path / "none")]) == 2
    assert out.read_text() == "precious\n" * 15000
    assert main(["decode", f, "--output", str(out), "--overwrite"]) == 0
    assert len(out.read_text().splitlines()) == len(WORDS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt", "out.txt.resume.json"]


def test_sampling_is_seeded(tmp_path, capsys):
    f = write(tmp_path, "in.txt", WORDS)
    args = ["decode", f, "--do-sample", "--temperature", "1.5", "--top-k", "20", "--seed", "7"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_batch_by_tokens_gives_the_same_output(tmp_path, capsys):
    f = write(tmp_path, "in.txt", WORDS)
    assert main(["decode", f, "--num-beams", "3"]) == 0
    by_sentences = capsys.readouterr().out
    assert main(["decode", f, "--num-beams", "3", "--batch-type", "tokens", "--batch-size", "20"]) == 0
    assert capsys.readouterr().out == by_sentences


def test_causal_lm_directory(tmp_path, capsys):
    """--model with a decoder-only model: the continuation of each prompt, as model.generate gives it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=64, eos_token_id=1, pad_token_id=0)
    model = GPT2LMHeadModel(config)
    folder = tmp_path / "lm"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, folder / name)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    lm = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = ["ab", "hello there", "z"]
    f = write(tmp_path, "in.txt", prompts)
    assert main(["decode", f, "--model", str(folder), "--num-beams", "2", "--max-new-tokens", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    marked = [line.split("\t")[1] for line in lines if "\t" in line]  # a random model rarely ends by itself
    assert marked and set(marked) == {"[unfinished: max_length]"}
    got = [line.split("\t")[0] for line in lines]
    enc = tok(prompts, return_tensors="pt", padding=True)
    gen = lm.generate(**enc, num_beams=2, max_new_tokens=5)
    want = [tok.decode(s[enc["input_ids"].shape[1] :], skip_special_tokens=True).strip() for s in gen]
    assert got == want


def expected_table_row(hyps: list[list[str]], entries) -> list[str]:
    """WER, WER with stress and PER cells computed here, independently of ``evaluation.score`` (the function the
    eval command uses): exact-match counts and a memoised recursive edit distance."""
    import functools

    def distance(a: tuple, b: tuple) -> int:
        @functools.cache
        def d(i: int, j: int) -> int:
            if i == 0 or j == 0:
                return i + j
            return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

        return d(len(a), len(b))

    def unstressed(tokens) -> list[str]:
        return [re.sub(r"[012]+$", "", t) for t in tokens]

    wrong = wrong_stress = errors = length = 0
    for hyp, (_, refs) in zip(hyps, entries, strict=True):
        wrong_stress += all(hyp != r for r in refs)
        wrong += all(unstressed(hyp) != unstressed(r) for r in refs)
        closest = min(refs, key=lambda r: (distance(tuple(hyp), tuple(r)) / max(len(r), 1),
                                           distance(tuple(hyp), tuple(r))))
        errors += distance(tuple(hyp), tuple(closest))
        length += len(closest)
    n = len(hyps)
    return [f"{100 * wrong / n:.2f}", f"{100 * wrong_stress / n:.2f}", f"{100 * errors / length:.2f}"]


def test_eval_table_matches_generate(g2p, capsys):
    assert main(["eval", "--limit", "40", "--beams", "1", "3"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    model, tok = g2p
    from beamsearch.cli.evaluate import CMUDICT_TEST

    entries = read_references(CMUDICT_TEST)[:40]
    for name, beams in (("greedy", 1), ("beam 3", 3)):
        hyps = []
        for word, _ in entries:
            seq = model.generate(**tok([word], return_tensors="pt"), num_beams=beams)[0]
            hyps.append(tok.decode(seq, skip_special_tokens=True).split())
        cells = [c.strip() for c in rows[name].split("|")[2:5]]
        assert cells == expected_table_row(hyps, entries)


def test_subprocess_stdin_to_stdout():
    proc = subprocess.run(
        [sys.executable, "-m", "beamsearch", "decode", "--num-beams", "2", "--threads", "1"],
        input="cat\n\ndog\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 3 and proc.stdout.splitlines()[1] == ""
    assert proc.stderr == ""


def test_bad_flag_values(capsys):
    assert main(["decode", "--batch-size", "0"]) == 2
    assert "--batch-size must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["decode", "--early-stopping", "sometimes"])
    torch.manual_seed(0)


def test_toolkit_semantics_flags_reach_the_search(g2p, tmp_path, capsys):
    from beamsearch.adapters.hf import search_model

    f = write(tmp_path, "in.txt", WORDS[:3])
    assert (
        main(["decode", f, "--semantics", "t2t", "--num-beams", "4", "--length-penalty", "0.6", "--format", "tsv"]) == 0
    )
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    model, tok = g2p
    for word, row in zip(WORDS[:3], rows, strict=True):
        r = search_model(model, **tok([word], return_tensors="pt"), semantics="t2t", num_beams=4, length_penalty=0.6)
        length = int(r.lengths[0, 0])
        assert row[4] == tok.decode(r.sequences[0, 0, 1:length], skip_special_tokens=True).strip()
        want = float(r.sequences_scores[0, 0])  # decoded alone here, in a batch of 3 there: float precision
        assert float(row[3]) == pytest.approx(want, abs=score_tolerance() * max(1.0, abs(want)))


def test_eval_takes_generation_options(g2p, capsys):
    from beamsearch.adapters.hf import search_model
    from beamsearch.cli.evaluate import CMUDICT_TEST

    assert main(["eval", "--limit", "15", "--beams", "3", "--semantics", "onmt", "--length-penalty-type", "wu"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| beam 3"))
    model, tok = g2p
    entries = read_references(CMUDICT_TEST)[:15]
    hyps = []
    for word, _ in entries:
        r = search_model(
            model, **tok([word], return_tensors="pt"), num_beams=3, semantics="onmt", length_penalty_type="wu"
        )
        hyps.append(tok.decode(r.sequences[0, 0, 1 : int(r.lengths[0, 0])], skip_special_tokens=True).split())
    assert [c.strip() for c in row.split("|")[2:5]] == expected_table_row(hyps, entries)


def test_ensemble_flag_decodes_with_both_models(g2p, tmp_path, capsys):
    """--ensemble DIR: the embedded model and a perturbed copy, as search_ensemble decodes them."""
    from beamsearch.adapters.hf_ensemble import search_ensemble

    model, tok = g2p
    other = AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = tmp_path / "other"
    other.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, folder / name)
    words = ["hello", "ensemble", "quixotic"]
    f = write(tmp_path, "in.txt", words)
    argv = ["decode", f, "--ensemble", str(folder), "--ensemble-mode", "prob", "--num-beams", "3", "--quiet"]
    assert main(argv) == 0
    got = capsys.readouterr().out.splitlines()
    enc = tok(words, return_tensors="pt", padding=True)
    other = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    result = search_ensemble([model, other], **enc, num_beams=3, mode="prob")
    want = [tok.decode(result.sequences[i, 0, : int(result.lengths[i, 0])], skip_special_tokens=True).strip()
            for i in range(len(words))]
    assert got == want


def test_ensemble_with_another_vocabulary_is_refused(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "lm"
    GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=16, n_layer=1, n_head=2)).save_pretrained(folder)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<pad>": 1}, unk_token="a")),
                            pad_token="<pad>").save_pretrained(folder)
    f = write(tmp_path, "in.txt", ["hello"])
    assert main(["decode", f, "--ensemble", str(folder)]) == 2
    assert "its tokenizer differs from the main model's" in capsys.readouterr().err


def test_prefix_flag_forces_the_first_tokens(g2p, tmp_path, capsys):
    from beamsearch.adapters.hf import search_model

    model, tok = g2p
    words = ["hello", "world", "phone"]
    f = write(tmp_path, "in.txt", words)
    assert main(["decode", f, "--prefix", "F", "--num-beams", "4", "--quiet"]) == 0
    got = capsys.readouterr().out.splitlines()
    prefix = tok("F", add_special_tokens=False)["input_ids"]
    enc = tok(words, return_tensors="pt", padding=True)
    result = search_model(model, **enc, num_beams=4, target_prefix=[prefix] * len(words))
    want = [tok.decode(result.sequences[i, 0, : int(result.lengths[i, 0])], skip_special_tokens=True).strip()
            for i in range(len(words))]
    assert got == want and all(line.split()[0] == "F" for line in got)
    assert main(["decode", f, "--prefix", " "]) == 2
    assert "no tokens" in capsys.readouterr().err


def test_diverse_beam_search_flags(g2p, tmp_path, capsys):
    model, tok = g2p
    f = write(tmp_path, "in.txt", ["either"])
    argv = ["decode", f, "--num-beams", "6", "--num-beam-groups", "3", "--diversity-penalty", "2.0",
            "--num-return-sequences", "3", "--format", "tsv"]
    assert main(argv) == 0
    got = [line.split("\t")[4] for line in capsys.readouterr().out.splitlines()]
    out = beamsearch.generate(model, **tok(["either"], return_tensors="pt"), num_beams=6, num_beam_groups=3,
                              diversity_penalty=2.0, num_return_sequences=3)
    assert got == [t.strip() for t in tok.batch_decode(out, skip_special_tokens=True)]


def test_alignments_in_jsonl(g2p, tmp_path, capsys):
    import json

    from beamsearch.adapters.hf import search_model

    model, tok = g2p
    f = write(tmp_path, "in.txt", ["hello", "alignment"])
    assert main(["decode", f, "--alignments", "--format", "jsonl", "--num-beams", "3", "--quiet"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    eager = AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL, attn_implementation="eager").eval()
    for record, word in zip(records, ["hello", "alignment"], strict=True):
        r = search_model(eager, **tok([word], return_tensors="pt"), num_beams=3, output_alignments=True)
        got = torch.tensor(record["hypotheses"][0]["alignment"])
        assert_scores_close(got, r.alignments[0, 0, : got.shape[0]])  # a batch of 2 there, alone here
        assert got.shape == (len(record["hypotheses"][0]["tokens"]), len(word) + 1)  # characters and </s>
    assert main(["decode", f, "--alignments"]) == 2
    assert "--alignments needs --format jsonl" in capsys.readouterr().err


def test_constraint_flag(g2p, tmp_path, capsys):
    from beamsearch.adapters.hf import search_model

    model, tok = g2p
    words = ["tomato", "route"]
    f = write(tmp_path, "in.txt", words)
    assert main(["decode", f, "--num-beams", "5", "--constraint", "AH0|UW1", "--quiet"]) == 0
    got = capsys.readouterr().out.splitlines()
    ah, uw = tok.convert_tokens_to_ids("AH0"), tok.convert_tokens_to_ids("UW1")
    enc = tok(words, return_tensors="pt", padding=True)
    r = search_model(model, **enc, num_beams=5, force_words_ids=[[[ah], [uw]]])
    want = [tok.decode(r.sequences[i, 0, : int(r.lengths[i, 0])], skip_special_tokens=True).strip() for i in range(2)]
    assert got == want and all("AH0" in g.split() or "UW1" in g.split() for g in got)
    assert main(["decode", f, "--constraint", "AH0| "]) == 2
    assert "has no tokens" in capsys.readouterr().err


def test_unique_flag_keys_hypotheses_by_text(g2p, tmp_path, capsys):
    from beamsearch.adapters.hf import search_model
    from beamsearch.cli.decoding import text_key

    model, tok = g2p
    key = text_key(tok)
    ids = tok("AH0 B", add_special_tokens=False)["input_ids"]
    assert key(ids + [tok.pad_token_id]) == key(ids) == "AH0 B"  # special tokens do not make a text distinct
    f = write(tmp_path, "in.txt", ["object"])
    assert main(["decode", f, "--num-beams", "8", "--num-return-sequences", "4", "--unique", "--format", "tsv"]) == 0
    got = [line.split("\t")[4] for line in capsys.readouterr().out.splitlines()]
    r = search_model(model, **tok(["object"], return_tensors="pt"), num_beams=8, num_return_sequences=4, unique=key)
    assert got == [key(r.sequences[0, j, 1 : int(r.lengths[0, j])].tolist()) for j in range(4)]
    assert len(set(got)) == 4


def test_stochastic_beam_search_flag(g2p, tmp_path, capsys):
    from beamsearch.adapters.hf import search_model

    model, tok = g2p
    f = write(tmp_path, "in.txt", ["either"])
    argv = ["decode", f, "--num-beams", "4", "--num-return-sequences", "4", "--stochastic-beam-search", "--seed", "3",
            "--format", "tsv"]
    assert main(argv) == 0
    got = [line.split("\t")[4] for line in capsys.readouterr().out.splitlines()]
    torch.manual_seed(3)
    r = search_model(model, **tok(["either"], return_tensors="pt"), num_beams=4, num_return_sequences=4,
                     stochastic_beam_search=True)
    want = [tok.decode(r.sequences[0, j, : int(r.lengths[0, j])], skip_special_tokens=True).strip() for j in range(4)]
    assert got == want and len(set(got)) == 4


def test_prefix_bias_flag(g2p, tmp_path, capsys):
    from beamsearch.adapters.hf import search_model

    model, tok = g2p
    words = ["hello", "phone"]
    f = write(tmp_path, "in.txt", words)
    assert main(["decode", f, "--prefix", "F", "--prefix-bias-beta", "0.4", "--num-beams", "3", "--quiet"]) == 0
    got = capsys.readouterr().out.splitlines()
    prefix = tok("F", add_special_tokens=False)["input_ids"]
    r = search_model(model, **tok(words, return_tensors="pt", padding=True), num_beams=3,
                     target_prefix=[prefix] * 2, prefix_bias_beta=0.4)
    assert got == [tok.decode(r.sequences[i, 0, : int(r.lengths[i, 0])], skip_special_tokens=True).strip()
                   for i in range(2)]
    assert main(["decode", f, "--prefix-bias-beta", "0.4"]) == 2
    assert "--prefix-bias-beta needs --prefix" in capsys.readouterr().err


def test_a_closed_pipe_stops_quietly(tmp_path):
    """`beamsearch decode big.txt | head -1`: the reader leaves early; no traceback, exit status 0."""
    f = write(tmp_path, "in.txt", ["hello", "world", "phone"] * 400)
    proc = subprocess.Popen([sys.executable, "-m", "beamsearch", "decode", f, "--threads", "1", "--batch-size", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "HH EH1 L OW0"
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_encoder_and_parity_flags_reach_the_search(g2p, tmp_path, capsys, monkeypatch):
    """--encoder-repetition-penalty, --encoder-no-repeat-ngram-size and --exact-parity become the search options
    of the same names; the decode equals model.generate with them."""
    from beamsearch.cli import decoding

    seen = []
    original = decoding.search_model

    def spy(model, **kwargs):
        seen.append(kwargs)
        return original(model, **kwargs)

    monkeypatch.setattr(decoding, "search_model", spy)
    f = write(tmp_path, "in.txt", WORDS[:3])
    flags = ["--encoder-repetition-penalty", "0.5", "--encoder-no-repeat-ngram-size", "2", "--exact-parity"]
    assert main(["decode", f, "--num-beams", "3", "--quiet", *flags]) == 0
    assert all(k["encoder_repetition_penalty"] == 0.5 and k["encoder_no_repeat_ngram_size"] == 2
               and k["exact_parity"] is True for k in seen) and seen
    model, tok = g2p
    want = []
    for word in WORDS[:3]:
        ids = model.generate(**tok([word], return_tensors="pt"), num_beams=3, encoder_repetition_penalty=0.5,
                             encoder_no_repeat_ngram_size=2)
        want.append(tok.decode(ids[0], skip_special_tokens=True).strip())
    assert capsys.readouterr().out.splitlines() == want


def model_copy(tmp_path, name: str, skip: tuple[str, ...] = ()) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for item in EMBEDDED_MODEL.iterdir():
        if item.is_file() and item.name not in skip:
            shutil.copy(item, folder / item.name)
    return folder


def test_broken_model_directories_get_one_line_errors(tmp_path, capsys):
    f = write(tmp_path, "in.txt", ["cat"])
    out = tmp_path / "out.txt"
    cases = []
    cases.append((model_copy(tmp_path, "no_tokenizer", skip=("tokenizer.json", "tokenizer_config.json")), 2,
                  "no tokenizer files in it"))
    pickled = model_copy(tmp_path, "pickled", skip=("model.safetensors",))
    from safetensors.torch import load_file

    torch.save(load_file(EMBEDDED_MODEL / "model.safetensors"), pickled / "pytorch_model.bin")
    cases.append((pickled, 2, "only pytorch_model.bin (pickle) weights; beamsearch loads safetensors only"))
    corrupt = model_copy(tmp_path, "corrupt")
    (corrupt / "model.safetensors").write_bytes((EMBEDDED_MODEL / "model.safetensors").read_bytes()[:5000])
    cases.append((corrupt, 1, "cannot be loaded (SafetensorError"))
    bad_config = model_copy(tmp_path, "bad_config")
    config = json.loads((bad_config / "generation_config.json").read_text())
    (bad_config / "generation_config.json").write_text(json.dumps(dict(config, num_beams=0)))
    cases.append((bad_config, 2, "num_beams must be an integer >= 1, got 0 (from the model's "
                                 "generation_config.json; --num-beams overrides it)"))
    for folder, status, message in cases:
        assert main(["decode", f, "--model", str(folder), "--output", str(out), "-q"]) == status, folder.name
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists() and not (tmp_path / "out.txt.partial").exists()  # a failed load creates no file


@pytest.mark.parametrize("flags, message", [
    (["--length-penalty", "nan"], "argument --length-penalty: expected a finite number, not 'nan'"),
    (["--length-penalty", "inf"], "expected a finite number, not 'inf'"),
    (["--temperature=-inf"], "expected a finite number, not '-inf'"),
    (["--num-beams", "0"], "--num-beams must be at least 1, not 0"),
])
def test_bad_flag_values_are_one_line_usage_errors(flags, message, tmp_path, capsys):
    f = write(tmp_path, "in.txt", ["cat"])
    try:
        status = main(["decode", f, *flags])
    except SystemExit as exit:  # argparse's own checks exit
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("limit", ["0", "-5"])
def test_eval_limit_is_checked(limit, capsys):
    assert main(["eval", "--limit", limit]) == 2
    assert f"--limit must be at least 1, not {limit}" in capsys.readouterr().err


def test_version_and_grouped_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"beamsearch {beamsearch.__version__}"
    with pytest.raises(SystemExit):
        main(["decode", "--help"])
    text = capsys.readouterr().out
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[-6:] == ["input/output", "search", "length", "penalties", "model", "performance"]
    assert "(default: 64)" in text and "(default: truncate)" in text and "`" not in text


def test_unexpected_errors_are_one_line_unless_debug(tmp_path, capsys, monkeypatch):
    from beamsearch.cli import decoding

    def broken(*args, **kwargs):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(decoding, "decode_batch", broken)
    f = write(tmp_path, "in.txt", ["cat"])
    assert main(["decode", f]) == 1
    err = capsys.readouterr().err
    assert err == "beamsearch: error: RuntimeError: something unforeseen (--debug shows the traceback)\n"
    with pytest.raises(RuntimeError, match="unforeseen"):
        main(["decode", f, "--debug"])


def test_a_model_returning_nan_is_a_runtime_error(tmp_path, capsys, monkeypatch):
    """The search's SearchError (NaN in what the model returned) is one line with exit status 1; the records
    decoded before it stay in the partial output for --resume."""
    from beamsearch import SearchError
    from beamsearch.cli import decoding

    original, calls = decoding.search_model, []

    def nan_on_the_second_batch(model, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise SearchError("the model's logits hold NaN at step 3 (example 1)", 3, 1)
        return original(model, **kwargs)

    monkeypatch.setattr(decoding, "search_model", nan_on_the_second_batch)
    f = write(tmp_path, "in.txt", WORDS)
    out = tmp_path / "out.txt"
    assert main(["decode", f, "--batch-size", "2", "--output", str(out)]) == 1
    assert capsys.readouterr().err == "beamsearch: error: the model's logits hold NaN at step 3 (example 1)\n"
    assert len((tmp_path / "out.txt.partial").read_text().splitlines()) == 2


def test_stdin_to_an_output_file(tmp_path, capsys, monkeypatch):
    """`decode - --output FILE`: stdin has no fingerprint to take (and cannot be resumed), but is written."""
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"cat\ndog\n")))
    out = tmp_path / "out.txt"
    assert main(["decode", "-", "--output", str(out), "-q"]) == 0
    assert out.read_text().splitlines() == ["K AE1 T", "D AO1 G"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_unfinished_hypotheses_are_marked_in_every_format_and_ranked_last(g2p, tmp_path, capsys):
    """With a length limit too short for most words, every format says which hypotheses did not finish, and the
    finished ones rank first unless --unfinished keep."""
    from beamsearch.adapters.hf import search_model

    model, tok = g2p
    f = write(tmp_path, "in.txt", ["cat"])
    common = ["decode", f, "--num-beams", "5", "--num-return-sequences", "5", "--max-new-tokens", "4", "-q"]
    r = search_model(model, **tok(["cat"], return_tensors="pt"), num_beams=5, num_return_sequences=5,
                     max_new_tokens=4)
    reasons = [int(x) for x in r.finish_reason[0]]
    assert 1 in reasons and 2 in reasons, reasons  # EOS and MAX_LENGTH both among the five (the test's premise)
    assert main([*common, "--format", "jsonl", "--unfinished", "keep"]) == 0
    kept = [h["finish_reason"] for h in json.loads(capsys.readouterr().out)["hypotheses"]]
    assert kept == ["eos" if x == 1 else "max_length" for x in reasons]  # the search's order
    assert main([*common, "--format", "tsv"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [row[5] for row in rows] == sorted(kept, key=lambda x: x != "eos")  # finished first, order kept
    assert [row[2] for row in rows] == ["1", "2", "3", "4", "5"]
    long = write(tmp_path, "long.txt", ["pronunciation"])
    assert main(["decode", long, "--num-beams", "5", "--max-new-tokens", "3", "-q"]) == 0
    line = capsys.readouterr().out
    assert line.endswith("\t[unfinished: max_length]\n") and len(line.split("\t")[0].split()) == 3


def test_eval_search_errors_table_matches_the_searches(g2p, tmp_path, capsys):
    """The --search-errors table, recomputed here from search_model: exact against beam scores word by word."""
    from beamsearch.adapters.hf import search_model
    from beamsearch.cli.evaluate import CMUDICT_TEST
    from beamsearch.cli.search_errors import looping
    from beamsearch.evaluation import read_references, strip_stress

    model, tok = g2p
    WORDS = 50  # the first 50 test words: greedy makes two search errors on them (on the first 40, none)
    png = tmp_path / "errors.png"
    assert main(["eval", "--search-errors", "--limit", str(WORDS), "--beams", "1", "3", "--plot", str(png), "-q"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 3 ")]
    assert len(rows) == 2 and png.stat().st_size > 1000
    assert float(rows[0][1]) > 0  # greedy makes search errors on these words: the comparison is not vacuous
    entries = read_references(CMUDICT_TEST)[:WORDS]
    enc = tok([word for word, _ in entries], return_tensors="pt", padding=True)
    exact = search_model(model, **enc, num_beams=3, exact_search=True)
    assert bool(exact.proven.all())

    def text(result, b):
        return tok.decode(result.sequences[b, 0, : int(result.lengths[b, 0])], skip_special_tokens=True).split()

    def right(phones, refs):
        return strip_stress(phones) in [strip_stress(r) for r in refs]

    def at_source_limit(b):  # ended with the EOS the source-tied limit forces: floor(a * source + b) + 1 tokens
        config = model.generation_config
        most = math.floor(config.max_len_a * int(enc["attention_mask"][b].sum()) + config.max_len_b) + 1
        return int(exact.lengths[b, 0]) - 1 == most  # the decoder's start token is not generated

    for row, width in zip(rows, (1, 3), strict=True):
        beam = search_model(model, **enc, num_beams=width)
        errors = sum(float(exact.sequences_scores[b, 0]) > float(beam.sequences_scores[b, 0]) + 1e-4 * max(
            1.0, abs(float(beam.sequences_scores[b, 0]))) for b in range(WORDS))
        wrong = sum(not right(text(beam, b), refs) for b, (_, refs) in enumerate(entries))
        exact_wrong = sum(not right(text(exact, b), refs) for b, (_, refs) in enumerate(entries))
        degenerate = sum(int(exact.finish_reason[b, 0]) != 1 or at_source_limit(b) or looping(text(exact, b))
                         for b in range(WORDS))
        cells = [round(float(c), 2) for c in row[1:]]
        assert cells[0] == round(100 * errors / WORDS, 2) and cells[2] == round(100 * wrong / WORDS, 2)
        assert cells[3] == round(100 * exact_wrong / WORDS, 2) and cells[6] == round(100 * degenerate / WORDS, 2)
        assert cells[4] == 0.0  # every exact answer proven
