"""The ``beamsearch`` command line: ``decode`` files with a model, ``eval`` greedy against beam search.

beamsearch decode words.txt --num-beams 5 --num-return-sequences 3 --format tsv
beamsearch eval --beams 1 5
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from .flags import NOT_IN_FINGERPRINT, build_parser, generation_options, validate
from .inputs import CLIError, check_readable, chunks, read_lines, scan_files
from .outputs import Output, fingerprint, format_record, progress


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate(args)
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        if args.command == "decode":
            return run_decode(args)
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
    from .decoding import add_ensemble, decode_lines, input_limit, load_model, report_long_inputs

    check_readable(args.files)
    if args.resume and (not args.files or "-" in args.files):
        raise CLIError("--resume needs input files: stdin cannot be checked against the interrupted run")
    out = Output(args.output, args.format, resume=args.resume, overwrite=args.overwrite)
    if out.complete_already:
        print(f"beamsearch: {args.output} is complete (no {out.partial.name} is left): nothing to resume",
              file=sys.stderr)
        return 0
    eager = args.coverage_penalty not in (None, "none") or args.alignments or args.replace_unk
    m = load_model(args.model, args.device, args.lowercase, eager_attention=eager, int8=args.int8)
    add_ensemble(m, args)
    m.unfinished_last = args.unfinished == "last"
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    options = decode_options(args, m)
    limit = input_limit(args, m)
    files = scan_files(args.files)  # None for stdin, which --output without --resume allows
    if args.output is not None:
        out.start(fingerprint(args, files or [], NOT_IN_FINGERPRINT))
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
    if len(m.warnings) > 20:
        print(f"beamsearch: {len(m.warnings)} warnings in all", file=sys.stderr)
    return 0


def decode_options(args: argparse.Namespace, m: Any) -> dict[str, Any]:
    """The search options of ``decode``: the generation flags and the output-shaping ones."""
    options = generation_options(args)
    if args.alignments:
        if args.format != "jsonl":
            raise CLIError("--alignments needs --format jsonl (each hypothesis gets an 'alignment' field)")
        options["output_alignments"] = True
    if args.replace_unk:
        if m.tokenizer.unk_token is None:
            raise CLIError("--replace-unk: the model's tokenizer has no unknown token")
        options["output_alignments"] = True
    m.replace_unk, m.keep_alignments = args.replace_unk, args.alignments
    if args.unique:
        options["unique"] = text_key(m.tokenizer)
    if args.constraint:
        options["force_words_ids"] = [constraint_ids(m.tokenizer, text) for text in args.constraint]
    if args.prefix is not None:
        prefix = m.tokenizer(args.prefix, add_special_tokens=False)["input_ids"]
        if not prefix:
            raise CLIError(f"--prefix {args.prefix!r}: no tokens")
        options["target_prefix"] = prefix  # decode_batch gives it to every input
        if args.prefix_bias_beta is not None:
            options["prefix_bias_beta"] = args.prefix_bias_beta
    elif args.prefix_bias_beta is not None:
        raise CLIError("--prefix-bias-beta needs --prefix")
    return options


def text_key(tokenizer: Any) -> Any:
    """``--unique``: a hypothesis' key is its text."""

    def key(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True).strip()

    return key


def constraint_ids(tokenizer: Any, text: str) -> list[list[int]]:
    """``--constraint 'AH0|UW1 T'``: its alternative phrases as token ids."""
    phrases = []
    for alternative in text.split("|"):
        ids = tokenizer(alternative.strip(), add_special_tokens=False)["input_ids"]
        if not ids:
            raise CLIError(f"--constraint {text!r}: {alternative!r} has no tokens")
        phrases.append(ids)
    return phrases


if __name__ == "__main__":
    sys.exit(main())
