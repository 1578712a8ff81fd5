"""The ``beamsearch`` command line: ``decode`` files with a model, ``eval`` greedy against beam search.

beamsearch decode words.txt --num-beams 5 --num-return-sequences 3 --format tsv
beamsearch eval --beams 1 5
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from .inputs import CLIError, check_readable, chunks, count_lines, read_lines
from .outputs import FORMATS, Output, fingerprint, format_record

# help groups, in the order --help shows them
SEARCH, LENGTH, PENALTIES = "search", "length", "penalties"

# command-line flag -> (generate() keyword, type, help group, help); not given: the model's generation_config
GENERATION_FLAGS: dict[str, tuple[str, Any, str, str]] = {
    "--num-beams": ("num_beams", int, SEARCH, "beam width (1: greedy or sampling)"),
    "--num-return-sequences": ("num_return_sequences", int, SEARCH, "hypotheses returned per input"),
    "--do-sample": ("do_sample", None, SEARCH, "sample instead of taking the best tokens"),
    "--temperature": ("temperature", float, SEARCH, "sampling temperature"),
    "--top-k": ("top_k", int, SEARCH, "sample among the k most likely tokens"),
    "--top-p": ("top_p", float, SEARCH, "nucleus sampling mass"),
    "--min-p": ("min_p", float, SEARCH, "drop tokens below this fraction of the top token's probability"),
    "--typical-p": ("typical_p", float, SEARCH, "locally typical sampling mass"),
    "--stochastic-beam-search": ("stochastic_beam_search", None, SEARCH, "num-beams samples without replacement"),
    "--num-beam-groups": ("num_beam_groups", int, SEARCH, "diverse beam search: groups of beams (divides --num-beams)"),
    "--diversity-penalty": ("diversity_penalty", float, SEARCH, "diverse beam search: Hamming diversity penalty"),
    "--semantics": ("semantics", str, SEARCH, "whose beam search: hf, onmt, t2t, ct2 (default: hf)"),
    "--patience": ("patience", float, SEARCH, "CTranslate2 patience factor"),
    "--exact-parity": ("exact_parity", None, SEARCH, "compute on transformers' rows and shapes: its generate bit "
                                                     "for bit on this machine (slower; not with --max-rows)"),
    "--length-penalty": ("length_penalty", float, LENGTH, "exponent of the length normalisation of beam scores"),
    "--length-penalty-type": ("length_penalty_type", str, LENGTH,
                              "hf, wu (gnmt), avg or none (default: the semantics' own)"),
    "--max-new-tokens": ("max_new_tokens", int, LENGTH, "most tokens generated per input"),
    "--min-new-tokens": ("min_new_tokens", int, LENGTH, "fewest tokens generated before EOS is allowed"),
    "--max-len-a": ("max_len_a", float, LENGTH, "at most max_len_a * source length + max_len_b tokens (fairseq)"),
    "--max-len-b": ("max_len_b", int, LENGTH, "see --max-len-a"),
    "--repetition-penalty": ("repetition_penalty", float, PENALTIES, "CTRL repetition penalty"),
    "--no-repeat-ngram-size": ("no_repeat_ngram_size", int, PENALTIES, "forbid repeating n-grams of this size"),
    "--encoder-repetition-penalty": ("encoder_repetition_penalty", float, PENALTIES,
                                     "favour (>1) or avoid (<1) the input's tokens (encoder-decoder models)"),
    "--encoder-no-repeat-ngram-size": ("encoder_no_repeat_ngram_size", int, PENALTIES,
                                       "forbid copying n-grams of this size from the input"),
    "--block-ngram-repeat": ("block_ngram_repeat", int, PENALTIES, "OpenNMT n-gram blocking"),
    "--coverage-penalty": ("coverage_penalty", str, PENALTIES, "none, wu or summary (OpenNMT semantics)"),
    "--coverage-beta": ("coverage_beta", float, PENALTIES, "weight of the coverage penalty"),
    "--max-rows": ("max_rows", int, "performance", "memory cap: most rows (inputs x beams) per model forward"),
}

# parsed arguments that cannot change an output (left out of --resume's fingerprint)
NOT_IN_FINGERPRINT = ("files", "output", "resume", "overwrite", "quiet", "batch_size", "batch_type", "chunk_size",
                      "threads", "device", "debug", "max_rows")


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default where it has one (flags without one take the model's generation_config)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with usage errors as one line (the usage itself is in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def early_stopping(value: str) -> bool | str:
    v = value.lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    if v == "never":
        return "never"
    raise argparse.ArgumentTypeError(f"expected true, false or never, not {value!r}")


def finite_float(value: str) -> float:
    """A float flag's value: a finite number (``nan`` and ``inf`` are refused)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expected a finite number, not {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    ap = ArgumentParser(prog="beamsearch", description="Decode text files with a sequence model (beam "
                                 "search, greedy, sampling), or compare greedy and beam search on references.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--version", action="version", version=f"beamsearch {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    def groups(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
        names = ("input/output", SEARCH, LENGTH, PENALTIES, "model", "performance")
        return {name: p.add_argument_group(name) for name in names}

    def model_args(g: dict[str, argparse._ArgumentGroup]) -> None:
        model, io, perf = g["model"], g["input/output"], g["performance"]
        model.add_argument("--model", help="local Hugging Face seq2seq or causal-LM directory (default: the "
                           "embedded G2P model)")
        model.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
        model.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                           help="lowercase inputs (default: on for the embedded model, off otherwise)")
        model.add_argument("--int8", action="store_true", help="quantize the model's linear layers to int8 (CPU)")
        model.add_argument("--ensemble", action="append", default=[], metavar="DIR",
                           help="decode with this model directory too, distributions averaged (repeatable)")
        model.add_argument("--ensemble-mode", choices=("log", "prob"), default="log",
                           help="average log-probabilities (OpenNMT-py) or probabilities (fairseq)")
        perf.add_argument("--batch-size", type=int, default=64, help="inputs per batch (tokens with --batch-type "
                          "tokens)")
        perf.add_argument("--batch-type", choices=("sentences", "tokens"), default="sentences")
        perf.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
        io.add_argument("--max-input-length", type=int, help="most input tokens, at most the model's limit "
                        "(default: the model's limit)")
        io.add_argument("--on-long", choices=("truncate", "skip", "error"), default="truncate",
                        help="inputs over --max-input-length: truncate or skip (one warning counts them), or error")
        g[SEARCH].add_argument("--seed", type=int, help="random seed for sampling")
        io.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")

    def generation_args(g: dict[str, argparse._ArgumentGroup], skip: tuple[str, ...] = ()) -> None:
        for flag, (_, typ, group, help_) in GENERATION_FLAGS.items():
            if flag in skip:
                continue
            if typ is None:
                g[group].add_argument(flag, action="store_true", default=None, help=help_)
            else:
                g[group].add_argument(flag, type=finite_float if typ is float else typ, help=help_)
        g[SEARCH].add_argument("--early-stopping", type=early_stopping, help="true, false or never")

    dec = sub.add_parser("decode", help="decode one input per line (stdin when no file is given)",
                         formatter_class=HelpFormatter, description="Decode one input per line; each line gives "
                         "one record, in input order. Generation flags not given come from the model's "
                         "generation_config.json.")
    g = groups(dec)
    io = g["input/output"]
    io.add_argument("files", nargs="*", help="input files ('-' for stdin)")
    model_args(g)
    generation_args(g)
    io.add_argument("--format", choices=FORMATS, default="text", help="text (best), tsv (n-best), jsonl (all)")
    io.add_argument("--output", "-o", help="write here (as FILE.partial, renamed when complete) instead of stdout")
    io.add_argument("--resume", action="store_true", help="continue the interrupted run's FILE.partial (same "
                    "inputs and options)")
    io.add_argument("--overwrite", action="store_true", help="replace an existing --output file once the new one "
                    "is complete")
    g["performance"].add_argument("--chunk-size", type=int, default=10000, help="lines read and sorted by length "
                                  "at a time")
    io.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    io.add_argument("--alignments", action="store_true",
                    help="jsonl: each token's attention over the source tokens (encoder-decoder models)")
    g[SEARCH].add_argument("--unique", action="store_true",
                           help="beam search: no two hypotheses of an n-best with the same text")
    g[SEARCH].add_argument("--constraint", "--constraints", action="append", default=[], metavar="TEXT",
                           help="every output must contain this word or phrase; alternatives separated by '|' "
                           "(repeatable)")
    io.add_argument("--replace-unk", action="store_true",
                    help="replace unknown output tokens by the source token they attend to most (OpenNMT)")
    g[SEARCH].add_argument("--prefix-bias-beta", type=finite_float, metavar="BETA",
                           help="with --prefix: bias toward it instead of forcing it (CTranslate2's "
                           "prefix_bias_beta)")
    g[SEARCH].add_argument("--prefix", help="every output starts with these tokens (text, tokenized by the model's "
                           "tokenizer), e.g. --prefix 'HH'")

    ev = sub.add_parser("eval", help="WER and PER, greedy against beam search, on a TSV of inputs and references",
                        formatter_class=HelpFormatter)
    g = groups(ev)
    g["input/output"].add_argument("--data", help="TSV: input<TAB>reference<TAB>... (default: the shipped CMUdict "
                                   "test split)")
    model_args(g)
    g[SEARCH].add_argument("--beams", type=int, nargs="+", default=[1, 5], help="beam widths to compare "
                           "(1: greedy)")
    generation_args(g, skip=("--num-beams",))
    g["input/output"].add_argument("--limit", type=int, help="only the first N examples")
    g["input/output"].add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return ap


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


