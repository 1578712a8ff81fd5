"""Logits processors with the semantics of Hugging Face ``transformers`` (5.x), and their pipeline.

Each processor is called as ``processor(input_ids [N, t], scores [N, V]) -> scores [N, V]`` (N rows,
V vocabulary, t tokens so far) and never modifies its inputs in place, so these and Hugging Face's
processors are interchangeable. :func:`build_processors` builds the list ``generate`` would build.
"""

from .allowed import PrefixConstrainedLogitsProcessor
from .base import LogitsProcessor
from .encoder import EncoderNoRepeatNGramLogitsProcessor, EncoderRepetitionPenaltyLogitsProcessor
from .masks import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from .ngrams import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor
from .numerics import InfNanRemoveLogitsProcessor, LogitNormalization
from .penalties import RepetitionPenaltyLogitsProcessor
from .pipeline import ProcessorList, build_processors
from .siblings import SiblingDiversityLogitsProcessor
from .warpers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

__all__ = [
    "EncoderNoRepeatNGramLogitsProcessor",
    "EncoderRepetitionPenaltyLogitsProcessor",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
    "LogitsProcessor",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "PrefixConstrainedLogitsProcessor",
    "MinPLogitsWarper",
    "NoBadWordsLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "ProcessorList",
    "RepetitionPenaltyLogitsProcessor",
    "SiblingDiversityLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor",
    "SuppressTokensLogitsProcessor",
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TypicalLogitsWarper",
    "build_processors",
]
