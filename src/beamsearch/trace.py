"""The search trace: what beam search considered at each step, what it kept and why the rest was dropped.

``search(..., trace=True)`` (or a :class:`TraceLimits`) sets a :class:`TraceRecorder` on the strategy; beam search
calls it once per step (``BeamSearch.advance``), and only then: with the trace off the strategy holds None and the
search runs unchanged (same tensors, same host synchronisations). The recorder keeps small device tensors per step
(the C candidates of each example, ``[B, C]`` each) and reads them once, after the search, into a
:class:`SearchTrace`: per example, a tree of nodes (the start tokens, then each candidate under the beam it
extends), exported as JSON (schema ``beamsearch.trace/1``, documented in docs/seeing.md) and drawn by
:mod:`beamsearch.trace_html`.

Memory is bounded: at most ``max_steps`` steps are recorded (then ``truncated`` is set), each step keeps the C
candidates of the strategy (transformers: the top ``max(2, 1 + #eos) x K`` totals of each example) and the
``masked_per_beam`` most likely tokens of each beam that a processor masked; the JSON holds the first
``max_examples`` examples. Tokens outside the top C are not recorded: they were dropped as "outside the top C".

Legend: B batch (B' examples still decoded), K beams, C candidates per example, m masked tokens kept per beam.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from .results import FinishReason
from .strategies.base import MASK

SCHEMA = "beamsearch.trace/1"
FINISH_WORDS = {int(FinishReason.EOS): "EOS", int(FinishReason.MAX_LENGTH): "max length",
                int(FinishReason.STOP_CRITERION): "a stopping criterion", int(FinishReason.NONE): "unknown"}


@dataclasses.dataclass(frozen=True)
class TraceLimits:
    """Bounds on what a trace keeps: steps recorded, examples exported, masked tokens kept per beam and step."""

    max_steps: int = 256
    max_examples: int = 8
    masked_per_beam: int = 2

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_examples", "masked_per_beam"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "masked_per_beam" else 1):
                raise ValueError(f"TraceLimits.{name} must be an integer >= 1 (masked_per_beam >= 0), got {value!r}")


@dataclasses.dataclass
class SearchTrace:
    """A recorded search, JSON-ready: ``examples[e]["nodes"]`` is the tree of example e (see docs/seeing.md).

    Each node is a dict: ``id`` (its index), ``parent`` (None for the root), ``step`` (-1 for the root, which holds
    the start tokens in ``tokens``), ``token``, ``text`` (after :meth:`label`), ``log_prob``, ``total`` (the beam's
    total with it), ``score`` (the finished score, for finished nodes; these three are None where -inf or unknown),
    ``status`` (``root``, ``kept``, ``finished``, ``dropped``, ``masked``), ``reason`` (why, in words), ``best``
    (the rank in the returned n-best of the hypothesis it is on, or None).
    """

    num_beams: int
    candidates_per_step: int
    prompt_length: int
    limits: dict[str, int]
    truncated: bool
    examples: list[dict[str, Any]]
    schema: str = SCHEMA

    def node_count(self, example: int = 0) -> int:
        return len(self.examples[example]["nodes"])

    def label(self, text: Callable[[int], str]) -> SearchTrace:
        """Set each node's ``text`` from its token id (the root's from its start tokens); returns self."""
        for example in self.examples:
            for node in example["nodes"]:
                tokens = node["tokens"] if node["parent"] is None else [node["token"]]
                node["text"] = " ".join(text(t) for t in tokens)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> SearchTrace:
        data = json.loads(text)
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} trace (schema {data.get('schema')!r})")
        return cls(**data)


class TraceRecorder:
    """Kept by a beam search while tracing: :meth:`beam_step` once per step, :meth:`build` after the search."""

    def __init__(self, limits: TraceLimits, prompt_length: int, num_beams: int):
        self.limits, self.prompt_length, self.num_beams = limits, prompt_length, num_beams
        self.steps: list[dict[str, torch.Tensor]] = []
        self.truncated = False
        self.candidates = 0

    def beam_step(self, search: Any, logits: torch.Tensor, log_probs: torch.Tensor, candidates: Any,
                  parents: torch.Tensor, keep: torch.Tensor, pool_keep: torch.Tensor,
                  before: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Record one beam step (device tensors only, no host sync).

        Args:
            search: the :class:`~beamsearch.strategies.beam.BeamSearch`, after the step.
            logits: ``[N, V]`` raw logits; ``log_probs``: ``[N, V]`` after the processors.
            candidates: the step's C candidates (``Hypotheses [B', C]``); ``parents [B', C]`` their beams.
            keep: ``[B', K]`` the candidates that became the live beams; ``pool_keep``: ``[B', K]`` the finished pool
                kept from the old pool and the candidates (positions >= K are candidates).
            before: the live beams' totals ``[B', K]`` and whether they could still enter the pool ``[B', 1]``, before
                the step.
        """
        if len(self.steps) >= self.limits.max_steps:
            self.truncated = True
            return
        b, c = parents.shape
        k = self.num_beams
        live_scores, open_before = before
        self.candidates = c
        position = search.length - 1
        pool = search.finished
        from_candidates = (pool_keep >= k) & pool.finished  # [B', K]: finished candidates that entered the pool
        slot = torch.where(from_candidates, pool_keep - k, c)  # [B', K]; c: a spare column
        entered = torch.zeros(b, c + 1, dtype=torch.bool, device=parents.device).scatter_(1, slot, from_candidates)
        pool_score = torch.zeros(b, c + 1, device=parents.device).scatter_(1, slot, pool.scores.float())
        pool_reason = torch.zeros(b, c + 1, dtype=torch.long, device=parents.device).scatter_(1, slot, pool.reasons)
        kept_beam = torch.full((b, c), -1, dtype=torch.long, device=parents.device)
        kept_beam.scatter_(1, keep, torch.arange(k, device=parents.device).expand(b, k))
        open_after = search.can_improve[:, 0]
        if search.early_stopping is True:
            open_after = open_after & ~torch.all(pool.finished, dim=-1)
        record = dict(examples=search.example_ids.clone(), tokens=candidates.tokens[:, :, position],
                      parents=parents, log_probs=candidates.token_log_probs[:, :, position - self.prompt_length],
                      totals=candidates.scores.float(), hits=search.hits, kept_beam=kept_beam,
                      entered=entered[:, :c], pool_score=pool_score[:, :c], pool_reason=pool_reason[:, :c],
                      open_before=open_before[:, 0], open_after=open_after)
        m = min(self.limits.masked_per_beam, log_probs.shape[-1])
        if m:  # the most likely tokens of each beam that a processor masked (EOS before min_length, a repeat...)
            raw_values, raw_tokens = torch.topk(torch.log_softmax(logits.float(), dim=-1), m, dim=-1)  # [N, m]
            processed = torch.gather(log_probs, 1, raw_tokens)  # [N, m]
            alive = (live_scores > MASK / 2).reshape(-1, 1)  # [N, 1]
            record.update(masked_tokens=raw_tokens.reshape(b, k, m), masked_log_probs=raw_values.reshape(b, k, m),
                          masked=((processed <= MASK / 2) & alive).reshape(b, k, m))
        self.steps.append(record)

    def build(self, result: Any) -> SearchTrace:
        """The trace of the finished search (one host transfer of everything recorded)."""
        steps = [{name: value.cpu().tolist() for name, value in step.items()} for step in self.steps]
        count = min(result.sequences.shape[0], self.limits.max_examples)
        prompts = result.sequences[:count, 0, : self.prompt_length].tolist()
        returned = [[result.sequences[e, j, self.prompt_length : int(result.lengths[e, j])].tolist()
                     for j in range(result.sequences.shape[1])] for e in range(count)]
        examples = [_example_tree(e, prompts[e], steps, returned[e]) for e in range(count)]
        limits = dataclasses.asdict(self.limits)
        return SearchTrace(self.num_beams, self.candidates, self.prompt_length, limits, self.truncated, examples)


