"""The CUDA-graph decoding path (``beamsearch.generate(..., cuda_graphs=True)``): one whole decoding step, fixed
shapes and no host synchronisation, captured once per row bucket and replayed.

- ``buckets.py``: the batch padded to a few example counts;
- ``static_cache.py``: the self-attention cache, written at a tensor position, never reordered (a parent index);
- ``attention.py``: an example's rows attending to its keys in one call;
- ``t5.py``, ``decoder.py``, ``gpt2.py``, ``llama.py``: the graph-safe model steps;
- ``processors.py``: the length-only processors at a tensor length;
- ``greedy.py``, ``beam.py``, ``search_state.py``: greedy and transformers' beam search over fixed shapes;
- ``runner.py``: the whole step, and its capture and replay;
- ``eligibility.py``: what cannot be captured, refused by name;
- ``driver.py``: the driver that runs a call (the eager path's loop stays ``loop.py``).
"""

from .reuse import release

__all__ = ["release"]
