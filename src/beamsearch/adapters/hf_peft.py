"""PEFT models (``peft.PeftModel``): decoded as their own ``generate`` decodes them.

For the methods that put their layers into the model (LoRA and its variants, IA3, LoHa, LoKr, ...),
``PeftModel.generate`` is the base model's ``generate`` with the adapter layers in place (``get_base_model()``: the
transformers model whose modules PEFT replaced): so is ours. Which step runs it is the gate's business
(``steps/gate.py``): a step that calls the adapted modules as modules honours them, one that computes them itself
from their weights steps aside. Merged adapters (``merge_adapter``, ``merge_and_unload``) change the weights in place
or give a plain model; the fast step's packed weights follow (``WeightStamp``).

Refused, by name: the prompt-learning methods (prompt tuning, prefix tuning, P-tuning, ...), whose ``generate``
prepends virtual tokens or a learned cache; a batch of mixed adapters (``adapter_names=``) and activated LoRA
(aLoRA), whose per-row adapter choice is made by hooks on the rows ``generate`` runs.
"""

from __future__ import annotations

import sys
from typing import Any

# the arguments of PeftModel.generate that pick adapters per row (PeftModel.special_peft_forward_args)
_PER_ROW_ARGUMENTS = ("adapter_names", "alora_offsets")


def base_model(model: Any, kwargs: dict[str, Any]) -> Any:
    """The model to decode for ``model``: itself, or for a ``PeftModel`` the base model with its adapter layers.

    Raises:
        ValueError: a PEFT method or argument whose ``generate`` does more than run the adapted model (named).
    """
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    config = model.active_peft_config
    method = getattr(config.peft_type, "value", config.peft_type)
    if config.is_prompt_learning:
        raise ValueError(f"a PeftModel with the prompt-learning method {method} is not supported: its generate adds "
                         f"virtual tokens that beamsearch does not reproduce; use model.generate, or a method that "
                         f"adapts the model's layers (LoRA, IA3, ...)")
    for name in _PER_ROW_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise ValueError(f"PeftModel argument {name!r} (adapters chosen per row) is not supported: decode the rows "
                             f"of each adapter in their own call (model.set_adapter)")
    if getattr(config, "alora_invocation_tokens", None):
        raise ValueError("a PeftModel with activated LoRA (alora_invocation_tokens) is not supported: its adapter "
                         "applies from a position generate finds per row")
    return model.get_base_model()
