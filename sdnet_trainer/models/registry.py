"""The registry of models by ``model.name``: the model families, this project's own small
classifiers, and torchvision's (``models/build.py`` builds them; ``models/families.py`` registers
the built-in families).

The registry is data, and holds no family of its own: :data:`FAMILIES` maps ``model.name`` to
each family's entry (``models/family.py``'s ``ModelFamily``: its builder, validator, Hugging Face
adapter, serving cache), and set-up, preflight, the dry run, export and serving ask
:func:`model_family` instead of branching on names. A family of your own: :func:`register_family`
from the module of the Trainer subclass your config names (docs/subclassing.md). Classifiers take
``model.num_classes``; the language families take their sizes from their own section
(``model.gpt``, ``model.llama``, ``model.moe``, a Hugging Face config.json).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from sdnet_trainer.config.schema import ModelConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.family import FolderReader, ModelFamily
from sdnet_trainer.models.hf_folder import hf_weights_folder
from sdnet_trainer.models.simple_cnn import SimpleCNN

logger = logging.getLogger(__name__)

# The project's own classifiers: name -> constructor(num_classes=..., **kwargs).
OWN_MODELS: dict[str, Callable[..., nn.Module]] = {"simple_cnn": SimpleCNN}

# The model families, by model.name: one entry each.
FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` under its name (registering the same entry again is a no-op)."""
    taken = FAMILIES.get(family.name)
    if taken is not None and taken is not family:
        raise ConfigError(f"model family {family.name!r} is registered already")
    if family.name in OWN_MODELS:
        raise ConfigError(f"model.name={family.name!r} names one of the project's classifiers")
    FAMILIES[family.name] = family
    return family


def model_family(name: str) -> ModelFamily | None:
    """The family registered under ``model.name``; None for a classifier."""
    return FAMILIES.get(name)


def hf_weights_reader(cfg: ModelConfig) -> FolderReader | None:
    """The family's reader of ``model.weights=hf:PATH`` (``ModelFamily.hf_weights``) bound to the
    folder; None without such weights, or where the family's builder reads them itself (a
    transformers model)."""
    family, folder = model_family(cfg.name), hf_weights_folder(cfg.weights)
    if family is None or family.hf_weights is None or folder is None:
        return None
    weights = family.hf_weights
    return FolderReader(
        check=lambda model: weights.check(model, folder),
        load=lambda model: weights.load(model, folder),
    )


def available_models() -> list[str]:
    import torchvision  # here, not at the top: only runs that name its models need it (lazy.py)

    return sorted([*OWN_MODELS, *FAMILIES]) + torchvision.models.list_models(
        module=torchvision.models
    )


def decoder_sizes(cfg: ModelConfig) -> tuple[int, int] | None:
    """(width, layer count) of a decoder language model's config; None for other models."""
    family = model_family(cfg.name)
    if family is None or family.decoder_sizes is None:
        return None
    return family.decoder_sizes(cfg)


__all__ = [
    "FAMILIES",
    "OWN_MODELS",
    "available_models",
    "decoder_sizes",
    "hf_weights_reader",
    "model_family",
    "register_family",
]
