"""SIGINT and SIGTERM, sent to real ``beamsearch`` processes (src/beamsearch/cli/interrupts.py): a run stops with one
line on stderr (no traceback) that says how many inputs were written, where, and the command that resumes, exit status
130 / 143; the command it gives completes the output with every input exactly once. ``decode --stream`` ends quietly
on Ctrl-C and Ctrl-D, typed in a terminal."""

from __future__ import annotations

import os
import re
import shlex
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from cli_processes import (  # noqa: E402
    Terminal,
    assert_every_input_once_in_order,
    command_line,
    decode_argv,
    lines_in,
    run,
    start,
    wait_for,
    word_list,
)

from beamsearch.cli.interrupts import (  # noqa: E402
    Interrupted,
    resume_command,
    signals_held,
    signals_stop_the_run,
)

STOPPED = re.compile(r"beamsearch: stopped by (SIG[A-Z]+): (\d+) of (\d+) inputs are written in (.+); "
                     r"continue with: (.+)")


def stop_while_writing(tmp_path: Path, signum: int, *flags: str) -> tuple[int, str, Path, list[str], list[str]]:
    """Start a decode into ``out.tsv``, send ``signum`` once it has written 20 records; (exit status, stderr, the
    partial file, the inputs, the run's arguments)."""
    source, lines = word_list(tmp_path, 800)
    argv = decode_argv(source, tmp_path / "out.tsv", *flags)
    partial = tmp_path / "out.tsv.partial"
    process = start(argv, stderr=-1, text=True)  # -1: subprocess.PIPE
    try:
        wait_for(lambda: lines_in(partial) >= 20, process, "20 records were written")
        process.send_signal(signum)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, err, partial, lines, argv


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_with_one_line_that_says_how_to_resume(tmp_path, signum, status):
    code, err, partial, lines, argv = stop_while_writing(tmp_path, signum)
    assert code == status, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    stopped = STOPPED.fullmatch(err.strip())
    assert stopped, err
    name, written, total, where, command = stopped.groups()
    assert name == signal.Signals(signum).name and total == str(len(lines)) and where == str(partial)
    data = partial.read_bytes()
    assert data.endswith(b"\n") and int(written) == data.count(b"\n")  # whole records only, each of them counted
    assert 20 <= int(written) < len(lines)
    assert command == shlex.join(["beamsearch", *argv, "--resume"])
    resumed = run(command_line(command))
    assert resumed.returncode == 0, resumed.stderr
    assert_every_input_once_in_order(tmp_path / "out.tsv", lines)
    assert not partial.exists() and not (tmp_path / "out.tsv.lock").exists()


def test_the_resume_command_of_an_overwrite_run_drops_overwrite(tmp_path):
    (tmp_path / "out.tsv").write_text("an older output\n")
    code, err, partial, lines, argv = stop_while_writing(tmp_path, signal.SIGINT, "--overwrite")
    assert code == 130, err
    command = STOPPED.fullmatch(err.strip()).group(5)
    assert command == shlex.join(["beamsearch", *argv[:-1], "--resume"])  # argv[-1] is --overwrite
    assert (tmp_path / "out.tsv").read_text() == "an older output\n"  # kept until a run completes
    assert run(command_line(command)).returncode == 0
    assert_every_input_once_in_order(tmp_path / "out.tsv", lines)


def test_resume_command():
    assert resume_command(["decode", "my words.txt", "-o", "out.tsv"]) == \
        "beamsearch decode 'my words.txt' -o out.tsv --resume"
    assert resume_command(["decode", "in.txt", "--overwrite", "-o", "o"]) == "beamsearch decode in.txt -o o --resume"
    assert resume_command(["decode", "in.txt", "--overw", "-o", "o"]) == "beamsearch decode in.txt -o o --resume"
    assert resume_command(["decode", "in.txt", "-o", "o", "--resume"]) == "beamsearch decode in.txt -o o --resume"
    assert resume_command(["decode", "-o", "o", "--", "--overwrite"]) == \
        "beamsearch decode -o o --resume -- --overwrite"  # after --, a file named --overwrite


