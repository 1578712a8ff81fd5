"""How user processors and stopping criteria merge with the built-in ones (Hugging Face's rule)."""

from __future__ import annotations

import sys
from typing import Any


def counterpart(ours: type) -> type | None:
    """The Hugging Face class our class ``ours`` mirrors (transformers exports it under the same name), if
    transformers is already imported; the core never imports it."""
    return foreign_class("transformers", ours.__name__)


def foreign_class(module: str, name: str) -> type | None:
    """A class of an optional package, only if that package is already imported (a caller's object of that
    class cannot exist otherwise)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def same_kind(custom: Any, default: Any) -> bool:
    """Whether a user item replaces a built-in one: same type, or the Hugging Face class ours mirrors."""
    if type(custom) is type(default):
        return True
    theirs = counterpart(type(default))
    return theirs is not None and isinstance(custom, theirs)


def merge_user_items(defaults: list[Any], custom: list[Any]) -> list[Any]:
    """As HF's ``_merge_criteria_processor_list``: same-kind user items replace built-ins in place, the rest follow."""
    if not custom:
        return defaults
    merged = [next((c for c in custom if same_kind(c, d)), d) for d in defaults]
    merged += [c for c in custom if c not in merged]  # membership as in HF (identity, or __eq__ if defined)
    return merged
