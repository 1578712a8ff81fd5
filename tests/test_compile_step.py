"""``compile_step``: the lean steps' decoder under ``torch.compile`` (``True``: dynamic shapes; ``'static'``: the
fixed-shape step), and its refusals."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_scores_close
from tiny_hf import tiny_model

import beamsearch
from beamsearch.steps import chooser

transformers = pytest.importorskip("transformers")


@pytest.fixture
def compiled(monkeypatch):
    """Records what the adapter hands to torch.compile (and compiles it)."""
    calls = []
    original = torch.compile

    def recording(function, **kwargs):
        calls.append((function, kwargs))
        return original(function, **kwargs)

    monkeypatch.setattr(chooser.torch, "compile", recording)
    return calls


def _inputs(model, batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, 6), generator=generator)
    mask = torch.ones_like(ids)
    if model.config.is_encoder_decoder:
        mask[1:, -2:] = 0  # right padding
    else:
        mask[1:, :2] = 0  # left padding
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id or 0)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize(("name", "mode"), [("t5", True), ("gpt2", True), ("llama", True), ("t5", "static"),
                                           ("gpt2", "static"), ("llama", "static")])
def test_compiled_lean_step_decodes_like_the_lean_step(name: str, mode, compiled) -> None:
    """Same sequences as the uncompiled lean step (and so as transformers on these models); scores to float
    precision (the compiled kernels fuse and reorder the arithmetic, so bitwise equality is not promised)."""
    torch._dynamo.reset()
    model = tiny_model(name)
    kwargs = dict(_inputs(model, 3, seed=1), num_beams=3, max_new_tokens=6, num_return_sequences=2,
                  return_dict_in_generate=True, output_scores=True)
    eager = beamsearch.generate(model, **kwargs)
    for _ in range(2):  # the second call reuses the compiled code
        fast = beamsearch.generate(model, **kwargs, compile_step=mode)
        assert torch.equal(fast.sequences, eager.sequences)
        assert_scores_close(fast.sequences_scores, eager.sequences_scores)
    dynamic = None if mode == "static" else True  # static: shapes fixed until the rows change
    want = {"dynamic": dynamic, **chooser.compile_options()}  # scalar kernels under ATEN_CPU_CAPABILITY=default
    assert len(compiled) == 2 and all(kwargs == want for _, kwargs in compiled)
    assert all(getattr(function, "__name__", "") == "decode" for function, _ in compiled)


@pytest.mark.parametrize(("name", "graphs"), [("t5", 2), ("gpt2", 1)])
def test_static_step_compiles_once_per_row_count(name: str, graphs: int, monkeypatch) -> None:
    """``compile_step='static'`` compiled with ``dynamic=False`` (every new input shape a new graph): a 9-step
    decode makes one graph per row count, as no step changes a shape: T5's decoder runs the start token once per
    example (B rows), then the B*K rows; GPT-2's prompt runs in the model's own forward. The dynamic-shape step
    compiled so makes one graph per step (its attention reads the filled positions)."""
    from torch._dynamo.utils import counters

    original = torch.compile
    monkeypatch.setattr(chooser.torch, "compile",
                        lambda function, **kwargs: original(function, **dict(kwargs, dynamic=False)))
    model = tiny_model(name)
    kwargs = dict(_inputs(model, 3, seed=2), num_beams=3, max_new_tokens=9, min_new_tokens=9)
    made = {}
    for mode in ("static", True) if name == "t5" else ("static",):
        torch._dynamo.reset()
        counters.clear()
        beamsearch.generate(model, **kwargs, compile_step=mode)
        made[mode] = counters["stats"]["unique_graphs"]
    assert made["static"] == graphs
    if name == "t5":
        assert made[True] >= 8  # (then torch.compile's recompile limit sends the last steps to eager)


def test_compile_step_refusals() -> None:
    model = tiny_model("bart")  # no lean step
    kwargs = dict(_inputs(model, 2, seed=0), num_beams=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="compile_step=True needs a lean step.*bart"):
        beamsearch.generate(model, **kwargs, compile_step=True)
    t5 = tiny_model("t5")
    with pytest.raises(ValueError, match="compile_step=True needs a lean step.*lean_step=False"):
        beamsearch.generate(t5, **dict(_inputs(t5, 2, seed=0), num_beams=2, max_new_tokens=3), compile_step=True,
                            lean_step=False)
    gpt2 = tiny_model("gpt2")
    with pytest.raises(ValueError, match="compile_step='static' needs a lean step.*lean_step=False"):
        beamsearch.generate(gpt2, **dict(_inputs(gpt2, 2, seed=0), max_new_tokens=3), compile_step="static",
                            lean_step=False)
    with pytest.raises(ValueError, match="compile_step must be True, False or .static."):
        beamsearch.generate(t5, **dict(_inputs(t5, 2, seed=0), max_new_tokens=3), compile_step="yes")


@pytest.mark.parametrize(("capability", "options"), [(None, {}), ("default", {"options": {"cpp.simdlen": 1}}),
                                                     ("AVX2", {"options": {"cpp.simdlen": 256}}),
                                                     ("avx512", {"options": {"cpp.simdlen": 512}})])
def test_inductor_follows_atens_vector_width(capability, options, monkeypatch) -> None:
    """Inductor's kernels use ATen's vector width (a mismatch fails to compile or computes garbage, torch 2.13);
    the suite runs under these settings too (docs/testing.md)."""
    if capability is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    assert chooser.compile_options() == options
