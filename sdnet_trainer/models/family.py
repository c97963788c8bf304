"""A model family as data: what the rest of the project asks of a model, by ``model.name``.

A family is a folder (or a module) holding its model, its Hugging Face adapter, its validator and
its serving cache, and one :class:`ModelFamily` that names them; ``models/registry.py`` lists the
project's families. Set-up, the preflight checks, the dry run, export and serving ask the family
instead of branching on names, so adding a family is adding its folder and one registry entry
(or, from outside the package, one :func:`~sdnet_trainer.models.registry.register_family` call in
the module of a Trainer subclass the config names: docs/subclassing.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from sdnet_trainer.config.schema import ModelConfig
from sdnet_trainer.errors import ConfigError


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face side: ``format=hf`` writes ``tensors(model)`` (Hugging Face's
    names, a tied tensor once: the family's state-dict adapter, whose names ``model.weights=hf:``
    reads too) through DCP's Hugging Face writer, and ``config(model, dtype)`` as config.json."""

    tensors: Callable[[nn.Module], dict[str, torch.Tensor]]
    config: Callable[[nn.Module, torch.dtype], dict[str, Any]]


@dataclass(frozen=True)
class HFWeights:
    """A family's reader of ``model.weights=hf:PATH`` into the Trainer's meta build:
    ``check(model, folder)`` compares the model built on the meta device with what the folder's
    files declare, before anything is allocated (a ConfigError naming the tensor and the file);
    ``load(model, folder)`` fills the parameters this rank holds, after sharding (checked again,
    then read by DCP's Hugging Face reader into the family's state-dict adapter's view of the
    model: ``models/hf_folder.py``'s ``read_folder``)."""

    check: Callable[[nn.Module, Path], object]
    load: Callable[[nn.Module, Path], None]


@dataclass(frozen=True)
class LoRATargets:
    """What ``model.lora`` (``models/lora.py``) asks of a family. ``modules``: the layers peft's
    adapters may wrap, as (Hugging Face's module name, the family's), e.g. (``q_proj``,
    ``attn.wq``): ``model.lora.target_modules`` is written in Hugging Face's names, and
    ``all-linear`` takes every one. ``hf_name``: the family's parameter name -> Hugging Face's,
    through which adapters are written as a peft folder for ``transformers`` and read from one.
    ``root``: the submodule that is a ``transformers`` model whose own names are Hugging Face's
    (``hf_causal_lm``'s ``lm``): the adapters go into it, and its names (and ``all-linear``) go
    to peft as they are, with no ``modules`` or ``hf_name``."""

    modules: tuple[tuple[str, str], ...] = ()
    hf_name: Callable[[str], str] | None = None
    root: str = ""


class FolderReader(NamedTuple):
    """A family's :class:`HFWeights` bound to the folder of ``model.weights=hf:PATH``."""

    check: Callable[[nn.Module], object]
    load: Callable[[nn.Module], None]


@dataclass(frozen=True)
class ModelFamily:
    """One family's entries; every entry but the name and the builder is optional."""

    name: str  # model.name
    build: Callable[[ModelConfig], nn.Module]  # the bare model from model.*
    # Token ids in, (batch, time, vocab) logits out: serving decodes text for it.
    language: bool = False
    # model.* against the data and the layout, before launch: validate(cfg, tp=..., pp=...).
    validate: Callable[..., None] | None = None
    # (width, layer count) of a decoder, from model.* (the dry run's activation estimate).
    decoder_sizes: Callable[[ModelConfig], tuple[int, int]] | None = None
    hf: HFAdapter | None = None  # format=hf export
    # model.weights=hf:PATH read after sharding (None: the builder reads the weights itself).
    hf_weights: HFWeights | None = None
    # Its attention can be split over context-parallel ranks (parallel.cp).
    context_parallel: bool = False
    # A mixture of experts: its expert count from model.* (parallel.ep splits the experts).
    num_experts: Callable[[ModelConfig], int] | None = None
    # model.lora: the layers its adapters may wrap, in Hugging Face's names (None: no LoRA).
    lora: LoRATargets | None = None
    # Serving: a model with a KV cache that shares the served model's tensors (None: none).
    generation_model: Callable[[nn.Module], nn.Module | None] | None = None


def config_dict(section: Any) -> dict[str, Any]:
    """A config section as a plain dict: the schema's dataclass normally; a DictConfig or dict
    when a caller builds the config by hand."""
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.asdict(section)
    return dict(section)


def check_kwargs(cfg: ModelConfig, sizes: dict[str, Any], section: str) -> None:
    """``model.kwargs`` (free-form) may override only the keys of the family's sizes."""
    unknown = sorted(set(cfg.kwargs) - set(sizes))
    if unknown:
        raise ConfigError(
            f"model.kwargs has {unknown}, which model.name={cfg.name!r} does not take; "
            f"it takes the keys of {section}: {', '.join(sizes)}"
        )


__all__ = [
    "FolderReader",
    "HFAdapter",
    "HFWeights",
    "LoRATargets",
    "ModelFamily",
    "check_kwargs",
    "config_dict",
]
