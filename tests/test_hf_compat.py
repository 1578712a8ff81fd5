"""The compatibility module (beamsearch/hf_compat.py): each branch against the installed transformers release.

``make test-transformers`` runs this module under every tested release (docs/testing.md), so each branch is taken
by the releases its table entry names; here the branch the installed release takes is checked against the table,
and the helpers that do not depend on the release are checked directly.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from tiny_hf import random_inputs, tiny_model

import beamsearch
from beamsearch import hf_compat

transformers = pytest.importorskip("transformers")
RELEASE = hf_compat.version()


def _in(release: tuple[int, ...], spec: str) -> bool:
    """Whether ``release`` is in a table entry's range: ">= 5.17", "4.57", "4.57 - 5.16"."""
    def parse(text):
        return tuple(int(p) for p in text.strip().split("."))

    major_minor = release[:2]
    if spec.startswith(">="):
        return major_minor >= parse(spec[2:])
    low, _, high = spec.partition(" - ")
    return parse(low) <= major_minor <= parse(high or low)


def _taken(branch: str) -> bool:
    """Whether the installed release takes ``branch``, read from the release itself (not from the table)."""
    from transformers import GenerationMixin
    from transformers.integrations import sdpa_attention
    from transformers.models.t5.modeling_t5 import T5Attention

    model_has = {
        "prefill: model._prefill": hasattr(GenerationMixin, "_prefill"),
        "prefill: cache positions + forward (no _prefill)": not hasattr(GenerationMixin, "_prefill"),
        "next step: prepare_inputs_for_generation(next_sequence_length=)": "next_sequence_length" in _parameters(
            GenerationMixin.prepare_inputs_for_generation),
        "next step: prepare_inputs_for_generation without next_sequence_length": "next_sequence_length" not in
        _parameters(GenerationMixin.prepare_inputs_for_generation),
        "cache keyword: cache": hf_compat.cache_keyword() == "cache",
        "cache keyword: past_key_values": hf_compat.cache_keyword() == "past_key_values",
        "beam sampling: sampled candidates sorted by score": hf_compat.sorts_sampled_beams(),
        "prefix_allowed_tokens_fn: batch_id = row // max(num_beams, num_return_sequences)":
            hf_compat.prefix_fn_rows_per_batch_id(2, 3) == 3,
        "generation config: use_model_defaults parameter": "use_model_defaults" in _parameters(
            GenerationMixin._prepare_generation_config),
        "T5 position bias of one query: compute_bias(past_seen_tokens=)": "past_seen_tokens" in _parameters(
            T5Attention.compute_bias),
        "T5 position bias of one query: compute_bias(cache_position=)": "cache_position" in _parameters(
            T5Attention.compute_bias),
        "GPT-2 attention scale: attention.scaling": hasattr(tiny_model("gpt2").transformer.h[0].attn, "scaling"),
        "GPT-2 attention scale: from config.scale_attn_weights": not hasattr(tiny_model("gpt2").transformer.h[0].attn,
                                                                            "scaling"),
        "beam reorder: every state name (model._reorder_cache, else reorder_cache, else refused)":
            "cannot be reordered" in inspect.getsource(GenerationMixin._beam_search),
        "beam reorder: past_key_values only (other states stay in place)":
            "cannot be reordered" not in inspect.getsource(GenerationMixin._beam_search),
        "Mamba state: MambaCache under cache_params (conv_states, ssm_states)": _mamba_cache_is_its_own(),
        "LFM2 cache: lists with empty placeholders (Lfm2HybridConvCache.key_cache)": _lfm2_cache_lists(),
        "sdpa grouped-query attention: use_gqa_in_sdpa(mask, key, value), else the query packed (pack_gqa)":
            hasattr(sdpa_attention, "pack_gqa") and len(_parameters(sdpa_attention.use_gqa_in_sdpa)) == 3,
        "sdpa grouped-query attention: use_gqa_in_sdpa(mask, key, value), else keys and values repeated":
            not hasattr(sdpa_attention, "pack_gqa") and len(_parameters(sdpa_attention.use_gqa_in_sdpa)) == 3,
        "sdpa grouped-query attention: use_gqa_in_sdpa(mask, key), else keys and values repeated":
            not hasattr(sdpa_attention, "pack_gqa") and len(_parameters(sdpa_attention.use_gqa_in_sdpa)) == 2,
    }
    return model_has[branch]


def _parameters(function):
    return inspect.signature(function).parameters


def _mamba_cache_is_its_own() -> bool:
    """Whether Mamba's state is its own MambaCache (lists of convolution and SSM states), not a transformers Cache."""
    from transformers.models.mamba import modeling_mamba

    return hasattr(modeling_mamba, "MambaCache") and "conv_states" in inspect.getsource(modeling_mamba.MambaCache)


def _lfm2_cache_lists() -> bool:
    """Whether LFM2's hybrid cache keeps keys in a list that convolution layers fill with empty placeholders."""
    from transformers.models.lfm2 import modeling_lfm2

    cache = getattr(modeling_lfm2, "Lfm2HybridConvCache", None)
    return cache is not None and "self.key_cache = []" in inspect.getsource(cache)


@pytest.mark.parametrize("branch", sorted(hf_compat.BRANCHES))
def test_installed_release_takes_the_branches_its_table_names(branch):
    assert _taken(branch) == _in(RELEASE, hf_compat.BRANCHES[branch]), (branch, transformers.__version__)


