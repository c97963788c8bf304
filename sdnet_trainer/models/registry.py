"""Build a model from ``ModelConfig``: a name, a class count, and a few adaptations."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable

import torchvision
from torch import nn

from sdnet_trainer.config.schema import ModelConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.simple_cnn import SimpleCNN

logger = logging.getLogger(__name__)

# The project's own models: name -> constructor(num_classes=..., **kwargs).
OWN_MODELS: dict[str, Callable[..., nn.Module]] = {"simple_cnn": SimpleCNN}


def available_models() -> list[str]:
    return sorted(OWN_MODELS) + torchvision.models.list_models(module=torchvision.models)


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.name in OWN_MODELS:
        if cfg.weights is not None:
            raise ConfigError(f"model.weights={cfg.weights!r}: model.name={cfg.name!r} has no pretrained weights")
        model = OWN_MODELS[cfg.name](num_classes=cfg.num_classes, **cfg.kwargs)
    else:
        model = _torchvision_model(cfg)
    if cfg.cifar_stem:
        _use_cifar_stem(model, cfg.name)
    return model


def _torchvision_model(cfg: ModelConfig) -> nn.Module:
    names = torchvision.models.list_models(module=torchvision.models)
    if cfg.name not in names:
        close = difflib.get_close_matches(cfg.name, available_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"model.name={cfg.name!r} is not in the model registry{hint}")
    try:
        # weights=None builds a randomly initialised model; a weights name loads (and on first use
        # downloads) torchvision's pretrained checkpoint, whose head must match num_classes.
        return torchvision.models.get_model(cfg.name, weights=cfg.weights, num_classes=cfg.num_classes,
                                            **cfg.kwargs)
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"model.name={cfg.name!r} with model.weights={cfg.weights!r}, "
                          f"model.num_classes={cfg.num_classes}, model.kwargs={dict(cfg.kwargs)}: {err}") from err


def _use_cifar_stem(model: nn.Module, name: str) -> None:
    """3x3 stride-1 first conv and no max-pool: 32x32 inputs keep their resolution into layer1."""
    conv1 = getattr(model, "conv1", None)
    if not isinstance(conv1, nn.Conv2d) or not hasattr(model, "maxpool"):
        raise ConfigError(f"model.cifar_stem=true needs a ResNet-style model (conv1 + maxpool); "
                          f"model.name={name!r} has none")
    model.conv1 = nn.Conv2d(conv1.in_channels, conv1.out_channels, kernel_size=3, stride=1, padding=1,
                            bias=False)
    model.maxpool = nn.Identity()
