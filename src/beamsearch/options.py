"""One frozen record of search options, validated once, up front.

Option names and defaults are those of Hugging Face ``GenerationConfig`` so that a user can move
between ``model.generate(**kwargs)`` and ``beamsearch.search(step, ids, **kwargs)`` without renaming
anything. Every option that would change results but is not implemented is rejected by name. Each value is checked
here; the combinations of options are rows of one table (``strategies/validation.py``), walked here for those that
need only the options and again, with the search's arguments, before a strategy is built.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

from .strategies.validation import check_combinations

# Generation options we know of but do not implement; passing a non-default value is an error,
# never a silent no-op.
UNSUPPORTED_OPTIONS: dict[str, tuple] = {
    "constraints": (),
    "penalty_alpha": (0.0,),
    "dola_layers": (),
    "guidance_scale": (1.0,),
    "sequence_bias": (),
    "exponential_decay_length_penalty": (),
    "watermarking_config": (),
    "top_h": (),
    "assistant_model": (),
    "prompt_lookup_num_tokens": (),
    "negative_prompt_ids": (),
    "token_healing": (False,),
    "low_memory": (False,),
    "use_mtp": (False,),
    "assistant_early_exit": (),
    "prefill_chunk_size": (),
}
# Options that are implemented but travel as arguments of beamsearch.search and beamsearch.generate, not in the
# frozen SearchOptions record (callables, per-example lists, hooks): SearchOptions.create says where they go.
SEARCH_ARGUMENTS = (
    "force_words_ids",
    "prefix_allowed_tokens_fn",
    "target_prefix",
    "prefix_bias_beta",
    "sequence_scorer",
    "unique",
    "output_alignments",
)


SEMANTICS = ("hf", "onmt", "t2t", "ct2")
MAX_NODES = 100_000  # exact search's default budget of partial hypotheses per example
# Options beyond transformers' GenerationConfig: other toolkits' and our own (the Hugging Face adapter takes them
# from the call's kwargs).
TOOLKIT_OPTIONS = (
    "semantics",
    "length_penalty_type",
    "coverage_penalty",
    "coverage_beta",
    "stepwise_penalty",
    "patience",
    "ratio",
    "max_length_ratio",
    "max_len_a",
    "max_len_b",
    "block_ngram_repeat",
    "ignore_when_blocking",
    "remove_finished",
    "stochastic_beam_search",
    "exact_search",
    "max_nodes",
    "loop_guard",
    "hf_release",
)
# What each semantics preset sets for the options the caller leaves unset (None): that toolkit's defaults.
PRESETS: dict[str, dict[str, Any]] = {
    "hf": {},
    "t2t": {"length_penalty": 0.6, "early_stopping": True},
    "onmt": {
        "num_beams": 5, "length_penalty": 1.0, "length_penalty_type": "avg", "max_new_tokens": 250,
        "max_length_ratio": 1.25,
    },
    "ct2": {"num_beams": 2, "length_penalty": 1.0, "patience": 1.0, "max_new_tokens": 256, "min_new_tokens": 1},
}
# Preset entries that only make sense with an end-of-sequence token (skipped without one).
_PRESET_NEEDS_EOS = {"min_new_tokens"}
LENGTH_PENALTY_TYPES = ("hf", "wu", "gnmt", "avg", "none")


def is_neutral(name: str, value: Any) -> bool:
    """Whether an unsupported option holds a value that changes nothing (None or its no-op value)."""
    return value is None or any(value == neutral for neutral in UNSUPPORTED_OPTIONS[name])


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """Every option of a search. Build with :meth:`SearchOptions.create`, which validates.

    Length limits count the start tokens, as in Hugging Face: ``max_length`` is the total length;
    ``max_new_tokens``, when given, wins and is resolved against the prompt length by the loop.
    """

    # length
    max_length: int = 20
    max_new_tokens: int | None = None
    min_length: int = 0
    min_new_tokens: int | None = None
    max_time: float | None = None
    # strategy
    num_beams: int = 1
    do_sample: bool = False
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_beam_groups: int = 1  # diverse beam search (transformers 4.x): beams in G groups, decoded one after another
    diversity_penalty: float = 0.0  # subtracted per earlier-group choice of the same token at the same step
    stochastic_beam_search: bool = False  # num_beams samples without replacement (Kool et al., 2019)
    exact_search: bool = False  # the best hypothesis under the beam score, by branch and bound (strategies/exact.py)
    max_nodes: int = MAX_NODES  # exact search: partial hypotheses expanded per example before it gives up (unproven)
    loop_guard: int = 0  # >= 2: ban the token completing that many back-to-back copies of any n-gram (n <= 4)
    # special tokens
    eos_token_id: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    # processors
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    encoder_repetition_penalty: float = 1.0  # needs the source ids (search(..., encoder_input_ids=))
    encoder_no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] | None = None
    renormalize_logits: bool = False
    remove_invalid_values: bool = False
    # warpers (sampling only)
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    # stopping
    stop_strings: tuple[str, ...] | None = None
    # outputs
    output_scores: bool = False
    output_logits: bool = False
    # speed
    remove_finished: bool = True  # finished examples leave the batch where that changes no result
    # other toolkits' semantics (see the preset table in docs/semantics.md)
    semantics: str = "hf"  # "hf", "onmt", "t2t", "ct2": whose beam search (scoring and stopping) to run
    length_penalty_type: str | None = None  # "hf", "wu" (= "gnmt"), "avg", "none"; None: the preset's
    coverage_penalty: str = "none"  # "none", "wu", "summary" (needs cross-attention from the step)
    coverage_beta: float = 0.0
    stepwise_penalty: bool = False  # OpenNMT: apply the coverage penalty at every step
    patience: float = 1.0  # CTranslate2: search until patience x num_beams hypotheses have finished
    ratio: float = 0.0  # OpenNMT: stop an example by its best score per token against ratio x source length (0: off)
    max_length_ratio: float = 0.0  # OpenNMT: at most int(max_length_ratio * source length + 5) tokens (0: off)
    max_len_a: float = 0.0  # fairseq: at most max_len_a * source_length + max_len_b generated tokens
    max_len_b: int | None = None
    block_ngram_repeat: int = 0  # OpenNMT n-gram blocking (with ignore_when_blocking exclusions)
    ignore_when_blocking: tuple[int, ...] = ()
    # which transformers release semantics="hf" follows where releases differ (docs/usage.md lists where): (major,
    # minor), e.g. (4, 57); None: the newest tested. The Hugging Face adapter sets the installed release.
    hf_release: tuple[int, int] | None = None

    @classmethod
    def create(cls, **kwargs: Any) -> SearchOptions:
        """Build and validate options from Hugging Face-named keyword arguments.

        Raises:
            ValueError: an unknown or unsupported option, or a bad value or combination; the
                message names the option.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        for name, value in kwargs.items():
            if name in SEARCH_ARGUMENTS:
                if value is None:
                    continue
                raise ValueError(f"{name!r} is an argument of beamsearch.search and beamsearch.generate, not a "
                                 f"SearchOptions field: pass it to them as {name}=...")
            if name in UNSUPPORTED_OPTIONS:
                if is_neutral(name, value):
                    continue
                raise ValueError(f"option {name!r} is not supported by beamsearch yet (it would change results)")
            if name not in known:
                raise ValueError(f"unknown option {name!r}")
        values = {k: v for k, v in kwargs.items() if k in known}
        apply_preset(values)
        values = {k: v for k, v in values.items() if v is not None or k in _NULLABLE}
        values = _normalize(values)
        options = cls(**values)
        options.validate()
        return options

    def validate(self) -> None:
        """Reject every bad value and incompatible combination with a message naming the option.

        Each value first, then the combinations: the rows of ``strategies/validation.py``'s table that need only
        the options.
        """
        for name in _FLOAT_OPTIONS:  # first: NaN passes no comparison, so the checks below would name it wrongly
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        _check_int("max_length", self.max_length, minimum=1)
        if self.max_new_tokens is not None:
            _check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        _check_int("min_length", self.min_length, minimum=0)
        if self.min_new_tokens is not None:
            _check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        if self.max_time is not None and not self.max_time > 0:
            raise ValueError(f"max_time must be > 0, got {self.max_time}")
        _check_int("num_beams", self.num_beams, minimum=1)
        _check_int("num_return_sequences", self.num_return_sequences, minimum=1)
        if not isinstance(self.stochastic_beam_search, bool):
            raise ValueError(f"stochastic_beam_search must be True or False, got {self.stochastic_beam_search!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not isinstance(self.remove_finished, bool):
            raise ValueError(f"remove_finished must be True or False, got {self.remove_finished!r}")
        if not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        for name in ("eos_token_id", "suppress_tokens", "begin_suppress_tokens", "forced_eos_token_id"):
            for token in getattr(self, name) or ():
                _check_int(name, token, minimum=0)
        for name in ("pad_token_id", "bos_token_id", "forced_bos_token_id"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        if self.bad_words_ids is not None:
            if not self.bad_words_ids or any(not seq for seq in self.bad_words_ids):
                raise ValueError(f"bad_words_ids must be a non-empty list of non-empty lists, got {self.bad_words_ids}")
            for seq in self.bad_words_ids:
                for token in seq:
                    _check_int("bad_words_ids", token, minimum=0)
        if self.repetition_penalty is None or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, minimum=0)
        if self.encoder_repetition_penalty is None or not self.encoder_repetition_penalty > 0:
            raise ValueError(f"encoder_repetition_penalty must be > 0, got {self.encoder_repetition_penalty}")
        _check_int("encoder_no_repeat_ngram_size", self.encoder_no_repeat_ngram_size, minimum=0)
        self._validate_warpers()
        self._validate_toolkit_options()
        self._validate_groups()
        if self.stop_strings is not None and (not self.stop_strings or any(not s for s in self.stop_strings)):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        check_combinations(self)

    def _validate_toolkit_options(self) -> None:
        if self.semantics not in SEMANTICS:
            raise ValueError(f"semantics must be one of {sorted(SEMANTICS)}, got {self.semantics!r}")
        if self.length_penalty_type is not None and self.length_penalty_type not in LENGTH_PENALTY_TYPES:
            raise ValueError(
                f"length_penalty_type must be one of {sorted(LENGTH_PENALTY_TYPES)}, got {self.length_penalty_type!r}"
            )
        if self.coverage_penalty not in ("none", "wu", "summary"):
            raise ValueError(f"coverage_penalty must be 'none', 'wu' or 'summary', got {self.coverage_penalty!r}")
        if not isinstance(self.coverage_beta, (int, float)) or self.coverage_beta < 0:
            raise ValueError(f"coverage_beta must be a number >= 0, got {self.coverage_beta!r}")
        if not isinstance(self.patience, (int, float)) or not self.patience > 0:
            raise ValueError(f"patience must be > 0, got {self.patience!r}")
        if not isinstance(self.ratio, (int, float)) or self.ratio < 0:
            raise ValueError(f"ratio must be >= 0, got {self.ratio!r}")
        if not isinstance(self.max_length_ratio, (int, float)) or self.max_length_ratio < 0:
            raise ValueError(f"max_length_ratio must be >= 0, got {self.max_length_ratio!r}")
        if not isinstance(self.max_len_a, (int, float)) or self.max_len_a < 0:
            raise ValueError(f"max_len_a must be >= 0, got {self.max_len_a!r}")
        if self.max_len_b is not None:
            _check_int("max_len_b", self.max_len_b, minimum=0)
        _check_int("block_ngram_repeat", self.block_ngram_repeat, minimum=0)
        _check_int("max_nodes", self.max_nodes, minimum=1)
        _check_int("loop_guard", self.loop_guard, minimum=0)
        if self.loop_guard == 1:
            raise ValueError("loop_guard must be 0 (off) or at least 2 (copies of an n-gram that are banned), got 1")
        if not isinstance(self.exact_search, bool):
            raise ValueError(f"exact_search must be True or False, got {self.exact_search!r}")
        for token in self.ignore_when_blocking:
            _check_int("ignore_when_blocking", token, minimum=0)

    def _validate_groups(self) -> None:
        """Diverse beam search's values, and a negative penalty (transformers 4.x ignored it)."""
        _check_int("num_beam_groups", self.num_beam_groups, minimum=1)
        if isinstance(self.diversity_penalty, bool) or not isinstance(self.diversity_penalty, (int, float)):
            raise ValueError(f"diversity_penalty must be a number, got {self.diversity_penalty!r}")
        if not self.diversity_penalty >= 0:
            raise ValueError(f"diversity_penalty must be >= 0, got {self.diversity_penalty!r}")

    def _validate_warpers(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.typical_p <= 1:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not 0 <= self.epsilon_cutoff < 1:
            raise ValueError(f"epsilon_cutoff must be in [0, 1), got {self.epsilon_cutoff}")
        if not 0 <= self.eta_cutoff < 1:
            raise ValueError(f"eta_cutoff must be in [0, 1), got {self.eta_cutoff}")

    def resolved_max_length(self, prompt_length: int) -> int:
        """The total length limit once ``max_new_tokens`` is applied to a prompt of that length."""
        if self.max_new_tokens is not None:
            return prompt_length + self.max_new_tokens
        return self.max_length

    def hf_at_least(self, major: int, minor: int) -> bool:
        """Whether the transformers semantics followed are those of release ``major.minor`` or a later one."""
        return self.hf_release is None or self.hf_release >= (major, minor)

    @property
    def output_fill_token(self) -> int:
        """The token that pads finished and shorter hypotheses in the returned sequences."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        if self.eos_token_id:
            return self.eos_token_id[0]
        return 0


def apply_preset(values: dict[str, Any], skip: Sequence[str] = ()) -> None:
    """Fill the options left unset (None) with the defaults of the chosen semantics' toolkit, in place.

    A length limit given as ``max_length`` keeps the preset's ``max_new_tokens`` out.
    """
    skip = set(skip) | ({"max_new_tokens"} if values.get("max_length") is not None else set())
    for name, value in PRESETS.get(values.get("semantics") or "hf", {}).items():
        if name in skip:
            continue
        if values.get(name) is None and (name not in _PRESET_NEEDS_EOS or values.get("eos_token_id")):
            values[name] = value


_NULLABLE = {f.name for f in dataclasses.fields(SearchOptions) if f.default is None}
# every float option (NaN and +-inf are refused for all of them); the annotations are strings here
_FLOAT_OPTIONS = tuple(f.name for f in dataclasses.fields(SearchOptions) if f.type in ("float", "float | None"))


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _as_tuple(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def _release(value: Any) -> tuple[int, int]:
    """``"5.23"``, ``"5.23.0"``, ``(5, 23)``: the (major, minor) of a transformers release."""
    parts = value.split(".")[:2] if isinstance(value, str) else list(value)[:2] if isinstance(value, Sequence) else ()
    try:
        release = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        release = ()
    if len(release) != 2 or min(release) < 0:
        raise ValueError(f"hf_release must be a transformers release such as '5.23' or (5, 23), got {value!r}")
    return release


def _normalize(values: dict[str, Any]) -> dict[str, Any]:
    """Turn the list-or-int forms Hugging Face accepts into tuples (the record is frozen and hashable)."""
    for name in ("eos_token_id", "suppress_tokens", "begin_suppress_tokens", "forced_eos_token_id"):
        if name in values:
            values[name] = _as_tuple(values[name])
    if "ignore_when_blocking" in values:
        values["ignore_when_blocking"] = _as_tuple(values["ignore_when_blocking"]) or ()
    if values.get("bad_words_ids") is not None:
        words = values["bad_words_ids"]
        if not isinstance(words, Sequence) or isinstance(words, (str, bytes)):
            raise ValueError(f"bad_words_ids must be a list of lists of token ids, got {words!r}")
        values["bad_words_ids"] = tuple(_as_tuple(w) if not isinstance(w, int) else (w,) for w in words)
    if values.get("hf_release") is not None:
        values["hf_release"] = _release(values["hf_release"])
    if isinstance(values.get("stop_strings"), str):
        values["stop_strings"] = (values["stop_strings"],)
    elif values.get("stop_strings") is not None:
        values["stop_strings"] = tuple(values["stop_strings"])
    return values
