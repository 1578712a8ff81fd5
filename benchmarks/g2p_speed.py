"""The main job's speed: the embedded G2P model on CMUdict test words, ours against CTranslate2 and transformers.

Decodes the first ``--words`` test words (lowercased, as the CLI feeds the embedded model) in batches of
``--batch``, sorted by length as the CLI batches them (or, with ``--unsorted``, in file order), greedy and at
``--beams``, with every engine in one process on the same inputs:

- ``hf``: transformers' ``generate`` (which ignores the model's ``loop_guard`` and source-tied length limit);
- ``ours``: beamsearch's default (the fast T5 step: packed weights, fused products, its own attention, equal to
  float rounding; native: one C++ call per step and per encoder batch, ``steps/t5/native.py``);
- ``ours-pysearch``: the same native step with the search's bookkeeping in Python (``BEAMSEARCH_NATIVE_SEARCH=0``;
  ``ours`` runs it in one C++ call per step, ``strategies/native_search.py``);
- ``ours-eager``: the eager fast step and the Python search (``BEAMSEARCH_NATIVE=0``: about 270 PyTorch calls per
  step);
- ``ours-lean``: ``lean_step=True`` (the lean T5 step: the model's own kernels, logits equal to transformers');
- ``ours-int8``: ours on ``quantize_int8(model)`` with the fast step (``lean_step="fast"``, what the CLI's
  ``--int8`` runs: the folded weights requantized per output row; native: each product's input quantized once per
  row); ``ours-int8-eager``: the same with ``BEAMSEARCH_NATIVE=0`` (torch's dynamic int8 products, per-tensor
  activations);
- ``ct2-fp32`` / ``ct2-int8``: CTranslate2 on the same model converted by its own converter (``beam_size``,
  ``max_decoding_length`` as ours; its patience 1 stops a beam search at K finished hypotheses, never later
  than ours);
- ``candidate`` (with ``--candidate DIR``): ours on another model directory of the same tokenizer, for example a
  newly trained G2P model, with its time over ``ours`` on the shipped one in the ``/ CT2`` column's place (issue
  38's limit: at most 1.5x).

Timing: ``--repeats`` rounds after a warm-up round; each round runs every engine once, in turn, so that a busy
moment of the machine spreads over all of them. Columns: the median round's seconds and the spread (fastest and
slowest round), words/s, the time over CTranslate2's at the same precision (issue 29's targets: at most 1.0x
float32 for ours, 1.25x int8), the share of words whose best output equals the lean step's (transformers'
kernels) and CTranslate2's (same precision), and the WER without stress against CMUdict's pronunciations. The
machine's load average is printed before and after.

    .venv/bin/python benchmarks/g2p_speed.py [--words 512] [--batch 64] [--beams 5] [--threads 1] [--repeats 5]
        [--unsorted] [--engines ours,ct2-fp32,...] [--no-hf] [--candidate MODEL_DIR]

Prints a markdown table. Nothing is written except CTranslate2's converted models (in a temporary directory).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
G2P_DIR = ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict"
WORDS = ROOT / "src" / "beamsearch" / "data" / "cmudict" / "test.tsv"
ENGINES = ("ours", "ours-pysearch", "ours-eager", "ours-lean", "ours-int8", "ours-int8-eager", "ct2-fp32", "ct2-int8",
           "hf")
TARGETS = {"ours": 1.0, "ours-int8": 1.25}  # time over CTranslate2's at the same precision (issue 29)
AGREEMENT = 0.99  # the share of words whose best output equals CTranslate2's (issue 29)


def precision(engine: str) -> str:
    return "int8" if engine.endswith("int8") else "fp32"


def ours_engine(model, tokenizer, batches: list[list[str]], beams: int, native: bool = True,
                native_search: bool = True, **options):
    """beamsearch on the batches; ``native=False``: with ``BEAMSEARCH_NATIVE=0`` (the eager fast step and the Python
    search); ``native_search=False``: with ``BEAMSEARCH_NATIVE_SEARCH=0`` (the native step, the Python search)."""
    from beamsearch.adapters.hf import search_model

    switched = {name: "0" for name, on in (("BEAMSEARCH_NATIVE", native), ("BEAMSEARCH_NATIVE_SEARCH", native_search))
                if not on}

    def run() -> list[list[str]]:
        before = {name: os.environ.get(name) for name in switched}
        os.environ.update(switched)
        try:
            outputs = []
            for words in batches:
                inputs = tokenizer(words, return_tensors="pt", padding=True)
                result = search_model(model, **inputs, num_beams=beams, **options)
                outputs += [tokenizer.decode(row[0], skip_special_tokens=True).split() for row in result.sequences]
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return outputs

    return run


def cpu_name() -> str:
    """The CPU's model name (as ``lscpu`` prints it), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hf_engine(model, tokenizer, batches: list[list[str]], beams: int):
    def run() -> list[list[str]]:
        outputs = []
        for words in batches:
            inputs = tokenizer(words, return_tensors="pt", padding=True)
            sequences = model.generate(**inputs, num_beams=beams, do_sample=False)
            outputs += [tokenizer.decode(row, skip_special_tokens=True).split() for row in sequences]
        return outputs

    return run


