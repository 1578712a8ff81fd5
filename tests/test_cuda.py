"""The library on a CUDA device: each search against the same search on the CPU, and the Hugging Face adapter
against ``model.generate`` on the device. Every test is skipped without a GPU.

The CPU and the GPU run other kernels (log-softmax, reductions, top-k, the model's matrix products), so results
are compared as docs/testing.md says: tokens exactly, except where the reference's own decision nearly tied
where the outputs part (``parity_grid.reference_margin``, for greedy and Hugging Face beam search; the other
searches have no margin helper, so their tokens must be equal), and scores within ``numerics.score_tolerance``.
The fake models give the same logits on both devices (a table lookup) or run a small GRU on each (other kernels).
Sampling draws differently on another device, so sampled results are checked for validity instead: shapes,
finish reasons, and token log-probs equal to the model's log-probs recomputed in float64 on the CPU; against
``model.generate`` on the same device, the same seed draws the same tokens. NaN logits on the device raise
:class:`beamsearch.SearchError` naming the step and the example, and leave the device usable (no device assert).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types

import pytest
import test_bad_values as bad_values
import torch
from fakes import GRUDecoder
from numerics import assert_scores_close, near_tie
from parity_grid import _same_rows, assert_bitwise_output, assert_equivalent_output, reference_margin
from tiny_hf import generate_both, random_inputs, tiny_model

import beamsearch
from beamsearch import FinishReason, SearchError

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB, PAD, EOS = 12, 0, 1
START = torch.tensor([[2, 5], [3, 7], [4, 4], [9, 2]])  # [B, t0]
SOURCE = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 3], [5, 5, 6, 2, 2], [7, 3, 9, 4, 11]])  # the GRU's [B, S]
BASE = {"max_new_tokens": 8, "eos_token_id": EOS, "pad_token_id": PAD}
TABLE_ROWS = 1009
NAN, INF = float("nan"), float("inf")


class TableModel:
    """Logits that depend on the whole prefix, looked up (by a hash of it) in a fixed random table kept on
    ``device``: the same float32 logits on every device, so that a CPU and a GPU search differ only in the
    library's own arithmetic."""

    def __init__(self, device: str, vocab: int = VOCAB, seed: int = 0, sharpness: float = 3.0, eos_boost: float = 2.0):
        generator = torch.Generator().manual_seed(seed)
        self.host_table = torch.randn(TABLE_ROWS, vocab, generator=generator) * sharpness  # [R, V]
        self.host_table[:, EOS] += eos_boost  # hypotheses end at varied steps
        self.table = self.host_table.to(device)

    @staticmethod
    def keys(tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [N, t]`` -> ``[N]`` rows of the table."""
        weights = torch.arange(1, tokens.shape[1] + 1, device=tokens.device) * 7919 + 13
        return (tokens * weights).sum(dim=1) % TABLE_ROWS

    def __call__(self, tokens: torch.Tensor, state):
        return self.table[self.keys(tokens)], state

    def log_probs(self, prefix: list[int]) -> torch.Tensor:
        """The next-token log-probs ``[V]`` after ``prefix``, in float64 on the CPU."""
        return torch.log_softmax(self.host_table.double()[self.keys(torch.tensor([prefix]))[0]], dim=-1)


def run(model: str, device: str, **options) -> beamsearch.SearchResult:
    """One search with the table model or the GRU decoder on ``device``."""
    options = dict(BASE, **options)
    if "source_lengths" in options:
        options["source_lengths"] = torch.tensor(options["source_lengths"], device=device)
    if model == "table":
        step, state = TableModel(device), None
    else:
        decoder = GRUDecoder(vocab_size=VOCAB)  # seeded: the same weights on both devices
        with torch.no_grad():
            decoder.out.bias[EOS] += 1.5  # hypotheses end at varied steps
            decoder.to(device)
            state = decoder.initial_state(SOURCE.to(device))
        step = decoder.step_cached
    return beamsearch.search(step, START.to(device), state, **options)


def on_host(result):
    """A search result or a Hugging Face output with every tensor moved to the CPU."""
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.cpu()
        return tuple(move(v) for v in value) if isinstance(value, tuple) else value

    if isinstance(result, torch.Tensor):
        return result.cpu()
    if dataclasses.is_dataclass(result) and not hasattr(result, "items"):
        return dataclasses.replace(result, **{f.name: move(getattr(result, f.name))
                                              for f in dataclasses.fields(result)})
    return type(result)(**{key: move(value) for key, value in result.items()})


def assert_on_device(result) -> None:
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        for tensor in value if isinstance(value, tuple) else (value,):
            if isinstance(tensor, torch.Tensor):
                assert tensor.device.type == torch.device(DEVICE).type, (field.name, tensor.device)


def assert_device_healthy() -> None:
    """A device-side assert would poison the context: the next synchronising operation would raise."""
    torch.cuda.synchronize()
    assert float(torch.ones(4, device=DEVICE).sum()) == 4.0


def flat(result) -> types.SimpleNamespace:
    """``sequences [B*n, T]`` and ``sequences_scores [B*n]``: the layout ``reference_margin`` reads."""
    return types.SimpleNamespace(sequences=result.sequences.flatten(0, 1),
                                 sequences_scores=result.sequences_scores.flatten())


def _assert_same_history(got, reference) -> None:
    """Equal beam indices, except between hypotheses of one example that are the same output with the same score
    (diverse beam search finds one output in two groups; which one ranks first is the tie order of the device's
    top-k)."""
    for b in range(reference.sequences.shape[0]):
        if torch.equal(got.beam_indices[b], reference.beam_indices[b]):
            continue
        differ = [j for j in range(reference.sequences.shape[1])
                  if not torch.equal(got.beam_indices[b, j], reference.beam_indices[b, j])]
        for j in differ:
            twins = [i for i in range(reference.sequences.shape[1]) if i != j
                     and torch.equal(reference.sequences[b, i], reference.sequences[b, j])
                     and float(reference.sequences_scores[b, i]) == float(reference.sequences_scores[b, j])]
            assert twins, ("beam indices differ for a hypothesis without a tied twin", b, j)
            assert any(torch.equal(got.beam_indices[b, j], reference.beam_indices[b, i]) for i in twins)


def assert_same_search(reference, result, rerun=None, kwargs=None) -> None:
    """``result`` (the device) against ``reference`` (the CPU): tokens, lengths and finish reasons equal, unless
    ``rerun`` shows the reference nearly tied where they part; scores within the score tolerance."""
    assert_on_device(result)
    got = on_host(result)
    b, n = reference.sequences.shape[:2]
    same = _same_rows(reference.sequences.flatten(0, 1), got.sequences.flatten(0, 1)).reshape(b, n)
    if not bool(same.all()):
        assert rerun is not None, ("sequences differ", reference.sequences, got.sequences)
        margin, magnitude, dtype = reference_margin(flat(reference), flat(got), rerun, kwargs)
        assert near_tie(margin, magnitude, dtype), (f"sequences differ where the CPU's margin is {margin:.3g}",
                                                    reference.sequences, got.sequences)
    for name in ("sequences_scores", "sum_log_probs"):
        assert_scores_close(getattr(got, name)[same], getattr(reference, name)[same])
    for name in ("lengths", "finish_reason", "unmet_constraints"):
        if getattr(reference, name) is not None:
            assert torch.equal(getattr(got, name)[same], getattr(reference, name)[same]), name
    if bool(same.all()):
        assert_scores_close(got.token_log_probs, reference.token_log_probs)
        if reference.beam_indices is not None:
            _assert_same_history(got, reference)
        for name in ("scores", "logits"):
            want, have = getattr(reference, name), getattr(got, name)
            assert (want is None) == (have is None), name
            for step_got, step_want in zip(have or (), want or (), strict=True):
                assert_scores_close(step_got, step_want)


# ---------------------------------------------------------------------------------------------- searches: GPU = CPU

SEARCHES = {
    "greedy": {},
    "greedy with scores": {"output_scores": True, "output_logits": True},
    "beam": {"num_beams": 4, "num_return_sequences": 2},
    "beam early": {"num_beams": 3, "early_stopping": True, "length_penalty": 0.5},
    "beam never": {"num_beams": 5, "early_stopping": "never", "length_penalty": 2.0, "output_scores": True},
    "beam processors": {"num_beams": 4, "no_repeat_ngram_size": 2, "repetition_penalty": 1.3, "min_new_tokens": 2,
                        "suppress_tokens": [3], "bad_words_ids": [[4, 5]]},
    "ct2": {"num_beams": 3, "semantics": "ct2", "num_return_sequences": 2},
    "onmt": {"num_beams": 3, "semantics": "onmt", "max_length_ratio": 1.5, "block_ngram_repeat": 2,
             "source_lengths": [5, 6, 4, 7]},
    "t2t": {"num_beams": 3, "semantics": "t2t"},
    "group": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5, "num_return_sequences": 2},
    "constrained": {"num_beams": 4, "force_words_ids": [[5], [6, 7]]},
    "target prefix": {"num_beams": 3, "target_prefix": [[5, 6], [], [7], [8, 9, 10]]},
}
# greedy and Hugging Face beam search: parity_grid.reference_margin rebuilds the reference's ranking
MARGIN_CHECKED = {"greedy", "greedy with scores", "beam", "beam early", "beam never", "beam processors"}


@pytest.mark.parametrize("model", ["table", "gru"])
@pytest.mark.parametrize("name", list(SEARCHES))
def test_search_on_the_device_equals_the_cpu(model, name):
    """Examples leave the batch on the device (the default) and stay on the CPU reference (so that the recording
    re-run of ``reference_margin`` computes the reference's rows again, on the same shapes)."""
    options = SEARCHES[name]
    reference = run(model, "cpu", **options, remove_finished=False)
    result = run(model, DEVICE, **options)
    rerun = None
    if name in MARGIN_CHECKED:
        def rerun(processors):
            return flat(run(model, "cpu", **options, remove_finished=False, logits_processor=list(processors)))
    assert_same_search(reference, result, rerun, dict(BASE, **options))


@pytest.mark.parametrize("model", ["table", "gru"])
def test_the_fake_models_end_hypotheses_at_varied_steps(model):
    """Otherwise no example would leave the batch, and finished pools would not be exercised."""
    for options in ({}, SEARCHES["beam"]):
        lengths = run(model, "cpu", **options).lengths
        assert lengths.min() < lengths.max(), options


# ---------------------------------------------------------------------------------------------- sampling: validity


def assert_valid_samples(result, model: TableModel, distribution=None) -> None:
    """Each hypothesis keeps its prompt, ends at its first EOS (reason EOS) or at the length limit (reason
    MAX_LENGTH), is padded after its end, and its token log-probs equal ``distribution(model log-probs)`` at each
    position (float64 on the CPU; the model's own log-probs by default) within the score tolerance."""
    assert_on_device(result)
    r = on_host(result)
    t0, limit = r.prompt_length, r.prompt_length + BASE["max_new_tokens"]
    assert r.sequences.shape[0] == START.shape[0] and r.sequences.shape[2] <= limit
    assert bool(((r.sequences >= 0) & (r.sequences < VOCAB)).all())
    for b in range(r.sequences.shape[0]):
        for j in range(r.sequences.shape[1]):
            sequence, length = r.sequences[b, j].tolist(), int(r.lengths[b, j])
            generated = sequence[t0:length]
            assert sequence[:t0] == START[b].tolist()
            assert all(token == PAD for token in sequence[length:])
            if EOS in generated:
                assert generated.index(EOS) == len(generated) - 1
                assert int(r.finish_reason[b, j]) == FinishReason.EOS
            else:
                assert length == limit and int(r.finish_reason[b, j]) == FinishReason.MAX_LENGTH
            expected = []
            for position in range(t0, length):
                log_probs = model.log_probs(sequence[:position])
                log_probs = log_probs if distribution is None else distribution(log_probs)
                assert log_probs[sequence[position]] > -INF, "a token the distribution excludes was drawn"
                expected.append(float(log_probs[sequence[position]]))
            assert_scores_close(r.token_log_probs[b, j, : length - t0], torch.tensor(expected, dtype=torch.float64))
            assert bool((r.token_log_probs[b, j, length - t0 :] == 0).all())
            assert_scores_close(r.sum_log_probs[b, j], torch.tensor(sum(expected), dtype=torch.float64))


def top_k_at_temperature(k: int, temperature: float):
    def distribution(log_probs: torch.Tensor) -> torch.Tensor:
        scores = log_probs / temperature
        return torch.log_softmax(scores.masked_fill(scores < torch.topk(scores, k).values[-1], -INF), dim=-1)

    return distribution


@pytest.mark.parametrize("options, distribution", [
    ({}, None),
    ({"temperature": 0.7, "top_k": 4}, top_k_at_temperature(4, 0.7)),
])
def test_sampling_on_the_device_draws_valid_sequences(options, distribution):
    model = TableModel(DEVICE)
    torch.manual_seed(0)
    result = beamsearch.search(model, START.to(DEVICE), do_sample=True, num_return_sequences=8, **BASE, **options)
    assert result.sequences.shape[1] == 8
    assert_valid_samples(result, model, distribution)
    reasons = set(result.finish_reason.flatten().tolist())  # each of 32 draws ends at EOS with probability ~0.7
    assert reasons == {FinishReason.EOS, FinishReason.MAX_LENGTH}, reasons


def test_sampled_tokens_follow_the_distribution():
    """20,000 draws of one token on the device: each token's count within 5 standard deviations of its
    expectation (a wrong distribution, e.g. a uniform fill applied to valid rows, is far outside)."""
    rows, vocab = 20000, 5
    model = TableModel(DEVICE, vocab=vocab, seed=3, sharpness=1.0)
    torch.manual_seed(0)
    result = beamsearch.search(model, torch.tensor([[2]], device=DEVICE), do_sample=True, num_return_sequences=rows,
                               max_new_tokens=1)
    counts = torch.bincount(result.sequences[0, :, 1].cpu(), minlength=vocab).double()
    probs = model.log_probs([2]).exp()
    deviation = (counts - rows * probs).abs() / (rows * probs * (1 - probs)).sqrt()
    assert bool((deviation < 5).all()), (counts, rows * probs)


def test_beam_sampling_on_the_device_returns_valid_sorted_hypotheses():
    model = TableModel(DEVICE)
    torch.manual_seed(0)
    result = beamsearch.search(model, START.to(DEVICE), do_sample=True, num_beams=3, num_return_sequences=3, **BASE)
    assert_valid_samples(result, model)
    r = on_host(result)
    assert bool((r.sequences_scores[:, :-1] >= r.sequences_scores[:, 1:]).all())
    generated = (r.lengths - r.prompt_length).double()
    assert_scores_close(r.sequences_scores, r.sum_log_probs.double() / generated)  # length_penalty 1


def test_stochastic_beam_search_on_the_device_samples_distinct_sequences():
    model = TableModel(DEVICE)
    torch.manual_seed(0)
    result = beamsearch.search(model, START.to(DEVICE), num_beams=4, num_return_sequences=4,
                               stochastic_beam_search=True, **BASE)
    assert_valid_samples(result, model)
    r = on_host(result)
    assert bool(torch.isfinite(r.keys).all()) and bool((r.keys[:, :-1] >= r.keys[:, 1:]).all())
    assert bool((r.threshold <= r.keys[:, -1]).all())
    for b in range(START.shape[0]):
        assert len({tuple(s.tolist()) for s in r.sequences[b]}) == 4
    assert torch.equal(r.sequences_scores, r.sum_log_probs)


# ---------------------------------------------------------------------------------------------- NaN on the device

def corrupting_step(bad_step: int, bad_example: int, value: float, whole_row: bool = False):
    """test_bad_values' corrupting step (a random table, EOS unlikely) on the device, with its search modes."""
    return bad_values.corrupting_step(bad_step, bad_example, value, whole_row, device=DEVICE)


def search_corrupted(step, batch: int = 3, **options):
    return beamsearch.search(step, torch.ones(batch, 1, dtype=torch.long, device=DEVICE),
                             torch.arange(batch, device=DEVICE), max_new_tokens=5, **options)


@pytest.mark.parametrize("mode", list(bad_values.MODES))
@pytest.mark.parametrize(("bad_step", "bad_example"), [(0, 0), (2, 1), (4, 2)])  # step 4: the last one
def test_nan_logits_on_the_device_name_the_step_and_the_example(mode, bad_step, bad_example):
    """Sampling: the softmax row is NaN; on the device it is made uniform before ``torch.multinomial`` (whose
    check would be a device assert) and reported at the step's host sync."""
    step = corrupting_step(bad_step, bad_example, NAN)
    message = rf"^the model's logits hold NaN at step {bad_step} \(example {bad_example}\)$"
    with pytest.raises(SearchError, match=message):
        search_corrupted(step, **bad_values.MODES[mode])
    assert_device_healthy()


@pytest.mark.parametrize("mode", ["sample", "beam sample"])
def test_sampling_a_row_of_minus_infinity_on_the_device_is_a_search_error(mode):
    step = corrupting_step(1, 0, -INF, whole_row=True)
    with pytest.raises(SearchError, match=r"^the model's logits are -inf for every token .* at step 1 \(example 0\)$"):
        search_corrupted(step, batch=2, **bad_values.MODES[mode])
    assert_device_healthy()


def test_sampling_rows_masked_by_a_processor_on_the_device_is_a_search_error():
    def mask_example_one_at_step_two(input_ids, scores):
        if input_ids.shape[1] - 1 == 2:
            scores = scores.clone()
            scores[1] = -INF
        return scores

    with pytest.raises(SearchError, match=r"^the processed scores are -inf for every token .* at step 2 \(example 1\)"):
        search_corrupted(corrupting_step(99, 0, 0.0), batch=2, do_sample=True,
                         logits_processor=[mask_example_one_at_step_two])
    assert_device_healthy()


@pytest.mark.parametrize("num_beams", [1, 3])
def test_examples_keep_their_index_on_the_device_after_others_left(num_beams):
    bad_values.check_examples_keep_their_index(num_beams, device=DEVICE)
    assert_device_healthy()


# ---------------------------------------------------------------------------------------------- Hugging Face adapter


@functools.cache
def device_model(name: str, dtype: torch.dtype = torch.float32):
    """A copy of ``tiny_hf.tiny_model(name)`` on the device (the cached CPU model stays where it is)."""
    return copy.deepcopy(tiny_model(name)).to(DEVICE, dtype)


def device_inputs(name: str, batch: int = 3, seed: int = 7) -> dict:
    ids, mask = random_inputs(tiny_model(name), batch, torch.Generator().manual_seed(seed))
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)}


