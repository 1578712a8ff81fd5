"""The graph path (``cuda_graphs=True``, ``beamsearch/graphs/``) run on the CPU, where the same whole step runs
uncaptured: against today's path (the lean steps through the engine's loop) and against transformers.

The graph path's step has other shapes than the lean step (every row attends over its example's whole cache under
a mask, an example's rows in one call, the cache never reordered): tokens equal the lean path's, scores within the
score tolerance (docs/testing.md), and against transformers tokens equal except at the reference's own near ties
(``parity_grid.reference_margin``). The step itself is checked for what a CUDA graph needs: no operation that reads
a tensor on the host, no tensor of the state replaced (only changed in place). ``tests/test_cuda.py`` captures it.
"""

from __future__ import annotations

import types

import pytest
import torch
from numerics import assert_scores_close, near_tie
from parity_grid import _same_rows, reference_margin
from test_lean_gpt2 import gpt2
from test_lean_llama import llama
from test_lean_t5 import inputs as t5_inputs
from test_lean_t5 import t5
from tiny_hf import left_padded_inputs, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import beamsearch
from beamsearch import SearchError
from beamsearch.adapters.hf import search_model
from beamsearch.graphs import driver
from beamsearch.graphs.runner import WholeStep
from beamsearch.steps.t5.graph import GraphT5

transformers = pytest.importorskip("transformers")

DECODER_VOCAB, DECODER_PAD = 50, 2  # test_lean_gpt2's and test_lean_llama's
CASES = {
    "greedy": dict(num_beams=1),
    "beam": dict(num_beams=4, num_return_sequences=2),
    "beam early": dict(num_beams=3, early_stopping=True, length_penalty=0.5),
    "beam never": dict(num_beams=3, early_stopping="never", length_penalty=2.0),
}


MODELS = ["t5", "gpt2", "llama", "qwen2", "mistral"]  # every model a graph-safe step runs (Qwen2, Mistral: Llama's)
# seeds of models whose hypotheses end at varied steps (test_the_models_end_...)
SEEDS = {"t5": 4, "gpt2": 1, "llama": 1, "qwen2": 1, "mistral": 1}


def model_and_inputs(name: str, batch: int, seed: int | None = None, dtype: torch.dtype = torch.float32):
    """A small random model whose outputs end at varied steps, and padded inputs (right for T5, left otherwise)."""
    seed = SEEDS[name] if seed is None else seed
    if name == "t5":
        model, (ids, mask) = t5(seed=seed), t5_inputs(batch, seed=seed)
        with torch.no_grad():  # the end token's logit along a random direction of the decoder's output
            model.lm_head.weight[1] = torch.randn(model.config.d_model, generator=torch.Generator().manual_seed(seed))
    else:
        model = gpt2("sdpa", seed=seed, eos=2.0) if name == "gpt2" else llama("sdpa", seed=seed, eos=2.0, arch=name)
        ids, mask = left_padded_inputs(DECODER_VOCAB, DECODER_PAD, batch, seed=seed)
    return model.to(dtype), ids, mask


@pytest.mark.parametrize("name", MODELS)
def test_the_models_end_hypotheses_at_varied_steps(name: str) -> None:
    """What makes the comparisons below cover the end token: hypotheses of one batch end at several lengths."""
    model, ids, mask = model_and_inputs(name, 5)
    for beams in (1, 3):
        result = search_model(model, input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=beams,
                              do_sample=False)
        assert len(set(result.lengths.flatten().tolist())) >= 2, result.lengths


@pytest.fixture
def graph_steps(monkeypatch) -> list[int]:
    """Counts the whole steps the graph path runs (so that a test cannot pass on the eager path)."""
    steps = []
    original = WholeStep.__call__

    def counting(self):
        steps.append(self.search.rows_per_example)
        return original(self)

    monkeypatch.setattr(WholeStep, "__call__", counting)
    return steps


