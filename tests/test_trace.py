"""The search trace: what it records agrees with the search's own rules and result; off, it changes nothing; it
round-trips through JSON and stays within its limits."""

from __future__ import annotations

import math
import random

import pytest
import torch
from fakes import PrefixModel, count_host_conversions

import beamsearch
from beamsearch.trace import SearchTrace, TraceLimits
from beamsearch.trace_html import render

OPTIONS = dict(num_beams=3, max_new_tokens=8, eos_token_id=2, pad_token_id=0, num_return_sequences=2)


def traced(model=None, prompt=None, **options):
    model = model or PrefixModel(8, seed=2)
    prompt = torch.tensor([[1], [3]]) if prompt is None else prompt
    return beamsearch.search(model, prompt, **{**OPTIONS, "trace": True, **options})


def path(nodes, node):
    tokens, log_probs = [], []
    while node["parent"] is not None:
        tokens.append(node["token"])
        log_probs.append(node["log_prob"])
        node = nodes[node["parent"]]
    return tokens[::-1], log_probs[::-1]


def test_the_result_is_the_same_with_the_trace_on():
    model, prompt = PrefixModel(8, seed=2), torch.tensor([[1], [3]])
    plain = beamsearch.search(model, prompt, **OPTIONS)
    result = traced(model, prompt)
    assert plain.search_trace is None and result.search_trace is not None
    for name in ("sequences", "sequences_scores", "token_log_probs", "beam_indices", "lengths"):
        assert torch.equal(getattr(plain, name), getattr(result, name)), name


