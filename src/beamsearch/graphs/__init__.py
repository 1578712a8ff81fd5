"""The CUDA-graph decoding path (``beamsearch.generate(..., cuda_graphs=True)``): one whole decoding step, fixed
shapes and no host synchronisation, captured once per row bucket and replayed.

- ``buckets.py``: the batch padded to a few example counts;
- ``processors.py``: the length-only processors at a tensor length;
- ``greedy.py``, ``beam.py``, ``search_state.py``: greedy and transformers' beam search over fixed shapes;
- ``runner.py``: the whole step, and its capture and replay;
- ``reuse.py``: captured steps kept for later calls of the same shapes;
- ``driver.py``: the driver that runs a call (the eager path's loop stays ``loop.py``).

This package is the search side. The model side, the graph-safe T5, GPT-2 and Llama steps with their static cache
and attention, lives with each family's other steps in ``beamsearch.steps``, whose chooser
(``steps/chooser.py``) refuses by name what cannot be captured and picks the graph-safe step.
"""

from .reuse import release

__all__ = ["release"]
