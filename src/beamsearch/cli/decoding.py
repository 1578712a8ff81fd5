"""Loading a local Hugging Face model and decoding lines with it, batched by length."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..adapters.hf import search_model
from ..errors import SearchError
from ..steps.chooser import fast_capable
from .ensemble_file import ENSEMBLE_FILE, is_ensemble_folder, read_ensemble_file
from .flags import generation_options
from .inputs import CLIError, Line
from .lengths import CutCount, capped, count_cut, mark_source_limit, source_tied_limit
from .outputs import is_unfinished

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "models" / "g2p_cmudict"
MAX_WARNINGS = 20


@dataclass
class Model:
    model: Any
    tokenizer: Any
    lowercase: bool  # the embedded G2P model reads lowercase words
    warnings: list[str] = field(default_factory=list)
    ensemble: list[Any] = field(default_factory=list)  # --ensemble: more models decoded with this one
    ensemble_mode: str = "log"
    replace_unk: bool = False  # --replace-unk: unknown output tokens become the source token they attend to
    keep_alignments: bool = False  # --alignments: keep them in the records
    long_inputs: list[str] = field(default_factory=list)  # sources of the inputs over the length limit
    unfinished_last: bool = True  # --unfinished last: hypotheses that did not end rank after those that did
    cut: CutCount = field(default_factory=CutCount)  # outputs a length limit stopped, for the summary line
    step: dict[str, Any] = field(default_factory=dict)  # --int8 on a T5 model: the fast step unless a flag says


def load_model(path: str | None, device: str, lowercase: bool | None, eager_attention: bool = False,
               int8: bool = False) -> Model:
    """The model and tokenizer of a local directory (the embedded G2P model when ``path`` is None), or the members of
    an ensemble folder (``ensemble.json``, :mod:`.ensemble_file`): the first is the model, the others its ensemble.

    ``eager_attention`` loads it with attention weights available (for coverage penalties); ``int8`` quantizes
    its linear layers (CPU only, :func:`beamsearch.quantize_int8`).
    """
    folder = EMBEDDED_MODEL if path is None else Path(path)
    lowercase = path is None if lowercase is None else lowercase
    if not is_ensemble_folder(folder):
        return load_one(folder, f"--model {folder}", device, lowercase, eager_attention, int8)
    spec = read_ensemble_file(folder)
    names = [f"--model {folder}: its member {member}" for member in spec.members]
    m, *others = (load_one(member, name, device, lowercase, eager_attention, int8)
                  for member, name in zip(spec.members, names, strict=True))
    for name, other in zip(names[1:], others, strict=True):
        join(m, other, name)
    m.ensemble_mode = spec.mode or m.ensemble_mode
    return m


def load_one(folder: Path, what: str, device: str, lowercase: bool, eager_attention: bool, int8: bool) -> Model:
    """One model directory; ``what`` names it in errors (``--model DIR``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise CLIError("the command line needs transformers: pip install 'beamsearch[hf]'") from None
    hf_logging.disable_progress_bar()
    check_model_folder(folder, what)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        cls = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        extra = {"attn_implementation": "eager"} if eager_attention else {}
        model = cls.from_pretrained(folder, local_files_only=True, use_safetensors=True, **extra)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # a corrupt or incomplete directory: transformers and safetensors raise many types
        message = " ".join(str(e).split())[:300]
        raise CLIError(f"{what}: cannot be loaded ({type(e).__name__}: {message})", status=1) from None
    if not callable(getattr(tokenizer, "pad", None)) or not tokenizer("a")["input_ids"]:
        raise CLIError(f"{what}: its tokenizer loaded but encodes nothing")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError) as e:
        raise CLIError(f"--device {device}: {e}") from None
    if int8:
        from ..quantize import quantize_int8

        try:
            model = quantize_int8(model)
        except ValueError as e:
            raise CLIError(f"--int8: {e}") from None
    if not config.is_encoder_decoder:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        raise CLIError(f"{what}: its tokenizer has no pad token (needed to batch inputs)")
    # an int8 T5 model decodes with the fast step (its folded weights requantized per output row: faster, and the
    # embedded model's WER within 0.3 points of float32's, docs/performance.md); the library's default for an int8
    # model is the lean step, whose products are the quantized model's own
    step = {"lean_step": "fast"} if int8 and fast_capable(model) else {}
    return Model(model, tokenizer, lowercase, step=step)


WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model", "source.spm")


