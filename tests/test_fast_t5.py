"""The fast T5 step (``lean_step="fast"``, ``steps/t5/fast.py``): the same model computed in another order,
so its logits and encoder output equal the lean step's and transformers' to float rounding (never bitwise: other
kernels), its searches equal on the embedded G2P model's words, its int8 variant agrees, and it refuses clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_hf import T5_VOCAB, record_t5_states
from tiny_hf import random_t5 as t5

from beamsearch.adapters.hf import search_model
from beamsearch.quantize import quantize_int8
from beamsearch.steps.caches import StackedTimeMajorCache
from beamsearch.steps.t5 import fast as fast_t5
from beamsearch.steps.t5.lean import LeanT5State

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
G2P = ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict"
WORDS = ROOT / "src" / "beamsearch" / "data" / "cmudict" / "test.tsv"
VOCAB = T5_VOCAB


def padded_inputs(batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, 9), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        cut = int(torch.randint(0, 6, (1,), generator=generator))
        if cut:
            mask[row, -cut:] = 0
            ids[row, -cut:] = 0
    return ids, mask


def lean_and_fast(model, batch: int, seed: int, max_length: int) -> list:
    """The lean and the fast state of ``model`` over the same padded inputs' encoder output."""
    ids, mask = padded_inputs(batch, seed=seed)
    encoded = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return [LeanT5State(model, encoded, mask, max_length), fast_t5.FastT5State(model, encoded, mask, max_length)]


MODELS = [(False, False, "t5"), (True, False, "t5"), (False, True, "t5"), (True, True, "mt5")]


@pytest.mark.parametrize(("gated", "tied", "model_type"), MODELS)
@pytest.mark.parametrize("padded", [True, False])
def test_encoder_equals_the_models_encoder(gated, tied, model_type, padded):
    """The encoder's products run on the source tokens only (padding left out, zeros in the output there)."""
    assert_encoder_equals_the_models(t5(gated, tied, model_type=model_type), fast_t5.fast_t5_encode, padded)


def assert_encoder_equals_the_models(model, encode, padded: bool) -> None:
    """``encode(model, ids, mask)`` against the model's encoder: equal within 1e-4 at the tokens, zeros at the
    padding, and without a mask equal to the model's on unpadded inputs."""
    ids, mask = padded_inputs(5, seed=1)
    if not padded:
        mask = torch.ones_like(mask)
    with torch.no_grad():
        expected = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        got = encode(model, ids, mask)
        unmasked = encode(model, ids, None)
    kept = mask.bool()
    torch.testing.assert_close(got[kept], expected[kept], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[~kept], torch.zeros_like(got[~kept]))
    if not padded:
        torch.testing.assert_close(unmasked, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("gated", "tied", "model_type"), MODELS)
