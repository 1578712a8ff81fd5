"""The ``beamsearch`` command line: ``decode`` files with a model, ``eval`` greedy against beam search, ``trace`` one
input's search tree.

beamsearch decode words.txt --num-beams 5 --num-return-sequences 3 --format tsv
beamsearch eval --beams 1 5
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .flags import NOT_IN_FINGERPRINT, build_parser, validate
from .inputs import CLIError, check_readable, chunks, read_lines, scan_files
from .lengths import report_cut
from .outputs import Output, check_complete, fingerprint, format_record, progress


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
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
    except CLIError as e:
        print(f"beamsearch: error: {e}", file=sys.stderr)
        return e.status
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not fail again
        return 0
    except KeyboardInterrupt:
        print("beamsearch: interrupted; what was written is kept (continue with --resume)", file=sys.stderr)
        return 130
    except Exception as e:  # not a user error we foresaw: one line, the traceback with --debug
        if args.debug:
            raise
        print(f"beamsearch: error: {type(e).__name__}: {e} (--debug shows the traceback)", file=sys.stderr)
        return 1


def run_decode(args: argparse.Namespace) -> int:
    from .decoding import decode_lines, prepare_decode, report_long_inputs

    if args.ray:  # blocks on a Ray cluster, written to --output by this process
        from ..ray import decode_files

        return decode_files(args)
    if args.stream:  # one input at a time, printed as it becomes final
        from .trace import run_stream

        return run_stream(args)
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
    m, options, limit = prepare_decode(args)
    if args.output is not None:
        out.start(None if files is None else fingerprint(args, files, NOT_IN_FINGERPRINT))
    try:
        bar = progress(None if files is None else sum(f.lines for f in files), args.quiet, initial=out.done)
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
    except BaseException:
        out.abandon()
        raise
    if not args.quiet:
        report_cut(m.cut, m.model.generation_config, options)
    if len(m.warnings) > 20:
        print(f"beamsearch: {len(m.warnings)} warnings in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
