"""How user processors and stopping criteria merge with the built-in ones (Hugging Face's rule)."""

from __future__ import annotations

from typing import Any


def same_kind(custom: Any, default: Any) -> bool:
    """Whether a user item replaces a built-in one: same type, or the Hugging Face class of that name."""
    kind = type(custom)
    if kind is type(default):
        return True
    return kind.__name__ == type(default).__name__ and kind.__module__.startswith("transformers.")


def merge_user_items(defaults: list[Any], custom: list[Any]) -> list[Any]:
    """As HF's ``_merge_criteria_processor_list``: same-kind user items replace built-ins in place, the rest follow."""
    if not custom:
        return defaults
    merged = [next((c for c in custom if same_kind(c, d)), d) for d in defaults]
    merged += [c for c in custom if c not in merged]  # membership as in HF (identity, or __eq__ if defined)
    return merged
