"""The main job's speed: the embedded G2P model on CMUdict test words, ours against CTranslate2 and transformers.

Decodes the first ``--words`` test words (lowercased, as the CLI feeds the embedded model), sorted by length into
batches of ``--batch`` as the CLI batches them, greedy and at ``--beams``, with every engine in one process on
the same inputs:

- ``hf``: transformers' ``generate`` (which ignores the model's ``loop_guard`` and source-tied length limit);
- ``ours``: beamsearch's default (the lean T5 step, results equal to transformers' kernels);
- ``ours-fast``: ``lean_step="fast"`` (packed weights, its own attention; not bitwise);
- ``ours-int8`` / ``ours-fast-int8``: the same on ``quantize_int8(model)``;
- ``ct2-fp32`` / ``ct2-int8``: CTranslate2 on the same model converted by its own converter (``beam_size``,
  ``max_decoding_length`` as ours; its patience 1 stops a beam search at K finished hypotheses, never later
  than ours).

Timing: ``--repeats`` rounds after a warm-up round; each round runs every engine once, in turn, so that a busy
moment of the machine spreads over all of them; the median round is reported. Columns: seconds, words/s, the
time over CTranslate2's at the same precision (the issue-21 targets: at most 1.25x float32, 1.5x int8), the share
of words whose best output equals ours (default step) and CTranslate2's (same precision), and the WER without
stress against CMUdict's pronunciations.

    .venv/bin/python benchmarks/g2p_speed.py [--words 512] [--batch 64] [--beams 5] [--threads 1] [--repeats 5]

Prints a markdown table. Nothing is written except CTranslate2's converted models (in a temporary directory).
"""

from __future__ import annotations

import argparse
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
OURS = ("ours", "ours-fast", "ours-int8", "ours-fast-int8")
TARGETS = {"fp32": 1.25, "int8": 1.5}  # time over CTranslate2's at the same precision (issue 21)


def precision(engine: str) -> str:
    return "int8" if engine.endswith("int8") else "fp32"


def ours_engine(model, tokenizer, batches: list[list[str]], beams: int, **options):
    from beamsearch.adapters.hf import search_model

    def run() -> list[list[str]]:
        outputs = []
        for words in batches:
            inputs = tokenizer(words, return_tensors="pt", padding=True)
            result = search_model(model, **inputs, num_beams=beams, **options)
            outputs += [tokenizer.decode(row[0], skip_special_tokens=True).split() for row in result.sequences]
        return outputs

    return run


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
    tokens = [[tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(words)["input_ids"]] for words in batches]
    specials = set(tokenizer.all_special_tokens)

    def run() -> list[list[str]]:
        outputs = []
        for batch in tokens:
            for result in translator.translate_batch(batch, beam_size=beams, max_decoding_length=max_new_tokens,
                                                     num_hypotheses=1):
                text = tokenizer.convert_tokens_to_string([t for t in result.hypotheses[0] if t not in specials])
                outputs.append(text.split())
        return outputs

    return run


def load_ct2(work: Path, threads: int) -> tuple[dict, list[str]]:
    try:
        import ctranslate2
    except Exception as error:  # noqa: BLE001 - any import failure only skips CTranslate2
        return {}, [f"CTranslate2 skipped: cannot import it ({type(error).__name__}: {error})"]
    translators = {}
    for quantization in ("float32", "int8"):
        out = work / f"g2p-{quantization}"
        ctranslate2.converters.TransformersConverter(str(G2P_DIR)).convert(str(out), quantization=quantization)
        translators[f"ct2-{'fp32' if quantization == 'float32' else 'int8'}"] = ctranslate2.Translator(
            str(out), device="cpu", compute_type=quantization, intra_threads=threads, inter_threads=1)
    return translators, []


def measure(engines: dict, repeats: int) -> tuple[dict[str, float], dict[str, list[list[str]]]]:
    """Median seconds per engine over ``repeats`` rounds (after one warm-up round), and each engine's outputs."""
    outputs = {name: run() for name, run in engines.items()}  # the warm-up round
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, run in engines.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in seconds.items()}, outputs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--beams", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="leave transformers' generate out (the slowest)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from beamsearch import quantize_int8
    from beamsearch.evaluation import read_references, right_without_stress

    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForSeq2SeqLM.from_pretrained(G2P_DIR, dtype=torch.float32).eval()
    quantized = quantize_int8(model)
    tokenizer = AutoTokenizer.from_pretrained(G2P_DIR)
    entries = sorted(read_references(WORDS)[: args.words], key=lambda entry: len(entry[0]))
    words = [source.lower() for source, _ in entries]
    batches = [words[i : i + args.batch] for i in range(0, len(words), args.batch)]
    max_new_tokens = int(model.generation_config.max_new_tokens)
    with tempfile.TemporaryDirectory() as work:
        translators, notes = load_ct2(Path(work), args.threads)
        print(f"{len(words)} CMUdict test words, batches of {args.batch} sorted by length; "
              f"{platform.processor() or platform.machine()}, {args.threads} thread(s); torch {torch.__version__}, "
              f"transformers {transformers.__version__}, ctranslate2 "
              f"{sys.modules['ctranslate2'].__version__ if translators else '-'}; median of {args.repeats} rounds")
        for note in notes:
            print(note)
        print("\n| search | engine | s | words/s | / CT2 same precision | = ours | = CT2 same precision | WER % |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        verdicts = []
        with torch.no_grad():
            for beams in (1, args.beams):
                engines = {
                    "ours": ours_engine(model, tokenizer, batches, beams),
                    "ours-fast": ours_engine(model, tokenizer, batches, beams, lean_step="fast"),
                    "ours-int8": ours_engine(quantized, tokenizer, batches, beams),
                    "ours-fast-int8": ours_engine(quantized, tokenizer, batches, beams, lean_step="fast"),
                    **{name: ct2_engine(t, tokenizer, batches, beams, max_new_tokens)
                       for name, t in translators.items()},
                }
                if not args.no_hf:
                    engines["hf"] = hf_engine(model, tokenizer, batches, beams)
                seconds, outputs = measure(engines, args.repeats)
                search = "greedy" if beams == 1 else f"beam {beams}"
                for name in engines:
                    ct2 = f"ct2-{precision(name)}"
                    ratio = seconds[name] / seconds[ct2] if ct2 in seconds else None
                    same_ours = sum(a == b for a, b in zip(outputs[name], outputs["ours"], strict=True))
                    same_ct2 = (sum(a == b for a, b in zip(outputs[name], outputs[ct2], strict=True))
                                if ct2 in outputs else None)
                    wrong = sum(not right_without_stress(hyp, refs)
                                for hyp, (_, refs) in zip(outputs[name], entries, strict=True))
                    print(f"| {search} | {name} | {seconds[name]:.3f} | {len(words) / seconds[name]:.0f} | "
                          f"{'-' if ratio is None else f'{ratio:.2f}x'} | {100 * same_ours / len(words):.1f}% | "
                          f"{'-' if same_ct2 is None else f'{100 * same_ct2 / len(words):.1f}%'} | "
                          f"{100 * wrong / len(words):.2f} |")
                    if name in ("ours-fast", "ours-fast-int8") and ratio is not None:
                        target = TARGETS[precision(name)]
                        verdicts.append(f"{search} {name}: {ratio:.2f}x CTranslate2 {precision(name)} (target "
                                        f"<= {target}x: {'met' if ratio <= target else 'missed'})")
        print()
        for verdict in verdicts:
            print(verdict)


if __name__ == "__main__":
    main()