def assert_same_search(expected, actual) -> None:
    """Two results of the same search on other shapes: tokens and integer fields equal, scores within tolerance."""
    for field in ("sequences", "lengths", "finish_reason", "beam_indices"):
        want, got = getattr(expected, field), getattr(actual, field)
        assert (want is None) == (got is None), field
        assert want is None or torch.equal(got, want), (field, got, want)
    for field in ("sequences_scores", "sum_log_probs", "token_log_probs"):
        assert_scores_close(getattr(actual, field), getattr(expected, field))


@pytest.mark.parametrize("batch", [1, 3, 5])  # buckets of 1, 4 and 8 examples
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", MODELS)
def test_the_graph_path_equals_the_lean_path(name: str, case: str, batch: int, graph_steps) -> None:
    model, ids, mask = model_and_inputs(name, batch)
    kwargs = dict(CASES[case], input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    expected = search_model(model, **kwargs)
    actual = search_model(model, cuda_graphs=True, **kwargs)
    assert graph_steps and set(graph_steps) == {kwargs["num_beams"]}
    assert_same_search(expected, actual)


def _assert_like_transformers(model, dtype: torch.dtype = torch.float32, **kwargs) -> None:
    """Ours (graph path) against ``model.generate``: tokens equal but where transformers nearly tied (its margin
    checked), beam scores within the tolerance of ``dtype`` where the tokens are equal."""
    expected = model.generate(**kwargs, return_dict_in_generate=True, output_scores=True)
    result = search_model(model, cuda_graphs=True, **kwargs)
    actual = types.SimpleNamespace(sequences=result.sequences.flatten(0, 1),
                                   sequences_scores=result.sequences_scores.flatten())
    same = _same_rows(expected.sequences, actual.sequences)
    if not bool(same.all()):
        def rerun(processors):
            return model.generate(**kwargs, return_dict_in_generate=True, output_scores=True,
                                  logits_processor=processors)

        margin, magnitude, _ = reference_margin(expected, actual, rerun, kwargs)
        assert near_tie(margin, magnitude, dtype), (margin, expected.sequences, actual.sequences)
    if kwargs.get("num_beams", 1) > 1:
        assert_scores_close(actual.sequences_scores[same], expected.sequences_scores[same], dtype=dtype)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", MODELS)
def test_the_graph_path_equals_transformers(name: str, case: str) -> None:
    model, ids, mask = model_and_inputs(name, 4)
    _assert_like_transformers(model, input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              **CASES[case])


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_equals_transformers(name: str) -> None:
    """bfloat16 weights (the model computes in it): tokens with the near-tie check at bfloat16's tolerance."""
    model, ids, mask = model_and_inputs(name, 3, seed=4, dtype=torch.bfloat16)
    for beams in (1, 3):
        _assert_like_transformers(model, torch.bfloat16, input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                  num_beams=beams, do_sample=False)


PROCESSOR_CASES = {
    "min new tokens": dict(min_new_tokens=4),
    "min length": dict(min_length=5),
    "suppress": dict(suppress_tokens=[5, 7, 9], begin_suppress_tokens=[3, 4]),
    "forced": dict(forced_bos_token_id=6, forced_eos_token_id=1),
    "loop guard": dict(loop_guard=2),
    "source-tied limit": dict(max_len_a=0.5, max_len_b=1),
    "renormalize": dict(renormalize_logits=True, remove_invalid_values=True),
}


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("case", list(PROCESSOR_CASES))
def test_length_only_processors_equal_the_lean_path(case: str, beams: int, graph_steps) -> None:
    """The processors a captured step runs at a tensor length (T5: the source-tied limit needs a source)."""
    model, ids, mask = model_and_inputs("t5", 4, seed=3)
    kwargs = dict(PROCESSOR_CASES[case], input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=beams,
                  do_sample=False)
    expected = search_model(model, **kwargs)
    assert_same_search(expected, search_model(model, cuda_graphs=True, **kwargs))
    assert graph_steps


def test_the_loop_guard_bans_a_third_copy_in_the_graph_path() -> None:
    """A model that repeats one token: with ``loop_guard=3`` no three copies in a row (the guard works, not only
    agrees with the eager path)."""
    model, ids, mask = model_and_inputs("gpt2", 2, seed=1)
    with torch.no_grad():
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(DECODER_VOCAB))
        model.lm_head.bias[7] = 1e3  # token 7 wins everywhere until banned
    out = search_model(model, input_ids=ids, attention_mask=mask, max_new_tokens=9, loop_guard=3,
                       cuda_graphs=True, do_sample=False)
    generated = out.sequences[:, 0, ids.shape[1]:].tolist()
    assert all(row[:2] == [7, 7] and row[2] != 7 for row in generated), generated


