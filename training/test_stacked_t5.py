"""The GPU trainer's pieces against transformers and torch, on the CPU (not in CI's ``tests/``; run by hand):

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q training/test_stacked_t5.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stacked_step import (  # noqa: E402
    AdamW,
    GraphedSteps,
    Objective,
    StackTrainer,
    clip_per_member,
    distillation_loss,
    reference_loss,
)
from stacked_t5 import (  # noqa: E402
    PAD,
    StackedT5,
    T5Shape,
    dropout,
    flat_from_hf,
    group_sizes,
    hf_state_dict,
    init_flat,
    relative_buckets,
)

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

SHAPE = T5Shape(vocab_size=101, d_model=32, d_ff=48, layers=2, heads=4, d_kv=8)


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


def test_logits_equal_transformers():
    k = 2
    matrices, vectors = init_flat(SHAPE, seeds=[11, 12])
    model = StackedT5(SHAPE)
    src, dec = batch(k)
    with torch.no_grad():
        w = model.weights(matrices, vectors)
        enc, mask = model.encode(w, src.expand(k, -1, -1))
        logits = model.decode(w, dec.expand(k, -1, -1), enc, mask)  # [K, B, T, V]
    for member in range(k):
        hf = hf_model(SHAPE, hf_state_dict(SHAPE, matrices[member], vectors[member]))
        with torch.no_grad():
            expected = hf(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=dec).logits
        torch.testing.assert_close(logits[member], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits[0], logits[1])  # the members differ


def test_exported_directory_round_trip(tmp_path):
    matrices, vectors = init_flat(SHAPE, seeds=[5])
    state = hf_state_dict(SHAPE, matrices[0], vectors[0])
    hf = hf_model(SHAPE, state)
    hf.save_pretrained(tmp_path)
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path)
    back_m, back_v = flat_from_hf(SHAPE, loaded.state_dict())
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
        for flat, group in ((m, model.matrix_entries), (v, model.vector_entries)):
            parts = flat.split([math.prod(e.shape) for e in group], dim=1)
            out.update({e.name: part.reshape(flat.shape[0], *e.shape) for e, part in zip(group, parts, strict=True)})
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


def test_tensor_rate_dropout():
    x = torch.ones(200_000)
    assert torch.equal(dropout(x, torch.tensor(0.0), True), x)
    y = dropout(x, torch.tensor(0.3), True)
    assert abs((y == 0).float().mean().item() - 0.3) < 0.01
    assert torch.allclose(y[y != 0], torch.tensor(1 / 0.7))
    assert torch.equal(dropout(x, 0.3, False), x)


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


class FakeCuda:
    """Stand-ins for the CUDA graph API on the CPU: "capturing" runs the step once and records it, a replay runs it
    again with whatever the static tensors then hold (a real graph records kernels, not Python)."""

    def __init__(self, monkeypatch, broken: bool = False):
        recording = {}

        class Graph:
            def replay(self):
                if not broken:
                    recording[self]()

        class Capture:
            def __init__(self, graph, pool=None):
                self.graph = graph

            def __enter__(self):
                recording["current"] = self.graph

            def __exit__(self, *exc):
                return False

        class Stream:
            def wait_stream(self, other):
                pass

        class StreamContext:
            def __init__(self, stream):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        self.recording = recording
        for name, value in {"CUDAGraph": Graph, "graph": Capture, "Stream": Stream, "stream": StreamContext,
                            "current_stream": Stream, "graph_pool_handle": lambda: None,
                            "synchronize": lambda: None}.items():
            monkeypatch.setattr(torch.cuda, name, value)


def graphed_trainer(monkeypatch, broken: bool):
    from stacked_data import BucketedData

    fake = FakeCuda(monkeypatch, broken)
    matrices, vectors = init_flat(SHAPE, seeds=[1, 2])
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(3, 30, (n,), generator=g).tolist() + [1], torch.randint(32, 101, (n,), generator=g)
              .tolist() + [1]) for n in [3, 4, 5, 6, 7] * 8]
    data = BucketedData(pairs, 8, torch.device("cpu"), lengths=(5, 64))
    trainer = StackTrainer(StackedT5(SHAPE), matrices, vectors, data, Objective(0.1))
    trainer.optimizer.lr.fill_(1e-3)
    graphs = GraphedSteps(trainer, 0.3, log=print)
    original = trainer.step

    def step(bucket, index, rate):  # record what a capture would replay
        if fake.recording.get("current") is not None:
            graph = fake.recording.pop("current")
            fake.recording[graph] = lambda: original(bucket, graphs.index[bucket], graphs.rate_tensor)
        original(bucket, index, rate)

    trainer.step = step
    return trainer, graphs, data


@pytest.mark.parametrize("broken", [False, True])
def test_graph_capture_is_checked_and_leaves_the_state(monkeypatch, broken):
    trainer, graphs, data = graphed_trainer(monkeypatch, broken)
    before = [t.clone() for t in trainer.state()]
    examples = {}
    for bucket, index in data.epoch(0, [1, 2]):
        examples.setdefault(bucket, index)
    assert graphs.capture(examples) is (not broken)
    for t, b in zip(trainer.state(), before, strict=True):
        assert torch.equal(t, b)
    assert float(graphs.rate_tensor) == pytest.approx(0.3)
    if not broken:  # a replay trains with the index copied in
        bucket, index = next(iter(examples.items()))
        graphs.step(bucket, index)
        assert not torch.equal(trainer.params[0], before[0])


def test_a_training_step_never_reads_the_device(monkeypatch):
    """No host read (``.item()``, ``nonzero``, ...) inside a step: one would break a CUDA graph capture."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            assert name not in ("_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"), name
            return func(*args, **(kwargs or {}))

    trainer, graphs, data = graphed_trainer(monkeypatch, broken=False)
    bucket, index = data.epoch(0, [1, 2])[0]
    with NoHostReads():
        trainer.step(bucket, index, graphs.rate_tensor)
        trainer.step(bucket, index, 0.3)
