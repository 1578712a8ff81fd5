"""The search tree of a :class:`~beamsearch.trace.SearchTrace` as one self-contained HTML page (inline SVG, CSS and
JavaScript; no network).

Nodes are drawn in columns by step, each under the beam it extends: kept (live beams), finished (entered the
finished pool), dropped and masked candidates in their own colours, the returned n-best's paths highlighted (the
best in gold). Hovering a node shows its token, log-prob, total, score and why it was kept or dropped; clicking it
folds or unfolds its branch. Every node is an SVG element with ``data-node-id``; once drawn, the page writes their
count into ``<body data-drawn-nodes>`` (the browser test reads it).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from .trace import SearchTrace

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 18px; margin: 0 0 4px; }
.summary { margin: 0 0 8px; color: #444; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 11px; height: 11px; border-radius: 50%; margin-right: 4px;
  vertical-align: -1px; }
svg { display: block; margin-top: 8px; }
.edge { fill: none; stroke: #c8c8c8; stroke-width: 1.2; }
.edge.best { stroke: #e6a700; stroke-width: 3; }
.edge.nbest { stroke: #f1cf6b; stroke-width: 2; }
.node circle { stroke: #fff; stroke-width: 1.5; cursor: pointer; }
.node text { font-size: 12px; pointer-events: none; }
.node.best circle { stroke: #e6a700; stroke-width: 3; }
.node.nbest circle { stroke: #f1cf6b; stroke-width: 2.5; }
.node.folded circle { stroke: #333; stroke-dasharray: 2 2; stroke-width: 2; }
.hidden { display: none; }
"""

COLOURS = {"root": "#222222", "kept": "#2b7bb9", "finished": "#2e9d4f", "dropped": "#b8b8b8", "masked": "#e08a2c"}

SCRIPT = """
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const trace = JSON.parse(document.getElementById("trace-data").textContent);
  const example = trace.examples[Number(document.body.dataset.example)];
  const nodes = example.nodes, colours = JSON.parse(document.getElementById("colours").textContent);
  const children = nodes.map(() => []);
  nodes.forEach(n => { if (n.parent !== null) children[n.parent].push(n.id); });
  // columns by step; within a column, nodes in the order of their parents, then in the search's order
  const order = new Array(nodes.length), rows = new Array(nodes.length), columns = new Map();
  nodes.forEach(n => { const s = n.step + 1; if (!columns.has(s)) columns.set(s, []); columns.get(s).push(n); });
  let tallest = 0;
  [...columns.keys()].sort((a, b) => a - b).forEach(s => {
    const column = columns.get(s);
    column.sort((a, b) => (a.parent === null ? 0 : order[a.parent]) - (b.parent === null ? 0 : order[b.parent])
                          || a.id - b.id);
    column.forEach((n, i) => { order[n.id] = i; rows[n.id] = i; });
    tallest = Math.max(tallest, column.length);
  });
  const dx = 96, dy = 26, left = 40, top = 24;
  const x = n => left + (n.step + 1) * dx, y = n => top + rows[n.id] * dy;
  const svg = document.getElementById("tree");
  svg.setAttribute("width", left * 2 + columns.size * dx);
  svg.setAttribute("height", top * 2 + tallest * dy);
  const edges = new Array(nodes.length), drawn = new Array(nodes.length);
  const make = (name, attributes) => {
    const element = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
    return element;
  };
  const rank = n => n.best === null ? "" : n.best === 0 ? " best" : " nbest";
  nodes.forEach(n => {
    if (n.parent === null) return;
    const p = nodes[n.parent], mx = (x(p) + x(n)) / 2;
    edges[n.id] = make("path", {class: "edge" + rank(n),
      d: `M${x(p)},${y(p)} C${mx},${y(p)} ${mx},${y(n)} ${x(n)},${y(n)}`});
    svg.appendChild(edges[n.id]);
  });
  const number = v => v === null || v === undefined ? "-" : Number(v).toFixed(4);
  nodes.forEach(n => {
    const g = make("g", {class: "node " + n.status + rank(n), "data-node-id": n.id,
                         transform: `translate(${x(n)},${y(n)})`});
    g.appendChild(make("circle", {r: n.status === "root" ? 7 : 6, fill: colours[n.status]}));
    const label = make("text", {x: 9, y: 4});
    label.textContent = n.text !== null ? n.text : (n.token === null ? "start" : String(n.token));
    g.appendChild(label);
    const title = make("title", {});
    const score = n.score !== null ? `, score ${number(n.score)}` : "";
    title.textContent = [`${n.text !== null ? n.text : n.token} (token ${n.token}), step ${n.step}`,
      `log-prob ${number(n.log_prob)}, total ${number(n.total)}${score}`, `${n.status}: ${n.reason}`]
      .concat(n.best !== null ? [`on the returned hypothesis #${n.best + 1}`] : []).join("\\n");
    g.appendChild(title);
    g.addEventListener("click", () => fold(n.id));
    svg.appendChild(g);
    drawn[n.id] = g;
  });
  const folded = new Set();
  function fold(id) {
    if (!children[id].length) return;
    const hide = !folded.has(id);
    if (hide) folded.add(id); else folded.delete(id);
    drawn[id].classList.toggle("folded", hide);
    const walk = c => {
      const hidden = hide || [...ancestors(c)].some(a => folded.has(a));
      drawn[c].classList.toggle("hidden", hidden);
      edges[c].classList.toggle("hidden", hidden);
      children[c].forEach(walk);
    };
    children[id].forEach(walk);
  }
  function* ancestors(id) {
    for (let a = nodes[id].parent; a !== null; a = nodes[a].parent) yield a;
  }
  document.getElementById("expand").addEventListener("click", () => [...folded].forEach(fold));
  document.getElementById("fold-dropped").addEventListener("click", () => nodes.forEach(n => {
    if (n.status === "dropped" && children[n.id].length && !folded.has(n.id)) fold(n.id);
  }));
  document.body.dataset.drawnNodes = svg.querySelectorAll("[data-node-id]").length;
})();
"""