def test_a_signal_while_a_record_is_written_stops_the_run_right_after_it():
    """In this process: a signal inside ``signals_held`` (a record being written) is raised when the block ends, one
    outside at once; SIGINT and SIGTERM alike; the handlers before are put back."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    written = []
    with signals_stop_the_run():
        with pytest.raises(Interrupted) as stopped:
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # Python runs a handler at the next instruction: it must wait for the block's end
                written.append("record")
        assert written == ["record"]
        assert (stopped.value.signum, stopped.value.status) == (signal.SIGTERM, 143)
        for _ in range(2):  # every signal stops the run, the second as the first
            with pytest.raises(Interrupted) as stopped:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
            assert (stopped.value.signum, stopped.value.status) == (signal.SIGINT, 130)
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_a_signal_while_the_model_loads_leaves_nothing(tmp_path):
    source, _ = word_list(tmp_path, 50)
    process = start(decode_argv(source, tmp_path / "out.tsv"), stderr=-1, text=True)
    try:  # FILE.lock is taken (the handlers are set) before the model is loaded
        wait_for(lambda: (tmp_path / "out.tsv.lock").exists(), process, "the output was claimed")
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert err == "beamsearch: stopped by SIGINT: nothing was written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["words.txt"]


def test_a_signal_while_writing_to_stdout_counts_the_lines_written(tmp_path):
    source, lines = word_list(tmp_path, 800)
    process = start(["decode", str(source), "--format", "tsv", "--threads", "1", "-q"], stdout=-1, stderr=-1)
    try:
        out = b""
        while out.count(b"\n") < 20:
            chunk = process.stdout.read1(4096)
            assert chunk, "stdout closed before 20 lines"
            out += chunk
        process.send_signal(signal.SIGTERM)
        rest, err = process.communicate(timeout=120)
    finally:
        process.kill()
    out += rest
    assert process.returncode == 143, err
    assert out.endswith(b"\n")
    written = len(out.splitlines())
    assert err.decode() == f"beamsearch: stopped by SIGTERM: {written} of {len(lines)} inputs were written to stdout\n"


def test_stream_ends_quietly_on_ctrl_c():
    terminal = Terminal(["decode", "--stream", "--threads", "1"])
    terminal.type(b"hello\n")
    screen = terminal.read_until(lambda screen: b"HH EH1 L OW0\r\n" in screen)
    assert b"HH EH1 L OW0\r\n" in screen, screen
    terminal.type(b"\x03")  # Ctrl-C: the terminal sends SIGINT
    assert terminal.finish() == 130
    after = terminal.screen[len(screen):]
    assert b"Traceback" not in after and b"beamsearch" not in after, after  # the terminal's own ^C at most


def test_stream_ends_quietly_on_ctrl_d():
    terminal = Terminal(["decode", "--stream", "--threads", "1"])
    terminal.type(b"cat\n")
    screen = terminal.read_until(lambda screen: b"K AE1 T\r\n" in screen)
    assert b"K AE1 T\r\n" in screen, screen
    terminal.type(b"\x04")  # Ctrl-D at the start of a line: the end of the input
    assert terminal.finish() == 0
    assert terminal.screen[len(screen):].strip() in (b"", b"^D"), terminal.screen


def test_stream_ends_quietly_on_sigterm():
    terminal = Terminal(["decode", "--stream", "--threads", "1"])
    terminal.type(b"dog\n")
    screen = terminal.read_until(lambda screen: b"D AO1 G\r\n" in screen)
    assert b"D AO1 G\r\n" in screen, screen
    terminal.process.send_signal(signal.SIGTERM)
    assert terminal.finish() == 143
    assert terminal.screen[len(screen):] == b"", terminal.screen