def host_recorders(processors):
    """``reference_margin``'s recording processors, fed CPU copies of transformers' tensors on the device."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class OnHost(LogitsProcessor):
        def __init__(self, processor):
            self.processor = processor

        def __call__(self, input_ids, scores):
            self.processor(input_ids.cpu(), scores.cpu())
            return scores

    return LogitsProcessorList([OnHost(p) for p in processors])


def assert_generate_matches_on_device(model, ours: dict, seed: int = 7, **kwargs):
    """``beamsearch.generate`` against ``model.generate``, both on the device: ``parity_grid``'s comparison of
    the fast default (tokens with the near-tie check, scores within the tolerance, sampling drawn alike)."""
    expected, actual = generate_both(model, ours, seed, **kwargs)
    assert actual.sequences.device == model.device

    def rerun(processors):
        torch.manual_seed(seed)
        return on_host(model.generate(**kwargs, logits_processor=host_recorders(processors)))

    assert_equivalent_output(on_host(expected), on_host(actual), rerun, kwargs)


GENERATE_CASES = {
    "greedy": dict(num_beams=1, do_sample=False, output_scores=True),
    "beam": dict(num_beams=4, num_return_sequences=2, do_sample=False, output_scores=True),
    "beam early": dict(num_beams=3, do_sample=False, early_stopping=True, length_penalty=0.5,
                       no_repeat_ngram_size=2),
    "sample": dict(do_sample=True, num_return_sequences=2, top_k=10),
    "beam sample": dict(num_beams=3, do_sample=True),
}
STEPS = [("t5", {"lean_step": True}), ("t5", {"lean_step": True, "share_encoder_state": True}),
         ("t5", {"lean_step": False}), ("gpt2", {"lean_step": True}), ("gpt2", {"lean_step": False}),
         ("llama", {"lean_step": True}), ("bart", {})]
STEP_IDS = ["-".join([name, "lean" if ours.get("lean_step") else "generic"]
                     + (["shared"] if ours.get("share_encoder_state") else [])) for name, ours in STEPS]


@pytest.mark.parametrize("case", list(GENERATE_CASES))
@pytest.mark.parametrize("name, ours", STEPS, ids=STEP_IDS)
def test_generate_on_the_device_matches_transformers(name, ours, case):
    """The lean T5 (also with ``share_encoder_state``), GPT-2 and Llama steps (``lean_step=True`` refuses to fall
    back) and the generic step."""
    assert_generate_matches_on_device(device_model(name), ours, **device_inputs(name), max_new_tokens=10,
                                      return_dict_in_generate=True, **GENERATE_CASES[case])


@pytest.mark.parametrize("name", ["t5", "gpt2"])
@pytest.mark.parametrize("case", ["greedy", "beam", "sample"])
def test_exact_parity_on_the_device_is_bitwise(name, case):
    """``exact_parity=True`` runs every forward on transformers' rows and shapes: the same kernels on the same
    device, so every output field is bit for bit transformers'."""
    model = device_model(name)
    expected, actual = generate_both(model, {"exact_parity": True}, 7, **device_inputs(name), max_new_tokens=10,
                                     return_dict_in_generate=True, output_logits=True, **GENERATE_CASES[case])
    assert_bitwise_output(on_host(expected), on_host(actual))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_half_precision_lean_gpt2_on_the_device(dtype, num_beams):
    """Half-precision weights, where a GPU runs them: tokens with the near-tie check and scores within the
    tolerance of ``dtype`` (the model computes in it; transformers and the lean step on other row counts)."""
    model, seed = device_model("gpt2", dtype), 7
    kwargs = dict(device_inputs("gpt2", batch=4), num_beams=num_beams, max_new_tokens=10, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
    expected, actual = (on_host(out) for out in generate_both(model, {"lean_step": True}, seed, **kwargs))
    same = _same_rows(expected.sequences, actual.sequences)
    if not bool(same.all()):
        def rerun(processors):
            return on_host(model.generate(**kwargs, logits_processor=host_recorders(processors)))

        margin, magnitude, _ = reference_margin(expected, actual, rerun, kwargs)
        assert near_tie(margin, magnitude, dtype), (margin, expected.sequences, actual.sequences)
    if num_beams > 1:
        assert_scores_close(actual.sequences_scores[same], expected.sequences_scores[same], dtype=dtype)
    if bool(same.all()):
        for step_got, step_want in zip(actual.scores, expected.scores, strict=True):
            assert_scores_close(step_got, step_want, dtype=dtype)


def test_max_rows_on_the_device_equals_one_batch():
    """Sub-batches of two examples: an example's result does not depend on its batch-mates (tokens exact, scores
    within the tolerance: other row counts)."""
    from beamsearch.adapters.hf import search_model

    model, inputs = device_model("gpt2"), device_inputs("gpt2", batch=5)
    whole = search_model(model, **inputs, num_beams=3, max_new_tokens=8)
    split = search_model(model, **inputs, num_beams=3, max_new_tokens=8, max_rows=6)
    assert_same_search(on_host(whole), split)


@pytest.mark.parametrize("options", [{}, {"num_beams": 2}, {"do_sample": True}, {"num_beams": 2, "max_rows": 4}])
def test_nan_from_a_processor_on_the_device_names_the_example(options):
    model = device_model("gpt2")
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13], [30, 6, 7], [14, 15, 16]], device=DEVICE)

    def poison(input_ids, scores):  # the prompt starting with 30 marks example 3, wherever its row is
        return scores.masked_fill(input_ids[:, :1] == 30, NAN)

    with pytest.raises(SearchError, match=r"^the processed scores hold NaN at step 0 \(example 3\)$"):
        beamsearch.generate(model, input_ids=ids, max_new_tokens=3, logits_processor=[poison], **options)
    assert_device_healthy()


