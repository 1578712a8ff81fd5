"""The library's own error types."""

from __future__ import annotations


class SearchError(ValueError):
    """A search that cannot go on with what the model returned: the scores of a step hold NaN, every token of a
    row that must be sampled is masked, or there are more beams than tokens. The message names the step and the
    example (or the options) at fault."""