def ct2_engine(translator, tokenizer, batches: list[list[str]], beams: int, max_new_tokens: int):
    specials = set(tokenizer.all_special_tokens)

    def run() -> list[list[str]]:
        outputs = []
        for words in batches:
            tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(words)["input_ids"]]
            for result in translator.translate_batch(tokens, beam_size=beams, max_decoding_length=max_new_tokens,
                                                     num_hypotheses=1):
                text = tokenizer.convert_tokens_to_string([t for t in result.hypotheses[0] if t not in specials])
                outputs.append(text.split())
        return outputs

    return run


def load_ct2(work: Path, threads: int, wanted: set[str]) -> tuple[dict, list[str]]:
    if not wanted:
        return {}, []
    try:
        import ctranslate2
    except Exception as error:  # noqa: BLE001 - any import failure only skips CTranslate2
        return {}, [f"CTranslate2 skipped: cannot import it ({type(error).__name__}: {error})"]
    translators = {}
    for quantization in ("float32", "int8"):
        name = f"ct2-{'fp32' if quantization == 'float32' else 'int8'}"
        if name not in wanted:
            continue
        out = work / f"g2p-{quantization}"
        ctranslate2.converters.TransformersConverter(str(G2P_DIR)).convert(str(out), quantization=quantization)
        translators[name] = ctranslate2.Translator(str(out), device="cpu", compute_type=quantization,
                                                   intra_threads=threads, inter_threads=1)
    return translators, []


def measure(engines: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[list[str]]]]:
    """Seconds of each round per engine (``repeats`` rounds after one warm-up round), and each engine's outputs."""
    outputs = {name: run() for name, run in engines.items()}  # the warm-up round
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, run in engines.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return seconds, outputs