def test_decoder_start_tokens_beyond_one_are_primed(graph_steps) -> None:
    """Two decoder start tokens: the first goes into the cache before the search, the search feeds the second."""
    model, ids, mask = model_and_inputs("t5", 3, seed=6)
    start = torch.tensor([[0, 5], [0, 9], [0, 12]])
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=start, max_new_tokens=8, num_beams=3,
                  do_sample=False)
    result = search_model(model, cuda_graphs=True, **kwargs)
    assert_same_search(search_model(model, **kwargs), result)
    assert graph_steps and torch.equal(result.sequences[:, :, :2], start[:, None])


class HostReads(TorchDispatchMode):
    """Records every operation that reads a tensor's value on the host or makes a shape from its data."""

    READS = ("_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique", "item")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.READS or name.startswith("_unique"):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("name", MODELS)
def test_the_whole_step_reads_nothing_on_the_host_and_changes_its_state_in_place(monkeypatch, name: str,
                                                                                   beams: int) -> None:
    """What capture needs: during a step no value is read on the host and no shape depends on data, and every
    tensor of the state keeps its storage (a graph replays on the addresses it was captured with). The host
    reads the flags between steps, outside the step."""
    model, ids, mask = model_and_inputs(name, 3, seed=2)
    seen: list[list[str]] = []
    addresses: list[list[int]] = []
    original = WholeStep.__call__

    def watched(self):
        addresses.append([t.data_ptr() for t in self.static_tensors()])
        with HostReads() as reads:
            original(self)
        seen.append(reads.seen)

    monkeypatch.setattr(WholeStep, "__call__", watched)
    search_model(model, input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=beams, cuda_graphs=True,
                 do_sample=False, min_new_tokens=2, loop_guard=2)
    assert len(seen) >= 3 and not any(seen), seen
    assert all(step == addresses[0] for step in addresses)


def test_a_search_may_run_past_its_end_without_changing_the_result(monkeypatch, graph_steps) -> None:
    """Flags read every 5 steps (as on CUDA, where they are read every few steps): the search runs on to the next
    read, and the steps after every example finished change nothing."""
    model, ids, mask = model_and_inputs("gpt2", 4, seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    for beams in (1, 3):
        every_step = search_model(model, cuda_graphs=True, num_beams=beams, **kwargs)
        ran = len(graph_steps) + 1  # the first step takes the prompt's logits, outside the whole step
        graph_steps.clear()
        monkeypatch.setattr(driver, "EAGER_CHECK_EVERY", 5)
        late = search_model(model, cuda_graphs=True, num_beams=beams, **kwargs)
        monkeypatch.setattr(driver, "EAGER_CHECK_EVERY", 1)
        assert 1 < ran < 30 and ran % 5  # it ended before the limit, between two reads
        assert len(graph_steps) + 1 == -(-ran // 5) * 5  # on to the next read
        assert_same_search(every_step, late)
        graph_steps.clear()


@pytest.mark.parametrize(("step", "example"), [(0, 2), (3, 1)])
@pytest.mark.parametrize("beams", [1, 3])
def test_nan_logits_name_the_step_and_the_example(monkeypatch, step: int, example: int, beams: int) -> None:
    original = GraphT5.decode

    def poisoned(self, tokens, position):
        logits = original(self, tokens, position)
        rows = torch.arange(logits.shape[0]) // self.cache.rows_per_example == example
        return logits.masked_fill(rows[:, None] & (position == step), float("nan"))

    monkeypatch.setattr(GraphT5, "decode", poisoned)
    model, ids, mask = model_and_inputs("t5", 3, seed=5)
    with pytest.raises(SearchError, match=rf"at step {step} \(example {example}\)$") as error:
        search_model(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=beams,
                     min_new_tokens=6, cuda_graphs=True, do_sample=False)
    assert (error.value.step, error.value.example) == (step, example)


REFUSED = {
    "do_sample": dict(do_sample=True),
    "num_beam_groups": dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
    "output_scores": dict(return_dict_in_generate=True, output_scores=True),
    "max_time": dict(max_time=10.0),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5]]),
    "semantics": dict(semantics="ct2"),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda batch_id, tokens: [5, 6]),
    "target_prefix": dict(target_prefix=[[5], [6], [7]]),
    "force_words_ids": dict(num_beams=3, force_words_ids=[[5]]),
    "output_alignments": dict(output_alignments=True),
    "trace": dict(num_beams=3, trace=True),
    "logits_processor": dict(logits_processor=[lambda input_ids, scores: scores]),
    "stopping_criteria": dict(stopping_criteria=[lambda input_ids, scores: torch.zeros(3, dtype=torch.bool)]),
}


