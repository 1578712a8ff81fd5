"""beamsearch: vectorized beam search, greedy search and sampling for any PyTorch sequence model.

Public names only; see the README and docs/usage.md for examples.
"""

from .engine import search
from .ensemble import ensemble_step
from .errors import SearchError
from .options import SearchOptions
from .quantize import quantize_int8
from .results import FinishReason, SearchResult
from .streaming import StreamEvent, stream

__all__ = [
    "FinishReason", "SearchError", "SearchOptions", "SearchResult", "StreamEvent", "ensemble_step", "generate",
    "quantize_int8", "search", "stream",
]
__version__ = "0.1.0"


def generate(model, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None, **kwargs):
    """Drop-in for ``model.generate(...)`` on Hugging Face models (needs ``beamsearch[hf]``).

    See :func:`beamsearch.adapters.hf.generate`.
    """
    from .adapters.hf import generate as hf_generate

    return hf_generate(model, inputs, generation_config, logits_processor, stopping_criteria, **kwargs)