def check_model_folder(folder: Path, what: str) -> None:
    """What a model directory must hold before anything is loaded: config.json, safetensors weights (pickled
    weights can run code when loaded, so they are refused) and tokenizer files. ``what`` names it (``--model DIR``)."""
    if not folder.is_dir():
        raise CLIError(f"{what}: not a directory (a local Hugging Face model directory is expected)")
    if not (folder / "config.json").is_file():
        raise CLIError(f"{what}: no config.json in it")
    if not any((folder / f).is_file() for f in WEIGHTS):
        pickled = [f for f in PICKLED if (folder / f).is_file()]
        if pickled:
            raise CLIError(f"{what}: only {pickled[0]} (pickle) weights; beamsearch loads safetensors only, "
                           "as pickle files can run code: convert with model.save_pretrained(dir) in transformers")
        raise CLIError(f"{what}: no model.safetensors in it")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise CLIError(f"{what}: no tokenizer files in it (tokenizer.json or tokenizer_config.json and its "
                       "vocabulary): save the tokenizer with the model")


@dataclass
class Encoded:
    line: Line
    ids: list[int]


def encode(m: Model, line: Line, max_length: int | None, on_long: str) -> Encoded | None:
    """Token ids of one line; None for an empty (or skipped) line. Warns about unknown characters."""
    text = line.text.lower() if m.lowercase else line.text
    if not text.strip():
        return None
    tok = m.tokenizer
    ids = tok(text)["input_ids"]
    unk = tok.unk_token_id
    if unk is not None and unk in ids:
        bad = sorted({c for c in text if not c.isspace() and tok(c, add_special_tokens=False)["input_ids"] == [unk]})
        what = ", ".join(repr(c) for c in bad) if bad else "part of it"
        warn(m, f"{line.source}: {what} not in the model's vocabulary; encoded as {tok.unk_token}")
    if max_length is not None and len(ids) > max_length:
        if on_long == "error":
            raise CLIError(f"{line.source}: {len(ids)} tokens, over the input limit of {max_length} "
                           "(--on-long truncate goes on)")
        m.long_inputs.append(f"{line.source}, {len(ids)} tokens")  # counted in one warning at the end
        if on_long == "skip":
            return None
        ids = tok(text, truncation=True, max_length=max_length)["input_ids"]
    return Encoded(line, ids)


def warn(m: Model, message: str) -> None:
    m.warnings.append(message)
    if len(m.warnings) <= MAX_WARNINGS:
        print(f"beamsearch: warning: {message}", file=sys.stderr)
    elif len(m.warnings) == MAX_WARNINGS + 1:
        print("beamsearch: warning: more warnings follow; a count is given at the end", file=sys.stderr)


def batches(items: list[Encoded], size: int, by_tokens: bool) -> list[list[Encoded]]:
    """Length-sorted batches of at most ``size`` inputs (or padded tokens), run in input order."""
    order = sorted(items, key=lambda e: len(e.ids))
    out: list[list[Encoded]] = []
    batch: list[Encoded] = []
    for e in order:
        cost = len(e.ids) * (len(batch) + 1) if by_tokens else len(batch) + 1
        if batch and cost > size:
            out.append(batch)
            batch = []
        batch.append(e)
    if batch:
        out.append(batch)
    return sorted(out, key=lambda b: min(e.line.index for e in b))


