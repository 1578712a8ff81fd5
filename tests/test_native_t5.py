"""The native fast T5 step (``steps/t5/native.py`` and ``native.cpp``): the fast step's computation in one C++ call
per step. Its logits equal the eager fast step's and the model's own forward to float rounding, step by step with
beam reorders and finished examples leaving; whole searches equal ``model.generate`` on T5 models of several shapes;
where the extension cannot be built the eager fast step runs after one warning; ``BEAMSEARCH_NATIVE=0``, other
activations and a hooked model (the gate) leave it unused, saying why; int8 models run natively, their products
quantizing each input once per row."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from test_fast_t5 import assert_encoder_equals_the_models, in_lockstep
from tiny_hf import assert_generate_equivalent, random_t5

from beamsearch import extension
from beamsearch.adapters.hf import search_model
from beamsearch.quantize import quantize_int8
from beamsearch.steps.t5 import fast as fast_t5
from beamsearch.steps.t5 import native

transformers = pytest.importorskip("transformers")

# (d_model, d_kv, heads, layers, d_ff, tied): the G2P model's head size (32), a head size below one vector (8), one
# that is no multiple of 16 (20), an inner width H*d unlike d_model (3 x 10 = 30 from 24), a deeper stack
SHAPES = [(64, 32, 2, 2, 96, True), (24, 8, 3, 2, 40, False), (40, 20, 2, 1, 48, True), (24, 10, 3, 2, 40, False),
          (48, 16, 3, 4, 64, False)]
VOCAB = 48


@pytest.fixture(autouse=True)
def built(monkeypatch):
    """The extension (compiled on first use, about 35 s once): skipped, naming why, where it cannot be built."""
    monkeypatch.delenv(extension.ENVIRONMENT, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        reason = extension.extension_reason()
    if reason is not None:
        pytest.skip(f"the native T5 step cannot be built here: {reason}")


def t5_of_shape(shape, seed: int = 0):
    d_model, d_kv, heads, layers, d_ff, tied = shape
    config = transformers.T5Config(vocab_size=VOCAB, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=layers,
                                   num_decoder_layers=layers, num_heads=heads, feed_forward_proj="relu",
                                   tie_word_embeddings=tied, relative_attention_num_buckets=8,
                                   relative_attention_max_distance=12, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 2.0 / d_model**0.5)
    return model


def padded_inputs(batch: int, seed: int, length: int = 9):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        cut = int(torch.randint(0, length - 2, (1,), generator=generator))
        if cut:
            mask[row, -cut:] = 0
            ids[row, -cut:] = 0
    return ids, mask


def count_native_steps(monkeypatch) -> list[int]:
    """The rows of each native step call."""
    rows: list[int] = []
    original = native.NativeDecoder.step

    def step(self, tokens):
        rows.append(tokens.shape[0])
        return original(self, tokens)

    monkeypatch.setattr(native.NativeDecoder, "step", step)
    return rows


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padded", [True, False])
def test_the_encoder_equals_the_models(shape, padded):
    assert_encoder_equals_the_models(t5_of_shape(shape), native.native_t5_encode, padded)


def forward_logits(model, encoded, mask, example, tokens):
    """The model's own forward, uncached, on each row's whole prefix ``tokens [N, t]`` (row n of example
    ``example[n]``): the last position's logits ``[N, V]``."""
    hidden = encoded.index_select(0, example)
    output = model(encoder_outputs=(hidden,), attention_mask=mask.index_select(0, example), decoder_input_ids=tokens)
    return output.logits[:, -1]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beams", [1, 3])