def test_release_numbers_parse():
    assert hf_compat._parse("5.24.0") == (5, 24, 0)
    assert hf_compat._parse("4.57.6") == (4, 57, 6)
    assert hf_compat._parse("5.25.0.dev0") == (5, 25, 0)
    assert hf_compat._parse("5.25.0rc1") == (5, 25, 0)


def test_the_installed_release_is_in_the_tested_range_and_does_not_warn():
    hf_compat.warn_if_untested.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_compat.warn_if_untested()


def test_an_untested_release_is_named_with_the_tested_range():
    assert hf_compat.untested_message("5.24.3") is None  # a patch release of a tested minor release
    assert hf_compat.untested_message("4.57.1") is None
    for release in ("4.56.2", "5.25.0", "6.0.0.dev0"):
        message = hf_compat.untested_message(release)
        assert message is not None and "4.57.0 to 5.24.0" in message and release in message


def test_importing_the_adapter_under_an_untested_release_warns_once():
    """A fresh interpreter with transformers' version patched before the adapter is imported."""
    import subprocess
    import sys

    code = ("import warnings, transformers; transformers.__version__ = '9.1.0'; "
            "warnings.simplefilter('always'); "
            "import beamsearch.adapters.hf, beamsearch.adapters.hf_ensemble")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.count("tested with transformers 4.57.0 to 5.24.0") == 1, out.stderr


def test_an_untested_release_warns_once(monkeypatch):
    import sys

    # the module object itself: transformers 4.x replaces its lazy module in sys.modules after some imports
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "9.1.0")
    hf_compat.warn_if_untested.cache_clear()
    with pytest.warns(UserWarning, match=r"tested with transformers 4\.57\.0 to 5\.24\.0.*9\.1\.0"):
        hf_compat.warn_if_untested()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_compat.warn_if_untested()  # once
    hf_compat.warn_if_untested.cache_clear()


def test_unexpand_takes_one_row_per_example_back():
    per_example = torch.arange(6).view(3, 2)
    expanded = per_example.repeat_interleave(4, dim=0)
    encoder = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.randn(3, 5, 2)
                                                            .repeat_interleave(4, dim=0))
    out = hf_compat.unexpand({"attention_mask": expanded, "encoder_outputs": encoder, "use_cache": True,
                              "cache_position": torch.arange(7)}, examples=3, rows=12)
    assert torch.equal(out["attention_mask"], per_example)
    assert out["encoder_outputs"].last_hidden_state.shape == (3, 5, 2)
    assert out["use_cache"] is True
    assert torch.equal(out["cache_position"], torch.arange(7))  # not a row-indexed tensor


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_prepared_inputs_are_generates_own(name):
    """What generate prepared, seen by its decoding method, is what prepare_with_generate returns."""
    model = tiny_model(name)
    ids, mask = random_inputs(model, 2, torch.Generator().manual_seed(3))
    prepared = hf_compat.prepare_with_generate(model, ids, None, {"attention_mask": mask, "num_beams": 3,
                                                                  "max_new_tokens": 4})
    assert prepared["input_ids"].shape[0] == 2 * 3  # expanded to the beams, as generate expands them
    assert torch.equal(prepared["inputs_tensor"], ids)
    assert prepared["generation_config"].num_beams == 3
    assert prepared["generation_config"].max_length == (1 if model.config.is_encoder_decoder else ids.shape[1]) + 4


def test_hf_release_option_is_normalised_and_checked():
    assert beamsearch.SearchOptions.create(hf_release="4.57").hf_release == (4, 57)
    assert beamsearch.SearchOptions.create(hf_release=(5, 24)).hf_release == (5, 24)
    assert beamsearch.SearchOptions.create(hf_release="5.23.0").hf_at_least(5, 18)
    assert not beamsearch.SearchOptions.create(hf_release="5.17").hf_at_least(5, 18)
    assert beamsearch.SearchOptions.create().hf_at_least(5, 24)  # None: the newest semantics
    with pytest.raises(ValueError, match="hf_release must be a transformers release"):
        beamsearch.SearchOptions.create(hf_release="five")


def test_the_adapter_follows_the_installed_release():
    model = tiny_model("t5")
    ids, mask = random_inputs(model, 1, torch.Generator().manual_seed(0))
    from beamsearch.adapters.hf_options import options_from_config

    config = hf_compat.prepare_with_generate(model, ids, None, {"attention_mask": mask})["generation_config"]
    assert options_from_config(config).hf_release == RELEASE[:2]


def test_t5_position_bias_is_the_row_of_the_full_table():
    """One query's bias at each position equals that row of the model's bias over all positions (the same buckets)."""
    attention = tiny_model("t5").decoder.block[0].layer[0].SelfAttention
    table = attention.compute_bias(9, 9)[0]  # [H, T, T], every query position
    for position in (0, 3, 8):
        bias = hf_compat.t5_position_bias(attention, position, torch.device("cpu"))
        assert torch.equal(bias[0, :, 0], table[:, position, : position + 1])


def test_gpt2_attention_scaling_is_the_inverse_square_root_of_the_head_size():
    attention = tiny_model("gpt2").transformer.h[0].attn
    assert hf_compat.gpt2_attention_scaling(attention) == pytest.approx(attention.head_dim**-0.5)
