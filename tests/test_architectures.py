"""The architecture sweep: ``beamsearch.generate`` against the installed release's ``model.generate`` on every
text-generation architecture it can build from a tiny config (``tiny_architectures.py``), decoder-only and
encoder-decoder.

Each family decodes a padded batch of three examples (left-padded for decoder-only models, right-padded for
encoder-decoder ones) three ways with the default call of ``beamsearch.generate`` (whatever step it picks):

- greedy, returning a dict without per-step scores, so that finished examples leave the batch (one leaves before
  another, asserted);
- beam search (3 beams, 2 returned) with per-step scores: the prompt's state expanded to the beams, then reordered;
- sampling with per-step scores, under the same torch seed on both sides.

Every mode decodes with a second EOS id where the model's own does not end one example before another in greedy
search: a token of transformers' greedy output that does, so that hypotheses end at varied steps in every family.

Tokens are compared exactly unless transformers' own choice nearly tied where the outputs part (its margin is
checked; never for sampling), scores within the score tolerance (``parity_grid.assert_equivalent_output``): the
default runs the prompt once per example, so on other shapes than transformers' (docs/testing.md).

A family the installed release cannot build (its config class came later) is skipped with that reason. Where
transformers itself refuses a mode (:data:`REFUSED`), beamsearch must refuse it too. A family and mode that cannot
match yet is listed in :data:`DIFFERS` with the releases it applies to and the diagnosed reason, and runs as a strict
xfail there, so that a fix shows up as an unexpected pass.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_architectures import ARCHITECTURES, FIRST_PLAIN, missing_reason, padded_batch, tiny_architecture
from tiny_hf import assert_generate_equivalent

import beamsearch
from beamsearch import hf_compat

transformers = pytest.importorskip("transformers")

SEED = 7
MAX_NEW_TOKENS = 8
MODES = {
    "greedy": {"num_beams": 1, "do_sample": False, "return_dict_in_generate": True},
    "beam": {"num_beams": 3, "num_return_sequences": 2, "do_sample": False, "return_dict_in_generate": True,
             "output_scores": True},
    "sample": {"num_beams": 1, "do_sample": True, "return_dict_in_generate": True, "output_scores": True},
}
ALL = tuple(MODES)

# (family, modes, releases, why beamsearch.generate cannot match model.generate there): strict xfails, so that a
# change shows up. The differences the sweep found in the generic step are fixed (Mamba's, FalconMamba's, MiniMax's,
# RWKV's and 4.57's LFM2 states, which it did not move; RecurrentGemma's state in its modules and RWKV's row-mixing
# step, now decoded on generate's rows: hf_compat.select_state_rows, reorder_beam_state, GENERATE_ROWS).
LFM2_BEAM_FAILS = ("transformers 4.57's own beam search fails on LFM2: Lfm2HybridConvCache.reorder_cache "
                   "index_selects the empty key placeholder of a convolution layer (IndexError), and so does the same "
                   "reorder in beamsearch's beam step, which calls it as generate does")
DIFFERS = (
    ("lfm2", ("beam",), "4.57", LFM2_BEAM_FAILS),
)

# (family, mode, releases, what transformers' generate raises there): beamsearch must refuse too
REFUSED = (
    ("rwkv", "beam", ">= 5.13", "cannot use beam search with a cache"),
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The sweep on one intra-op thread (both sides alike; restored after): its models are too small to gain from a
    second one, and on a busy 2-core machine two threads stalled each other's every operator (the sweep took 6 minutes
    instead of half a minute)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _applies(releases: str) -> bool:
    """Whether the installed release is in ``releases`` (">= 5.13", "4.57", "4.57 - 5.12": minor releases)."""
    def parse(text):
        return tuple(int(part) for part in text.strip().split("."))

    installed = hf_compat.version()[:2]
    if releases.startswith(">="):
        return installed >= parse(releases[2:])
    low, _, high = releases.partition(" - ")
    return parse(low) <= installed <= parse(high or low)


def _known_difference(name: str, mode: str) -> str | None:
    reasons = [why for family, modes, releases, why in DIFFERS
               if family == name and mode in modes and _applies(releases)]
    assert len(reasons) <= 1, (name, mode, reasons)
    return reasons[0] if reasons else None


def _refusal(name: str, mode: str) -> str | None:
    return next((message for family, refused, releases, message in REFUSED
                 if (family, refused) == (name, mode) and _applies(releases)), None)


@pytest.mark.parametrize("mode", ALL)
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_matches_generate(name, mode, request):
    missing = missing_reason(name)
    if missing is not None:
        pytest.skip(missing)
    known = _known_difference(name, mode)
    if known is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=known))
    model = tiny_architecture(name)
    ids, mask = padded_batch(model)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": MAX_NEW_TOKENS, **MODES[mode]}
    refusal = _refusal(name, mode)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            model.generate(**kwargs)
        with pytest.raises(ValueError, match=refusal):
            beamsearch.generate(model, **kwargs)
        return
    kwargs["eos_token_id"] = _eos_token_ids(name)
    expected, _ = assert_generate_equivalent(model, None, SEED, **kwargs)
    if mode == "greedy":
        lengths = _lengths(_new_tokens(model, expected.sequences, ids.shape[1]), kwargs["eos_token_id"])
        assert lengths.min() < lengths.max(), ("no example left the batch before another", lengths)


def _new_tokens(model, sequences: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """The generated tokens ``[rows, T]`` of ``generate``'s sequences (after the prompt, or the decoder start)."""
    return sequences[:, 1:] if model.config.is_encoder_decoder else sequences[:, prompt_width:]


