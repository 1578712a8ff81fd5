"""Fault injection on ``beamsearch decode --output``: the process killed (SIGKILL) at random points and the disk
filling up; ``--resume`` then completes the output with every input exactly once, in order."""

from __future__ import annotations

import itertools
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from beamsearch.cli.evaluate import CMUDICT_TEST  # noqa: E402
from beamsearch.evaluation import read_references  # noqa: E402


def inputs(tmp_path: Path, count: int) -> tuple[Path, list[str]]:
    words = [word for word, _ in read_references(CMUDICT_TEST)]
    lines = list(itertools.islice(itertools.cycle(words), count))
    path = tmp_path / "in.txt"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path, lines


def command(source: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "beamsearch", "decode", str(source), "--format", "tsv", "--output", str(output),
            "--threads", "1", "-q", *extra]


def assert_every_input_once_in_order(output: Path, lines: list[str]) -> None:
    rows = [row.split("\t") for row in output.read_text(encoding="utf-8").splitlines()]
    assert [int(row[0]) for row in rows] == list(range(1, len(lines) + 1))
    assert [row[1] for row in rows] == lines
    assert all(row[2] == "1" and row[4] for row in rows)


def test_killed_at_random_points_then_resumed(tmp_path):
    """A 10,000-line decode killed with SIGKILL at 5 random points while it writes, resumed after each."""
    source, lines = inputs(tmp_path, 10_000)
    output = tmp_path / "out.tsv"
    partial = tmp_path / "out.tsv.partial"
    rng = random.Random(1)
    kills, size = 0, 0
    while kills < 5:
        resume = ["--resume"] if partial.exists() else []
        proc = subprocess.Popen(command(source, output, *resume), stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while (not partial.exists() or partial.stat().st_size <= size) and proc.poll() is None:
            assert time.monotonic() < deadline, "the decode wrote nothing for 2 minutes"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # somewhere in the middle of decoding and writing
        if proc.poll() is not None:
            break  # finished before the kill: the output is complete
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        size = partial.stat().st_size
        assert not output.exists()
    assert kills == 5, "the decode finished before 5 kills"
    done = subprocess.run(command(source, output, "--resume"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert not partial.exists() and (tmp_path / "out.tsv.resume.json").exists()  # the complete output's
    assert_every_input_once_in_order(output, lines)


def test_disk_full_is_a_clear_error_and_the_output_resumes(tmp_path):
    """The output may grow to 6,000 bytes only (RLIMIT_FSIZE in the child: writes past it fail with EFBIG, as on a
    full disk): one-line error, exit 1, the partial file kept; resumed without the limit, it completes."""
    source, lines = inputs(tmp_path, 400)
    output = tmp_path / "out.tsv"

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))

    full = subprocess.run(command(source, output), capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert full.returncode == 1, full.stderr
    assert "Traceback" not in full.stderr and len(full.stderr.splitlines()) == 1, full.stderr
    assert "cannot write" in full.stderr and "File too large" in full.stderr and "--resume" in full.stderr
    partial = tmp_path / "out.tsv.partial"
    assert not output.exists() and 0 < partial.stat().st_size <= 6000
    done = subprocess.run(command(source, output, "--resume"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_every_input_once_in_order(output, lines)
    assert os.path.getsize(output) > 6000