@pytest.mark.parametrize("beams", [1, 3])
def test_each_step_equals_the_lean_step(gated, tied, model_type, beams):
    """Both states fed the same tokens, step by step, with rows expanded to beams and reordered between steps:
    the logits agree to float rounding at every step."""
    model = t5(gated, tied, model_type=model_type)
    with torch.no_grad():
        lean, fast = lean_and_fast(model, 4, seed=2, max_length=12)
        for expected, got in in_lockstep(lean, fast, 4, beams, steps=10, seed=3, vocab=VOCAB):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def in_lockstep(first, second, examples: int, beams: int, steps: int, seed: int, vocab: int):
    """Two T5 states fed the same tokens: rows expanded to ``beams`` per example, then at every step a random beam
    reorder within each example and random next tokens. Yields each step's logits ``(first's, second's)``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(examples * beams, 1, dtype=torch.long)
    for state in (first, second):
        state.reorder(torch.arange(examples).repeat_interleave(beams))
    for step in range(steps):
        yield tuple(state.prefill(tokens) if step == 0 else state.forward(tokens[:, -1]) for state in (first, second))
        parents = (torch.randint(beams, (examples, beams), generator=generator)
                   + torch.arange(examples)[:, None] * beams).view(-1)
        for state in (first, second):
            state.reorder(parents)
        tokens = torch.cat([tokens.index_select(0, parents),
                            torch.randint(2, vocab, (examples * beams, 1), generator=generator)], dim=1)


def test_examples_leaving_keep_the_others_right():
    """Whole examples leave the batch (the engine's compaction): the cross state and the cache follow."""
    model = t5(False, False)
    with torch.no_grad():
        states = lean_and_fast(model, 4, seed=4, max_length=8)
        tokens = torch.zeros(8, 1, dtype=torch.long)
        for state in states:
            state.reorder(torch.arange(4).repeat_interleave(2))
            state.prefill(tokens)
            state.forward(torch.full((8,), 5))
            state.reorder(torch.tensor([6, 7, 2, 3]))  # examples 3 and 1 stay, in that order
        expected, got = (state.forward(torch.tensor([7, 8, 9, 10])) for state in states)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_cache_capacity_grows_past_max_length():
    model = t5(False, False)
    with torch.no_grad():
        states = lean_and_fast(model, 2, seed=5, max_length=2)
        for state in states:
            state.prefill(torch.zeros(2, 1, dtype=torch.long))
        for token in range(2, 7):  # past the capacity of 2: the cache and the bias table grow
            expected, got = (state.forward(torch.full((2,), token)) for state in states)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert isinstance(states[1].cache, StackedTimeMajorCache) and states[1].cache.capacity >= 7


@pytest.mark.parametrize("beams", [1, 4])
def test_search_equals_generate_on_random_models(beams):
    """Whole searches through the adapter (fast encoder and step) against transformers' generate: tokens equal
    (these random models have no candidates within float rounding of each other), beam scores to 1e-4."""
    for seed in range(6):
        model = t5(seed % 2 == 1, seed % 3 == 0, seed=seed)
        ids, mask = padded_inputs(3, seed=seed)
        kwargs = {"num_beams": beams, "max_new_tokens": 8, "do_sample": False, "num_return_sequences": 1}
        with torch.no_grad():
            expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs, return_dict_in_generate=True,
                                      output_scores=True)
            got = search_model(model, input_ids=ids, attention_mask=mask, lean_step="fast", **kwargs)
        length = expected.sequences.shape[1]
        assert torch.equal(got.sequences[:, 0, :length], expected.sequences)
        if beams > 1:
            torch.testing.assert_close(got.sequences_scores[:, 0], expected.sequences_scores, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def g2p():
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(G2P).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(G2P)
    lines = WORDS.read_text(encoding="utf-8").splitlines()
    words = sorted((line.split("\t")[0].lower() for line in lines[:256] if line), key=len)
    return model, tokenizer, words


def _best(model, tokenizer, words, **kwargs):
    outputs = []
    for start in range(0, len(words), 64):
        batch = tokenizer(words[start : start + 64], return_tensors="pt", padding=True)
        result = search_model(model, **batch, **kwargs)
        outputs += [tokenizer.decode(row[0], skip_special_tokens=True) for row in result.sequences]
    return outputs


@pytest.mark.parametrize("beams", [1, 5])
def test_g2p_words_equal_the_lean_step(g2p, beams):
    """The embedded model on 256 test words: the fast step's best output (the default) equals the lean step's
    (transformers' kernels) on at least 99% of words (issue 21's bar; on this machine all of them)."""
    model, tokenizer, words = g2p
    expected = _best(model, tokenizer, words, num_beams=beams, lean_step=True)
    got = _best(model, tokenizer, words, num_beams=beams)
    same = sum(a == b for a, b in zip(expected, got, strict=True))
    assert same >= 0.99 * len(words), f"{len(words) - same} of {len(words)} words differ"


def test_g2p_int8_agrees_with_the_int8_lean_step(g2p):
    """int8: the fast step requantizes its folded, stacked weights per output row, the lean step runs the
    quantized model's per-tensor layers: both are int8 approximations of the same model, so they agree on most
    words, not all (the WER of each is measured by benchmarks/g2p_speed.py)."""
    model, tokenizer, words = g2p
    quantized = quantize_int8(model)
    expected = _best(quantized, tokenizer, words, num_beams=1)
    got = _best(quantized, tokenizer, words, num_beams=1, lean_step="fast")
    same = sum(a == b for a, b in zip(expected, got, strict=True))
    assert same >= 0.9 * len(words), f"{len(words) - same} of {len(words)} words differ"
    assert fast_t5.fast_weights(quantized).decoder_layers[0]["qkv"].int8


def test_packed_weights_follow_parameter_updates():
    model = t5(False, False)
    ids, mask = padded_inputs(2, seed=6)
    with torch.no_grad():
        before = fast_t5.fast_t5_encode(model, ids, mask)
        assert fast_t5.fast_weights(model) is fast_t5.fast_weights(model)  # packed once
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(2.0)  # an in-place update
        after = fast_t5.fast_t5_encode(model, ids, mask)
        expected = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    kept = mask.bool()
    assert not torch.allclose(before[kept], after[kept])
    torch.testing.assert_close(after[kept], expected[kept], rtol=1e-4, atol=1e-4)


def test_refusals_name_the_reason():
    model = t5(False, False)
    ids, mask = padded_inputs(2, seed=7)
    with pytest.raises(ValueError, match="lean_step must be None, True, False or 'fast', got 'fastest'"):
        search_model(model, input_ids=ids, attention_mask=mask, lean_step="fastest")
    with pytest.raises(ValueError, match="leave share_encoder_state unset"):
        search_model(model, input_ids=ids, attention_mask=mask, lean_step="fast", share_encoder_state=True)
    with pytest.raises(ValueError, match="no fixed-shape variant"):
        search_model(model, input_ids=ids, attention_mask=mask, lean_step="fast", compile_step="static")
    with pytest.raises(ValueError, match="exact_parity=True runs the generic step"):
        search_model(model, input_ids=ids, attention_mask=mask, lean_step="fast", exact_parity=True)
    with pytest.raises(ValueError, match="lean_step='fast' cannot run this call: the model's dtype is torch.float16"):
        search_model(t5(False, False).half(), input_ids=ids, attention_mask=mask, lean_step="fast")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="lean_step='fast' cannot run this call: model_type 'gpt2' is not T5"):
        search_model(gpt2.eval(), input_ids=ids, max_new_tokens=2, lean_step="fast")


