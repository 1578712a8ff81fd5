"""The ``beamsearch`` command line: ``decode`` files with a model, ``eval`` greedy against beam search, ``trace`` one
input's search tree.

beamsearch decode words.txt --num-beams 5 --num-return-sequences 3 --format tsv
beamsearch eval --beams 1 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from .flags import NOT_IN_FINGERPRINT, build_parser, validate
from .inputs import CLIError, check_readable, chunks, read_lines, scan_files
from .interrupts import Interrupted, as_interrupted, signals_stop_the_run, stopped_line
from .lengths import report_cut
from .output_claim import claim_output
from .outputs import Output, check_complete, fingerprint, format_record, progress


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    with signals_stop_the_run():  # SIGINT and SIGTERM raise Interrupted: reported below, exit status 130 / 143
        try:
            return run(args)
        except CLIError as e:
            print(f"beamsearch: error: {e}", file=sys.stderr)
            return e.status
        except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly, as Unix tools do
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not fail again
            return 0
        except KeyboardInterrupt as e:
            if args.debug:
                raise
            stop = as_interrupted(e)
            if not getattr(args, "stream", False):  # --stream ends quietly, as an interactive program does
                print(stopped_line(stop, argv), file=sys.stderr)
            return stop.status
        except Exception as e:  # not a user error we foresaw: one line, the traceback with --debug
            if args.debug:
                raise
            print(f"beamsearch: error: {type(e).__name__}: {e} (--debug shows the traceback)", file=sys.stderr)
            return 1


def run(args: argparse.Namespace) -> int:
    validate(args)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "decode":
        return run_decode(args)
    if args.command == "trace":
        from .trace import run_trace

        return run_trace(args)
    from .evaluate import run_eval

    return run_eval(args)


def run_decode(args: argparse.Namespace) -> int:
    if args.stream and not args.ray:  # one input at a time, printed as it becomes final
        from .trace import run_stream

        return run_stream(args)
    with claim_output(args.output, args.files):  # -o naming an input is refused; FILE.lock held to the end
        if args.ray:  # blocks on a Ray cluster, written to --output by this process
            return decode_on_ray(args)
        return decode_to_output(args)


def decode_to_output(args: argparse.Namespace) -> int:
    """``decode`` in this process: the inputs in chunks, each record written to stdout or ``--output`` as soon as
    the inputs before it are."""
    from .decoding import decode_lines, prepare_decode, report_long_inputs

    check_readable(args.files)
    if args.resume and (not args.files or "-" in args.files):
        raise CLIError("--resume needs input files: stdin cannot be checked against the interrupted run")
    out = Output(args.output, args.format, resume=args.resume, overwrite=args.overwrite)
    files = scan_files(args.files)  # None for stdin, which --output without --resume allows
    if out.complete_already:  # refused unless this command made it
        check_complete(out.path, fingerprint(args, files, NOT_IN_FINGERPRINT))
        print(f"beamsearch: {args.output} is complete (no {out.partial.name} is left): nothing to resume",
              file=sys.stderr)
        return 0
    total = None if files is None else sum(f.lines for f in files)
    try:
        m, options, limit = prepare_decode(args)
        if args.output is not None:
            out.start(None if files is None else fingerprint(args, files, NOT_IN_FINGERPRINT))
        bar = progress(total, args.quiet, initial=out.done)
        for chunk, error in chunks(read_lines(args.files), args.chunk_size):
            todo = [line for line in chunk if line.index > out.done]
            if todo:
                for line, hyps in decode_lines(
                    m, todo, options, args.batch_size, args.batch_type == "tokens", limit, args.on_long
                ):
                    out.write(format_record(args.format, line, hyps))
                    bar.update(1)
            if error is not None:
                raise error
        bar.close()
        report_long_inputs(m, limit, args.on_long)
        out.finish()
    except KeyboardInterrupt as e:
        out.abandon()
        stop = as_interrupted(e)
        stop.kept = out.kept(total)
        stop.resumable = files is not None and out.path is not None and out.partial.exists()
        if files is None and stop.kept and out.path is not None:
            stop.kept += " (read from stdin, which --resume cannot check: decode again with --overwrite)"
        raise stop from None
    except BaseException:
        out.abandon()
        raise
    if not args.quiet:
        report_cut(m.cut, m.model.generation_config, options)
    if len(m.warnings) > 20:
        print(f"beamsearch: {len(m.warnings)} warnings in all", file=sys.stderr)
    return 0


def decode_on_ray(args: argparse.Namespace) -> int:
    """``decode --ray`` (:func:`beamsearch.ray.decode_files`), stopped by SIGINT or SIGTERM as the single process is:
    what is kept is the finished blocks in ``FILE.blocks/``."""
    from ..ray import decode_files

    try:
        return decode_files(args)
    except (KeyboardInterrupt, SystemExit) as e:
        if isinstance(e, SystemExit):  # ray.init sets a SIGTERM handler of its own: sys.exit(SIGTERM)
            if e.code != signal.SIGTERM:
                raise
            e = Interrupted(signal.SIGTERM)
        stop = as_interrupted(e)
        stop.kept = finished_blocks(Path(args.output))
        stop.resumable = stop.kept is not None
        raise stop from None


def finished_blocks(output: Path) -> str | None:
    """What a stopped ``--ray`` run keeps: the finished blocks its manifest lists (None: none)."""
    from ..distributed.blocks import MANIFEST

    folder = output.with_name(output.name + ".blocks")
    try:
        listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["blocks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    lines = sum(int(entry["lines"]) for entry in listed.values())
    blocks = "1 finished block" if len(listed) == 1 else f"{len(listed)} finished blocks"
    return f"{blocks} ({lines} inputs) {'is' if len(listed) == 1 else 'are'} kept in {folder}/"


if __name__ == "__main__":
    sys.exit(main())
