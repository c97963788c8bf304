"""The base model's names of a model with peft's adapters in it, standing alone: the families'
Hugging Face adapters read a model's base state by them (``llama/hf.py``,
``moe/state_dict_adapter.py``) without importing LoRA itself (``models/lora.py``)."""

from __future__ import annotations

from typing import Any

from torch import nn

# The parts of a parameter name that peft gives an adapter's own tensors.
ADAPTER_PARTS = frozenset(
    {"lora_A", "lora_B", "lora_magnitude_vector", "lora_embedding_A", "lora_embedding_B"}
)


def base_name(name: str) -> str | None:
    """The base model's name of a parameter of a model with peft's adapters in it
    (``wq.base_layer.weight`` -> ``wq.weight``); None for an adapter's own parameter. Names
    outside the wrapped layers come back as they are."""
    parts = name.split(".")
    if ADAPTER_PARTS.intersection(parts):
        return None
    return ".".join(p for p in parts if p != "base_layer")


def base_state(model: nn.Module, *, keep_vars: bool = False) -> dict[str, Any]:
    """The state dict of the base model under its own names: with peft's adapters in it
    (model.lora), a wrapped layer's ``base_layer`` is named as the layer was, and the adapters'
    own tensors, which no Hugging Face model folder holds, are left out."""
    state = {}
    for name, value in model.state_dict(keep_vars=keep_vars).items():
        base = base_name(name)
        if base is not None:
            state[base] = value
    return state


__all__ = ["ADAPTER_PARTS", "base_name", "base_state"]