def test_each_step_equals_the_eager_step_and_the_model(shape, beams):
    """The native, the eager fast state and the model's forward fed the same tokens: rows expanded to beams,
    reordered within their example every step, two examples leaving the batch after step 4, and the positions going
    past ``max_length`` (the bias table grows). Logits agree to float rounding at every step."""
    model = t5_of_shape(shape, seed=2)
    examples, max_length = 4, 6
    with torch.no_grad():
        ids, mask = padded_inputs(examples, seed=2)
        encoded = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        eager = fast_t5.FastT5State(model, encoded, mask, max_length)
        fast = fast_t5.FastT5State(model, encoded, mask, max_length, native=True)
        assert isinstance(fast.native, native.NativeDecoder) and eager.native is None
        example = torch.arange(examples).repeat_interleave(beams)  # [N]: each row's example
        generator = torch.Generator().manual_seed(3)
        tokens = torch.zeros(examples * beams, 1, dtype=torch.long)
        for state in (eager, fast):
            state.reorder(example)
        for step in range(10):
            expected = eager.prefill(tokens) if step == 0 else eager.forward(tokens[:, -1])
            got = fast.prefill(tokens) if step == 0 else fast.forward(tokens[:, -1])
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            reference = forward_logits(model, encoded, mask, example, tokens)
            torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
            alive = example.shape[0] // beams
            parents = torch.randint(beams, (alive, beams), generator=generator) + torch.arange(alive)[:, None] * beams
            parents = parents.view(-1)
            if step == 4:  # examples 0 and 2 finish: the others' rows stay, in their order
                parents = parents.view(alive, beams)[torch.tensor([1, 3])].view(-1)
            for state in (eager, fast):
                state.reorder(parents)
            example = example.index_select(0, parents)
            tokens = torch.cat([tokens.index_select(0, parents),
                                torch.randint(2, VOCAB, (parents.shape[0], 1), generator=generator)], dim=1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("search", [{"num_beams": 1}, {"num_beams": 3, "num_return_sequences": 2}])
def test_search_equals_generate(monkeypatch, shape, search):
    """Whole searches through the adapter (the default: the native encoder and step) against ``model.generate``:
    tokens equal, scores to float rounding (tests/tiny_hf.py's comparison)."""
    rows = count_native_steps(monkeypatch)
    for seed in range(2):
        model = t5_of_shape(shape, seed=seed)
        ids, mask = padded_inputs(3, seed=seed)
        assert_generate_equivalent(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                   return_dict_in_generate=True, output_scores=True, **search)
    assert rows  # the native step ran


@pytest.mark.parametrize("tied", [False, True])
def test_mt5_with_relu_runs_natively(monkeypatch, tied):
    """mT5 (no output scale) with a ReLU feed-forward: native, and equal to ``model.generate``."""
    rows = count_native_steps(monkeypatch)
    model = random_t5(False, tied, model_type="mt5", seed=3)
    ids, mask = padded_inputs(3, seed=3)
    for beams in (1, 3):
        assert_generate_equivalent(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=beams,
                                   do_sample=False, return_dict_in_generate=True, output_scores=True)
    assert rows


def test_finished_examples_leave_the_call(monkeypatch):
    """The embedded G2P model, greedy and beam 4, on words of 2-15 letters: examples finish at different steps and
    leave the batch (later calls compute fewer rows); the outputs equal the lean step's (the model's own modules)."""
    from beamsearch.cli.decoding import EMBEDDED_MODEL

    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(EMBEDDED_MODEL).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    words = ["ox", "beam", "search", "native", "pronunciation", "internationalize", "cat", "dog's", "zebra"]
    inputs = tokenizer(words, return_tensors="pt", padding=True)
    rows = count_native_steps(monkeypatch)
    for beams in (1, 4):
        rows.clear()
        got = search_model(model, **inputs, num_beams=beams)
        assert rows[0] == len(words) and rows[-1] < len(words) * beams, rows
        lean = search_model(model, **inputs, num_beams=beams, lean_step=True)
        assert torch.equal(got.sequences, lean.sequences)
        torch.testing.assert_close(got.sequences_scores, lean.sequences_scores, rtol=1e-4, atol=1e-4)


def test_a_failed_build_falls_back_with_one_warning(monkeypatch):
    """No compiler (or any build error): one warning naming why, then the eager fast step, results as before."""
    model = random_t5(False, False, seed=5)
    ids, mask = padded_inputs(3, seed=5)
    expected = search_model(model, input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6)
    monkeypatch.setattr(extension, "_MODULE", [])
    monkeypatch.setattr(extension, "_FAILURE", [])

    def no_compiler():
        raise RuntimeError("no C++ compiler ('c++' is not on PATH)")

    monkeypatch.setattr(extension, "_load", no_compiler)
    rows = count_native_steps(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"native extension \(the T5 step, the search bookkeeping\) is not "
                                             r"available \(no C\+\+ compiler"):
        first = search_model(model, input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        search_model(model, input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6)
    assert not rows
    assert native.native_reason(model) == "no C++ compiler ('c++' is not on PATH)"
    assert torch.equal(first.sequences, expected.sequences)
    torch.testing.assert_close(first.sequences_scores, expected.sequences_scores, rtol=1e-4, atol=1e-4)


def test_the_environment_turns_it_off_and_the_log_says_why(monkeypatch, caplog):
    model = random_t5(False, False, seed=6)
    ids, mask = padded_inputs(2, seed=6)
    rows = count_native_steps(monkeypatch)
    monkeypatch.setenv(extension.ENVIRONMENT, "0")
    with caplog.at_level(logging.DEBUG, logger="beamsearch"):
        search_model(model, input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=4)
    assert not rows
    assert "the native fast T5 step (one C++ call per step) does not run this call: BEAMSEARCH_NATIVE=0 turns it " \
           "off" in caplog.text
    monkeypatch.delenv(extension.ENVIRONMENT)
    search_model(model, input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=4)
    assert rows


def test_what_it_does_not_run_is_named(monkeypatch):
    assert native.native_reason(quantize_int8(random_t5(False, False))) is None  # int8 runs natively
    monkeypatch.setattr(native, "_INT8", [False])  # a torch without torch._int_mm on the CPU
    assert "has no int8 matrix product on the CPU" in native.native_reason(quantize_int8(random_t5(False, False)))
    assert native.native_reason(random_t5(False, False)) is None  # float32 does not need it
    assert native.native_reason(random_t5(True, False)) == \
        "the feed-forward activation is NewGELUActivation (the native step computes ReLU)"
    assert "torch.float64" in native.native_reason(random_t5(False, False).double())
    assert native.native_reason(random_t5(False, False)) is None


def test_int8_products_quantize_each_input_once_per_row():
    """An int8 product (``native.cpp``'s ``product``): the input quantized per row, symmetric, to 127 levels (half to
    even), multiplied by the int8 weight in integers, scaled back by row and by output column: that, computed here in
    float32 (whose integers are exact below 2^24). The C++ may fuse the quantization's multiply and rounding (an
    FMA), so an input within an ulp of a half step may land one level away: nearly every output is bitwise equal,
    the rest within one level of one input. A float32 weight: ``x @ W.T`` to float rounding."""
    ext = extension.extension()
    generator = torch.Generator().manual_seed(4)
    for rows, width, out in ((70, 200, 50), (1, 192, 101), (5, 17, 3)):  # widths off the vector size too
        x = torch.randn(rows, width, generator=generator) * 3
        weight = torch.randn(out, width, generator=generator)
        scale = weight.abs().amax(dim=1) / 127
        quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        row_scale = x.abs().amax(dim=1, keepdim=True) / 127
        expected = (torch.round(x * (1 / row_scale)) @ quantized.float().t()) * row_scale * scale
        got = ext.product(x, quantized, scale)
        assert (got == expected).float().mean() >= 0.99
        torch.testing.assert_close(got, expected, rtol=0, atol=float(row_scale.max() * 127 * scale.max()) * 1.01)
        torch.testing.assert_close(ext.product(x, weight, None), x @ weight.t(), rtol=1e-5, atol=1e-4)
    assert torch.equal(ext.product(torch.zeros(2, 8), quantized[:, :8].contiguous(), scale),
                       torch.zeros(2, quantized.shape[0]))  # a zero row: scale 1, no division by zero


def test_int8_runs_natively_as_its_products_say(monkeypatch):
    """``lean_step="fast"`` on an int8 model (the CLI's ``--int8``) runs natively; its logits equal, step by step with
    reorders, the eager fast step's whose int8 products are made to quantize as the native ones do (per row, above),
    to float rounding (and the rare input that rounding moves across a quantization step)."""
    from beamsearch.steps.t5.packed import PackedLinear

    def per_row(self, x, relu=False):
        scale = x.abs().amax(dim=-1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        out = (torch.round(x / scale) @ self.int8_weight.float().t()) * scale * self.int8_scales
        return out.relu_() if relu else out

    model = quantize_int8(t5_of_shape(SHAPES[0], seed=5))
    ids, mask = padded_inputs(3, seed=5)
    with torch.no_grad():
        encoded = native.native_t5_encode(model, ids, mask)
        fast = fast_t5.FastT5State(model, encoded, mask, 8, native=True)
        monkeypatch.setattr(PackedLinear, "__call__", per_row)
        monkeypatch.setattr(PackedLinear, "add_to", lambda self, x, residual: per_row(self, x).add_(residual))
        kept = mask.bool()
        eager_encoded = fast_t5.fast_t5_encode(model, ids, mask)
        torch.testing.assert_close(encoded[kept], eager_encoded[kept], rtol=2e-2, atol=2e-2)
        eager = fast_t5.FastT5State(model, encoded, mask, 8)
        errors = torch.cat([(got - expected).abs().amax(dim=-1) / expected.abs().max()
                            for expected, got in in_lockstep(eager, fast, 3, 2, steps=6, seed=6, vocab=VOCAB)])
    # each row of each step (36): float rounding is about 2e-7; a row where rounding moved an input across a
    # quantization step differs by up to about 1e-2 (7e-3 seen once with ATEN_CPU_CAPABILITY=default, whose eager
    # kernels round differently); without the inputs' per-row quantization every row differs by 5e-3 to 2e-2
    # (measured), so the count of rows above rounding is what tells the per-row quantization from none
    assert int((errors > 1e-5).sum()) <= 2, errors
    assert float(errors.max()) < 2e-2, errors
    rows = count_native_steps(monkeypatch)
    search_model(model, input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=4, lean_step="fast")
    assert rows


def test_a_hooked_output_layer_is_not_run_natively(monkeypatch):
    """The gate: with a forward hook on ``lm_head`` the default runs a step that calls it (not the native one), and
    the hook's change shows in the results, as in ``model.generate``."""
    rows = count_native_steps(monkeypatch)
    model = random_t5(False, False, seed=8)
    ids, mask = padded_inputs(3, seed=8)

    def favour_token_5(module, args, output):
        output[..., 5] += 3.0
        return output

    handle = model.lm_head.register_forward_hook(favour_token_5)
    try:
        assert_generate_equivalent(model, input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   num_beams=3, return_dict_in_generate=True, output_scores=True)
    finally:
        handle.remove()
    assert not rows


def test_updated_weights_are_packed_again():
    """An in-place update of a weight (an optimizer step): the next call repacks, and the native step follows."""
    model = t5_of_shape(SHAPES[1], seed=9)
    ids, mask = padded_inputs(2, seed=9)
    with torch.no_grad():
        first = native.native_weights(model)
        assert native.native_weights(model) is first
        model.decoder.block[0].layer[2].DenseReluDense.wo.weight.mul_(2.0)
        assert native.native_weights(model) is not first
        encoded = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        eager = fast_t5.FastT5State(model, encoded, mask, 4)
        fast = fast_t5.FastT5State(model, encoded, mask, 4, native=True)
        tokens = torch.zeros(2, 1, dtype=torch.long)
        torch.testing.assert_close(fast.prefill(tokens), eager.prefill(tokens), rtol=1e-4, atol=1e-4)


def test_the_build_key_names_the_cpu_and_torch(monkeypatch):
    """A binary is built for the CPU it runs on: another CPU (or torch) gets another cache folder."""
    key = extension.build_key()
    monkeypatch.setattr(extension, "_cpu", lambda: "another CPU")
    assert extension.build_key() != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert extension.build_key() != key


def test_two_installs_of_the_same_sources_build_in_two_folders(tmp_path, monkeypatch):
    """The build file names the sources by path: a second checkout or virtual environment of the same sources gets its
    own folder, not one that each rebuilds for the other (a rebuild in every new process, and one inside a process
    whose file size is limited fails)."""
    key, compiled = extension.build_key(), extension.COMPILED
    copies = []
    for path in extension.SOURCES:
        copy = tmp_path / path.relative_to(extension.HERE)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(path.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(extension, "SOURCES", tuple(copies))
    monkeypatch.setattr(extension, "COMPILED", tuple(copies[: len(extension.COMPILED)]))
    assert extension.build_key() != key
    monkeypatch.setattr(extension, "COMPILED", compiled)
    assert extension.build_key() == key  # the same contents at the same place: the same folder


def test_a_build_stopped_half_way_does_not_make_the_next_load_wait(tmp_path):
    """torch's ``cpp_extension.load`` leaves its ``lock`` file behind when its process is killed mid-build, and every
    later load waited for that file forever. Under the kernel's lock (released when its holder dies) the next load
    removes the leftover and loads: here a copy of the built folder with such a file, loaded by a new process."""
    if extension.extension() is None:
        pytest.skip(f"the native extension is not available here ({extension.extension_reason()})")
    import os
    import shutil
    import subprocess
    import sys

    key = extension.build_key()
    folder = tmp_path / key
    shutil.copytree(extension.cache_root() / key, folder)  # copy2: the times ninja compares stay as they were
    (folder / extension.TORCH_LOCK).touch()
    code = "from beamsearch import extension; print('loaded', extension.extension_reason())"
    env = {**os.environ, "BEAMSEARCH_NATIVE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded None"
    assert not (folder / extension.TORCH_LOCK).exists()


def test_one_process_at_a_time_builds_or_loads_a_folder(tmp_path):
    """Another holder of the folder's lock (another process building) makes a load wait until it lets go."""
    fcntl = pytest.importorskip("fcntl")
    import threading

    entered = threading.Event()

    def load():
        with extension._build_lock(tmp_path):
            entered.set()

    with open(tmp_path / "build.flock", "a") as other:  # its own open file: flock conflicts as another process's
        fcntl.flock(other, fcntl.LOCK_EX)
        thread = threading.Thread(target=load)
        thread.start()
        assert not entered.wait(0.5)
        fcntl.flock(other, fcntl.LOCK_UN)
    assert entered.wait(30)
    thread.join()
