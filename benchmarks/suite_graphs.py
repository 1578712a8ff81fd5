"""The suite's CUDA-graph comparison: transformers against ours eager and ours with ``cuda_graphs=True``.

- :func:`graph_timing`: the graph engine's first call (on CUDA the default, no option given: it must keep a
  captured step, else the row reports that the default did not take the graph path) is timed and measured apart
  (cold: capture included; its kept step released before, so that peak memory counts the kept cache and the graph's
  memory pool), then the median of the repeats (warm: the kept graph replayed);
- :func:`count_ties`: where an engine's best hypothesis differs from transformers', the difference is checked with
  the parity grid's margin check (``tests/parity_grid.py``: transformers' own top-2 gap at the step where greedy
  outputs part, or the smallest gap among the best C + 1 beam candidates up to where the n-bests part, and between
  finished scores), at the tolerance of the model's dtype (``tests/numerics.py``): a near tie, or not;
- :func:`half_precision_rule`: in bfloat16 and float16, where a best hypothesis differs from transformers', both
  hypotheses are scored by one teacher-forced forward of the same model in float32; ours must not be worse than
  transformers' by more than :data:`RULE_NATS` per generated token (issue 39's rule; float32 keeps the margin check);
- :func:`table`: the Markdown table (times, ratios, tokens/s, equal-to-transformers counts with near ties, peak
  memory; cold times of the graph engine).

Legend: B examples, K beams, V vocabulary.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import suite_engines as engines  # noqa: E402
from numerics import near_tie, smallest_gap, top2_margin  # noqa: E402
from parity_grid import _parting_step, _Recorder, _running_scores, _same_rows  # noqa: E402

import beamsearch  # noqa: E402
from beamsearch.graphs.reuse import kept_count, release  # noqa: E402

ENGINES = ("hf", "ours", "ours-graphs")


def graph_timing(run, repeats: int, device: str) -> engines.Timing:
    """The cold first call (time and peak memory, kept steps released first), then the median of ``repeats``
    warm calls. On a CPU (nothing captured or kept) the suite's own timing."""
    if device != "cuda":
        return engines.timed(run, repeats, device)
    release()
    with engines.PeakMemory(device) as memory:
        start = time.perf_counter()
        outputs = run()
        torch.cuda.synchronize()
        cold = time.perf_counter() - start
    if kept_count() == 0:  # the call ran the eager path: the default did not take the graph path
        raise RuntimeError("the call kept no captured step: it did not run the graph path")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return engines.Timing(statistics.median(times), outputs, memory.mib, all_seconds=times, cold_seconds=cold)


def guarded(name: str, make, notes: list[str]):
    """``make()``, or where it raises a Timing holding the error (its traceback printed, a note named ``name``), so
    that the other engines and cases go on."""
    try:
        return make()
    except Exception as error:  # noqa: BLE001 - reported, the suite goes on
        traceback.print_exc()
        notes.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        return engines.Timing(error=f"{type(error).__name__}: {error}")


