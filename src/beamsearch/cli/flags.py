"""The command line's flags: the parser (grouped help with defaults), value types and checks, and the
generation flags mapped to :func:`beamsearch.generate` options."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any, NoReturn

from .inputs import CLIError
from .outputs import FORMATS

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
    "--exact-search": ("exact_search", None, SEARCH, "the best output under the beam score, by branch and bound "
                                                     "(after a --num-beams search that gives it a threshold)"),
    "--max-nodes": ("max_nodes", int, SEARCH, "exact search: partial outputs expanded per input before it gives up"),
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
    "--loop-guard": ("loop_guard", int, PENALTIES, "forbid this many back-to-back copies of any 1-4-gram (>= 2)"),
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
                      "threads", "device", "debug", "max_rows", "ray", "ray_address", "num_workers")


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

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        """As argparse's, but a flag the command does not take is reported by that command's parser, so that the
        error points to its own --help (``beamsearch trace --help``), where the flags it takes are listed."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = self._subparsers._group_actions[0].choices if self._subparsers else {}
            (commands.get(getattr(parsed, "command", None)) or self).error(
                f"unrecognized arguments: {' '.join(extras)}")
        return parsed


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

    def model_args(g: dict[str, argparse._ArgumentGroup], many: bool = True) -> None:
        """The model and performance flags; ``many=False`` (trace: one input, one model, recorded on the host)
        leaves out the flags that only mean something for many inputs or several models: batching, ensembles,
        ranking an n-best, CUDA graphs (a trace cannot be captured)."""
        model, io, perf = g["model"], g["input/output"], g["performance"]
        model.add_argument("--model", help="local Hugging Face seq2seq or causal-LM directory, or an ensemble "
                           "folder (its ensemble.json lists model directories; docs/cli.md) (default: the embedded "
                           "G2P model)")
        model.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
        model.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                           help="lowercase inputs (default: on for the embedded model, off otherwise)")
        model.add_argument("--int8", action="store_true", help="quantize the model's linear layers to int8 (CPU)")
        if many:
            model.add_argument("--ensemble", action="append", default=[], metavar="DIR",
                               help="decode with this model directory too, distributions averaged (repeatable)")
            model.add_argument("--ensemble-mode", choices=("log", "prob"),
                               help="average log-probabilities (OpenNMT-py; the default) or probabilities (fairseq); "
                                    "overrides an ensemble folder's own")
            perf.add_argument("--batch-size", type=int, default=64, help="inputs per batch (tokens with "
                              "--batch-type tokens)")
            perf.add_argument("--batch-type", choices=("sentences", "tokens"), default="sentences",
                              help="what --batch-size counts: inputs (sentences) or padded input tokens (tokens)")
        perf.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
        step = perf.add_mutually_exclusive_group()
        step.add_argument("--fast", action="store_true", help="T5 models: the fast step or an error (packed weights, "
                          "oneDNN products, its own attention; equal to float rounding, not bit for bit; "
                          "lean_step='fast'). Already the default for float32 T5 models on the CPU (the embedded one "
                          "too) and with --int8; docs/performance.md")
        step.add_argument("--lean-step", action="store_true", help="the lean step instead of the fast one (the "
                          "model's own kernels: logits equal to transformers' bit for bit; lean_step=True)")
        if many:
            perf.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                              help="each decoding step captured once in a CUDA graph and replayed (greedy and beam "
                              "search; T5, GPT-2, Llama, Qwen2 and Mistral models; equal to float rounding). Default: "
                              "on CUDA where the call allows it; --cuda-graphs asks for it (an error where it cannot "
                              "run; on a CPU the same step runs uncaptured), --no-cuda-graphs turns it off "
                              "(cuda_graphs=True / False, docs/usage.md)")
        io.add_argument("--max-input-length", type=int, help="most input tokens, at most the model's limit "
                        "(default: the model's limit)")
        if many:
            io.add_argument("--on-long", choices=("truncate", "skip", "error"), default="truncate",
                            help="inputs over --max-input-length: truncate or skip (one warning counts them), or "
                            "error")
        else:
            io.add_argument("--on-long", choices=("truncate", "error"), default="truncate",
                            help="an input over --max-input-length: truncate it (with a warning), or error")
        g[SEARCH].add_argument("--seed", type=int, help="random seed for sampling")
        if many:
            g[SEARCH].add_argument("--unfinished", choices=("last", "keep"), default="last",
                                   help="hypotheses that reached the length limit without ending: ranked after the "
                                   "finished ones (last), or where the search's score puts them (keep)")
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
                    "inputs and options); a complete FILE: nothing to do if this command made it, else refused")
    io.add_argument("--overwrite", action="store_true", help="replace an existing --output file once the new one "
                    "is complete")
    g["performance"].add_argument("--chunk-size", type=int, default=10000, help="lines read and sorted by length "
                                  "at a time")
    io.add_argument("--quiet", "-q", action="store_true", help="no progress bar, and no closing line counting the "
                    "outputs a length limit cut")
    io.add_argument("--stream", action="store_true", help="interactive: decode one input at a time and print its "
                    "best output as it becomes final (beam search included; text to stdout)")
    perf = g["performance"]
    perf.add_argument("--ray", action="store_true", help="decode on a Ray cluster, --chunk-size lines per block, "
                      "each block resumable (needs --output and beamsearch[ray]; see docs/ray.md)")
    perf.add_argument("--ray-address", metavar="ADDR", help="with --ray: the cluster to join (the address 'ray start "
                      "--head' prints, or auto; default: a local Ray instance)")
    perf.add_argument("--num-workers", type=int, metavar="N", help="with --ray: workers, each loading the model "
                      "once (default: one per free CPU, or per GPU)")
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
    g[SEARCH].add_argument("--beams", type=int, nargs="+", help="beam widths to compare (1: greedy; default: 1 5, "
                           "or 1 to 10 with --search-errors)")
    g[SEARCH].add_argument("--search-errors", action="store_true", help="compare each beam width with exact search: "
                           "search errors, model errors, empty and degenerate outputs")
    g["input/output"].add_argument("--plot", metavar="PNG", help="with --search-errors: also draw the table here")
    generation_args(g, skip=("--num-beams",))
    g["input/output"].add_argument("--limit", type=int, help="only the first N examples")
    g["input/output"].add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    tr = sub.add_parser("trace", help="draw the beam search tree of one input (HTML) and write its trace (JSON)",
                        formatter_class=HelpFormatter, description="Decode one input with beam search (default "
                        f"{DEFAULT_TRACE_BEAMS} beams) and record every step's candidates: kept, finished or dropped, "
                        "and why. Prints the best output.")
    g = groups(tr)
    g["input/output"].add_argument("text", help="the input, e.g. a word for the embedded G2P model")
    g["input/output"].add_argument("--html", metavar="PATH", help="write the search tree here (one self-contained "
                                   "page)")
    g["input/output"].add_argument("--json", metavar="PATH", help="write the trace here (schema beamsearch.trace/1)")
    g["input/output"].add_argument("--max-steps", type=int, default=256, help="record at most this many steps")
    model_args(g, many=False)
    generation_args(g)
    return ap


DEFAULT_TRACE_BEAMS = 4  # trace's --num-beams when not given (the embedded model's own default is greedy)


def validate(args: argparse.Namespace) -> None:
    positive = ("batch_size", "chunk_size", "threads", "max_rows", "max_input_length", "num_beams",
                "num_return_sequences", "limit", "num_workers", "max_steps")
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    for name in ("ray_address", "num_workers"):
        if getattr(args, name, None) is not None and not args.ray:
            raise CLIError(f"--{name.replace('_', '-')} needs --ray")


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generation options given on the command line; the model's generation_config supplies the rest."""
    out = {kw: getattr(args, flag[2:].replace("-", "_"), None) for flag, (kw, *_) in GENERATION_FLAGS.items()}
    out["early_stopping"] = args.early_stopping
    if getattr(args, "fast", False):
        out["lean_step"] = "fast"
    elif getattr(args, "lean_step", False):
        out["lean_step"] = True
    if getattr(args, "cuda_graphs", None) is not None:
        out["cuda_graphs"] = args.cuda_graphs
    return {k: v for k, v in out.items() if v is not None}
