"""The graph path's building blocks on hand-made tensors: row buckets, the static cache with its parent index, and
the attention of an example's rows over its keys (``graphs/buckets.py``, ``static_cache.py``, ``attention.py``).

The parent index is checked against what it replaces, a cache physically reordered after every step as the eager
lean steps reorder theirs: the keys a row reaches through the index are the very values the reordered cache holds
(an indexing identity, so bitwise), and attention through the mask equals per-row attention over the reordered
cache within the score tolerance (other shapes, so other summation orders).
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_scores_close

from beamsearch.graphs.buckets import bucket_size, real_examples
from beamsearch.steps.attention import additive, attend, group_mask
from beamsearch.steps.caches import StaticCache
from beamsearch.steps.padding import pad_examples, padding_index

B, K, T, G, D = 3, 4, 7, 2, 5  # examples, slots, capacity, heads, head size


@pytest.mark.parametrize(("examples", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (16, 16), (17, 32), (64, 64),
                                                  (256, 256), (257, 512), (600, 768)])
def test_buckets_are_powers_of_two_then_multiples_of_the_largest(examples: int, bucket: int) -> None:
    assert bucket_size(examples) == bucket


def test_a_bucket_repeats_the_last_example_and_marks_the_padding() -> None:
    rows = torch.tensor([[1, 2], [3, 4], [5, 6]])
    assert padding_index(3, 4).tolist() == [0, 1, 2, 2]
    assert pad_examples(rows, 4).tolist() == [[1, 2], [3, 4], [5, 6], [5, 6]]
    assert pad_examples(rows, 3) is rows and pad_examples(None, 4) is None
    assert real_examples(3, 4).tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match="cannot hold"):
        padding_index(5, 4)
    with pytest.raises(ValueError, match="at least one example"):
        bucket_size(0)


def _random_steps(steps: int, seed: int = 0):
    """Per step: keys and values ``[N, G, d]`` and parents within each example ``[N]``."""
    generator = torch.Generator().manual_seed(seed)
    n = B * K
    example_start = torch.arange(n) // K * K
    return [(torch.randn(n, G, D, generator=generator), torch.randn(n, G, D, generator=generator),
             example_start + torch.randint(K, (n,), generator=generator)) for _ in range(steps)]


def test_the_parent_index_reaches_what_a_reordered_cache_holds() -> None:
    """Each step writes every row's key at the position, then rows take random parents within their examples: the
    reference cache ``[T, N, G, d]`` is gathered by the parents (the eager reorder), the static one only moves its
    index, and the key of row n at position t through the index is the reference's, bit for bit."""
    cache = StaticCache(1, B, T, K, G, D, torch.float32, "cpu")
    reference = torch.zeros(T, B * K, G, D)
    buffers = [cache.keys[0].data_ptr(), cache.ancestry.data_ptr()]
    for position, (key, value, parents) in enumerate(_random_steps(T)):
        at = torch.tensor(position)
        cache.claim(at)
        cache.write(0, at, key, value)
        reference[position] = key
        cache.reorder(parents)
        reference = reference.index_select(1, parents)
        rows = torch.arange(B * K)
        for t in range(position + 1):  # keys[b, t, ancestry[n, t]] for every row n
            reached = cache.keys[0][rows // K, t, cache.ancestry[:, t]]  # [N, G, d]
            assert torch.equal(reached, reference[t])
    assert [cache.keys[0].data_ptr(), cache.ancestry.data_ptr()] == buffers  # in place: a graph keeps addresses


def test_the_mask_lets_each_row_see_its_ancestors_up_to_the_position() -> None:
    cache = StaticCache(1, B, T, K, G, D, torch.float32, "cpu")
    padding = torch.ones(B, T, dtype=torch.bool)
    padding[1, :2] = False  # example 1's first two positions are left padding
    for position, (_, _, parents) in enumerate(_random_steps(4)):
        cache.claim(torch.tensor(position))
        cache.reorder(parents)
    allowed = cache.allowed(torch.tensor(3), padding).view(B, K, T, K)  # [B, K, T, K slots]
    assert allowed.shape == (B, K, T, K)
    per_position = allowed.sum(dim=-1)  # [B, K, T]: slots a row sees at each position
    assert torch.equal(per_position[:, :, 4:], torch.zeros(B, K, T - 4, dtype=torch.long))  # nothing after 3
    expected = torch.ones(B, K, 4, dtype=torch.long)
    expected[1, :, :2] = 0  # padding blocked
    assert torch.equal(per_position[:, :, :4], expected)
    seen = torch.nn.functional.one_hot(cache.ancestry[:, :4], K).bool().view(B, K, 4, K)  # the ancestor's slot
    seen[1, :, :2] = False
    assert torch.equal(allowed[:, :, :4], seen)


def test_writing_at_a_tensor_position_touches_that_position_only() -> None:
    cache = StaticCache(2, B, T, K, G, D, torch.float32, "cpu")
    key, value, _ = _random_steps(1)[0]
    cache.write(1, torch.tensor(5), key, value)
    assert torch.equal(cache.keys[1][:, 5].reshape(B * K, G, D), key)
    assert torch.equal(cache.values[1][:, 5].reshape(B * K, G, D), value)
    untouched = torch.ones(T, dtype=torch.bool)
    untouched[5] = False
    assert not cache.keys[1][:, untouched].any() and not cache.keys[0].any()


def test_the_prompt_fills_every_slot_of_its_example() -> None:
    cache = StaticCache(1, B, T, K, G, D, torch.float32, "cpu")
    prompt = torch.randn(B, G, 3, D)  # [B, G, P, d]
    cache.fill_prompt(0, prompt, -prompt)
    for slot in range(K):
        assert torch.equal(cache.keys[0][:, :3, slot], prompt.permute(0, 2, 1, 3))
        assert torch.equal(cache.values[0][:, :3, slot], -prompt.permute(0, 2, 1, 3))
    assert not cache.keys[0][:, 3:].any()


@pytest.mark.parametrize("heads", [G, 2 * G])  # grouped-query attention: 2 query heads per key/value head
def test_attention_through_the_index_equals_attention_over_a_reordered_cache(heads: int) -> None:
    """At every step, each row's query over its ancestors (the index and mask) against per-row attention over the
    reordered reference cache's first ``position + 1`` positions (keys repeated per query head, as ``repeat_kv``)."""
    cache = StaticCache(1, B, T, K, G, D, torch.float32, "cpu")
    reference_keys, reference_values = torch.zeros(T, B * K, G, D), torch.zeros(T, B * K, G, D)
    generator = torch.Generator().manual_seed(5)
    for position, (key, value, parents) in enumerate(_random_steps(T, seed=1)):
        at = torch.tensor(position)
        cache.claim(at)
        cache.write(0, at, key, value)
        reference_keys[position], reference_values[position] = key, value
        query = torch.randn(B * K, heads, D, generator=generator)
        keys, values = cache.grouped(0)
        mask = group_mask(cache.allowed(at) if position % 2 else additive(cache.allowed(at), query.dtype), heads // G)
        got = attend(query, keys, values, mask, 0.5)  # [N, H*d]: a boolean mask, or the additive one
        per_row_keys = reference_keys[: position + 1].permute(1, 2, 0, 3).repeat_interleave(heads // G, dim=1)
        per_row_values = reference_values[: position + 1].permute(1, 2, 0, 3).repeat_interleave(heads // G, dim=1)
        expected = torch.nn.functional.scaled_dot_product_attention(query[:, :, None], per_row_keys, per_row_values,
                                                                    scale=0.5)  # [N, H, 1, d]
        assert_scores_close(got, expected.reshape(B * K, heads * D))
        cache.reorder(parents)
        reference_keys = reference_keys.index_select(1, parents)
        reference_values = reference_values.index_select(1, parents)


def test_masks_for_grouped_queries() -> None:
    """A key/value head's H/G query heads are packed as query positions (head-major): each repeats the K rows' mask;
    the additive mask is 0 where the boolean one lets through, -inf elsewhere."""
    allowed = torch.rand(2, 1, 3, 5, generator=torch.Generator().manual_seed(0)) < 0.5  # [B, 1, K, X]
    grouped = group_mask(allowed, 2)  # [B, 1, 2*K, X]
    assert grouped.shape == (2, 1, 6, 5)
    assert torch.equal(grouped[:, :, :3], allowed) and torch.equal(grouped[:, :, 3:], allowed)
    assert group_mask(allowed, 1) is allowed
    mask = additive(allowed, torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and torch.equal(mask == 0, allowed)
    assert bool(mask[~allowed].eq(-torch.inf).all())
    with pytest.raises(ValueError, match="per-head mask"):
        group_mask(torch.zeros(1, 2, 2, 3, dtype=torch.bool), 2)