def _host(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _recorded_reference(model, inputs: dict, kwargs: dict):
    """transformers' output (on the host) and its recorded steps: ``[(input_ids [N, t], scores [N, V])]``."""
    recorder = _Recorder()

    def on_host(input_ids, scores):
        recorder(input_ids.cpu(), scores.cpu())
        return scores

    from transformers import LogitsProcessorList

    with torch.no_grad():
        out = model.generate(**inputs, **kwargs, return_dict_in_generate=True, output_scores=True,
                             logits_processor=LogitsProcessorList([on_host]))
    scores = _host(getattr(out, "sequences_scores", None))  # beam search only
    return types.SimpleNamespace(sequences=out.sequences.cpu(), sequences_scores=scores), recorder.steps


def _margins(steps, expected, actual, beams: int, kwargs: dict) -> list[tuple[float, float]]:
    """``(margin, magnitude)`` of transformers at each example whose best hypotheses differ (the parity grid's
    rules, one example at a time)."""
    start = steps[0][0].shape[1]
    width = max(expected.sequences.shape[1], actual.sequences.shape[1])
    want = torch.nn.functional.pad(expected.sequences, (0, width - expected.sequences.shape[1]), value=-7)
    got = torch.nn.functional.pad(actual.sequences, (0, width - actual.sequences.shape[1]), value=-7)
    differing = (~_same_rows(want, got)).nonzero().flatten().tolist()
    if beams == 1:
        out = []
        for row in differing:
            step = int((want[row] != got[row]).nonzero()[0]) - start
            if not 0 <= step < len(steps):  # not where transformers chose a token: not a near tie
                out.append((float("inf"), 0.0))
                continue
            scores = steps[step][1][row : row + 1]
            out.append((float(top2_margin(scores)[0]), float(scores.max())))
        return out
    running = _running_scores(steps, beams)
    candidates = 2 * beams  # one end token
    out = []
    for example in differing:
        margin, magnitude = float("inf"), 0.0
        last = _parting_step(want[example : example + 1], got[example : example + 1], start)
        for step in range(min(last + 1, len(steps))):
            scores = steps[step][1][example * beams : (example + 1) * beams].double()  # [K, V]: this example's
            totals = (running[step][example][:, None] + scores).flatten()
            margin = min(margin, smallest_gap(totals, candidates + 1))
            magnitude = max(magnitude, float(totals.max().abs()))
        out.append((margin, magnitude))
    return out


RULE_NATS = 0.01  # the most a differing best hypothesis of ours may lose per token, scored in float32


@torch.no_grad()
def teacher_forced(model, inputs: dict, sequences: torch.Tensor) -> torch.Tensor:
    """FloatTensor ``[B]``: each row's generated tokens' mean log-probability under ``model`` (float32), teacher
    forced in one forward; a row's generated tokens run to its first end token (included) or to the end, after the
    prompt (decoder-only) or the decoder start token (encoder-decoder)."""
    config = model.config
    device = next(model.parameters()).device
    sequences = sequences.to(device)
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else (config.eos_token_id or [-1])[0]
    if config.is_encoder_decoder:
        start, mask = 1, None
        logits = model(**inputs, decoder_input_ids=sequences[:, :-1]).logits
    else:
        start = inputs["input_ids"].shape[1]
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(sequences[:, start:])], dim=1)
        positions = (mask.long().cumsum(dim=1) - 1).masked_fill(mask == 0, 1)  # as generate derives them
        logits = model(input_ids=sequences[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1]).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, sequences[:, 1:, None])[..., 0]  # [B, L-1]
    generated = torch.zeros_like(sequences, dtype=torch.bool)
    generated[:, start:] = True
    ended = (sequences == eos) & generated
    after_end = (ended.long().cumsum(dim=1) - ended.long()) > 0  # positions past the first end token
    counted = (generated & ~after_end)[:, 1:]
    return (logprobs * counted).sum(dim=1) / counted.sum(dim=1).clamp(min=1)


