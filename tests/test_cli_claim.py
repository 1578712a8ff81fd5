"""What ``decode -o FILE`` claims before it writes (src/beamsearch/cli/output_claim.py): an output that is one of the
inputs (the same file by device and inode: through a hard or symbolic link, another spelling of its path, stdin
redirected from it) is refused with and without ``--overwrite`` and nothing is written; ``FILE.lock`` makes a second
run on the same output refuse at once, naming the process that writes it; a lock left by a killed run blocks nothing.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from cli_processes import (  # noqa: E402
    assert_every_input_once_in_order,
    decode_argv,
    lines_in,
    run,
    start,
    wait_for,
    word_list,
)

from beamsearch.cli import main  # noqa: E402

WORDS = ["hello", "beam", "search", "cat"]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def refused(argv: list[str], capsys) -> str:
    """The one-line error of a command refused with exit status 2."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("beamsearch: error: ") and err.count("\n") == 1, err
    return err


def test_an_output_that_is_an_input_is_refused_and_nothing_is_written(tmp_path, capsys):
    words = write(tmp_path / "words.txt", WORDS)
    other = write(tmp_path / "other.txt", ["dog"])
    before = words.read_bytes()
    hard, soft = tmp_path / "hard.txt", tmp_path / "soft.txt"
    os.link(words, hard)
    soft.symlink_to(words)
    spelled = tmp_path / "sub" / ".." / "words.txt"
    (tmp_path / "sub").mkdir()
    cases = [  # inputs, output, flags, whether the message says that a link or another path joins them
        ([words], words, [], False), ([words], words, ["--overwrite"], False), ([words], words, ["--resume"], False),
        ([other, words], words, ["--overwrite"], False),  # any of the inputs
        ([words], spelled, ["--overwrite"], False),  # the same path once normalised
        ([words], hard, ["--overwrite"], True), ([words], soft, ["--overwrite"], True),
        ([soft], words, ["--overwrite"], True),
        ([words], words, ["--overwrite", "--ray"], False),  # refused before Ray is started
    ]
    for inputs, output, flags, linked in cases:
        err = refused(["decode", *map(str, inputs), "-o", str(output), *flags], capsys)
        assert f"--output {output} is the input {inputs[-1]}" in err and "would replace what it reads" in err, err
        assert ("the same file through a link or another path" in err) == linked, err
    assert words.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.txt", "other.txt", "soft.txt", "sub", "words.txt"]


def test_a_file_written_beside_the_output_that_is_an_input_is_refused(tmp_path, capsys):
    """``--resume`` appends to ``FILE.partial``: a partial file that is a link to an input would grow the input."""
    words = write(tmp_path / "words.txt", WORDS)
    before = words.read_bytes()
    (tmp_path / "out.txt.partial").symlink_to(words)
    err = refused(["decode", str(words), "-o", str(tmp_path / "out.txt"), "--resume"], capsys)
    assert f"out.txt.partial, written beside --output {tmp_path / 'out.txt'}, is the input {words}" in err, err
    assert words.read_bytes() == before and not (tmp_path / "out.txt").exists()


def test_stdin_redirected_from_the_output_is_refused(tmp_path, capsys, monkeypatch):
    words = write(tmp_path / "words.txt", WORDS)
    before = words.read_bytes()
    with words.open(encoding="utf-8") as redirected:  # `beamsearch decode - -o words.txt --overwrite < words.txt`
        monkeypatch.setattr(sys, "stdin", redirected)
        err = refused(["decode", "-", "-o", str(words), "--overwrite"], capsys)
        assert "is the input stdin (a file redirected to it)" in err, err
        err = refused(["decode", "-o", str(words), "--overwrite"], capsys)  # no file argument: stdin too
        assert "is the input stdin" in err, err
    assert words.read_bytes() == before


def test_eval_refuses_a_plot_over_its_data(tmp_path, capsys):
    data = tmp_path / "data.tsv"
    data.write_text("cat\tK AE1 T\ndog\tD AO1 G\n", encoding="utf-8")
    before = data.read_bytes()
    err = refused(["eval", "--data", str(data), "--search-errors", "--beams", "1", "2", "--plot", str(data)], capsys)
    assert f"--plot {data} is the input {data}" in err, err
    assert data.read_bytes() == before


def test_a_held_lock_refuses_every_run_on_that_output(tmp_path, capsys):
    """While another process holds ``FILE.lock`` (here this one, through a file it opened itself: flock locks
    conflict between open files, in one process as in two), a run on ``FILE`` is refused, whatever its flags, naming
    that process; once the lock is let go, the file left behind blocks nothing."""
    words = write(tmp_path / "words.txt", WORDS)
    out = tmp_path / "out.txt"
    with (tmp_path / "out.txt.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(f"{os.getpid()}\n")
        held.flush()
        for flags in ([], ["--overwrite"], ["--resume"], ["--ray"]):
            err = refused(["decode", str(words), "-o", str(out), *flags], capsys)
            assert f"--output {out} is being written by another beamsearch (process {os.getpid()})" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt.lock", "words.txt"]
    assert main(["decode", str(words), "-o", str(out), "-q"]) == 0
    assert len(out.read_text().splitlines()) == len(WORDS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "out.txt.resume.json", "words.txt"]


def test_a_second_process_on_the_same_output_refuses_at_once(tmp_path):
    """Two ``decode -o same.tsv`` one after the other: the second stops at once, naming the first, whose output is
    complete and right. The first reads its words from a pipe held open until the second has been refused, so it is
    still running then however fast it decodes (it claims the output before it reads any input)."""
    _, lines = word_list(tmp_path, 300)
    out = tmp_path / "same.tsv"
    first = start(decode_argv(Path("-"), out), stdin=subprocess.PIPE)
    try:
        lock = tmp_path / "same.tsv.lock"
        wait_for(lambda: lock.exists() and lock.read_text() == f"{first.pid}\n", first,
                 "the first run claimed the output")
        second = run(decode_argv(tmp_path / "words.txt", out))
        assert first.poll() is None, "the first run ended before the second was refused: the test proves nothing"
        assert second.returncode == 2, second.stderr
        assert second.stderr == (f"beamsearch: error: --output {out} is being written by another beamsearch "
                                 f"(process {first.pid}); wait for it to end, or write to another file\n")
        first.stdin.write("".join(line + "\n" for line in lines).encode("utf-8"))
        first.stdin.close()
        assert first.wait(timeout=600) == 0
    finally:
        first.kill()
    assert_every_input_once_in_order(out, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same.tsv", "words.txt"]  # (stdin has no resume record)


def test_a_lock_left_by_a_killed_run_does_not_block_resume(tmp_path):
    source, lines = word_list(tmp_path, 2000)  # enough that the run is killed well before its end
    out = tmp_path / "out.tsv"
    killed = start(decode_argv(source, out))
    wait_for(lambda: lines_in(tmp_path / "out.tsv.partial") > 10, killed, "the run wrote 10 records")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    lock = tmp_path / "out.tsv.lock"
    assert lock.read_text() == f"{killed.pid}\n"  # left behind, naming a process that is gone
    started = time.monotonic()
    resumed = run(decode_argv(source, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert time.monotonic() - started < 600
    assert_every_input_once_in_order(out, lines)
    assert not lock.exists()