def load() -> str:
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--beams", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--unsorted", action="store_true", help="batches in file order (the CLI sorts by length)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {ENGINES}")
    parser.add_argument("--no-hf", action="store_true", help="leave transformers' generate out (the slowest)")
    parser.add_argument("--candidate", type=Path, help="also time ours on this model directory, against ours")
    args = parser.parse_args(argv)
    names = [name for name in args.engines.split(",") if name and not (args.no_hf and name == "hf")]
    if not set(names) <= set(ENGINES):
        parser.error(f"--engines: a subset of {ENGINES}")
    if args.candidate is not None:
        if not (args.candidate / "config.json").is_file():
            parser.error(f"--candidate {args.candidate}: not a model directory (no config.json)")
        names += [name for name in ("ours", "candidate") if name not in names]
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from beamsearch import quantize_int8
    from beamsearch.evaluation import read_references, right_without_stress

    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForSeq2SeqLM.from_pretrained(G2P_DIR, dtype=torch.float32).eval()
    quantized = quantize_int8(model) if {"ours-int8", "ours-int8-eager"} & set(names) else None
    tokenizer = AutoTokenizer.from_pretrained(G2P_DIR)
    candidate = None
    if args.candidate is not None:
        candidate = AutoModelForSeq2SeqLM.from_pretrained(args.candidate, dtype=torch.float32).eval()
        if AutoTokenizer.from_pretrained(args.candidate).get_vocab() != tokenizer.get_vocab():
            parser.error(f"--candidate {args.candidate}: its tokenizer differs from the shipped model's")
    entries = read_references(WORDS)[: args.words]
    if not args.unsorted:
        entries = sorted(entries, key=lambda entry: len(entry[0]))
    words = [source.lower() for source, _ in entries]
    batches = [words[i : i + args.batch] for i in range(0, len(words), args.batch)]
    max_new_tokens = int(model.generation_config.max_new_tokens)
    with tempfile.TemporaryDirectory() as work:
        translators, notes = load_ct2(Path(work), args.threads, {n for n in names if n.startswith("ct2")})
        order = "in file order" if args.unsorted else "sorted by length"
        print(f"{len(words)} CMUdict test words, batches of {args.batch} {order}; "
              f"{cpu_name()} ({os.cpu_count()} CPUs), {args.threads} thread(s); torch {torch.__version__}, "
              f"transformers {transformers.__version__}, ctranslate2 "
              f"{sys.modules['ctranslate2'].__version__ if translators else '-'}; median of {args.repeats} "
              f"interleaved rounds; load average before: {load()}")
        for note in notes:
            print(note)
        print("\n| search | engine | s | spread s | words/s | / CT2 same precision (candidate: / ours) | = lean "
              "| = CT2 same precision (candidate: = ours) "
              "| WER % |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|")
        verdicts = []

        def make_engine(name: str, beams: int):
            if name == "hf":
                return hf_engine(model, tokenizer, batches, beams)
            if name == "candidate":
                return ours_engine(candidate, tokenizer, batches, beams)
            if name.startswith("ct2"):
                return ct2_engine(translators[name], tokenizer, batches, beams, max_new_tokens)
            step = {"ours": {}, "ours-pysearch": {"native_search": False}, "ours-eager": {"native": False},
                    "ours-lean": {"lean_step": True},
                    "ours-int8": {"lean_step": "fast"}, "ours-int8-eager": {"lean_step": "fast", "native": False}}[name]
            return ours_engine(quantized if "int8" in name else model, tokenizer, batches, beams, **step)

        with torch.no_grad():
            for beams in (1, args.beams):
                engines = {name: make_engine(name, beams) for name in names
                           if not name.startswith("ct2") or name in translators}
                rounds, outputs = measure(engines, args.repeats)
                search = "greedy" if beams == 1 else f"beam {beams}"
                seconds = {name: statistics.median(times) for name, times in rounds.items()}
                for name in engines:
                    ct2 = "ours" if name == "candidate" else f"ct2-{precision(name)}"
                    ratio = seconds[name] / seconds[ct2] if ct2 in seconds else None
                    same = {other: (sum(a == b for a, b in zip(outputs[name], outputs[other], strict=True))
                                    if other in outputs else None) for other in ("ours-lean", ct2)}
                    wrong = sum(not right_without_stress(hyp, refs)
                                for hyp, (_, refs) in zip(outputs[name], entries, strict=True))
                    share = {k: "-" if v is None else f"{100 * v / len(words):.1f}%" for k, v in same.items()}
                    print(f"| {search} | {name} | {seconds[name]:.3f} | {min(rounds[name]):.3f}-"
                          f"{max(rounds[name]):.3f} | {len(words) / seconds[name]:.0f} | "
                          f"{'-' if ratio is None else f'{ratio:.2f}x'} | {share['ours-lean']} | {share[ct2]} | "
                          f"{100 * wrong / len(words):.2f} |")
                    if name in TARGETS and ratio is not None:
                        target, agreed = TARGETS[name], same[ct2] / len(words)
                        verdicts.append(f"{search} {name}: {ratio:.2f}x CTranslate2 {precision(name)} (target <= "
                                        f"{target}x: {'met' if ratio <= target else 'missed'}); best output equal "
                                        f"to CTranslate2's on {100 * agreed:.1f}% of words")
        print(f"\nload average after: {load()}")
        for verdict in verdicts:
            print(verdict)


if __name__ == "__main__":
    main()