def test_the_trace_adds_no_host_synchronisation_per_step(monkeypatch):
    model, prompt = PrefixModel(11, seed=1), torch.tensor([[3]])
    options = dict(num_beams=3, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    conversions = count_host_conversions(monkeypatch)
    seen: list[int] = []

    def step(tokens, state):  # the conversions made so far, at each step
        seen.append(len(conversions))
        return model(tokens, state)

    beamsearch.search(step, prompt, **options)
    plain, seen[:], conversions[:] = list(seen), [], []
    beamsearch.search(step, prompt, trace=True, **options)
    monkeypatch.undo()
    assert len(plain) == 16 and seen == plain  # the trace is read once, after the search


@pytest.mark.parametrize("seed", range(6))
def test_nodes_follow_the_beam_search_rules(seed):
    rng = random.Random(seed)
    options = dict(num_beams=rng.randint(2, 4), length_penalty=rng.choice([0.0, 1.0, 2.0]),
                   early_stopping=rng.choice([True, False, "never"]), max_new_tokens=rng.randint(3, 9))
    result = traced(PrefixModel(rng.randint(6, 10), seed=seed), **options)
    trace = result.search_trace
    k = options["num_beams"]
    for e, example in enumerate(trace.examples):
        nodes = example["nodes"]
        assert nodes[0]["status"] == "root" and nodes[0]["tokens"] == result.sequences[e, 0, :1].tolist()
        steps = sorted({n["step"] for n in nodes if n["step"] >= 0})
        for step in steps:
            here = [n for n in nodes if n["step"] == step and n["status"] != "masked"]
            kept = [n for n in here if n["status"] == "kept"]
            assert len(here) == trace.candidates_per_step
            assert len(kept) in (0, k)  # K live beams go on, or the example is done
            # the kept ones are the best totals among the candidates that did not finish
            others = [n["total"] for n in here if n["status"] == "dropped" and "below the beam" in n["reason"]]
            assert all(n["total"] >= max(others, default=-math.inf) for n in kept)
        for node in nodes[1:]:
            if node["status"] != "masked":  # a total is the sum of the log-probs along the path
                assert node["total"] == pytest.approx(sum(path(nodes, node)[1]), abs=1e-4)
        # the returned n-best are finished nodes whose paths are the returned hypotheses
        for rank in range(result.sequences.shape[1]):
            ends = [n for n in nodes if n["best"] == rank and n["status"] == "finished"]
            tokens = result.sequences[e, rank, 1 : int(result.lengths[e, rank])].tolist()
            assert [path(nodes, n)[0] for n in ends] == [tokens]
            assert ends[0]["score"] == pytest.approx(float(result.sequences_scores[e, rank]), abs=1e-5)


def test_a_masked_end_token_is_recorded_with_its_reason():
    # a model that wants to end at once; min_new_tokens masks the end token for the first steps
    class Eager(PrefixModel):
        def logits_for(self, tokens):
            logits = super().logits_for(tokens)
            logits[:, 2] = 20.0
            return logits

    result = traced(Eager(8, seed=4), min_new_tokens=3)
    nodes = result.search_trace.examples[0]["nodes"]
    masked = [n for n in nodes if n["status"] == "masked"]
    assert masked and all(n["token"] == 2 and "masked by a processor" in n["reason"] for n in masked)
    assert {n["step"] for n in masked} == {0, 1, 2}


def test_the_trace_round_trips_through_json():
    trace = traced().search_trace.label(lambda token: f"<{token}>")
    again = SearchTrace.from_json(trace.to_json())
    assert again == trace
    assert again.schema == "beamsearch.trace/1"
    with pytest.raises(ValueError, match="schema"):
        SearchTrace.from_json('{"schema": "other"}')


def test_the_trace_is_bounded():
    result = traced(max_new_tokens=30, eos_token_id=None, trace=TraceLimits(max_steps=5, max_examples=1))
    trace = result.search_trace
    assert trace.truncated and len(trace.examples) == 1
    assert max(n["step"] for n in trace.examples[0]["nodes"]) == 4


def test_options_without_a_trace_are_refused():
    with pytest.raises(ValueError, match="trace=True records beam search"):
        beamsearch.search(PrefixModel(6), torch.tensor([[1]]), max_new_tokens=3, trace=True)
    with pytest.raises(ValueError, match="max_steps"):
        TraceLimits(max_steps=0)


def test_the_page_holds_the_trace_and_no_network_address():
    trace = traced().search_trace
    page = render(trace, example=1)
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert 'data-example="1"' in page and "beamsearch.trace/1" in page
    with pytest.raises(ValueError, match="example 5"):
        render(trace, example=5)


def test_the_trace_command_writes_the_trace_and_prints_the_best(tmp_path, capsys):
    from beamsearch.cli.main import main

    data, page = tmp_path / "trace.json", tmp_path / "tree.html"
    assert main(["trace", "river", "--num-beams", "3", "--json", str(data), "--html", str(page)]) == 0
    best = capsys.readouterr().out.strip()
    trace = SearchTrace.from_json(data.read_text())
    nodes = trace.examples[0]["nodes"]
    end = next(n for n in nodes if n["best"] == 0 and n["status"] == "finished")
    texts = [nodes[i]["text"] for i in _ancestry(nodes, end["id"])]
    assert " ".join(t for t in texts if t != "</s>") == best and trace.num_beams == 3
    assert page.read_text().count("data-drawn-nodes") == 0  # written by the page's script, in a browser
    assert main(["trace", "river", "--num-beams", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def _ancestry(nodes, node_id):
    ids = []
    while nodes[node_id]["parent"] is not None:
        ids.append(node_id)
        node_id = nodes[node_id]["parent"]
    return ids[::-1]


def test_the_trace_command_takes_only_flags_it_honours(tmp_path, capsys):
    """trace decodes one input with one model, recorded on the host: it has no batching, ensemble, n-best ranking
    or CUDA-graph flags (argparse refuses them by name), and the model flags it has take effect: --int8 gives
    decode --int8's best output, --max-input-length truncates with decode's warning (or refuses with --on-long
    error), --seed makes a sampled trace repeat."""
    from beamsearch.cli.flags import build_parser
    from beamsearch.cli.main import main

    trace_parser = build_parser()._subparsers._group_actions[0].choices["trace"]
    listed = {flag for action in trace_parser._actions for flag in action.option_strings}
    for flag in ("--batch-size", "--batch-type", "--ensemble", "--ensemble-mode", "--unfinished", "--cuda-graphs"):
        assert flag not in listed
        with pytest.raises(SystemExit) as exit_:
            main(["trace", "river", flag, "1"])
        assert exit_.value.code == 2
        assert f"beamsearch trace: error: unrecognized arguments: {flag} 1 (see beamsearch trace --help)" in (
            capsys.readouterr().err)
    assert {"--int8", "--threads", "--seed", "--max-input-length", "--on-long", "--fast", "--lean-step"} <= listed

    word = tmp_path / "word.txt"
    word.write_text("quintessential\n", encoding="utf-8")
    scores = []
    for flags in ([], ["--int8"]):
        assert main(["decode", str(word), "--num-beams", "4", "-q", "--format", "tsv", *flags]) == 0
        decoded = capsys.readouterr().out.splitlines()[0].split("\t")
        data = tmp_path / "trace.json"
        assert main(["trace", "quintessential", "--num-beams", "4", "--json", str(data), *flags]) == 0
        assert capsys.readouterr().out == decoded[4] + "\n"
        scores.append([n["log_prob"] for n in SearchTrace.from_json(data.read_text()).examples[0]["nodes"]][1:])
    assert scores[0] != scores[1]  # the int8 model's own log-probabilities: the flag took effect

    assert main(["decode", str(word), "--num-beams", "4", "-q", "--max-input-length", "5"]) == 0
    truncated = capsys.readouterr().out
    assert main(["trace", "quintessential", "--num-beams", "4", "--max-input-length", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == truncated and "1 input(s) over 5 tokens truncated (first: argument, 15 tokens)" in err
    assert main(["trace", "quintessential", "--max-input-length", "5", "--on-long", "error"]) == 2
    assert "argument: 15 tokens, over the input limit of 5" in capsys.readouterr().err

    sampled = ["trace", "quintessential", "--num-beams", "4", "--do-sample", "--temperature", "3"]
    runs = []
    for seed in ("1", "1", "2", "3"):
        assert main([*sampled, "--seed", seed]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and len(set(runs)) > 1  # the same seed repeats; other seeds give other samples