@pytest.mark.parametrize("option", list(REFUSED))
def test_what_cannot_be_captured_is_refused_by_name(option: str) -> None:
    model, ids, mask = model_and_inputs("t5", 3)
    with pytest.raises(ValueError, match=rf"^cuda_graphs=True cannot capture {option}\b"):
        beamsearch.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=4, cuda_graphs=True,
                            **REFUSED[option])


@pytest.mark.parametrize("option", [dict(lean_step=False), dict(lean_step="fast"), dict(compile_step=True),
                                    dict(share_encoder_state=True), dict(exact_parity=True)])
def test_the_other_step_options_are_refused(option: dict) -> None:
    model, ids, mask = model_and_inputs("t5", 2)
    name, value = next(iter(option.items()))
    with pytest.raises(ValueError, match=rf"cannot be combined with {name}={value!r}"):
        beamsearch.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=4, cuda_graphs=True, **option)


def test_models_without_a_graph_step_and_bad_values_are_refused() -> None:
    bart = tiny_model("bart")
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="cuda_graphs=True runs T5, GPT-2, Llama, Qwen2 and Mistral models .* "
                       "model_type 'bart'"):
        beamsearch.generate(bart, input_ids=ids, max_new_tokens=3, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be None, True or False, got 'yes'"):
        beamsearch.generate(bart, input_ids=ids, max_new_tokens=3, cuda_graphs="yes")
    from beamsearch.adapters.hf_ensemble import search_ensemble

    model, t5_ids, mask = model_and_inputs("t5", 2)
    with pytest.raises(ValueError, match="cuda_graphs=True is not supported with an ensemble"):
        search_ensemble([model, model], input_ids=t5_ids, attention_mask=mask, max_new_tokens=3, cuda_graphs=True)


def test_a_sliding_window_is_refused_by_name() -> None:
    """Mistral v0.1's window (and Qwen2's use_sliding_window): the graph-safe step attends to the whole cache."""
    model = llama("sdpa", seed=1, arch="mistral", sliding_window=4)
    ids, mask = left_padded_inputs(DECODER_VOCAB, DECODER_PAD, 2, seed=1)
    with pytest.raises(ValueError, match="graph-safe step, which cannot run this call: config.sliding_window is set"):
        beamsearch.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=3, cuda_graphs=True)


def test_too_many_beams_for_the_vocabulary_is_a_search_error() -> None:
    model, ids, mask = model_and_inputs("t5", 1)
    with pytest.raises(SearchError, match="larger than the vocabulary size"):
        search_model(model, input_ids=ids, attention_mask=mask, max_new_tokens=1, num_beams=60,
                     num_return_sequences=60, cuda_graphs=True)


