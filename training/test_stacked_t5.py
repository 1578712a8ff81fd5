"""The GPU trainer's model, losses and optimizer against transformers and torch, on the CPU (not in CI's ``tests/``;
run by hand, with the trainer's other tests):

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q training/test_stacked_t5.py training/test_stacked_dropout.py \
        training/test_stacked_step.py training/test_stacked_graphs.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stacked_fixtures import SHAPE  # noqa: E402
from stacked_step import AdamW, clip_per_member, distillation_loss, reference_loss  # noqa: E402
from stacked_t5 import (  # noqa: E402
    PAD,
    StackedT5,
    T5Shape,
    flat_from_hf,
    group_sizes,
    hf_state_dict,
    init_flat,
    relative_buckets,
)

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)


def hf_model(shape: T5Shape, state: dict[str, torch.Tensor]):
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**shape.hf_config(), dropout_rate=0.0))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    return model.eval()


def batch(k: int, b: int = 3, s: int = 7, t: int = 6, seed: int = 0):
    """Random sources and decoder inputs with ragged padding (the same rows for every member)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, 101, (b, s), generator=g)
    dec = torch.randint(3, 101, (b, t), generator=g)
    dec[:, 0] = PAD
    for row, n in enumerate([s, s - 2, 2][:b]):
        src[row, n:] = PAD
    return src, dec


@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_equal_transformers(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    n = 100
    relative = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    expected = T5Attention._relative_position_bucket(relative, bidirectional, 32, 64)
    assert torch.equal(relative_buckets(n, bidirectional, 32, 64), expected)


DEEP_ENCODER = T5Shape(vocab_size=101, d_model=32, d_ff=48, layers=3, heads=4, d_kv=8, decoder_layers=1)


@pytest.mark.parametrize("shape", [SHAPE, DEEP_ENCODER])
def test_logits_equal_transformers(shape):
    k = 2
    matrices, vectors = init_flat(shape, seeds=[11, 12])
    model = StackedT5(shape)
    src, dec = batch(k)
    with torch.no_grad():
        w = model.weights(matrices, vectors)
        enc, mask = model.encode(w, src.expand(k, -1, -1))
        logits = model.decode(w, dec.expand(k, -1, -1), enc, mask)  # [K, B, T, V]
    for member in range(k):
        hf = hf_model(shape, hf_state_dict(shape, matrices[member], vectors[member]))
        assert (hf.config.num_layers, hf.config.num_decoder_layers) == (shape.layers, shape.dec_layers)
        with torch.no_grad():
            expected = hf(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=dec).logits
        torch.testing.assert_close(logits[member], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits[0], logits[1])  # the members differ


@pytest.mark.parametrize("shape", [SHAPE, DEEP_ENCODER])
def test_exported_directory_round_trip(tmp_path, shape):
    matrices, vectors = init_flat(shape, seeds=[5])
    state = hf_state_dict(shape, matrices[0], vectors[0])
    hf = hf_model(shape, state)
    hf.save_pretrained(tmp_path)
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path)
    back_m, back_v = flat_from_hf(shape, loaded.state_dict())
    assert torch.equal(back_m, matrices[0]) and torch.equal(back_v, vectors[0])


def test_init_matches_transformers_scales():
    matrices, vectors = init_flat(T5Shape(), seeds=[0])
    state = hf_state_dict(T5Shape(), matrices[0], vectors[0])
    ref = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5Shape().hf_config())).state_dict()
    for name, w in state.items():
        assert w.shape == ref[name].shape, name
        expected = ref[name].float().std().item()  # both samples: tolerance ~4 standard errors of a std estimate
        assert abs(w.float().std().item() - expected) <= max(0.05, 4 / w.numel() ** 0.5) * expected + 1e-6, name
    assert group_sizes(T5Shape()) == (matrices.shape[1], vectors.shape[1])


def test_unflatten_gradient_is_the_sliced_gradient():
    matrices, vectors = init_flat(SHAPE, seeds=[1, 2])
    src, dec = batch(2)
    model = StackedT5(SHAPE)

    def plain_weights(m, v):  # autograd's own slicing views instead of _Unflatten
        out = {}
        groups = ((m, model.matrix_entries, [e.shape for e in model.matrix_entries]),
                  (v, model.vector_entries, model.vector_shapes))
        for flat, group, shapes in groups:
            parts = flat.split([math.prod(e.shape) for e in group], dim=1)
            out.update({e.name: part.reshape(flat.shape[0], *shape)
                        for e, part, shape in zip(group, parts, shapes, strict=True)})
        return out

    def loss(m, v, weights):
        w = weights(m, v)
        enc, mask = model.encode(w, src.expand(2, -1, -1))
        return model.decode(w, dec.expand(2, -1, -1), enc, mask).square().mean()

    m1, v1 = matrices.clone().requires_grad_(), vectors.clone().requires_grad_()
    g_m, g_v = torch.autograd.grad(loss(m1, v1, model.weights), [m1, v1])
    m2, v2 = matrices.clone().requires_grad_(), vectors.clone().requires_grad_()
    e_m, e_v = torch.autograd.grad(loss(m2, v2, plain_weights), [m2, v2])
    torch.testing.assert_close(g_m, e_m)
    torch.testing.assert_close(g_v, e_v)


def test_adamw_equals_torch():
    torch.manual_seed(0)
    params = [torch.randn(3, 50), torch.randn(3, 7)]
    ours = [p.clone() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW([{"params": [theirs[0]], "weight_decay": 0.01}, {"params": [theirs[1]], "weight_decay": 0}],
                            lr=1e-2, betas=(0.9, 0.98), eps=1e-8)
    adam = AdamW(ours, weight_decays=(0.01, 0.0), betas=(0.9, 0.98), eps=1e-8)
    for step in range(5):
        grads = [torch.randn_like(p) for p in params]
        lr = 1e-2 * (step + 1) / 5
        for g in opt.param_groups:
            g["lr"] = lr
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        adam.lr.fill_(lr)
        adam.step(grads)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b.detach())


def test_clip_per_member():
    grads = [torch.tensor([[3.0, 0.0], [0.3, 0.0]]), torch.tensor([[4.0], [0.4]])]  # norms 5 and 0.5
    clip_per_member(grads, 1.0)
    torch.testing.assert_close(grads[0], torch.tensor([[0.6, 0.0], [0.3, 0.0]]))
    torch.testing.assert_close(grads[1], torch.tensor([[0.8], [0.4]]))


def test_losses():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 5)  # [K, B, T, V]
    labels = torch.randint(0, 5, (2, 3, 4))
    labels[:, :, -1] = -100
    per_member = reference_loss(logits, labels, 0.1)
    for k in range(2):
        expected = torch.nn.functional.cross_entropy(logits[k].reshape(-1, 5), labels[k].reshape(-1),
                                                     ignore_index=-100, label_smoothing=0.1)
        torch.testing.assert_close(per_member[k], expected)
    # distillation towards a one-hot teacher equals the unsmoothed cross entropy
    target = torch.nn.functional.one_hot(labels.clamp(min=0), 5).float()
    torch.testing.assert_close(distillation_loss(logits, target, labels), reference_loss(logits, labels, 0.0))