def _example_tree(example: int, prompt: list[int], steps: list[dict[str, Any]], returned: list[list[int]]) -> dict:
    """Example ``example``'s nodes from the per-step records (host lists)."""
    nodes: list[dict[str, Any]] = [dict(id=0, parent=None, step=-1, token=None, tokens=prompt, text=None,
                                        log_prob=0.0, total=0.0, score=None, status="root",
                                        reason="the start tokens", best=None)]
    beam_node: list[int] = []  # the node of each live beam
    for step, record in enumerate(steps):
        if example not in record["examples"]:
            continue  # the example left the batch: it is done
        row = record["examples"].index(example)
        if not record["open_before"][row]:
            continue  # nothing of this step could change the example's result
        if not beam_node:
            beam_node = [0] * len(record["kept_beam"][row])
        k, closed, previous = len(beam_node), not record["open_after"][row], list(beam_node)
        for beam, masked in enumerate(record["masked"][row] if "masked" in record else []):
            for j, is_masked in enumerate(masked):
                if is_masked and (step > 0 or beam == 0):  # at the first step the K beams are one
                    nodes.append(dict(id=len(nodes), parent=previous[beam], step=step,
                                      token=record["masked_tokens"][row][beam][j], text=None,
                                      log_prob=record["masked_log_probs"][row][beam][j], total=None, score=None,
                                      status="masked", reason="masked by a processor (e.g. EOS before min_length, a "
                                      "repeated n-gram, a banned token)", best=None))
        for c, token in enumerate(record["tokens"][row]):
            parent = previous[record["parents"][row][c]] if step > 0 else 0
            status, reason = _status(record, row, c, k, closed)
            node = dict(id=len(nodes), parent=parent, step=step, token=token, text=None,
                        log_prob=record["log_probs"][row][c], total=record["totals"][row][c],
                        score=record["pool_score"][row][c] if status == "finished" else None,
                        status=status, reason=reason, best=None)
            nodes.append(node)
            if record["kept_beam"][row][c] >= 0:
                beam_node[record["kept_beam"][row][c]] = node["id"]
    _mark_best(nodes, returned)
    for node in nodes:  # strict JSON has no infinities: a masked (-inf) number is null
        for name in ("log_prob", "total", "score"):
            if node[name] is not None and not math.isfinite(node[name]):
                node[name] = None
    return dict(example=example, prompt=prompt, nodes=nodes)


