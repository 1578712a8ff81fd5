"""Every way a model step runs, one folder per architecture family, with the one chooser and the one gate.

- ``chooser.py``: which step runs a call (eager: fast, lean or generic; captured: graph-safe or refused by name),
  asking the gate first;
- ``gate.py``: whether a specialized step still computes what the model's own modules compute (classes, hooks,
  patched forwards, copied weights);
- ``generic.py``: the generic step, ``model(...)`` with transformers' cache, for any Hugging Face model;
- ``t5/``: ``lean.py`` (the model's modules called on the step's rows), ``fast.py`` with ``packed.py`` (its own
  products over packed weights, CPU float32 and int8), ``graph.py`` (graph-safe, a static cache);
- ``gpt2/``, ``llama/`` (Llama, Qwen2, Mistral): ``lean.py`` and ``graph.py``;
- shared: ``lean_decoder.py`` (the decoder-only lean steps' prompt prefill and loop), ``graph_decoder.py`` (the
  graph-safe decoder-only steps' prompt copied into the static cache), ``caches.py`` (the time-major and static
  caches), ``attention.py`` (an example's rows attending to its keys in one call), ``padding.py`` (the graph path's
  bucket places filled with the last example).

Imports run one way: ``adapters`` and ``graphs`` import from here; nothing here imports them. The private
transformers helpers every part uses are in ``beamsearch.hf_compat``. docs/steps.md: how a step is chosen, and how to
add an architecture.
"""
