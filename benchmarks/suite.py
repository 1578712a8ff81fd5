"""Benchmark suite: transformers generate, beamsearch, CTranslate2 (float32, int8) and the model floor.

One process, the same models and inputs for every engine; each engine is warmed up, then timed (median of
--repeats). Engines:

- HF: ``model.generate``; ours: ``beamsearch.generate`` with the same arguments (on float32 T5 models the fast
  step, since issue 29; the lean step on GPT-2 and Llama); ours-fast: ``lean_step="fast"`` (the same as ours on
  float32 T5 models); ours-lean: ``lean_step=True`` (the lean T5 / GPT-2 / Llama step: the model's own kernels);
  ours-keep: the same as ours with ``remove_finished=False`` (finished examples stay in the batch, as in
  transformers): the lever's effect; ours-generic: the same with ``lean_step=False`` (the generic step calling
  ``model(...)``): that lever's effect; ours-shared: ``share_encoder_state=True`` (the lean T5 step with an example's
  beams sharing one copy of the cross-attention keys and values); ours-compiled: ``compile_step=True`` (the lean
  step under ``torch.compile``, timed after a compiling warm-up); ours-static: ``compile_step="static"`` (the
  fixed-shape lean step, compiled); ours-int8: ours on ``beamsearch.quantize_int8(model)`` (CPU only; dynamic int8
  linear layers; on T5 models with ``lean_step="fast"``, as the CLI's ``--int8`` runs it).
- CT2 fp32 / int8: CTranslate2 converted offline from the same ``save_pretrained`` directory with its
  ``TransformersConverter`` (quantization float32 and int8), the same options in its names (beam_size,
  max/min decoding length, patience 1, length_penalty 1, return_end_token).
- floor: the same model forwards with the KV cache and no search (prompt once per example, then B*K rows
  for the number of steps our search took): the cost of the model alone, with the step ours uses (the fast
  step on float32 T5 models, the lean step on other T5, GPT-2 and Llama models, ``model(...)`` otherwise), so that
  ours/floor is the search's overhead.

Models (``--models``): t5-small (random weights, d_model 512, 6+6 layers, vocab 32128, source 32, 48 new
tokens, EOS suppressed so all engines return the same sequences), t5-small-eos (the same shape, EOS likely
at varied lengths; beam search with early_stopping=True, which is CTranslate2's patience 1), g2p (the
embedded real T5 on CMUdict test words) and gpt2 (random GPT-2-small shape, prompts of mixed length,
left-padded, EOS suppressed).

The table gives times, ratios (HF/ours, CT2/ours above 1 mean ours is faster; "over floor" is ours' time
over the floor's), how many best hypotheses equal transformers', how many CTranslate2 outputs equal ours
under ``semantics="ct2"`` (the exact-match check under CTranslate2's own rules) and peak memory growth
(see suite_engines.py for how it is measured). A PNG plot (throughput against beam size; time against
output length) goes to --plot.

    .venv/bin/python benchmarks/suite.py --quick --threads 1
    .venv/bin/python benchmarks/suite.py --device cuda --markdown-out benchmarks/results/suite-h100.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import beamsearch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import suite_engines as engines  # noqa: E402
import suite_graphs as graphs  # noqa: E402
import suite_models as models  # noqa: E402
from suite_plot import plot  # noqa: E402

ENGINES = ("hf", "ours", "ours-fast", "ours-lean", "ours-keep", "ours-generic", "ours-shared", "ours-compiled",
           "ours-static", "ours-int8", "ours-graphs",
           "ct2-fp32",
           "ct2-int8", "floor")
QUICK = {"models": "t5-small,t5-small-eos,g2p,gpt2", "beams": "1,4", "batches": "1,8", "repeats": 1,
         "lengths": "8,16,32"}
FULL = {"models": ",".join(m for m in models.MODELS if m != "llama-1b"), "beams": "1,4,8", "batches": "1,16,64",
        "repeats": 3, "lengths": "12,24,48"}


@dataclass
class Row:
    model: str
    beams: int
    batch: int
    steps: int = 0
    timings: dict[str, engines.Timing] = field(default_factory=dict)
    equal_hf: dict[str, int] = field(default_factory=dict)  # engine -> best hypotheses equal to HF's
    ct2_exact: int | None = None  # CT2 fp32 outputs equal to ours under semantics="ct2"
    tokens: dict[str, int] = field(default_factory=dict)  # engine -> generated tokens (best hypotheses)
    ties: dict[str, int] = field(default_factory=dict)  # engine -> differences from HF at HF's own near ties
    bad: dict[str, int] = field(default_factory=dict)  # engine -> differences from HF that are not near ties
    # engine -> (rows whose best hypothesis differs from HF's, the largest float32 score deficit per token of ours
    # against HF's among them): issue 39's rule for bfloat16 / float16 (suite_graphs.half_precision_rule)
    rule: dict[str, tuple[int, float] | None] = field(default_factory=dict)  # also the control (suite_graphs.CONTROL)

    def seconds(self, engine: str) -> float | None:
        timing = self.timings.get(engine)
        return None if timing is None else timing.seconds


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true",
                        help=f"small grid (beams {QUICK['beams']}, batches {QUICK['batches']}, 1 repeat)")
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(models.MODELS)} (default: all)")
    parser.add_argument("--beams", help="comma-separated beam sizes, 1 = greedy (default 1,4,8)")
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,16,64)")
    parser.add_argument("--repeats", type=int, help="timed runs per engine after one warm-up (default 3)")
    parser.add_argument("--engines", help=f"comma-separated subset of {ENGINES} (default: all; --quick: all but"
                        " ours-compiled and ours-static, whose compiling warm-ups would dominate a small grid)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch and CTranslate2 (default 1)")
    parser.add_argument("--lengths", help="output lengths of the time-vs-length sweep (t5-small; '' to skip)")
    parser.add_argument("--markdown-out", type=Path, help="also write the report as Markdown to this file")
    parser.add_argument("--time-budget", type=float, help="start no case after this many seconds (the report then "
                        "holds the cases finished)")
    parser.add_argument("--table", choices=("full", "graphs"), default="full",
                        help="graphs: transformers, ours (eager) and ours-graphs (the default on CUDA) only, with cold "
                        "times, near ties and the half-precision rule (suite_graphs.py); full: every engine's columns")
    parser.add_argument("--plot", type=Path, default=Path(__file__).resolve().parent / "results" / "suite.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.models = [m for m in (args.models or preset["models"]).split(",") if m]
    for name in args.models:
        if name not in models.MODELS:
            parser.error(f"unknown model {name!r}; choose from {', '.join(models.MODELS)}")
    args.beams = _ints(args.beams or preset["beams"])
    args.batches = _ints(args.batches or preset["batches"])
    args.repeats = args.repeats or preset["repeats"]
    args.lengths = _ints(preset["lengths"] if args.lengths is None else args.lengths)
    default_engines = [e for e in ENGINES if not (args.quick and e in ("ours-compiled", "ours-static"))]
    args.engines = [e for e in args.engines.split(",") if e] if args.engines else default_engines
    if not set(args.engines) <= set(ENGINES) or "ours" not in args.engines:
        parser.error(f"--engines: a subset of {ENGINES} that includes 'ours'")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_case(workload, ct2_models: dict, args, beams: int, batch: int, exact_check: bool = True,
             memory_only: bool = False) -> Row:
    """One case, every engine; ``memory_only``: the CPU memory pass (peak memory, no times)."""
    row = Row(workload.name, beams, batch)

    def timed(run, **kwargs):
        return engines.timed(run, args.repeats, args.device, memory_only=memory_only, **kwargs)

    inputs = workload.batch(batch, args.device)
    kwargs = workload.generation_kwargs(beams)
    # ours: the eager path (on CUDA the default is the graph path where the call allows it: ours-graphs)
    ours = engines.beamsearch_engine(workload, inputs, dict(kwargs, cuda_graphs=False))
    row.steps = engines.count_forwards(workload.model, ours)  # also ours' warm-up
    row.timings["ours"] = timed(ours, warm=True)
    if "ours-fast" in args.engines and workload.lean_t5:
        fast = engines.beamsearch_engine(workload, inputs, dict(kwargs, lean_step="fast"))
        row.timings["ours-fast"] = timed(fast)
    if "ours-lean" in args.engines and workload.lean:
        lean = engines.beamsearch_engine(workload, inputs, dict(kwargs, lean_step=True))
        row.timings["ours-lean"] = timed(lean)
    if "ours-keep" in args.engines:
        keep = engines.beamsearch_engine(workload, inputs, dict(kwargs, remove_finished=False))
        row.timings["ours-keep"] = timed(keep)
    if "ours-generic" in args.engines:
        generic = engines.beamsearch_engine(workload, inputs, dict(kwargs, lean_step=False))
        row.timings["ours-generic"] = timed(generic)
    if "ours-shared" in args.engines and workload.lean_t5:
        shared = engines.beamsearch_engine(workload, inputs, dict(kwargs, share_encoder_state=True))
        row.timings["ours-shared"] = timed(shared)
    if "ours-compiled" in args.engines and workload.lean:
        compiled = engines.beamsearch_engine(workload, inputs, dict(kwargs, compile_step=True))
        row.timings["ours-compiled"] = timed(compiled)  # its warm-up run compiles
    if "ours-static" in args.engines and workload.lean:
        static = engines.beamsearch_engine(workload, inputs, dict(kwargs, compile_step="static"))
        row.timings["ours-static"] = timed(static)
    if "ours-graphs" in args.engines and workload.lean and not memory_only:
        # the default, no option given: on CUDA the graph path (graph_timing checks that it took it), on a CPU
        # cuda_graphs=True (the same step uncaptured; the default there is the eager path)
        asked = {} if args.device == "cuda" else {"cuda_graphs": True}
        run = engines.beamsearch_engine(workload, inputs, dict(kwargs, **asked))
        row.timings["ours-graphs"] = graphs.guarded(f"{workload.name} ours-graphs", lambda: graphs.graph_timing(
            run, args.repeats, args.device), args.notes)
    if "ours-int8" in args.engines and args.device == "cpu":
        if workload.int8_model is None:
            workload.int8_model = beamsearch.quantize_int8(workload.model)
        step = {"lean_step": "fast"} if workload.lean_t5 else {}  # the CLI's --int8 on T5 models
        int8 = engines.beamsearch_engine(workload, inputs, dict(kwargs, **step), model=workload.int8_model)
        row.timings["ours-int8"] = timed(int8)
    if "hf" in args.engines:
        row.timings["hf"] = timed(engines.hf_engine(workload, inputs, kwargs))
    for engine, model in ct2_models.items():
        if engine in args.engines and model is not None:
            run = engines.CT2.engine(workload, model, batch, beams)
            row.timings[engine] = timed(run, foreign_allocator=True)
    if "floor" in args.engines:
        floor = engines.floor_engine(workload, inputs, beams, row.steps)
        row.timings["floor"] = timed(floor)
    reference = row.timings["hf"].outputs if "hf" in row.timings else None
    for engine, timing in row.timings.items():
        if timing.outputs is None:  # the engine failed (guarded)
            continue
        row.tokens[engine] = batch * row.steps if engine == "floor" else sum(map(len, timing.outputs))
        if reference is not None and engine not in ("hf", "floor"):
            row.equal_hf[engine] = sum(a == b for a, b in zip(timing.outputs, reference, strict=True))
    if reference is not None and not memory_only:  # differences from transformers: at its own near ties or not
        names = ("ours", "ours-graphs") if args.table == "graphs" else ("ours",)
        graphs.guarded(f"{workload.name} near ties", lambda: graphs.count_ties(workload, inputs, kwargs, row, names),
                       args.notes)
    if exact_check and "ct2-fp32" in row.timings:
        ours_ct2 = engines.beamsearch_ct2_semantics(workload, inputs, beams)
        row.ct2_exact = sum(a == b for a, b in zip(ours_ct2, row.timings["ct2-fp32"].outputs, strict=True))
    return row


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _mem(timing: engines.Timing | None) -> str:
    if timing is None or timing.memory_mib is None:
        return "-"
    return f"{'~' if timing.memory_approximate else ''}{timing.memory_mib:.0f}"


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| model | search | batch | steps | HF s | ours s | CT2 fp32 s | CT2 int8 s | floor s | HF/ours |"
        " ours-lean s | HF/ours-lean | lean/ours | =HF ours-lean |"
        " keep/ours | generic/ours | shared/ours | compiled/ours | static/ours | CT2/ours | int8/ours | ours-int8 s |"
        " CT2 int8/ours-int8 | ours/floor | =HF ours | =HF CT2 | =HF int8 | =HF ours-int8 | CT2=ours[ct2] |"
        " peak MiB HF/ours/shared/CT2/int8/floor | ours tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|---:|---:|---:|"
        "---:|"
        "---|---:|",
    ]
    for r in rows:
        search = "greedy" if r.beams == 1 else f"beam {r.beams}"
        ours = r.seconds("ours")

        def eq(engine: str, r=r) -> str:
            if engine not in r.equal_hf:
                return "-"
            ties, bad = r.ties.get(engine), r.bad.get(engine)
            return f"{r.equal_hf[engine]}/{r.batch}" + (f" +{ties} ties" if ties else "") + (
                f" !{bad} not ties" if bad else "")

        memory = "/".join(_mem(r.timings.get(e)) for e in ("hf", "ours", "ours-shared", "ct2-fp32", "ct2-int8",
                                                            "floor"))
        exact = "-" if r.ct2_exact is None else f"{r.ct2_exact}/{r.batch}"
        lines.append(
            f"| {r.model} | {search} | {r.batch} | {r.steps} | {_fmt_s(r.seconds('hf'))} | {_fmt_s(ours)} |"
            f" {_fmt_s(r.seconds('ct2-fp32'))} | {_fmt_s(r.seconds('ct2-int8'))} | {_fmt_s(r.seconds('floor'))} |"
            f" {_ratio(r.seconds('hf'), ours)} | {_fmt_s(r.seconds('ours-lean'))} |"
            f" {_ratio(r.seconds('hf'), r.seconds('ours-lean'))} |"
            f" {_ratio(r.seconds('ours-lean'), ours)} |"
            f" {eq('ours-lean')} | {_ratio(r.seconds('ours-keep'), ours)} |"
            f" {_ratio(r.seconds('ours-generic'), ours)} | {_ratio(r.seconds('ours-shared'), ours)} |"
            f" {_ratio(r.seconds('ours-compiled'), ours)} | {_ratio(r.seconds('ours-static'), ours)} |"
            f" {_ratio(r.seconds('ct2-fp32'), ours)} |"
            f" {_ratio(r.seconds('ct2-int8'), ours)} | {_fmt_s(r.seconds('ours-int8'))} |"
            f" {_ratio(r.seconds('ct2-int8'), r.seconds('ours-int8'))} | {_ratio(ours, r.seconds('floor'))} |"
            f" {eq('ours')} | {eq('ct2-fp32')} | {eq('ct2-int8')} | {eq('ours-int8')} | {exact} | {memory} |"
            f" {r.tokens['ours'] / ours:.0f} |"
        )
    return lines


def sweep_table(points: list[tuple[int, Row]]) -> list[str]:
    lines = ["| new tokens | steps | " + " | ".join(f"{e} s" for e in ENGINES) + " |",
             "|---:|---:|" + "---:|" * len(ENGINES)]
    for length, r in points:
        lines.append(f"| {length} | {r.steps} | " + " | ".join(_fmt_s(r.seconds(e)) for e in ENGINES) + " |")
    return lines


def environment(args) -> str:
    import transformers

    try:
        import ctranslate2

        ct2_version = ctranslate2.__version__
    except Exception:  # noqa: BLE001
        ct2_version = "not available"
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} thread(s)"
    return (f"{device}; torch {torch.__version__}, transformers {transformers.__version__}, "
            f"ctranslate2 {ct2_version}, Python {platform.python_version()}; median of {args.repeats} after a "
            f"warm-up")


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    # The compiled engines compile one decode function (per lean step class) for every workload, row count and
    # cache size of this process; past torch.compile's default limit of 8 graphs it would run them uncompiled.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch.manual_seed(0)
    started = time.perf_counter()
    rows: list[Row] = []
    sweep: list[tuple[int, Row]] = []
    sweep_label = ""
    args.notes = notes = []  # engines' failures (suite_graphs.guarded) and CTranslate2's notes
    descriptions: list[str] = []
    make_table = graphs.table if args.table == "graphs" else table
    with tempfile.TemporaryDirectory(prefix="beamsearch-suite-") as tmp:
        work = Path(tmp)
        ct2 = engines.CT2(args.device, args.threads, work)
        wanted_ct2 = [e for e in ("ct2-fp32", "ct2-int8") if e in args.engines]
        cpu = args.device == "cpu"
        engines.ALLOCATOR.return_freed_memory(cpu)  # the CPU memory pass first (see suite_engines.py)
        workloads = []
        for name in args.models:
            log(f"[{time.perf_counter() - started:6.0f}s] building {name}")
            workload = models.build(name, work, max(args.batches), args.device)
            workload.model.to(args.device)
            descriptions.append(f"- {name}: {workload.description}")
            ct2_models = {e: ct2.load(workload, "float32" if e == "ct2-fp32" else "int8") for e in wanted_ct2}
            workloads.append((name, workload, ct2_models))
        cases = [(w, beams, batch) for w in workloads for beams in args.beams for batch in args.batches]
        memory = {}
        for (name, workload, ct2_models), beams, batch in cases if cpu else ():
            log(f"[{time.perf_counter() - started:6.0f}s] memory: {name} beams {beams} batch {batch}")
            row = run_case(workload, ct2_models, args, beams, batch, exact_check=False, memory_only=True)
            memory[name, beams, batch] = {engine: timing.memory_mib for engine, timing in row.timings.items()}
        engines.ALLOCATOR.return_freed_memory(False)
        for index, ((name, workload, ct2_models), beams, batch) in enumerate(cases):
            if args.time_budget and time.perf_counter() - started > args.time_budget:
                notes.append(f"stopped at the time budget ({args.time_budget:.0f} s): {index} of {len(cases)} cases")
                break
            log(f"[{time.perf_counter() - started:6.0f}s] {name} beams {beams} batch {batch}")
            row = graphs.guarded(f"{name} beams {beams} batch {batch}", lambda: run_case(
                workload, ct2_models, args, beams, batch), notes)  # noqa: B023 - called at once
            if not isinstance(row, Row):  # the case failed (its traceback printed): the others go on
                continue
            for engine, mib in memory.get((name, beams, batch), {}).items():
                row.timings[engine].memory_mib = mib
            rows.append(row)
            log("\n".join(make_table([row])[2:]))
        for name, workload, ct2_models in workloads:
            if name == "t5-small" and args.lengths:
                sweep_beams = 4 if 4 in args.beams else max(args.beams)
                sweep_batch = min(args.batches)
                sweep_label = f"t5-small, beam {sweep_beams}, batch {sweep_batch}: time vs length"
                for length in args.lengths:
                    log(f"[{time.perf_counter() - started:6.0f}s] sweep: {length} new tokens")
                    workload.max_new_tokens = length
                    sweep.append((length, run_case(workload, ct2_models, args, sweep_beams, sweep_batch,
                                                   exact_check=False)))
        del workloads, cases
        notes.extend(dict.fromkeys(ct2.notes))
    header = environment(args)
    report = [f"beamsearch benchmark suite: {header}", "", *descriptions, "", *make_table(rows)]
    if args.table == "graphs":
        report += ["", graphs.NOTE]
    elif sweep:
        report += ["", f"Time against output length ({sweep_label.split(':')[0]}):", "", *sweep_table(sweep)]
    if args.table == "full":
        report += ["", "HF/ours, CT2/ours, int8/ours: the other engine's time over ours (above 1: ours is faster);"
                   " keep/ours: ours without removing finished examples (remove_finished=False) over ours;"
                   " ours-lean s: ours with lean_step=True (the lean step: the model's own kernels); lean/ours: its"
                   " time over ours; generic/ours: ours with the generic model step (lean_step=False) over ours;"
                   " shared/ours: ours with share_encoder_state=True (one copy of the encoder state per example) over"
                   " ours; compiled/ours: ours with compile_step=True (torch.compile, after a compiling warm-up) over"
                   " ours; static/ours: ours with compile_step=\"static\" (the fixed-shape lean step, compiled) over"
                   " ours;"
                   " ours-int8 s: ours on beamsearch.quantize_int8(model) (T5: lean_step=\"fast\"); CT2 int8/ours-int8:"
                   " CTranslate2 int8's"
                   " time over it;"
                   " ours/floor: our time over the model floor's. =HF: best hypotheses equal to transformers' (for"
                   " ours, each difference classified by the parity grid's margin check: +n ties at transformers' own"
                   " near ties, !n not ties);"
                   " CT2=ours[ct2]: CTranslate2 fp32 equal to beamsearch under semantics=\"ct2\". Peak MiB: growth"
                   " (CPU: peak RSS in a memory pass before the timing, with freed memory returned to the system;"
                   " CUDA: max_memory_allocated over the timed runs, ~ = device memory used by CTranslate2's"
                   " allocator)."]
    if args.device == "cpu" and not Path("/proc/self/clear_refs").exists():
        report.append("Peak memory is not measured on this platform (needs Linux /proc).")
    report += [f"Note: {note}" for note in notes]
    if not args.no_plot and rows:
        report.append(plot(rows, sweep, sweep_label, args.plot, header, ENGINES))
    report.append(f"total {time.perf_counter() - started:.0f} s")
    text = "\n".join(report)
    print(text)
    if args.markdown_out:
        args.markdown_out.parent.mkdir(parents=True, exist_ok=True)
        args.markdown_out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