def validate(args: argparse.Namespace) -> None:
    positive = ("batch_size", "chunk_size", "threads", "max_rows", "max_input_length", "num_beams",
                "num_return_sequences", "limit")
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1, not {value}")


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generation options given on the command line; the model's generation_config supplies the rest."""
    out = {kw: getattr(args, flag[2:].replace("-", "_"), None) for flag, (kw, *_) in GENERATION_FLAGS.items()}
    out["early_stopping"] = args.early_stopping
    return {k: v for k, v in out.items() if v is not None}


def input_limit(args: argparse.Namespace, m: Any) -> int | None:
    """The most input tokens: ``--max-input-length``, which may not exceed the model's own limit (the tokenizer's
    ``model_max_length`` or the model's position table), so that a long line cannot take unbounded memory."""
    limits = [getattr(m.tokenizer, "model_max_length", None)]
    config = m.model.config
    if not config.is_encoder_decoder:  # a decoder's positions hold the prompt and what is generated
        limits += [getattr(config, name, None) for name in ("max_position_embeddings", "n_positions")]
    known = [x for x in limits if isinstance(x, int) and 0 < x < 1_000_000]
    model_limit = min(known) if known else None
    if args.max_input_length is None:
        return model_limit
    if model_limit is not None and args.max_input_length > model_limit:
        raise CLIError(f"--max-input-length {args.max_input_length} is over the model's limit of {model_limit} "
                       "tokens")
    return args.max_input_length