def test_alternatives_on_the_device_equal_the_cpu():
    """``search_alternatives`` (the k best tokens after a prefix, each continued) on the device: the same tokens
    as on the CPU (no margin helper: exact), scores within the tolerance."""
    from beamsearch.adapters.hf_alternatives import search_alternatives

    inputs = device_inputs("t5", batch=2)
    options = dict(num_alternatives=3, target_prefix=[[5], []], num_beams=1, max_new_tokens=6)
    reference = search_alternatives(tiny_model("t5"), inputs["input_ids"].cpu(), inputs["attention_mask"].cpu(),
                                    **options)
    result = search_alternatives(device_model("t5"), inputs["input_ids"], inputs["attention_mask"], **options)
    assert_same_search(reference, result)


# ---------------------------------------------------------------------------------------------- CUDA graphs

GRAPH_CASES = {
    "greedy": dict(num_beams=1),
    "beam": dict(num_beams=4, num_return_sequences=2),
    "beam early": dict(num_beams=3, early_stopping=True, length_penalty=0.5, min_new_tokens=2),
}


@pytest.fixture
def graphs():
    """The graph path's kept steps, released before and after (each test captures its own)."""
    from beamsearch.graphs import reuse

    reuse.release()
    yield reuse
    reuse.release()
    torch.cuda.empty_cache()


