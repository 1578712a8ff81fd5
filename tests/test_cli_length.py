"""The command line's length limit: the embedded model's source-tied limit (max_len_a * source + max_len_b) decides
where no --max-new-tokens is given, and a run ends with one line counting the outputs a limit cut.

Every expected length is computed from the model's generation_config.json and its tokenizer."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
from transformers import AutoTokenizer, GenerationConfig  # noqa: E402

from beamsearch.cli import main  # noqa: E402
from beamsearch.cli.decoding import EMBEDDED_MODEL  # noqa: E402

LONG_WORD = "pneumonoultramicroscopicsilicovolcanoconiosis"  # 45 letters
SHORT_WORDS = ["hello", "beam", "search", "cat"]


@pytest.fixture(scope="module")
def config():
    return GenerationConfig.from_pretrained(EMBEDDED_MODEL)


def source_tied_tokens(config, word: str) -> int:
    """The most tokens the source-tied limit lets this word's output have, its forced EOS included."""
    source_length = len(AutoTokenizer.from_pretrained(EMBEDDED_MODEL)(word)["input_ids"])
    return math.floor(config.max_len_a * source_length + config.max_len_b) + 1


def decoded(tmp_path, capsys, words: list[str], *flags: str) -> tuple[list[dict], str]:
    """The best hypothesis of each word (jsonl) and what the run printed on stderr."""
    path = tmp_path / "in.txt"
    path.write_text("".join(w + "\n" for w in words), encoding="utf-8")
    assert main(["decode", str(path), "--format", "jsonl", *flags]) == 0
    captured = capsys.readouterr()
    return [json.loads(line)["hypotheses"][0] for line in captured.out.splitlines()], captured.err


def test_the_embedded_model_ties_its_limit_to_the_source_and_caps_it_lower(config):
    """The premise: for the long word the model's max_new_tokens is below its source-tied limit."""
    assert config.max_len_a > 0 and config.max_new_tokens is not None
    assert source_tied_tokens(config, LONG_WORD) > config.max_new_tokens


def test_a_long_word_runs_to_the_source_tied_limit_not_the_models_cap(config, tmp_path, capsys):
    [best], _ = decoded(tmp_path, capsys, [LONG_WORD], "-q")
    assert best["finish_reason"] == "eos"
    assert config.max_new_tokens < len(best["tokens"]) <= source_tied_tokens(config, LONG_WORD)
    # the same output as under a cap that cannot bind: the source-tied limit alone decides
    [free], _ = decoded(tmp_path, capsys, [LONG_WORD], "-q", "--max-new-tokens",
                        str(source_tied_tokens(config, LONG_WORD) + 10))
    assert free["tokens"] == best["tokens"]


def test_an_explicit_max_new_tokens_still_wins(tmp_path, capsys):
    [best], _ = decoded(tmp_path, capsys, [LONG_WORD], "-q", "--max-new-tokens", "10")
    assert best["finish_reason"] == "max_length" and len(best["tokens"]) == 10


def test_the_summary_counts_the_outputs_cut_at_the_cap(tmp_path, capsys):
    hyps, err = decoded(tmp_path, capsys, [*SHORT_WORDS, LONG_WORD], "--max-new-tokens", "4")
    cut = sum(h["finish_reason"] == "max_length" for h in hyps)
    assert 0 < cut < len(hyps)  # the case needs both kinds
    lines = [line for line in err.splitlines() if "cut at a length limit" in line]
    assert lines == [f"beamsearch: {cut} of {len(hyps)} outputs were cut at a length limit: {cut} at "
                     "max_new_tokens=4, marked finish_reason max_length (--max-new-tokens raises it)"]


def test_the_summary_counts_the_outputs_cut_at_the_source_tied_limit(config, tmp_path, capsys):
    hyps, err = decoded(tmp_path, capsys, [*SHORT_WORDS, LONG_WORD])
    words = [*SHORT_WORDS, LONG_WORD]
    cut = sum(len(h["tokens"]) == source_tied_tokens(config, w) for h, w in zip(hyps, words, strict=True))
    assert cut >= 1 and all(h["finish_reason"] == "eos" for h in hyps)
    limit = f"{config.max_len_a:g}*source+{config.max_len_b}"
    assert (f"beamsearch: {cut} of {len(hyps)} outputs were cut at a length limit: {cut} at the source-tied limit "
            f"max_len_a*source+max_len_b = {limit} tokens, where EOS is forced (--max-len-a and --max-len-b raise "
            "it)\n") in err


def test_no_summary_when_nothing_is_cut_or_with_quiet(tmp_path, capsys):
    hyps, err = decoded(tmp_path, capsys, SHORT_WORDS)
    assert all(h["finish_reason"] == "eos" for h in hyps) and "length limit" not in err
    _, err = decoded(tmp_path, capsys, [LONG_WORD], "-q", "--max-new-tokens", "4")
    assert "length limit" not in err


def test_stream_and_trace_follow_the_same_limit(config, tmp_path, capsys):
    """decode --stream and trace print decode's best output for the long word, not one cut at the model's cap."""
    [best], _ = decoded(tmp_path, capsys, [LONG_WORD], "-q", "--num-beams", "4")
    assert len(best["tokens"]) > config.max_new_tokens
    assert main(["decode", "--stream", "--num-beams", "4", str(tmp_path / "in.txt")]) == 0
    assert capsys.readouterr().out == best["text"] + "\n"
    assert main(["trace", LONG_WORD, "--num-beams", "4"]) == 0
    assert capsys.readouterr().out == best["text"] + "\n"