def _status(record: dict[str, Any], row: int, c: int, k: int, closed: bool) -> tuple[str, str]:
    """A candidate's status and why (transformers' rules: only finished candidates among the first K may enter the
    pool; the K best others go on)."""
    if record["entered"][row][c]:
        why = FINISH_WORDS.get(record["pool_reason"][row][c], "a stop")
        return "finished", f"finished ({why}), entered the finished pool with score {record['pool_score'][row][c]:.4g}"
    if record["hits"][row][c]:
        if c >= k:
            return "dropped", "finished, but ranked below the first K candidates (only those may enter the pool)"
        return "dropped", "finished, but the finished pool holds K better hypotheses (or the example is done)"
    if record["kept_beam"][row][c] >= 0:
        if closed:
            return "dropped", "pruned: example done (no live beam can beat the finished pool any more)"
        return "kept", f"kept as live beam {record['kept_beam'][row][c]}"
    count = len(record["tokens"][row])
    return "dropped", f"below the beam: candidate {c + 1} of {count}, after the K best that went on"


def _mark_best(nodes: list[dict[str, Any]], returned: list[list[int]]) -> None:
    """Mark the nodes on each returned hypothesis' path with its rank (the best rank where paths share nodes)."""
    paths: dict[tuple[int, ...], int] = {}
    for node in nodes:
        if node["status"] == "finished":
            path, at = [], node
            while at["parent"] is not None:
                path.append(at["token"])
                at = nodes[at["parent"]]
            paths.setdefault(tuple(reversed(path)), node["id"])
    for rank, tokens in enumerate(returned):
        at = paths.get(tuple(tokens))
        while at is not None:
            if nodes[at]["best"] is None or nodes[at]["best"] > rank:
                nodes[at]["best"] = rank
            at = nodes[at]["parent"]


def attach(strategy: Any, limits: TraceLimits, prompt_length: int) -> TraceRecorder:
    """Set a recorder on ``strategy`` (beam search only)."""
    from .strategies.beam import BeamSearch

    if not isinstance(strategy, BeamSearch):
        raise ValueError("trace=True records beam search and beam sampling (num_beams > 1, semantics 'hf'), not "
                         f"{type(strategy).__name__}")
    strategy.recorder = TraceRecorder(limits, prompt_length, strategy.rows_per_example)
    return strategy.recorder
