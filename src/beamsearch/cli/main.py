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

from .inputs import CLIError, check_readable, chunks, count_lines, read_lines
from .outputs import FORMATS, Output, format_record

# command-line flag -> (generate() keyword, type, help)
GENERATION_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--num-beams": ("num_beams", int, "beam width (1: greedy or sampling)"),
    "--num-return-sequences": ("num_return_sequences", int, "hypotheses returned per input"),
    "--length-penalty": ("length_penalty", float, "exponent of the length normalisation of beam scores"),
    "--max-new-tokens": ("max_new_tokens", int, "most tokens generated per input"),
    "--min-new-tokens": ("min_new_tokens", int, "fewest tokens generated before EOS is allowed"),
    "--do-sample": ("do_sample", None, "sample instead of taking the best tokens"),
    "--temperature": ("temperature", float, "sampling temperature"),
    "--top-k": ("top_k", int, "sample among the k most likely tokens"),
    "--top-p": ("top_p", float, "nucleus sampling mass"),
    "--min-p": ("min_p", float, "drop tokens below this fraction of the top token's probability"),
    "--typical-p": ("typical_p", float, "locally typical sampling mass"),
    "--repetition-penalty": ("repetition_penalty", float, "CTRL repetition penalty"),
    "--no-repeat-ngram-size": ("no_repeat_ngram_size", int, "forbid repeating n-grams of this size"),
    "--encoder-repetition-penalty": ("encoder_repetition_penalty", float,
                                     "favour (>1) or avoid (<1) the input's tokens (encoder-decoder models)"),
    "--encoder-no-repeat-ngram-size": ("encoder_no_repeat_ngram_size", int,
                                       "forbid copying n-grams of this size from the input"),
    "--stochastic-beam-search": ("stochastic_beam_search", None, "num-beams samples without replacement"),
    "--num-beam-groups": ("num_beam_groups", int, "diverse beam search: groups of beams (divides --num-beams)"),
    "--diversity-penalty": ("diversity_penalty", float, "diverse beam search: Hamming diversity penalty"),
    "--semantics": ("semantics", str, "whose beam search: hf (default), onmt, t2t, ct2"),
    "--length-penalty-type": ("length_penalty_type", str, "hf, wu (gnmt), avg or none (default: the preset's)"),
    "--coverage-penalty": ("coverage_penalty", str, "none, wu or summary (OpenNMT semantics)"),
    "--coverage-beta": ("coverage_beta", float, "weight of the coverage penalty"),
    "--patience": ("patience", float, "CTranslate2 patience factor"),
    "--max-len-a": ("max_len_a", float, "at most max_len_a * source length + max_len_b tokens (fairseq)"),
    "--max-len-b": ("max_len_b", int, "see --max-len-a"),
    "--block-ngram-repeat": ("block_ngram_repeat", int, "OpenNMT n-gram blocking"),
    "--max-rows": ("max_rows", int, "memory cap: most rows (inputs x beams) per model forward"),
    "--exact-parity": ("exact_parity", None, "compute on transformers' rows and shapes: its generate bit for bit "
                                             "(slower; not with --max-rows)"),
}