def _lengths(new: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """``[rows]`` generated tokens up to and including the first EOS (any of ``eos_token_ids``), else all."""
    ends = torch.isin(new, torch.tensor(eos_token_ids))
    return torch.where(ends.any(dim=1), ends.int().argmax(dim=1) + 1, new.shape[1])


@functools.cache
def _eos_token_ids(name: str) -> list[int]:
    """The EOS ids every mode decodes the family with: ones with which greedy search ends some example before
    another, so that hypotheses finish at varied steps whatever the random model's EOS does. Read from transformers'
    own greedy output of the batch: another EOS id only cuts each greedy sequence at its first occurrence, so the
    lengths it gives are known. The model's EOS where it varies the lengths already, else also the first token (by
    step, from the second step on, then the first) that does."""
    model = tiny_architecture(name)
    eos = model.config.eos_token_id
    ids, mask = padded_batch(model)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    new = _new_tokens(model, out, ids.shape[1])
    steps = [*range(1, new.shape[1]), 0]
    for candidate in [[eos]] + [[eos, int(token)] for step in steps for token in new[:, step]]:
        lengths = _lengths(new, candidate)
        if candidate[-1] >= FIRST_PLAIN or candidate == [eos]:
            if lengths.min() < lengths.max():
                return candidate
    raise AssertionError(f"no EOS id ends an example before another: {new.tolist()}")


def test_the_sweep_covers_the_issue_families():
    """Issue 35's list of families is in the sweep (a family dropped from the table must be dropped on purpose), and
    every listed difference or refusal names a family and mode of the sweep."""
    required = {"gpt2", "gptj", "gpt_neox", "bloom", "opt", "falcon", "llama", "mistral", "mixtral", "qwen2",
                "qwen2_moe", "qwen3", "phi", "phi3", "gemma", "gemma2", "gemma3_text", "stablelm", "starcoder2",
                "olmo", "olmo2", "cohere", "granite", "codegen", "xglm", "mpt", "persimmon", "biogpt", "t5", "mt5",
                "umt5", "longt5", "switch_transformers", "bart", "mbart", "marian", "pegasus", "pegasus_x",
                "prophetnet", "led", "blenderbot-small", "blenderbot", "fsmt", "m2m_100", "nllb-moe", "plbart"}
    assert required <= set(ARCHITECTURES), sorted(required - set(ARCHITECTURES))
    listed = {(name, mode) for name, modes, _, _ in DIFFERS for mode in modes}
    listed |= {(name, mode) for name, mode, _, _ in REFUSED}
    assert listed <= {(name, mode) for name in ARCHITECTURES for mode in MODES}


def test_the_sweep_models_depend_on_the_input_and_finish_at_varied_steps():
    """The comparisons mean something only if the tiny models' outputs vary with the prompt (or the source) and
    hypotheses end by their own EOS at varied steps: over the families the installed release builds, most greedy
    outputs differ between the batch's rows, and EOS ends some hypotheses early and others not."""
    built = [name for name in ARCHITECTURES if missing_reason(name) is None]
    varied, finished = 0, set()
    for name in built:
        model = tiny_architecture(name)
        ids, mask = padded_batch(model)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        new = _new_tokens(model, out, ids.shape[1])
        varied += len({tuple(row) for row in new.tolist()}) > 1
        lengths = _lengths(new, [model.config.eos_token_id])
        finished.update(lengths[lengths < MAX_NEW_TOKENS].tolist())
    assert varied >= 0.8 * len(built), (varied, len(built))
    assert len(finished) >= 4, finished


def test_phi3_decodes_one_new_token_per_step_like_generate(monkeypatch):
    """Phi3's prepare_inputs_for_generation takes next_sequence_length through **kwargs: the generic step gives it,
    as the release's loop does (hf_compat.next_step), so its forwards see the shapes of generate's (the prompt, then
    one new token per row), not the whole sequence again on top of the cache (issue 35's regression)."""
    model = tiny_architecture("phi3")
    ids, mask = padded_batch(model)
    seen: dict[str, list[int]] = {"transformers": [], "ours": []}
    side = "transformers"
    original = type(model).forward

    @functools.wraps(original)  # generate reads the forward's signature
    def recording(self, *args, **kwargs):
        seen[side].append(kwargs["input_ids"].shape[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", recording)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    model.generate(**kwargs)
    side = "ours"
    beamsearch.generate(model, lean_step=False, **kwargs)
    assert seen["ours"] == seen["transformers"] == [ids.shape[1], 1, 1, 1], seen
