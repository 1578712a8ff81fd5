"""Streaming: committed chunks join to the best hypothesis and are never taken back; provisional corrections end
with it; transformers' streamers get the same text; no host synchronisation is added."""

from __future__ import annotations

import random

import pytest
import torch
from fakes import PrefixModel, count_host_conversions

import beamsearch
from beamsearch.streaming import StreamEvent


def random_case(rng: random.Random, case: int) -> tuple[PrefixModel, torch.Tensor, dict]:
    """A random small model, prompt and beam / greedy search options (EOS, lengths, penalties, early stopping)."""
    vocab = rng.randint(4, 12)
    model = PrefixModel(vocab, seed=case, sharpness=rng.choice([0.5, 1.0, 2.0, 4.0]))
    options = dict(num_beams=rng.randint(1, 5), max_new_tokens=rng.randint(1, 12), pad_token_id=0,
                   eos_token_id=rng.randrange(vocab), remove_finished=rng.choice([True, False]))
    if options["num_beams"] > 1:
        options.update(length_penalty=rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0]),
                       early_stopping=rng.choice([True, False, "never"]))
        if rng.random() < 0.2:
            options["num_return_sequences"] = rng.randint(1, options["num_beams"])
    prompt = torch.tensor([[rng.randrange(vocab) for _ in range(rng.randint(1, 3))]])
    return model, prompt, options


def best_tokens(result: beamsearch.SearchResult) -> list[int]:
    return result.sequences[0, 0, result.prompt_length : int(result.lengths[0, 0])].tolist()


def test_committed_chunks_join_to_the_best_hypothesis_and_are_never_retracted():
    rng = random.Random(22)
    early = total = 0
    for case in range(200):
        model, prompt, options = random_case(rng, case)
        stream = beamsearch.stream(model, prompt, **options)
        committed: list[int] = []
        events = list(stream)
        for event in events:
            assert event.committed and event.position == len(committed)  # appended, never a correction
            committed.extend(event.tokens)
        assert committed == best_tokens(stream.result), (case, options)
        early += sum(len(e.tokens) for e in events[:-1])  # committed before the search ended
        total += len(committed)
    assert early > 0.3 * total  # most tokens are committed before the search ends (greedy: each step)


def test_the_stream_decodes_what_search_returns():
    model, prompt = PrefixModel(9, seed=3), torch.tensor([[1, 2]])
    options = dict(num_beams=4, max_new_tokens=10, eos_token_id=5, pad_token_id=0, length_penalty=0.7)
    stream = beamsearch.stream(model, prompt, **options)
    list(stream)
    plain = beamsearch.search(model, prompt, **options)
    assert torch.equal(stream.result.sequences, plain.sequences)
    assert torch.equal(stream.result.sequences_scores, plain.sequences_scores)


def test_provisional_corrections_applied_in_order_give_the_best_hypothesis():
    rng = random.Random(7)
    corrected = 0
    for case in range(120):
        model, prompt, options = random_case(rng, case)
        stream = beamsearch.stream(model, prompt, provisional=True, **options)
        shown: list[int] = []
        events = list(stream)
        for event in events:
            assert event.position <= len(shown)
            corrected += event.position < len(shown)
            shown[event.position:] = event.tokens
        assert events[-1].committed and not any(e.committed for e in events[:-1])
        assert shown == best_tokens(stream.result), (case, options)
    assert corrected  # the current best did change its mind somewhere


def test_streaming_adds_no_host_synchronisation_per_step(monkeypatch):
    model, prompt = PrefixModel(11, seed=1), torch.tensor([[3]])
    options = dict(num_beams=3, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    conversions = count_host_conversions(monkeypatch)
    beamsearch.search(model, prompt, **options)
    plain = len(conversions)
    conversions.clear()
    events: list[StreamEvent] = []
    beamsearch.search(model, prompt, stream_to=events.append, **options)
    streamed = len(conversions)
    monkeypatch.undo()
    assert len(events) > 2 and plain >= 12
    assert streamed <= plain + 2  # the final flush reads the result once; the steps add nothing


def test_streaming_refuses_a_batch():
    with pytest.raises(ValueError, match="one example"):
        beamsearch.search(PrefixModel(6), torch.tensor([[1], [2]]), num_beams=2, max_new_tokens=3,
                          stream_to=lambda event: None)


def test_leaving_the_stream_early_stops_the_search():
    steps = []

    def step(tokens, state):
        steps.append(tokens.shape[1])
        return PrefixModel(7).logits_for(tokens), state

    stream = beamsearch.stream(step, torch.tensor([[1]]), max_new_tokens=200, eos_token_id=None, pad_token_id=0)
    for _ in stream:
        break
    stream._thread.join(timeout=10)
    assert not stream._thread.is_alive() and len(steps) < 200


@pytest.mark.parametrize("name", ["t5", "gpt2"])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_transformers_streamers_print_the_returned_text(name, num_beams, capsys):
    transformers = pytest.importorskip("transformers")
    from test_hf_adapter import tiny_tokenizer
    from tiny_hf import random_inputs, tiny_model

    model, tokenizer = tiny_model(name), tiny_tokenizer()
    ids, mask = random_inputs(model, 1, torch.Generator().manual_seed(1))
    start = ids.shape[1] if name == "gpt2" else 1  # decoder-only outputs repeat the prompt
    iterator = transformers.TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = beamsearch.generate(model, input_ids=ids, attention_mask=mask, num_beams=num_beams,
                              max_new_tokens=12, streamer=iterator)
    assert "".join(iterator) == tokenizer.decode(out[0, start:])
    capsys.readouterr()
    beamsearch.generate(model, input_ids=ids, attention_mask=mask, num_beams=num_beams, max_new_tokens=12,
                        streamer=transformers.TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out == tokenizer.decode(out[0, start:]) + "\n"


def test_decode_stream_prints_what_decode_prints(tmp_path, capsys):
    from beamsearch.cli.main import main

    words = tmp_path / "words.txt"
    words.write_text("pneumonia\n\nriver\n")
    assert main(["decode", "--num-beams", "4", "-q", str(words)]) == 0
    batch = capsys.readouterr().out
    assert main(["decode", "--stream", "--num-beams", "4", str(words)]) == 0
    assert capsys.readouterr().out == batch
    assert main(["decode", "--stream", "--format", "jsonl", str(words)]) == 2
    assert "--stream" in capsys.readouterr().err


def test_the_stream_runs_under_the_callers_grad_mode():
    modes = []

    def step(tokens, state):
        modes.append(torch.is_grad_enabled())
        return PrefixModel(5).logits_for(tokens), state

    with torch.no_grad():
        stream = beamsearch.stream(step, torch.tensor([[1]]), num_beams=2, max_new_tokens=3, eos_token_id=None,
                                   pad_token_id=0)
    with torch.no_grad():
        list(stream)
    assert modes and not any(modes)
