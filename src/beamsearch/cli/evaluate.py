"""``beamsearch eval``: WER and PER of greedy and beam search on inputs with references, as a table."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..evaluation import Entry, read_references, score
from .decoding import add_ensemble, decode_lines, input_limit, load_model, report_long_inputs
from .flags import generation_options
from .inputs import CLIError, Line
from .output_claim import check_not_an_input
from .outputs import progress

CMUDICT_TEST = Path(__file__).resolve().parent.parent / "data" / "cmudict" / "test.tsv"


def run_eval(args: argparse.Namespace) -> int:
    if args.beams is None:
        args.beams = list(range(1, 11)) if args.search_errors else [1, 5]
    if args.plot and not args.search_errors:
        raise CLIError("--plot needs --search-errors")
    bad = [beams for beams in args.beams if beams < 1]
    if bad:
        raise CLIError(f"--beams: {bad[0]} is not a beam width")
    path = Path(args.data) if args.data else CMUDICT_TEST
    if not path.is_file():
        raise CLIError(f"--data {path}: no such file")
    if args.plot:  # eval's one output file
        check_not_an_input("--plot", args.plot, [Path(args.plot)], [str(path)])
    entries = read_data(path)
    entries = entries[: args.limit] if args.limit else entries
    if not entries:
        raise CLIError(f"--data {path}: no examples")
    options = generation_options(args)
    eager = options.get("coverage_penalty", "none") != "none"
    m = load_model(args.model, args.device, args.lowercase, eager_attention=eager, int8=args.int8)
    add_ensemble(m, args, eager)
    m.unfinished_last = args.unfinished == "last"
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    lines = [Line(i, f"{path.name}:{i}", source) for i, (source, _) in enumerate(entries, 1)]
    refs = [r for _, r in entries]
    limit = input_limit(args, m)
    if args.search_errors:
        from .search_errors import plot, print_table, report

        rows = report(m, lines, refs, options, args, limit)
        report_long_inputs(m, limit, args.on_long)
        print_table(rows, len(lines), path)
        if args.plot:
            print(plot(rows, args.plot))
        return 0
    bar = progress(len(lines) * len(args.beams), args.quiet)
    rows = []
    for beams in args.beams:
        t0 = time.perf_counter()
        decoded = decode_lines(
            m, lines, {**options, "num_beams": beams}, args.batch_size, args.batch_type == "tokens", limit,
            args.on_long,
        )
        hyps = []
        for _, h in decoded:
            hyps.append(h[0]["text"].split() if h else [])
            bar.update(1)
        seconds = time.perf_counter() - t0
        s = score(hyps, refs)
        name = "greedy" if beams == 1 else f"beam {beams}"
        rows.append((name, s.wer, s.wer_stress, s.per, len(lines) / seconds))
    bar.close()
    report_long_inputs(m, limit, args.on_long)
    print(f"{len(lines)} examples from {path}\n")
    print("| decoding | WER % (stress removed) | WER % | PER % | inputs/s |")
    print("|---|---:|---:|---:|---:|")
    for name, wer, wer_stress, per, speed in rows:
        print(f"| {name} | {wer:.2f} | {wer_stress:.2f} | {per:.2f} | {speed:.0f} |")
    print("\nWER: inputs whose output matches no reference; PER: token edit distance to the closest reference")
    print("over its length. 'Stress removed' drops the digits 0-2 ending ARPAbet phones before comparing.")
    return 0


def read_data(path: Path) -> list[Entry]:
    """``--data``'s inputs and references (:func:`~beamsearch.evaluation.read_references`, which drops a leading
    UTF-8 byte-order mark)."""
    try:
        return read_references(path)
    except UnicodeDecodeError as e:
        raise CLIError(f"--data {path}: invalid UTF-8 ({e.reason})") from None
    except ValueError as e:
        raise CLIError(str(e)) from None
