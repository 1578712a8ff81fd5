"""The model card's account of a run's learning-rate schedule (``train_g2p.schedule_words``), run by hand with the
trainer's other tests:

    PYTHONPATH=runs/pydeps .venv/bin/python -m pytest -q training/test_model_card.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_g2p import schedule_words  # noqa: E402


def test_a_decayed_schedule_names_its_floor_and_its_length():
    saved = {"min_lr_ratio": 0.02, "hours": 1.45, "time_schedule": True, "total_steps": 100000}
    assert schedule_words(saved) == "cosine decay to 0.02x over 87 minutes"
    assert schedule_words({**saved, "time_schedule": False}) == "cosine decay to 0.02x over 100000 steps"


def test_a_constant_rate_is_not_called_a_decay():
    # stage 9 (run 12a) trained at --min-lr-ratio 1: its card once said "cosine decay to 1.0x over 87 minutes"
    saved = {"min_lr_ratio": 1.0, "hours": 1.45, "time_schedule": True, "total_steps": 100000}
    assert schedule_words(saved) == "a constant rate after them (`--min-lr-ratio 1`)"