def graph_search(model, **kwargs):
    from beamsearch.adapters.hf import search_model

    return search_model(model, cuda_graphs=True, **kwargs)


def fixed_inputs(name: str, batch: int, seed: int) -> dict:
    """Inputs ``[B, 6]`` with left padding of mixed lengths: the same shapes for every seed (one kept graph)."""
    from tiny_hf import left_padded_inputs

    pad = {"t5": 0, "gpt2": 1}.get(name, 2)  # llama, qwen2, mistral: 2
    ids, mask = left_padded_inputs(tiny_model(name).config.vocab_size, pad, batch, seed=seed, length=6)
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
@pytest.mark.parametrize("name", ["t5", "gpt2", "llama", "qwen2", "mistral"])
def test_cuda_graphs_equal_the_eager_path_on_the_device(graphs, name, case):
    """Captured and replayed (a batch of 3 in a bucket of 4), then replayed for other inputs of the same shapes:
    tokens equal the eager path's on the device, scores within the tolerance (other shapes: the graph path's rows
    attend over their example's whole cache under a mask)."""
    from beamsearch.adapters.hf import search_model

    model = device_model(name)
    kwargs = dict(max_new_tokens=10, do_sample=False, **GRAPH_CASES[case])
    for seed in (7, 8):  # the second call replays the kept graph on the first call's tensors
        inputs = fixed_inputs(name, 3, seed)
        assert_same_search(on_host(search_model(model, **inputs, **kwargs)), graph_search(model, **inputs, **kwargs))
    (kept,) = graphs._KEPT.values()
    assert isinstance(kept.runner.graph, torch.cuda.CUDAGraph)


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("name", ["t5", "gpt2", "llama", "qwen2", "mistral"])
def test_cuda_graphs_in_bfloat16_equal_transformers_up_to_near_ties(graphs, name, num_beams):
    model = device_model(name, torch.bfloat16)
    kwargs = dict(device_inputs(name, batch=4), num_beams=num_beams, max_new_tokens=10, do_sample=False)
    expected = on_host(model.generate(**kwargs, return_dict_in_generate=True, output_scores=True))
    result = on_host(graph_search(model, **kwargs))
    actual = flat(result)
    same = _same_rows(expected.sequences, actual.sequences)
    if not bool(same.all()):
        def rerun(processors):
            return on_host(model.generate(**kwargs, return_dict_in_generate=True, output_scores=True,
                                          logits_processor=host_recorders(processors)))

        margin, magnitude, _ = reference_margin(expected, actual, rerun, kwargs)
        assert near_tie(margin, magnitude, torch.bfloat16), (margin, expected.sequences, actual.sequences)
    if num_beams > 1:
        assert_scores_close(actual.sequences_scores[same], expected.sequences_scores[same], dtype=torch.bfloat16)


