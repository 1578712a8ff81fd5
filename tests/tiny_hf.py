"""Tiny Hugging Face models with random weights, built from configs (no downloads).

Output heads are untied and redrawn with a large scale so that distributions are peaked and
input-dependent without self-repetition, and the EOS rows are boosted so that hypotheses finish at
varied steps.
"""

from __future__ import annotations

import copy
import functools

import torch

VOCAB = 40


def _configs():
    from transformers import BartConfig, GPT2Config, LlamaConfig, MarianConfig, MistralConfig, Qwen2Config, T5Config

    untied = {"vocab_size": VOCAB, "tie_word_embeddings": False}
    bart_like = dict(untied, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                     forced_eos_token_id=None)
    return {
        "t5": T5Config(**untied, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                       pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
        "bart": BartConfig(**bart_like, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2),
        "marian": MarianConfig(**bart_like, pad_token_id=VOCAB - 1, eos_token_id=0, decoder_start_token_id=VOCAB - 1),
        "gpt2": GPT2Config(**untied, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=1),
        "llama": LlamaConfig(**untied, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                             pad_token_id=2),
        # Llama's layers, with biases in the query, key and value products (drawn in tiny_model)
        "qwen2": Qwen2Config(**untied, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0,
                             eos_token_id=1, pad_token_id=2),
        "mistral": MistralConfig(**untied, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                 sliding_window=None, bos_token_id=0, eos_token_id=1, pad_token_id=2),
    }


MODEL_NAMES = ("t5", "bart", "marian", "gpt2", "llama", "qwen2", "mistral")


@functools.cache
def tiny_model(name: str, seed: int = 0):
    """A tiny random-weight model of the family ``name`` in eval mode."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = _configs()[name]
    torch.manual_seed(seed)
    if config.is_encoder_decoder:
        model = AutoModelForSeq2SeqLM.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model.eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 0.8)  # untied: peaked, input-dependent distributions without self-repetition
        head[config.eos_token_id] *= 1.3
        if config.model_type == "qwen2":
            draw_attention_biases(model, 0.4)
    return model


def draw_attention_biases(model, std: float) -> None:
    """Draw a Qwen2 model's query, key and value biases (zeros when initialised) with ``std``, so that they
    matter."""
    with torch.no_grad():
        for layer in model.model.layers:
            for product in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                product.bias.normal_(0.0, std)


def random_inputs(model, batch_size: int, generator: torch.Generator):
    """Token ids ``[B, S]`` and an attention mask with padding (left for decoder-only, right for seq2seq)."""
    config = model.config
    specials = {
        getattr(config, name, None)
        for name in ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id")
    }
    allowed = torch.tensor([t for t in range(VOCAB) if t not in specials])
    length = int(torch.randint(2, 7, (1,), generator=generator))
    ids = allowed[torch.randint(len(allowed), (batch_size, length), generator=generator)]
    mask = torch.ones(batch_size, length, dtype=torch.long)
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    for row in range(1, batch_size):
        cut = int(torch.randint(0, length - 1, (1,), generator=generator))
        if cut == 0:
            continue
        if config.is_encoder_decoder:
            mask[row, length - cut :] = 0
            ids[row, length - cut :] = pad
        else:
            mask[row, :cut] = 0
            ids[row, :cut] = pad
    return ids, mask


def reference_generate(model, **kwargs):
    """``model.generate(**kwargs)``; with ``stop_strings``, transformers 4.x passes the tokenizer on to an
    encoder-decoder model's forward, which refuses it: there the same criterion generate would build (a
    ``StopStringCriteria`` of the tokenizer and strings) is given as a stopping criterion instead."""
    try:
        return model.generate(**kwargs)
    except TypeError as error:
        if "tokenizer" not in str(error) or kwargs.get("stop_strings") is None:
            raise
    from transformers import StopStringCriteria

    kwargs = dict(kwargs)
    criterion = StopStringCriteria(tokenizer=kwargs.pop("tokenizer"), stop_strings=kwargs.pop("stop_strings"))
    return model.generate(**kwargs, stopping_criteria=[*kwargs.pop("stopping_criteria", ()), criterion])


def record_t5_states(monkeypatch) -> list[str]:
    """The type name of the state each T5 step is given, appended as the adapter's T5 step function runs (the lean
    and the fast step share it): which step a call chose."""
    from beamsearch.steps import chooser

    states: list[str] = []
    original = chooser.lean_t5_step

    def recording(tokens, state):
        states.append(type(state).__name__)
        return original(tokens, state)

    monkeypatch.setattr(chooser, "lean_t5_step", recording)
    return states


def generate_both(model, ours: dict | None = None, seed: int = 7, **kwargs):
    """``model.generate(**kwargs)`` and ``beamsearch.generate(model, **kwargs, **ours)`` (``ours``: options only
    beamsearch takes), each after ``torch.manual_seed(seed)`` so that sampling draws alike: (transformers', ours)."""
    import beamsearch

    torch.manual_seed(seed)
    expected = model.generate(**kwargs)
    torch.manual_seed(seed)
    return expected, beamsearch.generate(model, **kwargs, **(ours or {}))


def assert_alone_equals_in_batch(model, ids: torch.Tensor, mask: torch.Tensor, **kwargs) -> None:
    """Batch invariance of a decoder-only model: each row of a left-padded batch decodes alone (no padding) to the
    same tokens, scores within the score tolerance (other row counts: not bitwise) (``kwargs``: search options)."""
    from numerics import assert_scores_close

    from beamsearch.adapters import hf as hf_adapter

    batch = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, **kwargs)
    for row in range(ids.shape[0]):
        keep = mask[row].bool()
        alone = hf_adapter.search_model(model, input_ids=ids[row, keep][None], **kwargs)
        width = int(alone.lengths[0, 0])
        shift = int((~keep).sum())  # the batch's sequences carry the row's left padding
        assert int(batch.lengths[row, 0]) - shift == width
        assert torch.equal(batch.sequences[row, 0, shift : shift + width], alone.sequences[0, 0, :width])
        assert_scores_close(batch.sequences_scores[row], alone.sequences_scores[0])
    assert batch.lengths.min() < batch.lengths.max()


