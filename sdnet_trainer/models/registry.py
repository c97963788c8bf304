"""Build a model from ``ModelConfig``: a name, a class count, and a few adaptations.

Classifiers take ``model.num_classes``; the language models take their sizes from ``model.gpt``
or ``model.llama`` instead (the vocabulary is the class count), so they have paths of their own.
A Llama's sizes may also come from a Hugging Face config.json (``model.hf_config``, or the folder
of ``model.weights=hf:PATH``, whose weights the Trainer loads into each rank's shards).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from sdnet_trainer.config.schema import ModelConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.gpt import GPT
from sdnet_trainer.models.hf_causal_lm import HF_CAUSAL_LM, build_hf_causal_lm
from sdnet_trainer.models.hf_llama import hf_weights_folder, llama_sizes_from_hf, read_hf_config
from sdnet_trainer.models.init import REPLACED_STEM, ZERO_INIT_RESIDUAL
from sdnet_trainer.models.llama import Llama
from sdnet_trainer.models.simple_cnn import SimpleCNN

logger = logging.getLogger(__name__)

# The project's own models: name -> constructor(num_classes=..., **kwargs).
OWN_MODELS: dict[str, Callable[..., nn.Module]] = {"simple_cnn": SimpleCNN}

# The language models, configured by model.gpt / model.llama rather than model.num_classes.
GPT_NAME = "gpt"
LLAMA_NAME = "llama"


def available_models() -> list[str]:
    import torchvision  # here, not at the top: only runs that name its models need it (lazy.py)

    return sorted(
        [*OWN_MODELS, GPT_NAME, LLAMA_NAME, HF_CAUSAL_LM]
    ) + torchvision.models.list_models(module=torchvision.models)


def build_model(cfg: ModelConfig) -> nn.Module:
    model: nn.Module
    if cfg.name == GPT_NAME:
        model = _gpt_model(cfg)
    elif cfg.name == LLAMA_NAME:
        model = Llama(**llama_sizes(cfg))
    elif cfg.name == HF_CAUSAL_LM:
        model = build_hf_causal_lm(cfg)
    elif cfg.name in OWN_MODELS:
        if cfg.weights is not None:
            raise ConfigError(
                f"model.weights={cfg.weights!r}: model.name={cfg.name!r} has no pretrained weights"
            )
        model = OWN_MODELS[cfg.name](num_classes=_num_classes(cfg), **cfg.kwargs)
    else:
        model = _torchvision_model(cfg)
    if cfg.cifar_stem:
        _use_cifar_stem(model, cfg.name)
    return model


def _num_classes(cfg: ModelConfig) -> int:
    if cfg.num_classes is None:
        # The Trainer fills it in from the data before building (data.resolve_num_classes).
        raise ConfigError(
            f"model.num_classes is not set for model.name={cfg.name!r}: the Trainer takes the "
            f"class count from the data (or data.num_classes); to build the model by hand, pass "
            f"it: compose([..., 'model.num_classes=10']), or set cfg.model.num_classes before "
            f"build_model(cfg.model)"
        )
    return cfg.num_classes


def _gpt_model(cfg: ModelConfig) -> GPT:
    """``GPT(**model.gpt)``, with ``model.kwargs`` overriding single sizes."""
    if cfg.weights is not None:
        raise ConfigError(
            f"model.weights={cfg.weights!r}: model.name={cfg.name!r} has no pretrained weights"
        )
    sizes = _as_dict(cfg.gpt)
    # The schema rejects unknown keys in model.gpt, but model.kwargs is a free-form dict.
    unknown = sorted(set(cfg.kwargs) - set(sizes))
    if unknown:
        raise ConfigError(
            f"model.kwargs has {unknown}, which model.name={cfg.name!r} does not take; "
            f"it takes the keys of model.gpt: {', '.join(sizes)}"
        )
    return GPT(**{**sizes, **cfg.kwargs})


def llama_sizes(cfg: ModelConfig) -> dict[str, Any]:
    """The Llama's constructor arguments: from the Hugging Face config.json of
    ``model.weights=hf:PATH`` or ``model.hf_config``, else ``model.llama``; ``model.kwargs``
    overrides single ones."""
    folder = hf_weights_folder(cfg.weights)
    if cfg.weights is not None and folder is None:
        raise ConfigError(
            f"model.weights={cfg.weights!r}: model.name={cfg.name!r} loads Hugging Face "
            f"checkpoints only, as model.weights=hf:PATH (a local folder)"
        )
    if folder is not None and cfg.hf_config is not None:
        raise ConfigError(
            f"model.weights={cfg.weights!r} brings its own config.json; leave model.hf_config "
            f"(={cfg.hf_config!r}) unset"
        )
    source = cfg.hf_config if folder is None else folder
    if source is not None:
        key = "model.hf_config" if folder is None else "model.weights"
        config = read_hf_config(source, key=key)
        sizes = llama_sizes_from_hf(config, source=f"{key}={source}")
    else:
        sizes = _as_dict(cfg.llama)
        sizes["rope_scaling"] = _as_dict(sizes["rope_scaling"])
    unknown = sorted(set(cfg.kwargs) - set(sizes))
    if unknown:
        raise ConfigError(
            f"model.kwargs has {unknown}, which model.name={cfg.name!r} does not take; "
            f"it takes the keys of model.llama: {', '.join(sizes)}"
        )
    return {**sizes, **cfg.kwargs}


def decoder_sizes(cfg: ModelConfig) -> tuple[int, int] | None:
    """(width, layer count) of a decoder language model's config; None for other models."""
    if cfg.name == GPT_NAME:
        sizes = {**_as_dict(cfg.gpt), **cfg.kwargs}
    elif cfg.name == LLAMA_NAME:
        sizes = llama_sizes(cfg)
    else:
        return None
    return int(sizes["dim"]), int(sizes["n_layers"])


