"""A :class:`SearchResult` viewed as the output class ``model.generate`` returns.

Legend: B batch, n returned hypotheses per example, T total length, T' generated positions.
"""

from __future__ import annotations

from typing import Any

import torch

from ..beams import flatten_beams
from ..options import SearchOptions
from ..results import SearchResult


def to_hf_output(model: Any, config: Any, options: SearchOptions, result: SearchResult) -> Any:
    """The sequences tensor ``[B*n, T]``, or with ``return_dict_in_generate`` the matching output class."""
    sequences = flatten_beams(result.sequences)  # [B*n, T]
    if not config.return_dict_in_generate:
        return sequences
    from transformers.generation.utils import (
        GenerateBeamDecoderOnlyOutput,
        GenerateBeamEncoderDecoderOutput,
        GenerateDecoderOnlyOutput,
        GenerateEncoderDecoderOutput,
    )

    encoder_decoder = model.config.is_encoder_decoder
    fields: dict[str, Any] = {"sequences": sequences, "scores": result.scores, "logits": result.logits}
    if options.num_beams > 1:
        output_class = GenerateBeamEncoderDecoderOutput if encoder_decoder else GenerateBeamDecoderOnlyOutput
        fields["sequences_scores"] = flatten_beams(result.sequences_scores) if config.output_scores else None
        fields["beam_indices"] = flatten_beams(result.beam_indices).to(torch.int32)  # [B*n, T']
    else:
        output_class = GenerateEncoderDecoderOutput if encoder_decoder else GenerateDecoderOnlyOutput
    return output_class(**fields)
