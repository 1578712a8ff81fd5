"""The library's own error types."""

from __future__ import annotations


class SearchError(ValueError):
    """A search that cannot go on with what the model returned: the scores of a step hold NaN, every token of a
    row that must be sampled is masked, or there are more beams than tokens. The message names the step and the
    example (or the options) at fault."""

    def __init__(self, message: str, step: int | None = None, example: int | None = None):
        super().__init__(message)
        self.step = step  # the step at fault, where one is
        self.example = example  # the batch index of the example at fault, where one is

    def shifted(self, offset: int) -> SearchError:
        """The same error for an example ``offset`` rows further in a larger batch (``max_rows`` sub-batches)."""
        if self.example is None:
            return self
        message = str(self).replace(f"(example {self.example})", f"(example {self.example + offset})")
        return SearchError(message, self.step, self.example + offset)