def early_stopping(value: str) -> bool | str:
    v = value.lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    if v == "never":
        return "never"
    raise argparse.ArgumentTypeError(f"expected true, false or never, not {value!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="beamsearch", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="local Hugging Face seq2seq or causal-LM directory (default: embedded G2P)")
        p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
        p.add_argument(
            "--lowercase",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="lowercase inputs (default: on for the embedded model, off otherwise)",
        )
        p.add_argument("--batch-size", type=int, default=64, help="inputs per batch (tokens with --batch-type tokens)")
        p.add_argument("--batch-type", choices=("sentences", "tokens"), default="sentences")
        p.add_argument("--max-input-length", type=int, help="most input tokens (default: the tokenizer's limit)")
        p.add_argument(
            "--on-long",
            choices=("truncate", "skip", "error"),
            default="truncate",
            help="what to do with longer inputs: truncate (warn), skip (empty result, warn), error",
        )
        p.add_argument("--seed", type=int, help="random seed for sampling")
        p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
        p.add_argument("--int8", action="store_true", help="quantize the model's linear layers to int8 (CPU only)")
        p.add_argument("--ensemble", action="append", default=[], metavar="DIR",
                       help="decode with this model directory too, distributions averaged (repeatable)")
        p.add_argument("--ensemble-mode", choices=("log", "prob"), default="log",
                       help="average log-probabilities (OpenNMT-py) or probabilities (fairseq)")

    def generation_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        for flag, (_, typ, help_) in GENERATION_FLAGS.items():
            if flag in skip:
                continue
            if typ is None:
                p.add_argument(flag, action="store_true", default=None, help=help_)
            else:
                p.add_argument(flag, type=typ, help=help_)
        p.add_argument("--early-stopping", type=early_stopping, help="true, false or never")

    dec = sub.add_parser("decode", help="decode one input per line (stdin when no file is given)")
    dec.add_argument("files", nargs="*", help="input files ('-' for stdin)")
    model_args(dec)
    generation_args(dec)
    dec.add_argument("--format", choices=FORMATS, default="text", help="text (best), tsv (n-best), jsonl (all)")
    dec.add_argument("--output", "-o", help="write here (incrementally) instead of stdout")
    dec.add_argument("--resume", action="store_true", help="continue an interrupted --output file")
    dec.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    dec.add_argument("--chunk-size", type=int, default=10000, help="lines read and sorted by length at a time")
    dec.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    dec.add_argument("--alignments", action="store_true",
                     help="jsonl: each token's attention over the source tokens (encoder-decoder models)")
    dec.add_argument("--unique", action="store_true",
                     help="beam search: no two hypotheses of an n-best with the same text (filled while searching)")
    dec.add_argument("--constraint", "--constraints", action="append", default=[], metavar="TEXT",
                     help="every output must contain this word or phrase; alternatives separated by '|' (repeatable)")
    dec.add_argument("--replace-unk", action="store_true",
                     help="replace unknown output tokens by the source token they attend to most (OpenNMT)")
    dec.add_argument("--prefix-bias-beta", type=float, metavar="BETA",
                     help="with --prefix: bias toward it instead of forcing it (CTranslate2's prefix_bias_beta)")
    dec.add_argument("--prefix", help="every output starts with these tokens (text, tokenized by the model's "
                     "tokenizer), e.g. --prefix 'HH'")

    ev = sub.add_parser("eval", help="WER and PER, greedy against beam search, on a TSV of inputs and references")
    ev.add_argument("--data", help="TSV: input<TAB>reference<TAB>... (default: the shipped CMUdict test split)")
    model_args(ev)
    ev.add_argument("--beams", type=int, nargs="+", default=[1, 5], help="beam widths to compare (1: greedy)")
    generation_args(ev, skip=("--num-beams",))
    ev.add_argument("--limit", type=int, help="only the first N examples")
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
        return 2
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not fail again
        return 0
    except KeyboardInterrupt:
        print("beamsearch: interrupted; what was written is kept (continue with --resume)", file=sys.stderr)
        return 130


def validate(args: argparse.Namespace) -> None:
    positive = ("batch_size", "chunk_size", "threads", "max_rows", "max_input_length", "num_beams",
                "num_return_sequences")
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1, not {value}")


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generation options given on the command line; the model's generation_config supplies the rest."""
    out = {kw: getattr(args, flag[2:].replace("-", "_"), None) for flag, (kw, _, _) in GENERATION_FLAGS.items()}
    out["early_stopping"] = args.early_stopping
    return {k: v for k, v in out.items() if v is not None}


def input_limit(args: argparse.Namespace, tokenizer: Any) -> int | None:
    if args.max_input_length is not None:
        return args.max_input_length
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 1_000_000 else None


def run_decode(args: argparse.Namespace) -> int:
    from .decoding import decode_lines, load_model

    check_readable(args.files)
    out = Output(args.output, args.format, resume=args.resume, overwrite=args.overwrite)
    try:
        eager = args.coverage_penalty not in (None, "none") or args.alignments or args.replace_unk
        m = load_model(args.model, args.device, args.lowercase, eager_attention=eager, int8=args.int8)
        add_ensemble(m, args)
        if args.seed is not None:
            import torch

            torch.manual_seed(args.seed)
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
        limit = input_limit(args, m.tokenizer)
        bar = progress(count_lines(args.files), args.quiet, initial=out.done)
        for chunk, error in chunks(read_lines(args.files), args.chunk_size):
            todo = [line for line in chunk if line.index > out.done]
            if todo:
                for line, hyps in decode_lines(
                    m, todo, options, args.batch_size, args.batch_type == "tokens", limit, args.on_long
                ):
                    out.write(format_record(args.format, line, hyps))
                    bar.update(1)
                out.sync()
            if error is not None:
                raise error
        bar.close()
        if len(m.warnings) > 20:
            print(f"beamsearch: {len(m.warnings)} warnings in all", file=sys.stderr)
    finally:
        out.close()
    return 0


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