@pytest.fixture
def keeping(monkeypatch):
    """Steps kept across calls as on CUDA (here uncaptured: the kept tensors are loaded and the same step runs)."""
    from beamsearch.graphs import reuse

    monkeypatch.setattr(driver, "keeps_steps", lambda capture: True)
    reuse.release()
    yield reuse
    reuse.release()


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("name", MODELS)
def test_a_kept_step_serves_later_calls_of_the_same_shapes(keeping, name: str, beams: int) -> None:
    """Other inputs of the same shapes are loaded into the kept step's tensors (the same addresses, which a graph
    replays on): each call's result equals the lean path's on its own inputs; another batch size keeps another."""
    model, ids, mask = model_and_inputs(name, 3)
    _, other_ids, other_mask = model_and_inputs(name, 3, seed=SEEDS[name] + 10)
    assert other_ids.shape == ids.shape and not torch.equal(other_ids, ids)
    kwargs = dict(max_new_tokens=10, num_beams=beams, do_sample=False)
    first = search_model(model, input_ids=ids, attention_mask=mask, cuda_graphs=True, **kwargs)
    (kept,) = keeping._KEPT.values()
    addresses = [t.data_ptr() for t in kept.step.static_tensors()]
    second = search_model(model, input_ids=other_ids, attention_mask=other_mask, cuda_graphs=True, **kwargs)
    third = search_model(model, input_ids=ids, attention_mask=mask, cuda_graphs=True, **kwargs)
    assert keeping.kept_count() == 1 and [t.data_ptr() for t in kept.step.static_tensors()] == addresses
    assert_same_search(search_model(model, input_ids=other_ids, attention_mask=other_mask, **kwargs), second)
    assert_same_search(search_model(model, input_ids=ids, attention_mask=mask, **kwargs), first)
    assert_same_search(first, third)
    search_model(model, input_ids=ids[:2], attention_mask=mask[:2], cuda_graphs=True, **kwargs)  # bucket 2
    assert keeping.kept_count() == 2


def test_kept_steps_are_bounded_and_a_failed_call_drops_its_own(keeping, monkeypatch) -> None:
    model, ids, mask = model_and_inputs("gpt2", 1)
    monkeypatch.setattr(keeping, "MAX_KEPT", 3)
    for new_tokens in range(2, 7):  # five lengths: five keys
        search_model(model, input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, cuda_graphs=True)
    assert keeping.kept_count() == 3
    original = GraphT5.decode

    def poisoned(self, tokens, position):
        return original(self, tokens, position).masked_fill(position == 1, float("nan"))

    monkeypatch.setattr(GraphT5, "decode", poisoned)
    t5_model, t5_ids, t5_mask = model_and_inputs("t5", 2)
    with pytest.raises(SearchError, match="at step 1"):
        search_model(t5_model, input_ids=t5_ids, attention_mask=t5_mask, max_new_tokens=4, min_new_tokens=4,
                     cuda_graphs=True)
    assert keeping.kept_count() == 3 and all(kept.model is model for kept in keeping._KEPT.values())
    keeping.release()
    assert keeping.kept_count() == 0


def test_a_kept_step_that_fails_is_dropped(keeping, monkeypatch) -> None:
    model, ids, mask = model_and_inputs("t5", 2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, cuda_graphs=True)
    search_model(model, **kwargs)
    assert keeping.kept_count() == 1
    original = GraphT5.decode
    monkeypatch.setattr(GraphT5, "decode", lambda self, tokens, position: original(self, tokens, position).masked_fill(
        position == 2, float("nan")))
    with pytest.raises(SearchError, match="at step 2"):
        search_model(model, **kwargs)
    assert keeping.kept_count() == 0


