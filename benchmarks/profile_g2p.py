"""Where the time of one G2P decode goes: model step, search step, state reorder, and the rest (issue 21's profile).

Decodes the first ``--words`` words of the CMUdict test split with the embedded model through
``beamsearch.adapters.hf.search_model`` (the CLI's path), sorted by length and batched as the CLI does, once greedy
and once at ``--beams``. Every model step, strategy step (processors, selection, stopping: ``strategy.advance``),
state reorder and ``strategy.is_done`` (the step's host sync) is timed with ``perf_counter``; what is left of the
wall time is the adapter's setup (tokenizer padding, encoder, state creation) and the loop's own Python. Then
``torch.profiler`` runs one batch of each and lists the operators by self CPU time, so that the model's share can be
split into its kernels and the dispatch around them.

    .venv/bin/python benchmarks/profile_g2p.py [--words 512] [--batch 64] [--beams 5] [--threads 1] [--lean]
        [--unsorted]

The default step is the fast T5 step (issue 29); ``--lean`` profiles the lean step (``lean_step=True``) instead,
``--unsorted`` takes the batches in file order.

Prints two tables (markdown). Nothing is written. Timings are of this machine and this moment; run it in one
process with nothing else busy, and compare only runs made the same way.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
G2P_DIR = ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict"
WORDS = ROOT / "src" / "beamsearch" / "data" / "cmudict" / "test.tsv"


class Timers:
    """Seconds and calls per part, filled by :func:`instrumented_decode`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return wrapper


def instrumented(timers: Timers):
    """A replacement for ``engine.decode`` that times the model step, the strategy's advance and is_done, and the
    state reorder, then runs the real loop."""
    from beamsearch import loop

    real_decode, real_reorder = loop.decode, loop.reorder_state

    def decode(step, state, strategy, batch_size):
        strategy.advance = timers.timed("search step (advance)", strategy.advance)
        strategy.is_done = timers.timed("host sync (is_done)", strategy.is_done)
        timed_step = timers.timed("model step", step)
        timed_step.fresh_logits = getattr(step, "fresh_logits", False)
        loop.reorder_state = timers.timed("state reorder", real_reorder)
        try:
            return real_decode(timed_step, state, strategy, batch_size)
        finally:
            loop.reorder_state = real_reorder

    return decode


MARKS = ("model step", "search step", "state reorder")


def marked(real_decode):
    """``engine.decode`` with the model step, the strategy's advance and the state reorder each under a
    ``torch.profiler.record_function`` range, for :func:`ops_per_call`."""
    from beamsearch import loop

    def within(name: str, fn):
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return wrapper

    def decode(step, state, strategy, batch_size):
        strategy.advance = within("search step", strategy.advance)
        step_in_range = within("model step", step)
        step_in_range.fresh_logits = getattr(step, "fresh_logits", False)
        real_reorder = loop.reorder_state
        loop.reorder_state = within("state reorder", real_reorder)
        try:
            return real_decode(step_in_range, state, strategy, batch_size)
        finally:
            loop.reorder_state = real_reorder

    return decode


def ops_per_call(prof) -> dict[str, float]:
    """Top-level operator calls (ATen and the oneDNN / quantized ops; those an operator calls are not counted) per
    call of each marked range: the dispatches a step makes."""
    events = prof.events()
    calls = {name: sum(e.name == name for e in events) for name in MARKS}
    ops = dict.fromkeys(MARKS, 0)
    kinds = ("aten::", "mkldnn::", "quantized::")
    for event in events:
        parent = event.cpu_parent
        if not event.name.startswith(kinds) or (parent is not None and parent.name.startswith(kinds)):
            continue
        while parent is not None and parent.name not in ops:
            parent = parent.cpu_parent
        if parent is not None:
            ops[parent.name] += 1
    return {name: ops[name] / calls[name] for name in MARKS if calls[name]}


def run(model, tokenizer, words: list[str], batch: int, beams: int, **options) -> float:
    from beamsearch.adapters.hf import search_model

    start = time.perf_counter()
    for i in range(0, len(words), batch):
        inputs = tokenizer(words[i : i + batch], return_tensors="pt", padding=True)
        search_model(model, **inputs, num_beams=beams, **options)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--beams", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="operators listed per search")
    ap.add_argument("--lean", action="store_true", help="profile the lean T5 step (lean_step=True)")
    ap.add_argument("--fast", action="store_true", help="lean_step='fast' (the default step on this model already)")
    ap.add_argument("--unsorted", action="store_true", help="batches in file order (the CLI sorts by length)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from beamsearch import engine

    model = AutoModelForSeq2SeqLM.from_pretrained(G2P_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(G2P_DIR)
    words = [line.split("\t")[0].lower() for line in WORDS.read_text(encoding="utf-8").splitlines() if line]
    words = words[: args.words]  # lowercased, as the CLI feeds the embedded model
    if not args.unsorted:
        words.sort(key=len)  # batched by length, as the CLI batches its inputs (less padding)
    print(f"{len(words)} CMUdict test words, batches of {args.batch}, {args.threads} thread(s), torch "
          f"{torch.__version__}\n")
    print("| search | wall s | model step | search step (advance) | state reorder | host sync (is_done) | rest | "
          "steps | per step ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    options = {"lean_step": True} if args.lean else {"lean_step": "fast"} if args.fast else {}
    real_decode = engine.decode
    with torch.no_grad():
        for beams in (1, args.beams):
            run(model, tokenizer, words[: args.batch], args.batch, beams, **options)  # warm-up
            timers = Timers()
            engine.decode = instrumented(timers)
            try:
                wall = run(model, tokenizer, words, args.batch, beams, **options)
            finally:
                engine.decode = real_decode
            parts = ("model step", "search step (advance)", "state reorder", "host sync (is_done)")
            rest = wall - sum(timers.seconds[p] for p in parts)
            steps = timers.calls["model step"]
            cells = " | ".join(f"{timers.seconds[p]:.2f} s ({100 * timers.seconds[p] / wall:.0f}%)" for p in parts)
            name = "greedy" if beams == 1 else f"beam {beams}"
            print(f"| {name} | {wall:.2f} | {cells} | {rest:.2f} s ({100 * rest / wall:.0f}%) | {steps} | "
                  f"{1000 * wall / max(steps, 1):.2f} |")
        from beamsearch.adapters.hf import search_model

        for beams in (1, args.beams):
            inputs = tokenizer(words[: args.batch], return_tensors="pt", padding=True)
            engine.decode = marked(real_decode)
            try:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    search_model(model, **inputs, num_beams=beams, **options)
            finally:
                engine.decode = real_decode
            name = "greedy" if beams == 1 else f"beam {beams}"
            counts = " ".join(f"{part} {ops:.0f}" for part, ops in ops_per_call(prof).items())
            print(f"\n{name}, one batch of {args.batch}: operator calls per step ({counts}); operators by self CPU "
                  "time\n")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                              max_name_column_width=40)
            print(table)


if __name__ == "__main__":
    main()