def _as_dict(section: Any) -> dict[str, Any]:
    # The schema's dataclass normally; a DictConfig or dict when a caller builds the config by hand.
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.asdict(section)
    return dict(section)


def _torchvision_model(cfg: ModelConfig) -> nn.Module:
    import torchvision  # as in available_models

    names = torchvision.models.list_models(module=torchvision.models)
    if cfg.name not in names:
        close = difflib.get_close_matches(cfg.name, available_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"model.name={cfg.name!r} is not in the model registry{hint}")
    try:
        # weights=None builds a randomly initialised model; a weights name loads (and on first use
        # downloads) torchvision's pretrained checkpoint, whose head must match num_classes.
        model = torchvision.models.get_model(
            cfg.name, weights=cfg.weights, num_classes=_num_classes(cfg), **cfg.kwargs
        )
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(
            f"model.name={cfg.name!r} with model.weights={cfg.weights!r}, "
            f"model.num_classes={cfg.num_classes}, model.kwargs={dict(cfg.kwargs)}: {err}"
        ) from err
    if cfg.kwargs.get("zero_init_residual"):
        # Kept for the init replayed after building on the meta device (models/init.py).
        setattr(model, ZERO_INIT_RESIDUAL, True)
    return model


def _use_cifar_stem(model: nn.Module, name: str) -> None:
    """3x3 stride-1 first conv and no max-pool: 32x32 inputs keep their resolution into layer1."""
    conv1 = getattr(model, "conv1", None)
    if not isinstance(conv1, nn.Conv2d) or not hasattr(model, "maxpool"):
        raise ConfigError(
            f"model.cifar_stem=true needs a ResNet-style model (conv1 + maxpool); "
            f"model.name={name!r} has none"
        )
    # What was removed, for the init replayed after building on the meta device (models/init.py).
    setattr(
        model,
        REPLACED_STEM,
        {
            "in_channels": conv1.in_channels,
            "out_channels": conv1.out_channels,
            "kernel_size": conv1.kernel_size,
            "stride": conv1.stride,
            "padding": conv1.padding,
            "bias": conv1.bias is not None,
        },
    )
    model.conv1 = nn.Conv2d(
        conv1.in_channels, conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False
    )
    model.maxpool = nn.Identity()