def test_cli_step_flags(tmp_path, capsys, monkeypatch):
    """``decode`` runs the fast step by default, ``--fast`` too, ``--lean-step`` the lean step: the embedded model's
    outputs equal on these words (scores to float rounding); a model the fast step cannot run is refused by
    ``--fast`` with the reason, nothing written."""
    import shutil

    from beamsearch.cli import main

    states = record_t5_states(monkeypatch)
    words = tmp_path / "words.txt"
    words.write_text("hello\nbeam\nsearch\npronunciation\ninternationalization\ndog's\n", encoding="utf-8")
    rows = {}
    for name, extra, state in (("default", [], "FastT5State"), ("fast", ["--fast"], "FastT5State"),
                               ("lean", ["--lean-step"], "LeanT5State")):
        states.clear()
        assert main(["decode", str(words), "--num-beams", "4", "--num-return-sequences", "2", "--format", "tsv",
                     *extra]) == 0
        rows[name] = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
        assert set(states) == {state}, name
    for lean, default, fast in zip(rows["lean"], rows["default"], rows["fast"], strict=True):
        assert default == fast
        assert lean[:3] + lean[4:] == fast[:3] + fast[4:]  # all but the score
        assert abs(float(lean[3]) - float(fast[3])) < 1e-4
    with pytest.raises(SystemExit):
        main(["decode", str(words), "--fast", "--lean-step"])  # one or the other
    capsys.readouterr()
    folder = tmp_path / "lm"
    config = transformers.GPT2Config(vocab_size=101, n_embd=16, n_layer=1, n_head=2, n_positions=32, eos_token_id=1,
                                     pad_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(G2P / name, folder / name)
    output = tmp_path / "out.tsv"
    assert main(["decode", str(words), "--model", str(folder), "--fast", "--output", str(output)]) == 2
    assert "lean_step='fast' cannot run this call: model_type 'gpt2' is not T5" in capsys.readouterr().err
    assert not output.exists()


def test_the_default_is_fast_on_float32_and_lean_on_int8(monkeypatch):
    """``lean_step=None``: the fast step on a float32 T5 model, the lean step on its int8 copy (whose products the
    fast step would requantize) and with the lean step's own options; ``lean_step="fast"`` on the int8 copy."""

    model = t5(False, False)
    ids, mask = padded_inputs(3, seed=8)
    states = record_t5_states(monkeypatch)
    quantized = quantize_int8(model)
    for chosen, options, expected in ((model, {}, "FastT5State"), (quantized, {}, "LeanT5State"),
                                      (quantized, {"lean_step": "fast"}, "FastT5State"),
                                      (model, {"share_encoder_state": True}, "LeanT5State"),
                                      (model, {"lean_step": True}, "LeanT5State")):
        states.clear()
        search_model(chosen, input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=4, **options)
        assert set(states) == {expected}, options


def test_the_fast_encoder_runs_with_generation_options(monkeypatch):
    """The fast encoder replaces transformers' on a plain call, generation options included (``num_beams``,
    ``max_new_tokens``: they go to the generation config, not to the encoder); attention outputs leave the encoder to
    the model. Where the call then cannot run the fast step (a ``decoder_attention_mask``), the step gets the model's
    own encoder output, as generate makes it: the results equal the generic step's bit for bit."""
    from beamsearch.adapters import hf_inputs

    model = t5(False, False, seed=3)
    ids, mask = padded_inputs(3, seed=9)
    encoded = []
    original = hf_inputs.prepare

    def recording(*args, **kwargs):
        setup = original(*args, **kwargs)
        encoded.append(setup)  # its "fast_encoded" read after the call, which may have re-encoded
        return setup

    monkeypatch.setattr(hf_inputs, "prepare", recording)
    monkeypatch.setattr("beamsearch.adapters.hf.prepare", recording)
    options = dict(num_beams=3, max_new_tokens=5, do_sample=False)
    search_model(model, input_ids=ids, attention_mask=mask, **options)
    search_model(model, input_ids=ids, attention_mask=mask, **options, lean_step=True)
    search_model(model, input_ids=ids, attention_mask=mask, **options, output_attentions=True)
    assert [setup["fast_encoded"] for setup in encoded] == [True, False, False]
    encoded.clear()
    start = torch.zeros(3, 1, dtype=torch.long)
    with torch.no_grad():
        fallback = search_model(model, input_ids=ids, attention_mask=mask, decoder_input_ids=start,
                                decoder_attention_mask=torch.ones_like(start), **options)
        generic = search_model(model, input_ids=ids, attention_mask=mask, decoder_input_ids=start,
                               decoder_attention_mask=torch.ones_like(start), **options, lean_step=False)
    assert [setup["fast_encoded"] for setup in encoded] == [False, False]  # re-encoded by the model (first)
    assert torch.equal(fallback.sequences, generic.sequences)
    assert torch.equal(fallback.sequences_scores, generic.sequences_scores)


def test_the_fast_default_is_for_the_cpu():
    """Off the CPU the default is the lean step (the fast step is built and measured for CPU kernels); a model on
    the meta device stands in for a GPU here."""
    from beamsearch.steps.chooser import default_fast, fast_capable

    model = t5(False, False)
    assert default_fast(model)
    elsewhere = t5(False, False).to("meta")
    assert fast_capable(elsewhere) and not default_fast(elsewhere)


def test_the_weights_are_checked_once_per_call_and_again_at_the_next(monkeypatch):
    """The encoder and the decoder state of one call share one check of the weights (``one_check_per_call``); each
    sub-batch of ``max_rows`` and each later call checks again, so weights changed between calls are packed again."""
    from beamsearch.steps.gate import WeightStamp
    from beamsearch.steps.t5 import packed

    model = t5(False, False)
    ids, mask = padded_inputs(4, seed=7)
    checks = []
    current = WeightStamp.current
    monkeypatch.setattr(WeightStamp, "current", lambda self, m: checks.append(m) or current(self, m))
    options = {"attention_mask": mask, "max_new_tokens": 5, "num_beams": 2, "lean_step": "fast"}
    packed.fast_weights(model)  # packed before the calls counted
    with torch.no_grad():
        first = search_model(model, ids, **options).sequences
        assert len(checks) == 1  # not once for the encoder and once for the state
        search_model(model, ids, **options, max_rows=4)  # two sub-batches of two examples (beam 2)
        assert len(checks) == 3
        model.decoder.block[0].layer[2].DenseReluDense.wo.weight.mul_(3.0)  # changed between calls
        changed = search_model(model, ids, **options).sequences
        reference = search_model(model, ids, **{**options, "lean_step": True}).sequences
    assert torch.equal(changed, reference) and not torch.equal(changed, first)