def render(trace: SearchTrace, example: int = 0, title: str | None = None) -> str:
    """The page for example ``example`` of ``trace`` (label it first with :meth:`SearchTrace.label` for text)."""
    if not 0 <= example < len(trace.examples):
        raise ValueError(f"the trace holds {len(trace.examples)} example(s); example {example} is not one of them")
    nodes = trace.examples[example]["nodes"]
    best = [n for n in nodes if n["best"] == 0 and n["status"] == "finished"]
    best_text = _path_text(nodes, best[0]) if best else "(not in the trace)"
    start = nodes[0]["text"] if nodes[0].get("text") is not None else " ".join(map(str, nodes[0]["tokens"]))
    heading = title or f"Search tree: {start}"
    data = json.dumps(trace.to_dict()).replace("</", "<\\/")
    steps = max(n["step"] for n in nodes) + 1
    legend = "".join(f'<span><i style="background:{c}"></i>{name}</span>' for name, c in COLOURS.items())
    summary = (f"{trace.num_beams} beams, {steps} steps, {len(nodes)} nodes"
               f"{' (truncated at ' + str(trace.limits['max_steps']) + ' steps)' if trace.truncated else ''}; "
               f"best: <b>{html.escape(best_text)}</b> (gold). Hover a node for its scores and why it was kept or "
               "dropped; click it to fold its branch.")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(heading)}</title>
<style>{STYLE}</style></head>
<body data-example="{example}">
<h1>{html.escape(heading)}</h1>
<p class="summary">{summary}</p>
<div class="legend">{legend}<span><i style="background:#fff;border:3px solid #e6a700"></i>returned best</span>
<button id="expand">unfold all</button> <button id="fold-dropped">fold dropped branches</button></div>
<svg id="tree" xmlns="http://www.w3.org/2000/svg"></svg>
<script type="application/json" id="trace-data">{data}</script>
<script type="application/json" id="colours">{json.dumps(COLOURS)}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def write_html(trace: SearchTrace, path: str | Path, example: int = 0, title: str | None = None) -> Path:
    """Write :func:`render`'s page to ``path``; returns the path."""
    path = Path(path)
    path.write_text(render(trace, example, title), encoding="utf-8")
    return path


def _path_text(nodes: list[dict[str, Any]], node: dict[str, Any]) -> str:
    """The tokens (text where labelled) from the root to ``node``."""
    parts = []
    while node["parent"] is not None:
        parts.append(node["text"] if node.get("text") is not None else str(node["token"]))
        node = nodes[node["parent"]]
    return " ".join(reversed(parts))
