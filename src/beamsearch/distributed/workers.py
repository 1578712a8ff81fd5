"""The workers of a distributed decode: callable classes that Ray Data runs in an actor pool (``map_batches``).

Each worker loads the model once, in its constructor, exactly as ``beamsearch decode`` does (the same flags, the
same :func:`~beamsearch.cli.decoding.prepare_decode`), and decodes a block of lines with the command line's own
:func:`~beamsearch.cli.decoding.decode_lines` (sorted by length, batched by ``--batch-size``) and
:func:`~beamsearch.cli.outputs.format_record`: a block's records are the bytes the single process writes for the
same lines. Batches come in and go out as dicts of NumPy arrays (Ray Data's default batch format); nothing here
imports Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..cli.inputs import Line
from ..cli.outputs import format_record


class Decoder:
    """The model and the options of one worker.

    Args:
        args: ``beamsearch decode``'s parsed flags (:func:`beamsearch.cli.flags.build_parser`).
        kill: test hook: ``(block, marker)`` makes the first attempt at that block end the worker's process
            halfway through the block (``os._exit``), the marker file recording that it happened.
    """

    def __init__(self, args: argparse.Namespace, kill: tuple[int, str] | None = None):
        import torch

        from ..cli.decoding import prepare_decode

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        self.m, self.options, self.limit = prepare_decode(args)
        self.args = args
        self.kill = kill

    def decode(self, lines: list[Line], block: int = -1) -> tuple[list[list[dict[str, Any]]], list[str]]:
        """Each line's hypotheses (``to_dicts`` records), in input order, and the warnings the lines gave."""
        from ..cli.decoding import decode_lines

        warned, long_inputs = len(self.m.warnings), len(self.m.long_inputs)
        a = self.args
        numbered = [Line(n, line.source, line.text) for n, line in enumerate(lines, 1)]  # unique keys, in order
        out = []
        for _, hyps in decode_lines(self.m, numbered, self.options, a.batch_size, a.batch_type == "tokens",
                                    self.limit, a.on_long):
            out.append(hyps)
            if self.kill is not None and block == self.kill[0] and len(out) == len(lines) // 2 + 1:
                self._die_once(Path(self.kill[1]))
        long = [f"input over the length limit ({a.on_long}): {source}" for source in self.m.long_inputs[long_inputs:]]
        return out, self.m.warnings[warned:] + long

    @staticmethod
    def _die_once(marker: Path) -> None:
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)


class BlockDecoder(Decoder):
    """Rows of whole blocks in, rows of their records out (``beamsearch decode --ray``).

    In: ``block`` (its number), ``first`` (the index of its first line), ``texts`` and ``sources`` (its lines and
    their ``file:line``). Out: ``block``, ``lines`` (how many), ``records`` (the block's output text),
    ``warnings`` (one string, a line per warning), ``seconds`` (the worker's time on the block) and ``cut`` (JSON:
    ``count``, the block's :class:`~beamsearch.cli.lengths.CutCount`, and ``names``, the limits' names, for the
    run's summary line).
    """

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..cli.lengths import CutCount, limit_names

        out: dict[str, list[Any]] = {"block": [], "lines": [], "records": [], "warnings": [], "seconds": [],
                                     "cut": []}
        for block, first, texts, sources in zip(batch["block"], batch["first"], batch["texts"], batch["sources"],
                                                strict=True):
            start = time.perf_counter()
            lines = [Line(int(first) + i, str(source), str(text))
                     for i, (text, source) in enumerate(zip(texts, sources, strict=True))]
            self.m.cut = CutCount()  # this block's outputs only
            hyps, warnings = self.decode(lines, int(block))
            names = limit_names(self.m.model.generation_config, self.options)
            out["cut"].append(json.dumps({"count": dataclasses.asdict(self.m.cut), "names": names}))
            out["block"].append(int(block))
            out["lines"].append(len(lines))
            pairs = zip(lines, hyps, strict=True)
            out["records"].append("".join(format_record(self.args.format, line, h) for line, h in pairs))
            out["warnings"].append("\n".join(warnings))
            out["seconds"].append(time.perf_counter() - start)
        return {"block": np.array(out["block"], dtype=np.int64), "lines": np.array(out["lines"], dtype=np.int64),
                "records": np.array(out["records"], dtype=object), "warnings": np.array(out["warnings"], dtype=object),
                "seconds": np.array(out["seconds"], dtype=np.float64), "cut": np.array(out["cut"], dtype=object)}


class LineDecoder(Decoder):
    """Rows of lines in, the same rows with their outputs out (:func:`beamsearch.ray.decode_dataset`).

    In: ``text``, and optionally ``index`` (the record number; 0 when absent) and ``source``. Out: the input's
    columns, plus ``prediction`` (the best hypothesis' text, empty for an empty line) and ``record`` (the line's
    output in ``format``, as ``beamsearch decode`` writes it).
    """

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = batch["text"]
        indices = batch.get("index", np.zeros(len(texts), dtype=np.int64))
        sources = batch.get("source", np.full(len(texts), "", dtype=object))
        lines = [Line(int(i), str(s), str(t)) for i, s, t in zip(indices, sources, texts, strict=True)]
        hyps, _ = self.decode(lines)
        records = [format_record(self.args.format, line, h) for line, h in zip(lines, hyps, strict=True)]
        best = [h[0]["text"] if h else "" for h in hyps]
        return dict(batch, prediction=np.array(best, dtype=object), record=np.array(records, dtype=object))
