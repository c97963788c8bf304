"""The Llama's state-dict adapter: its tensors under Hugging Face's ``LlamaForCausalLM`` names,
each value the model's own tensor, for ``model.weights=hf:PATH`` to read into and for
``format=hf`` to write.

This project's :class:`~sdnet_trainer.models.llama.Llama` uses the rotary layout of
``transformers`` (``rotate_half``), so the query and key projections are stored as they are, with
no permutation: only the names differ (:data:`HF_NAMES`, kept as data). A tied output layer is
the embedding, stored once under the embedding's name (transformers ties it back) and so read
once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from sdnet_trainer.models.hf_folder import HFState

# This project's parameter names -> Hugging Face LlamaForCausalLM's ({i}: the layer).
HF_NAMES: tuple[tuple[str, str], ...] = (
    ("embed.tok.weight", "model.embed_tokens.weight"),
    ("blocks.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
    ("blocks.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("blocks.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("blocks.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("blocks.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("blocks.{i}.norm2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("blocks.{i}.mlp.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("blocks.{i}.mlp.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("blocks.{i}.mlp.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
)


class NameMap:
    """This project's parameter names <-> a Hugging Face model's, from (ours, theirs) templates
    (``{i}``: the layer); a name no template matches translates to None."""

    def __init__(self, pairs: Iterable[tuple[str, str]]) -> None:
        pairs = tuple(pairs)
        self._to_hf = [(_pattern(ours), hf) for ours, hf in pairs]
        self._from_hf = [(_pattern(hf), ours) for ours, hf in pairs]

    def to_hf(self, name: str) -> str | None:
        return _translate(name, self._to_hf)

    def from_hf(self, name: str) -> str | None:
        return _translate(name, self._from_hf)


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


def _translate(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.group(1)) if match.groups() else template
    return None


_NAMES = NameMap(HF_NAMES)


def to_hf_name(name: str) -> str:
    hf = _NAMES.to_hf(name)
    if hf is None:
        raise KeyError(f"{name} has no Hugging Face Llama name")
    return hf


def from_hf_name(name: str) -> str | None:
    """This project's name for a Hugging Face Llama tensor name (None: not a Llama weight)."""
    return _NAMES.from_hf(name)


def to_hf(state: Mapping[str, torch.Tensor], *, tied: bool) -> HFState:
    """``state`` (the Llama's, or this rank's part of it: DTensors under FSDP2 or tensor
    parallelism, plain tensors otherwise) under Hugging Face's names, each value the same tensor;
    with ``tied`` the output layer is left out (the embedding's values, stored once)."""
    return HFState(
        {
            to_hf_name(name): value
            for name, value in state.items()
            if not (tied and name == "head.weight")
        }
    )


__all__ = ["HF_NAMES", "NameMap", "from_hf_name", "to_hf", "to_hf_name"]
