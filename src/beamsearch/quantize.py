"""Opt-in int8: dynamic quantization of a model's linear layers (CPU).

Weights of every ``nn.Linear`` are stored as int8 (per-tensor scale); activations are quantized on the fly at
each matrix product. This is PyTorch's own eager-mode dynamic quantization (``torch.ao.quantization``), which
PyTorch has deprecated in favour of the separate ``torchao`` package but still ships; its warnings are silenced
here. The search is unchanged: the quantized model is decoded like any other, so results equal transformers'
``generate`` on the same quantized model, and differ from the float32 model's by the quantization error
(measured on the G2P test set, docs/advanced.md).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch


def quantize_int8(model: Any) -> Any:
    """A copy of ``model`` (left unchanged) whose linear layers run in int8 on the CPU.

    Raises:
        ValueError: the model is not on the CPU, or this PyTorch has no dynamic quantization.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"quantize_int8 needs a torch.nn.Module, got {type(model).__name__}")
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        raise ValueError(f"int8 dynamic quantization runs on the CPU only; the model is on {sorted(devices)}")
    quantize = getattr(getattr(torch, "ao", None), "quantization", None)
    if quantize is None or not hasattr(quantize, "quantize_dynamic"):
        raise ValueError(f"this PyTorch ({torch.__version__}) has no torch.ao.quantization.quantize_dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notices of torch.ao.quantization
        quantized = quantize.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    return quantized.eval()