def decode_batch(m: Model, batch: list[Encoded], options: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Run the search on one batch; per input, its hypotheses as JSON-ready dicts with their text."""
    padded = m.tokenizer.pad({"input_ids": [e.ids for e in batch]}, return_tensors="pt")
    device = m.model.device
    inputs = {"input_ids": padded["input_ids"].to(device), "attention_mask": padded["attention_mask"].to(device)}
    given = options
    options = capped(m.model.generation_config, options, inputs["input_ids"].shape[1])
    if "target_prefix" in options:  # one prefix for every input
        options = dict(options, target_prefix=[options["target_prefix"]] * len(batch))
    try:
        if m.ensemble:
            from ..adapters.hf_ensemble import search_ensemble

            result = search_ensemble([m.model, *m.ensemble], **inputs, mode=m.ensemble_mode, **options)
        else:
            result = search_model(m.model, **inputs, **{**m.step, **options})
    except SearchError as e:  # what the model returned: a failure while running
        raise CLIError(str(e), status=1) from None
    except ValueError as e:
        raise CLIError(explained(str(e), m, given)) from None

    def text(ids: list[int]) -> str:
        return m.tokenizer.decode(ids, skip_special_tokens=True).strip()

    records = result.to_dicts(decode=text)
    mark_source_limit(source_tied_limit(m.model.generation_config, given), [len(e.ids) for e in batch], records)
    if m.unfinished_last:  # a stable sort: the search's order among finished, and among unfinished, hypotheses
        records = [sorted(hyps, key=is_unfinished) for hyps in records]
    count_cut(m.cut, records)
    for encoded, hyps in zip(batch, records, strict=True):  # alignments over the input's own tokens, no padding
        for hyp in hyps:
            if "alignment" in hyp:
                hyp["alignment"] = [row[: len(encoded.ids)] for row in hyp["alignment"]]
            if m.replace_unk:
                hyp["text"] = unk_replaced_text(m.tokenizer, hyp, encoded.ids)
                if not m.keep_alignments:
                    del hyp["alignment"]
    return records


def explained(message: str, m: Model, options: dict[str, Any]) -> str:
    """A search error about an option the command line did not set: say that it came from the model."""
    name = re.match(r"[a-z_]+", message)
    name = name.group(0) if name else ""
    if name and name not in options and hasattr(m.model.generation_config, name):
        flag = "--" + name.replace("_", "-")
        return f"{message} (from the model's generation_config.json; {flag} overrides it)"
    return message


def unk_replaced_text(tokenizer: Any, hyp: dict[str, Any], source_ids: list[int]) -> str:
    """The hypothesis' text with each unknown token replaced by the source token it attends to most."""
    from ..alignment import replace_unk

    tokens = tokenizer.convert_ids_to_tokens(hyp["tokens"])
    replaced = replace_unk(tokens, hyp["alignment"], tokenizer.convert_ids_to_tokens(source_ids),
                           tokenizer.unk_token)
    special = set(tokenizer.all_special_tokens)
    kept = [new for old, new in zip(tokens, replaced, strict=True) if old == tokenizer.unk_token or new not in special]
    return tokenizer.convert_tokens_to_string(kept).strip()


def decode_lines(
    m: Model,
    lines: list[Line],
    options: dict[str, Any],
    batch_size: int,
    by_tokens: bool,
    max_length: int | None,
    on_long: str,
) -> Iterator[tuple[Line, list[dict[str, Any]]]]:
    """Decode ``lines``, yielding ``(line, hypotheses)`` in input order as soon as a prefix is complete."""
    encoded = {line.index: encode(m, line, max_length, on_long) for line in lines}
    ready: dict[int, list[dict[str, Any]]] = {i: [] for i, e in encoded.items() if e is None}
    pending = iter(lines)
    next_line = next(pending, None)

    def flush() -> Iterator[tuple[Line, list[dict[str, Any]]]]:
        nonlocal next_line
        while next_line is not None and next_line.index in ready:
            yield next_line, ready.pop(next_line.index)
            next_line = next(pending, None)

    yield from flush()
    for batch in batches([e for e in encoded.values() if e is not None], batch_size, by_tokens):
        for e, hyps in zip(batch, decode_batch(m, batch, options), strict=True):
            ready[e.line.index] = hyps
        yield from flush()


def input_limit(args: argparse.Namespace, m: Model) -> int | None:
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


def report_long_inputs(m: Model, limit: int | None, on_long: str) -> None:
    """One warning counting the inputs over the length limit (truncated or skipped)."""
    sources = list(dict.fromkeys(m.long_inputs))  # eval decodes each input once per beam width
    if sources:
        what = "truncated" if on_long == "truncate" else "left empty"
        print(f"beamsearch: warning: {len(sources)} input(s) over {limit} tokens {what} (first: {sources[0]}); "
              "--on-long error refuses them instead", file=sys.stderr)


def add_ensemble(m: Model, args: argparse.Namespace, eager_attention: bool = False) -> None:
    """Load the --ensemble directories next to the main model; they must share its tokenizer, and load with its
    attention setting (``eager_attention``: alignments and coverage penalties average every member's attention).
    ``--ensemble-mode`` overrides an ensemble folder's mode."""
    for folder in args.ensemble:
        if is_ensemble_folder(Path(folder)):
            raise CLIError(f"--ensemble {folder}: an ensemble folder ({ENSEMBLE_FILE}); give it as --model, or its "
                           "members as --ensemble")
        name = f"--ensemble {folder}"
        join(m, load_one(Path(folder), name, args.device, m.lowercase, eager_attention, args.int8), name)
    m.ensemble_mode = args.ensemble_mode or m.ensemble_mode


def join(m: Model, other: Model, what: str) -> None:
    """``other`` decodes with ``m`` (an ensemble member): one vocabulary."""
    if other.tokenizer.get_vocab() != m.tokenizer.get_vocab():
        raise CLIError(f"{what}: its tokenizer differs from the main model's (an ensemble needs one vocabulary)")
    m.ensemble.append(other.model)


def prepare_decode(args: argparse.Namespace) -> tuple[Model, dict[str, Any], int | None]:
    """What ``decode`` needs before its first line: the model (with its ensemble), the search options and the input
    length limit (the single process and each ``--ray`` worker prepare them here alike)."""
    eager = args.coverage_penalty not in (None, "none") or args.alignments or args.replace_unk
    m = load_model(args.model, args.device, args.lowercase, eager_attention=eager, int8=args.int8)
    add_ensemble(m, args, eager)
    m.unfinished_last = args.unfinished == "last"
    if args.seed is not None:
        torch.manual_seed(args.seed)
    return m, decode_options(args, m), input_limit(args, m)


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