def run_decode(args: argparse.Namespace) -> int:
    from .decoding import decode_lines, load_model

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
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    options = decode_options(args, m)
    limit = input_limit(args, m)
    if args.output is not None:
        out.start(fingerprint(args, args.files, NOT_IN_FINGERPRINT))
    try:
        bar = progress(count_lines(args.files), args.quiet, initial=out.done)
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


def report_long_inputs(m: Any, limit: int | None, on_long: str) -> None:
    """One warning counting the inputs over the length limit (truncated or skipped)."""
    sources = list(dict.fromkeys(m.long_inputs))  # eval decodes each input once per beam width
    if sources:
        what = "truncated" if on_long == "truncate" else "left empty"
        print(f"beamsearch: warning: {len(sources)} input(s) over {limit} tokens {what} (first: {sources[0]}); "
              "--on-long error refuses them instead", file=sys.stderr)


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


def add_ensemble(m: Any, args: argparse.Namespace) -> None:
    """Load the --ensemble directories next to the main model; they must share its tokenizer."""
    from .decoding import load_model

    for folder in args.ensemble:
        other = load_model(folder, args.device, args.lowercase, int8=args.int8)
        if other.tokenizer.get_vocab() != m.tokenizer.get_vocab():
            raise CLIError(f"--ensemble {folder}: its tokenizer differs from the main model's (an ensemble needs "
                           "one vocabulary)")
        m.ensemble.append(other.model)
    m.ensemble_mode = args.ensemble_mode


def progress(total: int | None, quiet: bool, initial: int = 0) -> Any:
    """A tqdm bar on stderr, off with --quiet or when stderr is not a terminal."""
    from tqdm.auto import tqdm

    disable = quiet or not sys.stderr.isatty()
    return tqdm(total=total, initial=initial, disable=disable, file=sys.stderr, unit="line", dynamic_ncols=True)


if __name__ == "__main__":
    sys.exit(main())
