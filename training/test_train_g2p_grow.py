"""``train_g2p.py --init-from DIR --grow``: a deeper model warm-started from the shipped one computes what the shipped
one computes, run by hand with the trainer's other tests:

    OMP_NUM_THREADS=1 PYTHONPATH=runs/pydeps .venv/bin/python -m pytest -q training/test_train_g2p_grow.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_g2p import DEFAULT_EXPORT_DIR, init_weights, make_model, set_training_dropout  # noqa: E402

SHIPPED = DEFAULT_EXPORT_DIR
D_FF = json.loads((SHIPPED / "config.json").read_text())["d_ff"]  # the shipped model's feed-forward width


def shipped():
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    return AutoTokenizer.from_pretrained(SHIPPED), T5ForConditionalGeneration.from_pretrained(SHIPPED).eval()


def deeper(layers: int, decoder_layers: int, tok, grow: bool = True, d_ff: int = D_FF, d_model: int = 192):
    a = argparse.Namespace(d_model=d_model, d_ff=d_ff, layers=layers, decoder_layers=decoder_layers, heads=6, d_kv=32,
                           dropout=0.1, seed=7)
    model = make_model(a, len(tok))
    init_weights(model, tok, SHIPPED, grow=grow)
    return model


def logits(model, tok) -> torch.Tensor:
    batch = tok(["hello", "beamsearch", "pronunciation", "a"], return_tensors="pt", padding=True)
    labels = tok(["HH AH0 L OW1", "B IY1 M S ER0 CH", "P R OW0 N AH2 N S IY0 EY1 SH AH0 N", "AH0"],
                 return_tensors="pt", padding=True)["input_ids"]
    with torch.no_grad():
        return model(**batch, labels=labels).logits


@pytest.mark.parametrize("layers, decoder_layers", [(6, 3), (4, 5)])
def test_a_grown_model_computes_what_the_saved_one_computes(layers, decoder_layers):
    tok, ref = shipped()
    model = deeper(layers, decoder_layers, tok).eval()
    assert len(model.encoder.block) == layers and len(model.decoder.block) == decoder_layers
    # the extra layers add exactly zero to the residual stream: same operations on the same shapes as the saved
    # model's layers, then + 0, so the logits are bitwise equal
    assert torch.equal(logits(model, tok), logits(ref, tok))
    extra = model.encoder.block[-1] if layers > 3 else model.decoder.block[-1]
    assert extra.layer[0].SelfAttention.o.weight.abs().sum() == 0
    assert extra.layer[-1].DenseReluDense.wo.weight.abs().sum() == 0
    assert extra.layer[0].SelfAttention.q.weight.abs().sum() > 0  # the rest is a fresh initialisation


def test_a_wider_feed_forward_computes_what_the_saved_one_computes():
    tok, ref = shipped()
    model = deeper(4, 3, tok, d_ff=D_FF + 256).eval()
    ff = model.decoder.block[0].layer[2].DenseReluDense
    saved = ref.decoder.block[0].layer[2].DenseReluDense
    assert torch.equal(ff.wi.weight[:D_FF], saved.wi.weight) and torch.equal(ff.wo.weight[:, :D_FF], saved.wo.weight)
    assert ff.wo.weight[:, D_FF:].abs().sum() == 0 and ff.wi.weight[D_FF:].abs().sum() > 0
    # the extra units add zeros, but to longer products than the saved model's: equal to float rounding only
    assert torch.allclose(logits(model, tok), logits(ref, tok), atol=1e-4, rtol=0)


def test_the_extra_layers_learn_from_the_first_steps():
    tok, _ = shipped()
    model = deeper(4, 3, tok)
    set_training_dropout(model, 0.0, 0.0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    new = model.encoder.block[3]
    before = {k: v.clone() for k, v in new.state_dict().items()}
    for _ in range(2):  # step 1 moves the zero projections, step 2 the layer's inputs behind them
        batch = tok(["hello", "world"], return_tensors="pt", padding=True)
        labels = tok(["HH AH0 L OW1", "W ER1 L D"], return_tensors="pt", padding=True)["input_ids"]
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    moved = [k for k, v in new.state_dict().items() if not torch.equal(v, before[k])]
    assert "layer.0.SelfAttention.o.weight" in moved and "layer.0.SelfAttention.q.weight" in moved
    assert "layer.1.DenseReluDense.wi.weight" in moved


def test_a_deeper_model_without_grow_and_a_shallower_one_are_refused():
    tok, _ = shipped()
    with pytest.raises(SystemExit, match="missing"):
        deeper(4, 3, tok, grow=False)
    with pytest.raises(SystemExit, match="encoder has 3 layers, more than the 2 asked"):
        deeper(2, 3, tok)
    with pytest.raises(SystemExit, match="adds layers and feed-forward units only"):
        deeper(3, 3, tok, d_ff=D_FF // 2)
