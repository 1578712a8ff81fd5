"""``output_alignments``: each returned token's attention over the source, following its own beam history.

The oracle is teacher forcing: the model run once on the returned hypothesis (no cache, no beams) gives, at
each position, the last decoder layer's cross-attention averaged over heads, which must equal what the search
kept for that token.
"""

from __future__ import annotations

import copy

import pytest
import torch
from numerics import assert_scores_close

pytest.importorskip("transformers")
from tiny_hf import random_inputs, tiny_model  # noqa: E402

from beamsearch import search  # noqa: E402
from beamsearch.adapters.hf import search_model  # noqa: E402


def eager(name: str):
    model = copy.deepcopy(tiny_model(name))  # the cached model stays as it is for other tests
    model.set_attn_implementation("eager")  # attention weights are returned only by eager attention
    return model


def teacher_forced_attention(model, ids, mask, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens [T]`` (start token included) -> ``[T - 1, S]``: the attention that chose tokens[1:]."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=tokens[None, :-1], output_attentions=True)
    return out.cross_attentions[-1][0].mean(dim=0).float()


@pytest.mark.parametrize("name", ["t5", "bart"])
@pytest.mark.parametrize("options", [
    {"num_beams": 1},
    {"num_beams": 4, "num_return_sequences": 3},
    {"num_beams": 3, "early_stopping": True, "length_penalty": 0.5},
    {"num_beams": 3, "remove_finished": False},
])
def test_alignments_follow_each_hypothesis(name, options):
    model = eager(name)
    ids, mask = random_inputs(model, 4, torch.Generator().manual_seed(6))
    result = search_model(model, input_ids=ids, attention_mask=mask, max_new_tokens=12, output_alignments=True,
                          **options)
    plain = search_model(model, input_ids=ids, attention_mask=mask, max_new_tokens=12, **options)
    assert torch.equal(result.sequences, plain.sequences)  # asking for alignments changes nothing else
    assert result.alignments.shape[:3] == result.token_log_probs.shape and result.alignments.shape[3] == ids.shape[1]
    for b in range(ids.shape[0]):
        for j in range(result.sequences.shape[1]):
            length = int(result.lengths[b, j])
            want = teacher_forced_attention(model, ids[b : b + 1], mask[b : b + 1], result.sequences[b, j, :length])
            got = result.alignments[b, j, : length - 1]
            assert_scores_close(got, want)
            assert not result.alignments[b, j, length - 1 :].any()  # zero after the end


def test_plain_step_function_alignments_and_errors():
    def step(tokens, state):
        n = tokens.shape[0]
        attention = torch.softmax(torch.arange(3.0).repeat(n, 1) * tokens[:, -1:].float(), dim=-1)
        return torch.randn(n, 5, generator=torch.Generator().manual_seed(tokens.shape[1])), state, attention

    result = search(step, torch.zeros(2, 1, dtype=torch.long), num_beams=2, max_new_tokens=3,
                    output_alignments=True)
    assert result.alignments.shape == (2, 1, 3, 3)
    with pytest.raises(ValueError, match="output_alignments needs the step function to return"):
        search(lambda t, s: (torch.zeros(t.shape[0], 5), s), torch.zeros(1, 1, dtype=torch.long), num_beams=2,
               max_new_tokens=2, output_alignments=True)
    with pytest.raises(ValueError, match="output_alignments needs semantics='hf'"):
        search(step, torch.zeros(1, 1, dtype=torch.long), num_beams=2, semantics="t2t", output_alignments=True)
    with pytest.raises(ValueError, match="need an encoder-decoder model"):
        model = tiny_model("gpt2")
        search_model(model, input_ids=torch.tensor([[3, 4]]), max_new_tokens=2, output_alignments=True)


def test_replace_unk_takes_the_most_attended_source_token():
    from beamsearch.alignment import replace_unk

    alignment = torch.tensor([[0.1, 0.7, 0.2, 0.0], [0.5, 0.1, 0.4, 0.0], [0.0, 0.0, 0.1, 0.9]])
    got = replace_unk(["<unk>", "b", "<unk>"], alignment, ["x", "y", "z"], "<unk>")
    assert got == ["y", "b", "z"]  # the last step attends to padding (position 3) most: ignored
    with pytest.raises(ValueError, match="alignment must be"):
        replace_unk(["a", "b"], alignment[:1], ["x"], "<unk>")


def test_cli_replace_unk(tmp_path, capsys):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from beamsearch.cli.decoding import EMBEDDED_MODEL
    from beamsearch.cli.main import main

    words = ["hello", "world", "zebra"]
    (tmp_path / "in.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    argv = ["decode", str(tmp_path / "in.txt"), "--prefix", "<unk>", "--num-beams", "3", "--quiet"]
    assert main([*argv, "--replace-unk"]) == 0
    replaced = capsys.readouterr().out.splitlines()
    assert main(argv) == 0
    plain = capsys.readouterr().out.splitlines()  # the forced unknown token is dropped as a special token
    model = AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    for word, got, rest in zip(words, replaced, plain, strict=True):
        enc = tok([word], return_tensors="pt")
        r = search_model(model, **enc, num_beams=3, target_prefix=[[tok.unk_token_id]], output_alignments=True)
        source = tok.convert_ids_to_tokens(enc["input_ids"][0].tolist())
        first = source[int(r.alignments[0, 0, 0, : len(source)].argmax())]
        assert got == f"{first} {rest}"