def half_precision_rule(model, inputs: dict, expected: torch.Tensor, actual: torch.Tensor) -> tuple[int, float]:
    """Issue 39's rule for a bfloat16 / float16 model: ``(rows whose best hypothesis differs from transformers',
    the largest deficit per token of ours against transformers' in float32 among them)`` (0.0 where none differ; a
    negative deficit: ours scores better). The float32 scoring model is a cast copy, for scoring only."""
    width = max(expected.shape[1], actual.shape[1])
    fill = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    want = torch.nn.functional.pad(expected, (0, width - expected.shape[1]), value=fill)
    got = torch.nn.functional.pad(actual, (0, width - actual.shape[1]), value=fill)
    differing = (~_same_rows(want, got)).nonzero().flatten()
    if differing.numel() == 0:
        return 0, 0.0
    scorer = copy.deepcopy(model).float()
    chosen = {k: (v.index_select(0, differing.to(v.device)) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}
    deficit = teacher_forced(scorer, chosen, want[differing]) - teacher_forced(scorer, chosen, got[differing])
    return int(differing.numel()), float(deficit.max())


def count_ties(workload, inputs: dict, kwargs: dict, row, names=("ours", "ours-graphs")) -> None:
    """For each engine of ``names`` whose best hypotheses differ from transformers' somewhere: how many of those
    examples are near ties of transformers' own (``row.ties``) and how many are not (``row.bad``)."""
    checked = [n for n in names if n in row.equal_hf and row.equal_hf[n] < row.batch]
    if not checked:
        return
    model, dtype = workload.model, next(workload.model.parameters()).dtype
    expected, steps = _recorded_reference(model, inputs, kwargs)
    for name in checked:
        ours = {"cuda_graphs": name == "ours-graphs"}
        with torch.no_grad():
            sequences = beamsearch.generate(model, **inputs, **kwargs, **ours).cpu()
        margins = _margins(steps, expected, types.SimpleNamespace(sequences=sequences), kwargs["num_beams"], kwargs)
        ties = sum(near_tie(margin, magnitude, dtype) for margin, magnitude in margins)
        row.ties[name], row.bad[name] = ties, len(margins) - ties
        if dtype in (torch.bfloat16, torch.float16) and kwargs.get("num_return_sequences", 1) == 1:
            row.rule[name] = half_precision_rule(model, inputs, expected.sequences, sequences)
    if any(name in row.rule for name in checked):
        row.rule[CONTROL] = control_rule(model, inputs, kwargs, expected.sequences)


CONTROL = "hf-static"  # the rule's control in row.rule: transformers' static cache against its dynamic one


def control_rule(model, inputs: dict, kwargs: dict, expected: torch.Tensor) -> tuple[int, float] | None:
    """The half-precision rule's measure of transformers against itself: its ``generate`` with
    ``cache_implementation="static"`` (its own fixed-shape cache, the analogue of the graph path: the same model, the
    sums in another order) against its default, or None where the static cache is refused. It says how large the
    measure is when nothing is wrong: on random bfloat16 models, larger than the rule's 0.01 (``README.md`` of
    ``benchmarks/gpu_results/2026-11-28-h200``)."""
    try:
        with torch.no_grad():
            static = model.generate(**inputs, **kwargs, cache_implementation="static").cpu()
    except Exception:  # noqa: BLE001 - a model or release without a static cache: no control, said in the table
        traceback.print_exc()
        return None
    return half_precision_rule(model, inputs, expected, static)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _equal(row, name: str) -> str:
    if row.timings.get(name) is not None and row.timings[name].error:
        return "ERR"
    if name not in row.equal_hf:
        return "-"
    text = f"{row.equal_hf[name]}/{row.batch}"
    if row.ties.get(name):
        text += f" +{row.ties[name]} ties"
    if row.bad.get(name):
        text += f" !{row.bad[name]} not ties"
    if name in row.rule:  # bfloat16 / float16: the float32 score rule
        rows, deficit = row.rule[name]
        text += f"; rule {'pass' if deficit <= RULE_NATS else 'FAIL'} ({rows} differ, worst {deficit:+.4f} nats/token)"
        if name == "ours-graphs" and CONTROL in row.rule:
            control = row.rule[CONTROL]
            text += ("; control: none" if control is None else
                     f"; control: transformers' static cache {control[0]} differ, worst {control[1]:+.4f}")
    return text


def table(rows: list) -> list[str]:
    lines = ["| model | search | batch | steps | HF s | ours s | graphs s | graphs cold s | HF/ours | HF/graphs |"
             " ours/graphs | HF tok/s | ours tok/s | graphs tok/s | =HF ours | =HF graphs |"
             " peak MiB HF/ours/graphs |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        seconds = {name: r.seconds(name) for name in ENGINES}
        graphs = r.timings.get("ours-graphs")

        def rate(name: str, r=r, seconds=seconds) -> str:
            return "-" if not seconds[name] or name not in r.tokens else f"{r.tokens[name] / seconds[name]:.0f}"

        memory = "/".join("-" if r.timings.get(n) is None or r.timings[n].memory_mib is None
                          else f"{r.timings[n].memory_mib:.0f}" for n in ENGINES)
        lines.append(
            f"| {r.model} | {'greedy' if r.beams == 1 else f'beam {r.beams}'} | {r.batch} | {r.steps} |"
            f" {_fmt(seconds['hf'])} | {_fmt(seconds['ours'])} | {_fmt(seconds['ours-graphs'])} |"
            f" {_fmt(None if graphs is None else graphs.cold_seconds)} | {_ratio(seconds['hf'], seconds['ours'])} |"
            f" {_ratio(seconds['hf'], seconds['ours-graphs'])} | {_ratio(seconds['ours'], seconds['ours-graphs'])} |"
            f" {rate('hf')} | {rate('ours')} | {rate('ours-graphs')} | {_equal(r, 'ours')} |"
            f" {_equal(r, 'ours-graphs')} | {memory} |")
    return lines


NOTE = ("HF/ours, HF/graphs: transformers' time over ours eager (cuda_graphs=False) and over ours by default, which on "
        "CUDA is the graph path (checked per row; on a CPU: cuda_graphs=True, uncaptured) (above 1: ours is faster); "
        "ours/graphs: the graphs' speed-up over our eager path. graphs s: the median of warm calls (the "
        "kept graph replayed); graphs cold s: the first call of that shape (warm-up steps and capture included). "
        "=HF: best hypotheses equal to transformers'; +n ties: differences at transformers' own near ties (the "
        "parity grid's margin check at the model dtype's tolerance); !n not ties: differences that are not. Peak "
        "MiB: torch.cuda.max_memory_allocated growth over the timed calls (graphs: over the cold call, with the "
        "kept cache and the graph's memory pool). rule (bfloat16 / float16 rows): where a best hypothesis differs from "
        "transformers', both are scored by one teacher-forced forward in float32, and ours may lose at most 0.01 "
        "nats per generated token (worst: the largest loss among those rows; negative: ours scores better); control: "
        "the same measure of transformers' generate with its static cache against its default, what the rule "
        "measures when nothing is wrong.")
