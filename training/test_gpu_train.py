"""The GPU run's resume (``gpu_train.py --init``) on the CPU, run by hand with the trainer's other tests:

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q training/test_gpu_train.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_train import init_from_files, save_member  # noqa: E402
from stacked_fixtures import SHAPE  # noqa: E402
from stacked_t5 import init_flat  # noqa: E402


def returned_files(folder: Path, wers: dict[str, float]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Files as an earlier run returns them (float16, transformers' names, the facts in the metadata), one per name
    with the given dev WER; each file's flat weights rounded to float16, as a resume reads them back."""
    written = {}
    for seed, (name, wer) in enumerate(wers.items()):
        matrices, vectors = init_flat(SHAPE, [seed])
        save_member(folder / name, SHAPE, matrices[0], vectors[0],
                    {"dev_greedy": {"wer": wer}, "shape": dataclasses.asdict(SHAPE)})
        written[name] = (matrices[0].half().float(), vectors[0].half().float())
    return written


def test_the_teachers_start_from_the_returned_files_best_first_repeated(tmp_path):
    written = returned_files(tmp_path, {"teacher0.safetensors": 30.0, "teacher3.safetensors": 20.0,
                                        "student.safetensors": 25.0})
    matrices, vectors, names = init_from_files(tmp_path, SHAPE, 5)
    assert names == ["teacher3.safetensors", "student.safetensors", "teacher0.safetensors",
                     "teacher3.safetensors", "student.safetensors"]
    for k, name in enumerate(names):
        assert torch.equal(matrices[k], written[name][0]), name  # float16 values are exact in float32
        assert torch.equal(vectors[k], written[name][1]), name


def test_a_resume_refuses_another_shape_and_an_empty_folder(tmp_path):
    returned_files(tmp_path, {"teacher0.safetensors": 30.0})
    other = dataclasses.replace(SHAPE, d_ff=SHAPE.d_ff * 2)
    with pytest.raises(SystemExit, match="teacher0.safetensors holds a model of shape"):
        init_from_files(tmp_path, other, 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no teacher"):
        init_from_files(tmp_path / "empty", SHAPE, 2)