def assert_lean_generate_equivalent(model, ids: torch.Tensor, mask: torch.Tensor, beams=(1, 3)) -> None:
    """Tokens and per-step scores of the lean step those of ``model.generate`` (greedy and beams), compared as
    :func:`assert_generate_equivalent` does: the lean cache has other shapes than transformers'."""
    for num_beams in beams:
        assert_generate_equivalent(model, {"lean_step": True}, input_ids=ids, attention_mask=mask, num_beams=num_beams,
                                   max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                                   output_scores=True)


def left_padded_inputs(vocab: int, pad: int, batch: int, seed: int = 0, length: int = 9, padded: bool = True):
    """Token ids ``[B, P]`` (from 3 up) and a mask with left padding of mixed lengths (none in the first row)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch if padded else 0):
        cut = row % 5
        if cut:
            ids[row, :cut], mask[row, :cut] = pad, 0
    return ids, mask


def assert_finished_examples_leave(monkeypatch, model, ids: torch.Tensor, mask: torch.Tensor, early_stopping) -> None:
    """With EOS likely, examples finish at different steps and leave the lean state (its cache shrinks): tokens
    equal transformers' and the generic step's, scores within the score tolerance (fewer rows than transformers
    and another cache layout: not bitwise)."""
    from numerics import assert_scores_close

    from beamsearch.adapters import hf as hf_adapter
    from beamsearch.steps.caches import TimeMajorCache

    shrinks = []
    original = TimeMajorCache.gather_rows

    def recording(cache, index, length):
        shrinks.append((cache.rows, index.shape[0]))
        return original(cache, index, length)

    monkeypatch.setattr(TimeMajorCache, "gather_rows", recording)
    for beams in (1, 3):
        kwargs = dict(num_beams=beams, max_new_tokens=20, early_stopping=early_stopping, do_sample=False)
        expected = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True,
                                  output_scores=True, **kwargs)  # the full batch to the end
        got = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, lean_step=True, **kwargs)
        assert torch.equal(got.sequences.flatten(0, 1), expected.sequences)
        if beams > 1:
            assert_scores_close(got.sequences_scores.flatten(), expected.sequences_scores)
        generic = hf_adapter.search_model(model, input_ids=ids, attention_mask=mask, lean_step=False, **kwargs)
        assert torch.equal(got.sequences, generic.sequences)
        for name in ("sequences_scores", "token_log_probs"):
            assert_scores_close(getattr(got, name), getattr(generic, name))
        lengths = got.lengths.flatten()
        assert lengths.min() < lengths.max(), "the case does not finish examples at different steps"
    assert shrinks, "no example left the batch"
    assert any(after < before for before, after in shrinks), "no example left the batch"


def compare_lean_steps(model, state_class, step, ids: torch.Tensor, mask: torch.Tensor, vocab: int, padded: bool,
                       prompt_per_example: bool = True, per_example: int = 3, steps: int = 8):
    """Per-step logits ``[steps + 1, N, V]`` of a lean decoder-only step and of the model's own forward with its
    cache, rows reordered within their examples between steps (random parents and tokens): ``(lean, reference,
    lean state)``. The lean state starts with room for the prompt and one position, so it grows.

    The reference runs the prompt on the expanded rows, as transformers' generate does, or once per example and
    then expands its cache and logits (``prompt_per_example``, as the generic step does). Positions and mask as
    transformers' generate makes them. The lean cache has other shapes than the model's (a capacity, not the
    length), so the two agree within the score tolerance, not bitwise (docs/testing.md)."""
    import transformers

    examples, rows = ids.shape[0], ids.shape[0] * per_example
    generator = torch.Generator().manual_seed(3)
    parents = [torch.arange(rows) // per_example * per_example + torch.randint(per_example, (rows,),
                                                                                generator=generator)
               for _ in range(steps)]
    tokens = [torch.randint(3, vocab, (rows,), generator=generator) for _ in range(steps)]
    expand = torch.arange(examples).repeat_interleave(per_example)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)

    def cache_kwargs(attention_mask):
        return {"attention_mask": attention_mask if padded else None, "use_cache": True, "logits_to_keep": 1,
                "past_key_values": transformers.DynamicCache(config=model.config)}

    with torch.no_grad():
        if prompt_per_example:
            kwargs = cache_kwargs(mask)
            out = model(input_ids=ids, position_ids=positions, **kwargs)
            kwargs["past_key_values"].reorder_cache(expand)
            reference = [out.logits[expand, -1]]
        else:
            kwargs = cache_kwargs(mask[expand])
            out = model(input_ids=ids[expand], position_ids=positions[expand], **kwargs)
            reference = [out.logits[:, -1]]
        cache, row_mask, last = kwargs["past_key_values"], mask[expand], positions[expand, -1:]
        for index, token in zip(parents, tokens, strict=True):
            cache.reorder_cache(index)
            row_mask, last = torch.cat([row_mask[index], torch.ones_like(row_mask[:, :1])], dim=1), last[index] + 1
            out = model(input_ids=token[:, None], attention_mask=row_mask if padded else None, position_ids=last,
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
            reference.append(out.logits[:, -1])

        state = state_class(model, dict(cache_kwargs(mask), position_ids=positions), model.generation_config,
                            max_length=3)
        state.reorder(expand)
        sequence = ids[expand]
        lean = [step(sequence, state)[0]]
        for index, token in zip(parents, tokens, strict=True):
            state.reorder(index)
            sequence = torch.cat([sequence[index], token[:, None]], dim=1)
            lean.append(step(sequence, state)[0])
    return torch.stack(lean), torch.stack(reference), state


def assert_generate_equivalent(model, ours: dict | None = None, seed: int = 7, **kwargs):
    """``beamsearch.generate(model, **kwargs, **ours)`` against ``model.generate(**kwargs)`` where the two run on
    different shapes (the prompt once per example, a lean cache): tokens equal unless transformers nearly tied
    where they part (its margin is checked), scores within the dtype's tolerance (docs/testing.md). Returns
    (transformers', ours)."""
    from parity_grid import assert_equivalent_output

    expected, actual = generate_both(model, ours, seed, **kwargs)
    extra = list(kwargs.pop("logits_processor", None) or [])

    def rerun(processors):
        torch.manual_seed(seed)
        return model.generate(**kwargs, logits_processor=[*extra, *processors])

    if not isinstance(expected, torch.Tensor):
        assert_equivalent_output(expected, actual, rerun, kwargs)
    else:  # a plain tensor of sequences: the tokens
        assert torch.equal(actual, expected)
    return expected, actual


T5_VOCAB = 48


def random_t5(gated: bool = False, tied: bool = False, seed: int = 0, model_type: str = "t5"):
    """A small random T5 (or mT5) with peaked, input-dependent next-token distributions (the lean and fast T5
    steps' tests)."""
    import transformers

    config_class = transformers.MT5Config if model_type == "mt5" else transformers.T5Config
    model_class = transformers.MT5ForConditionalGeneration if model_type == "mt5" else \
        transformers.T5ForConditionalGeneration
    config = config_class(vocab_size=T5_VOCAB, d_model=24, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=2,
                          num_heads=3, feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=tied,
                          relative_attention_num_buckets=8, relative_attention_max_distance=12, pad_token_id=0,
                          eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.4)
    return model


def fresh(name: str):
    """A copy of ``tiny_model(name)`` to change (hooks, adapters, weights)."""
    return copy.deepcopy(tiny_model(name))


def inputs(model, batch: int = 3, seed: int = 5) -> dict:
    """generate kwargs for a padded batch of ``random_inputs``, with the scores returned."""
    ids, mask = random_inputs(model, batch, torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                output_scores=True)


SEARCHES = (dict(num_beams=1), dict(num_beams=3, num_return_sequences=2))


def assert_equals_generate(model, steps_run: list[str], expected_state: str, searches=SEARCHES, **kwargs) -> None:
    """Greedy and beam search (``searches``): tokens of ``model.generate`` (but at its own near ties), scores to float
    precision, and the step that ran is ``expected_state`` (``steps_run``: the conftest fixture)."""
    for search in searches:
        steps_run.clear()
        assert_generate_equivalent(model, **kwargs, **search)
        assert steps_run == [expected_state], (search, steps_run)
