"""``prefix_allowed_tokens_fn`` against transformers' own ``generate`` (its PrefixConstrainedLogitsProcessor)."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_scores_close

pytest.importorskip("transformers")
from fakes import RowCounter  # noqa: E402
from tiny_hf import VOCAB, random_inputs, tiny_model  # noqa: E402

from beamsearch import generate, search  # noqa: E402


def allowed(batch_id: int, tokens: torch.Tensor) -> list[int]:
    """Depends on the example (batch_id) and the last token, so a wrong batch_id changes the output."""
    last = int(tokens[-1])
    return [(last + 1) % VOCAB, (last + 2 + 3 * batch_id) % VOCAB, (last * 3) % VOCAB, 1, 2]


@pytest.mark.parametrize("name", ["t5", "bart", "gpt2", "llama"])
@pytest.mark.parametrize(
    "options",
    [
        {"num_beams": 1},
        {"num_beams": 3, "num_return_sequences": 2},
        {"num_beams": 4, "early_stopping": True, "length_penalty": 0.5},
        {"num_beams": 2, "max_rows": 4},  # sub-batches: batch ids stay those of the whole batch
    ],
)
def test_matches_transformers(name, options):
    model = tiny_model(name)
    ids, mask = random_inputs(model, 5, torch.Generator().manual_seed(4))
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=15, prefix_allowed_tokens_fn=allowed,
                  return_dict_in_generate=True, output_scores=options["num_beams"] > 1 and "max_rows" not in options)
    want = model.generate(**common, **{k: v for k, v in options.items() if k != "max_rows"})
    got = generate(model, **common, **options)
    assert torch.equal(got.sequences, want.sequences)
    if options["num_beams"] > 1 and "max_rows" not in options:
        assert_scores_close(got.sequences_scores, want.sequences_scores)


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_sampling_matches_transformers(name):
    model = tiny_model(name)
    ids, mask = random_inputs(model, 3, torch.Generator().manual_seed(5))
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, prefix_allowed_tokens_fn=allowed,
                  do_sample=True, num_return_sequences=2)  # batch_id counts rows here, as in transformers
    torch.manual_seed(0)
    want = model.generate(**common)
    torch.manual_seed(0)
    assert torch.equal(generate(model, **common), want)


def test_without_scores_finished_examples_leave_and_batch_ids_follow():
    model = tiny_model("t5")
    ids, mask = random_inputs(model, 6, torch.Generator().manual_seed(4))
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=15, prefix_allowed_tokens_fn=allowed)
    counter = RowCounter(model)
    try:
        got = generate(model, num_beams=1, **common)
    finally:
        rows = counter.close()
    assert torch.equal(got, model.generate(num_beams=1, **common))
    assert min(rows) < 6  # finished examples left the batch, and the remaining rows kept their batch ids


def test_core_search_only_emits_allowed_tokens():
    def step(tokens, state):
        return torch.randn(tokens.shape[0], 9, generator=torch.Generator().manual_seed(tokens.shape[1])), state

    def only_even(batch_id, tokens):
        return [2 * (batch_id + 1), 4]

    result = search(step, torch.zeros(3, 1, dtype=torch.long), num_beams=2, max_new_tokens=6,
                    prefix_allowed_tokens_fn=only_even)
    for example in range(3):
        assert set(result.sequences[example, 0, 1:].tolist()) <= {2 * (example + 1), 4}


def test_bad_callbacks_are_named():
    model = tiny_model("t5")
    ids, mask = random_inputs(model, 2, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="no allowed token for batch_id 0"):
        generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=3, prefix_allowed_tokens_fn=lambda b, t: [])
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn must be callable"):
        generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=3, prefix_allowed_tokens_fn=[1, 2])
