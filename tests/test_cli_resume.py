"""``decode --resume`` of an output that is already complete: nothing to do when this command made it, refused
(one line, exit status 2, nothing touched) when another input, format or option did, or when nothing says what
made it. The single process and ``--ray`` keep the same fingerprint beside a complete output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from beamsearch.cli import main  # noqa: E402
from beamsearch.cli.inputs import CLIError  # noqa: E402
from beamsearch.cli.outputs import check_complete  # noqa: E402
from beamsearch.distributed.blocks import BlockStore  # noqa: E402

WORDS = ["hello", "beam", "search", "cat"]


def write(folder: Path, name: str, lines: list[str]) -> str:
    path = folder / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def refused(argv: list[str], capsys) -> str:
    """The one-line error of a refused command (exit status 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("beamsearch: error: --resume: ") and err.count("\n") == 1, err
    return err


def test_a_complete_output_of_the_same_command_is_left_as_it_is(tmp_path, capsys):
    f = write(tmp_path, "in.txt", WORDS)
    out = tmp_path / "out.tsv"
    argv = ["decode", f, "--format", "tsv", "-q", "-o", str(out)]
    assert main(argv) == 0
    data = out.read_bytes()
    kept = json.loads((tmp_path / "out.tsv.resume.json").read_text())
    assert kept["output_sha256"] == hashlib.sha256(data).hexdigest()
    assert kept["options"]["format"] == "tsv"
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert "out.tsv is complete (no out.tsv.partial is left): nothing to resume" in capsys.readouterr().err
    assert main([*argv, "--resume", "--batch-size", "1", "--threads", "1"]) == 0  # no change to the outputs
    assert "nothing to resume" in capsys.readouterr().err
    assert out.read_bytes() == data


def test_a_complete_output_of_another_input_format_or_option_is_refused(tmp_path, capsys):
    f = write(tmp_path, "in.txt", WORDS)
    out = tmp_path / "out.txt"
    argv = ["decode", f, "-q", "-o", str(out)]
    assert main(argv) == 0
    data, fingerprint = out.read_bytes(), (tmp_path / "out.txt.resume.json").read_bytes()
    other = write(tmp_path, "other.txt", WORDS)  # the same lines, another file
    cases = [
        (["decode", f, "--format", "tsv", "-q", "-o", str(out)], "the options differ from those it was made "
                                                                  "with (--format 'text' -> 'tsv')"),
        ([*argv, "--num-beams", "3"], "the options differ from those it was made with (--num-beams None -> 3)"),
        (["decode", other, "-q", "-o", str(out)], "the input files differ from those it was made with"),
    ]
    for command, message in cases:
        err = refused([*command, "--resume"], capsys)
        assert f"{out} is complete, but {message}" in err and "--overwrite instead of --resume" in err
    write(tmp_path, "in.txt", [*WORDS, "dog"])  # the same file name, other contents
    assert "the input files differ" in refused([*argv, "--resume"], capsys)
    assert out.read_bytes() == data and (tmp_path / "out.txt.resume.json").read_bytes() == fingerprint


def test_a_complete_output_without_its_fingerprint_or_changed_since_is_refused(tmp_path, capsys):
    f = write(tmp_path, "in.txt", WORDS)
    out = tmp_path / "out.txt"
    argv = ["decode", f, "-q", "-o", str(out), "--resume"]
    out.write_text("made by hand\n")
    err = refused(argv, capsys)
    assert "is complete but has no fingerprint (out.txt.resume.json;" in err and "--overwrite" in err
    assert out.read_text() == "made by hand\n"

    out.unlink()
    assert main(argv) == 0  # --resume with nothing there: a new run
    assert len(out.read_text().splitlines()) == len(WORDS)
    out.write_text(out.read_text().lower())  # edited after that run
    assert "is not the file out.txt.resume.json fingerprints" in refused(argv, capsys)


def test_an_empty_file_without_a_fingerprint_is_no_output(tmp_path, capsys):
    """As without --resume (where an empty file is replaced without --overwrite), e.g. a file the shell made."""
    f = write(tmp_path, "in.txt", WORDS)
    out = tmp_path / "out.txt"
    out.write_text("")
    assert main(["decode", f, "-q", "-o", str(out), "--resume"]) == 0
    assert len(out.read_text().splitlines()) == len(WORDS)


def test_ray_resume_applies_the_same_rule_to_a_single_process_output(tmp_path, capsys):
    """The complete output's fingerprint leaves out the block layout (--chunk-size, ...): a --ray --resume of the
    command that made an output in one process has nothing to do; another option is refused. Ray never starts."""
    f = write(tmp_path, "in.txt", WORDS)
    out = tmp_path / "out.txt"
    argv = ["decode", f, "-q", "-o", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--ray", "--resume", "--chunk-size", "2"]) == 0
    assert "nothing to resume" in capsys.readouterr().err
    err = refused([*argv, "--ray", "--resume", "--num-beams", "2"], capsys)
    assert "options differ from those it was made with (--num-beams None -> 2)" in err


def test_the_block_store_keeps_the_complete_outputs_fingerprint_without_its_layout(tmp_path):
    out = tmp_path / "out.txt"
    options = {"num_beams": 5, "format": "text"}
    blocks = {"beamsearch": "0", "inputs": [], "options": {**options, "chunk_size": 2, "batch_size": 64}}
    store = BlockStore(str(out), "txt", resume=False, overwrite=False)
    store.start(blocks)
    store.save(0, "a\nb\n", 2)
    store.assemble(1)
    kept = json.loads((tmp_path / "out.txt.resume.json").read_text())
    assert kept["options"] == options
    assert kept["output_sha256"] == hashlib.sha256(b"a\nb\n").hexdigest()
    check_complete(out, {"beamsearch": "0", "inputs": [], "options": options})  # accepted: no error
    with pytest.raises(CLIError, match=r"--num-beams 5 -> 4"):
        check_complete(out, {"beamsearch": "0", "inputs": [], "options": {**options, "num_beams": 4}})
