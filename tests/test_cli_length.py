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
# at beam 4 the model reads LONG_WORD in fewer phones than its cap (27 of 32), this one in more
BEAM_LONG_WORD = "pneumono-ultramicroscopic-silicovolcanoconiosis"
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
    assert config.max_new_tokens < len(best["tokens"]) <= source_tied_tokens(config, LONG_WORD)
    at_limit = len(best["tokens"]) == source_tied_tokens(config, LONG_WORD)
    assert best["finish_reason"] == ("source_length_limit" if at_limit else "eos")
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
    at_limit = [len(h["tokens"]) == source_tied_tokens(config, w) for h, w in zip(hyps, words, strict=True)]
    cut = sum(at_limit)
    assert 1 <= cut < len(hyps)
    # the files mark each output the limit ended (its EOS was forced), the others ended by themselves
    assert [h["finish_reason"] for h in hyps] == ["source_length_limit" if a else "eos" for a in at_limit]
    limit = f"{config.max_len_a:g}*source+{config.max_len_b}"
    assert (f"beamsearch: {cut} of {len(hyps)} outputs were cut at a length limit: {cut} at the source-tied limit "
            f"max_len_a*source+max_len_b = {limit} tokens, marked finish_reason source_length_limit (--max-len-a "
            "and --max-len-b raise it)\n") in err


def test_every_format_marks_and_ranks_an_output_ended_at_the_source_tied_limit(tmp_path, capsys):
    """jsonl marks each hypothesis the limit ended; --unfinished last ranks them after those that ended by
    themselves, --unfinished keep leaves the search's order; text marks a best output the limit ended. A limit of
    0*source+4 (5 tokens with the EOS) gives short words n-best lists with both kinds (with the stage-9 weights,
    "church", "light" and "beam" rank a cut hypothesis before one that ended), and "hello" (HH AH L OW) none that
    ends before it."""
    def run(words: list[str], b: int, *flags: str) -> str:
        path = tmp_path / "in.txt"
        path.write_text("".join(w + "\n" for w in words), encoding="utf-8")
        assert main(["decode", str(path), "-q", "--num-beams", "8", "--num-return-sequences", "8", "--max-len-a",
                     "0", "--max-len-b", str(b), *flags]) == 0
        return capsys.readouterr().out

    words = ["search", "church", "light", "beam"]
    orders = {}
    for unfinished in ("keep", "last"):
        records = [json.loads(line) for line in run(words, 4, "--format", "jsonl", "--unfinished", unfinished)
                   .splitlines()]
        assert [r["input"] for r in records] == words
        orders[unfinished] = []
        for record in records:
            hyps = record["hypotheses"]
            assert all((h["finish_reason"] == "source_length_limit") == (len(h["tokens"]) == 5) for h in hyps)
            orders[unfinished].append([(h["text"], h["finish_reason"]) for h in hyps])
    interleaved = 0
    for kept, last in zip(orders["keep"], orders["last"], strict=True):
        assert last == [h for h in kept if h[1] == "eos"] + [h for h in kept if h[1] != "eos"]
        interleaved += last != kept  # a cut hypothesis ranked before one that ended
    assert interleaved >= 1  # the case needs both kinds in one list, out of order
    [best, *_] = run(["hello"], 2, "--format", "tsv").splitlines()
    text = best.split("\t")[4]
    assert best.endswith("\tsource_length_limit") and len(text.split()) == 2
    assert run(["hello"], 2) == f"{text}\t[unfinished: source_length_limit]\n"


def test_no_summary_when_nothing_is_cut_or_with_quiet(tmp_path, capsys):
    hyps, err = decoded(tmp_path, capsys, SHORT_WORDS)
    assert all(h["finish_reason"] == "eos" for h in hyps) and "length limit" not in err
    _, err = decoded(tmp_path, capsys, [LONG_WORD], "-q", "--max-new-tokens", "4")
    assert "length limit" not in err


def test_stream_and_trace_follow_the_same_limit(config, tmp_path, capsys):
    """decode --stream and trace print decode's best output for a long word, not one cut at the model's cap."""
    [best], _ = decoded(tmp_path, capsys, [BEAM_LONG_WORD], "-q", "--num-beams", "4")
    assert len(best["tokens"]) > config.max_new_tokens
    assert main(["decode", "--stream", "--num-beams", "4", str(tmp_path / "in.txt")]) == 0
    assert capsys.readouterr().out == best["text"] + "\n"
    assert main(["trace", BEAM_LONG_WORD, "--num-beams", "4"]) == 0
    assert capsys.readouterr().out == best["text"] + "\n"
