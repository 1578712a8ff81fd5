"""``candidates.py``: the candidate directories hold the checkpoints' weights, and ``--soup`` the mean of several runs'
best checkpoints. Run by hand with the trainer's other tests:

    OMP_NUM_THREADS=1 PYTHONPATH=runs/pydeps .venv/bin/python -m pytest -q training/test_candidates.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import candidates  # noqa: E402


def tiny_run(path: Path, seed: int, d_ff: int = 32) -> dict:
    """A run directory with ``best.pt`` and ``ckpt_last.pt`` of a tiny T5, as train_g2p.py writes them."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=101, d_model=16, d_ff=d_ff, num_layers=1, num_heads=2, d_kv=8,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    path.mkdir()
    torch.save({"model": state, "config": config.to_dict(), "best": {}}, path / "best.pt")
    torch.save({"model": state, "config": config.to_dict(), "state": {"step": 1}}, path / "ckpt_last.pt")
    return state


def saved(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def test_soup_is_the_mean_of_the_runs_best_weights(tmp_path):
    a, b, c = (tiny_run(tmp_path / name, seed) for name, seed in (("a", 1), ("b", 2), ("c", 3)))
    candidates.main([str(tmp_path / "a"), str(tmp_path / "out"), "--soup", str(tmp_path / "b"), str(tmp_path / "c")])
    soup, best = saved(tmp_path / "out" / "soup"), saved(tmp_path / "out" / "best")
    name = "encoder.block.0.layer.1.DenseReluDense.wi.weight"
    assert torch.equal(best[name], a[name].half())
    assert torch.equal(soup[name], ((a[name] + b[name] + c[name]) / 3).half())
    assert not torch.equal(soup[name], best[name])
    assert (tmp_path / "out" / "soup" / "tokenizer.json").is_file()  # the shipped tokenizer goes with each candidate


def test_soup_refuses_runs_of_another_shape(tmp_path, capsys):
    tiny_run(tmp_path / "a", 1)
    tiny_run(tmp_path / "wide", 2, d_ff=64)
    with pytest.raises(SystemExit):
        candidates.main([str(tmp_path / "a"), str(tmp_path / "out"), "--soup", str(tmp_path / "wide")])
    assert "names or shapes differ" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_step_snapshotted_twice_counts_once_in_a_mean(tmp_path):
    """A run stopped right after a periodic checkpoint saves the same step again, and both copies land in snap/: the
    mean of the last N snapshots is over N distinct steps."""
    tiny_run(tmp_path / "run", 1)
    snap = tmp_path / "run" / "snap"
    snap.mkdir()
    weights = {}
    copies = (("ckpt_100.pt", 1, 1), ("ckpt_200.pt", 2, 2), ("ckpt_218.pt", 2, 2), ("ckpt_300.pt", 3, 3))
    for name, step, seed in copies:
        torch.manual_seed(seed)
        weights[step] = {"encoder.w": torch.randn(4, 4)}
        torch.save({"model": weights[step], "state": {"step": step}}, snap / name)
    assert [path.name for path in candidates.snapshots(tmp_path / "run")] == ["ckpt_100.pt", "ckpt_200.pt",
                                                                              "ckpt_300.pt"]
    states = [torch.load(path, weights_only=False) for path in candidates.snapshots(tmp_path / "run")[-3:]]
    expected = (weights[1]["encoder.w"] + weights[2]["encoder.w"] + weights[3]["encoder.w"]) / 3
    assert torch.allclose(candidates.mean_weights(states)["encoder.w"], expected)