def test_cuda_graphs_capture_once_per_shape_and_sync_only_between_steps(graphs, monkeypatch):
    """A step is captured once per shape (later calls replay it), and its eager warm-up steps make no host
    synchronisation (torch's sync debug mode raises on one), so the captured step has none either."""
    from beamsearch.graphs.runner import StepRunner

    captures, warmups = [], []
    record, warm_up = StepRunner._record, StepRunner._warm_up

    def counted_record(self):
        captures.append(1)
        return record(self)

    def strict_warm_up(self):
        torch.cuda.set_sync_debug_mode("error")
        try:
            warm_up(self)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        warmups.append(1)

    monkeypatch.setattr(StepRunner, "_record", counted_record)
    monkeypatch.setattr(StepRunner, "_warm_up", strict_warm_up)
    model = device_model("gpt2")
    for seed in (1, 2, 3):
        graph_search(model, **fixed_inputs("gpt2", 5, seed), num_beams=3, max_new_tokens=12)
    graph_search(model, **fixed_inputs("gpt2", 2, 1), num_beams=3, max_new_tokens=12)  # another bucket
    assert len(captures) == 2 and len(warmups) == 4 and graphs.kept_count() == 2


@pytest.mark.parametrize("num_beams", [1, 3])
def test_cuda_graphs_nan_names_the_step_and_the_example_on_the_device(graphs, monkeypatch, num_beams):
    from beamsearch.steps.t5.graph import GraphT5

    original = GraphT5.decode

    def poisoned(self, tokens, position):  # example 1 from step 4 on: after the capture (two warm-up steps)
        logits = original(self, tokens, position)
        rows = torch.arange(logits.shape[0], device=logits.device) // self.cache.rows_per_example == 1
        return logits.masked_fill(rows[:, None] & (position >= 4), NAN)

    monkeypatch.setattr(GraphT5, "decode", poisoned)
    with pytest.raises(SearchError, match=r"at step 4 \(example 1\)$"):
        graph_search(device_model("t5"), **device_inputs("t5", batch=3), num_beams=num_beams, max_new_tokens=8,
                     min_new_tokens=8)
    assert_device_healthy()
    assert graphs.kept_count() == 0


@pytest.mark.parametrize("option", [dict(logits_processor=[lambda ids, scores: scores]), dict(max_time=5.0),
                                    dict(do_sample=True), dict(repetition_penalty=1.2)])
def test_cuda_graphs_refuse_what_needs_the_host_on_the_device(graphs, option):
    with pytest.raises(ValueError, match="^cuda_graphs=True cannot capture"):
        beamsearch.generate(device_model("gpt2"), **device_inputs("gpt2"), max_new_tokens=4, cuda_graphs=True,
                            **option)
    assert graphs.kept_count() == 0