def test_the_capture_path_with_a_stand_in_for_the_device(keeping, monkeypatch) -> None:
    """The driver's captured path on the CPU, CUDA's part stood in for: warm-up steps run eagerly, the capture
    records the step without its effects (the state is restored, as a real capture runs no kernel) and a replay
    runs it. Two warm-up steps, one capture per shape, replays for every later step and call, the flags read every
    4 steps (and after the last), and the results of the eager path."""
    from beamsearch.graphs.runner import StepRunner
    from beamsearch.graphs.search_state import SearchFlags

    events: list[str] = []

    class StandIn:
        def __init__(self, step):
            self.step = step

        def replay(self):
            events.append("replay")
            self.step()

    def record(self):
        events.append("capture")
        saved = [tensor.clone() for tensor in self.step.static_tensors()]
        self.step()
        for tensor, value in zip(self.step.static_tensors(), saved, strict=True):
            tensor.copy_(value)
        return StandIn(self.step)

    def warm_up(self):
        events.append("warm-up")
        self.step()

    read = SearchFlags.read

    def counted_read(self):
        events.append("read")
        return read(self)

    monkeypatch.setattr(driver, "captures", lambda device: True)
    monkeypatch.setattr(StepRunner, "_record", record)
    monkeypatch.setattr(StepRunner, "_warm_up", warm_up)
    monkeypatch.setattr(SearchFlags, "read", counted_read)
    model, ids, mask = model_and_inputs("t5", 3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=3, do_sample=False,
                  min_new_tokens=10)  # ten steps, whatever the end token
    for call in range(2):
        events.clear()
        assert_same_search(search_model(model, **kwargs), search_model(model, cuda_graphs=True, **kwargs))
        steps = [e for e in events if e != "read"]
        if call == 0:
            assert steps == ["warm-up", "warm-up", "capture", *["replay"] * 8]
        else:
            assert steps == ["replay"] * 10
        done, reads = 0, []
        for event in events:
            done += event in ("warm-up", "replay")
            if event == "read":
                reads.append(done)
        assert reads == [4, 8, 10]  # every 4 steps and after the last


def test_on_cuda_the_default_takes_the_graph_path_where_the_call_allows_it(monkeypatch, caplog) -> None:
    """``cuda_graphs`` unset: the graph path where steps are captured (CUDA; here the CPU stands in for it) and the
    call and the model allow it, else the eager path with the reason at debug level; ``cuda_graphs=False`` turns it
    off; on the CPU the default stays eager."""
    import logging

    from beamsearch.adapters import hf as hf_adapter

    model, ids, mask = model_and_inputs("gpt2", 3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=3)
    ran = []
    original = hf_adapter.graph_search
    monkeypatch.setattr(hf_adapter, "graph_search", lambda *args, **kw: ran.append(1) or original(*args, **kw))
    search_model(model, **kwargs)
    assert ran == []  # the CPU: eager
    monkeypatch.setattr(hf_adapter, "captures", lambda device: True)
    default = search_model(model, **kwargs)
    asked = search_model(model, cuda_graphs=True, **kwargs)
    assert ran == [1, 1]
    assert torch.equal(default.sequences, asked.sequences)
    assert torch.equal(default.sequences_scores, asked.sequences_scores)
    search_model(model, cuda_graphs=False, **kwargs)
    assert ran == [1, 1]
    with caplog.at_level(logging.DEBUG, logger="beamsearch"):
        search_model(model, do_sample=True, **kwargs)
        handle = model.transformer.h[0].attn.register_forward_hook(lambda module, args, output: output)
        try:
            search_model(model, **kwargs)
        finally:
            handle.remove()
    assert ran == [1, 1]
    assert "the graph path (CUDA graphs) does not run this call: cannot capture do_sample=True" in caplog.text
    assert "does not run this call: transformer.h.0.attn has a forward hook" in caplog.text, caplog.text


@pytest.mark.parametrize(("flags", "expected"), [([], None), (["--cuda-graphs"], True),
                                                 (["--no-cuda-graphs"], False)])
def test_the_command_line_asks_for_turns_off_or_leaves_the_graph_path_to_the_default(flags, expected) -> None:
    from beamsearch.cli.flags import build_parser, generation_options

    options = generation_options(build_parser().parse_args(["decode", "words.txt", *flags]))
    assert options.get("cuda_graphs") == expected
