"""``beamsearch trace WORD``: the search tree of one input as an HTML page and JSON; ``decode --stream``: each
input's best output printed as it becomes final."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .ensemble_file import is_ensemble_folder, read_ensemble_file
from .flags import DEFAULT_TRACE_BEAMS, generation_options
from .inputs import CLIError, Line, check_readable, read_lines
from .lengths import capped


def run_trace(args: argparse.Namespace) -> int:
    """Decode ``args.text`` with a beam search trace; write ``--html`` / ``--json``; print the best output."""
    import torch

    from ..adapters.hf import search_model
    from ..trace import TraceLimits
    from ..trace_html import write_html
    from .decoding import encode, input_limit, load_model, report_long_inputs

    if args.model is not None and is_ensemble_folder(Path(args.model)):  # refused before any member is loaded
        members = len(read_ensemble_file(Path(args.model)).members)
        raise CLIError(f"trace records one model's search: --model {args.model} is an ensemble of {members} (trace "
                       "one of its members)")
    m = load_model(args.model, args.device, args.lowercase, int8=args.int8)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    options = generation_options(args)
    options.setdefault("num_beams", DEFAULT_TRACE_BEAMS)
    if options["num_beams"] < 2:
        raise CLIError("trace draws a beam search: --num-beams must be at least 2")
    limit = input_limit(args, m)
    encoded = encode(m, Line(1, "argument", args.text), limit, args.on_long)
    if encoded is None:
        raise CLIError("trace: the input is empty")
    report_long_inputs(m, limit, args.on_long)
    options = capped(m.model.generation_config, options, len(encoded.ids))
    input_ids = torch.tensor([encoded.ids], device=m.model.device)
    try:
        result = search_model(m.model, input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                              trace=TraceLimits(max_steps=args.max_steps), **{**m.step, **options})
    except ValueError as e:
        raise CLIError(str(e)) from None
    trace = result.search_trace.label(token_text(m.tokenizer))
    if args.json:
        Path(args.json).write_text(trace.to_json(indent=1), encoding="utf-8")
    if args.html:
        write_html(trace, args.html, title=f"Search tree: {args.text} ({options['num_beams']} beams)")
    best = result.sequences[0, 0, result.prompt_length : int(result.lengths[0, 0])].tolist()
    print(m.tokenizer.decode(best, skip_special_tokens=True).strip())
    if not args.html and not args.json:
        print("beamsearch: no --html or --json given: only the best output was printed", file=sys.stderr)
    return 0


def token_text(tokenizer: Any) -> Any:
    """A node's label: its token as the tokenizer spells it (special tokens included, e.g. ``</s>``)."""

    def text(token_id: int) -> str:
        return str(tokenizer.convert_ids_to_tokens(int(token_id)))

    return text


def run_stream(args: argparse.Namespace) -> int:
    """``decode --stream``: the inputs one at a time, each best output printed as it is committed."""
    from .decoding import prepare_decode

    refused = [flag for flag, given in (("--output", args.output), ("--resume", args.resume),
                                        ("--ensemble", args.ensemble), ("--format " + args.format,
                                                                        args.format != "text")) if given]
    if refused:
        raise CLIError(f"--stream prints text to the terminal as it comes: it cannot be combined with {refused[0]}")
    check_readable(args.files)
    m, options, _ = prepare_decode(args)
    if "target_prefix" in options:  # one example per search
        options["target_prefix"] = [options["target_prefix"]]
    stream_lines(m, read_lines(args.files), options)
    return 0


def stream_lines(m: Any, lines: Any, options: dict[str, Any], out: Any = None) -> None:
    """``decode --stream``: decode one input at a time, printing its best output's text as it is committed (the
    prefix every hypothesis that can still win agrees on; :mod:`beamsearch.streaming`), one line per input."""
    import torch

    from ..adapters.hf import generate
    from .decoding import encode

    out = out or sys.stdout
    for line in lines:
        encoded = encode(m, line, None, "truncate")
        if encoded is not None:
            input_ids = torch.tensor([encoded.ids], device=m.model.device)
            printer = TextPrinter(m.tokenizer, out)
            try:
                generate(m.model, input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=printer,
                         **capped(m.model.generation_config, options, len(encoded.ids)))
            except ValueError as e:
                raise CLIError(str(e)) from None
        out.write("\n")
        out.flush()


class TextPrinter:
    """A streamer (``put`` / ``end``) that prints the new text of each committed chunk at once."""

    def __init__(self, tokenizer: Any, out: Any):
        self.tokenizer, self.out = tokenizer, out
        self.tokens: list[int] = []
        self.printed = ""
        self.prompt = True

    def put(self, value: Any) -> None:
        if self.prompt:  # the start tokens come first
            self.prompt = False
            return
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).strip()
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def end(self) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).strip()
        self.out.write(text[len(self.printed):] if text.startswith(self.printed) else "\n" + text)
        self.printed = text
