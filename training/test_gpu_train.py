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

from gpu_train import init_from_files, parse, save_member  # noqa: E402
from stacked_data import tokenizer_vocab  # noqa: E402
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


def test_the_returned_files_leave_the_flat_teachers_file_alone(tmp_path):
    """``teachers.safetensors`` (the work folder's flat float32 file) is not a returned teacher."""
    returned_files(tmp_path, {"teacher0.safetensors": 30.0})
    (tmp_path / "teachers.safetensors").write_bytes(b"not a returned file")
    assert init_from_files(tmp_path, SHAPE, 2)[2] == ["teacher0.safetensors"] * 2


def test_a_student_shape_is_five_positive_integers_and_starts_from_scratch():
    a = parse(["--student-shape", "192,768,3,6,32", "--student-init", "scratch"])
    assert a.student_shape == {"d_model": 192, "d_ff": 768, "layers": 3, "heads": 6, "d_kv": 32, "decoder_layers": 0}
    a = parse(["--student-shape", "192,768,6,6,32,3", "--student-init", "scratch"])
    assert (a.student_shape["layers"], a.student_shape["decoder_layers"]) == (6, 3)
    assert parse([]).student_shape is None
    for bad in (["--student-shape", "192,768,3", "--student-init", "scratch"],
                ["--student-shape", "192,768,3,6,32,3,1", "--student-init", "scratch"],
                ["--student-shape", "192,768,3,0,32", "--student-init", "scratch"],
                ["--student-shape", "192,768,3,6,32"]):  # --student-init best needs the teachers' shape
        with pytest.raises(SystemExit):
            parse(bad)


def test_students_of_another_shape_are_trained_written_and_exported(tmp_path):
    """Teachers of one shape, a student of another (its encoder deeper than its decoder), on a tiny data folder; the
    student's file states its own shape and exports to a transformers model whose logits equal the trainer's
    (finish_gpu_run's check)."""
    import json

    from finish_gpu_run import DATA, SHIPPED, export, stored_facts
    from gpu_train import main

    data = tmp_path / "data"
    data.mkdir()
    (data / "vocab.json").write_text(json.dumps(tokenizer_vocab(SHIPPED / "tokenizer.json")))
    pairs = [line.split("\t")[:2] for line in (DATA / "test.tsv").read_text().splitlines()[:600]]
    (data / "train.tsv").write_text("".join(f"{w}\t{p}\n" for w, p in pairs))
    (data / "dev.tsv").write_text("".join((DATA / "dev.tsv").read_text().splitlines(keepends=True)[:20]))
    out = tmp_path / "out"
    teacher = ["--d-model", "32", "--d-ff", "64", "--layers", "1", "--heads", "2", "--d-kv", "16"]
    main(["--data", str(data), "--out", str(out), "--device", "cpu", "--graphs", "off", "--teachers", "2",
          "--students", "1", "--student-alphas", "0.5", "--student-init", "scratch", "--student-shape",
          "24,48,2,3,8,1", "--budget", "30", "--reserve", "1", "--min-student-seconds", "5", "--batch-size", "16",
          "--log-every", "10", "--eval-every", "20", "--warmup", "20", *teacher])
    facts = stored_facts(out / "student.safetensors")
    assert {k: facts["shape"][k] for k in ("d_model", "d_ff", "layers", "heads", "d_kv", "decoder_layers")} == \
        {"d_model": 24, "d_ff": 48, "layers": 2, "heads": 3, "d_kv": 8, "decoder_layers": 1}
    assert stored_facts(out / "teacher0.safetensors")["shape"]["d_model"] == 32
    run = json.loads((out / "run.json").read_text())
    assert run["student_shape"]["d_model"] == 24 and run["shape"]["d_model"] == 32
    export(out / "student.safetensors", run, tmp_path / "student")  # raises if the logits differ
    config = json.loads((tmp_path / "student" / "config.json").read_text())
    assert (config["num_layers"], config["num_decoder_layers"]) == (2, 1)


def test_the_teachers_can_start_from_the_shipped_model_directory(tmp_path):
    """``--init`` on an exported model directory: every member is that model (the trainer's logits equal
    transformers' on it); another shape or vocabulary is refused."""
    import json
    import shutil

    from finish_gpu_run import SHIPPED
    from stacked_t5 import StackedT5, T5Shape
    from transformers import AutoModelForSeq2SeqLM

    config = json.loads((SHIPPED / "config.json").read_text())
    shape = T5Shape(vocab_size=config["vocab_size"], d_model=config["d_model"], d_ff=config["d_ff"],
                    layers=config["num_layers"], heads=config["num_heads"], d_kv=config["d_kv"])
    vocab = tokenizer_vocab(SHIPPED / "tokenizer.json")
    vocab_map = {token: i for i, token in enumerate(vocab)}
    matrices, vectors, names = init_from_files(SHIPPED, shape, 2, vocab)
    assert names == [SHIPPED.name] * 2 and torch.equal(matrices[0], matrices[1])
    src = torch.tensor([[vocab_map[c] for c in "hello"] + [1]])
    dec = torch.tensor([[0, 40, 50, 60]])
    model = StackedT5(shape)
    with torch.no_grad():
        w = model.weights(matrices[:1], vectors[:1])
        enc, mask = model.encode(w, src[None])
        ours = model.decode(w, dec[None], enc, mask)[0]
        theirs = AutoModelForSeq2SeqLM.from_pretrained(SHIPPED).eval()(input_ids=src, decoder_input_ids=dec).logits
    assert (ours - theirs).abs().max() < 1e-3
    with pytest.raises(SystemExit, match="holds a model of shape"):
        init_from_files(SHIPPED, dataclasses.replace(shape, d_ff=64), 2, vocab)
    with pytest.raises(SystemExit, match="tokenizer differs from vocab.json"):
        init_from_files(SHIPPED, shape, 2, vocab[::-1])
    folder = tmp_path / "model"
    shutil.copytree(SHIPPED, folder)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "d_kv"}))
    with pytest.raises(SystemExit, match="has no 'd_kv'"):
        init_from_files(folder, shape, 2, vocab)
